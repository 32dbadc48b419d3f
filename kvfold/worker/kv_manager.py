"""The seed-compatible facade: KVCacheManager over a KVStatsBackend.

A backend answers two questions about one rank's world: the node's host tier
(`get_host_stats`) and this rank's GPU cache (`get_gpu_stats`, None while the
cache is not bound). The manager turns them into free pages and into the
node's folded utilization, with the host tier counted once per node.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from kvfold.aggregator.fold import fold_node
from kvfold.stats import HostStats, KVStats, RankReport
from kvfold.topology import Topology
from kvfold.view import HostKVUtilization, SourceState
from kvfold.worker.cache import PagedKVCache


@runtime_checkable
class KVStatsBackend(Protocol):
    def get_host_stats(self) -> HostStats | None: ...

    def get_gpu_stats(self) -> KVStats | None: ...


class PagedCacheBackend:
    """A backend over a real PagedKVCache (and optionally the node's host pool)."""

    def __init__(self, cache: PagedKVCache | None, host: object | None = None) -> None:
        self.cache = cache
        self.host = host

    def get_gpu_stats(self) -> KVStats | None:
        return None if self.cache is None else self.cache.stats()

    def get_host_stats(self) -> HostStats | None:
        stats = getattr(self.host, "stats", None)
        return stats() if callable(stats) else None


@dataclass
class InMemoryBackend:
    """A fake for tests and for engines that compute their own numbers."""

    gpu: KVStats | None = None
    host: HostStats | None = None

    def get_gpu_stats(self) -> KVStats | None:
        return self.gpu

    def get_host_stats(self) -> HostStats | None:
        return self.host


@dataclass(frozen=True)
class KVUtilizationRequest:
    """Fold `node`: `rank_stats[rank]` are the GPU stats of the node's ranks as the
    caller gathered them (None: not bound); ranks absent are missing. The host
    tier comes from the backend, once."""

    node: int
    rank_stats: Mapping[int, KVStats | None] = field(default_factory=dict)


class KVCacheManager:
    def __init__(self, backend: KVStatsBackend, topology: Topology) -> None:
        if not isinstance(backend, KVStatsBackend):
            raise TypeError(
                f"backend must implement get_host_stats() and get_gpu_stats(), "
                f"got {type(backend).__name__}"
            )
        if not isinstance(topology, Topology):
            raise TypeError(f"topology must be a Topology, got {type(topology).__name__}")
        self.backend = backend
        self.topology = topology

    def get_gpu_free_pages(self) -> int:
        """Free GPU blocks of this rank, summed over windows; 0 while not bound."""
        stats = self.backend.get_gpu_stats()
        return 0 if stats is None else stats.total.num_blocks_free

    def get_host_free_pages(self) -> int:
        stats = self.backend.get_host_stats()
        return 0 if stats is None else stats.num_blocks_free

    def get_host_utilization(self, request: KVUtilizationRequest) -> HostKVUtilization:
        """The node's folded view (ranks clamped to the world, host counted once)."""
        self.topology.check_node(request.node)
        reports = {}
        for rank, stats in request.rank_stats.items():
            if self.topology.node_of(rank) != request.node:
                raise ValueError(f"rank {rank} is not on node {request.node}")
            reports[rank] = RankReport(
                rank=rank,
                incarnation=0,
                seq=0,
                gpu=None if stats is None else stats.windows,
                deltas={},
                num_sequences_by_status=({} if stats is None else stats.num_sequences_by_status),
            )
        fresh = dict.fromkeys(reports, SourceState.FRESH)
        return fold_node(self.topology, request.node, reports, self.backend.get_host_stats(), fresh)

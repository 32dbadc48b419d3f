"""The seed's facade, with the seed's exact semantics (DESIGN 3.7).

    KVCacheManager(backend)                 backend: any object with get_host_stats()
      .get_gpu_free_pages()                 and get_gpu_stats() (a KVStatsBackend)
      .get_host_free_pages()
      .get_host_utilization(request) -> HostKVUtilization
    should_trigger_prefill(node_stats, watermark_free_percent, has_queued) -> PrefillTrigger

Where the seed and kvfold's own view use different words:

    seed (this module)                      kvfold (kvfold.view / kvfold.stats)
    KVStats: pages free / used / total      BlockGauges: blocks total / used / cached
    HostKVUtilization: the node's HOST      NodeUtilization: the node's GPU blocks over its
      tier, int free_percent (100 if          fresh ranks, float free_percent (0.0 if empty),
      empty), sequences with KV in host:      host tier apart (`.host`), valid sequences are
      PREFILLED + ON_HOLD + IN_DECODE         those holding GPU blocks (IN_PREFILL too)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sized
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from kvfold.checks import check_int
from kvfold.stats import BlockGauges, HostStats, SequenceStatus
from kvfold.stats import KVStats as GpuStats
from kvfold.view import ClusterView

HOST_VALID_STATUSES = (SequenceStatus.PREFILLED, SequenceStatus.ON_HOLD, SequenceStatus.IN_DECODE)
"""Sequences whose KV is in host memory (the seed's valid statuses)."""


@dataclass(frozen=True)
class KVStats:
    """The seed's page-counter snapshot of one paged KV manager (GPU, or a node's host tier)."""

    num_free_pages: int
    num_used_pages: int
    num_total_pages: int

    @classmethod
    def of(cls, stats: object) -> KVStats:
        """From any of: this type (or another with the three page fields), kvfold's
        `stats.KVStats` (summed over windows), `BlockGauges`, `HostStats`; None is empty."""
        if stats is None:
            return cls(0, 0, 0)
        if isinstance(stats, GpuStats):
            stats = stats.total
        if isinstance(stats, (BlockGauges, HostStats)):
            return cls(stats.num_blocks_free, stats.num_blocks_used, stats.num_blocks_total)
        try:
            return cls(
                int(stats.num_free_pages),  # type: ignore[attr-defined]
                int(stats.num_used_pages),  # type: ignore[attr-defined]
                int(stats.num_total_pages),  # type: ignore[attr-defined]
            )
        except AttributeError:
            raise TypeError(
                "stats must have num_free_pages, num_used_pages and num_total_pages "
                f"(or be one of kvfold's stats types), got {type(stats).__name__}"
            ) from None


@runtime_checkable
class KVStatsBackend(Protocol):
    """What the manager reads: the node's host tier, and this rank's GPU cache
    (None while it is not bound). Any object with these two methods will do."""

    def get_host_stats(self) -> object: ...

    def get_gpu_stats(self) -> object | None: ...


class SequenceSource(Protocol):
    """The seed's `global_batch`: the sequences of one rank in one status."""

    def get_sequences_for_rank_with_status(self, rank: int, status: SequenceStatus) -> Sized: ...


@dataclass(frozen=True)
class RankStatusCounts:
    """A SequenceSource from counts: `{rank: {status: n}}` or `{rank: kvfold KVStats}`
    (what ranks report), for callers that have counts rather than sequence objects."""

    counts: Mapping[int, Mapping[SequenceStatus, int] | GpuStats | None] = field(
        default_factory=dict
    )

    def get_sequences_for_rank_with_status(self, rank: int, status: SequenceStatus) -> Sized:
        c = self.counts.get(rank)
        if isinstance(c, GpuStats):
            c = c.num_sequences_by_status
        return range(0 if c is None else int(c.get(status, 0)))


@dataclass(frozen=True)
class KVUtilizationRequest:
    """The seed's request: which rank asks, the world's shape, and the sequences."""

    rank: int
    world_size: int
    local_rank: int
    num_gpus_per_node: int
    global_batch: SequenceSource = field(default_factory=RankStatusCounts)

    def __post_init__(self) -> None:
        for name in ("rank", "world_size", "local_rank", "num_gpus_per_node"):
            check_int(name, getattr(self, name))
        if self.world_size < 1 or self.num_gpus_per_node < 1:
            raise ValueError(
                f"world_size and num_gpus_per_node must be >= 1, got {self.world_size} "
                f"and {self.num_gpus_per_node}"
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")
        if not callable(getattr(self.global_batch, "get_sequences_for_rank_with_status", None)):
            raise TypeError(
                "global_batch must have get_sequences_for_rank_with_status(rank, status), "
                f"got {type(self.global_batch).__name__}"
            )


@dataclass(frozen=True)
class HostKVUtilization:
    """One node's host tier, and its sequences with KV in host memory (every rank of
    the node counted). free_percent = int(free / total * 100), 100 when total is 0."""

    rank: int
    node_id: int
    num_free_pages: int
    num_total_pages: int
    num_used_pages: int
    free_percent: int
    num_in_decode: int
    num_onhold: int
    num_prefilled: int
    num_valid_sequences: int

    @classmethod
    def of(
        cls, rank: int, node_id: int, host: KVStats, counts: Mapping[SequenceStatus, int]
    ) -> HostKVUtilization:
        """From the host tier's pages and the node's sequences by (host-valid) status."""
        return cls(
            rank=rank,
            node_id=node_id,
            num_free_pages=host.num_free_pages,
            num_total_pages=host.num_total_pages,
            num_used_pages=host.num_used_pages,
            free_percent=percent_free(host.num_free_pages, host.num_total_pages),
            num_in_decode=counts[SequenceStatus.IN_DECODE],
            num_onhold=counts[SequenceStatus.ON_HOLD],
            num_prefilled=counts[SequenceStatus.PREFILLED],
            num_valid_sequences=sum(counts[s] for s in HOST_VALID_STATUSES),
        )


def percent_free(free: int, total: int) -> int:
    """The seed's integer percentage: int(free / total * 100), 100 when total is 0."""
    return int(free / total * 100) if total > 0 else 100


class KVCacheManager:
    """The seed's read-only stats facade over a KVStatsBackend."""

    def __init__(self, backend: KVStatsBackend) -> None:
        if not isinstance(backend, KVStatsBackend):
            raise TypeError(
                f"backend must implement get_host_stats() and get_gpu_stats(), "
                f"got {type(backend).__name__}"
            )
        self._backend = backend

    def get_host_free_pages(self) -> int:
        """Free pages of the node's host tier."""
        return KVStats.of(self._backend.get_host_stats()).num_free_pages

    def get_gpu_free_pages(self) -> int:
        """Free pages of this rank's GPU cache; 0 while it is not bound."""
        return KVStats.of(self._backend.get_gpu_stats()).num_free_pages

    def get_host_utilization(self, request: KVUtilizationRequest) -> HostKVUtilization:
        """The node's host tier, with the node's sequences that hold KV in host memory,
        over ranks [node_rank_start, min(node_rank_start + gpus_per_node, world_size))."""
        if not isinstance(request, KVUtilizationRequest):
            raise TypeError(f"request must be a KVUtilizationRequest, got {type(request).__name__}")
        host = KVStats.of(self._backend.get_host_stats())
        g = request.num_gpus_per_node
        node_id = request.rank // g
        start = node_id * g
        end = min(start + g, request.world_size)
        counts = dict.fromkeys(HOST_VALID_STATUSES, 0)
        batch = request.global_batch
        for rank in range(start, end):
            for status in HOST_VALID_STATUSES:
                counts[status] += len(batch.get_sequences_for_rank_with_status(rank, status))
        return HostKVUtilization.of(request.rank, node_id, host, counts)


@dataclass(frozen=True)
class PrefillTrigger:
    """The seed's decision and, beside it, the host pages over the nodes it saw.

    max_free_percent is None (and the figures 0) when no node was given.
    free_percent = 100 - int(used / total * 100) (100 - 0 when total is 0): the seed's
    cluster figure, which rounds the used share down (1 of 3 pages used: 67, where a
    node's own free_percent, int(2 / 3 * 100), is 66)."""

    should_trigger: bool
    max_free_percent: int | None
    used_pages: int
    total_pages: int
    free_percent: int
    num_nodes: int


def should_trigger_prefill(
    node_stats: Iterable[HostKVUtilization],
    watermark_free_percent: int,
    has_queued: bool,
    has_evicted: bool = False,
) -> PrefillTrigger:
    """Trigger prefill when some node's host free_percent is above the watermark (its
    host tier is under-used) and work is waiting (queued, or evicted sequences)."""
    check_int("watermark_free_percent", watermark_free_percent)
    nodes = list(node_stats)
    if not nodes:
        return PrefillTrigger(False, None, 0, 0, 100, 0)
    max_free = max(int(n.free_percent) for n in nodes)
    used = sum(n.num_used_pages for n in nodes)
    total = sum(n.num_total_pages for n in nodes)
    used_percent = int(used / total * 100) if total > 0 else 0
    return PrefillTrigger(
        should_trigger=max_free > watermark_free_percent and (has_queued or has_evicted),
        max_free_percent=max_free,
        used_pages=used,
        total_pages=total,
        free_percent=100 - used_percent,
        num_nodes=len(nodes),
    )


def host_utilizations(view: ClusterView) -> list[HostKVUtilization]:
    """The seed's per-node utilization of every fresh node of a cluster view (nodes
    that are stale, dead or never heard from are left out, as a gather would). A node's
    sequences are those of its fresh ranks: a silent rank's are not known."""
    out = []
    for node in view.fresh_nodes:
        host = KVStats.of(node.host)
        statuses = node.num_sequences_by_status
        counts = {s: int(statuses.get(s, 0)) for s in HOST_VALID_STATUSES}
        out.append(HostKVUtilization.of(node.rank_start, node.node, host, counts))
    return out


class PagedCacheBackend:
    """A backend over a real PagedKVCache (None: not bound) and the node's host pool
    (anything with `.stats() -> HostStats`; None: no host tier)."""

    def __init__(self, cache: object | None, host: object | None = None) -> None:
        self.cache = cache
        self.host = host

    def get_gpu_stats(self) -> KVStats | None:
        return None if self.cache is None else KVStats.of(self.cache.stats())  # type: ignore[attr-defined]

    def get_host_stats(self) -> KVStats:
        return KVStats.of(None if self.host is None else self.host.stats())  # type: ignore[attr-defined]


@dataclass
class InMemoryBackend:
    """A fake for tests, and for engines that compute their own numbers."""

    gpu: KVStats | None = None
    host: KVStats = field(default_factory=lambda: KVStats(0, 0, 0))

    def get_gpu_stats(self) -> KVStats | None:
        return self.gpu

    def get_host_stats(self) -> KVStats:
        return self.host


__all__ = [
    "HOST_VALID_STATUSES",
    "HostKVUtilization",
    "InMemoryBackend",
    "KVCacheManager",
    "KVStats",
    "KVStatsBackend",
    "KVUtilizationRequest",
    "PagedCacheBackend",
    "PrefillTrigger",
    "RankStatusCounts",
    "SequenceSource",
    "host_utilizations",
    "should_trigger_prefill",
]

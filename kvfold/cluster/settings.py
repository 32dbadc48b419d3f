"""LaunchSettings: what a kvfold deployment was started with, validated up front."""

from __future__ import annotations

from dataclasses import dataclass

from kvfold.checks import check_int, check_positive
from kvfold.engines.endpoints import EngineEndpoints
from kvfold.worker.config import KVCacheConfig


@dataclass(frozen=True)
class LaunchSettings:
    world_size: int
    gpus_per_node: int | None
    cache: KVCacheConfig | None
    host_num_blocks: int
    report_interval_s: float
    stale_after_s: float
    dead_after_s: float
    namespace: str
    placement_timeout_s: float
    detached: bool
    gpus_per_rank: float
    rank_max_restarts: int
    engines: tuple[EngineEndpoints, ...] = ()  # engine ranks (DESIGN §10): one per rank
    nodes_per_rack: int = 0  # 0: nodes push to the aggregator; else through rack actors

    def __post_init__(self) -> None:
        check_int("world_size", self.world_size, 1)
        if self.gpus_per_node is not None:
            check_int("gpus_per_node", self.gpus_per_node, 1)
        if self.cache is not None and not isinstance(self.cache, KVCacheConfig):
            raise TypeError(
                f"cache must be a KVCacheConfig or None, got {type(self.cache).__name__}"
            )
        check_int("host_num_blocks", self.host_num_blocks, 0)
        check_int("nodes_per_rack", self.nodes_per_rack, 0)
        for name in (
            "report_interval_s",
            "stale_after_s",
            "dead_after_s",
            "placement_timeout_s",
            "gpus_per_rank",
        ):
            check_positive(name, getattr(self, name))
        if self.dead_after_s < self.stale_after_s:
            raise ValueError(
                f"dead_after_s ({self.dead_after_s}) must be >= "
                f"stale_after_s ({self.stale_after_s})"
            )
        if not isinstance(self.namespace, str) or not self.namespace:
            raise ValueError(f"namespace must be a non-empty str, got {self.namespace!r}")
        if self.engines:
            if any(not isinstance(e, EngineEndpoints) for e in self.engines):
                raise TypeError("engines must be EngineEndpoints, one per rank")
            if len(self.engines) != self.world_size:
                raise ValueError(
                    f"engines: one per rank, so {self.world_size} (world_size), "
                    f"got {len(self.engines)}"
                )
            binds = [e.events for e in self.engines]
            if len(set(binds)) != len(binds):
                raise ValueError(f"engines: each rank needs its own events endpoint, got {binds}")
            drained = [e.metrics for e in self.engines if e.kind == "trtllm"]
            if len(set(drained)) != len(drained):
                raise ValueError(
                    "engines: trtllm-serve's /metrics drains its stats queue, so each trtllm "
                    f"rank needs its own metrics URL, got {drained}"
                )

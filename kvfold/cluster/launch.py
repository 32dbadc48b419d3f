"""launch(): place and start kvfold on a Ray cluster; KVFold: the handle it returns.

    placement group (PACK, one {"GPU": n} bundle per rank)   -> where each rank goes
    ranks numbered contiguously per node, fullest nodes first -> the partial node is last
    one HostKVActor per node (hard node affinity), one ClusterAggregator (named)
    one RankWorker per bundle

A placement that cannot be satisfied fails within `placement_timeout_s` with a
PlacementError naming the missing resources, and leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from kvfold.aggregator.client import KVFoldClient
from kvfold.aggregator.cluster_actor import ClusterAggregator
from kvfold.aggregator.node_actor import HostKVActor
from kvfold.errors import KVFoldError, PlacementError, RankUnavailable
from kvfold.naming import (
    AGGREGATOR_NAME,
    DEFAULT_NAMESPACE,
    PLACEMENT_GROUP_NAME,
    node_actor_name,
    rank_actor_name,
)
from kvfold.stats import IterationStats, KVStats, SequenceStatus, Window
from kvfold.topology import Topology
from kvfold.view import ClusterView, SourceState
from kvfold.worker.config import KVCacheConfig
from kvfold.worker.rank_actor import RankWorker
from kvfold.workload.engine import StepResult

CALL_TIMEOUT_S = 30.0


def _positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")


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

    def __post_init__(self) -> None:
        ws = self.world_size
        if isinstance(ws, bool) or not isinstance(ws, int) or ws < 1:
            raise ValueError(f"world_size must be an int >= 1, got {ws!r}")
        gpn = self.gpus_per_node
        if gpn is not None and (isinstance(gpn, bool) or not isinstance(gpn, int) or gpn < 1):
            raise ValueError(f"gpus_per_node must be an int >= 1 or None, got {gpn!r}")
        if self.cache is not None and not isinstance(self.cache, KVCacheConfig):
            raise TypeError(
                f"cache must be a KVCacheConfig or None, got {type(self.cache).__name__}"
            )
        hb = self.host_num_blocks
        if isinstance(hb, bool) or not isinstance(hb, int) or hb < 0:
            raise ValueError(f"host_num_blocks must be an int >= 0, got {hb!r}")
        for name in (
            "report_interval_s",
            "stale_after_s",
            "dead_after_s",
            "placement_timeout_s",
            "gpus_per_rank",
        ):
            _positive(name, getattr(self, name))
        if self.dead_after_s < self.stale_after_s:
            raise ValueError(
                f"dead_after_s ({self.dead_after_s}) must be >= "
                f"stale_after_s ({self.stale_after_s})"
            )
        if not isinstance(self.namespace, str) or not self.namespace:
            raise ValueError(f"namespace must be a non-empty str, got {self.namespace!r}")


def _missing_resources(world_size: int, gpus_per_rank: float) -> str:
    total = ray.cluster_resources().get("GPU", 0.0)
    free = ray.available_resources().get("GPU", 0.0)
    alive = [n for n in ray.nodes() if n.get("Alive")]
    need = world_size * gpus_per_rank
    return (
        f"asked for {world_size} ranks x {gpus_per_rank:g} GPU = {need:g} GPU; the cluster has "
        f"{total:g} GPU in all on {len(alive)} nodes, {free:g} free; missing "
        f"{max(0.0, need - free):g} GPU. Add GPU nodes, lower --world-size, or stop what holds them"
    )


def _assign_ranks(
    bundle_nodes: Sequence[str], node_order: Sequence[str]
) -> tuple[list[int], list[str], list[int]]:
    """Bundles -> (bundle index of each rank, Ray node id of each kvfold node, rank -> node).

    Nodes holding more bundles come first (so a partial node is last); ties keep
    Ray's node order. Ranks are contiguous on each node.
    """
    counts: dict[str, list[int]] = {}
    for b, nid in enumerate(bundle_nodes):
        counts.setdefault(nid, []).append(b)
    order = sorted(
        counts,
        key=lambda nid: (-len(counts[nid]), node_order.index(nid) if nid in node_order else 0),
    )
    rank_bundle: list[int] = []
    rank_to_node: list[int] = []
    for node, nid in enumerate(order):
        for b in counts[nid]:
            rank_bundle.append(b)
            rank_to_node.append(node)
    return rank_bundle, order, rank_to_node


class RankClient:
    """Synchronous calls to one rank actor; Ray failures become RankUnavailable."""

    def __init__(self, rank: int, handle: Any, timeout_s: float = CALL_TIMEOUT_S) -> None:
        self.rank = rank
        self.handle = handle
        self.timeout_s = timeout_s

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return ray.get(
                getattr(self.handle, method).remote(*args, **kwargs), timeout=self.timeout_s
            )
        except RayActorError as e:
            raise RankUnavailable(self.rank, str(e).splitlines()[0]) from e
        except GetTimeoutError as e:
            raise RankUnavailable(self.rank, f"no answer to {method} in {self.timeout_s} s") from e

    def add_sequence(
        self,
        seq_id: str | int,
        token_ids: Sequence[int] | np.ndarray,
        salt: str | None = None,
        report: bool = False,
    ) -> bool:
        return bool(self.call("add_sequence", seq_id, token_ids, salt, report))

    def append_tokens(
        self, seq_id: str | int, token_ids: Sequence[int], report: bool = False
    ) -> bool:
        return bool(self.call("append_tokens", seq_id, token_ids, report))

    def set_status(self, seq_id: str | int, status: SequenceStatus, report: bool = False) -> None:
        self.call("set_status", seq_id, int(status), report)

    def free_sequence(self, seq_id: str | int, report: bool = False) -> None:
        self.call("free_sequence", seq_id, report)

    def block_table(self, seq_id: str | int, window: Window = None) -> list[int]:
        table: list[int] = self.call("block_table", seq_id, window)
        return table

    def stats(self) -> KVStats | None:
        stats: KVStats | None = self.call("stats")
        return stats

    def cumulative(self) -> IterationStats | None:
        out: IterationStats | None = self.call("cumulative")
        return out

    def write_kv(
        self, seq_id: str | int, layer: int, positions: list[int], k: np.ndarray, v: np.ndarray
    ) -> None:
        self.call("write_kv", seq_id, layer, positions, k, v)

    def gather_kv(self, seq_id: str | int, layer: int) -> tuple[np.ndarray, np.ndarray]:
        k, v = self.call("gather_kv", seq_id, layer)
        return k, v

    def engine_step(self, admits: list[tuple[Any, np.ndarray, int, str | None]]) -> StepResult:
        result: StepResult = self.call("engine_step", admits)
        return result

    def report_now(self) -> str:
        verdict: str = self.call("report_now")
        return verdict

    def info(self) -> dict[str, Any]:
        info: dict[str, Any] = self.call("info")
        return info

    def check_integrity(self) -> None:
        self.call("check_integrity")


class KVFold:
    """A running kvfold deployment: its topology, its actors, and a client for views."""

    def __init__(
        self,
        settings: LaunchSettings,
        topology: Topology,
        aggregator: Any,
        nodes: list[Any],
        ranks: list[Any],
        pg: Any,
        ray_node_ids: list[str],
    ) -> None:
        self.settings = settings
        self.topology = topology
        self.namespace = settings.namespace
        self.aggregator = aggregator
        self.node_handles = nodes
        self.rank_handles = ranks
        self.placement_group = pg
        self.ray_node_ids = ray_node_ids
        self.client = KVFoldClient(namespace=settings.namespace)
        self._ranks = [RankClient(r, h) for r, h in enumerate(ranks)]

    def view(self) -> ClusterView:
        return self.client.view()

    def wait_for_version(self, version: int, timeout_s: float = 5.0) -> ClusterView | None:
        return self.client.wait_for_version(version, timeout_s)

    def rank(self, rank: int) -> RankClient:
        self.topology.check_rank(rank)
        return self._ranks[rank]

    def node(self, node: int) -> Any:
        """The node's HostKVActor handle (for `.counts.remote()`, `.view.remote()`)."""
        self.topology.check_node(node)
        return self.node_handles[node]

    def wait_until_fresh(self, timeout_s: float = 30.0) -> ClusterView:
        """Block until every rank of every node is fresh in the view."""
        deadline = time.monotonic() + timeout_s
        view = self.view()
        while True:
            states = view.rank_states()
            if (
                all(s is SourceState.FRESH for s in states.values())
                and len(states) == self.topology.world_size
            ):
                return view
            left = deadline - time.monotonic()
            if left <= 0:
                not_fresh = {r: s.value for r, s in states.items() if s is not SourceState.FRESH}
                raise KVFoldError(f"ranks not fresh after {timeout_s} s: {not_fresh}")
            view = self.client.wait_for_version(view.version, min(left, 1.0)) or self.view()

    def shutdown(self) -> None:
        """Stop every kvfold actor of this deployment and free its placement group."""
        for h in [*self.rank_handles, *self.node_handles, self.aggregator]:
            with contextlib.suppress(RayActorError, ValueError):
                ray.kill(h, no_restart=True)
        with contextlib.suppress(ValueError, RayActorError):
            remove_placement_group(self.placement_group)

    def __enter__(self) -> KVFold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def launch(
    world_size: int,
    gpus_per_node: int | None = None,
    *,
    address: str | None = None,
    cache: KVCacheConfig | None = None,
    host_num_blocks: int = 0,
    report_interval_s: float = 0.1,
    stale_after_s: float | None = None,
    dead_after_s: float | None = None,
    namespace: str | None = None,
    placement_timeout_s: float = 60.0,
    detached: bool = False,
    gpus_per_rank: float = 1.0,
    rank_max_restarts: int = -1,
    wait_fresh: bool = True,
    metrics_port: int | None = None,
    metrics_host: str = "127.0.0.1",
) -> KVFold:
    """Start kvfold on the Ray cluster at `address` (or the one this process is connected to).

    cache: every rank's KV cache (None: ranks start unbound and report no GPU stats).
    host_num_blocks: host-tier blocks per node (0 turns the tier off).
    stale_after_s / dead_after_s default to 3 and 30 report intervals.
    metrics_port: serve Prometheus metrics from the aggregator (0: any free port;
    None: off), bound to `metrics_host` (127.0.0.1 unless told otherwise).
    """
    if cache is None:
        cache = KVCacheConfig()
    if namespace is None:
        namespace = ray.get_runtime_context().namespace if ray.is_initialized() else None
    settings = LaunchSettings(
        world_size=world_size,
        gpus_per_node=gpus_per_node,
        cache=cache,
        host_num_blocks=host_num_blocks,
        report_interval_s=report_interval_s,
        stale_after_s=stale_after_s if stale_after_s is not None else 3 * report_interval_s,
        dead_after_s=dead_after_s if dead_after_s is not None else 30 * report_interval_s,
        namespace=namespace or DEFAULT_NAMESPACE,
        placement_timeout_s=placement_timeout_s,
        detached=detached,
        gpus_per_rank=gpus_per_rank,
        rank_max_restarts=rank_max_restarts,
    )
    if not ray.is_initialized():
        ray.init(address=address, namespace=settings.namespace, log_to_driver=False)
    ns = settings.namespace
    try:
        ray.get_actor(AGGREGATOR_NAME, namespace=ns)
        raise KVFoldError(f"kvfold is already running in namespace {ns!r}; run `kvfold down` first")
    except ValueError:
        pass

    lifetime = "detached" if detached else None
    pg = placement_group(
        [{"GPU": gpus_per_rank}] * world_size,
        strategy="PACK",
        name=PLACEMENT_GROUP_NAME if detached else "",
        lifetime=lifetime,
    )
    if not pg.wait(timeout_seconds=placement_timeout_s):
        message = _missing_resources(world_size, gpus_per_rank)
        remove_placement_group(pg)
        raise PlacementError(f"could not place kvfold within {placement_timeout_s:g} s: {message}")
    table = ray.util.placement_group_table(pg)
    bundle_nodes = [table["bundles_to_node_id"][b] for b in range(world_size)]
    ray_order = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
    rank_bundle, node_ids, rank_to_node = _assign_ranks(bundle_nodes, ray_order)
    topology = Topology.from_mapping(rank_to_node)

    windows = list(cache.windows)
    common = {
        "namespace": ns,
        "report_interval_s": settings.report_interval_s,
    }
    fresh = {"stale_after_s": settings.stale_after_s, "dead_after_s": settings.dead_after_s}
    actors: list[Any] = []
    try:
        aggregator = (
            ray.remote(concurrency_groups={"reports": 1})(ClusterAggregator)  # type: ignore[call-overload]
            .options(
                name=AGGREGATOR_NAME,
                namespace=ns,
                lifetime=lifetime,
                num_cpus=0,
                resources=_on_head_node(),
                max_restarts=-1,
                max_task_retries=0,
                max_concurrency=32,
            )
            .remote(
                rank_to_node,
                windows,
                **common,
                **fresh,
                metrics_host=metrics_host,
                metrics_port=metrics_port,
            )
        )
        actors.append(aggregator)
        slot = max(cache.bytes_per_block(w) for w in cache.windows)
        geometry = cache.block_geometry()
        nodes = []
        for node, nid in enumerate(node_ids):
            # reports: one thread, in order; offload/onboard: their own threads, never in the way
            h = (
                ray.remote(concurrency_groups={"reports": 1, "data": 4})(HostKVActor)  # type: ignore[call-overload]
                .options(
                    name=node_actor_name(node),
                    namespace=ns,
                    lifetime=lifetime,
                    num_cpus=0,
                    max_restarts=-1,
                    max_task_retries=0,
                    max_concurrency=16,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=nid, soft=False),
                )
                .remote(
                    node,
                    rank_to_node,
                    windows,
                    **common,
                    **fresh,
                    host_num_blocks=host_num_blocks,
                    host_slot_nbytes=slot,
                    geometry=geometry,
                )
            )
            nodes.append(h)
            actors.append(h)
        ranks = []
        for rank, bundle in enumerate(rank_bundle):
            rh = (
                ray.remote(RankWorker)
                .options(
                    name=rank_actor_name(rank),
                    namespace=ns,
                    lifetime=lifetime,
                    num_cpus=0,
                    num_gpus=gpus_per_rank,
                    max_restarts=rank_max_restarts,
                    max_task_retries=0,
                    max_concurrency=4,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=bundle
                    ),
                )
                .remote(rank, rank_to_node, cache, **common, host_tier=host_num_blocks > 0)
            )
            ranks.append(rh)
            actors.append(rh)
        ray.get([a.ping.remote() for a in actors], timeout=placement_timeout_s + 60.0)
    except (RayActorError, GetTimeoutError) as e:
        for a in actors:
            ray.kill(a, no_restart=True)
        remove_placement_group(pg)
        raise PlacementError(f"kvfold actors failed to start: {e}") from e
    kv = KVFold(settings, topology, aggregator, nodes, ranks, pg, node_ids)
    if wait_fresh:
        try:
            kv.wait_until_fresh(timeout_s=placement_timeout_s)
        except KVFoldError:
            kv.shutdown()
            raise
    return kv


HEAD_RESOURCE = "node:__internal_head__"


def _on_head_node() -> dict[str, float]:
    """Pin the aggregator to the head node, as Ray Serve pins its controller: losing a
    worker node must not take the cluster's view with it (docs/decisions.md)."""
    return {HEAD_RESOURCE: 0.001} if HEAD_RESOURCE in ray.cluster_resources() else {}


def attach(namespace: str = DEFAULT_NAMESPACE, address: str | None = None) -> KVFoldClient:
    """A client for a deployment started elsewhere (`kvfold up`)."""
    return KVFoldClient(address=address, namespace=namespace)


def teardown(namespace: str = DEFAULT_NAMESPACE) -> list[str]:
    """Kill every kvfold actor in `namespace` and its placement group; return what was stopped."""
    stopped = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name, ns = entry["name"], entry["namespace"]
        if ns != namespace or not name.startswith("kvfold:"):
            continue
        try:
            ray.kill(ray.get_actor(name, namespace=ns), no_restart=True)
            stopped.append(name)
        except ValueError:
            pass
    try:
        remove_placement_group(ray.util.get_placement_group(PLACEMENT_GROUP_NAME))
        stopped.append(PLACEMENT_GROUP_NAME)
    except ValueError:
        pass
    return stopped

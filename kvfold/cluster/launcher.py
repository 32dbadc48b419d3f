"""launch(): place and start kvfold on a Ray cluster; KVFold: the handle it returns.

    where each rank goes (kvfold.cluster.placement: a placement group, ranks numbered
    node by node, the partial node last; a PlacementError in time, nothing left behind)
    one HostKVActor per node (hard node affinity), one ClusterAggregator (named),
    with racks one RackAggregator per `nodes_per_rack` nodes (both on the head node)
    one RankWorker per bundle

Every actor is named in the deployment's namespace (kvfold.naming).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.experimental.internal_kv import _internal_kv_del
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from kvfold.aggregator.client import KVFoldClient
from kvfold.aggregator.cluster_actor import CARRY_KEY, ClusterAggregator
from kvfold.aggregator.node_actor import HostKVActor
from kvfold.aggregator.rack_actor import (
    RACK_CONCURRENCY_GROUPS,
    RACK_MAX_CONCURRENCY,
    RackAggregator,
)
from kvfold.cluster.handle import KVFold
from kvfold.cluster.phases import PhaseClock
from kvfold.cluster.placement import Placement, on_head_node, place
from kvfold.cluster.settings import LaunchSettings
from kvfold.engines.endpoints import EngineEndpoints
from kvfold.engines.engine_rank_actor import EngineRankActor
from kvfold.errors import KVFoldError, PlacementError
from kvfold.naming import (
    AGGREGATOR_NAME,
    DEFAULT_NAMESPACE,
    PLACEMENT_GROUP_NAME,
    PREFIX,
    node_actor_name,
    rack_actor_name,
    rank_actor_name,
)
from kvfold.ray_actor import named_actor
from kvfold.topology import Topology
from kvfold.worker.config import KVCacheConfig
from kvfold.worker.engine import EngineFactory
from kvfold.worker.rank_actor import RankWorker
from kvfold.workload.engine import SimEngine


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
    engine_factory: EngineFactory | None = SimEngine,
    engines: Sequence[EngineEndpoints] | None = None,
    nodes_per_rack: int = 0,
) -> KVFold:
    """Start kvfold on the Ray cluster at `address` (or the one this process is connected to).

    cache: every rank's KV cache (None: ranks start unbound and report no GPU stats).
    host_num_blocks: host-tier blocks per node (0 turns the tier off).
    stale_after_s / dead_after_s default to 3 and 30 report intervals.
    metrics_port: serve Prometheus metrics from the aggregator (0: any free port;
    None: off), bound to `metrics_host` (127.0.0.1 unless told otherwise).
    engine_factory: the engine each rank runs over its cache (kvfold.worker.engine);
    kvfold's simulated engine by default, None for ranks driven only by their API.
    engines: real engines as ranks (DESIGN §10), one EngineEndpoints per rank, in rank
    order, of any kind (vLLM, SGLang, TensorRT-LLM; kinds may be mixed): each rank is an
    EngineRankActor reading what its engine publishes (its KV events and its numbers
    page), instead of a kvfold cache (`cache` then only names the windows; full
    attention is the default's).
    nodes_per_rack: above 0, nodes push through rack actors of that many nodes each:
    the aggregator takes two calls per rack and interval, and each rack keeps its nodes'
    shard of the block index (docs/scale.md); 0: straight to the aggregator.
    """
    if namespace is None:
        namespace = ray.get_runtime_context().namespace if ray.is_initialized() else None
    settings = LaunchSettings(
        world_size=world_size,
        gpus_per_node=gpus_per_node,
        cache=KVCacheConfig() if cache is None else cache,
        host_num_blocks=host_num_blocks,
        report_interval_s=report_interval_s,
        stale_after_s=stale_after_s if stale_after_s is not None else 3 * report_interval_s,
        dead_after_s=dead_after_s if dead_after_s is not None else 30 * report_interval_s,
        namespace=namespace or DEFAULT_NAMESPACE,
        placement_timeout_s=placement_timeout_s,
        detached=detached,
        gpus_per_rank=gpus_per_rank,
        rank_max_restarts=rank_max_restarts,
        engines=tuple(engines or ()),
        nodes_per_rack=nodes_per_rack,
    )
    return _deploy(settings, address, (metrics_host, metrics_port), engine_factory, wait_fresh)


def _deploy(
    settings: LaunchSettings,
    address: str | None,
    metrics: tuple[str, int | None],
    engine_factory: EngineFactory | None,
    wait_fresh: bool,
) -> KVFold:
    """Place, start every actor, wait until fresh; on any failure leave nothing behind.
    The handle's `launch_phases` says how long each step took."""
    clock = PhaseClock()
    if not ray.is_initialized():
        ray.init(address=address, namespace=settings.namespace, log_to_driver=False)
        clock.mark("connected")
    if named_actor(AGGREGATOR_NAME, settings.namespace) is not None:
        raise KVFoldError(
            f"kvfold is already running in namespace {settings.namespace!r}; "
            "run `kvfold down` first"
        )
    placement = place(settings)
    clock.mark("placed")
    actors: list[Any] = []
    try:
        aggregator = _start_aggregator(settings, placement, metrics)
        actors.append(aggregator)
        racks = _start_racks(settings, placement)
        actors += racks
        nodes = _start_nodes(settings, placement)
        actors += nodes
        ranks = _start_ranks(settings, placement, engine_factory)
        actors += ranks
        clock.mark("actors submitted")
        ray.get([a.ping.remote() for a in actors], timeout=settings.placement_timeout_s + 60.0)
        clock.mark("actors started")
    except (RayActorError, GetTimeoutError) as e:
        for a in actors:
            ray.kill(a, no_restart=True)
        remove_placement_group(placement.group)
        raise PlacementError(f"kvfold actors failed to start: {e}") from e
    topology = Topology.from_mapping(placement.rank_to_node)
    kv = KVFold(settings, topology, aggregator, nodes, ranks, placement.group, placement.node_ids)
    kv.rack_handles = racks  # before waiting: a shutdown on the way out stops them too
    if wait_fresh:
        try:
            kv.wait_until_fresh(timeout_s=settings.placement_timeout_s)
        except KVFoldError:
            kv.shutdown()
            raise
        clock.mark("ranks fresh")
    kv.launch_phases = clock.phases
    return kv


def _common(settings: LaunchSettings) -> dict[str, Any]:
    return {"namespace": settings.namespace, "report_interval_s": settings.report_interval_s}


def _freshness(settings: LaunchSettings) -> dict[str, Any]:
    return {"stale_after_s": settings.stale_after_s, "dead_after_s": settings.dead_after_s}


def _actor_options(settings: LaunchSettings, name: str, **extra: Any) -> dict[str, Any]:
    lifetime = "detached" if settings.detached else None
    return {
        "name": name,
        "namespace": settings.namespace,
        "lifetime": lifetime,
        "num_cpus": 0,
        "max_task_retries": 0,
        **extra,
    }


def _start_aggregator(
    settings: LaunchSettings, placement: Placement, metrics: tuple[str, int | None]
) -> Any:
    assert settings.cache is not None
    # a new deployment counts from zero: only its own aggregator's restarts carry counters on
    _internal_kv_del(CARRY_KEY, namespace=settings.namespace)
    options = _actor_options(
        settings, AGGREGATOR_NAME, resources=on_head_node(), max_restarts=-1, max_concurrency=32
    )
    actor = ray.remote(concurrency_groups={"reports": 1, "events": 1})(ClusterAggregator)  # type: ignore[call-overload]
    return actor.options(**options).remote(
        placement.rank_to_node,
        list(settings.cache.windows),
        **_common(settings),
        **_freshness(settings),
        metrics_host=metrics[0],
        metrics_port=metrics[1],
        ray_node_ids=placement.node_ids,
        nodes_per_rack=settings.nodes_per_rack,
    )


def _start_racks(settings: LaunchSettings, placement: Placement) -> list[Any]:
    """One RackAggregator per `nodes_per_rack` nodes, beside the aggregator."""
    per = settings.nodes_per_rack
    if not per:
        return []
    num_racks = -(-len(placement.node_ids) // per)
    actor = ray.remote(concurrency_groups=RACK_CONCURRENCY_GROUPS)(RackAggregator)  # type: ignore[call-overload]
    head = on_head_node()
    return [
        actor.options(
            **_actor_options(
                settings,
                rack_actor_name(i),
                resources=head,
                max_restarts=-1,
                max_concurrency=RACK_MAX_CONCURRENCY,
            )
        ).remote(i, placement.rank_to_node, **_common(settings))
        for i in range(num_racks)
    ]


def _start_nodes(settings: LaunchSettings, placement: Placement) -> list[Any]:
    """One HostKVActor per node, pinned to it. Reports: one thread, in order;
    offload/onboard: threads of their own (they hold the node's lock while a batch is
    copied into or out of the pool, so a large batch can delay a report by that copy)."""
    assert settings.cache is not None
    actor = ray.remote(concurrency_groups={"reports": 1, "events": 1, "data": 4})(HostKVActor)  # type: ignore[call-overload]
    nodes = []
    for node, nid in enumerate(placement.node_ids):
        strategy = NodeAffinitySchedulingStrategy(node_id=nid, soft=False)
        options = _actor_options(
            settings,
            node_actor_name(node),
            max_restarts=-1,
            max_concurrency=16,
            scheduling_strategy=strategy,
        )
        nodes.append(
            actor.options(**options).remote(
                node,
                placement.rank_to_node,
                list(settings.cache.windows),
                **_common(settings),
                **_freshness(settings),
                host_num_blocks=settings.host_num_blocks,
                layout=settings.cache.block_layout(),
                rack=node // settings.nodes_per_rack if settings.nodes_per_rack else None,
            )
        )
    return nodes


def _start_ranks(
    settings: LaunchSettings, placement: Placement, engine_factory: EngineFactory | None
) -> list[Any]:
    ranks: list[Any] = []
    # one actor class for all ranks: Ray exports a class once per ray.remote() call
    engine_rank, rank_worker = ray.remote(EngineRankActor), ray.remote(RankWorker)
    for rank, bundle in enumerate(placement.rank_bundle):
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=placement.group, placement_group_bundle_index=bundle
        )
        options = _actor_options(
            settings,
            rank_actor_name(rank),
            num_gpus=settings.gpus_per_rank,
            max_restarts=settings.rank_max_restarts,
            max_concurrency=4,
            scheduling_strategy=strategy,
        )
        if settings.engines:  # beside the engine: its sockets are bound on loopback
            ranks.append(
                engine_rank.options(**options).remote(
                    rank, placement.rank_to_node, settings.engines[rank], **_common(settings)
                )
            )
            continue
        ranks.append(
            rank_worker.options(**options).remote(
                rank,
                placement.rank_to_node,
                settings.cache,
                **_common(settings),
                host_tier=settings.host_num_blocks > 0,
                engine_factory=engine_factory,
            )
        )
    return ranks


def attach(namespace: str = DEFAULT_NAMESPACE, address: str | None = None) -> KVFoldClient:
    """A client for a deployment started elsewhere (`kvfold up`)."""
    return KVFoldClient(address=address, namespace=namespace)


def teardown(namespace: str = DEFAULT_NAMESPACE) -> list[str]:
    """Kill every kvfold actor in `namespace` and its placement group; return what was stopped."""
    _internal_kv_del(CARRY_KEY, namespace=namespace)
    stopped = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name, ns = entry["name"], entry["namespace"]
        if ns != namespace or not name.startswith(PREFIX):
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

"""Prometheus exposition of the cluster view, served from one process (the aggregator).

Every scrape reads the aggregator's current view, so no series is duplicated
(one process, one registry) or lost (every node is exported whatever its state,
with `kvfold_node_state` saying whether its numbers count). Counters are the
view's cumulative counts, which never go backwards across rank, node-actor or
aggregator restarts (kvfold.aggregator.counter_ledger), so `rate()` is right.

    kvfold_gpu_blocks{node,window,state=used|cached|free}   gauge, last known per node
    kvfold_gpu_capacity_blocks{node,window}                   gauge
    kvfold_gpu_committed_blocks{node,window}                  gauge, used + growth still owed
    kvfold_rank_refused_placements{node}                      gauge, placements the node's ranks
                                                              refused as over-commits (per
                                                              incarnation; docs/admission.md)
    kvfold_cluster_gpu_blocks{window,state}                   gauge, fresh capacity only
    kvfold_host_blocks{node,state=used|evictable|free}        gauge
    kvfold_sequences{node,status}                             gauge
    kvfold_ranks{node,state=fresh|stale|dead|missing}         gauge
    kvfold_node_state{node,state}                             gauge, 1 for the node's state
    kvfold_node_report_age_seconds{node}                      gauge
    kvfold_unknown_ranks{node,field}                          gauge, fresh ranks that do not
                                                              publish a field (cached,
                                                              committed, deltas); that node's
                                                              series of the field are left out
    kvfold_view_version                                       gauge
    kvfold_blocks_total{node,window,kind}                     counter (alloc_total, reused, ...)
    kvfold_bytes_total{node,window,kind=onboarded|offloaded}  counter
    kvfold_host_blocks_total{node,kind}                       counter (offloaded, onboarded, ...)
    kvfold_host_bytes_total{node,kind}                        counter
    kvfold_reports_refused_total{source,reason}               counter
    kvfold_admission_decisions_total{outcome,reason}          counter
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvfold.stats import DELTA_FIELDS, HOST_FIELDS, UNKNOWABLE, SequenceStatus, window_label
from kvfold.view import ClusterView, SourceState

# the block counters of stats.BlockDeltas / HostStats, named by kind (`<kind>_blocks`)
BLOCK_KINDS = tuple(f.removesuffix("_blocks") for f in DELTA_FIELDS if f.endswith("_blocks"))
HOST_KINDS = tuple(
    f.removesuffix("_blocks")
    for f in HOST_FIELDS
    if f.endswith("_blocks") and not f.startswith("num_")
)


class ViewCollector(Collector):
    """Builds every kvfold_* family from one view at scrape time."""

    def __init__(
        self,
        view_source: Callable[[], ClusterView],
        refused_source: Callable[[], Mapping[tuple[str, str], int]] = dict,
        admission_source: Callable[[], Mapping[tuple[str, str], int]] = dict,
    ) -> None:
        self.view_source = view_source
        self.refused_source = refused_source
        self.admission_source = admission_source

    def collect(self) -> Iterator[Metric]:
        view = self.view_source()
        yield from _node_gauges(view)
        yield _cluster_gpu(view)
        version = GaugeMetricFamily("kvfold_view_version", "version of the cluster view")
        version.add_metric([], view.version)
        yield version
        yield from _node_counters(view)
        refused = CounterMetricFamily(
            "kvfold_reports_refused", "reports refused, by reason", labels=["source", "reason"]
        )
        for (source, reason), count in sorted(self.refused_source().items()):
            refused.add_metric([source, reason], count)
        decisions = CounterMetricFamily(
            "kvfold_admission_decisions",
            "admission decisions reported by schedulers",
            labels=["outcome", "reason"],
        )
        for (outcome, reason), count in sorted(self.admission_source().items()):
            decisions.add_metric([outcome, reason], count)
        yield from (refused, decisions)


def _node_gauges(view: ClusterView) -> Iterator[Metric]:
    """Per node: GPU blocks by window and state, capacity, host blocks, sequences by
    status, ranks by freshness, the node's own state and silence."""
    gpu = GaugeMetricFamily(
        "kvfold_gpu_blocks",
        "GPU KV blocks of a node by window and state (last known; see kvfold_node_state)",
        labels=["node", "window", "state"],
    )
    cap = GaugeMetricFamily(
        "kvfold_gpu_capacity_blocks", "GPU KV blocks of a node's ranks", labels=["node", "window"]
    )
    host = GaugeMetricFamily(
        "kvfold_host_blocks", "host-tier KV blocks by state", labels=["node", "state"]
    )
    committed = GaugeMetricFamily(
        "kvfold_gpu_committed_blocks",
        "GPU KV blocks a node's sequences hold plus the growth they are still owed",
        labels=["node", "window"],
    )
    refused = GaugeMetricFamily(
        "kvfold_rank_refused_placements",
        "placements the node's ranks refused because they would over-commit (last known)",
        labels=["node"],
    )
    seqs = GaugeMetricFamily("kvfold_sequences", "sequences by status", labels=["node", "status"])
    ranks = GaugeMetricFamily("kvfold_ranks", "ranks by freshness", labels=["node", "state"])
    nstate = GaugeMetricFamily(
        "kvfold_node_state", "1 for the node's freshness state", labels=["node", "state"]
    )
    age = GaugeMetricFamily(
        "kvfold_node_report_age_seconds", "seconds since the node's last report", labels=["node"]
    )
    unknown = GaugeMetricFamily(
        "kvfold_unknown_ranks",
        "fresh ranks whose source does not publish a field (an engine's): the node's series "
        "of that field are left out rather than undercounted",
        labels=["node", "field"],
    )
    for n in view.nodes:
        node = str(n.node)
        blind = n.unknown  # field -> fresh ranks that do not publish it
        for name in UNKNOWABLE:
            unknown.add_metric([node, name], len(blind.get(name, ())))
        for st in SourceState:
            nstate.add_metric([node, st.value], 1.0 if n.state is st else 0.0)
            ranks.add_metric([node, st.value], sum(1 for r in n.ranks if r.state is st))
        age.add_metric([node], view.age_s(n.node))
        refused.add_metric([node], sum(r.num_refused for r in n.ranks))
        for w, g in n.gpu.items():
            wl = window_label(w)
            gpu.add_metric([node, wl, "used"], g.num_blocks_used)
            if "cached" not in blind:
                gpu.add_metric([node, wl, "cached"], g.num_blocks_cached)
            gpu.add_metric([node, wl, "free"], g.num_blocks_free)
            cap.add_metric([node, wl], g.num_blocks_total)
            if "committed" not in blind:
                committed.add_metric([node, wl], g.num_blocks_committed)
        if n.host is not None:
            host.add_metric([node, "used"], n.host.num_blocks_used)
            host.add_metric([node, "evictable"], n.host.num_blocks_evictable)
            host.add_metric([node, "free"], n.host.num_blocks_free)
        for status in SequenceStatus:
            seqs.add_metric([node, status.name.lower()], n.num_sequences_by_status.get(status, 0))
    yield from (gpu, cap, committed, refused, host, seqs, ranks, nstate, age, unknown)


def _cluster_gpu(view: ClusterView) -> Metric:
    cluster = GaugeMetricFamily(
        "kvfold_cluster_gpu_blocks", "GPU KV blocks over fresh ranks", labels=["window", "state"]
    )
    cached_known = "cached" not in view.unknown
    for w, g in view.gpu.items():
        wl = window_label(w)
        cluster.add_metric([wl, "used"], g.num_blocks_used)
        if cached_known:
            cluster.add_metric([wl, "cached"], g.num_blocks_cached)
        cluster.add_metric([wl, "free"], g.num_blocks_free)
        cluster.add_metric([wl, "total"], g.num_blocks_total)
    return cluster


def _node_counters(view: ClusterView) -> Iterator[Metric]:
    """Cumulative block and byte counts per node (never backwards), GPU and host tier."""
    blocks = CounterMetricFamily(
        "kvfold_blocks", "KV block events by kind", labels=["node", "window", "kind"]
    )
    nbytes = CounterMetricFamily(
        "kvfold_bytes", "KV bytes moved between tiers", labels=["node", "window", "kind"]
    )
    hblocks = CounterMetricFamily(
        "kvfold_host_blocks", "host-tier block events", labels=["node", "kind"]
    )
    hbytes = CounterMetricFamily(
        "kvfold_host_bytes", "host-tier bytes moved", labels=["node", "kind"]
    )
    for n in view.nodes:
        node = str(n.node)
        for w, d in n.counters.windows.items():
            wl = window_label(w)
            for kind in BLOCK_KINDS:
                blocks.add_metric([node, wl, kind], getattr(d, f"{kind}_blocks"))
            nbytes.add_metric([node, wl, "onboarded"], d.onboarded_bytes)
            nbytes.add_metric([node, wl, "offloaded"], d.offloaded_bytes)
        if n.host is not None:
            for kind in HOST_KINDS:
                hblocks.add_metric([node, kind], getattr(n.host, f"{kind}_blocks"))
            hbytes.add_metric([node, "offloaded"], n.host.offloaded_bytes)
            hbytes.add_metric([node, "onboarded"], n.host.onboarded_bytes)
    yield from (blocks, nbytes, hblocks, hbytes)


def serve(collector: Collector, host: str = "127.0.0.1", port: int = 0) -> tuple[Any, str, int]:
    """Serve `collector` at http://host:port/metrics (port 0: any free port).

    Binds 127.0.0.1 unless told otherwise. Returns (server, host, port).
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server, host, int(server.server_port)

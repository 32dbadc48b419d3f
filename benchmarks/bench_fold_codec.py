"""Wire codec and folds: encode+decode+validate per report (beside pickle's round trip of
the same report, same run); fold_cluster at scale; view memory; a view sent to a reader
whole or as a delta of the one node that changed (kvfold.aggregator.view_delta); a
display's and a controller's refresh (kvfold.aggregator.capacity_delta) at 1,024 nodes
with 10% of them changed, and with every one."""

from __future__ import annotations

import copy
import pickle
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from _report import info, median_time_s, report

from kvfold.admission import AdmissionPolicy
from kvfold.admission.capacity import CapacityIndex
from kvfold.aggregator.capacity_delta import CapacityReader, CapacitySender
from kvfold.aggregator.fold import fold_cluster, fold_node
from kvfold.aggregator.view_delta import NOTHING, ViewReader, ViewSender
from kvfold.codec import decode_rank_report, encode_rank_report
from kvfold.stats import BlockDeltas, BlockGauges, HostStats, RankReport, SequenceStatus
from kvfold.topology import Topology
from kvfold.view import ClusterView


def rank_report(rank: int) -> RankReport:
    return RankReport(
        rank=rank,
        incarnation=1_700_000_000_123_456_789,
        seq=123_456,
        gpu={None: BlockGauges(40_000, 12_345, 2_000, 16), 4096: BlockGauges(40_000, 999, 50, 16)},
        deltas={
            None: BlockDeltas(13, 12, 30, 4, 4 * 262144, 8, 3, 1, 2, 2 * 262144),
            4096: BlockDeltas(3, 3, 0, 0, 0, 3, 1),
        },
        num_sequences_by_status={s: 7 * i for i, s in enumerate(SequenceStatus)},
        tickets={"scheduler-a-1f2e3d4c": 123, "scheduler-b-5a6b7c8d": 7},
    )


def node_views(topo: Topology) -> dict[int, object]:
    host = HostStats(100_000, 5_000, 5_000, 10, 10 * 262144, 5, 5 * 262144, 1, 1, 0)
    return {
        n: fold_node(topo, n, {r: rank_report(r) for r in topo.ranks_on(n)}, host)
        for n in range(topo.num_nodes)
    }


def main() -> None:
    topo = Topology(1024, 8)
    rep = rank_report(5)
    data = encode_rank_report(rep)
    windows = (None, 4096)

    def round_trip() -> RankReport:
        return decode_rank_report(encode_rank_report(rep), topo, node=0, windows=windows)

    assert round_trip() == rep
    t = median_time_s(round_trip, repeats=30, number=500)
    t_pickle = median_time_s(lambda: pickle.loads(pickle.dumps(rep)), repeats=30, number=500)
    info("encode + decode + validate, one 2-window rank report", t * 1e6, "us")
    info("  pickle round trip of the same report (no validation), same run", t_pickle * 1e6, "us")
    report("  codec / pickle (target: no slower than pickle)", t / t_pickle, "x", 1.0)
    report("bytes per rank report", len(data), "B", 512)

    for world, gpn, target_ms in ((1024, 8, 1.0), (8192, 8, 8.0)):
        topo = Topology(world, gpn)
        views = node_views(topo)
        t = median_time_s(lambda: fold_cluster(topo, views, version=1), repeats=30, number=5)
        report(
            f"fold_cluster, {world:,} ranks on {topo.num_nodes:,} nodes", t * 1e3, "ms", target_ms
        )
        node0 = {r: rank_report(r) for r in topo.ranks_on(0)}
        tn = median_time_s(lambda: fold_node(topo, 0, node0, None), repeats=30, number=20)
        info("  (fold_node of one 8-rank node, on its own node actor)", tn * 1e6, "us")
        info("  (all nodes folded serially + fold_cluster)", (tn * topo.num_nodes + t) * 1e3, "ms")

    view_deltas()

    topo = Topology(8192, 8)
    views = node_views(topo)
    tracemalloc.start()
    view = fold_cluster(topo, views, version=1)
    current, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    tracemalloc.start()
    views2 = node_views(topo)
    nodes_bytes, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del views2
    info(
        "memory of a view of 1,024 nodes: cluster fold on top of node views", current / 2**20, "MiB"
    )
    info("memory of the 1,024 node views themselves (8,192 ranks)", nodes_bytes / 2**20, "MiB")
    info(
        "pickled size of that ClusterView (what a reader receives)",
        len(pickle.dumps(view)) / 2**20,
        "MiB",
    )


def view_deltas() -> None:
    """A reader one version behind, at 1,024 ranks: the whole view (pickled once per
    version, decoded by each reader) against the delta of the one node that changed."""
    topo = Topology(1024, 8)
    views = node_views(topo)
    sender, reader = ViewSender(), ViewReader()
    v1 = fold_cluster(topo, views, version=1)
    sender.update(v1)
    reader.apply(sender.since(NOTHING), NOTHING)
    asked = reader.position
    changed = dict(views)
    changed[3] = fold_node(topo, 3, {r: rank_report(r) for r in topo.ranks_on(3)}, None)
    folded = fold_cluster(topo, changed, version=2)
    # as ClusterState keeps them: the nodes that did not change are the same objects
    v2 = replace(folded, nodes=v1.nodes[:3] + folded.nodes[3:4] + v1.nodes[4:])
    sender.update(v2)
    delta = sender.since(asked)
    assert delta is not None
    whole = pickle.dumps(v2, protocol=pickle.HIGHEST_PROTOCOL)

    def read_delta() -> object:
        reader.view = v1
        return reader.apply(delta, asked)

    assert read_delta() == v2
    t_whole = median_time_s(lambda: pickle.loads(whole), repeats=15, number=5)
    t_delta = median_time_s(read_delta, repeats=15, number=20)
    info("view to a reader one version behind, 1,024 ranks: whole, decode", t_whole * 1e3, "ms")
    info("  the same as a delta (one node changed), decode + rebuild", t_delta * 1e3, "ms")
    info("  bytes: whole / delta", len(whole) / 1024, f"KiB / {len(delta) / 1024:.1f} KiB")
    report("  delta / whole, reader's time (target: 0.1x)", t_delta / t_whole, "x", 0.1)


def fleet_refresh() -> None:
    """A display's view refresh at 1,024 nodes x 8 ranks (a whole view, rebuilt from
    deltas): the delta of 102 nodes' changed entries, beside the delta when every node
    changed, as when every node reports (each report moves its ranks' seqs and ages, so
    every entry is new). Controllers read capacity deltas instead (below)."""
    topo = Topology(8192, 8)
    views = node_views(topo)
    v1 = fold_cluster(topo, views, version=1)
    for label, changed in (("10% of nodes", range(0, 1024, 10)), ("every node", range(1024))):
        moved = dict(views)
        for n in changed:
            reports = {r: replace(rank_report(r), seq=999) for r in topo.ranks_on(n)}
            moved[n] = fold_node(topo, n, reports, None)
        folded = fold_cluster(topo, moved, version=2)
        keep = set(changed)  # as ClusterState keeps them: the others are the same objects
        nodes = tuple(folded.nodes[n] if n in keep else v1.nodes[n] for n in range(1024))
        sender, reader = ViewSender(), ViewReader()
        sender.update(v1)
        reader.apply(sender.since((b"", 0)), (b"", 0))
        asked = reader.position
        sender.update(replace(folded, nodes=nodes))
        delta = sender.since(asked)
        assert delta is not None

        def refresh() -> object:
            reader.view, reader.epoch = v1, asked[0]
            return reader.apply(delta, asked)

        t = median_time_s(refresh, repeats=7, number=1)
        info(f"a display's view refresh, 1,024 nodes, {label} changed", t * 1e3, "ms")
        info(f"  its bytes, {label} changed", len(delta) / 1024, "KiB")


def fleet_capacity_refresh() -> None:
    """A controller's whole view refresh at 1,024 nodes x 8 ranks when 10% of the nodes'
    gauges moved (issue 25's target: 2 ms and 64 KiB), and when every node's did: the
    capacity delta (kvfold.aggregator.capacity_delta) decoded into its table and taken by
    the policy, beside the same refresh through view deltas (decode the entries, fold
    capacity from the whole view), same run."""
    topo = Topology(8192, 8)
    views = node_views(topo)
    v1 = fold_cluster(topo, views, version=1)
    cid = "scheduler-a-1f2e3d4c"
    for label, changed in (("10% of nodes", range(0, 1024, 10)), ("every node", range(1024))):
        moved = dict(views)
        for n in changed:
            reports = {}
            for r in topo.ranks_on(n):
                rep = rank_report(r)
                gpu = {
                    w: replace(g, num_blocks_used=g.num_blocks_used + 7) for w, g in rep.gpu.items()
                }
                reports[r] = replace(rep, seq=999, gpu=gpu)
            moved[n] = fold_node(topo, n, reports, None)
        folded = fold_cluster(topo, moved, version=2)
        keep = set(changed)
        nodes = tuple(folded.nodes[n] if n in keep else v1.nodes[n] for n in range(1024))
        t_cap, t_view, cap_bytes, view_bytes = _capacity_against_view(
            v1, replace(folded, nodes=nodes), cid
        )
        if label.startswith("10%"):
            report(
                f"controller's refresh by capacity delta, {label} changed", t_cap * 1e3, "ms", 2.0
            )
            report("  its bytes", cap_bytes / 1024, "KiB", 64.0)
        else:
            info(f"controller's refresh by capacity delta, {label} changed", t_cap * 1e3, "ms")
            info("  its bytes", cap_bytes / 1024, "KiB")
        info("  the same by view delta (entries decoded, capacity folded)", t_view * 1e3, "ms")
        info("  its bytes", view_bytes / 1024, "KiB")
        info("  capacity / view, time", t_cap / t_view, "x")


def _capacity_against_view(
    v1: ClusterView, v2: ClusterView, cid: str
) -> tuple[float, float, int, int]:
    """Median seconds of a controller's refresh from v1 to v2 by capacity delta and by
    view delta, and their bytes."""
    cap_sender, cap_reader = CapacitySender(), CapacityReader()
    cap_sender.update(v1)
    cap_reader.apply(cap_sender.since(NOTHING, cid), NOTHING)
    cap_asked = cap_reader.position
    cap_sender.update(v2)
    cap_delta = cap_sender.since(cap_asked, cid)
    assert cap_delta is not None
    base_table, base_index = copy.deepcopy((cap_reader._table, cap_reader.index))

    view_sender, view_reader = ViewSender(), ViewReader()
    view_sender.update(v1)
    view_reader.apply(view_sender.since(NOTHING), NOTHING)
    view_asked = view_reader.position
    view_sender.update(v2)
    view_delta = view_sender.since(view_asked)
    assert view_delta is not None

    def reset_capacity() -> None:
        cap_reader._table, cap_reader.index = copy.deepcopy((base_table, base_index))

    def take_capacity(policy: AdmissionPolicy) -> None:
        index = cap_reader.apply(cap_delta, cap_asked)
        assert index is not None
        policy.load_capacity(index, 0.0)

    def reset_view() -> None:
        view_reader.view, view_reader.epoch = v1, view_asked[0]

    def take_view(policy: AdmissionPolicy) -> None:
        view = view_reader.apply(view_delta, view_asked)
        assert view is not None
        policy.load_view(view, 0.0)

    def refresh(reset: Callable[[], None], take: Callable[[AdmissionPolicy], None]) -> Any:
        """A controller holding v1's index takes v2 (timed: the take alone)."""
        reset()
        policy = AdmissionPolicy(controller_id=cid)
        policy.index = base_index
        t0 = time.perf_counter()
        take(policy)
        timed.append(time.perf_counter() - t0)
        return policy

    timed: list[float] = []
    assert refresh(reset_capacity, take_capacity).index.same_as(CapacityIndex.of_view(v2, cid))
    for _ in range(15):
        refresh(reset_capacity, take_capacity)
    t_cap = statistics.median(timed[1:])
    timed.clear()
    for _ in range(5):
        refresh(reset_view, take_view)
    return t_cap, statistics.median(timed), len(cap_delta), len(view_delta)


if __name__ == "__main__":
    main()
    fleet_refresh()
    fleet_capacity_refresh()

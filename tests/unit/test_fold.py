"""Folding ranks -> nodes -> cluster: counts summed, never ratios; order-independent."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvfold.aggregator.fold import RankRecord, fold_cluster, fold_node
from kvfold.stats import BlockGauges, HostStats, SequenceStatus, sum_gauges
from kvfold.topology import Topology
from kvfold.view import SourceState
from tests.unit.builders import make_report

FRESH = SourceState.FRESH


def fold_all(topo, reports, hosts, order):  # type: ignore[no-untyped-def]
    views = {}
    for node in order:
        ranks = [r for r in topo.ranks_on(node) if r in reports]
        random.Random(node).shuffle(ranks)
        views[node] = fold_node(topo, node, {r: reports[r] for r in ranks}, hosts.get(node))
    return fold_cluster(topo, views)


@st.composite
def clusters(draw):  # type: ignore[no-untyped-def]
    world = draw(st.integers(1, 24))
    gpn = draw(st.integers(1, 8))
    topo = Topology(world, gpn)
    reports = {}
    for r in range(world):
        total = draw(st.integers(0, 64))
        used = draw(st.integers(0, total))
        cached = draw(st.integers(0, total - used))
        reports[r] = make_report(
            r,
            used,
            total,
            cached,
            window=draw(st.sampled_from([None, 8])),
            reused=draw(st.integers(0, 50)),
            missed=draw(st.integers(0, 50)),
            statuses={s: draw(st.integers(0, 3)) for s in SequenceStatus},
            unbound=draw(st.booleans()) and draw(st.booleans()),
        )
    hosts = {
        n: HostStats(num_blocks_total=10 * (n + 1), num_blocks_used=n)
        for n in range(topo.num_nodes)
    }
    return topo, reports, hosts


@settings(max_examples=150, deadline=None)
@given(clusters(), st.randoms())
def test_fold_is_order_independent_and_equals_direct_sum(case, rnd) -> None:  # type: ignore[no-untyped-def]
    topo, reports, hosts = case
    nodes = list(range(topo.num_nodes))
    a = fold_all(topo, reports, hosts, nodes)
    rnd.shuffle(nodes)
    b = fold_all(topo, reports, hosts, nodes)
    assert a.gpu == b.gpu and a.host == b.host and a.counters == b.counters
    assert a.num_sequences_by_status == b.num_sequences_by_status
    direct = sum_gauges(r.gpu for r in reports.values() if r.gpu is not None)
    assert a.gpu == direct
    host_total = sum(h.num_blocks_total for h in hosts.values())
    assert a.host.num_blocks_total == host_total  # each node's host counted once
    reused = sum(r.deltas[w].reused_blocks for r in reports.values() for w in r.deltas)
    assert a.counters.total.reused_blocks == reused
    # associativity: fold any split of a node's ranks and add the parts
    for node in range(topo.num_nodes):
        ranks = [r for r in topo.ranks_on(node)]
        half = len(ranks) // 2
        left = fold_node(topo, node, {r: reports[r] for r in ranks[:half]}, None)
        right = fold_node(topo, node, {r: reports[r] for r in ranks[half:]}, None)
        whole = fold_node(topo, node, {r: reports[r] for r in ranks}, None)
        assert sum_gauges([left.gpu, right.gpu]) == whole.gpu


def test_ratios_are_never_averaged() -> None:
    topo = Topology(2, 2)
    view = fold_node(
        topo,
        0,
        {
            0: make_report(0, used=1, total=4, reused=1, missed=0),
            1: make_report(1, used=90, total=100, reused=1, missed=99),
        },
        None,
    )
    assert view.deltas.hit_rate == 2 / 101  # (1 + 1) / (1 + 0 + 1 + 99), not 0.505
    assert view.gpu_total.usage == 91 / 104  # (1 + 90) / (4 + 100), not (0.25 + 0.9) / 2
    assert view.free_percent == 100 * 13 / 104  # (3 + 10) / (4 + 100)


def test_world_10_on_4_gpu_nodes() -> None:
    topo = Topology(10, 4)
    reports = {r: make_report(r, used=r, total=16) for r in range(10)}
    views = {
        n: fold_node(topo, n, {r: reports[r] for r in topo.ranks_on(n)}, None) for n in range(3)
    }
    view = fold_cluster(topo, views)
    assert [n.num_ranks_expected for n in view.nodes] == [4, 4, 2]
    assert view.stale_ranks == view.dead_ranks == view.missing_ranks == ()
    node2 = views[2]
    assert (node2.rank_start, node2.rank_end) == (8, 10)
    assert node2.gpu_total == BlockGauges(32, 17, 0, 4, 17)  # ranks 8 and 9: 16 + 16, 8 + 9
    assert node2.num_ranks_missing == 0


def test_eight_gpu_node_statuses_and_host_once() -> None:
    topo = Topology(8, 8)
    statuses = {s: i + 1 for i, s in enumerate(SequenceStatus)}  # QUEUEING 1 .. COMPLETED 6
    reports = {r: make_report(r, used=1, statuses=statuses) for r in range(8)}
    host = HostStats(num_blocks_total=1000, num_blocks_used=10)
    view = fold_node(topo, 0, reports, host)
    # valid = IN_PREFILL 2 + PREFILLED 3 + IN_DECODE 4 + ON_HOLD 5 = 14 per rank
    assert view.num_valid_sequences == 8 * 14
    assert view.num_sequences_by_status[SequenceStatus.QUEUEING] == 8
    assert view.host == host  # once, not eight times
    cluster = fold_cluster(topo, {0: view})
    assert cluster.host.num_blocks_total == 1000


def test_unbound_and_stale_ranks() -> None:
    topo = Topology(3, 3)
    reports = {
        0: make_report(0, used=2),
        1: make_report(1, unbound=True),
        2: make_report(2, used=5),
    }
    records = {
        r: RankRecord(rep, SourceState.STALE if r == 2 else None) for r, rep in reports.items()
    }
    view = fold_node(topo, 0, records, None)
    assert view.gpu_total.num_blocks_total == 16  # rank 1 unbound: 0 total; rank 2 excluded
    assert view.rank_free_blocks == {0: 14, 1: 0}
    assert view.stale_ranks == (2,)
    empty = fold_node(topo, 0, {}, None)
    assert empty.free_percent == 0.0 and empty.num_ranks_missing == 3


def test_stale_and_dead_nodes_are_excluded_and_listed() -> None:
    topo = Topology(4, 2)
    views = {
        n: fold_node(topo, n, {r: make_report(r, used=1) for r in topo.ranks_on(n)}, HostStats(5))
        for n in range(2)
    }
    view = fold_cluster(topo, views, {0: FRESH, 1: SourceState.STALE})
    assert view.gpu_total.num_blocks_total == 32  # node 0 only
    assert view.host.num_blocks_total == 5
    assert view.stale_nodes == (1,) and view.stale_ranks == (2, 3)
    dead = fold_cluster(topo, {0: views[0]}, {1: SourceState.DEAD})
    assert dead.dead_ranks == (2, 3) and dead.dead_nodes == (1,)
    missing = fold_cluster(topo, {0: views[0]})
    assert missing.missing_nodes == (1,) and missing.missing_ranks == (2, 3)

"""A restarted aggregator goes on from the counters its predecessor carried: through a node
actor's restart before it, a node that never reports again, and one that restarts after."""

from __future__ import annotations

from kvfold.aggregator.cluster_state import ClusterState
from kvfold.aggregator.fold import fold_node
from kvfold.codec import encode_node_report
from kvfold.stats import BlockDeltas, RankReport, SequenceStatus
from kvfold.topology import Topology

TOPO = Topology(4, 2)


def node_report(node: int, incarnation: int, seq: int, alloc: int) -> bytes:
    reports = {
        r: RankReport(
            r,
            1,
            seq,
            None,
            {None: BlockDeltas(alloc_total_blocks=alloc, alloc_new_blocks=alloc)},
            dict.fromkeys(SequenceStatus, 0),
        )
        for r in TOPO.ranks_on(node)
    }
    return encode_node_report(fold_node(TOPO, node, reports, None), incarnation, seq)


def total(state: ClusterState) -> int:
    return state.view(0.0).counters.total.alloc_total_blocks


def test_counters_go_on_across_an_aggregator_restart() -> None:
    first = ClusterState(TOPO, (None,), 1.0, 2.0)
    assert first.receive(node_report(0, 1, 1, 5), 0.0) == "accepted"  # 2 ranks x 5
    assert first.receive(node_report(1, 1, 1, 7), 0.0) == "accepted"
    assert first.receive(node_report(0, 2, 1, 3), 0.0) == "accepted"  # node 0 restarted
    assert total(first) == 10 + 14 + 6
    second = ClusterState(TOPO, (None,), 1.0, 2.0)
    second.carry_counters(first.carried_counters())
    assert total(second) == 30  # before any node reports again
    assert second.receive(node_report(0, 2, 2, 4), 0.0) == "accepted"  # same life, grown
    assert total(second) == 10 + 8 + 14  # its live counters supersede what was carried
    assert second.receive(node_report(1, 9, 1, 1), 0.0) == "accepted"  # node 1 restarted
    assert total(second) == 10 + 8 + 14 + 2
    third = ClusterState(TOPO, (None,), 1.0, 2.0)
    third.carry_counters(second.carried_counters())
    assert total(third) == total(second)  # and again, node 1's earlier life included

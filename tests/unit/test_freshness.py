from __future__ import annotations

import pytest

from kvfold.aggregator.fold import RankRecord, fold_node
from kvfold.aggregator.freshness import FreshnessTracker, Verdict
from kvfold.topology import Topology
from kvfold.view import SourceState
from tests.unit.builders import make_report


def test_stale_then_dead_then_back() -> None:
    f = FreshnessTracker(stale_after_s=0.3, dead_after_s=1.0)
    assert f.state("r0", 0.0) is SourceState.MISSING
    assert f.observe("r0", 1, 1, now_s=10.0) is Verdict.NEW_INCARNATION
    assert f.state("r0", 10.29) is SourceState.FRESH
    assert f.state("r0", 10.3) is SourceState.STALE
    assert f.state("r0", 11.0) is SourceState.DEAD
    assert f.observe("r0", 1, 2, now_s=11.5) is Verdict.ACCEPTED  # partition healed
    assert f.state("r0", 11.5) is SourceState.FRESH


def test_duplicates_reorders_and_retired_incarnations_are_dropped_and_counted() -> None:
    f = FreshnessTracker(1.0, 2.0)
    f.observe("r", 7, 1, 0.0)
    f.observe("r", 7, 3, 0.1)
    assert f.observe("r", 7, 3, 0.2) is Verdict.DUPLICATE
    assert f.observe("r", 7, 2, 0.2) is Verdict.LATE  # overtaken: its counts still count
    assert f.observe("r", 7, 2, 0.2) is Verdict.DUPLICATE  # but only once
    f.observe("r", 7, 100, 0.25)
    assert f.observe("r", 7, 50, 0.25) is Verdict.OUT_OF_ORDER  # too far behind (window 32)
    assert f.observe("r", 9, 1, 0.3) is Verdict.NEW_INCARNATION  # restarted
    assert f.observe("r", 7, 101, 0.4) is Verdict.RETIRED  # a late report of the old life
    assert f.dropped == {"duplicate": 2, "out_of_order": 1, "retired_incarnation": 1}
    assert f.incarnation("r") == 9 and f.num_restarts == 1


def test_told_dead_until_a_new_incarnation() -> None:
    f = FreshnessTracker(1.0, 2.0)
    f.observe("r", 1, 1, 0.0)
    f.mark_dead("r")
    assert f.state("r", 0.1) is SourceState.DEAD
    assert f.observe("r", 1, 2, 0.2) is Verdict.RETIRED
    assert f.observe("r", 2, 1, 0.3) is Verdict.NEW_INCARNATION
    assert f.state("r", 0.3) is SourceState.FRESH


def test_bad_limits() -> None:
    with pytest.raises(ValueError, match="stale_after_s"):
        FreshnessTracker(0, 1)
    with pytest.raises(ValueError, match="dead_after_s"):
        FreshnessTracker(2, 1)


def test_silent_rank_leaves_the_node_totals_and_restart_counts_once() -> None:
    topo = Topology(2, 2)
    f = FreshnessTracker(0.3, 1.0)
    reports = {}
    for r in (0, 1):
        f.observe(r, 1, 1, 0.0)
        reports[r] = make_report(r, used=4, incarnation=1)
    f.observe(0, 1, 2, 0.5)  # rank 0 keeps reporting, rank 1 goes silent
    states = {r: f.state(r, 0.5) for r in (0, 1)}
    view = fold_node(topo, 0, {r: RankRecord(reports[r], states[r]) for r in reports}, None)
    assert view.gpu_total.num_blocks_total == 16 and view.stale_ranks == (1,)
    # rank 1 restarts: a new incarnation replaces the old state, counted once
    assert f.observe(1, 2, 1, 0.6) is Verdict.NEW_INCARNATION
    reports[1] = make_report(1, used=0, incarnation=2)
    view = fold_node(topo, 0, {r: RankRecord(reports[r], f.state(r, 0.6)) for r in reports}, None)
    assert view.gpu_total.num_blocks_total == 32 and view.gpu_total.num_blocks_used == 4
    assert view.ranks[1].incarnation == 2


def test_node_state_counts_every_report_and_refuses_impostors() -> None:
    from kvfold.aggregator.node_state import NodeState
    from kvfold.codec import encode_rank_report

    topo = Topology(4, 2)
    state = NodeState(topo, 0, (None,), 0.3, 1.0)
    real = {0: 11, 1: 22}

    def verify(rank: int, incarnation: int) -> bool:
        return real.get(rank) == incarnation

    first = encode_rank_report(make_report(0, used=1, incarnation=11, seq=1, reused=0))
    assert state.receive(first, 0.0, verify) == "accepted"
    ok = encode_rank_report(make_report(0, used=3, incarnation=11, seq=3, reused=4))
    assert state.receive(ok, 0.0, verify) == "accepted"
    assert state.receive(ok, 0.1, verify) == "duplicate"
    late = encode_rank_report(make_report(0, used=9, incarnation=11, seq=2, reused=5))
    assert state.receive(late, 0.1, verify) == "late"  # counted, its older snapshot unused
    assert state.receive(late, 0.1, verify) == "duplicate"  # once only
    assert state.receive(first, 0.1, verify) == "duplicate"  # a replay of a seen report
    assert state.fold(0.1, None).counters.total.reused_blocks == 4 + 5
    impostor = encode_rank_report(make_report(0, used=0, incarnation=99, seq=5))
    assert state.receive(impostor, 0.2, verify) == "identity_mismatch"
    other_node = encode_rank_report(make_report(2, incarnation=1))
    assert state.receive(other_node, 0.2, verify) == "rank_not_on_node"
    assert state.receive(b"\xff\x00", 0.2, verify) == "bad_msgpack"
    assert state.fold(0.2, None).gpu_total.num_blocks_used == 3  # the impostor changed nothing
    assert state.num_received == 9 and state.num_accepted == 3
    assert dict(state.refused) == {
        "duplicate": 3,
        "identity_mismatch": 1,
        "rank_not_on_node": 1,
        "bad_msgpack": 1,
    }


def test_a_source_never_heard_from_can_be_told_dead() -> None:
    f = FreshnessTracker(1.0, 2.0)
    f.mark_dead("n2")  # e.g. its machine is gone before this aggregator ever heard from it
    assert f.state("n2", 0.0) is SourceState.DEAD
    assert f.observe("n2", 5, 1, 0.1) is Verdict.NEW_INCARNATION  # it may still come back
    assert f.state("n2", 0.1) is SourceState.FRESH

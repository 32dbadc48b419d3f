"""A view's capacity sent to controllers as deltas (kvfold.aggregator.capacity_delta)
against the capacity of the views themselves, and that against a recount.

A real ClusterState (3 nodes, the last partial; two windows) takes node reports whose
ranks move their gauges or only report again, show tickets of two controllers, or are
an engine's (commitments unknown); nodes go stale and dead as time passes; the
aggregator restarts with versions above or below the old ones. Two controllers read at
their own pace, answers also applied late. Every index a controller rebuilds must be the
index of the view that aggregator had at that version, as a recount from the view's
ranks says it is, and a report that moved nothing a decision reads sends no node. A
controller given every whole view (ViewCapacity) holds the same index.
"""

from __future__ import annotations

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvfold.admission.capacity import CapacityIndex, ViewCapacity
from kvfold.aggregator.capacity_delta import CapacityReader, CapacitySender
from kvfold.aggregator.cluster_state import ClusterState
from kvfold.aggregator.fold import fold_node
from kvfold.aggregator.view_delta import NOTHING
from kvfold.codec import encode_node_report
from kvfold.stats import BlockDeltas, BlockGauges, RankReport, SequenceStatus
from kvfold.topology import Topology
from kvfold.view import ClusterView, SourceState

TOPO = Topology(7, 3)  # nodes of 3, 3 and 1 ranks
WINDOWS = (None, 32)
CONTROLLERS = ("ctl-a", "ctl-b")


def rank_report(
    rank: int, seq: int, used: int, tickets: dict[str, int], engine: bool
) -> RankReport:
    gauges = {None: BlockGauges(64, used, 0, 16, min(64, used + 3))}
    if used % 5:  # else a rank without the sliding window's pool
        gauges[32] = BlockGauges(16, used % 17, 0, 16, used % 17)
    return RankReport(
        rank,
        1,
        seq,
        gauges,
        {None: BlockDeltas(alloc_total_blocks=used)},
        dict.fromkeys(SequenceStatus, 0),
        tickets=tickets,
        unknown=frozenset({"committed"}) if engine else frozenset(),
    )


def recount(view: ClusterView, controller: str) -> dict[str, object]:
    """What a controller may promise on, rank by rank from the view (the oracle)."""
    n = view.world_size
    fresh = np.zeros(n, dtype=bool)
    seen = np.zeros(n, dtype=np.int64)
    room: dict[object, list[int]] = {}
    total: dict[object, list[int]] = {}
    unknown = 0
    for node in view.nodes:
        for r in node.ranks:
            seen[r.rank] = r.tickets.get(controller, 0)
            live = node.state is SourceState.FRESH and r.state is SourceState.FRESH and r.gpu
            if not live or r.gpu is None:
                continue
            if "committed" in r.unknown:
                unknown += 1
                continue
            fresh[r.rank] = True
            for w, g in r.gpu.items():
                room.setdefault(w, [0] * n)[r.rank] = g.num_blocks_room
                total.setdefault(w, [0] * n)[r.rank] = g.num_blocks_total
    windows = tuple(w for w in WINDOWS if w in room)
    return {
        "windows": windows,
        "room": [room[w] for w in windows],
        "total": [total[w] for w in windows],
        "fresh": fresh.tolist(),
        "seen": seen.tolist(),
        "unknown": unknown,
    }


def as_recount(idx: CapacityIndex) -> dict[str, object]:
    return {
        "windows": idx.windows,
        "room": idx.room.tolist(),
        "total": idx.total.tolist(),
        "fresh": idx.fresh.tolist(),
        "seen": idx.seen.tolist(),
        "unknown": idx.num_unknown,
    }


class CapacityDeltas(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.state = ClusterState(TOPO, WINDOWS, 1.0, 2.0, version_base=1000)
        self.sender = CapacitySender()
        self.readers = {c: CapacityReader() for c in CONTROLLERS}
        self.whole_views = {c: ViewCapacity(c) for c in CONTROLLERS}
        self.seqs = [0] * TOPO.num_nodes
        self.used = [0] * TOPO.world_size
        self.tickets: list[dict[str, int]] = [{} for _ in range(TOPO.world_size)]
        self.engine = [False] * TOPO.world_size
        self.history: dict[tuple[bytes, int], ClusterView] = {}
        self.pending: list[tuple[str, bytes | None, tuple[bytes, int]]] = []

    def _serve(self) -> ClusterView:
        view = self.state.view(self.now)
        self.sender.update(view)
        self.history[(self.sender.epoch, view.version)] = view
        for c, whole in self.whole_views.items():  # a controller given whole views
            assert whole.index(view).same_as(CapacityIndex.of_view(view, c))
        return view

    def _report(self, node: int) -> None:
        self.seqs[node] += 1
        reports = {
            r: rank_report(r, self.seqs[node], self.used[r], dict(self.tickets[r]), self.engine[r])
            for r in TOPO.ranks_on(node)
        }
        data = encode_node_report(fold_node(TOPO, node, reports, None), 1, self.seqs[node])
        assert self.state.receive(data, self.now) == "accepted"

    def _check(self, controller: str, got: CapacityIndex | None) -> None:
        if got is None:
            return
        view = self.history[self.readers[controller].position]
        assert got.same_as(CapacityIndex.of_view(view, controller))
        assert as_recount(got) == recount(view, controller)

    @rule(
        node=st.integers(0, TOPO.num_nodes - 1),
        used=st.integers(0, 64),
        rank_in_node=st.integers(0, 2),
    )
    def gauges_move(self, node: int, used: int, rank_in_node: int) -> None:
        ranks = TOPO.ranks_on(node)
        self.used[ranks[rank_in_node % len(ranks)]] = used
        self._report(node)

    @rule(node=st.integers(0, TOPO.num_nodes - 1))
    def report_again_with_nothing_moved(self, node: int) -> None:
        before = self._serve().nodes[node]
        sent_at = self.sender._changed_at[node]
        self._report(node)
        after = self._serve().nodes[node]
        same_states = (before.state, [r.state for r in before.ranks]) == (
            after.state,
            [r.state for r in after.ranks],
        )
        if before.last_report_s is not None and same_states:
            # its view entry changed (a new report); what a decision reads did not
            assert after != before and self.sender._changed_at[node] == sent_at

    def _sent(self, asked: tuple[bytes, int], controller: str) -> bytes | None:
        self._serve()
        return self.sender.since(asked, controller)

    @rule(rank=st.integers(0, TOPO.world_size - 1), c=st.sampled_from(CONTROLLERS))
    def ticket_shown(self, rank: int, c: str) -> None:
        self.tickets[rank][c] = self.tickets[rank].get(c, 0) + 1
        self._report(TOPO.node_of(rank))

    @rule(rank=st.integers(0, TOPO.world_size - 1))
    def becomes_an_engine_rank_or_back(self, rank: int) -> None:
        self.engine[rank] = not self.engine[rank]
        self._report(TOPO.node_of(rank))

    @rule(dt=st.sampled_from([0.0, 0.3, 1.2, 2.5]))
    def advance(self, dt: float) -> None:
        self.now += dt

    @rule(c=st.sampled_from(CONTROLLERS))
    def read(self, c: str) -> None:
        reader = self.readers[c]
        asked = reader.position
        got = reader.apply(self._sent(asked, c), asked)
        assert got is not None and got.version == self.state.view(self.now).version
        self._check(c, got)

    @rule(c=st.sampled_from(CONTROLLERS))
    def ask_now_apply_later(self, c: str) -> None:
        asked = self.readers[c].position
        self.pending.append((c, self._sent(asked, c), asked))

    @precondition(lambda self: self.pending)
    @rule(i=st.integers(0, 3))
    def apply_late(self, i: int) -> None:
        c, data, asked = self.pending.pop(i % len(self.pending))
        self._check(c, self.readers[c].apply(data, asked))

    @rule(grow=st.integers(-4, 20))
    def restart_aggregator(self, grow: int) -> None:
        served = max((v for _, v in self.history), default=1000)
        self.state = ClusterState(TOPO, WINDOWS, 1.0, 2.0, version_base=max(1, served + grow))
        self.seqs = [0] * TOPO.num_nodes
        self.sender = CapacitySender()

    @invariant()
    def a_new_controller_gets_everything_and_a_current_one_nothing(self) -> None:
        if self.sender.version < 0:
            return
        view = self.history[(self.sender.epoch, self.sender.version)]
        for c in CONTROLLERS:
            got = CapacityReader().apply(self.sender.since(NOTHING, c), NOTHING)
            assert got is not None and as_recount(got) == recount(view, c)
            reader = CapacityReader()
            reader.apply(self.sender.since(NOTHING, c), NOTHING)
            assert self.sender.since(reader.position, c) is None


TestCapacityDeltas = CapacityDeltas.TestCase
TestCapacityDeltas.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


def test_a_report_that_moves_nothing_a_decision_reads_sends_no_node() -> None:
    state = ClusterState(TOPO, WINDOWS, 1.0, 2.0, version_base=10)
    sender, reader = CapacitySender(), CapacityReader()

    def report(seq: int, used: int) -> None:
        reports = {r: rank_report(r, seq, used, {"ctl-a": 3}, False) for r in TOPO.ranks_on(0)}
        data = encode_node_report(fold_node(TOPO, 0, reports, None), 1, seq)
        assert state.receive(data, 0.0) == "accepted"
        sender.update(state.view(0.0))

    report(1, 5)
    reader.apply(sender.since(NOTHING, "ctl-a"), NOTHING)
    asked = reader.position
    report(2, 5)  # the same gauges, a new report: its view entry changed, its rows did not
    data = sender.since(asked, "ctl-a")
    assert data is not None
    got = reader.apply(data, asked)
    assert got is not None and got.version > asked[1]
    assert sender._changed_at[0] == asked[1]  # node 0's rows were not sent again
    report(3, 9)
    assert sender._changed_at[0] == sender.version
    asked = reader.position
    got = reader.apply(sender.since(asked, "ctl-a"), asked)
    assert got is not None and got.room[0][0] == 64 - 12


def test_a_new_topology_sends_everything() -> None:
    """Within one sender's life the world grows: a controller of the old one starts over."""
    small, big = Topology(4, 2), Topology(6, 2)
    sender, reader = CapacitySender(), CapacityReader()
    for topo in (small, big):
        state = ClusterState(topo, WINDOWS, 1.0, 2.0, version_base=100 if topo is small else 200)
        reports = {r: rank_report(r, 1, 9, {}, False) for r in topo.ranks_on(0)}
        data = encode_node_report(fold_node(topo, 0, reports, None), 1, 1)
        assert state.receive(data, 0.0) == "accepted"
        view = state.view(0.0)
        sender.update(view)
        asked = reader.position
        got = reader.apply(sender.since(asked, "ctl-a"), asked)
        assert got is not None and got.same_as(CapacityIndex.of_view(view, "ctl-a"))


def test_a_window_no_candidate_has_any_more_leaves_the_index() -> None:
    state = ClusterState(TOPO, WINDOWS, 1.0, 2.0, version_base=10)
    sender, reader = CapacitySender(), CapacityReader()
    for seq, used in enumerate((7, 5), start=1):  # 7: both pools; 5: the full one alone
        for node in range(TOPO.num_nodes):
            reports = {r: rank_report(r, seq, used, {}, False) for r in TOPO.ranks_on(node)}
            data = encode_node_report(fold_node(TOPO, node, reports, None), 1, seq)
            assert state.receive(data, 0.0) == "accepted"
        view = state.view(0.0)
        sender.update(view)
        asked = reader.position
        got = reader.apply(sender.since(asked, "ctl-a"), asked)
        assert got is not None and as_recount(got) == recount(view, "ctl-a")
        assert got.windows == ((None, 32) if used == 7 else (None,))

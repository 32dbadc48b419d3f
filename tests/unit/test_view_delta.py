"""Views sent as deltas (kvfold.aggregator.view_delta) against the views themselves.

A real ClusterState (3 nodes, the last partial) takes node reports, nodes go stale and
dead as time passes, and the aggregator restarts (a new state and sender, versions
going on from a higher base). Two readers read at their own pace, and answers are also
applied late, after the reader has moved on (two threads sharing one client). Every
view a reader rebuilds must equal the view the aggregator had at that version, and a
reader never goes back to an older version.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvfold.aggregator.cluster_state import ClusterState
from kvfold.aggregator.fold import fold_node
from kvfold.aggregator.view_delta import ViewReader, ViewSender
from kvfold.codec import encode_node_report
from kvfold.stats import BlockDeltas, BlockGauges, RankReport, SequenceStatus
from kvfold.topology import Topology
from kvfold.view import ClusterView

TOPO = Topology(7, 3)  # nodes of 3, 3 and 1 ranks


def node_report(node: int, seq: int, used: int) -> bytes:
    reports = {
        r: RankReport(
            r,
            1,
            seq,
            {None: BlockGauges(num_blocks_total=64, num_blocks_used=used, tokens_per_block=16)},
            {None: BlockDeltas(alloc_total_blocks=used, alloc_new_blocks=used)},
            dict.fromkeys(SequenceStatus, 0),
        )
        for r in TOPO.ranks_on(node)
    }
    return encode_node_report(fold_node(TOPO, node, reports, None), 1, seq)


class ViewDeltas(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.state = ClusterState(TOPO, (None,), 1.0, 2.0, version_base=1000)
        self.sender = ViewSender()
        self.readers = [ViewReader(), ViewReader()]
        self.seqs = [0] * TOPO.num_nodes
        self.history: dict[int, ClusterView] = {}  # every version served
        self.held = [0, 0]  # the newest version each reader returned
        self.pending: list[tuple[int, bytes | None, int]] = []  # answers not applied yet

    def _serve(self) -> ClusterView:
        view = self.state.view(self.now)
        self.sender.update(view)
        self.history[view.version] = view
        return view

    def _check(self, reader: int, got: ClusterView | None) -> None:
        if got is None:
            return
        assert got == self.history[got.version]
        assert got.version >= self.held[reader]
        self.held[reader] = got.version

    @rule(node=st.integers(0, TOPO.num_nodes - 1), used=st.integers(0, 64))
    def report(self, node: int, used: int) -> None:
        self.seqs[node] += 1
        assert self.state.receive(node_report(node, self.seqs[node], used), self.now) == "accepted"

    @rule(dt=st.sampled_from([0.0, 0.3, 1.2, 2.5]))
    def advance(self, dt: float) -> None:
        self.now += dt

    @rule(reader=st.integers(0, 1))
    def read(self, reader: int) -> None:
        view = self._serve()
        r = self.readers[reader]
        have = r.version
        got = r.apply(self.sender.since(have), have)
        assert got is not None and got == view  # nothing else moved it
        self._check(reader, got)

    @rule(reader=st.integers(0, 1))
    def ask_now_apply_later(self, reader: int) -> None:
        self._serve()
        have = self.readers[reader].version
        self.pending.append((reader, self.sender.since(have), have))

    @precondition(lambda self: self.pending)
    @rule(i=st.integers(0, 3))
    def apply_late(self, i: int) -> None:
        reader, data, have = self.pending.pop(i % len(self.pending))
        self._check(reader, self.readers[reader].apply(data, have))

    @rule(grow=st.integers(1, 50))
    def restart_aggregator(self, grow: int) -> None:
        """A new aggregator: its versions start above everything the old one served."""
        base = max(self.history, default=1000) + grow
        self.state = ClusterState(TOPO, (None,), 1.0, 2.0, version_base=base)
        self.seqs = [0] * TOPO.num_nodes
        self.sender = ViewSender()
        self.pending.clear()

    @invariant()
    def a_new_reader_gets_the_whole_view_and_a_current_one_nothing(self) -> None:
        view = self.sender.view
        if view is None:
            return
        reader = ViewReader()
        whole = self.sender.since(reader.version)
        assert whole is not None
        reader.apply(whole, 0)
        assert reader.view == view
        assert self.sender.since(view.version) is None


TestViewDeltas = ViewDeltas.TestCase
TestViewDeltas.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)

"""Views sent as deltas (kvfold.aggregator.view_delta) against the views themselves.

A real ClusterState (3 nodes, the last partial) takes node reports, nodes go stale and
dead as time passes, and the aggregator restarts (a new state and sender, its versions
starting higher or, on a machine whose clock is behind, lower). Two readers read at their
own pace, and answers are also applied late, after the reader has moved on, across
restarts too (as when two threads share one client). Every view a reader rebuilds must
equal the view that aggregator had at that version, and within one aggregator's life a
reader never goes back to an older version. Then KVFoldClient.wait_for_version over a
real sender (its Ray call the only seam).
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvfold.aggregator.client import KVFoldClient
from kvfold.aggregator.cluster_state import ClusterState
from kvfold.aggregator.fold import fold_node
from kvfold.aggregator.view_delta import NOTHING, ViewReader, ViewSender
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
        self.history: dict[tuple[bytes, int], ClusterView] = {}  # every (epoch, version) served
        self.held: list[tuple[bytes, int]] = [NOTHING, NOTHING]  # what each reader returned
        self.pending: list[tuple[int, bytes | None, tuple[bytes, int]]] = []  # not applied yet

    def _serve(self) -> ClusterView:
        view = self.state.view(self.now)
        self.sender.update(view)
        self.history[(self.sender.epoch, view.version)] = view
        return view

    def _check(self, reader: int, got: ClusterView | None) -> None:
        if got is None:
            return
        position = self.readers[reader].position
        assert position[1] == got.version
        assert got == self.history[position]
        epoch, version = self.held[reader]
        if epoch == position[0]:
            assert got.version >= version
        self.held[reader] = position

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
        asked = r.position
        got = r.apply(self.sender.since(asked), asked)
        assert got is not None and got == view  # nothing else moved it
        self._check(reader, got)

    @rule(reader=st.integers(0, 1))
    def ask_now_apply_later(self, reader: int) -> None:
        self._serve()
        asked = self.readers[reader].position
        self.pending.append((reader, self.sender.since(asked), asked))

    @precondition(lambda self: self.pending)
    @rule(i=st.integers(0, 3))
    def apply_late(self, i: int) -> None:
        reader, data, asked = self.pending.pop(i % len(self.pending))
        self._check(reader, self.readers[reader].apply(data, asked))

    @rule(grow=st.integers(-4, 20))
    def restart_aggregator(self, grow: int) -> None:
        """A new aggregator: its versions start from its own clock's base, above what the
        old one served or (a clock behind) below it."""
        served = max((v for _, v in self.history), default=1000)
        self.state = ClusterState(TOPO, (None,), 1.0, 2.0, version_base=max(1, served + grow))
        self.seqs = [0] * TOPO.num_nodes
        self.sender = ViewSender()

    @invariant()
    def a_new_reader_gets_the_whole_view_and_a_current_one_nothing(self) -> None:
        view = self.sender.view
        if view is None:
            return
        reader = ViewReader()
        whole = self.sender.since(NOTHING)
        assert whole is not None
        assert reader.apply(whole, NOTHING) == view
        assert self.sender.since(reader.position) is None


TestViewDeltas = ViewDeltas.TestCase
TestViewDeltas.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


class _AggregatorSeam:
    """KVFoldClient's Ray calls answered by a real ViewSender over a real ClusterState."""

    def __init__(self) -> None:
        self.state = ClusterState(TOPO, (None,), 1.0, 2.0, version_base=10)
        self.sender = ViewSender()

    def current(self) -> ClusterView:
        view = self.state.view(0.0)
        self.sender.update(view)
        return view

    def __call__(self, method: str, *args: object, timeout_s: float | None = None) -> object:
        view = self.current()
        if method == "view_since":
            return self.sender.since(args[0])  # type: ignore[arg-type]
        assert method == "wait_for_version"
        version, _, position = args
        if view.version <= version:  # type: ignore[operator]
            return None  # timed out: nothing newer came
        return self.sender.since(position)  # type: ignore[arg-type]


def test_wait_for_version_returns_the_held_view_when_it_is_already_newer() -> None:
    seam = _AggregatorSeam()
    client = KVFoldClient.__new__(KVFoldClient)  # no Ray: only its reader and its calls
    client._reader = ViewReader()
    client._call = seam  # type: ignore[method-assign]
    assert seam.state.receive(node_report(0, 1, 5), 0.0) == "accepted"
    v = client.view()
    assert v == seam.current()
    older = v.version - 1
    got = client.wait_for_version(older, timeout_s=0.1)  # this client already holds newer
    assert got is not None and got.version > older and got == seam.current()
    assert client.wait_for_version(v.version, timeout_s=0.1) is None  # nothing newer: timeout
    assert seam.state.receive(node_report(1, 1, 9), 0.0) == "accepted"
    got = client.wait_for_version(v.version, timeout_s=0.1)
    assert got is not None and got == seam.current() and got.version > v.version


def test_a_reader_of_a_restarted_aggregator_with_lower_versions_gets_the_whole_view() -> None:
    """The new aggregator's clock is behind: its versions pass through the one the reader
    holds from the old aggregator. Nodes it has not heard from yet must not keep what the
    old one said about them."""
    old = ClusterState(TOPO, (None,), 1.0, 2.0, version_base=100)
    sender, reader = ViewSender(), ViewReader()
    for node in range(TOPO.num_nodes):
        assert old.receive(node_report(node, 1, 7), 0.0) == "accepted"
        sender.update(old.view(0.0))
    reader.apply(sender.since(NOTHING), NOTHING)
    held = reader.position
    new = ClusterState(TOPO, (None,), 1.0, 2.0, version_base=held[1] - 2)
    restarted = ViewSender()
    for seq in range(1, 6):  # only node 0 reports to the new aggregator
        assert new.receive(node_report(0, seq, seq), 0.0) == "accepted"
        restarted.update(new.view(0.0))
    current = new.view(0.0)
    assert restarted.first_version <= held[1] < current.version
    assert reader.apply(restarted.since(held), held) == current

"""Every counter a reader can see goes on through rank, node-actor and aggregator
restarts: a state machine drives ranks -> node actors (NodeState) -> the aggregator
(ClusterState) through the real codec, restarts each kind at random, and compares every
published view (and the refused and decision counts beside it) with every earlier one.
The aggregator's shell is modelled as it is: it hands its counters on (`take_carry`)
before it publishes a view, and a restarted one starts from the last ones handed on.

It also checks the other side: nothing is counted twice, so a published counter never
exceeds what the ranks counted (a node actor's restart may lose what it had not sent
yet; it never makes anything up).
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import count

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvfold.aggregator.cluster_state import ClusterState
from kvfold.aggregator.node_state import NodeState
from kvfold.codec import encode_node_report, encode_rank_report
from kvfold.stats import (
    DELTA_FIELDS,
    HOST_COUNTER_FIELDS,
    BlockDeltas,
    BlockGauges,
    HostStats,
    RankReport,
    SequenceStatus,
)
from kvfold.topology import Topology
from kvfold.view import ClusterView

TOPO = Topology(5, 2)  # nodes of 2, 2 and 1 ranks
WINDOWS = (None, 8)
STALE_S, DEAD_S = 1.0, 2.0
_incarnations = count(1)


def rank_report(rank: int, incarnation: int, seq: int, grow: int) -> RankReport:
    deltas = {
        None: BlockDeltas(alloc_total_blocks=grow, alloc_new_blocks=grow, missed_blocks=grow),
        8: BlockDeltas(reused_blocks=grow, offloaded_blocks=grow, offloaded_bytes=64 * grow),
    }
    return RankReport(
        rank,
        incarnation,
        seq,
        {w: BlockGauges(16, 0, 0, 4) for w in WINDOWS},
        deltas,
        dict.fromkeys(SequenceStatus, 0),
    )


def readings(view: ClusterView, refused: dict, decisions: dict) -> Iterator[tuple[object, int]]:  # type: ignore[type-arg]
    """Every counter a reader sees, by name: per node and window, per node's host tier,
    the cluster's, the refused reports and the schedulers' decisions."""
    for n in view.nodes:
        for w, d in n.counters.windows.items():
            for f, v in zip(DELTA_FIELDS, d.as_tuple(), strict=True):
                yield ("node", n.node, w, f), v
        if n.host is not None:
            for f in HOST_COUNTER_FIELDS:
                yield ("host", n.node, f), getattr(n.host, f)
    for w, d in view.counters.windows.items():
        for f, v in zip(DELTA_FIELDS, d.as_tuple(), strict=True):
            yield ("cluster", w, f), v
    for f in HOST_COUNTER_FIELDS:
        yield ("cluster host", f), getattr(view.host, f)
    for key, v in refused.items():
        yield ("refused", key), v
    for key, v in decisions.items():
        yield ("decisions", key), v


class CountersGoOn(RuleBasedStateMachine):
    @initialize()
    def start(self) -> None:
        self.now_s = 0.0
        self.rank_life = {r: [next(_incarnations), 0] for r in range(TOPO.world_size)}
        self.nodes = {n: self._new_node(n) for n in range(TOPO.num_nodes)}
        self.gcs: bytes | None = None  # what the last aggregator handed on
        self.aggregator = ClusterState(TOPO, WINDOWS, STALE_S, DEAD_S)
        self.published: dict[object, int] = {}  # the highest each counter was published at
        self.truth = {"alloc": 0, "offloaded": 0, "host_offloaded": 0, "decisions": 0}
        self.scheduler_life = 0  # its counts since it last started
        self.scheduler_total = 0

    def _new_node(self, node: int) -> dict:  # type: ignore[type-arg]
        state = NodeState(TOPO, node, WINDOWS, STALE_S, DEAD_S)
        return {"state": state, "incarnation": next(_incarnations), "seq": 0, "offloads": 0}

    # ---------------------------------------------------------------- ranks

    @rule(rank=st.integers(0, TOPO.world_size - 1), grow=st.integers(0, 5))
    def rank_reports(self, rank: int, grow: int) -> None:
        life = self.rank_life[rank]
        life[1] += 1
        report = rank_report(rank, life[0], life[1], grow)
        node = self.nodes[TOPO.node_of(rank)]
        if node["state"].receive(encode_rank_report(report), self.now_s) == "accepted":
            self.truth["alloc"] += grow
            self.truth["offloaded"] += grow

    @rule(rank=st.integers(0, TOPO.world_size - 1))
    def rank_restarts(self, rank: int) -> None:
        self.rank_life[rank] = [next(_incarnations), 0]

    @rule(rank=st.integers(0, TOPO.world_size - 1))
    def node_refuses_a_rank_report(self, rank: int) -> None:
        node = self.nodes[TOPO.node_of(rank)]
        assert node["state"].receive(b"\x81\xa1v\x63", self.now_s) != "accepted"

    # ---------------------------------------------------------------- node actors

    @rule(node=st.integers(0, TOPO.num_nodes - 1), offloads=st.integers(0, 3))
    def node_pushes(self, node: int, offloads: int) -> None:
        nd = self.nodes[node]
        nd["seq"] += 1
        nd["offloads"] += offloads
        host = HostStats(32, 0, 0, offloaded_blocks=nd["offloads"])
        util = nd["state"].fold(self.now_s, host)
        data = encode_node_report(util, nd["incarnation"], nd["seq"], refused=nd["state"].refused)
        self.aggregator.receive(data, self.now_s)
        self.truth["host_offloaded"] += offloads

    @rule(node=st.integers(0, TOPO.num_nodes - 1))
    def node_actor_restarts(self, node: int) -> None:
        self.nodes[node] = self._new_node(node)  # its ranks' counts and its tier start over

    # ---------------------------------------------------------------- aggregator

    @rule()
    def aggregator_refuses_a_node_report(self) -> None:
        assert self.aggregator.receive(b"garbage", self.now_s) != "accepted"

    @rule(decided=st.integers(0, 4), restart=st.booleans())
    def scheduler_reports(self, decided: int, restart: bool) -> None:
        if restart:
            self.scheduler_life = 0
        self.scheduler_life += decided
        self.scheduler_total += decided
        self.aggregator.report_admission("s1", {"admit:fits": self.scheduler_life})

    @rule()
    def aggregator_restarts(self) -> None:
        self.aggregator = ClusterState(TOPO, WINDOWS, STALE_S, DEAD_S)
        if self.gcs is not None:
            self.aggregator.carry_counters(self.gcs)

    @rule(dt=st.sampled_from([0.1, 1.5, 3.0]))
    def time_passes(self, dt: float) -> None:
        self.now_s += dt

    @rule()
    def a_reader_looks(self) -> None:
        """What the shell does on every read: build the view, hand the counters on, then
        let the reader have it (with the refused and decision counts)."""
        view = self.aggregator.view(self.now_s)
        carry = self.aggregator.take_carry()
        if carry is not None:
            self.gcs = carry
        refused = self.aggregator.refused_totals()
        decisions = self.aggregator.admission_totals()
        for name, value in readings(view, refused, decisions):
            before = self.published.get(name, 0)
            assert value >= before, f"{name} went back from {before} to {value}"
            self.published[name] = value
        # never more than the ranks, tiers and schedulers counted
        cluster = view.counters.total
        assert cluster.alloc_total_blocks <= self.truth["alloc"]
        assert cluster.offloaded_blocks <= self.truth["offloaded"]
        assert view.host.offloaded_blocks <= self.truth["host_offloaded"]
        assert sum(decisions.values()) <= self.scheduler_total

    @invariant()
    def every_node_is_in_the_view(self) -> None:
        assert self.aggregator.view(self.now_s).num_nodes == TOPO.num_nodes


CountersGoOn.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
TestCountersGoOn = CountersGoOn.TestCase


def test_a_node_actors_restart_keeps_its_own_counters() -> None:
    """The example from the field: a node's own counters (not only the cluster's) go on."""
    node = NodeState(TOPO, 0, WINDOWS, STALE_S, DEAD_S)
    agg = ClusterState(TOPO, WINDOWS, STALE_S, DEAD_S)
    node.receive(encode_rank_report(rank_report(0, 1, 1, 5)), 0.0)
    agg.receive(encode_node_report(node.fold(0.0, None), 11, 1), 0.0)
    assert agg.view(0.0).nodes[0].counters.total.alloc_total_blocks == 5
    node = NodeState(TOPO, 0, WINDOWS, STALE_S, DEAD_S)  # the node actor restarts
    node.receive(encode_rank_report(rank_report(0, 1, 2, 2)), 0.0)
    agg.receive(encode_node_report(node.fold(0.0, None), 12, 1), 0.0)
    assert agg.view(0.0).nodes[0].counters.total.alloc_total_blocks == 5 + 2


def test_a_restarted_aggregator_shows_what_was_carried_before_nodes_report() -> None:
    node = NodeState(TOPO, 1, WINDOWS, STALE_S, DEAD_S)
    node.receive(encode_rank_report(rank_report(2, 1, 1, 4)), 0.0)
    first = ClusterState(TOPO, WINDOWS, STALE_S, DEAD_S)
    host = HostStats(32, 3, 0, offloaded_blocks=7)
    first.receive(encode_node_report(node.fold(0.0, host), 21, 1), 0.0)
    first.view(0.0)
    second = ClusterState(TOPO, WINDOWS, STALE_S, DEAD_S)
    second.carry_counters(first.take_carry() or b"")
    view = second.view(0.0)
    assert view.nodes[1].state.value == "missing"  # not heard by this aggregator yet
    assert view.nodes[1].counters.total.alloc_total_blocks == 4  # but its counters stand
    assert view.nodes[1].host is not None and view.nodes[1].host.offloaded_blocks == 7
    assert view.nodes[1].host.num_blocks_total == 0  # gauges: nothing known
    assert view.counters.total.alloc_total_blocks == 4
    assert view.host.offloaded_blocks == 7

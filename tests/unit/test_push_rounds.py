"""When a node pushes: its ranks report on the node's phase (kvfold.ray_actor.next_tick_s,
node_phase_s), and the node pushes once a round is in (kvfold.aggregator.node_state:
every fresh rank has reported since its last push). Held against a recount by a
Hypothesis state machine of reports, silences and pushes."""

from __future__ import annotations

import math
from itertools import pairwise

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvfold.aggregator.node_state import NodeState
from kvfold.codec import encode_rank_report
from kvfold.ray_actor import next_tick_s, node_phase_s
from kvfold.topology import Topology
from kvfold.view import SourceState
from tests.unit.builders import make_report

STALE_S, DEAD_S = 0.3, 1.0
TOPO = Topology(12, 4)
NODE = 1  # ranks 4..7


@given(
    now=st.floats(0.0, 1e6),
    interval=st.floats(0.01, 10.0),
    phase=st.one_of(st.none(), st.floats(0.0, 10.0)),
)
def test_the_next_tick_is_within_an_interval_and_on_the_phase(
    now: float, interval: float, phase: float | None
) -> None:
    t = next_tick_s(now, interval, phase)
    assert now < t <= now + interval * (1 + 1e-9)
    if phase is None:
        assert t == now + interval
    else:
        k = (t - phase) / interval
        assert math.isclose(k, round(k), abs_tol=1e-6)


def test_node_phases_lie_in_the_interval_and_spread_the_nodes() -> None:
    interval = 0.1
    phases = sorted(node_phase_s(n, interval) for n in range(1024))
    assert all(0.0 <= p < interval for p in phases)
    # a golden-ratio sequence: no gap between neighbours is above 3x the even spacing
    gaps = [b - a for a, b in pairwise(phases)]
    assert max(gaps) < 3 * interval / 1024 and min(gaps) > 0


class RoundMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.state = NodeState(TOPO, NODE, (None,), STALE_S, DEAD_S)
        self.now = 0.0
        self.seq = dict.fromkeys(TOPO.ranks_on(NODE), 0)
        self.last_heard: dict[int, float] = {}
        self.since_push: set[int] = set()
        self.first_at: float | None = None

    @rule(rank=st.sampled_from(list(TOPO.ranks_on(NODE))))
    def rank_reports(self, rank: int) -> None:
        self.seq[rank] += 1
        data = encode_rank_report(make_report(rank, incarnation=7, seq=self.seq[rank]))
        assert self.state.receive(data, self.now) == "accepted"
        self.last_heard[rank] = self.now
        if not self.since_push:
            self.first_at = self.now
        self.since_push.add(rank)

    @rule(dt=st.sampled_from([0.01, 0.05, 0.2, 0.5]))
    def time_passes(self, dt: float) -> None:
        self.now += dt

    @rule()
    def node_pushes(self) -> None:
        self.state.start_round()
        self.since_push.clear()
        self.first_at = None

    @invariant()
    def a_round_is_in_when_every_fresh_rank_reported_since_the_push(self) -> None:
        fresh = {
            r for r, t in self.last_heard.items() if self.now - t < STALE_S
        }  # silent past stale_after_s: not waited for
        want = bool(self.since_push) and fresh <= self.since_push
        assert self.state.round_complete(self.now) == want
        states = self.state.rank_states(self.now)
        assert {r for r, s in states.items() if s is SourceState.FRESH} == fresh
        wait = 0.05
        due = self.state.round_due_s(wait)
        assert due == (None if self.first_at is None else self.first_at + wait)


TestRoundMachine = RoundMachine.TestCase
TestRoundMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)

"""The front door's pure core (kvfold.serving.door_admission), held against an independent
recount by a Hypothesis state machine: random submits, releases, engine liveness changes
and deadlines.

- no engine is ever committed past its capacity, and each engine's committed blocks are
  the sum of what is running there (recounted here);
- the queue is strict FIFO (nothing is placed while an earlier request waits), bounded,
  and work-conserving (after every step its head fits no live engine);
- placements go only to live engines the request does not avoid, and under
  precise_prefix to the cheapest by the documented cost (recomputed here, with the
  prefill still pending on each engine: requests whose first token has not come back);
- every refusal names its reason and changes nothing.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvfold.serving.door_admission import (
    LEAST_LOADED,
    PRECISE_PREFIX,
    DoorAdmission,
    DoorRequest,
    EngineState,
    Refused,
    blocks_needed,
)
from kvfold.serving.door_view import CommittedLog

CAPACITY = (12, 20, 8)
QUEUE_LIMIT = 5


class DoorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.held: dict[str, dict[int, int]] = {}
        self.adm: DoorAdmission | None = None
        self.live = [True] * len(CAPACITY)
        self.running: dict[str, tuple[int, int]] = {}  # request -> (engine, need)
        self.to_prefill: dict[str, int] = {}  # running, first token not back -> its blocks
        self.queued: list[DoorRequest] = []  # submission order
        self.now = 0.0
        self.next_id = 0

    @rule(
        policy=st.sampled_from([PRECISE_PREFIX, LEAST_LOADED]),
        prefix_weight=st.sampled_from([1.0, 4.0, 0.0]),
        decode_weight=st.sampled_from([1.0, 0.0625, 0.0]),
    )
    @precondition(lambda self: self.adm is None)
    def start(self, policy: str, prefix_weight: float, decode_weight: float) -> None:
        self.adm = DoorAdmission(
            policy, queue_limit=QUEUE_LIMIT, held_blocks=lambda r: self.held.get(r.request_id, {}),
            prefix_weight=prefix_weight, decode_weight=decode_weight,
        )  # fmt: skip
        self.sync(self.adm.update_engines(self.states()))

    def states(self) -> list[EngineState]:
        return [EngineState(i, c, self.live[i]) for i, c in enumerate(CAPACITY)]

    def sync(self, placed: list) -> None:  # type: ignore[type-arg]
        """Placements out of the queue: in FIFO order, from its head."""
        for p in placed:
            assert self.queued and self.queued[0].request_id == p.request_id, "not FIFO"
            head = self.queued.pop(0)
            self.check_placement(head, p)

    def check_placement(self, req: DoorRequest, p) -> None:  # type: ignore[no-untyped-def]
        assert self.adm is not None
        assert self.live[p.rank] and p.rank not in req.avoid
        committed = {e: sum(n for (r, n) in self.running.values() if r == e) for e in range(3)}
        assert committed[p.rank] + req.need_blocks <= CAPACITY[p.rank]
        fits = [
            e
            for e in range(3)
            if self.live[e] and e not in req.avoid and committed[e] + req.need_blocks <= CAPACITY[e]
        ]
        # least_loaded asks the index nothing: all of its prompt is to prefill
        held = self.held.get(req.request_id, {}) if self.adm.policy == PRECISE_PREFIX else {}
        pending = {e: self.pending_prefill(e) for e in range(3)}
        if self.adm.policy == PRECISE_PREFIX:
            pw, dw = self.adm.prefix_weight, self.adm.decode_weight
            cost = {
                e: pw * max(req.prompt_blocks - held.get(e, 0), 0) + pending[e] + dw * committed[e]
                for e in fits
            }
        else:
            cost = {e: committed[e] / CAPACITY[e] for e in fits}
        best = min(fits, key=lambda e: (cost[e], e))
        assert p.rank == best, (p, cost)
        self.running[req.request_id] = (p.rank, req.need_blocks)
        self.to_prefill[req.request_id] = max(req.prompt_blocks - held.get(p.rank, 0), 0)

    def pending_prefill(self, e: int) -> int:
        return sum(b for r, b in self.to_prefill.items() if self.running[r][0] == e)

    @rule(
        need=st.integers(1, 22),
        prompt=st.integers(0, 10),
        held=st.dictionaries(st.integers(0, 2), st.integers(0, 10), max_size=3),
        avoid=st.sets(st.integers(0, 2), max_size=1),
        wait=st.floats(0.5, 5.0),
    )
    @precondition(lambda self: self.adm is not None)
    def submit(self, need: int, prompt: int, held: dict[int, int], avoid: set[int], wait: float):
        assert self.adm is not None
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.held[rid] = held
        req = DoorRequest(rid, need, prompt, self.now + wait, frozenset(avoid))
        before = (self.adm.queued, dict(self.running))
        try:
            p = self.adm.submit(req)
        except Refused as e:
            assert e.reason in ("exceeds_engine_capacity", "queue_full")
            if e.reason == "exceeds_engine_capacity":
                assert need > max(CAPACITY)
            else:
                assert len(self.queued) == QUEUE_LIMIT
            assert (self.adm.queued, dict(self.running)) == before  # nothing changed
            return
        if p is None:
            self.queued.append(req)
        else:
            assert not self.queued, "placed past a waiting request"
            self.check_placement(req, p)

    @rule(data=st.data())
    @precondition(lambda self: self.adm is not None and (self.running or self.queued))
    def release(self, data: st.DataObject) -> None:
        assert self.adm is not None
        ids = sorted(self.running) + [r.request_id for r in self.queued]
        rid = data.draw(st.sampled_from(ids))
        rank, placed = self.adm.release(rid)
        if rid in self.running:
            assert rank == self.running.pop(rid)[0]
            self.to_prefill.pop(rid, None)
        else:
            assert rank is None
            self.queued = [r for r in self.queued if r.request_id != rid]
        self.sync(placed)
        assert self.adm.release(rid) == (None, [])  # idempotent

    @rule(data=st.data())
    @precondition(lambda self: self.adm is not None and self.running)
    def first_token(self, data: st.DataObject) -> None:
        assert self.adm is not None
        rid = data.draw(st.sampled_from(sorted(self.running)))
        assert self.adm.started(rid) == (rid in self.to_prefill)
        self.to_prefill.pop(rid, None)
        assert not self.adm.started(rid)  # once

    @rule(engine=st.integers(0, 2), live=st.booleans())
    @precondition(lambda self: self.adm is not None)
    def engine_changes(self, engine: int, live: bool) -> None:
        assert self.adm is not None
        self.live[engine] = live
        self.sync(self.adm.update_engines(self.states()))

    @rule(dt=st.floats(0.1, 3.0))
    @precondition(lambda self: self.adm is not None)
    def time_passes(self, dt: float) -> None:
        assert self.adm is not None
        self.now += dt
        gone, placed = self.adm.expire(self.now)
        want = [r for r in self.queued if r.deadline < self.now]
        assert sorted(r.request_id for r in gone) == sorted(r.request_id for r in want)
        self.queued = [r for r in self.queued if r.deadline >= self.now]
        self.sync(placed)

    @invariant()
    def commitments_are_the_recount(self) -> None:
        if self.adm is None:
            return
        for e, cap in enumerate(CAPACITY):
            want = sum(n for (r, n) in self.running.values() if r == e)
            assert self.adm.committed(e) == want <= cap
            assert self.adm.running(e) == sum(1 for (r, _) in self.running.values() if r == e)
            assert self.adm.prefilling(e) == self.pending_prefill(e)
        assert self.adm.queued == len(self.queued) <= QUEUE_LIMIT

    @invariant()
    def the_head_fits_nowhere(self) -> None:
        if self.adm is None or not self.queued:
            return
        head = self.queued[0]
        for e, cap in enumerate(CAPACITY):
            if self.live[e] and e not in head.avoid:
                assert self.adm.committed(e) + head.need_blocks > cap


TestDoorMachine = DoorMachine.TestCase
TestDoorMachine.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip


def test_a_duplicate_id_is_refused_and_changes_nothing() -> None:
    adm = DoorAdmission(LEAST_LOADED)
    adm.update_engines([EngineState(0, 10, True)])
    assert adm.submit(DoorRequest("a", 4, 1, 9.0)) is not None
    with pytest.raises(Refused, match="duplicate_request_id"):
        adm.submit(DoorRequest("a", 2, 1, 9.0))
    assert adm.committed(0) == 4 and adm.refused == {"duplicate_request_id": 1}


def test_blocks_needed_counts_every_sequence_to_its_declared_end() -> None:
    assert blocks_needed(33, 31, 1, 32, 1024) == 2  # 64 tokens
    assert blocks_needed(33, 32, 1, 32, 1024) == 3
    assert blocks_needed(33, None, 1, 32, 1024) == 32  # up to the model's limit
    assert blocks_needed(1000, 500, 1, 32, 1024) == 32  # never past it
    assert blocks_needed(10, 10, 3, 32, 1024) == 3
    with pytest.raises(ValueError, match="positive"):
        blocks_needed(0, 1, 1, 32, 1024)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"policy": "round_robin"}, "policy='round_robin': allowed: precise_prefix, least_loaded"),
        ({"queue_limit": -1}, "queue_limit=-1"),
        ({"max_running_per_engine": 0}, "max_running_per_engine=0"),
        ({"prefix_weight": -1.0}, "prefix_weight=-1.0"),
        ({"decode_weight": -0.5}, "decode_weight=-0.5"),
    ],
)
def test_bad_settings_are_named(kwargs: dict[str, object], match: str) -> None:
    policy = kwargs.pop("policy", PRECISE_PREFIX)
    with pytest.raises(ValueError, match=match):
        DoorAdmission(policy, **kwargs)  # type: ignore[arg-type]


def test_the_committed_log_says_the_most_promised_over_a_span() -> None:
    log = CommittedLog([0], now=0.0)
    for t, c in ((1.0, 5), (2.0, 9), (3.0, 2), (5.0, 0)):
        log.record(0, t, c)
    assert log.most_between(0, 2.5, 4.0) == 9  # what held at 2.5 counts (set at 2.0)
    assert log.most_between(0, 3.0, 4.0) == 2
    assert log.most_between(0, 0.5, 1.5) == 5
    assert log.most_between(0, 6.0, 7.0) == 0

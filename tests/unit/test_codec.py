"""The wire format: round trips, and every bad message ends as ReportError with a reason."""

from __future__ import annotations

import random

import msgpack
import pytest

from kvfold.aggregator.fold import RankRecord, fold_node
from kvfold.codec import (
    MAX_REPORT_BYTES,
    REASONS,
    decode_node_report,
    decode_rank_report,
    encode_node_report,
    encode_rank_report,
)
from kvfold.errors import ReportError
from kvfold.stats import (
    BlockDeltas,
    BlockGauges,
    HostStats,
    IterationStats,
    RankReport,
    SequenceStatus,
    sum_deltas,
)
from kvfold.topology import Topology
from tests.unit.builders import make_report

TOPO = Topology(10, 4)


def two_window_report(rank: int = 5) -> RankReport:
    return RankReport(
        rank=rank,
        incarnation=123456789,
        seq=42,
        gpu={
            None: BlockGauges(1000, 300, 50, 16, 420),
            4096: BlockGauges(1000, 20, 5, 16, 33),
        },
        deltas={
            None: BlockDeltas(
                alloc_total_blocks=5,
                alloc_new_blocks=3,
                reused_blocks=3,
                onboarded_blocks=1,
                onboarded_bytes=4096,
                missed_blocks=2,
                gen_alloc_blocks=1,
                evicted_blocks=2,
            ),
            4096: BlockDeltas(alloc_total_blocks=1, alloc_new_blocks=1),
        },
        num_sequences_by_status={s: i for i, s in enumerate(SequenceStatus)},
        tickets={"router-a": 17, "router-b": 3},
        num_refused=2,
    )


def test_rank_report_round_trip() -> None:
    rep = two_window_report()
    data = encode_rank_report(rep)
    assert len(data) <= 512
    assert decode_rank_report(data, TOPO, node=1, windows=(None, 4096)) == rep


def test_node_report_round_trip() -> None:
    reports = {r: make_report(r, used=r, tickets={f"c{r}": r}, refused=r) for r in (8, 9)}
    util = fold_node(TOPO, 2, reports, HostStats(100, 7, 7, 3, 300))
    back = decode_node_report(encode_node_report(util, incarnation=3, seq=9), TOPO)
    assert (back.node, back.incarnation, back.seq) == (2, 3, 9)
    assert back.util == util


def test_a_rank_never_heard_from_round_trips_with_no_age() -> None:
    """Ray said its actor died before it ever reported (the receiver records it dead, last
    seen never): its age is infinite, and the node's report still encodes."""
    from kvfold.aggregator.freshness import FreshnessTracker

    fresh = FreshnessTracker(stale_after_s=1.0, dead_after_s=3.0)
    fresh.mark_dead(9)
    age = fresh.age_s(9, now_s=5.0)
    records = {8: make_report(8, used=1), 9: RankRecord(None, fresh.state(9, 5.0), None, age)}
    util = fold_node(TOPO, 2, records, None)
    back = decode_node_report(encode_node_report(util, incarnation=3, seq=9), TOPO)
    assert back.util == util
    assert back.util.ranks[1].age_s == float("inf") and back.util.ranks[0].age_s == 0.0


def expect(reason: str, data: object, **kw: object) -> None:
    with pytest.raises(ReportError) as e:
        decode_rank_report(data, TOPO, **kw)  # type: ignore[arg-type]
    assert e.value.reason == reason, e.value


def patched(**changes: object) -> bytes:
    msg = msgpack.unpackb(encode_rank_report(two_window_report()), raw=False)
    msg.update(changes)
    return msgpack.packb(msg, use_bin_type=True)


def test_each_reason() -> None:
    expect("bad_msgpack", b"\xc1")
    expect("bad_msgpack", b"\x92\x01")  # truncated array
    expect("bad_schema", msgpack.packb([1, 2]))
    expect("bad_schema", patched(v=2))  # an older kvfold's reports: no commitments, no tickets
    expect("bad_schema", patched(v=4))
    expect("bad_schema", patched(t="node"))
    expect("bad_schema", patched(extra=1))
    expect("too_large", b"\x00" * (MAX_REPORT_BYTES + 1))
    expect("bad_field", patched(i=-1))
    expect("bad_field", patched(s=1.5))
    expect("bad_field", patched(s=float("nan")))
    expect("bad_field", patched(i=2**64 - 1))
    expect("bad_field", patched(q=[1, 2]))
    expect("bad_field", patched(k=[["x" * 1000, 1]]))
    expect("bad_field", patched(k=[[f"c{i}", 1] for i in range(1_000)]))
    expect("bad_field", patched(g=[[None, 10, 1, 0, 4, 1]] * 20))
    expect("used_exceeds_total", patched(g=[[None, 10, 11, 0, 4, 11]]))
    expect("used_exceeds_total", patched(g=[[None, 10, 6, 6, 4, 6]]))
    expect("rank_out_of_world", patched(r=10))
    expect("rank_out_of_world", patched(r=-1))
    expect("rank_not_on_node", patched(r=0), node=1)
    expect("unknown_window", patched(), windows=(None,))
    expect("bad_field", "not bytes")
    expect("bad_msgpack", b"\x91" * 60_000 + b"\x01")  # 60,000 nested one-element arrays
    expect("too_large", b"\x91" * 70_000 + b"\x01")


def mutate(rnd: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    op = rnd.randrange(5)
    if op == 0 and b:
        return bytes(b[: rnd.randrange(len(b))])  # truncated
    if op == 1 and b:
        for _ in range(rnd.randint(1, 4)):
            b[rnd.randrange(len(b))] = rnd.randrange(256)
        return bytes(b)
    if op == 2:
        return bytes(rnd.randrange(256) for _ in range(rnd.randrange(64)))
    if op == 3:
        return data + bytes(rnd.randrange(256) for _ in range(rnd.randint(1, 8)))
    msg = msgpack.unpackb(data, raw=False)
    key = rnd.choice(sorted(msg))
    msg[key] = rnd.choice(
        [
            None,
            -1,
            2**63,
            1.5,
            float("nan"),
            float("inf"),
            "x",
            b"\x00",
            [],
            {},
            [[[[[]]]]],
            True,
            list(range(300)),
            {"a": 1},
            [None] * 17,
            [[None, 1, 2]],
        ]
    )
    return msgpack.packb(msg, use_bin_type=True)


def _summary(util):  # type: ignore[no-untyped-def]
    """What a refused message must never change, and an accepted one changes exactly."""
    return (
        {r.rank: (r.state, r.incarnation, r.report_seq, r.gpu) for r in util.ranks},
        util.gpu,
        util.num_sequences_by_status,
        util.counters,
    )


def test_fuzz_ten_thousand_messages_through_the_receivers_match_a_recount() -> None:
    """Mutated and valid reports go through each node's real intake (NodeState): a
    refused message leaves the node's view exactly as it was, and the views always equal
    a recount folded from the reports the receivers accepted."""
    from kvfold.aggregator.node_state import NodeState

    rnd = random.Random(1234)
    states = {n: NodeState(TOPO, n, (None, 4096), 3.0, 9.0) for n in range(TOPO.num_nodes)}
    accepted: dict[int, RankReport] = {}  # the recount's input: latest accepted per rank
    counters: dict[int, object] = {}
    next_seq = dict.fromkeys(range(10), 1)
    reasons: dict[str, int] = {}
    num_accepted = 0
    for i in range(10_000):
        rank = i % 10
        node = TOPO.node_of(rank)
        valid = make_report(
            rank, used=rnd.randrange(8), reused=rnd.randrange(3), seq=next_seq[rank]
        )
        data = encode_rank_report(valid)
        if rnd.random() < 0.9:
            data = mutate(rnd, data)
        state = states[node]
        before = _summary(state.fold(0.0, None))
        verdict = state.receive(data, 0.0)
        after = _summary(state.fold(0.0, None))
        if verdict not in ("accepted", "late"):  # late: counts folded once, snapshot not
            assert verdict in (*REASONS, "duplicate", "out_of_order", "retired_incarnation")
            reasons[verdict] = reasons.get(verdict, 0) + 1
            assert after == before, verdict
            continue
        num_accepted += 1
        rep = decode_rank_report(data, TOPO, node=node, windows=(None, 4096))
        if verdict == "accepted":
            accepted[rep.rank] = rep
        old = counters.get(rep.rank)
        counters[rep.rank] = rep.deltas if old is None else sum_deltas([old, rep.deltas])  # type: ignore[list-item]
        next_seq[rep.rank] = max(next_seq[rep.rank], rep.seq) + 1
        recount = fold_node(
            TOPO,
            node,
            {
                r: RankRecord(accepted.get(r), counters=IterationStats(counters[r]))  # type: ignore[arg-type]
                for r in TOPO.ranks_on(node)
                if r in counters
            },
            None,
        )
        assert (after[1], after[2], after[3]) == (
            recount.gpu,
            recount.num_sequences_by_status,
            recount.counters,
        )
    assert sum(reasons.values()) > 8_000
    assert len(reasons) >= 5
    assert num_accepted > 500  # the recount was exercised on many accepted reports


def test_node_report_refuses_wrong_ranks_and_nodes() -> None:
    util = fold_node(TOPO, 2, {8: make_report(8), 9: make_report(9)}, None)
    msg = msgpack.unpackb(encode_node_report(util, 1, 1), raw=False)
    bad = dict(msg, n=7)
    with pytest.raises(ReportError, match="node_out_of_world"):
        decode_node_report(msgpack.packb(bad), TOPO)
    bad = dict(msg, ranks=msg["ranks"][:1])
    with pytest.raises(ReportError, match="ranks_mismatch"):
        decode_node_report(msgpack.packb(bad), TOPO)
    bad = dict(msg, h=[1, 5, 0, 0, 0, 0, 0, 0, 0, 0])
    with pytest.raises(ReportError, match="used_exceeds_total"):
        decode_node_report(msgpack.packb(bad), TOPO)


def test_node_report_keeps_the_newest_tickets_within_the_size_limit() -> None:
    topo = Topology(64, 64)
    tickets = {f"controller-{i:02d}-" + "x" * 50: 10**12 + i for i in range(64)}
    reports = {r: make_report(r, tickets=tickets) for r in range(64)}
    util = fold_node(topo, 0, reports, None)
    data = encode_node_report(util, 1, 1)
    assert len(data) <= MAX_REPORT_BYTES  # 64 ranks x 64 tickets of ~70 bytes: ~290 KiB
    kept = decode_node_report(data, topo).util.ranks[0].tickets
    assert 0 < len(kept) < 64 and list(kept) == list(tickets)[-len(kept) :]  # newest kept


def test_rank_report_tickets_and_committed_are_validated() -> None:
    rep = two_window_report()
    msg = msgpack.unpackb(encode_rank_report(rep))
    for bad, reason in (
        ({"k": [["a", 1], ["a", 2]]}, "bad_field"),  # a controller twice
        ({"k": [["", 1]]}, "bad_field"),
        ({"k": [["x" * 65, 1]]}, "bad_field"),
        ({"k": [["a", -1]]}, "bad_field"),
        ({"k": [["a"]]}, "bad_field"),
        ({"f": -1}, "bad_field"),
        ({"g": [[None, 10, 1, 0, 16, 11]]}, "used_exceeds_total"),  # committed > total
    ):
        with pytest.raises(ReportError) as e:
            decode_rank_report(msgpack.packb({**msg, **bad}), TOPO, windows=(None, 4096))
        assert e.value.reason == reason, (bad, e.value)

"""Node reports on the wire (node actor -> cluster aggregator): the node's rank
summaries, sums, cumulative counters and host stats, and the rank reports it refused."""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from kvfold.codec.fields import (
    MAX_COUNT,
    MAX_ID,
    MAX_RANKS_PER_NODE,
    MAX_REASONS,
    MAX_REPORT_BYTES,
    SCHEMA_VERSION,
    STATE_CODES,
    delta_rows,
    deltas_field,
    fail,
    gauge_rows,
    gauges_field,
    guarded,
    int_field,
    list_field,
    pack,
    status_field,
    status_row,
    ticket_rows,
    tickets_field,
    unknown_field,
    unpack,
)
from kvfold.stats import HOST_FIELDS, HostStats, IterationStats, Window
from kvfold.tickets import MAX_CONTROLLERS
from kvfold.topology import Topology
from kvfold.view import NodeUtilization, RankSummary

_NODE_KEYS = frozenset({"v", "t", "n", "i", "s", "ranks", "g", "q", "d", "c", "h", "x"})


@dataclass(frozen=True, slots=True)
class NodeReport:
    """What a node actor sends the aggregator (decoded and validated)."""

    node: int
    incarnation: int
    seq: int
    util: NodeUtilization
    refused: dict[str, int]  # rank reports the node refused, by reason (cumulative)


AGE_NEVER_MS = MAX_COUNT  # a rank never heard from (its age is infinite)


def age_ms(age_s: float) -> int:
    """A rank's age on the wire, in whole milliseconds; never heard from: AGE_NEVER_MS."""
    return AGE_NEVER_MS if not math.isfinite(age_s) else min(int(age_s * 1000), AGE_NEVER_MS - 1)


def age_s_of(ms: int) -> float:
    return math.inf if ms == AGE_NEVER_MS else ms / 1000.0


def encode_node_report(
    util: NodeUtilization,
    incarnation: int,
    seq: int,
    max_tickets_per_rank: int = MAX_CONTROLLERS,
    refused: Mapping[str, int] | None = None,
) -> bytes:
    """A node report within MAX_REPORT_BYTES: each rank's ticket table keeps its most
    recently stamped controllers, as many as fit (halved until the report fits; a
    controller left out releases its reservations by their TTL instead)."""
    while True:
        data = _encode_node_report(util, incarnation, seq, max_tickets_per_rank, refused)
        if len(data) <= MAX_REPORT_BYTES or max_tickets_per_rank == 0:
            return data
        max_tickets_per_rank //= 2


def _encode_node_report(
    util: NodeUtilization,
    incarnation: int,
    seq: int,
    max_tickets: int,
    refused: Mapping[str, int] | None,
) -> bytes:
    ranks = [
        [
            r.rank,
            r.state.value,
            r.incarnation,
            gauge_rows(r.gpu),
            r.num_valid_sequences,
            age_ms(r.age_s),
            ticket_rows(r.tickets)[-max_tickets:] if max_tickets else [],
            r.report_seq,
            r.num_refused,
            *([sorted(r.unknown)] if r.unknown else []),
        ]
        for r in util.ranks
    ]
    return pack(
        {
            "v": SCHEMA_VERSION,
            "t": "node",
            "n": util.node,
            "i": incarnation,
            "s": seq,
            "ranks": ranks,
            "g": gauge_rows(util.gpu),
            "q": status_row(util.num_sequences_by_status),
            "d": delta_rows(util.deltas.windows),
            "c": delta_rows(util.counters.windows),
            "h": None if util.host is None else list(util.host.as_tuple()),
            "x": [[r, int(c)] for r, c in sorted((refused or {}).items())][:MAX_REASONS],
        }
    )


def decode_node_report(
    data: bytes, topology: Topology, windows: Collection[Window] | None = None
) -> NodeReport:
    """Validate a node report against the topology (the node's ranks, exactly)."""
    return guarded(lambda: _decode_node(data, topology, windows))  # type: ignore[no-any-return]


def _decode_node(data: bytes, topology: Topology, windows: Collection[Window] | None) -> NodeReport:
    msg = unpack(data, "node", _NODE_KEYS)
    node = msg["n"]
    if type(node) is not int or not 0 <= node < topology.num_nodes:
        raise fail("node_out_of_world", f"node {node!r} not in [0, {topology.num_nodes})")
    expected = topology.ranks_on(node)
    util = NodeUtilization(
        node=node,
        rank_start=expected[0],
        rank_end=expected[-1] + 1,
        ranks=_rank_summaries(msg["ranks"], node, expected, windows),
        gpu=gauges_field(msg["g"], "g", windows) or {},
        host=_host(msg["h"]),
        num_sequences_by_status=status_field(msg["q"]),
        deltas=IterationStats(deltas_field(msg["d"], "d", windows)),
        counters=IterationStats(deltas_field(msg["c"], "c", windows)),
    )
    return NodeReport(
        node=node,
        incarnation=int_field(msg["i"], "incarnation", MAX_ID),
        seq=int_field(msg["s"], "seq", MAX_ID),
        util=util,
        refused=_refused(msg["x"]),
    )


def _rank_summaries(
    value: Any, node: int, expected: tuple[int, ...], windows: Collection[Window] | None
) -> tuple[RankSummary, ...]:
    rows = list_field(value, "ranks", MAX_RANKS_PER_NODE)
    if [r[0] if type(r) is list and r else None for r in rows] != list(expected):
        raise fail("ranks_mismatch", f"node {node} must report ranks {list(expected)}")
    summaries = []
    for i, row in enumerate(rows):
        row = list_field(row, f"ranks[{i}]", 10)
        if len(row) < 9:
            raise fail("bad_field", f"ranks[{i}] has {len(row)} fields, not 9 or 10")
        state = STATE_CODES.get(row[1]) if type(row[1]) is str else None
        if state is None:
            raise fail("bad_field", f"ranks[{i}] state {row[1]!r} is not a known state")
        summaries.append(
            RankSummary(
                rank=row[0],
                state=state,
                incarnation=int_field(row[2], f"ranks[{i}] incarnation", MAX_ID),
                gpu=gauges_field(row[3], f"ranks[{i}] gpu", windows),
                num_valid_sequences=int_field(row[4], f"ranks[{i}] valid"),
                age_s=age_s_of(int_field(row[5], f"ranks[{i}] age_ms")),
                tickets=tickets_field(row[6], f"ranks[{i}] tickets"),
                report_seq=int_field(row[7], f"ranks[{i}] seq", MAX_ID),
                num_refused=int_field(row[8], f"ranks[{i}] refused"),
                unknown=unknown_field(row[9] if len(row) > 9 else None, f"ranks[{i}] unknown"),
            )
        )
    return tuple(summaries)


def _host(value: Any) -> HostStats | None:
    if value is None:
        return None
    vals = list_field(value, "h", len(HOST_FIELDS), exact=len(HOST_FIELDS))
    host = HostStats(*(int_field(x, f"h.{f}") for x, f in zip(vals, HOST_FIELDS, strict=True)))
    if host.num_blocks_used > host.num_blocks_total:
        raise fail(
            "used_exceeds_total",
            f"host used {host.num_blocks_used} > total {host.num_blocks_total}",
        )
    return host


def _refused(value: Any) -> dict[str, int]:
    refused: dict[str, int] = {}
    for i, row in enumerate(list_field(value, "x", MAX_REASONS)):
        row = list_field(row, f"x[{i}]", 2, exact=2)
        if type(row[0]) is not str or len(row[0]) > 64:
            raise fail("bad_field", f"x[{i}] reason must be a str of at most 64 chars")
        refused[row[0]] = int_field(row[1], f"x[{i}] count")
    return refused

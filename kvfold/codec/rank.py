"""Rank reports on the wire (rank -> its node's host-KV actor):

{"v": 2, "t": "rank", "r": rank, "i": incarnation, "s": seq,
 "g": None | [[window, total, used, cached, tokens_per_block, committed], ...],  # None: unbound
 "d": [[window, alloc_total, alloc_new, reused, onboarded, onboarded_bytes, missed,
        gen_alloc, evicted, offloaded, offloaded_bytes], ...],   # stats.DELTA_FIELDS
 "q": [queueing, in_prefill, prefilled, in_decode, on_hold, completed],
 "k": [[controller id, highest ticket taken in], ...],   # kvfold.tickets
 "f": placements refused as over-commits (cumulative for the incarnation)}
"""

from __future__ import annotations

from collections.abc import Collection

from kvfold.codec.fields import (
    DECODE_ERRORS,
    MAX_COUNT,
    MAX_ID,
    SCHEMA_VERSION,
    bad_field,
    delta_rows,
    deltas_field,
    fail,
    gauge_rows,
    gauges_field,
    int_field,
    pack,
    status_field,
    status_row,
    ticket_rows,
    tickets_field,
    unknown_field,
    unpack,
)
from kvfold.errors import ReportError
from kvfold.stats import RankReport, Window
from kvfold.topology import Topology

_RANK_KEYS = frozenset({"v", "t", "r", "i", "s", "g", "d", "q", "k", "f"})
_OPTIONAL = frozenset({"u"})  # what the rank's source does not publish (an engine's)


def encode_rank_report(report: RankReport) -> bytes:
    return pack(
        {
            "v": SCHEMA_VERSION,
            "t": "rank",
            "r": report.rank,
            "i": report.incarnation,
            "s": report.seq,
            "g": gauge_rows(report.gpu),
            "d": delta_rows(report.deltas),
            "q": status_row(report.num_sequences_by_status),
            "k": ticket_rows(report.tickets),
            "f": report.num_refused,
            **({"u": sorted(report.unknown)} if report.unknown else {}),
        }
    )


def decode_rank_report(
    data: bytes,
    topology: Topology,
    node: int | None = None,
    windows: Collection[Window] | None = None,
) -> RankReport:
    """Validate a rank report. `node`: the receiving node (the rank must be on it);
    `windows`: the windows this deployment's caches have."""
    try:
        msg = unpack(data, "rank", _RANK_KEYS, optional=_OPTIONAL)
        rank = msg["r"]
        if type(rank) is not int:
            raise fail("bad_field", f"rank must be an int, got {type(rank).__name__}")
        if not 0 <= rank < topology.world_size:
            raise fail("rank_out_of_world", f"rank {rank} not in [0, {topology.world_size})")
        if node is not None and topology.node_of(rank) != node:
            raise fail(
                "rank_not_on_node", f"rank {rank} is on node {topology.node_of(rank)}, not {node}"
            )
        return RankReport(
            rank=rank,
            incarnation=int_field(msg["i"], "incarnation", MAX_ID),
            seq=int_field(msg["s"], "seq", MAX_ID),
            gpu=gauges_field(msg["g"], "g", windows),
            deltas=deltas_field(msg["d"], "d", windows),
            num_sequences_by_status=status_field(msg["q"]),
            tickets=tickets_field(msg["k"], "k"),
            num_refused=int_field(msg["f"], "refused", MAX_COUNT),
            unknown=unknown_field(msg.get("u"), "u"),
        )
    except ReportError:
        raise
    except DECODE_ERRORS as e:  # inline, not `guarded`: no closure on the hot path
        raise bad_field(e) from None

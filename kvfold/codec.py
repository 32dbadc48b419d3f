"""The wire format: msgpack maps with a schema version, validated on the way in.

Rank report (rank -> its node's host-KV actor):

    {"v": 2, "t": "rank", "r": rank, "i": incarnation, "s": seq,
     "g": None | [[window, total, used, cached, tokens_per_block], ...],   # None: cache unbound
     "d": [[window, alloc_total, alloc_new, reused, onboarded, onboarded_bytes, missed,
            gen_alloc, evicted, offloaded, offloaded_bytes], ...],   # stats.DELTA_FIELDS
     "q": [queueing, in_prefill, prefilled, in_decode, on_hold, completed],
     "a": [seq ids added since the previous report]}

Node report (node actor -> cluster aggregator): the node's rank summaries,
sums, cumulative counters and host stats; see `encode_node_report`.

`decode_*` never raises anything but ReportError (with a reason code), whatever
the bytes; a refused report changes nothing. No pickle anywhere on this path.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from kvfold.errors import ReportError
from kvfold.stats import (
    DELTA_FIELDS,
    GAUGE_FIELDS,
    HOST_FIELDS,
    BlockDeltas,
    BlockGauges,
    HostStats,
    IterationStats,
    RankReport,
    SequenceStatus,
    Window,
)
from kvfold.topology import Topology
from kvfold.view import NodeUtilization, RankSummary, SourceState

SCHEMA_VERSION = 2  # 2: alloc_total_blocks travels; alloc_new means TensorRT-LLM's
MAX_REPORT_BYTES = 64 * 1024
MAX_WINDOWS = 16
MAX_ADDED_IDS = 256
MAX_SEQ_ID_CHARS = 128
MAX_RANKS_PER_NODE = 1024
MAX_REASONS = 64
MAX_COUNT = 2**53  # counts and bytes: exact in a float64 exporter
MAX_ID = 2**63 - 1  # incarnations and sequence numbers

REASONS = (
    "bad_msgpack",
    "bad_schema",
    "too_large",
    "bad_field",
    "used_exceeds_total",
    "rank_out_of_world",
    "rank_not_on_node",
    "node_out_of_world",
    "unknown_window",
    "ranks_mismatch",
)

_NUM_STATUSES = len(SequenceStatus)
_STATE_CODES = {s.value: s for s in SourceState}


# ----------------------------------------------------------------------------- encode


def _delta_rows(values: Mapping[Window, BlockDeltas]) -> list[list[Any]]:
    return [[w, *d.as_tuple()] for w, d in values.items()]


def _gauges(g: Mapping[Window, BlockGauges] | None) -> list[list[Any]] | None:
    if g is None:
        return None
    return [[w, *v.as_tuple()] for w, v in g.items()]


def _statuses(counts: Mapping[SequenceStatus, int]) -> list[int]:
    return [int(counts.get(s, 0)) for s in SequenceStatus]


def _pack(msg: dict[str, Any]) -> bytes:
    out: bytes = msgpack.packb(msg, use_bin_type=True)
    return out


def encode_rank_report(report: RankReport) -> bytes:
    return _pack(
        {
            "v": SCHEMA_VERSION,
            "t": "rank",
            "r": report.rank,
            "i": report.incarnation,
            "s": report.seq,
            "g": _gauges(report.gpu),
            "d": _delta_rows(report.deltas),
            "q": _statuses(report.num_sequences_by_status),
            "a": list(report.added_seq_ids[-MAX_ADDED_IDS:]),
        }
    )


@dataclass(frozen=True, slots=True)
class NodeReport:
    """What a node actor sends the aggregator (decoded and validated)."""

    node: int
    incarnation: int
    seq: int
    util: NodeUtilization
    refused: dict[str, int]  # rank reports the node refused, by reason (cumulative)


def encode_node_report(
    util: NodeUtilization,
    incarnation: int,
    seq: int,
    max_ids_per_rank: int = MAX_ADDED_IDS,
    refused: Mapping[str, int] | None = None,
) -> bytes:
    """A node report within MAX_REPORT_BYTES: each rank's recently added ids are kept
    newest first, as many as fit (halved until the report fits)."""
    while True:
        data = _encode_node_report(util, incarnation, seq, max_ids_per_rank, refused)
        if len(data) <= MAX_REPORT_BYTES or max_ids_per_rank == 0:
            return data
        max_ids_per_rank //= 2


def _encode_node_report(
    util: NodeUtilization,
    incarnation: int,
    seq: int,
    max_ids_per_rank: int,
    refused: Mapping[str, int] | None,
) -> bytes:
    ranks = [
        [
            r.rank,
            r.state.value,
            r.incarnation,
            _gauges(r.gpu),
            r.num_valid_sequences,
            int(r.age_s * 1000),
            list(r.added_seq_ids[-max_ids_per_rank:]) if max_ids_per_rank else [],
            r.report_seq,
        ]
        for r in util.ranks
    ]
    return _pack(
        {
            "v": SCHEMA_VERSION,
            "t": "node",
            "n": util.node,
            "i": incarnation,
            "s": seq,
            "ranks": ranks,
            "g": _gauges(util.gpu),
            "q": _statuses(util.num_sequences_by_status),
            "d": _delta_rows(util.deltas.windows),
            "c": _delta_rows(util.counters.windows),
            "h": None if util.host is None else list(util.host.as_tuple()),
            "x": [[r, int(c)] for r, c in sorted((refused or {}).items())][:MAX_REASONS],
        }
    )


# ----------------------------------------------------------------------------- decode


def _fail(reason: str, detail: str) -> ReportError:
    return ReportError(reason, detail)


def _int(value: Any, name: str, hi: int = MAX_COUNT) -> int:
    if type(value) is not int:
        raise _fail("bad_field", f"{name} must be an int, got {type(value).__name__}")
    if not 0 <= value <= hi:
        raise _fail("bad_field", f"{name} must be in [0, {hi}], got {value}")
    return value


def _list(value: Any, name: str, max_len: int, exact: int | None = None) -> list[Any]:
    if type(value) is not list:
        raise _fail("bad_field", f"{name} must be a list, got {type(value).__name__}")
    if exact is not None and len(value) != exact:
        raise _fail("bad_field", f"{name} must have {exact} entries, got {len(value)}")
    if len(value) > max_len:
        raise _fail("bad_field", f"{name} has {len(value)} entries, at most {max_len} allowed")
    return value


def _window(value: Any, name: str, known: Collection[Window] | None) -> Window:
    if value is not None:
        value = _int(value, name)
        if value < 1:
            raise _fail("bad_field", f"{name} must be None or >= 1, got {value}")
    if known is not None and value not in known:
        raise _fail("unknown_window", f"{name} {value!r} is not one of {list(known)}")
    return value  # type: ignore[no-any-return]


_INT_ONLY = {int}


def _counts_ok(values: list[Any]) -> bool:
    """Fast check: every value a plain int in [0, MAX_COUNT]."""
    return set(map(type, values)) == _INT_ONLY and min(values) >= 0 and max(values) <= MAX_COUNT


def _per_window(
    rows: Any,
    name: str,
    width: int,
    known: Collection[Window] | None,
    make: Callable[[list[int]], Any],
) -> dict[Window, Any]:
    out: dict[Window, Any] = {}
    for i, row in enumerate(_list(rows, name, MAX_WINDOWS)):
        values = row[1:] if type(row) is list and len(row) == width + 1 else None
        if values is not None and _counts_ok(values):
            w = row[0]
            if not ((w is None or type(w) is int) and known is not None and w in known):
                w = _window(w, f"{name}[{i}] window", known)
        else:  # slow path: find and name what is wrong
            row = _list(row, f"{name}[{i}]", width + 1, exact=width + 1)
            w = _window(row[0], f"{name}[{i}] window", known)
            values = [_int(x, f"{name}[{i}][{j + 1}]") for j, x in enumerate(row[1:])]
        if w in out:
            raise _fail("bad_field", f"{name} lists window {w!r} twice")
        out[w] = make(values)
    return out


def _make_gauges(v: list[int]) -> BlockGauges:
    total, used, cached, tpb = v
    if used > total:
        raise _fail("used_exceeds_total", f"used {used} > total {total}")
    if used + cached > total:
        raise _fail("used_exceeds_total", f"used {used} + cached {cached} > total {total}")
    return BlockGauges(total, used, cached, tpb)


def _gpu(
    rows: Any, name: str, known: Collection[Window] | None
) -> dict[Window, BlockGauges] | None:
    if rows is None:
        return None
    return _per_window(rows, name, len(GAUGE_FIELDS), known, _make_gauges)


_ALLOC_TOTAL = DELTA_FIELDS.index("alloc_total_blocks")
_ALLOC_NEW = DELTA_FIELDS.index("alloc_new_blocks")
_ONBOARDED = DELTA_FIELDS.index("onboarded_blocks")


def _make_deltas(v: list[int]) -> BlockDeltas:
    total = v[_ALLOC_TOTAL]
    if v[_ALLOC_NEW] > total:  # alloc_new counts a subset of the taken blocks
        raise _fail("bad_field", f"alloc_new {v[_ALLOC_NEW]} > alloc_total {total}")
    if v[_ONBOARDED] > total:  # onboarded blocks are taken blocks
        raise _fail("bad_field", f"onboarded {v[_ONBOARDED]} > alloc_total {total}")
    return BlockDeltas(*v)


def _deltas(rows: Any, name: str, known: Collection[Window] | None) -> dict[Window, BlockDeltas]:
    return _per_window(rows, name, len(DELTA_FIELDS), known, _make_deltas)


_STATUSES = tuple(SequenceStatus)


def _status_counts(value: Any) -> dict[SequenceStatus, int]:
    counts = _list(value, "q", _NUM_STATUSES, exact=_NUM_STATUSES)
    if not _counts_ok(counts):
        counts = [_int(c, f"q[{s.name}]") for s, c in zip(_STATUSES, counts, strict=True)]
    return dict(zip(_STATUSES, counts, strict=True))


def _seq_ids(value: Any, name: str) -> tuple[str | int, ...]:
    ids = _list(value, name, MAX_ADDED_IDS)
    if set(map(type, ids)) <= {str} and (not ids or max(map(len, ids)) <= MAX_SEQ_ID_CHARS):
        return tuple(ids)
    out: list[str | int] = []
    for i, x in enumerate(_list(value, name, MAX_ADDED_IDS)):
        if type(x) is str:
            if len(x) > MAX_SEQ_ID_CHARS:
                raise _fail("bad_field", f"{name}[{i}] is longer than {MAX_SEQ_ID_CHARS} chars")
        elif type(x) is int:
            if not -MAX_ID <= x <= MAX_ID:
                raise _fail("bad_field", f"{name}[{i}] is out of range")
        else:
            raise _fail("bad_field", f"{name}[{i}] must be a str or int, got {type(x).__name__}")
        out.append(x)
    return tuple(out)


def _unpack(data: Any, kind: str, keys: frozenset[str]) -> dict[str, Any]:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise _fail("bad_field", f"a report must be bytes, got {type(data).__name__}")
    if len(data) > MAX_REPORT_BYTES:
        raise _fail("too_large", f"{len(data)} bytes > limit {MAX_REPORT_BYTES}")
    try:
        msg = msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=True,
        )
    except (
        msgpack.ExtraData,
        msgpack.FormatError,
        msgpack.StackError,
        ValueError,
        TypeError,
        OverflowError,
        UnicodeDecodeError,
        RecursionError,
        MemoryError,
    ) as e:
        raise _fail("bad_msgpack", f"{type(e).__name__}: {e}"[:200]) from None
    if type(msg) is not dict:
        raise _fail("bad_schema", f"a report must be a map, got {type(msg).__name__}")
    version = msg.get("v")
    if version != SCHEMA_VERSION:
        raise _fail(
            "bad_schema",
            f"unknown schema version {version!r}; this kvfold reads version {SCHEMA_VERSION}",
        )
    if msg.get("t") != kind:
        raise _fail("bad_schema", f"expected a {kind} report, got type {msg.get('t')!r}")
    if set(msg) != keys:
        missing = sorted(keys - set(msg))
        extra = sorted(str(k) for k in set(msg) - keys)
        raise _fail("bad_schema", f"fields missing {missing}, unexpected {extra}")
    return msg


_RANK_KEYS = frozenset({"v", "t", "r", "i", "s", "g", "d", "q", "a"})
_NODE_KEYS = frozenset({"v", "t", "n", "i", "s", "ranks", "g", "q", "d", "c", "h", "x"})


def _guard(fn: Callable[[], Any]) -> Any:
    """Run a decoder; anything but ReportError becomes ReportError('bad_field')."""
    try:
        return fn()
    except ReportError:
        raise
    except (TypeError, ValueError, KeyError, IndexError, OverflowError, RecursionError) as e:
        raise _fail("bad_field", f"{type(e).__name__}: {e}"[:200]) from None


def decode_rank_report(
    data: bytes,
    topology: Topology,
    node: int | None = None,
    windows: Collection[Window] | None = None,
) -> RankReport:
    """Validate a rank report. `node`: the receiving node (the rank must be on it);
    `windows`: the windows this deployment's caches have."""
    try:
        msg = _unpack(data, "rank", _RANK_KEYS)
        rank = msg["r"]
        if type(rank) is not int:
            raise _fail("bad_field", f"rank must be an int, got {type(rank).__name__}")
        if not 0 <= rank < topology.world_size:
            raise _fail("rank_out_of_world", f"rank {rank} not in [0, {topology.world_size})")
        if node is not None and topology.node_of(rank) != node:
            raise _fail(
                "rank_not_on_node", f"rank {rank} is on node {topology.node_of(rank)}, not {node}"
            )
        return RankReport(
            rank=rank,
            incarnation=_int(msg["i"], "incarnation", MAX_ID),
            seq=_int(msg["s"], "seq", MAX_ID),
            gpu=_gpu(msg["g"], "g", windows),
            deltas=_per_window(msg["d"], "d", len(DELTA_FIELDS), windows, _make_deltas),
            num_sequences_by_status=_status_counts(msg["q"]),
            added_seq_ids=_seq_ids(msg["a"], "a"),
        )
    except ReportError:
        raise
    except (TypeError, ValueError, KeyError, IndexError, OverflowError, RecursionError) as e:
        raise _fail("bad_field", f"{type(e).__name__}: {e}"[:200]) from None


def decode_node_report(
    data: bytes, topology: Topology, windows: Collection[Window] | None = None
) -> NodeReport:
    """Validate a node report against the topology (the node's ranks, exactly)."""

    def run() -> NodeReport:
        msg = _unpack(data, "node", _NODE_KEYS)
        node = msg["n"]
        if type(node) is not int or not 0 <= node < topology.num_nodes:
            raise _fail("node_out_of_world", f"node {node!r} not in [0, {topology.num_nodes})")
        expected = topology.ranks_on(node)
        rows = _list(msg["ranks"], "ranks", MAX_RANKS_PER_NODE)
        if [r[0] if type(r) is list and r else None for r in rows] != list(expected):
            raise _fail("ranks_mismatch", f"node {node} must report ranks {list(expected)}")
        summaries = []
        for i, row in enumerate(rows):
            row = _list(row, f"ranks[{i}]", 8, exact=8)
            state = _STATE_CODES.get(row[1]) if type(row[1]) is str else None
            if state is None:
                raise _fail("bad_field", f"ranks[{i}] state {row[1]!r} is not a known state")
            summaries.append(
                RankSummary(
                    rank=row[0],
                    state=state,
                    incarnation=_int(row[2], f"ranks[{i}] incarnation", MAX_ID),
                    gpu=_gpu(row[3], f"ranks[{i}] gpu", windows),
                    num_valid_sequences=_int(row[4], f"ranks[{i}] valid"),
                    age_s=_int(row[5], f"ranks[{i}] age_ms") / 1000.0,
                    added_seq_ids=_seq_ids(row[6], f"ranks[{i}] added"),
                    report_seq=_int(row[7], f"ranks[{i}] seq", MAX_ID),
                )
            )
        host_row = msg["h"]
        host = None
        if host_row is not None:
            vals = _list(host_row, "h", len(HOST_FIELDS), exact=len(HOST_FIELDS))
            host = HostStats(*(_int(x, f"h.{f}") for x, f in zip(vals, HOST_FIELDS, strict=True)))
            if host.num_blocks_used > host.num_blocks_total:
                raise _fail(
                    "used_exceeds_total",
                    f"host used {host.num_blocks_used} > total {host.num_blocks_total}",
                )
        util = NodeUtilization(
            node=node,
            rank_start=expected[0],
            rank_end=expected[-1] + 1,
            ranks=tuple(summaries),
            gpu=_gpu(msg["g"], "g", windows) or {},
            host=host,
            num_sequences_by_status=_status_counts(msg["q"]),
            deltas=IterationStats(_deltas(msg["d"], "d", windows)),
            counters=IterationStats(_deltas(msg["c"], "c", windows)),
        )
        refused: dict[str, int] = {}
        for i, row in enumerate(_list(msg["x"], "x", MAX_REASONS)):
            row = _list(row, f"x[{i}]", 2, exact=2)
            if type(row[0]) is not str or len(row[0]) > 64:
                raise _fail("bad_field", f"x[{i}] reason must be a str of at most 64 chars")
            refused[row[0]] = _int(row[1], f"x[{i}] count")
        return NodeReport(
            node=node,
            incarnation=_int(msg["i"], "incarnation", MAX_ID),
            seq=_int(msg["s"], "seq", MAX_ID),
            util=util,
            refused=refused,
        )

    return _guard(run)  # type: ignore[no-any-return]

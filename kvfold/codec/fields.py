"""What every report on the wire shares: the schema version, the limits, the reasons a
report is refused, and the field encoders and validators (kvfold.codec.rank, .node).

Decoders never raise anything but ReportError (with a reason code), whatever the bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

import msgpack

from kvfold.errors import ReportError
from kvfold.stats import (
    DELTA_FIELDS,
    GAUGE_FIELDS,
    UNKNOWABLE,
    BlockDeltas,
    BlockGauges,
    SequenceStatus,
    Window,
)
from kvfold.tickets import MAX_CONTROLLER_ID_CHARS, MAX_CONTROLLERS
from kvfold.view import SourceState

SCHEMA_VERSION = 3  # 3: committed blocks and admission tickets travel; 2: alloc_total_blocks
MAX_REPORT_BYTES = 64 * 1024
MAX_WINDOWS = 16
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
STATE_CODES = {s.value: s for s in SourceState}


def delta_rows(values: Mapping[Window, BlockDeltas]) -> list[list[Any]]:
    return [[w, *d.as_tuple()] for w, d in values.items()]


def gauge_rows(g: Mapping[Window, BlockGauges] | None) -> list[list[Any]] | None:
    if g is None:
        return None
    return [[w, *v.as_tuple()] for w, v in g.items()]


def status_row(counts: Mapping[SequenceStatus, int]) -> list[int]:
    return [int(counts.get(s, 0)) for s in SequenceStatus]


def pack(msg: dict[str, Any]) -> bytes:
    out: bytes = msgpack.packb(msg, use_bin_type=True)
    return out


def fail(reason: str, detail: str) -> ReportError:
    return ReportError(reason, detail)


def int_field(value: Any, name: str, hi: int = MAX_COUNT) -> int:
    if type(value) is not int:
        raise fail("bad_field", f"{name} must be an int, got {type(value).__name__}")
    if not 0 <= value <= hi:
        raise fail("bad_field", f"{name} must be in [0, {hi}], got {value}")
    return value


def list_field(value: Any, name: str, max_len: int, exact: int | None = None) -> list[Any]:
    if type(value) is not list:
        raise fail("bad_field", f"{name} must be a list, got {type(value).__name__}")
    if exact is not None and len(value) != exact:
        raise fail("bad_field", f"{name} must have {exact} entries, got {len(value)}")
    if len(value) > max_len:
        raise fail("bad_field", f"{name} has {len(value)} entries, at most {max_len} allowed")
    return value


def window_field(value: Any, name: str, known: Collection[Window] | None) -> Window:
    if value is not None:
        value = int_field(value, name)
        if value < 1:
            raise fail("bad_field", f"{name} must be None or >= 1, got {value}")
    if known is not None and value not in known:
        raise fail("unknown_window", f"{name} {value!r} is not one of {list(known)}")
    return value  # type: ignore[no-any-return]


_INT_ONLY = {int}


def _counts_ok(values: list[Any]) -> bool:
    """Fast check: every value a plain int in [0, MAX_COUNT]."""
    return set(map(type, values)) == _INT_ONLY and min(values) >= 0 and max(values) <= MAX_COUNT


def per_window(
    rows: Any,
    name: str,
    width: int,
    known: Collection[Window] | None,
    make: Callable[[list[int]], Any],
) -> dict[Window, Any]:
    out: dict[Window, Any] = {}
    for i, row in enumerate(list_field(rows, name, MAX_WINDOWS)):
        values = row[1:] if type(row) is list and len(row) == width + 1 else None
        if values is not None and _counts_ok(values):
            w = row[0]
            if not ((w is None or type(w) is int) and known is not None and w in known):
                w = window_field(w, f"{name}[{i}] window", known)
        else:  # slow path: find and name what is wrong
            row = list_field(row, f"{name}[{i}]", width + 1, exact=width + 1)
            w = window_field(row[0], f"{name}[{i}] window", known)
            values = [int_field(x, f"{name}[{i}][{j + 1}]") for j, x in enumerate(row[1:])]
        if w in out:
            raise fail("bad_field", f"{name} lists window {w!r} twice")
        out[w] = make(values)
    return out


def _make_gauges(v: list[int]) -> BlockGauges:
    total, used, cached, tpb, committed = v
    if used > total:
        raise fail("used_exceeds_total", f"used {used} > total {total}")
    if used + cached > total:
        raise fail("used_exceeds_total", f"used {used} + cached {cached} > total {total}")
    if committed > total:
        raise fail("used_exceeds_total", f"committed {committed} > total {total}")
    return BlockGauges(total, used, cached, tpb, committed)


def gauges_field(
    rows: Any, name: str, known: Collection[Window] | None
) -> dict[Window, BlockGauges] | None:
    if rows is None:
        return None
    return per_window(rows, name, len(GAUGE_FIELDS), known, _make_gauges)


_ALLOC_TOTAL = DELTA_FIELDS.index("alloc_total_blocks")
_ALLOC_NEW = DELTA_FIELDS.index("alloc_new_blocks")
_ONBOARDED = DELTA_FIELDS.index("onboarded_blocks")


def _make_deltas(v: list[int]) -> BlockDeltas:
    total = v[_ALLOC_TOTAL]
    # alloc_new counts a subset of the taken blocks; onboarded blocks are taken blocks
    if v[_ALLOC_NEW] > total or v[_ONBOARDED] > total:
        raise fail(
            "bad_field",
            f"alloc_new {v[_ALLOC_NEW]} or onboarded {v[_ONBOARDED]} > alloc_total {total}",
        )
    return BlockDeltas(*v)


def deltas_field(
    rows: Any, name: str, known: Collection[Window] | None
) -> dict[Window, BlockDeltas]:
    return per_window(rows, name, len(DELTA_FIELDS), known, _make_deltas)


_STATUSES = tuple(SequenceStatus)


def status_field(value: Any) -> dict[SequenceStatus, int]:
    counts = list_field(value, "q", _NUM_STATUSES, exact=_NUM_STATUSES)
    if not _counts_ok(counts):
        counts = [int_field(c, f"q[{s.name}]") for s, c in zip(_STATUSES, counts, strict=True)]
    return dict(zip(_STATUSES, counts, strict=True))


def ticket_rows(tickets: Mapping[str, int]) -> list[list[Any]]:
    return [[c, n] for c, n in tickets.items()]


def tickets_field(value: Any, name: str) -> dict[str, int]:
    """Per controller id, the highest ticket taken in (kvfold.tickets)."""
    out: dict[str, int] = {}
    for i, row in enumerate(list_field(value, name, MAX_CONTROLLERS)):
        if not (type(row) is list and len(row) == 2):
            raise fail("bad_field", f"{name}[{i}] must be [controller id, ticket]")
        cid, number = row
        if type(cid) is not str or not 0 < len(cid) <= MAX_CONTROLLER_ID_CHARS:
            raise fail(
                "bad_field",
                f"{name}[{i}] controller id must be a str of 1-{MAX_CONTROLLER_ID_CHARS} chars",
            )
        if cid in out:
            raise fail("bad_field", f"{name} lists controller {cid!r} twice")
        out[cid] = int_field(number, f"{name}[{i}] ticket", MAX_ID)
    return out


def unpack(
    data: Any, kind: str, keys: frozenset[str], optional: frozenset[str] = frozenset()
) -> dict[str, Any]:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise fail("bad_field", f"a report must be bytes, got {type(data).__name__}")
    if len(data) > MAX_REPORT_BYTES:
        raise fail("too_large", f"{len(data)} bytes > limit {MAX_REPORT_BYTES}")
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
        raise fail("bad_msgpack", f"{type(e).__name__}: {e}"[:200]) from None
    if type(msg) is not dict:
        raise fail("bad_schema", f"a report must be a map, got {type(msg).__name__}")
    version = msg.get("v")
    if version != SCHEMA_VERSION:
        raise fail(
            "bad_schema",
            f"unknown schema version {version!r}; this kvfold reads version {SCHEMA_VERSION}",
        )
    if msg.get("t") != kind:
        raise fail("bad_schema", f"expected a {kind} report, got type {msg.get('t')!r}")
    if set(msg) - optional != keys:
        missing = sorted(keys - set(msg))
        extra = sorted(str(k) for k in set(msg) - keys - optional)
        raise fail("bad_schema", f"fields missing {missing}, unexpected {extra}")
    return msg


def unknown_field(value: Any, name: str) -> frozenset[str]:
    """Which of stats.UNKNOWABLE a rank's source does not publish (absent: none)."""
    if value is None:
        return frozenset()
    names = list_field(value, name, len(UNKNOWABLE))
    if any(n not in UNKNOWABLE for n in names):
        raise fail("bad_field", f"{name} names fields outside {list(UNKNOWABLE)}: {names!r}"[:200])
    return frozenset(names)


DECODE_ERRORS = (TypeError, ValueError, KeyError, IndexError, OverflowError, RecursionError)
"""What a malformed message can make a decoder raise; each becomes ReportError('bad_field')."""


def bad_field(e: BaseException) -> ReportError:
    return fail("bad_field", f"{type(e).__name__}: {e}"[:200])


def guarded(fn: Callable[[], Any]) -> Any:
    """Run a decoder; anything but ReportError becomes ReportError('bad_field')."""
    try:
        return fn()
    except ReportError:
        raise
    except DECODE_ERRORS as e:
        raise bad_field(e) from None

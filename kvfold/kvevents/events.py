"""Block events in the shape of vLLM's KV-event schema (DESIGN §9), msgpack on the wire.

    batch   [ts, [event, ...], data_parallel_rank]
    event   {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h | nil,
             "token_ids": [...], "block_size": B, "lora_id": nil, "medium": "GPU" | "CPU",
             "lora_name": nil, "extra_keys": nil, "group_idx": g
             [, "kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": W]}
            {"type": "BlockRemoved", "block_hashes": [...], "medium": m, "group_idx": g}
            {"type": "AllBlocksCleared"}

kvfold writes the map form (vLLM since about v0.23); readers accept it and the
positional form of earlier vLLM (["BlockStored", hashes, parent, token_ids,
block_size, lora_id, medium], ["BlockRemoved", hashes, medium], ["AllBlocksCleared"]),
key fields by name, and take hashes as 64-bit ints or bytes. kvfold's own hashes are
its prefix keys (kvfold.worker.hashing).

Around each batch, the envelope says whose it is and where it falls in that source's
stream (as vLLM's ZMQ frames carry a topic and a sequence number):

    [source kind ("rank" | "host"), source id, incarnation, seq, batch bytes]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import msgpack

from kvfold.errors import KVFoldError

BlockHash: TypeAlias = int | bytes
GPU = "GPU"
CPU = "CPU"
RANK = "rank"
HOST = "host"
MAX_EVENT_BYTES = 64 * 1024 * 1024
MAX_HASH_BYTES = 64


class EventError(KVFoldError, ValueError):
    """A block-event batch or envelope that cannot be read; says what was wrong."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks that became reusable, in prefix order; `parent_block_hash` is the key of
    the block before the first (None: the first is a prompt's first block)."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    block_size: int
    medium: str = GPU
    group_idx: int = 0
    sliding_window: int | None = None  # the group's window in tokens (None: full attention)
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    medium: str = GPU
    group_idx: int = 0


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


Event: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: tuple[Event, ...]
    data_parallel_rank: int | None = None


@dataclass(frozen=True, slots=True)
class Envelope:
    """One batch from one source: a rank's GPU cache or a node's host tier."""

    kind: str  # RANK or HOST
    source: int  # the rank, or the node
    incarnation: int
    seq: int  # 1, 2, ... per incarnation; a gap means batches were lost
    batch: EventBatch = field(default_factory=lambda: EventBatch(0.0, ()))


# ------------------------------------------------------------------ encode


def _event_map(e: Event) -> dict[str, Any]:
    if isinstance(e, BlockStored):
        m: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": list(e.block_hashes),
            "parent_block_hash": e.parent_block_hash,
            "token_ids": list(e.token_ids),
            "block_size": e.block_size,
            "lora_id": None,
            "medium": e.medium,
            "lora_name": None,
            "extra_keys": None,
            "group_idx": e.group_idx,
        }
        if e.sliding_window is not None:
            m["kv_cache_spec_kind"] = "sliding_window"
            m["kv_cache_spec_sliding_window"] = e.sliding_window
        return m
    if isinstance(e, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": list(e.block_hashes),
            "medium": e.medium,
            "group_idx": e.group_idx,
        }
    return {"type": "AllBlocksCleared"}


def encode_batch(batch: EventBatch) -> bytes:
    data: bytes = msgpack.packb(
        [batch.ts, [_event_map(e) for e in batch.events], batch.data_parallel_rank],
        use_bin_type=True,
    )
    return data


def encode_envelope(env: Envelope, payload: bytes | None = None) -> bytes:
    """The envelope around an encoded batch (`payload`, or `env.batch` encoded now)."""
    body = encode_batch(env.batch) if payload is None else payload
    data: bytes = msgpack.packb(
        [env.kind, env.source, env.incarnation, env.seq, body], use_bin_type=True
    )
    return data


# ------------------------------------------------------------------ decode


def _fail(detail: str) -> EventError:
    return EventError(f"block events: {detail}")


def _hashes(value: Any, what: str) -> tuple[BlockHash, ...]:
    if not isinstance(value, list):
        raise _fail(f"{what} must be a list of hashes, got {type(value).__name__}")
    for h in value:
        _check_hash(h, what)
    return tuple(value)


def _check_hash(h: Any, what: str) -> BlockHash:
    if type(h) is int:
        if not -(2**63) <= h < 2**64:
            raise _fail(f"{what}: hash {h} is not a 64-bit int")
        return h
    if isinstance(h, bytes):
        if not 0 < len(h) <= MAX_HASH_BYTES:
            raise _fail(f"{what}: a bytes hash must be 1..{MAX_HASH_BYTES} bytes, got {len(h)}")
        return h
    raise _fail(f"{what}: a hash must be an int or bytes, got {type(h).__name__}")


def _int(value: Any, what: str, lo: int = 0) -> int:
    if type(value) is not int or value < lo:
        raise _fail(f"{what} must be an int >= {lo}, got {value!r}")
    return value


def _medium(value: Any) -> str:
    if value is None:
        return GPU  # vLLM before mediums existed: the GPU cache
    if not isinstance(value, str) or not value:
        raise _fail(f"medium must be a non-empty str, got {value!r}")
    return value.upper()


def _from_map(m: dict[Any, Any]) -> Event:
    kind = m.get("type")
    if kind == "BlockStored":
        window = m.get("kv_cache_spec_sliding_window")
        token_ids = m.get("token_ids") or []
        return BlockStored(
            block_hashes=_hashes(m.get("block_hashes"), "BlockStored.block_hashes"),
            parent_block_hash=None
            if m.get("parent_block_hash") is None
            else _check_hash(m["parent_block_hash"], "BlockStored.parent_block_hash"),
            block_size=_int(m.get("block_size"), "BlockStored.block_size", 1),
            medium=_medium(m.get("medium")),
            group_idx=_int(m.get("group_idx") or 0, "BlockStored.group_idx"),
            sliding_window=None if window is None else _int(window, "sliding window", 1),
            token_ids=tuple(token_ids) if isinstance(token_ids, list) else (),
        )
    if kind == "BlockRemoved":
        return BlockRemoved(
            block_hashes=_hashes(m.get("block_hashes"), "BlockRemoved.block_hashes"),
            medium=_medium(m.get("medium")),
            group_idx=_int(m.get("group_idx") or 0, "BlockRemoved.group_idx"),
        )
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise _fail(f"unknown event type {kind!r}")


_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id")


def _from_array(a: list[Any]) -> Event:
    """vLLM's positional encoding: the type tag, then the fields in declaration order."""
    kind = a[0] if a else None
    if kind == "BlockStored":
        m = dict(zip(_STORED_FIELDS, a[1:6], strict=False))
        m.update(type=kind, medium=a[6] if len(a) > 6 else None)
        if len(a) > 8:  # later fields, when present: lora_name, extra_keys, group_idx
            m["group_idx"] = a[9] if len(a) > 9 else 0
        return _from_map(m)
    if kind == "BlockRemoved":
        return _from_map(
            {
                "type": kind,
                "block_hashes": a[1] if len(a) > 1 else None,
                "medium": a[2] if len(a) > 2 else None,
                "group_idx": a[3] if len(a) > 3 else 0,
            }
        )
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise _fail(f"unknown event type {kind!r}")


def decode_batch(data: bytes) -> EventBatch:
    """Read a batch in either of vLLM's encodings; EventError says what was wrong."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise _fail(f"a batch must be bytes, got {type(data).__name__}")
    if len(data) > MAX_EVENT_BYTES:
        raise _fail(f"batch of {len(data)} bytes > limit {MAX_EVENT_BYTES}")
    try:
        msg = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise _fail(f"not msgpack: {type(e).__name__}: {e}"[:200]) from None
    if not isinstance(msg, list) or len(msg) not in (2, 3):
        raise _fail("a batch must be [ts, events, data_parallel_rank]")
    ts, raw = msg[0], msg[1]
    dp = msg[2] if len(msg) == 3 else None
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise _fail(f"ts must be a number, got {ts!r}")
    if not isinstance(raw, list):
        raise _fail(f"events must be a list, got {type(raw).__name__}")
    if dp is not None and type(dp) is not int:
        raise _fail(f"data_parallel_rank must be an int or nil, got {dp!r}")
    events: list[Event] = []
    for item in raw:
        if isinstance(item, dict):
            events.append(_from_map(item))
        elif isinstance(item, list):
            events.append(_from_array(item))
        else:
            raise _fail(f"an event must be a map or an array, got {type(item).__name__}")
    return EventBatch(float(ts), tuple(events), dp)


def decode_envelope(data: bytes) -> Envelope:
    try:
        msg = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise _fail(f"envelope is not msgpack: {type(e).__name__}") from None
    if not isinstance(msg, list) or len(msg) != 5:
        raise _fail("an envelope must be [kind, source, incarnation, seq, batch]")
    kind, source, incarnation, seq, body = msg
    if kind not in (RANK, HOST):
        raise _fail(f"source kind must be {RANK!r} or {HOST!r}, got {kind!r}")
    return Envelope(
        kind,
        _int(source, "source"),
        _int(incarnation, "incarnation"),
        _int(seq, "seq", 1),
        decode_batch(body),
    )


def num_hashes(events: Sequence[Event]) -> int:
    """How many block hashes the events name (what an ingest rate counts)."""
    return sum(len(e.block_hashes) for e in events if not isinstance(e, AllBlocksCleared))

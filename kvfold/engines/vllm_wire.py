"""vLLM's KV events as they come off its ZMQ publisher, decoded strictly. Pure; no Ray,
no sockets (the shell hands frames in).

    live   [topic, seq (8 bytes, big-endian, from 0), payload]
    replay [b"", topic, seq, payload] ... then [b"", b"", ff * 8, b""]   (a DEALER asked
           with [b"", start_seq as 8 bytes]; SGLang's replies leave out the topic)
    payload  [ts, [event, ...], data_parallel_rank]                     (msgpack)
    event    {"type": "BlockStored", "block_hashes": [h, ...], "parent_block_hash": h | nil,
              "token_ids": [...], "block_size": B, "lora_id": ..., "medium": "GPU",
              "lora_name": ..., "extra_keys": [k | nil per block] | nil, "group_idx": g, ...}
             {"type": "BlockRemoved", "block_hashes": [h], "medium": m, "group_idx": g}
             {"type": "AllBlocksCleared"}
             or the positional arrays of vLLM up to about v0.23 (the tag first)

Hashes are unsigned 64-bit ints (vLLM's default) or bytes. Unlike kvfold's own events
(kvfold.kvevents.events), an engine's are untrusted input: every field is checked, and
anything wrong raises WireError with a short reason (counted by the caller) and a detail.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeAlias

import msgpack
import numpy as np

from kvfold.errors import KVFoldError

EngineHash: TypeAlias = int | bytes
END_SEQ = 2**64 - 1  # the replay's end marker
MAX_PAYLOAD_BYTES = 16 * 1024 * 1024
MAX_EVENTS = 65_536  # per batch
MAX_HASHES = 65_536  # per event
MAX_TOKEN_ID = 2**32
MAX_HASH_BYTES = 64


class WireError(KVFoldError, ValueError):
    """Engine output kvfold cannot read: `reason` is a short tag (counted), the message
    says what was wrong."""

    def __init__(self, reason: str, detail: str) -> None:
        self.reason = reason
        super().__init__(f"{reason}: {detail}")


@dataclass(frozen=True, slots=True)
class EngineStored:
    """Blocks an engine made reusable, in prefix order, with their tokens (maybe none)."""

    block_hashes: tuple[EngineHash, ...]
    parent_block_hash: EngineHash | None
    token_ids: tuple[int, ...]
    block_size: int
    group_idx: int = 0
    medium: str = "GPU"
    extra_keys: tuple[Any, ...] | None = None  # one per block (LoRA, salt, multimodal)
    lora_name: str | None = None
    sliding_window: int | None = None


@dataclass(frozen=True, slots=True)
class EngineRemoved:
    block_hashes: tuple[EngineHash, ...]
    group_idx: int = 0
    medium: str = "GPU"


@dataclass(frozen=True, slots=True)
class EngineCleared:
    """AllBlocksCleared: the engine's prefix cache was reset."""


EngineEvent: TypeAlias = EngineStored | EngineRemoved | EngineCleared


@dataclass(frozen=True, slots=True)
class EngineBatch:
    seq: int
    ts: float
    events: tuple[EngineEvent, ...]
    data_parallel_rank: int | None = None


# ------------------------------------------------------------------ frames


def decode_live(frames: list[bytes]) -> EngineBatch:
    """One message of the live stream: [topic, seq, payload]."""
    if not isinstance(frames, list) or len(frames) != 3:
        raise WireError("bad_frame", f"a live message has 3 frames, got {frame_count(frames)}")
    return decode_payload(seq_of(frames[1]), frames[2])


def decode_replay(frames: list[bytes]) -> EngineBatch | None:
    """One message of a replay answer: a batch, or None for the end marker. Takes vLLM's
    [b"", topic, seq, payload] and SGLang's [b"", seq, payload]."""
    if not isinstance(frames, list) or len(frames) not in (3, 4) or frames[0] != b"":
        raise WireError("bad_frame", f"a replay message is [b'', (topic,) seq, payload], got "
                        f"{frame_count(frames)} frames")  # fmt: skip
    seq_frame, payload = frames[-2], frames[-1]
    seq = seq_of(seq_frame)
    if seq == END_SEQ:
        return None
    return decode_payload(seq, payload)


def replay_request(start_seq: int) -> list[bytes]:
    """What a DEALER sends to ask for every kept batch from `start_seq` on."""
    if type(start_seq) is not int or not 0 <= start_seq < END_SEQ:
        raise ValueError(f"start_seq must be an int in [0, 2**64 - 1), got {start_seq!r}")
    return [b"", start_seq.to_bytes(8, "big")]


def frame_count(frames: Any) -> str:
    return str(len(frames)) if isinstance(frames, list) else type(frames).__name__


def seq_of(frame: Any) -> int:
    """A frame's sequence number (8 bytes, big-endian)."""
    if not isinstance(frame, (bytes, bytearray)) or len(frame) != 8:
        raise WireError("bad_frame", "the sequence number must be 8 bytes, big-endian")
    return int.from_bytes(frame, "big")


# ------------------------------------------------------------------ payload


def decode_payload(seq: int, payload: Any) -> EngineBatch:
    ts, raw, dp = unpack_batch(payload, "data_parallel_rank")
    return EngineBatch(seq, ts, _events(raw), dp)


def unpack_batch(payload: Any, rank_field: str) -> tuple[float, list[Any], int | None]:
    """(ts, raw events, rank) of a batch payload `[ts, events(, rank)]`, checked: what
    vLLM's and SGLang's publishers share (`rank_field` names the third field)."""
    if not isinstance(payload, (bytes, bytearray)):
        raise WireError("bad_frame", f"a payload must be bytes, got {type(payload).__name__}")
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise WireError("too_large", f"{len(payload)} bytes > {MAX_PAYLOAD_BYTES}")
    try:
        msg = msgpack.unpackb(
            payload, raw=False, strict_map_key=False, max_array_len=MAX_HASHES * 64
        )
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise WireError("bad_msgpack", f"{type(e).__name__}: {e}"[:200]) from None
    if not isinstance(msg, list) or len(msg) not in (2, 3):
        raise WireError("bad_batch", f"a batch must be [ts, events, {rank_field}]")
    ts, raw = msg[0], msg[1]
    dp = msg[2] if len(msg) == 3 else None
    if type(ts) not in (int, float):
        raise WireError("bad_batch", f"ts must be a number, got {type(ts).__name__}")
    if not isinstance(raw, list):
        raise WireError("bad_batch", f"events must be a list, got {type(raw).__name__}")
    if len(raw) > MAX_EVENTS:
        raise WireError("too_large", f"{len(raw)} events in one batch > {MAX_EVENTS}")
    if dp is not None and (type(dp) is not int or not 0 <= dp < 2**31):
        raise WireError("bad_batch", f"{rank_field} must be an int >= 0 or nil, got {dp!r}")
    return float(ts), raw, dp


def _events(raw: list[Any]) -> tuple[EngineEvent, ...]:
    """The batch's events, in order; a run of BlockRemoved maps of one group and medium
    (vLLM sends one per evicted block) becomes one EngineRemoved, read on a fast path."""
    out: list[EngineEvent] = []
    run: list[EngineHash] = []
    run_key: tuple[int, str] = (0, "GPU")
    for item in raw:
        if type(item) is dict and item.get("type") == "BlockRemoved":
            hashes = item.get("block_hashes")
            g = item.get("group_idx", 0) or 0
            if (  # vLLM's own shape, checked inline: one int hash, on the GPU
                type(hashes) is list
                and len(hashes) == 1
                and type(hashes[0]) is int
                and 0 <= hashes[0] < 2**64
                and type(g) is int
                and 0 <= g < 2**31
                and item.get("medium", "GPU") == "GPU"
            ):
                key = (g, "GPU")
            else:
                key = (check_int(g, "BlockRemoved.group_idx"), check_medium(item.get("medium")))
                hashes = check_hashes(hashes, "BlockRemoved.block_hashes")
            if run and key != run_key:
                out.append(EngineRemoved(tuple(run), *run_key))
                run = []
            run_key = key
            run += hashes
            continue
        if run:
            out.append(EngineRemoved(tuple(run), *run_key))
            run = []
        out.append(_event(item))
    if run:
        if len(run) > MAX_HASHES:
            raise WireError("too_large", f"{len(run)} blocks removed in one batch > {MAX_HASHES}")
        out.append(EngineRemoved(tuple(run), *run_key))
    return tuple(out)


_POSITIONAL = {
    # vLLM's array_like events: the tag, then the fields in declaration order
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size",
                    "lora_id", "medium", "lora_name", "extra_keys", "group_idx"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}  # fmt: skip


def _event(item: Any) -> EngineEvent:
    if isinstance(item, list):
        tag = item[0] if item else None
        names = _POSITIONAL.get(tag) if isinstance(tag, str) else None
        if names is None:
            raise WireError("unknown_event", f"unknown event type {str(tag)[:40]!r}")
        item = {"type": tag, **dict(zip(names, item[1:], strict=False))}
    if not isinstance(item, dict):
        raise WireError("bad_event", f"an event must be a map or an array, not "
                        f"{type(item).__name__}")  # fmt: skip
    kind = item.get("type")
    if kind == "BlockStored":
        return _stored(item)
    if kind == "BlockRemoved":
        return EngineRemoved(
            check_hashes(item.get("block_hashes"), "BlockRemoved.block_hashes"),
            check_int(item.get("group_idx", 0) or 0, "BlockRemoved.group_idx"),
            check_medium(item.get("medium")),
        )
    if kind == "AllBlocksCleared":
        return EngineCleared()
    raise WireError("unknown_event", f"unknown event type {str(kind)[:40]!r}")


def _stored(m: dict[Any, Any]) -> EngineStored:
    hashes = check_hashes(m.get("block_hashes"), "BlockStored.block_hashes")
    parent = m.get("parent_block_hash")
    size = check_int(m.get("block_size"), "BlockStored.block_size", 1)
    tokens = m.get("token_ids") or []
    if not isinstance(tokens, list) or not _token_ids_ok(tokens):
        raise WireError("bad_field", "BlockStored.token_ids must be a list of token ids")
    if tokens and len(tokens) != size * len(hashes):
        raise WireError("bad_field", f"BlockStored has {len(hashes)} blocks of {size} tokens "
                        f"but {len(tokens)} token ids")  # fmt: skip
    extra = m.get("extra_keys")
    if extra is not None and (not isinstance(extra, list) or len(extra) != len(hashes)):
        raise WireError("bad_field", "BlockStored.extra_keys must be one entry per block")
    lora = m.get("lora_name")
    if lora is not None and not isinstance(lora, str):
        raise WireError("bad_field", "BlockStored.lora_name must be a str or nil")
    window = m.get("kv_cache_spec_sliding_window")
    return EngineStored(
        block_hashes=hashes,
        parent_block_hash=None if parent is None else check_hash(parent, "parent_block_hash"),
        token_ids=tuple(tokens),
        block_size=size,
        group_idx=check_int(m.get("group_idx", 0) or 0, "BlockStored.group_idx"),
        medium=check_medium(m.get("medium")),
        extra_keys=None if extra is None else tuple(_frozen(k) for k in extra),
        lora_name=lora,
        sliding_window=None if window is None else check_int(window, "sliding window", 1),
    )


def _token_ids_ok(tokens: list[Any]) -> bool:
    """Every entry an int in [0, MAX_TOKEN_ID): checked at C speed (a batch carries
    hundreds of them per block stored)."""
    if not tokens:
        return True
    try:
        arr = np.array(tokens)
    except (ValueError, TypeError, OverflowError):
        return False
    return (
        arr.ndim == 1
        and arr.dtype.kind in "iu"
        and int(arr.min()) >= 0
        and int(arr.max()) < MAX_TOKEN_ID
    )


def check_hashes(value: Any, what: str) -> tuple[EngineHash, ...]:
    if not isinstance(value, list) or not value:
        raise WireError("bad_field", f"{what} must be a non-empty list of hashes")
    if len(value) > MAX_HASHES:
        raise WireError("too_large", f"{what}: {len(value)} hashes > {MAX_HASHES}")
    return tuple(check_hash(h, what) for h in value)


def check_hash(h: Any, what: str) -> EngineHash:
    if type(h) is int and -(2**63) <= h < 2**64:
        return h
    if isinstance(h, bytes) and 0 < len(h) <= MAX_HASH_BYTES:
        return h
    raise WireError("bad_field", f"{what}: a hash is a 64-bit int or 1..{MAX_HASH_BYTES} "
                    f"bytes, got {type(h).__name__}")  # fmt: skip


def check_int(value: Any, what: str, lo: int = 0) -> int:
    if type(value) is not int or not lo <= value < 2**31:
        raise WireError("bad_field", f"{what} must be an int >= {lo}, got {str(value)[:40]}")
    return value


def check_medium(value: Any) -> str:
    if value is None:
        return "GPU"
    if not isinstance(value, str) or not 0 < len(value) <= 32:
        raise WireError("bad_field", f"medium must be a short str, got {str(value)[:40]!r}")
    return value.upper()


def _frozen(value: Any) -> Any:
    """An extra key as something hashable and msgpack-able (lists become tuples)."""
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        raise WireError("bad_field", "BlockStored.extra_keys entries must not be maps")
    return value


__all__ = [
    "END_SEQ",
    "EngineBatch",
    "EngineCleared",
    "EngineEvent",
    "EngineHash",
    "EngineRemoved",
    "EngineStored",
    "WireError",
    "decode_live",
    "decode_payload",
    "decode_replay",
    "replay_request",
]

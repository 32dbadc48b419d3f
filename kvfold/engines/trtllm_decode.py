"""TensorRT-LLM's KV cache events as its LLM API and trtllm-serve hand them out (JSON,
tensorrt_llm/_utils.py KVCacheEventSerializer), decoded strictly. Pure; no Ray, no HTTP.

    POST /kv_cache_events -> [event, ...]       (drains the engine's event queue)
    event  {"event_id": n, "data": {...}, "window_size": w [, "attention_dp_rank": r]}
    data   {"type": "created", "num_blocks_per_cache_level": [primary, secondary]}
           {"type": "stored", "parent_hash": h | null, "blocks": [
               {"type": "stored_block", "block_hash": h, "cache_level": 0, "priority": p,
                "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": x}, ...]
                [, "lora_id": l] [, "cache_salt": s]
                [, "mm_keys": [{"type": "mm_key", "hash": hex, "start_offset": o}]]}, ...]}
           {"type": "removed", "block_hashes": [h, ...]}
           {"type": "updated", "block_hash": h,
            "cache_level": {"type": "event_diff", "old_value": a, "new_value": b} | null,
            "priority": {"type": "event_diff", ...} | null}

    decode_events(body) -> [TRTLLMEvent, ...]

Hashes are 64-bit ints or hex digests (kept as bytes); token_extra_id (prompt tuning),
mm_keys, lora_id and cache_salt become a block's extra keys. Anything wrong raises WireError
with a short reason (counted by the caller). What the events mean for kvfold's index is
kvfold.engines.trtllm_events (TRTLLMTranslator).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvfold.engines.vllm_wire import (
    MAX_EVENTS,
    MAX_HASH_BYTES,
    MAX_HASHES,
    MAX_PAYLOAD_BYTES,
    MAX_TOKEN_ID,
    EngineHash,
    WireError,
)


@dataclass(frozen=True, slots=True)
class TRTLLMBlock:
    block_hash: EngineHash
    token_ids: tuple[int, ...]
    extra: tuple[Any, ...]  # () for a plain block
    cache_level: int
    priority: int


@dataclass(frozen=True, slots=True)
class TRTLLMEvent:
    """One decoded event; which fields mean something depends on `kind`."""

    event_id: int
    kind: str  # "created" | "stored" | "removed" | "updated"
    window_size: int
    attention_dp_rank: int | None = None
    num_blocks_per_cache_level: tuple[int, ...] = ()  # created
    parent_hash: EngineHash | None = None  # stored
    blocks: tuple[TRTLLMBlock, ...] = ()  # stored
    block_hashes: tuple[EngineHash, ...] = ()  # removed; updated: its one block
    cache_level: tuple[int, int] | None = None  # updated: (old, new)


# ------------------------------------------------------------------ decoding


def decode_events(body: bytes | str) -> list[TRTLLMEvent]:
    """A /kv_cache_events answer (a JSON list of events), strictly."""
    items = _json(body)
    if not isinstance(items, list):
        raise WireError("bad_page", f"a page of events is a JSON list, got {type(items).__name__}")
    if len(items) > MAX_EVENTS:
        raise WireError("too_large", f"{len(items)} events in one page > {MAX_EVENTS}")
    return [_event(item) for item in items]


def _json(body: Any) -> Any:
    if not isinstance(body, (bytes, bytearray, str)):
        raise WireError("bad_json", f"a JSON body is bytes or str, got {type(body).__name__}")
    if len(body) > MAX_PAYLOAD_BYTES:
        raise WireError("too_large", f"{len(body)} bytes > {MAX_PAYLOAD_BYTES}")
    try:
        return json.loads(body, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise WireError("bad_json", f"{type(e).__name__}: {e}"[:200]) from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number")


def _event(item: Any) -> TRTLLMEvent:
    if not isinstance(item, dict):
        raise WireError("bad_event", f"an event is a JSON object, not {type(item).__name__}")
    event_id = _int(item.get("event_id"), "event_id", hi=2**64)
    window = _int(item.get("window_size"), "window_size", lo=1)
    rank_raw = item.get("attention_dp_rank")
    rank = None if rank_raw is None else _int(rank_raw, "attention_dp_rank")
    data = item.get("data")
    if not isinstance(data, dict):
        raise WireError("bad_event", "an event's data is a JSON object")
    kind = data.get("type")
    if kind == "created":
        levels = data.get("num_blocks_per_cache_level")
        if not isinstance(levels, list) or not 0 < len(levels) <= 8:
            raise WireError("bad_field", "created.num_blocks_per_cache_level is a short list")
        counts = tuple(_int(n, "num_blocks_per_cache_level") for n in levels)
        return TRTLLMEvent(event_id, kind, window, rank, num_blocks_per_cache_level=counts)
    if kind == "stored":
        blocks = data.get("blocks")
        if not isinstance(blocks, list) or not 0 < len(blocks) <= MAX_HASHES:
            raise WireError("bad_field", "stored.blocks is a non-empty list")
        parent = data.get("parent_hash")
        return TRTLLMEvent(
            event_id,
            kind,
            window,
            rank,
            parent_hash=None if parent is None else _hash(parent, "stored.parent_hash"),
            blocks=tuple(_block(b) for b in blocks),
        )
    if kind == "removed":
        hashes = data.get("block_hashes")
        if not isinstance(hashes, list) or not 0 < len(hashes) <= MAX_HASHES:
            raise WireError("bad_field", "removed.block_hashes is a non-empty list")
        removed = tuple(_hash(h, "removed.block_hashes") for h in hashes)
        return TRTLLMEvent(event_id, kind, window, rank, block_hashes=removed)
    if kind == "updated":
        _diff(data.get("priority"), "updated.priority")
        return TRTLLMEvent(
            event_id,
            kind,
            window,
            rank,
            block_hashes=(_hash(data.get("block_hash"), "updated.block_hash"),),
            cache_level=_diff(data.get("cache_level"), "updated.cache_level"),
        )
    raise WireError("unknown_event", f"unknown event type {str(kind)[:40]!r}")


def _block(b: Any) -> TRTLLMBlock:
    if not isinstance(b, dict):
        raise WireError("bad_field", "a stored block is a JSON object")
    tokens = b.get("tokens")
    if not isinstance(tokens, list) or len(tokens) > 1 << 16:
        raise WireError("bad_field", "stored_block.tokens is a list")
    ids: list[int] = []
    extra_ids: list[int] = []
    for t in tokens:
        if not isinstance(t, dict):
            raise WireError("bad_field", "a token is a JSON object {token_id, token_extra_id}")
        ids.append(_int(t.get("token_id"), "token_id", hi=MAX_TOKEN_ID))
        extra_ids.append(_int(t.get("token_extra_id", 0), "token_extra_id", hi=2**64))
    extra: list[Any] = []
    if any(extra_ids):
        extra.append(("trtllm-token-extra-ids", tuple(extra_ids)))
    lora = b.get("lora_id")
    if lora is not None:
        extra.append(("trtllm-lora", _int(lora, "lora_id", hi=2**64)))
    salt = b.get("cache_salt")
    if salt is not None:
        if not isinstance(salt, (str, int)) or isinstance(salt, bool):
            raise WireError("bad_field", "stored_block.cache_salt is a str or an int")
        extra.append(("trtllm-cache-salt", salt))
    mm = b.get("mm_keys") or []
    if not isinstance(mm, list):
        raise WireError("bad_field", "stored_block.mm_keys is a list")
    for k in mm:
        if not isinstance(k, dict) or not isinstance(k.get("hash"), str) or len(k["hash"]) > 256:
            raise WireError("bad_field", "an mm_key is {hash: hex str, start_offset: int}")
        extra.append(("trtllm-mm", k["hash"], _int(k.get("start_offset", 0), "start_offset")))
    return TRTLLMBlock(
        block_hash=_hash(b.get("block_hash"), "stored_block.block_hash"),
        token_ids=tuple(ids),
        extra=tuple(extra),
        cache_level=_int(b.get("cache_level", 0), "cache_level", hi=16),
        priority=_int(b.get("priority", 0), "priority", hi=2**31),
    )


def _diff(value: Any, what: str) -> tuple[int, int] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise WireError("bad_field", f"{what} is an event_diff object or null")
    return _int(value.get("old_value"), what), _int(value.get("new_value"), what)


def _hash(h: Any, what: str) -> EngineHash:
    """A 64-bit int, or a hex digest (as bytes)."""
    if type(h) is int and -(2**63) <= h < 2**64:
        return h
    if isinstance(h, str) and 0 < len(h) <= 2 * MAX_HASH_BYTES:
        try:
            return bytes.fromhex(h)
        except ValueError:
            pass
    raise WireError("bad_field", f"{what}: a hash is a 64-bit int or a hex digest, got "
                    f"{str(h)[:40]!r}")  # fmt: skip


def _int(value: Any, what: str, lo: int = 0, hi: int = 2**31) -> int:
    if type(value) is not int or not lo <= value < hi:
        raise WireError("bad_field", f"{what} must be an int in [{lo}, {hi}), got "
                        f"{str(value)[:40]}")  # fmt: skip
    return value


__all__ = ["TRTLLMBlock", "TRTLLMEvent", "decode_events"]

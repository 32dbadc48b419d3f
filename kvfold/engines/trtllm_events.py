"""TensorRT-LLM's KV cache events as its LLM API and trtllm-serve hand them out (JSON,
tensorrt_llm/_utils.py KVCacheEventSerializer), turned into kvfold's EngineBatch /
EngineEvent types. Pure; no Ray, no HTTP.

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

What kvfold makes of it (TRTLLMTranslator, one per engine attention-DP rank):

  - Order. event_id is a sequence per event manager (per attention-DP rank), from 0; each
    event becomes one EngineBatch with seq = event_id (ts: the caller's clock, events carry
    none). The engine keeps at most event_buffer_max_size events for a reader: one that
    falls behind loses some, and there is no replay socket, so a gap puts the source out
    of sync at once (feed_page calls replay_failed): no false credit. A reader that
    joins late (its first event id is not 0) is out of sync the same way, until the engine
    stores blocks again.
  - Window groups. One group per distinct window_size; the largest (full attention: TRT-LLM
    gives full-attention layers the model's max sequence length) is group 0, the others
    follow in descending order with sliding_window = their size. The sizes of a page's
    created events are numbered together (TRT-LLM sends them smallest first); a size met
    later takes the next number.
  - Cache levels. Level 0 is the primary (GPU) pool, 1 the secondary (host) pool.
      stored at level 0            EngineStored on the GPU
      updated 0 -> 1 (offloaded)   EngineRemoved from the GPU
      updated 1 -> 0 (onboarded)   EngineStored on the GPU again, from the tokens and
                                   parent the translator kept from the block's stored
                                   event (it keeps them for every block the engine
                                   holds); a block whose store it never saw: nothing
                                   (counted)
      removed                      EngineRemoved from the GPU for blocks on the GPU (or
                                   unknown here); blocks on the host are forgotten
    Host-pool blocks are not sent on as events (their parents are mostly on the GPU, where
    a host-tier source could not key them); num_blocks_secondary counts them.
  - Keys. Only full blocks (tokens_per_block tokens) carry their tokens on; a partial block
    is stored without (counted, never credited). token_extra_id (prompt tuning), mm_keys,
    lora_id and cache_salt become per-block extra keys: such blocks never meet a plain
    prompt's keys.

Anything wrong raises WireError with a short reason (counted by the caller). The stats
are read by kvfold.engines.trtllm_stats.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

from kvfold.engines.vllm_wire import (
    MAX_EVENTS,
    MAX_HASH_BYTES,
    MAX_HASHES,
    MAX_PAYLOAD_BYTES,
    MAX_TOKEN_ID,
    EngineBatch,
    EngineEvent,
    EngineHash,
    EngineRemoved,
    EngineStored,
    WireError,
)

if TYPE_CHECKING:
    from kvfold.blockindex.events import Event
    from kvfold.engines.engine_source import EngineSource

GPU = "GPU"
PRIMARY = 0  # cache_level of the GPU pool


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


# ------------------------------------------------------------------ translating


_Block: TypeAlias = tuple[EngineHash, tuple[int, ...], tuple[Any, ...]]  # hash, tokens, extra


@dataclass(slots=True)
class _Held:
    """What kvfold keeps of a block the engine stored: enough to store it again."""

    parent: EngineHash | None
    token_ids: tuple[int, ...]  # () when not a full block
    extra: tuple[Any, ...]
    level: int


class TRTLLMTranslator:
    """One engine attention-DP rank's TensorRT-LLM events as EngineBatches, one per event.
    Owns what it kept of each block (its parent, tokens and cache level); pages of other
    ranks' events are skipped (counted), so each rank's translator can read the same page."""

    def __init__(
        self, tokens_per_block: int, attention_dp_rank: int = 0, window_sizes: Sequence[int] = ()
    ) -> None:
        if type(tokens_per_block) is not int or tokens_per_block < 1:
            raise ValueError(f"tokens_per_block must be an int >= 1, got {tokens_per_block!r}")
        if type(attention_dp_rank) is not int or attention_dp_rank < 0:
            raise ValueError(f"attention_dp_rank must be an int >= 0, got {attention_dp_rank!r}")
        if any(type(w) is not int or w < 1 for w in window_sizes):
            raise ValueError(f"window_sizes must be ints >= 1, got {list(window_sizes)!r}")
        self.tokens_per_block = tokens_per_block
        self.attention_dp_rank = attention_dp_rank
        self.groups: dict[int, int] = {}  # window size -> window group
        self._number(window_sizes)
        self.num_blocks_per_cache_level: dict[int, tuple[int, ...]] = {}  # per window size
        self.held: dict[tuple[int, EngineHash], _Held] = {}  # (group, engine hash)
        self.last_event_id: int | None = None
        self.counts: Counter[str] = Counter()

    def take_page(self, body: bytes | str, now_s: float) -> list[EngineBatch]:
        """A /kv_cache_events answer: this rank's events as batches (WireError: none)."""
        return self.translate(decode_events(body), now_s)

    def translate(self, events: Sequence[TRTLLMEvent], now_s: float) -> list[EngineBatch]:
        mine = [e for e in events if (e.attention_dp_rank or 0) == self.attention_dp_rank]
        self.counts["other_rank"] += len(events) - len(mine)
        self._number([e.window_size for e in mine if e.kind == "created"])
        out: list[EngineBatch] = []
        for e in mine:
            if self.last_event_id is not None and e.event_id <= self.last_event_id:
                self.counts["restarts"] += 1  # ids start over: a new engine process
                self.held.clear()
            self.last_event_id = e.event_id
            group = self.group_of(e.window_size)
            window = None if group == 0 else e.window_size
            made = self._events(e, group, window)
            out.append(EngineBatch(e.event_id, now_s, made, self.attention_dp_rank))
        return out

    def group_of(self, window_size: int) -> int:
        """The window group of a window size (a new size takes the next number)."""
        if window_size not in self.groups:
            self.groups[window_size] = len(self.groups)
        return self.groups[window_size]

    def _number(self, window_sizes: Sequence[int]) -> None:
        for w in sorted(set(window_sizes) - set(self.groups), reverse=True):
            self.group_of(w)

    @property
    def num_blocks_secondary(self) -> int:
        """Blocks the engine holds in its host pool, as far as its events said."""
        return sum(1 for h in self.held.values() if h.level != PRIMARY)

    # ------------------------------------------------------------------ per kind

    def _events(self, e: TRTLLMEvent, group: int, window: int | None) -> tuple[EngineEvent, ...]:
        if e.kind == "created":
            self.num_blocks_per_cache_level[e.window_size] = e.num_blocks_per_cache_level
            return ()
        if e.kind == "stored":
            return self._stored(e, group, window)
        if e.kind == "removed":
            gone = []
            for h in e.block_hashes:
                held = self.held.pop((group, h), None)
                if held is None or held.level == PRIMARY:
                    gone.append(h)
                else:
                    self.counts["removed_from_host"] += 1
            return (EngineRemoved(tuple(gone), group, GPU),) if gone else ()
        return self._updated(e, group, window)

    def _stored(self, e: TRTLLMEvent, group: int, window: int | None) -> tuple[EngineEvent, ...]:
        """Consecutive full GPU blocks go out as one EngineStored; anything else breaks
        the run (a partial block goes out alone, without tokens; a host block not at all)."""
        out: list[EngineEvent] = []
        run: list[_Block] = []
        run_parent: EngineHash | None = None
        parent = e.parent_hash
        for b in e.blocks:
            full = len(b.token_ids) == self.tokens_per_block
            tokens = b.token_ids if full else ()
            self.held[(group, b.block_hash)] = _Held(parent, tokens, b.extra, b.cache_level)
            if b.cache_level == PRIMARY and full:
                if not run:
                    run_parent = parent
                run.append((b.block_hash, tokens, b.extra))
            else:
                if run:
                    out.append(self._store(group, window, run_parent, run))
                    run = []
                if b.cache_level == PRIMARY:
                    self.counts["partial_blocks"] += 1
                    out.append(self._store(group, window, parent, [(b.block_hash, (), b.extra)]))
            parent = b.block_hash
        if run:
            out.append(self._store(group, window, run_parent, run))
        return tuple(out)

    def _store(
        self, group: int, window: int | None, parent: EngineHash | None, blocks: list[_Block]
    ) -> EngineStored:
        """Blocks (hash, tokens, extra) as one EngineStored; tokens only if all have them."""
        keyable = all(tokens for _, tokens, _ in blocks)
        extras = tuple(extra or None for _, _, extra in blocks)
        return EngineStored(
            block_hashes=tuple(h for h, _, _ in blocks),
            parent_block_hash=parent,
            token_ids=tuple(t for _, tokens, _ in blocks for t in tokens) if keyable else (),
            block_size=self.tokens_per_block,
            group_idx=group,
            medium=GPU,
            extra_keys=extras if any(extras) else None,
            sliding_window=window,
        )

    def _updated(self, e: TRTLLMEvent, group: int, window: int | None) -> tuple[EngineEvent, ...]:
        if e.cache_level is None:
            self.counts["priority_updates"] += 1
            return ()
        h = e.block_hashes[0]
        held = self.held.get((group, h))
        if held is None:
            self.counts["updated_unknown"] += 1
            return ()
        new = e.cache_level[1]
        was_on_gpu, held.level = held.level == PRIMARY, new
        if was_on_gpu == (new == PRIMARY):
            return ()
        if was_on_gpu:
            self.counts["offloaded"] += 1
            return (EngineRemoved((h,), group, GPU),)
        self.counts["onboarded"] += 1
        return (self._store(group, window, held.parent, [(h, held.token_ids, held.extra)]),)


def feed_page(
    source: EngineSource, translator: TRTLLMTranslator, body: bytes | str, now_s: float
) -> list[Event]:
    """One /kv_cache_events answer into `source` (one source per translator). Refused output
    is counted in `source.refused` and changes nothing; a gap in the event ids cannot be
    replayed, so the source goes out of sync at once."""
    try:
        batches = translator.take_page(body, now_s)
    except WireError as e:
        source.refused[e.reason] += 1
        return []
    out: list[Event] = []
    for batch in batches:
        out += source.take_batch(batch, now_s)
    if source.wanted_replay() is not None:
        out += source.replay_failed(now_s)
    return out


__all__ = [
    "TRTLLMBlock",
    "TRTLLMEvent",
    "TRTLLMTranslator",
    "decode_events",
    "feed_page",
]

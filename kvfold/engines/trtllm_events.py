"""TensorRT-LLM's KV cache events as its LLM API and trtllm-serve hand them out (JSON,
tensorrt_llm/_utils.py KVCacheEventSerializer), turned into kvfold's EngineBatch /
EngineEvent types. Pure; no Ray, no HTTP.

    POST /kv_cache_events -> [event, ...]   decoded by kvfold.engines.trtllm_decode

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

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

from kvfold.engines.trtllm_decode import TRTLLMBlock, TRTLLMEvent, decode_events
from kvfold.engines.vllm_wire import (
    EngineBatch,
    EngineEvent,
    EngineHash,
    EngineRemoved,
    EngineStored,
    WireError,
)

if TYPE_CHECKING:
    from kvfold.engines.engine_source import EngineSource
    from kvfold.kvevents.events import Event

GPU = "GPU"
PRIMARY = 0  # cache_level of the GPU pool


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

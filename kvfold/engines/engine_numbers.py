"""EngineNumbers: what one engine rank's numbers page says, in kvfold's units (blocks), and
what it cannot say. Pure; no Ray, no HTTP: the pages come in parsed.

    vllm_numbers(VLLMMetrics)                          blocks as vLLM counts them
    sglang_numbers(SGLangMetrics, tokens_per_block)    tokens // page size
    trtllm_numbers([TRTLLMStats, ...], previous, tokens_per_block)
                                                       blocks, and per-interval counters

What each engine gives (None: it does not publish it; `unknown` names those fields):

    field               vLLM                   SGLang                     TensorRT-LLM
    num_blocks_total    cache_config_info      max_total_num_tokens // P  maxNumBlocks
    num_blocks_used     usage_perc x total     num_used_tokens // P       usedNumBlocks
    tokens_per_block    block_size             page_size (or the user's)  tokensPerBlock
    running / waiting   num_requests_*         num_running / queue_reqs   numActive / Queued
    num_blocks_cached   None                   None                       None
    deltas              None                   None                       the counters' growth

Committed blocks are never an engine's to say (kvfold's front door keeps them, DESIGN
§11): "committed" is always unknown. TensorRT-LLM's allocTotalBlocks, allocNewBlocks,
reusedBlocks and missedBlocks are cumulative per engine process; a rank reports how much
each grew since the previous page of the same process (kvfold's BlockDeltas mean what those
counters count). A counter that went down is a new process: it counted from 0, so all of
it is the interval's. The first page's baseline is its own oldest iteration, so kvfold
never credits what an engine counted before kvfold read it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from kvfold.engines.sglang_metrics import SGLangMetrics
from kvfold.engines.trtllm_stats import TRTLLMStats
from kvfold.engines.vllm_metrics import MetricsError, VLLMMetrics
from kvfold.stats import BlockDeltas

COMMITTED = "committed"  # of stats.UNKNOWABLE: no engine publishes it
_TRTLLM_COUNTERS = {  # BlockDeltas field <- TRTLLMStats field (cumulative)
    "alloc_total_blocks": "num_blocks_alloc_total",
    "alloc_new_blocks": "num_blocks_alloc_new",
    "reused_blocks": "num_blocks_reused",
    "missed_blocks": "num_blocks_missed",
}


@dataclass(frozen=True, slots=True)
class EngineNumbers:
    """One engine rank's numbers as of its latest page, in blocks of `tokens_per_block`
    tokens (0: the page did not say; the events may). `deltas`: the per-iteration block
    counters since the previous page (None: unknown); `counters`: the engine's own
    cumulative ones they were taken from (kept to diff the next page)."""

    num_blocks_total: int = 0
    num_blocks_used: int = 0
    tokens_per_block: int = 0
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    num_blocks_cached: int | None = None
    deltas: BlockDeltas | None = None
    counters: BlockDeltas | None = None
    process_start_time_s: float | None = None  # a new value: the engine restarted

    @property
    def unknown(self) -> frozenset[str]:
        """The fields of stats.UNKNOWABLE these numbers do not give."""
        out = {COMMITTED}
        if self.num_blocks_cached is None:
            out.add("cached")
        if self.deltas is None:
            out.add("deltas")
        return frozenset(out)

    def as_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in ("deltas", "counters"):
            value = out[name]
            if value is not None:
                out[name] = {f.name: getattr(value, f.name) for f in fields(value)}
        out["unknown"] = sorted(self.unknown)
        return out


def vllm_numbers(m: VLLMMetrics) -> EngineNumbers:
    """vLLM's page: total blocks (cache_config_info's num_gpu_blocks less vLLM's null
    block, which never holds tokens) and block size, blocks running requests hold (usage
    x usable blocks, at most that), requests running and waiting."""
    total = m.num_blocks_usable or 0
    return EngineNumbers(
        num_blocks_total=total,
        num_blocks_used=min(m.num_blocks_used or 0, total),
        tokens_per_block=m.block_size or 0,
        num_requests_running=m.num_requests_running or 0,
        num_requests_waiting=m.num_requests_waiting or 0,
        process_start_time_s=m.process_start_time_s,
    )


def sglang_numbers(m: SGLangMetrics, tokens_per_block: int | None) -> EngineNumbers:
    """SGLang's page counts tokens: blocks are whole pages of P tokens, P from the page's
    sglang:page_size or else `tokens_per_block` (the engine's --page-size, given by the
    user). MetricsError when neither says, or when they disagree."""
    page = _page_size("sglang:page_size", m.page_size, tokens_per_block)
    total = (m.max_total_num_tokens or 0) // page
    return EngineNumbers(
        num_blocks_total=total,
        num_blocks_used=min((m.num_used_tokens or 0) // page, total),
        tokens_per_block=page,
        num_requests_running=m.num_running_reqs or 0,
        num_requests_waiting=m.num_queue_reqs or 0,
        process_start_time_s=m.process_start_time_s,
    )


def trtllm_numbers(
    iterations: list[TRTLLMStats], previous: EngineNumbers | None, tokens_per_block: int | None
) -> EngineNumbers:
    """TensorRT-LLM's iteration stats since its previous answer (oldest first): the latest
    one's gauges, and how much its cumulative counters grew since `previous` (this rank's
    numbers from the previous page; None on the first). An answer with no iteration (an
    idle engine) leaves the numbers as they were, with nothing counted."""
    if not iterations:
        base = previous or EngineNumbers(tokens_per_block=tokens_per_block or 0)
        return replace(base, deltas=BlockDeltas())
    latest = iterations[-1]
    block = _page_size("tokensPerBlock", latest.tokens_per_block, tokens_per_block)
    total = latest.num_blocks_max or 0
    counters = _counters(latest)
    before = previous.counters if previous is not None else None
    if before is None:
        before = _counters(iterations[0])
    return EngineNumbers(
        num_blocks_total=total,
        num_blocks_used=min(latest.num_blocks_used or 0, total),
        tokens_per_block=block,
        num_requests_running=latest.num_requests_active or 0,
        num_requests_waiting=latest.num_requests_queued or 0,
        deltas=None if counters is None else _growth(counters, before),
        counters=counters,
    )


def _page_size(what: str, on_page: int | None, given: int | None) -> int:
    if on_page is not None and given is not None and on_page != given:
        raise MetricsError(
            f"{what} = {on_page} on the engine's page, but tokens_per_block = {given} was "
            "given: the engine's blocks are not the size kvfold was told"
        )
    size = on_page if on_page is not None else given
    if not size:
        raise MetricsError(
            f"the engine's page has no {what}: give tokens_per_block (the engine's page size)"
        )
    return size


def _counters(s: TRTLLMStats) -> BlockDeltas | None:
    values = {name: getattr(s, stat) for name, stat in _TRTLLM_COUNTERS.items()}
    if any(v is None for v in values.values()):
        return None
    return BlockDeltas(**values)


def _growth(now: BlockDeltas, before: BlockDeltas | None) -> BlockDeltas:
    """now - before, field by field; all of `now` when a counter went down (a new engine
    process counted from 0) or there is nothing before."""
    if before is None:
        return now
    grown = {name: getattr(now, name) - getattr(before, name) for name in _TRTLLM_COUNTERS}
    if any(v < 0 for v in grown.values()):
        return now
    return BlockDeltas(**grown)


__all__ = ["EngineNumbers", "sglang_numbers", "trtllm_numbers", "vllm_numbers"]

"""TensorRT-LLM's iteration stats as trtllm-serve's /metrics hands them out: a JSON list
of IterationStats (cpp executor/jsonSerialization.cpp), each with its KV cache numbers.
Pure; no Ray, no HTTP.

    GET /metrics -> [{"iter": n, "numActiveRequests": a, "numQueuedRequests": q, ...,
                      "kvCacheStats": {"maxNumBlocks", "freeNumBlocks", "usedNumBlocks",
                                       "tokensPerBlock", "allocTotalBlocks", "allocNewBlocks",
                                       "reusedBlocks", "missedBlocks", "cacheHitRate"}}, ...]

    parse_trtllm_stats(body) -> TRTLLMStats                 the latest iteration's numbers
    parse_trtllm_iterations(body) -> [TRTLLMStats, ...]     every one on the page, oldest first

TensorRT-LLM counts in blocks of tokensPerBlock tokens. A field the page does not carry
stays None: unknown, never 0. A page that is not such a list, or whose values are out of
range, raises MetricsError.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvfold.engines.vllm_metrics import MAX_PAGE_BYTES, MetricsError


@dataclass(frozen=True, slots=True)
class TRTLLMStats:
    """The latest iteration's KV cache numbers, in blocks (None: not published). The
    alloc / reused / missed counts are cumulative since the engine started."""

    iteration: int | None = None
    num_blocks_max: int | None = None
    num_blocks_free: int | None = None
    num_blocks_used: int | None = None
    tokens_per_block: int | None = None
    num_blocks_alloc_total: int | None = None
    num_blocks_alloc_new: int | None = None
    num_blocks_reused: int | None = None
    num_blocks_missed: int | None = None
    cache_hit_rate: float | None = None  # 0.0-1.0: reused / (reused + missed)
    num_requests_active: int | None = None
    num_requests_queued: int | None = None

    @property
    def usage(self) -> float | None:
        """Share of the primary pool in use (0.0-1.0)."""
        if self.num_blocks_used is None or not self.num_blocks_max:
            return None
        return self.num_blocks_used / self.num_blocks_max


_KV_FIELDS = {
    "maxNumBlocks": "num_blocks_max",
    "freeNumBlocks": "num_blocks_free",
    "usedNumBlocks": "num_blocks_used",
    "tokensPerBlock": "tokens_per_block",
    "allocTotalBlocks": "num_blocks_alloc_total",
    "allocNewBlocks": "num_blocks_alloc_new",
    "reusedBlocks": "num_blocks_reused",
    "missedBlocks": "num_blocks_missed",
}
_TOP_FIELDS = {
    "iter": "iteration",
    "numActiveRequests": "num_requests_active",
    "numQueuedRequests": "num_requests_queued",
}


def parse_trtllm_stats(body: bytes | str) -> TRTLLMStats:
    """trtllm-serve's /metrics answer (a JSON list of iteration stats): the latest one's
    numbers. An empty list (no iteration since the last answer) gives every field None."""
    iterations = parse_trtllm_iterations(body)
    return iterations[-1] if iterations else TRTLLMStats()


def parse_trtllm_iterations(body: bytes | str) -> list[TRTLLMStats]:
    """Every iteration's numbers on the page, oldest first (by `iter`; in page order where
    none says). trtllm-serve's /metrics drains the engine's stats queue: each answer holds
    the iterations since the previous one, and an idle engine answers []."""
    if isinstance(body, (bytes, bytearray, str)) and len(body) > MAX_PAGE_BYTES:
        raise MetricsError(f"stats page of {len(body)} bytes > {MAX_PAGE_BYTES}")
    try:
        items = json.loads(body, parse_constant=_no_constant)
    except (ValueError, TypeError, RecursionError) as e:
        raise MetricsError(f"not JSON: {type(e).__name__}: {e}"[:300]) from None
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise MetricsError("iteration stats are a JSON list of objects")
    order = sorted(range(len(items)), key=lambda n: (_iteration(items[n]), n))
    return [_stats(items[n]) for n in order]


def _iteration(item: dict[str, Any]) -> int:
    it = item.get("iter")
    return it if type(it) is int else -1


def _stats(item: dict[str, Any]) -> TRTLLMStats:
    fields: dict[str, Any] = {}
    for key, name in _TOP_FIELDS.items():
        fields[name] = _count(item.get(key), key)
    kv = item.get("kvCacheStats")
    if kv is not None:
        if not isinstance(kv, dict):
            raise MetricsError("kvCacheStats is a JSON object")
        for key, name in _KV_FIELDS.items():
            fields[name] = _count(kv.get(key), key)
        rate = kv.get("cacheHitRate")
        if rate is not None:
            if type(rate) not in (int, float) or not 0.0 <= rate <= 1.0:
                raise MetricsError(f"cacheHitRate = {str(rate)[:40]}: not in 0.0-1.0")
            fields["cache_hit_rate"] = float(rate)
    return TRTLLMStats(**fields)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number")


def _count(value: Any, what: str) -> int | None:
    if value is None:
        return None
    if type(value) is not int or value < 0:
        raise MetricsError(f"{what} = {str(value)[:40]}: not a count")
    return value


__all__ = ["TRTLLMStats", "parse_trtllm_iterations", "parse_trtllm_stats"]

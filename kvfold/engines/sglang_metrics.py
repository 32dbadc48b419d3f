"""What SGLang's /metrics page says about one engine's KV cache. Pure; no Ray, no HTTP.

    parse_sglang_metrics(text) -> {dp_rank label: SGLangMetrics}

Read with prometheus_client's own parser (names from SGLang's metrics collector,
python/sglang/srt/metrics/collector.py and its successors):

    sglang:max_total_num_tokens           the device KV pool, in tokens
    sglang:num_used_tokens                tokens held by running requests
    sglang:token_usage                    their share (0.0-1.0; on hybrid models the
                                          fullest of the full / SWA / mamba pools)
    sglang:cache_hit_rate                 prefix-cache hit rate (0.0-1.0)
    sglang:hicache_host_used_tokens       HiCache's host pool (L2): tokens held
    sglang:hicache_host_total_tokens      and its size
    sglang:num_running_reqs / _queue_reqs requests running, waiting
    sglang:page_size                      tokens per page (newer SGLang only)
    process_start_time_seconds            a new value: the engine restarted

SGLang counts in tokens, not blocks: turning them into kvfold's blocks (tokens //
page_size) is the caller's, with the page size it knows (this page's, when it carries
sglang:page_size, or the engine's configuration).

Samples are grouped by their `dp_rank` label ("" when absent). Tensor- and pipeline-parallel
ranks of one engine share its cache view: samples labelled with a tp_rank or pp_rank other
than "0" are skipped. A field the page does not carry stays None: unknown, never 0. A page
that is not a Prometheus exposition, or whose values are out of range, raises MetricsError.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from kvfold.engines.prom_lines import wanted_lines
from kvfold.engines.vllm_metrics import MAX_PAGE_BYTES, MetricsError


@dataclass(frozen=True, slots=True)
class SGLangMetrics:
    """One engine's numbers as its page said them, in tokens (None: not published)."""

    max_total_num_tokens: int | None = None
    num_used_tokens: int | None = None
    token_usage: float | None = None  # 0.0-1.0
    cache_hit_rate: float | None = None  # 0.0-1.0
    hicache_host_used_tokens: int | None = None
    hicache_host_total_tokens: int | None = None
    num_running_reqs: int | None = None
    num_queue_reqs: int | None = None
    page_size: int | None = None
    process_start_time_s: float | None = None

    @property
    def host_usage(self) -> float | None:
        """HiCache host pool's share in use (0.0-1.0)."""
        used, total = self.hicache_host_used_tokens, self.hicache_host_total_tokens
        if used is None or not total:
            return None
        return used / total


_FIELDS = {
    "sglang:max_total_num_tokens": "max_total_num_tokens",
    "sglang:num_used_tokens": "num_used_tokens",
    "sglang:token_usage": "token_usage",
    "sglang:cache_hit_rate": "cache_hit_rate",
    "sglang:hicache_host_used_tokens": "hicache_host_used_tokens",
    "sglang:hicache_host_total_tokens": "hicache_host_total_tokens",
    "sglang:num_running_reqs": "num_running_reqs",
    "sglang:num_queue_reqs": "num_queue_reqs",
    "sglang:page_size": "page_size",
}
_RATIOS = ("token_usage", "cache_hit_rate")
FAMILIES = ("process_start_time_seconds", *_FIELDS)


def parse_sglang_metrics(text: str) -> dict[str, SGLangMetrics]:
    """Every engine data-parallel rank on the page (by its `dp_rank` label)."""
    if not isinstance(text, str):
        raise MetricsError(f"a metrics page is text, got {type(text).__name__}")
    if len(text) > MAX_PAGE_BYTES:
        raise MetricsError(f"metrics page of {len(text)} characters > {MAX_PAGE_BYTES}")
    wanted = wanted_lines(text, FAMILIES)
    if text.strip() and not wanted.strip():
        raise MetricsError(f"no SGLang KV-cache metric on the page; it begins {text[:120]!r}")
    found: dict[str, dict[str, float]] = {}
    started: float | None = None
    try:
        for family in text_string_to_metric_families(wanted):
            for s in family.samples:
                if s.name == "process_start_time_seconds":
                    started = float(s.value)
                    continue
                field_name = _FIELDS.get(s.name)
                if field_name is None:
                    continue
                if s.labels.get("tp_rank", "0") != "0" or s.labels.get("pp_rank", "0") != "0":
                    continue
                number = float(s.value)
                if not math.isfinite(number) or number < 0:
                    raise MetricsError(f"{s.name} = {s.value}: not a count")
                found.setdefault(str(s.labels.get("dp_rank", "")), {})[field_name] = number
    except (ValueError, TypeError, IndexError) as e:
        if isinstance(e, MetricsError):
            raise
        raise MetricsError(f"not a Prometheus exposition: {e}"[:300]) from None
    out: dict[str, SGLangMetrics] = {}
    for rank, fields in found.items():
        for name in _RATIOS:
            if fields.get(name, 0.0) > 1.0:
                raise MetricsError(f"sglang:{name} = {fields[name]} > 1.0")
        used = fields.get("hicache_host_used_tokens")
        total = fields.get("hicache_host_total_tokens")
        if used is not None and total is not None and used > total:
            raise MetricsError(f"hicache host pool: {used} tokens used > {total} total")
        out[rank] = SGLangMetrics(
            max_total_num_tokens=_int(fields.get("max_total_num_tokens")),
            num_used_tokens=_int(fields.get("num_used_tokens")),
            token_usage=fields.get("token_usage"),
            cache_hit_rate=fields.get("cache_hit_rate"),
            hicache_host_used_tokens=_int(used),
            hicache_host_total_tokens=_int(total),
            num_running_reqs=_int(fields.get("num_running_reqs")),
            num_queue_reqs=_int(fields.get("num_queue_reqs")),
            page_size=_int(fields.get("page_size")),
            process_start_time_s=started,
        )
    return out


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


__all__ = ["SGLangMetrics", "parse_sglang_metrics"]

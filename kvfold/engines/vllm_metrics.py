"""What vLLM's /metrics page says about one engine's KV cache. Pure; no Ray, no HTTP.

    parse_vllm_metrics(text) -> {engine label: VLLMMetrics}

Read with prometheus_client's own parser, as Prometheus would read it, over the lines of
these families only (kvfold.engines.prom_lines; METRICS_QUERY asks the server for them):

    vllm:cache_config_info{num_gpu_blocks, block_size}   total blocks, tokens per block
    vllm:kv_cache_usage_perc                             the share of blocks running
                                                         requests hold (0.0-1.0; cached
                                                         blocks nobody holds are not in it)
    vllm:num_requests_running / _waiting                 requests
    vllm:prefix_cache_queries / _hits                    cumulative, in tokens
    vllm:num_preemptions                                 cumulative
    process_start_time_seconds                           a new value: the engine restarted

A field the page does not carry stays None: unknown, never 0. A page that is not a
Prometheus exposition, or whose values are out of range, raises MetricsError.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from kvfold.engines.prom_lines import families_query, wanted_lines
from kvfold.errors import KVFoldError

MAX_PAGE_BYTES = 8 * 1024 * 1024


class MetricsError(KVFoldError, ValueError):
    """A metrics page kvfold cannot read; says what was wrong."""


@dataclass(frozen=True, slots=True)
class VLLMMetrics:
    """One engine's numbers, as its page said them (None: not published)."""

    num_gpu_blocks: int | None = None
    block_size: int | None = None
    kv_cache_usage: float | None = None  # 0.0-1.0, blocks held by running requests
    num_requests_running: int | None = None
    num_requests_waiting: int | None = None
    prefix_cache_queries_tokens: int | None = None
    prefix_cache_hits_tokens: int | None = None
    num_preemptions: int | None = None
    process_start_time_s: float | None = None  # the server process's: a new one, a restart

    @property
    def num_blocks_usable(self) -> int | None:
        """Blocks that can hold tokens: vLLM reserves one of `num_gpu_blocks` as its null
        block (vllm/v1/core/block_pool.py) and computes its usage over the others."""
        if self.num_gpu_blocks is None:
            return None
        return max(self.num_gpu_blocks - 1, 0)

    @property
    def num_blocks_used(self) -> int | None:
        """Blocks running requests hold: usage x usable blocks, rounded."""
        usable = self.num_blocks_usable
        if self.kv_cache_usage is None or usable is None:
            return None
        return round(self.kv_cache_usage * usable)


_GAUGES = {
    "vllm:kv_cache_usage_perc": "kv_cache_usage",
    "vllm:num_requests_running": "num_requests_running",
    "vllm:num_requests_waiting": "num_requests_waiting",
}
_COUNTERS = {  # sample names as the parser gives them (counters end in _total)
    "vllm:prefix_cache_queries_total": "prefix_cache_queries_tokens",
    "vllm:prefix_cache_hits_total": "prefix_cache_hits_tokens",
    "vllm:num_preemptions_total": "num_preemptions",
}


_INFO = "vllm:cache_config_info"
_STARTED = "process_start_time_seconds"
FAMILIES = (_INFO, _STARTED, *_GAUGES, *(name.removesuffix("_total") for name in _COUNTERS))
METRICS_QUERY = families_query((_INFO, _STARTED, *_GAUGES, *_COUNTERS))


def parse_vllm_metrics(text: str) -> dict[str, VLLMMetrics]:
    """Every engine on the page (by its `engine` label, "" when unlabelled)."""
    if not isinstance(text, str):
        raise MetricsError(f"a metrics page is text, got {type(text).__name__}")
    if len(text) > MAX_PAGE_BYTES:
        raise MetricsError(f"metrics page of {len(text)} characters > {MAX_PAGE_BYTES}")
    wanted = wanted_lines(text, FAMILIES)
    if text.strip() and not wanted.strip():
        raise MetricsError(f"no vLLM KV-cache metric on the page; it begins {text[:120]!r}")
    found: dict[str, dict[str, float | int]] = {}
    started: float | None = None
    try:
        for family in text_string_to_metric_families(wanted):
            for s in family.samples:
                engine = str(s.labels.get("engine", ""))
                if s.name == _INFO:
                    fields = found.setdefault(engine, {})
                    for label in ("num_gpu_blocks", "block_size"):
                        text_value = s.labels.get(label)
                        if text_value is not None and text_value.isdigit():
                            fields[label] = int(text_value)
                    continue
                if s.name == _STARTED:
                    started = float(s.value)
                    continue
                field_name = _GAUGES.get(s.name) or _COUNTERS.get(s.name)
                if field_name is None:
                    continue
                number = float(s.value)
                if not math.isfinite(number) or number < 0:
                    raise MetricsError(f"{s.name} = {s.value}: not a count")
                found.setdefault(engine, {})[field_name] = number
    except (ValueError, TypeError, IndexError) as e:
        if isinstance(e, MetricsError):
            raise
        raise MetricsError(f"not a Prometheus exposition: {e}"[:300]) from None
    out: dict[str, VLLMMetrics] = {}
    for engine, fields in found.items():
        usage = fields.get("kv_cache_usage")
        if usage is not None and usage > 1.0:
            raise MetricsError(f"vllm:kv_cache_usage_perc = {usage} > 1.0")
        out[engine] = VLLMMetrics(
            num_gpu_blocks=_int(fields.get("num_gpu_blocks")),
            block_size=_int(fields.get("block_size")),
            kv_cache_usage=None if usage is None else float(usage),
            num_requests_running=_int(fields.get("num_requests_running")),
            num_requests_waiting=_int(fields.get("num_requests_waiting")),
            prefix_cache_queries_tokens=_int(fields.get("prefix_cache_queries_tokens")),
            prefix_cache_hits_tokens=_int(fields.get("prefix_cache_hits_tokens")),
            num_preemptions=_int(fields.get("num_preemptions")),
            process_start_time_s=started,
        )
    return out


def _int(value: float | int | None) -> int | None:
    return None if value is None else int(value)


__all__ = ["FAMILIES", "METRICS_QUERY", "MetricsError", "VLLMMetrics", "parse_vllm_metrics"]

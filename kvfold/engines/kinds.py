"""EngineKind: what differs between engines, for the engine rank that reads one. Pure; no
Ray, no sockets: the shell hands in messages and pages, the kind says what they mean.

    kind      events                                   replay                numbers page
    vllm      ZMQ [topic, seq, payload]                [b"", topic, seq, p]  Prometheus
              (EngineSource.take_live)                 (.take_replay)
    sglang    ZMQ, vLLM's design (sglang_wire)         [b"", seq, p]         Prometheus, tokens
    trtllm    POST /kv_cache_events JSON, polled       none                  iteration stats JSON
              (trtllm_events.feed_page)

    engine_kind(name).take_live(source, frames, now_s) -> [kvfold event, ...]
    engine_kind(name).take_replay(source, answer, now_s) -> [kvfold event, ...]
    engine_kind(name).read_numbers(page, endpoints, previous) -> EngineNumbers

`take_live` and `take_replay` are None for a kind whose events do not come over ZMQ
(TensorRT-LLM: the rank polls its HTTP endpoint and feeds a TRTLLMTranslator). A page
kvfold cannot read, or one without this rank, raises MetricsError.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from kvfold.engines import sglang_wire
from kvfold.engines.endpoints import ENGINE_KINDS, EngineEndpoints
from kvfold.engines.engine_numbers import (
    EngineNumbers,
    sglang_numbers,
    trtllm_numbers,
    vllm_numbers,
)
from kvfold.engines.engine_source import EngineSource
from kvfold.engines.sglang_metrics import parse_sglang_metrics
from kvfold.engines.trtllm_stats import parse_trtllm_iterations
from kvfold.engines.vllm_metrics import METRICS_QUERY, MetricsError, parse_vllm_metrics
from kvfold.kvevents.events import Event

TakeLive = Callable[[EngineSource, list[bytes], float], list[Event]]
TakeReplay = Callable[[EngineSource, Iterable[list[bytes]], float], list[Event]]
ReadNumbers = Callable[[str, EngineEndpoints, EngineNumbers | None], EngineNumbers]
M = TypeVar("M")


@dataclass(frozen=True, slots=True)
class EngineKind:
    name: str
    zmq: bool  # events on a SUB kvfold binds (+ a replay ROUTER); else polled over HTTP
    take_live: TakeLive | None
    take_replay: TakeReplay | None
    read_numbers: ReadNumbers
    numbers_query: str = ""  # added to the numbers page's URL (one without a query of its own)

    def numbers_url(self, url: str) -> str:
        """Where to read the numbers page: `url`, asking only for what is read of it."""
        return url if "?" in url else url + self.numbers_query


def engine_kind(name: str) -> EngineKind:
    kind = KINDS.get(name)
    if kind is None:
        raise ValueError(f"kind must be one of {list(ENGINE_KINDS)}, got {name!r}")
    return kind


def this_rank(found: Mapping[str, M], label: str, what: str) -> M:
    """The rank's entry on a page with several (by its label), or the page's only one."""
    if label in found:
        return found[label]
    if len(found) == 1:
        return next(iter(found.values()))
    raise MetricsError(f"no {what} {label!r} on the page (it has {sorted(found)})")


# ------------------------------------------------------------------ per kind


def _vllm_live(source: EngineSource, frames: list[bytes], now_s: float) -> list[Event]:
    return source.take_live(frames, now_s)


def _vllm_replay(source: EngineSource, answer: Iterable[list[bytes]], now_s: float) -> list[Event]:
    return source.take_replay(answer, now_s)


def _vllm_numbers(page: str, e: EngineEndpoints, _previous: EngineNumbers | None) -> EngineNumbers:
    return vllm_numbers(this_rank(parse_vllm_metrics(page), e.engine, "engine"))


def _sglang_numbers(
    page: str, e: EngineEndpoints, _previous: EngineNumbers | None
) -> EngineNumbers:
    metrics = this_rank(parse_sglang_metrics(page), e.engine, "dp_rank")
    return sglang_numbers(metrics, e.tokens_per_block)


def _trtllm_numbers(page: str, e: EngineEndpoints, previous: EngineNumbers | None) -> EngineNumbers:
    return trtllm_numbers(parse_trtllm_iterations(page), previous, e.tokens_per_block)


KINDS: dict[str, EngineKind] = {
    "vllm": EngineKind("vllm", True, _vllm_live, _vllm_replay, _vllm_numbers, METRICS_QUERY),
    "sglang": EngineKind(
        "sglang", True, sglang_wire.take_live, sglang_wire.take_replay, _sglang_numbers
    ),
    "trtllm": EngineKind("trtllm", False, None, None, _trtllm_numbers),
}

__all__ = ["KINDS", "EngineKind", "engine_kind", "this_rank"]

"""EngineEndpoints: where one engine data-parallel rank publishes, as kvfold reads it.
Pure; checked before anything starts.

vLLM and SGLang publish KV events on ZMQ:

    events   tcp://127.0.0.1:P    kvfold binds its SUB socket here and the engine's PUB
                                  connects (both connect whenever their endpoint has no
                                  `*`); kvfold binds loopback only, never every interface
    replay   tcp://127.0.0.1:R    the engine's replay ROUTER (the engine binds it); None:
                                  no replay, so a lost batch puts the source out of sync
    topic    the engine's configured topic ("" by default)

TensorRT-LLM hands them out over HTTP:

    events   http://HOST:PORT     trtllm-serve's base URL: kvfold POSTs /kv_cache_events
    replay   None                 (there is none: a lost event puts the source out of sync)
    topic    ""

For every kind:

    metrics  http://127.0.0.1:M/metrics    the numbers page (TensorRT-LLM: iteration stats)
    engine   which rank of the page: vLLM's `engine` label, SGLang's `dp_rank` label,
             TensorRT-LLM's attention_dp_rank (digits)
    tokens_per_block   SGLang and TensorRT-LLM: the engine's page size, for pages that do
             not say it (older SGLang); checked against the page when both do. vLLM: None
             (its page always says)
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

ENGINE_KINDS = ("vllm", "sglang", "trtllm")
ZMQ_KINDS = ("vllm", "sglang")  # a SUB kvfold binds, the engine's replay ROUTER
_LOOPBACK = ("127.0.0.1", "localhost", "[::1]", "::1")


@dataclass(frozen=True, slots=True)
class EngineEndpoints:
    events: str
    metrics: str
    replay: str | None = None
    kind: str = "vllm"
    topic: str = ""
    engine: str = "0"
    tokens_per_block: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ENGINE_KINDS:
            raise ValueError(f"kind must be one of {list(ENGINE_KINDS)}, got {self.kind!r}")
        if not isinstance(self.topic, str) or not isinstance(self.engine, str):
            raise TypeError("topic and engine must be str")
        if self.kind in ZMQ_KINDS:
            _loopback_tcp("events", self.events)
            if self.replay is not None:
                _loopback_tcp("replay", self.replay)
        else:
            _http_url("events", self.events, "TensorRT-LLM's base URL, http://HOST:PORT")
            if self.replay is not None:
                raise ValueError(
                    f"replay must be None for kind {self.kind!r} (TensorRT-LLM has no replay "
                    f"socket), got {self.replay!r}"
                )
            if self.topic:
                raise ValueError(f"topic must be '' for kind {self.kind!r}, got {self.topic!r}")
            if not self.engine.isdigit():
                raise ValueError(
                    f"engine must be the attention_dp_rank in digits for kind {self.kind!r}, "
                    f"got {self.engine!r}"
                )
        _http_url("metrics", self.metrics, "an http(s) URL")
        tpb = self.tokens_per_block
        if tpb is not None:
            if self.kind == "vllm":
                raise ValueError(
                    f"tokens_per_block must be None for kind 'vllm' (its page says its block "
                    f"size), got {tpb!r}"
                )
            if type(tpb) is not int or tpb < 1:
                raise ValueError(f"tokens_per_block must be an int >= 1 or None, got {tpb!r}")


def _http_url(name: str, value: object, allowed: str) -> None:
    url = urlsplit(value) if isinstance(value, str) else None
    if url is None or url.scheme not in ("http", "https") or not url.hostname:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _loopback_tcp(name: str, endpoint: object) -> None:
    if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
        raise ValueError(f"{name} must be tcp://127.0.0.1:PORT, got {endpoint!r}")
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    if host not in _LOOPBACK:
        raise ValueError(
            f"{name} must be on loopback (tcp://127.0.0.1:PORT), got {endpoint!r}: kvfold "
            "binds it, and `*` or 0.0.0.0 would listen on every interface; run the engine "
            "rank on the engine's own machine instead"
        )
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{name} needs a port in 1..65535, got {endpoint!r}")


__all__ = ["ENGINE_KINDS", "ZMQ_KINDS", "EngineEndpoints"]

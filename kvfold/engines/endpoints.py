"""EngineEndpoints: where one engine data-parallel rank publishes, as kvfold reads it.
Pure; checked before anything starts.

    events   tcp://127.0.0.1:P    kvfold binds its SUB socket here and the engine's PUB
                                  connects (vLLM connects whenever its endpoint has no
                                  `*`); kvfold binds loopback only, never every interface
    replay   tcp://127.0.0.1:R    the engine's replay ROUTER (the engine binds it); None:
                                  no replay, so a lost batch puts the source out of sync
    metrics  http://127.0.0.1:M/metrics
    topic    the engine's configured topic ("" by default)
    engine   the `engine` label of this rank's series on a page with several
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

ENGINE_KINDS = ("vllm",)
_LOOPBACK = ("127.0.0.1", "localhost", "[::1]", "::1")


@dataclass(frozen=True, slots=True)
class EngineEndpoints:
    events: str
    metrics: str
    replay: str | None = None
    kind: str = "vllm"
    topic: str = ""
    engine: str = "0"

    def __post_init__(self) -> None:
        if self.kind not in ENGINE_KINDS:
            raise ValueError(f"kind must be one of {list(ENGINE_KINDS)}, got {self.kind!r}")
        _loopback_tcp("events", self.events)
        if self.replay is not None:
            _loopback_tcp("replay", self.replay)
        url = urlsplit(self.metrics) if isinstance(self.metrics, str) else None
        if url is None or url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"metrics must be an http(s) URL, got {self.metrics!r}")
        if not isinstance(self.topic, str) or not isinstance(self.engine, str):
            raise TypeError("topic and engine must be str")


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


__all__ = ["ENGINE_KINDS", "EngineEndpoints"]

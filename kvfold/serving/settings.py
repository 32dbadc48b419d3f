"""What kvfold's front door runs with, checked before anything starts. Pure; no Ray.

    FrontDoorSettings   frozen; a wrong value raises ValueError naming it and what is allowed

Engine rank i (kvfold's rank, as `launch(engines=...)` numbered them) serves at
`engine_urls[i]`, the engine's own OpenAI server. Everything is on loopback unless the user
asks otherwise (`http_host`).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from kvfold.naming import PREFIX
from kvfold.serving.door_admission import DECODE_WEIGHT, POLICIES, PRECISE_PREFIX, PREFIX_WEIGHT

DOOR_ACTOR_NAME = f"{PREFIX}door"
# Through Serve's proxy, a stream's tokens after its first are passed on together every this
# many seconds (one pass through the proxy each), as Ray Serve LLM batches its streams (50 ms
# by default). The door's own HTTP passes each chunk on as it comes, as an engine does.
STREAM_INTERVAL_S = 0.05
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
# who answers HTTP: Ray Serve's proxy and the FrontDoor deployment, or the door itself
INGRESSES = ("serve", "door")


@dataclass(frozen=True, slots=True)
class FrontDoorSettings:
    engine_urls: tuple[str, ...]  # http://HOST:PORT of engine rank 0, 1, ...
    model_dir: str  # the model's directory (its tokenizer files), as the engines run it
    namespace: str = "kvfold"  # kvfold's Ray namespace (its aggregator): KVFold.namespace
    policy: str = PRECISE_PREFIX
    queue_limit: int = 256  # requests waiting in kvfold's queue; beyond: 429
    queue_timeout_s: float = 60.0  # a request waits at most this long; then 429
    watermark_blocks: int = 0  # blocks of each engine kept out of every promise
    max_running_per_engine: int | None = None  # the engines' max_num_seqs, or None
    # precise_prefix's cost on an engine, in blocks of prefill: prefix_weight x the prompt's
    # blocks it does not hold + the blocks it still has to prefill for others + decode_weight
    # x its committed blocks
    # x its committed blocks. Measured defaults (docs/serving.md, "Routing"): a block a prompt
    # must compute costs its first token (and everyone's behind it) more than a block queued,
    # and far more than a block held by a running request, which decode only reads.
    prefix_weight: float = PREFIX_WEIGHT
    decode_weight: float = DECODE_WEIGHT
    refresh_s: float = 0.1  # how often the door follows the view and the block index
    num_replicas: int = 1  # front-door replicas (more than one needs shared_door)
    # False: the door lives in the front door's one replica (no Ray call per request; nothing
    # else may admit onto these engines). True: one named door actor that every replica and
    # every kvfold RequestRouter in the namespace shares.
    shared_door: bool = False
    app_name: str = "kvfold-front-door"
    route_prefix: str = "/"
    http_host: str = "127.0.0.1"
    http_port: int = 8000
    retry_unstreamed: bool = True  # an engine failing before a byte was sent: try another
    # 0: every chunk passed on as it comes; None: 0 on the door's ingress, STREAM_INTERVAL_S
    # through Serve's proxy
    stream_interval_s: float | None = None
    # "serve": Ray Serve's proxy, then the FrontDoor deployment (Serve scales and restarts
    # it); "door": the door's own actor answers HTTP (kvfold.serving.door_http), no proxy
    ingress: str = "door"

    def __post_init__(self) -> None:
        if not self.engine_urls:
            raise ValueError("engine_urls=(): allowed: one http://HOST:PORT per engine rank")
        for i, url in enumerate(self.engine_urls):
            parts = urlsplit(url) if isinstance(url, str) else None
            if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(
                    f"engine_urls[{i}]={url!r}: allowed: http://HOST:PORT, the engine's "
                    "OpenAI server"
                )
            if parts.path not in ("", "/"):
                raise ValueError(
                    f"engine_urls[{i}]={url!r}: allowed: the server's base URL, no path"
                )
        if not self.model_dir:
            raise ValueError("model_dir='': allowed: the model's directory")
        if self.policy not in POLICIES:
            raise ValueError(f"policy={self.policy!r}: allowed: {', '.join(POLICIES)}")
        for name in ("queue_limit", "watermark_blocks"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ValueError(f"{name}={value!r}: allowed: an int >= 0")
        if type(self.num_replicas) is not int or self.num_replicas <= 0:
            raise ValueError(f"num_replicas={self.num_replicas!r}: allowed: an int > 0")
        if self.ingress == "door" and (self.num_replicas != 1 or self.shared_door):
            raise ValueError(
                f"ingress='door' with num_replicas={self.num_replicas}, shared_door="
                f"{self.shared_door}: allowed: one replica and its own door (the door's actor "
                "answers HTTP itself); ingress='serve' for replicas sharing a door"
            )
        if self.num_replicas > 1 and not self.shared_door:
            raise ValueError(
                f"num_replicas={self.num_replicas} with shared_door=False: allowed: one "
                "replica, or shared_door=True (the replicas then share one door actor)"
            )
        if self.ingress not in INGRESSES:
            raise ValueError(f"ingress={self.ingress!r}: allowed: {', '.join(INGRESSES)}")
        if self.max_running_per_engine is not None and (
            type(self.max_running_per_engine) is not int or self.max_running_per_engine <= 0
        ):
            raise ValueError(
                f"max_running_per_engine={self.max_running_per_engine!r}: allowed: a "
                "positive int or None"
            )
        for name in ("queue_timeout_s", "refresh_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name}={value!r}: allowed: a number > 0")
        if self.stream_interval_s is not None and (
            not isinstance(self.stream_interval_s, (int, float)) or not self.stream_interval_s >= 0
        ):
            raise ValueError(
                f"stream_interval_s={self.stream_interval_s!r}: allowed: a number >= 0 "
                "(0: every chunk as it comes), or None (the ingress's own)"
            )
        for name in ("prefix_weight", "decode_weight"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: allowed: >= 0")
        if not 0 < self.http_port <= 65535:
            raise ValueError(f"http_port={self.http_port!r}: allowed: 1-65535")
        if not self.route_prefix.startswith("/"):
            raise ValueError(f"route_prefix={self.route_prefix!r}: allowed: a path from '/'")

    @property
    def engine_ranks(self) -> tuple[int, ...]:
        return tuple(range(len(self.engine_urls)))

    @property
    def stream_interval(self) -> float:
        """Seconds a stream's chunks after its first are gathered for (0: none)."""
        if self.stream_interval_s is not None:
            return float(self.stream_interval_s)
        return 0.0 if self.ingress == "door" else STREAM_INTERVAL_S

    @property
    def on_loopback(self) -> bool:
        return self.http_host in LOOPBACK_HOSTS


__all__ = ["DOOR_ACTOR_NAME", "INGRESSES", "STREAM_INTERVAL_S", "FrontDoorSettings"]

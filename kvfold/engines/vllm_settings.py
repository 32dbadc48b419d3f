"""What a trial vLLM server runs with (kvfold.engines.vllm_server runs it): its settings,
checked on construction, and the sizes and ports they resolve to. Standard library only.

    VLLMServerSettings    frozen; a wrong value raises ValueError naming it and what is allowed
    kv_bytes_per_token    a model config's KV bytes per token (sizes --kv-cache-memory-bytes)
    free_loopback_port    a port free on 127.0.0.1 now

Every endpoint is on loopback: with a plain `tcp://127.0.0.1:P` vLLM *connects* its PUB to
the reader's SUB; an endpoint holding `*` or `::` would make it bind on every interface.
"""

from __future__ import annotations

import random
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LOOPBACK = "127.0.0.1"
BLOCK_SIZE_MULTIPLE = 32  # the CPU attention backend's block sizes
KV_DTYPE = "bfloat16"
KV_DTYPE_BYTES = 2
_EVERY_INTERFACE = ("*", "0.0.0.0", "::", "[::]", "")
_TCP_ENDPOINT = re.compile(r"^tcp://(?P<host>\[[^\]]*\]|[^:]*):(?P<port>[^:]*)$")


@dataclass(frozen=True, slots=True)
class VLLMServerSettings:
    """What to run. `num_gpu_blocks` is the KV cache in blocks, as vLLM reports it in
    `vllm:cache_config_info` (one of them is vLLM's reserved null block, so one fewer
    holds tokens). `events_endpoint=None` runs without KV events."""

    python: str  # the engine virtualenv's interpreter
    model_dir: str  # a HF config directory; weights are dummy (`--load-format dummy`)
    served_model_name: str = "tiny-llama"
    block_size: int = 32
    num_gpu_blocks: int = 48
    max_model_len: int = 1024
    max_num_seqs: int = 4
    port: int = 0  # 0: pick a free loopback port at start()
    events_endpoint: str | None = None  # tcp://127.0.0.1:P, bound by the reader's SUB
    replay_endpoint: str | None = None  # tcp://127.0.0.1:R, bound by the engine
    topic: str = "kv-events"
    omp_threads_bind: str | None = None  # VLLM_CPU_OMP_THREADS_BIND: "auto", "nobind", "0", ...
    omp_num_threads: int | None = None  # OMP_NUM_THREADS (1 with "nobind")
    seed: int = 0
    # the engine tokenizes text (its model_dir's tokenizer files); None: when they are there
    tokenizer: bool | None = None
    extra_env: Mapping[str, str] = field(default_factory=dict)  # applied last
    # more of vLLM's flags, appended as given (e.g. --hf-overrides for a longer context)
    extra_args: tuple[str, ...] = ()
    log_path: str | None = None  # None: a new temporary file

    def __post_init__(self) -> None:
        for name in ("python", "model_dir", "served_model_name"):
            if not getattr(self, name):
                raise ValueError(f"{name}={getattr(self, name)!r}: allowed: a non-empty string")
        if self.block_size <= 0 or self.block_size % BLOCK_SIZE_MULTIPLE:
            raise ValueError(
                f"block_size={self.block_size}: allowed: a positive multiple of "
                f"{BLOCK_SIZE_MULTIPLE} (vLLM's CPU attention backend)"
            )
        for name in ("num_gpu_blocks", "max_model_len", "max_num_seqs"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)}: allowed: > 0")
        if self.num_gpu_blocks < 2:
            raise ValueError(
                f"num_gpu_blocks={self.num_gpu_blocks}: allowed: >= 2 (vLLM reserves one)"
            )
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port}: allowed: 0 (pick a free one) to 65535")
        if self.omp_num_threads is not None and self.omp_num_threads <= 0:
            raise ValueError(f"omp_num_threads={self.omp_num_threads}: allowed: > 0 or None")
        if self.events_endpoint is not None:
            _check_endpoint("events_endpoint", self.events_endpoint)
        if self.replay_endpoint is not None:
            if self.events_endpoint is None:
                raise ValueError(
                    f"replay_endpoint={self.replay_endpoint!r}: allowed: None when "
                    "events_endpoint is None (the replay serves the event stream)"
                )
            _check_endpoint("replay_endpoint", self.replay_endpoint)
            if self.replay_endpoint == self.events_endpoint:
                raise ValueError(
                    f"replay_endpoint={self.replay_endpoint!r}: allowed: an endpoint other "
                    "than events_endpoint"
                )

    @property
    def serves_text(self) -> bool:
        """Whether the engine loads its tokenizer (and so takes text prompts and chats)."""
        if self.tokenizer is not None:
            return self.tokenizer
        return has_tokenizer_files(self.model_dir)


def has_tokenizer_files(model_dir: str) -> bool:
    """Whether `model_dir` holds a Hugging Face tokenizer (tokenizer.json or
    tokenizer_config.json), as vLLM and kvfold's front door load it."""
    root = Path(model_dir)
    return (root / "tokenizer.json").is_file() or (root / "tokenizer_config.json").is_file()


def _check_endpoint(name: str, endpoint: str) -> None:
    allowed = f"allowed: tcp://{LOOPBACK}:<port 1-65535>"
    m = _TCP_ENDPOINT.match(endpoint)
    if m is None:
        raise ValueError(f"{name}={endpoint!r}: {allowed}")
    host, port = m.group("host"), m.group("port")
    if host in _EVERY_INTERFACE or port == "*":
        raise ValueError(
            f"{name}={endpoint!r}: it would listen on every interface (vLLM binds an endpoint "
            f"holding '*' or '::' on all of them, and a wildcard port is unknown to the "
            f"reader); {allowed}"
        )
    if host != LOOPBACK:
        raise ValueError(f"{name}={endpoint!r}: not loopback; {allowed}")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{name}={endpoint!r}: port {port!r}; {allowed}")


def kv_bytes_per_token(config: Mapping[str, Any], dtype_bytes: int = KV_DTYPE_BYTES) -> int:
    """KV-cache bytes one token takes: 2 (K and V) x layers x kv_heads x head_dim x
    dtype bytes. The tiny Llama: 2 x 2 x 2 x 32 x 2 = 512."""
    try:
        num_layers = int(config["num_hidden_layers"])
        num_heads = int(config["num_attention_heads"])
        num_kv_heads = int(config.get("num_key_value_heads") or num_heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // num_heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise ValueError(
            f"model config: {e!r}: allowed: num_hidden_layers, num_attention_heads and "
            "head_dim or hidden_size, all positive integers"
        ) from e
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def free_loopback_port() -> int:
    """A port free on 127.0.0.1 now, below the ephemeral range: a port the kernel hands
    out as it will (bind to 0) is also what it gives the next outgoing connection's
    source, which took an engine's events port in the seconds before kvfold bound it.
    Another listener may still take it before it is used."""
    low = _ephemeral_low()
    for _ in range(64):
        port = random.randrange(PRIVATE_PORTS_FROM, low)
        with socket.socket() as s:
            try:
                s.bind((LOOPBACK, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # everything below is taken: whatever the kernel gives
        s.bind((LOOPBACK, 0))
        got: int = s.getsockname()[1]
        return got


PRIVATE_PORTS_FROM = 20_000


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768 elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32_768
    return max(low, PRIVATE_PORTS_FROM + 1_000)


__all__ = [
    "BLOCK_SIZE_MULTIPLE",
    "KV_DTYPE",
    "KV_DTYPE_BYTES",
    "LOOPBACK",
    "VLLMServerSettings",
    "free_loopback_port",
    "has_tokenizer_files",
    "kv_bytes_per_token",
]

"""What every `kvfold` command shares: the process's Ray settings, the cache and
cluster flags, connecting and authenticating. Imports no Ray (docs/security.md: the
process is configured before Ray is imported)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from kvfold.naming import DEFAULT_NAMESPACE


def ray_env(address: str | None = None) -> None:
    from kvfold.ray_env import apply_local_defaults

    apply_local_defaults(address)


def cache_config(args: argparse.Namespace) -> Any:
    from kvfold.worker.config import KVCacheConfig

    windows: tuple[int | None, ...] = tuple(
        None if w in ("full", "none") else int(w) for w in args.windows.split(",")
    )
    return KVCacheConfig(
        tokens_per_block=args.tokens_per_block,
        num_blocks=args.num_blocks,
        windows=windows,
        num_layers=args.num_layers,
        num_kv_heads=2,
        head_dim=16,
        dtype="float16",
        device="auto",
    )


def add_cluster_args(p: argparse.ArgumentParser, blocks: int, tpb: int, windows: str) -> None:
    p.add_argument("--nodes", type=int, default=3, help="simulated nodes (embedded cluster)")
    p.add_argument("--gpus-per-node", type=int, default=4)
    p.add_argument("--world-size", type=int, default=10)
    p.add_argument("--tokens-per-block", type=int, default=tpb)
    p.add_argument("--num-blocks", type=int, default=blocks, help="GPU blocks per window per rank")
    p.add_argument("--windows", default=windows, help="comma list: full and/or window sizes")
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument(
        "--host-blocks", type=int, default=1024, help="host-tier blocks per node (0: off)"
    )


def connect_args(p: argparse.ArgumentParser, address_help: str = "Ray address HOST:PORT") -> None:
    p.add_argument("--address", default=os.environ.get("RAY_ADDRESS"), help=address_help)
    p.add_argument("--namespace", default=DEFAULT_NAMESPACE)
    auth_arg(p)


def auth_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--auth-token-file",
        default=None,
        help="file holding the Ray cluster's auth token (Ray token authentication)",
    )


def apply_auth(path: str | None) -> None:
    """Token auth must be in the environment before Ray is imported (docs/security.md)."""
    if not path:
        return
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as e:
        raise SystemExit(f"kvfold: cannot read the auth token file {path!r}: {e.strerror}") from e
    if not token:
        raise SystemExit(f"kvfold: the auth token file {path!r} is empty")
    from kvfold.ray_env import use_token

    use_token(token)


def metrics_args(p: argparse.ArgumentParser, port: int | None) -> None:
    p.add_argument("--metrics-host", default="127.0.0.1", help="bind address for /metrics")
    p.add_argument(
        "--metrics-port", type=int, default=port, help="port for /metrics (0: any free port)"
    )


def engine_args(p: argparse.ArgumentParser) -> None:
    """Real engines as ranks (docs/engines.md): one --engine-events and --engine-metrics
    per engine data-parallel rank, in rank order."""
    p.add_argument("--engine", choices=["vllm", "sglang", "trtllm"],
                   help="ranks are engines of this kind")  # fmt: skip
    p.add_argument("--engine-events", action="append", default=[], metavar="ENDPOINT",
                   help="vllm, sglang: tcp://127.0.0.1:P, where kvfold binds the SUB that "
                   "rank's engine publishes its KV events to; trtllm: the engine's base URL "
                   "http://HOST:PORT (kvfold POSTs /kv_cache_events); repeat per rank")  # fmt: skip
    p.add_argument("--engine-replay", action="append", default=[], metavar="tcp://127.0.0.1:R",
                   help="the engine's replay endpoint (vllm, sglang; repeat per rank, or leave "
                   "out)")  # fmt: skip
    p.add_argument("--engine-metrics", action="append", default=[], metavar="URL",
                   help="the engine's /metrics URL (repeat per rank)")  # fmt: skip
    p.add_argument("--engine-topic", default="", help="the engines' KV-event topic")
    p.add_argument("--engine-page-size", type=int, default=None, metavar="TOKENS",
                   help="sglang, trtllm: tokens per block (SGLang's --page-size) when the "
                   "engine's numbers page does not say it")  # fmt: skip


def engine_endpoints(args: argparse.Namespace) -> list[Any] | None:
    """The EngineEndpoints the flags name (None without --engine); ValueError says which
    flag is wrong, before anything starts."""
    from kvfold.engines.endpoints import EngineEndpoints

    events, metrics, replay = args.engine_events, args.engine_metrics, args.engine_replay
    if args.engine is None:
        if events or metrics or replay or args.engine_page_size is not None:
            raise ValueError(
                "--engine-events/--engine-metrics/--engine-replay/--engine-page-size need --engine"
            )
        return None
    if not events or len(metrics) != len(events):
        raise ValueError(
            f"--engine {args.engine}: one --engine-events and one --engine-metrics per rank, "
            f"got {len(events)} and {len(metrics)}"
        )
    if replay and len(replay) != len(events):
        raise ValueError(
            f"--engine-replay: one per rank ({len(events)}) or none, got {len(replay)}"
        )
    return [
        EngineEndpoints(
            events=e,
            metrics=m,
            replay=replay[i] if replay else None,
            kind=args.engine,
            topic=args.engine_topic,
            tokens_per_block=args.engine_page_size,
        )
        for i, (e, m) in enumerate(zip(events, metrics, strict=True))
    ]

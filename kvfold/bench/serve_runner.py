"""`kvfold bench-serve`'s run: it starts what it measures on this machine (N vLLM engines
from the engine virtualenv, an embedded Ray cluster, kvfold with the engines as ranks, Ray
Serve with the engines as replicas for the baseline, vllm-router from its own virtualenv,
Ray Serve LLM's application from its own (kvfold.bench.serve_llm), kvfold's front door),
runs each arm (kvfold.bench.bench_serve) and stops them all. The CLI
(kvfold.cli_serve) parses.

With a vllm-router kv_aware arm, the engines' KV events pass through a relay
(kvfold.bench.event_relay) so that kvfold's ranks and the router read the same stream.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import time
from pathlib import Path
from typing import Any

from kvfold.bench.bench_trace import ServeRequest

VLLM_ROUTER_ARMS = {
    "vllm_router_p2c": "power_of_two",
    "vllm_router_cache_aware": "cache_aware",
    "vllm_router_kv_aware": "kv_aware",
}

# Ray Serve LLM's application (its own replicas' engines, same vLLM arguments), text prompts
SERVE_LLM_ARMS = {
    "serve_llm_default": "default",
    "serve_llm_prefix": "prefix",
    "serve_llm_kvfold": "kvfold",
}


def engine_settings(args: argparse.Namespace) -> Any:
    """The engines' settings: KV of `--blocks` blocks, a context of `--max-model-len`
    (beyond the model's own max_position_embeddings through --hf-overrides)."""
    from kvfold.engines.vllm_server import VLLMServerSettings

    config = json.loads((Path(args.model_dir) / "config.json").read_text())
    extra: tuple[str, ...] = ()
    if args.max_model_len > int(config.get("max_position_embeddings", 0)):
        extra = ("--hf-overrides", json.dumps({"max_position_embeddings": args.max_model_len}))
    return VLLMServerSettings(
        python=args.engine_python, model_dir=args.model_dir, num_gpu_blocks=args.blocks,
        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, extra_args=extra,
    )  # fmt: skip


def run_bench(args: argparse.Namespace, arms: list[str], requests: list[ServeRequest]) -> int:
    """Run each arm, print and write the results. Ray Serve LLM's arms come first, each with
    the machine to itself (a Ray instance and engines of its own, nothing of the others'
    running: on two cores, idle engines and a second kvfold still take their share); then
    the engines, kvfold and Serve start for the other arms."""
    from kvfold.bench.bench_serve import ARMS, format_table, write_outputs
    from kvfold.engines.engine_fleet import EngineFleet

    # vLLM's default topic (""): vllm-router's kv_aware drops every batch under another
    fleet = EngineFleet(engine_settings(args), args.engines, topic="")
    rows: list[dict[str, Any]] = []
    per_request: list[dict[str, Any]] = []
    commands: dict[str, str] = {}
    for arm in [a for a in arms if a in SERVE_LLM_ARMS]:
        run_serve_llm_arm(args, arm, fleet, requests, rows, per_request, commands)
    others = [a for a in arms if a not in SERVE_LLM_ARMS]
    if others:
        run_with_fleet(args, others, requests, fleet, rows, per_request, commands)
    rows.sort(key=lambda row: ARMS.index(row["arm"]))
    meta = {k: v for k, v in vars(args).items() if k != "fn"}
    meta["engine_command"] = shlex.join(fleet.servers[0].command())
    meta["anchor_commands"] = commands
    print()
    print(format_table(rows))
    for arm, cmd in commands.items():
        print(f"{arm}: {cmd}")
    for path in write_outputs(rows, meta, args.out, per_request):
        print(f"wrote {path}")
    return 0


def run_serve_llm_arm(
    args: argparse.Namespace,
    arm: str,
    fleet: Any,
    requests: list[ServeRequest],
    rows: list[dict[str, Any]],
    per_request: list[dict[str, Any]],
    commands: dict[str, str],
) -> None:
    """One Ray Serve LLM arm: its application (replicas started with the fleet's vLLM
    arguments), the requests as text, its engines' own counters."""
    from kvfold.bench.bench_serve import format_table, request_rows, run_arm
    from kvfold.bench.serve_llm import ServeLlmApp, engine_kwargs_of

    print(f"== {arm}: {len(requests)} requests", flush=True)
    app = ServeLlmApp(
        args.serve_llm_python, SERVE_LLM_ARMS[arm], args.engines,
        engine_kwargs_of(fleet.servers[0].settings, fleet.servers[0].kv_cache_memory_bytes),
        args.model_dir,
    )  # fmt: skip
    commands[arm] = shlex.join(app.command())
    print(f"  {commands[arm]}", flush=True)
    with app:
        print(f"  {args.engines} replicas ready in {app.ready_s} s", flush=True)
        row, seen = run_arm(arm, requests, app, _constant(app.url), "tiny-llama", as_text=True)
    print(format_table([row]), flush=True)
    rows.append(row)
    per_request += request_rows(arm, requests, seen)


def run_with_fleet(
    args: argparse.Namespace,
    arms: list[str],
    requests: list[ServeRequest],
    fleet: Any,
    rows: list[dict[str, Any]],
    per_request: list[dict[str, Any]],
    commands: dict[str, str],
) -> None:
    """Start the engines, kvfold and Serve; run each of `arms` against them; stop them."""
    from kvfold.engines.vllm_server import free_loopback_port

    relay = None
    endpoints = fleet.endpoints
    if "vllm_router_kv_aware" in arms:
        import dataclasses

        from kvfold.bench.event_relay import EventRelay

        relay = EventRelay([e.events for e in fleet.endpoints])
        relay.start()
        endpoints = [
            dataclasses.replace(e, events=p.to_kvfold)
            for e, p in zip(fleet.endpoints, relay.ports, strict=True)
        ]
    from kvfold.cluster import launch, start_local_cluster

    cluster = start_local_cluster(num_nodes=1, gpus_per_node=args.engines)
    try:
        t0 = time.monotonic()
        print(f"starting {args.engines} vLLM engines ...", flush=True)
        print("  engine: " + shlex.join(fleet.servers[0].command()), flush=True)
        fleet.start()
        print(f"engines up in {time.monotonic() - t0:.1f} s", flush=True)
        from ray import serve

        from kvfold.bench.bench_serve import format_table, request_rows, run_arm
        from kvfold.serving.engine_replica import engine_deployment
        from kvfold.serving.front_door import serve_front_door, start_serve
        from kvfold.serving.settings import FrontDoorSettings

        kv = launch(args.engines, args.engines, engines=endpoints, dead_after_s=5.0)
        port = free_loopback_port()
        start_serve(http_port=port)
        proxy = f"http://127.0.0.1:{port}"
        urls = fleet.urls
        model = "tiny-llama"
        door_options: dict[str, Any] = {
            k: v
            for k, v in (
                ("prefix_weight", args.prefix_weight),
                ("decode_weight", args.decode_weight),
            )
            if v is not None
        }
        if args.door_refresh_s is not None:
            door_options["refresh_s"] = args.door_refresh_s
        for arm in arms:
            print(f"== {arm}: {len(requests)} requests", flush=True)
            if arm == "round_robin":
                row, seen = run_arm(arm, requests, urls, lambda i: urls[i % len(urls)], model)
            elif arm == "serve_default":
                serve.run(engine_deployment(urls), name="engines", route_prefix="/engines")
                row, seen = run_arm(arm, requests, urls, lambda i: proxy + "/engines", model)
                serve.delete("engines")
            elif arm in VLLM_ROUTER_ARMS:
                from kvfold.bench.vllm_router import VllmRouter

                sources = [p.outlet for p in relay.ports] if relay is not None else []
                replays = [e.replay or "" for e in fleet.endpoints] if relay is not None else []
                router = VllmRouter(
                    args.router_bin, VLLM_ROUTER_ARMS[arm], urls, kv_event_sources=sources,
                    kv_event_replay_sources=replays, model=model,
                )  # fmt: skip
                commands[arm] = shlex.join(router.command())
                print(f"  {commands[arm]}", flush=True)
                with router:
                    row, seen = run_arm(arm, requests, urls, _constant(router.url), model)
                    row["router_metrics"] = router_counters(router.metrics_text())
                    print(f"  router: {row['router_metrics']}", flush=True)
            else:
                door = serve_front_door(
                    FrontDoorSettings(
                        engine_urls=tuple(urls), model_dir=args.model_dir,
                        namespace=kv.namespace, policy=arm, ingress=args.door_ingress,
                        http_port=port if args.door_ingress == "serve" else free_loopback_port(),
                        max_running_per_engine=args.door_max_running or None,
                        queue_timeout_s=300.0,
                        **door_options,
                        queue_limit=max(256, len(requests)),
                    )
                )  # fmt: skip
                front: str = door.url
                row, seen = run_arm(arm, requests, urls, _constant(front), model)
                door.shutdown()
            print(format_table([row]), flush=True)
            rows.append(row)
            per_request += request_rows(arm, requests, seen)
    finally:
        try:
            from ray import serve as serve_

            serve_.shutdown()
        finally:
            cluster.shutdown()
            fleet.stop()
            if relay is not None:
                relay.stop()


def router_counters(page: str) -> dict[str, float]:
    """vllm-router's own counters that say how it routed (its Prometheus page): every
    sample whose name speaks of prefixes, cache or KV, by its result or outcome label
    (kv_aware's lookups: hit, miss, missing_tokens, ...), summed over the other labels."""
    out: dict[str, float] = {}
    for line in page.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if not any(w in name for w in ("prefix", "cache", "kv_", "credited", "lookup")):
            continue
        m = re.search(r'(?:result|outcome)="([^"]*)"', line)
        if m is not None:
            name = f"{name}:{m.group(1)}"
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        out[name] = out.get(name, 0.0) + value
    return out


def _constant(url: str) -> Any:
    return lambda i: url


__all__ = ["SERVE_LLM_ARMS", "VLLM_ROUTER_ARMS", "engine_settings", "router_counters", "run_bench"]

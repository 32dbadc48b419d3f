"""kvfold inside a Ray Serve LLM application, on this machine: two vLLM replicas (CPU, dummy
weights, the small model) built by Ray Serve LLM's own `build_openai_app`, with kvfold's
picture, routing and no-preemption admission added by `with_kvfold`. Runs in the Serve LLM
virtualenv (`make serve-llm-venv`), where Ray and vLLM live together:

    .venv-serve-llm/bin/python examples/serve_llm_kvfold.py

It sends a few requests through Serve's OpenAI routes (a shared prefix, as text and as token
ids), then prints, per request, the replica kvfold chose, the prompt tokens the engine
served from cache (its own `cached_tokens`), and kvfold's view of the two engines.
Everything listens on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
MODEL = str(REPO / "examples" / "models" / "small-llama")
os.environ.update(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1")


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def main() -> int:
    from kvfold.cluster import launch, start_local_cluster
    from kvfold.engines.vllm_settings import free_loopback_port

    replicas = 2
    cluster = start_local_cluster(num_nodes=1, gpus_per_node=replicas, cpus_per_node=2 * replicas + 4)
    try:
        from ray import serve
        import ray
        from ray.serve.llm import LLMConfig, build_openai_app

        from kvfold.serving.door_actor import start_door
        from kvfold.serving.serve_llm import ServeLLMRanks, with_kvfold
        from kvfold.serving.settings import FrontDoorSettings

        plan = ServeLLMRanks.on_loopback(replicas)
        kv = launch(replicas, replicas, engines=plan.endpoints, wait_fresh=False, dead_after_s=5.0)
        door = start_door(FrontDoorSettings(engine_urls=tuple(plan.urls), model_dir=MODEL,
                                            namespace=kv.namespace), detached=True)
        config = LLMConfig(
            model_loading_config={"model_id": "tiny-llama", "model_source": MODEL},
            engine_kwargs={"load_format": "dummy", "enforce_eager": True, "dtype": "bfloat16",
                           "block_size": 32, "max_model_len": 1024, "enable_prefix_caching": True,
                           "kv_cache_memory_bytes": 512 * 32 * 1024, "max_num_seqs": 8,
                           "enable_prompt_tokens_details": True},
            deployment_config={"autoscaling_config": {"min_replicas": replicas, "max_replicas": replicas}},
            accelerator_config={"kind": "cpu"},
            runtime_env={"env_vars": {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}},
        )
        port = free_loopback_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        t0 = time.monotonic()
        serve.run(build_openai_app({"llm_configs": [with_kvfold(config, plan, kv.namespace)]}),
                  blocking=False)
        import ray

        if os.environ.get("KVFOLD_DEBUG"):
            from kvfold.naming import rank_actor_name

            for _ in range(40):
                time.sleep(5)
                for r, url in enumerate(plan.urls):
                    try:
                        page = urllib.request.urlopen(url + "/metrics", timeout=3).read().decode()
                        vl = [l for l in page.splitlines() if l.startswith("vllm:")]
                        print(r, "page", len(page), "vllm lines", len(vl), vl[:2])
                    except OSError as e:
                        print(r, "page error", e)
                    a = ray.get_actor(rank_actor_name(r), namespace=kv.namespace)
                    print(r, "info", ray.get(a.info.remote()))
                print("door", ray.get(door.stats.remote()))
        ray.get(door.ready.remote(), timeout=600)
        print(f"{replicas} replicas up and in kvfold's view in {time.monotonic() - t0:.1f} s")
        base = f"http://127.0.0.1:{port}"
        while True:
            try:
                urllib.request.urlopen(base + "/v1/models", timeout=5).read()
                break
            except OSError:
                time.sleep(1)
        shared = " the rank holds a block of the cache" * 12
        for i, prompt in enumerate([shared + " one", shared + " two", shared + " three"]):
            answer = post(base + "/v1/completions", {"model": "tiny-llama", "prompt": prompt,
                                                     "max_tokens": 8, "temperature": 0})
            cached = answer["usage"].get("prompt_tokens_details") or {}
            print(f"request {i}: prompt {answer['usage']['prompt_tokens']} tokens, "
                  f"{cached.get('cached_tokens')} from cache")
        print(json.dumps(ray.get(door.stats.remote()), default=str)[:600])
        view = kv.view()
        print("ranks live:", [r for r in range(replicas) if view.ranks[r].live] if hasattr(view, "ranks") else view)
        return 0
    finally:
        try:
            from ray import serve as serve_

            serve_.shutdown()
        finally:
            cluster.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())

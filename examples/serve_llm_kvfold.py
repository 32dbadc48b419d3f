"""kvfold inside a Ray Serve LLM application, on this machine: two vLLM replicas (CPU, dummy
weights, the small model) built by Ray Serve LLM's own `build_openai_app`, with kvfold's
picture, routing and no-preemption admission added by `with_kvfold`. Runs in the Serve LLM
virtualenv (`make test` builds `.venv-engine`), where Ray Serve LLM and vLLM live together:

    .venv-engine/bin/python examples/serve_llm_kvfold.py

It sends a few requests through Serve's OpenAI route (a shared prefix, as text and as token
ids) and prints, per request, the prompt tokens the engine served from cache (its own
`cached_tokens`), then kvfold's view of the two replicas. Everything listens on 127.0.0.1.
`tests/serve_llm` runs it.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
MODEL = str(REPO / "examples" / "models" / "small-llama")
B = 32  # tokens per KV block


@dataclass
class Running:
    kv: Any  # kvfold (kvfold.cluster.KVFold)
    door: Any  # kvfold's door actor
    plan: Any  # where each replica's kvfold rank reads (ServeLLMRanks)
    url: str  # Serve's HTTP proxy: the OpenAI routes


@contextmanager
def serve_llm_with_kvfold(
    replicas: int = 2, blocks: int = 512, queue_timeout_s: float = 60.0
) -> Iterator[Running]:
    """An embedded Ray cluster, kvfold with one rank per replica, its door (a request waits
    there at most `queue_timeout_s`, then 429), and the Ray Serve LLM application, each
    engine with KV of `blocks` blocks; stopped on exit."""
    os.environ.update(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1")
    from kvfold.cluster import launch, start_local_cluster
    from kvfold.engines.vllm_settings import free_loopback_port

    # a replica on CPU takes 2 logical CPUs, Serve LLM's ingress 1, Serve's actors some
    cluster = start_local_cluster(num_nodes=1, gpus_per_node=replicas,
                                  cpus_per_node=2 * replicas + 4)  # fmt: skip
    try:
        import ray
        from ray import serve
        from ray.serve.llm import LLMConfig, build_openai_app

        from kvfold.serving.door_actor import start_door
        from kvfold.serving.serve_llm import ServeLLMRanks, kvfold_ingress, with_kvfold
        from kvfold.serving.settings import FrontDoorSettings

        # -- kvfold: a rank per replica, and the door that routes and admits ------------
        plan = ServeLLMRanks.on_loopback(replicas)
        kv = launch(replicas, replicas, engines=plan.endpoints, wait_fresh=False)
        door = start_door(
            FrontDoorSettings(engine_urls=tuple(plan.urls), model_dir=MODEL,
                              namespace=kv.namespace, queue_timeout_s=queue_timeout_s),
            detached=True,
        )  # fmt: skip
        # -- the Ray Serve LLM application, as its users write it ... --------------------
        config = LLMConfig(
            model_loading_config={"model_id": "tiny-llama", "model_source": MODEL},
            engine_kwargs={
                "load_format": "dummy", "enforce_eager": True, "dtype": "bfloat16",
                "block_size": B, "max_model_len": 1024, "enable_prefix_caching": True,
                "kv_cache_memory_bytes": blocks * B * 1024, "max_num_seqs": 8,
                "enable_prompt_tokens_details": True,
            },
            deployment_config={
                "autoscaling_config": {"min_replicas": replicas, "max_replicas": replicas}
            },
            accelerator_config={"kind": "cpu"},
            runtime_env={"env_vars": {"VLLM_CPU_OMP_THREADS_BIND": "nobind",
                                      "OMP_NUM_THREADS": "1"}},
        )  # fmt: skip
        # -- ... with kvfold's two lines ---------------------------------------------------
        builder = {
            "llm_configs": [with_kvfold(config, plan, kv.namespace)],
            "ingress_cls_config": kvfold_ingress(),
        }
        port = free_loopback_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_openai_app(builder), blocking=False)
        ray.get(door.ready.remote(), timeout=600)  # every replica fresh in kvfold's view
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(url + "/v1/models", timeout=5).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        yield Running(kv, door, plan, url)
    finally:
        try:
            from ray import serve as serve_

            serve_.shutdown()
        finally:
            cluster.shutdown()


def complete(url: str, prompt: str | list[int], max_tokens: int = 8) -> dict[str, Any]:
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return dict(json.loads(r.read()))


def show(running: Running) -> list[int]:
    """A few requests, a shared prefix among them; what each found in cache."""
    from transformers import AutoTokenizer

    shared = " the rank holds a block of the cache" * 12
    prompts: list[str | list[int]] = [shared + " one", shared + " two", shared + " three"]
    prompts.append(AutoTokenizer.from_pretrained(MODEL).encode(shared + " four"))  # ids
    cached = []
    for i, prompt in enumerate(prompts):
        usage = complete(running.url, prompt)["usage"]
        cached.append(int(usage["prompt_tokens_details"]["cached_tokens"]))
        kind = "token ids" if isinstance(prompt, list) else "text"
        print(f"request {i} ({kind}): {usage['prompt_tokens']} prompt tokens, "
              f"{cached[-1]} from cache")  # fmt: skip
    import ray

    stats = ray.get(running.door.stats.remote())
    print(f"kvfold's door placed {stats['placed']} requests, refused {stats['refused'] or 0}")
    for node in running.kv.view().nodes:
        for r in node.ranks:
            g = r.gpu[None]
            print(f"replica {r.rank}: {r.state.value} in kvfold's view, "
                  f"{g.num_blocks_total} blocks of {g.tokens_per_block} tokens")  # fmt: skip
    return cached


def main() -> int:
    t0 = time.monotonic()
    with serve_llm_with_kvfold() as running:
        print(f"2 replicas up and in kvfold's view in {time.monotonic() - t0:.1f} s")
        show(running)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Requests through kvfold's front door onto real vLLM engines (docs/serving.md): an
OpenAI-compatible Ray Serve app; send it OpenAI requests. (kvfold's RequestRouter, the other
way, runs in tests/engines/test_front_door.py.)

    python examples/serve_front_door.py            # 2 engines, an embedded Ray cluster

It starts what it needs: vLLM engines from the engine virtualenv (`make test` builds
.venv-engine; `--engine-python` names another), an embedded Ray cluster, kvfold reading the
engines, and Ray Serve, all on 127.0.0.1; and stops them all at the end.
"""

from __future__ import annotations

import argparse
import json
import urllib.request

from kvfold.ray_env import apply_local_defaults

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--engines", type=int, default=2)
p.add_argument("--engine-python", default=".venv-engine/bin/python")
p.add_argument("--model-dir", default="examples/models/small-llama")
args = p.parse_args()
apply_local_defaults(None)  # before Ray is imported (docs/security.md)

from ray import serve  # noqa: E402

from kvfold.cluster import launch, start_local_cluster  # noqa: E402
from kvfold.engines.engine_fleet import EngineFleet  # noqa: E402
from kvfold.engines.vllm_server import VLLMServerSettings, free_loopback_port  # noqa: E402
from kvfold.serving.front_door import serve_front_door  # noqa: E402
from kvfold.serving.settings import FrontDoorSettings  # noqa: E402


def post(url: str, body: dict) -> tuple[dict, dict]:  # type: ignore[type-arg]
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return dict(r.headers), json.loads(r.read())


cluster = start_local_cluster(num_nodes=1, gpus_per_node=args.engines)
engines = EngineFleet(
    VLLMServerSettings(python=args.engine_python, model_dir=args.model_dir, num_gpu_blocks=128),
    args.engines,
)
try:
    engines.start()
    print(f"vLLM engines serving at {', '.join(engines.urls)}")
    # kvfold reads each engine's KV events and /metrics: engine i is rank i
    kv = launch(args.engines, args.engines, engines=engines.endpoints)

    # 1. The front door. Clients send it OpenAI requests; it tokenizes them as the engine
    #    will, admits each only where its blocks up to its declared end fit, routes it to the
    #    engine holding most of its prompt, and frees its promise when the answer ends.
    door = serve_front_door(
        FrontDoorSettings(
            engine_urls=tuple(engines.urls),
            model_dir=args.model_dir,
            namespace=kv.namespace,
            http_port=free_loopback_port(),
        )
    )
    print(f"front door at {door.url}")
    system = "You answer in one line about the cache block of the rank. " * 12
    for user in ("Which node?", "Which rank?"):
        body = {"model": "tiny-llama", "max_tokens": 8,
                "messages": [{"role": "system", "content": system},
                             {"role": "user", "content": user}]}  # fmt: skip
        headers, answer = post(door.url + "/v1/chat/completions", body)
        cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        prompt_tokens = answer["usage"]["prompt_tokens"]
        engine = headers["x-kvfold-engine"]
        print(
            f"front door: engine {engine}, {prompt_tokens} prompt tokens, {cached} from its cache"
        )
    print("door:", {r: e["committed_blocks"] for r, e in door.stats()["engines"].items()},
          "blocks committed once every answer ended")  # fmt: skip

    door.shutdown()
    print("done")
finally:
    try:
        serve.shutdown()
    finally:
        cluster.shutdown()
        engines.stop()

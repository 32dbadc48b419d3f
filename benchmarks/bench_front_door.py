"""What kvfold's door adds to a request, beside what the router a vLLM user would pick instead
adds, measured in one run on real vLLM engines: the same small request, one at a time,
round after round, five ways in turn (a new random order each round):

    direct            straight to an engine
    vllm_router       vllm-router (the vLLM project's Rust router, its cache_aware policy by
                      default) in front of the engines: the anchor
    serve_default     Serve's proxy, a replica fronting the engine, Serve's default router
    front_door_serve  Serve's proxy, kvfold's FrontDoor deployment (ingress="serve")
    door              kvfold's door answering HTTP itself (ingress="door", the default)

The figure is the median, over rounds, of door's time minus vllm_router's in the same round
(paired: both met the same moment of the machine), target <= 1 ms; beside it, a 95%
bootstrap interval of that median and its interquartile range, what each way adds over
straight to the engine (paired medians), the door's own admit (`x-kvfold-waited-ms`) and
the ratios of the medians.

With `--stream` each request is streamed (8 new tokens) and its time is the client's time
to first token: the first event carrying text, as `kvfold bench-serve` counts it.

    python benchmarks/bench_front_door.py [--rounds 1000] [--engines 2] [--stream] [--json F]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _report import info, percentile, report

from kvfold.ray_env import apply_local_defaults

REPO = Path(__file__).resolve().parents[1]

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--rounds", type=int, default=1000)
p.add_argument("--engines", type=int, default=2)
p.add_argument(
    "--door-refresh-s",
    type=float,
    default=None,
    help="how often the door follows (default: the door's own)",
)
p.add_argument("--engine-python", default=str(REPO / ".venv-engine" / "bin" / "python"))
p.add_argument("--model-dir", default=str(REPO / "tests" / "fixtures" / "tiny-llama"))
p.add_argument("--stream", action="store_true", help="time to first token of a stream")
p.add_argument("--json", help="write every round's times (ms) here")
p.add_argument("--router-bin", default=str(REPO / ".venv-router" / "bin" / "vllm-router"))
p.add_argument("--router-policy", default="cache_aware", help="vllm-router's (its default)")
args = p.parse_args()
apply_local_defaults(None)

from ray import serve

from kvfold.bench.bench_serve import first_text
from kvfold.bench.vllm_router import VllmRouter
from kvfold.cluster import launch, start_local_cluster
from kvfold.engines.engine_fleet import EngineFleet
from kvfold.engines.vllm_server import VLLMServerSettings, free_loopback_port
from kvfold.serving.engine_replica import engine_deployment
from kvfold.serving.front_door import serve_front_door, start_serve
from kvfold.serving.settings import FrontDoorSettings


def bootstrap_median_interval(xs: list[float], resamples: int = 2000) -> tuple[float, float]:
    """A 95% percentile-bootstrap interval of the median of `xs`."""
    pick = random.Random(1)
    meds = sorted(statistics.median(pick.choices(xs, k=len(xs))) for _ in range(resamples))
    k = int(0.025 * resamples)
    return meds[k], meds[resamples - 1 - k]


def timed_post(url: str, body: dict[str, object]) -> tuple[float, dict[str, str]]:
    """The request's time: to its whole answer, or to a stream's first text."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=60) as r:
        headers = {k.lower(): v for k, v in r.headers.items()}
        if not body.get("stream"):
            r.read()
            return time.perf_counter() - t0, headers
        first = None
        for line in r:  # Server-Sent Events, a line at a time
            if first is None and first_text(line):
                first = time.perf_counter() - t0
        if first is None:
            raise SystemExit(f"{url}: a stream with no text")
        return first, headers


def paired(ours: list[float], anchor: list[float], label: str) -> float:
    """The median per-round difference (ms), with its interval and spread printed."""
    diffs = [(a - b) * 1e3 for a, b in zip(ours, anchor, strict=True)]
    lo, hi = bootstrap_median_interval(diffs)
    info(f"{label}, paired median: 95% interval, low", lo, "ms")
    info(f"{label}, paired median: 95% interval, high", hi, "ms")
    info(f"{label}, per round: 25th percentile", percentile(diffs, 0.25), "ms")
    info(f"{label}, per round: 75th percentile", percentile(diffs, 0.75), "ms")
    return statistics.median(diffs)


cluster = start_local_cluster(num_nodes=1, gpus_per_node=args.engines)
fleet = EngineFleet(
    VLLMServerSettings(python=args.engine_python, model_dir=args.model_dir, num_gpu_blocks=64),
    args.engines,
)
router = None
try:
    fleet.start()
    kv = launch(args.engines, args.engines, engines=fleet.endpoints)
    port = free_loopback_port()
    start_serve(http_port=port)
    serve.run(engine_deployment(fleet.urls), name="engines", route_prefix="/engines")
    refresh = {} if args.door_refresh_s is None else {"refresh_s": args.door_refresh_s}
    doors = {}
    for ingress in ("door", "serve"):
        doors[ingress] = serve_front_door(
            FrontDoorSettings(
                engine_urls=tuple(fleet.urls),
                model_dir=args.model_dir,
                namespace=kv.namespace,
                http_port=port if ingress == "serve" else free_loopback_port(),
                ingress=ingress,
                app_name=f"kvfold-front-door-{ingress}",
                route_prefix=f"/{ingress}",
                **refresh,
            )
        )
    router = VllmRouter(args.router_bin, args.router_policy, fleet.urls)
    router.start()
    router.wait_ready()
    info("vllm-router: " + " ".join(router.command()), 0, "")
    ways = {
        "direct": fleet.urls[0] + "/v1/completions",
        "vllm_router": router.url + "/v1/completions",
        "serve_default": f"http://127.0.0.1:{port}/engines/v1/completions",
        "front_door_serve": doors["serve"].url + "/v1/completions",
        "door": doors["door"].url + "/v1/completions",
    }
    body: dict[str, object] = {"model": "tiny-llama", "prompt": list(range(3, 67)), "max_tokens": 1}
    if args.stream:
        body.update(max_tokens=8, stream=True, ignore_eos=True)
    for url in ways.values():  # warm every path: connections, imports, first compiles
        for _ in range(5):
            try:
                timed_post(url, body)
            except urllib.error.HTTPError as e:
                raise SystemExit(f"{url}: {e.code} {e.read()[:500]!r}") from e
    times: dict[str, list[float]] = {w: [] for w in ways}
    waited: list[float] = []
    order = random.Random(0)
    for _ in range(args.rounds):
        for way, url in order.sample(list(ways.items()), len(ways)):  # no way always first
            dt, headers = timed_post(url, body)
            times[way].append(dt)
            if way == "door":
                waited.append(float(headers["x-kvfold-waited-ms"]))
    med = {w: statistics.median(t) * 1e3 for w, t in times.items()}
    what = "time to first token" if args.stream else "request"
    for w in ways:
        info(f"{w}: {what} p50 ({args.rounds} rounds)", med[w], "ms")
    info("door: its own admit, as it saw it, p50", statistics.median(waited), "ms")
    added = {w: paired(times[w], times["direct"], f"{w} - direct") for w in ways if w != "direct"}
    for w, ms in added.items():
        info(f"added by {w} (over straight to the engine), paired p50", ms, "ms")
    over = paired(times["door"], times["vllm_router"], "door - vllm_router")
    report("door's added latency over vllm-router's, p50 (paired)", over, "ms", 1.0)
    info("ratio door / vllm_router p50", med["door"] / med["vllm_router"], "x")
    info("ratio front_door_serve / serve_default p50",
         med["front_door_serve"] / med["serve_default"], "x")  # fmt: skip
    if args.json:
        rows = {w: [t * 1e3 for t in ts] for w, ts in times.items()}
        Path(args.json).write_text(json.dumps({"ms": rows, "door_admit_ms": waited}))
    for d in doors.values():
        d.shutdown()
finally:
    try:
        if router is not None:
            router.stop()
        serve.shutdown()
    finally:
        cluster.shutdown()
        fleet.stop()

"""`kvfold bench-serve TRACE`: a trace replayed as real HTTP requests against N real vLLM
engines, four ways in one run, judged by the engines' own counters and the client's clock.

    round_robin     straight to the engines, in turn, no admission
    serve_default   the engines as Ray Serve replicas behind Serve's proxy and its default
                    router (power of two choices)
    vllm_router_p2c, vllm_router_cache_aware, vllm_router_kv_aware
                    vllm-router (the vLLM project's Rust router) in front of the engines:
                    power of two choices; its prefix tree of the token ids it sent; its
                    block index fed by the engines' own KV events
    serve_llm_default, serve_llm_prefix, serve_llm_kvfold
                    a Ray Serve LLM application (build_openai_app) with as many replicas,
                    their engines started with the same vLLM arguments, behind its default
                    router (power of two choices), its PrefixCacheAffinityRouter (a text
                    prefix tree), or kvfold's router and admission (kvfold.serving.serve_llm:
                    its block index and promises); prompts go as their text, which
                    tokenizes to the same ids
    least_loaded    kvfold's front door, least committed engine
    precise_prefix  kvfold's front door, by what each engine holds (the block index)

Per arm, from the engines: prompt tokens served from cache (`vllm:prefix_cache_hits`) and
preemptions (`vllm:num_preemptions`), as deltas over the arm; from the client: time to first
token (the first streamed chunk carrying text) and end-to-end latency, requests answered,
refused (429) and failed; for the front door's arms, the part of each request's wait spent
in kvfold's queue (its `x-kvfold-waited-ms` header). Every arm starts from empty engine
caches (POST /reset_prefix_cache) and idle engines.

    run_arm(...)  -> its row, and what the client saw of each request
    first_text(line)   whether a streamed line is what the client's time to first token counts
    write_outputs(rows, meta, out_dir, per_request)   .json, .csv, .png; every request
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kvfold.bench.bench_trace import ServeRequest
from kvfold.engines.vllm_metrics import parse_vllm_metrics

ARMS = (
    "round_robin",
    "serve_default",
    "vllm_router_p2c",
    "vllm_router_cache_aware",
    "vllm_router_kv_aware",
    "serve_llm_default",
    "serve_llm_prefix",
    "serve_llm_kvfold",
    "least_loaded",
    "precise_prefix",
)
COLUMNS = (
    "arm",
    "requests",
    "completed",
    "refused_429",
    "failed",
    "prompt_tokens",
    "cached_tokens",
    "cached_fraction",
    "preemptions",
    "ttft_p50_ms",
    "ttft_p90_ms",
    "ttft_p99_ms",
    "door_wait_p50_ms",
    "door_wait_p90_ms",
    "e2e_p50_ms",
    "e2e_p90_ms",
    "wall_s",
)


@dataclass
class Outcome:
    status: int = 0
    engine: int | None = None  # the rank that answered (x-kvfold-engine), where known
    ttft_s: float | None = None
    e2e_s: float | None = None
    door_wait_s: float | None = None  # in kvfold's queue, as the front door said (a header)
    error: str = ""


@dataclass
class EngineCounters:
    cached_tokens: int = 0
    preemptions: int = 0
    running: int = 0
    waiting: int = 0
    per_engine: list[dict[str, int]] = field(default_factory=list)


def engine_counters(urls: Sequence[str]) -> EngineCounters:
    out = EngineCounters()
    for url in urls:
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            m = parse_vllm_metrics(r.read().decode())["0"]
        one = {
            "cached_tokens": int(m.prefix_cache_hits_tokens or 0),
            "preemptions": int(m.num_preemptions or 0),
        }
        out.per_engine.append(one)
        out.cached_tokens += one["cached_tokens"]
        out.preemptions += one["preemptions"]
        out.running += int(m.num_requests_running or 0)
        out.waiting += int(m.num_requests_waiting or 0)
    return out


def reset_caches(urls: Sequence[str], timeout_s: float = 60.0) -> None:
    """Wait until every engine is idle, then empty its prefix cache."""
    deadline = time.monotonic() + timeout_s
    while True:
        c = engine_counters(urls)
        if c.running == 0 and c.waiting == 0:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"engines still busy after {timeout_s} s: {c}")
        time.sleep(0.2)
    for url in urls:
        req = urllib.request.Request(url + "/reset_prefix_cache", data=b"", method="POST")
        urllib.request.urlopen(req, timeout=30).read()


def first_text(line: bytes) -> bool:
    """Whether a streamed line is one a client's time to first token counts: an event of a
    completion that carries text (vLLM's first may carry none)."""
    return line.startswith(b"data: {") and b'"text":""' not in line


async def replay_http(
    requests: Sequence[ServeRequest],
    target: Callable[[int], str],
    model: str,
    timeout_s: float = 600.0,
    *,
    as_text: bool = False,
) -> list[Outcome]:
    """Send each request at its arrival time (streamed, greedy, generated to max_tokens)
    to `target(i)` + /v1/completions, its prompt as token ids or (`as_text`) as its text;
    what the client saw of each."""
    import aiohttp

    t0 = time.monotonic()
    out = [Outcome() for _ in requests]
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as session:

        async def one(i: int, r: ServeRequest) -> None:
            await asyncio.sleep(max(0.0, r.arrival_s - (time.monotonic() - t0)))
            body = {
                "model": model,
                "prompt": r.text if as_text else list(r.prompt),
                "max_tokens": r.max_tokens,
                "ignore_eos": True,
                "temperature": 0,
                "stream": True,
            }
            sent = time.monotonic()
            o = out[i]
            try:
                async with session.post(target(i) + "/v1/completions", json=body) as resp:
                    o.status = resp.status
                    engine = resp.headers.get("x-kvfold-engine")
                    o.engine = int(engine) if engine is not None else None
                    waited = resp.headers.get("x-kvfold-waited-ms")
                    if waited is not None:
                        o.door_wait_s = float(waited) / 1e3
                    if resp.status != 200:
                        o.error = (await resp.read())[:200].decode(errors="replace")
                        return
                    async for line in resp.content:
                        if o.ttft_s is None and first_text(line):
                            o.ttft_s = time.monotonic() - sent
                        if b'"error"' in line:
                            o.error = line[:200].decode(errors="replace")
                    o.e2e_s = time.monotonic() - sent
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
                o.error = repr(e)[:200]  # no answer, a cut stream, or a header not a number

        await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
    return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 1)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def summarize(
    arm: str,
    requests: Sequence[ServeRequest],
    outcomes: Sequence[Outcome],
    before: EngineCounters,
    after: EngineCounters,
    wall_s: float,
) -> dict[str, Any]:
    done = [o for o in outcomes if o.status == 200 and not o.error and o.e2e_s is not None]
    ttft = [o.ttft_s for o in done if o.ttft_s is not None]
    e2e = [o.e2e_s for o in done if o.e2e_s is not None]
    wait = [o.door_wait_s for o in done if o.door_wait_s is not None]
    prompt_tokens = sum(len(r.prompt) for r in requests)
    cached = after.cached_tokens - before.cached_tokens
    return {
        "arm": arm,
        "requests": len(requests),
        "completed": len(done),
        "refused_429": sum(1 for o in outcomes if o.status == 429),
        "failed": sum(1 for o in outcomes if o.status != 429 and (o.status != 200 or o.error)),
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "cached_fraction": round(cached / prompt_tokens, 4) if prompt_tokens else 0.0,
        "preemptions": after.preemptions - before.preemptions,
        "ttft_p50_ms": _ms(_pct(ttft, 0.5)),
        "ttft_p90_ms": _ms(_pct(ttft, 0.9)),
        "ttft_p99_ms": _ms(_pct(ttft, 0.99)),
        "door_wait_p50_ms": _ms(_pct(wait, 0.5)),
        "door_wait_p90_ms": _ms(_pct(wait, 0.9)),
        "e2e_p50_ms": _ms(_pct(e2e, 0.5)),
        "e2e_p90_ms": _ms(_pct(e2e, 0.9)),
        "wall_s": round(wall_s, 1),
    }


class UrlEngines:
    """Engines reached at their own URLs: vLLM's /metrics and /reset_prefix_cache."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.urls = list(urls)

    def counters(self) -> EngineCounters:
        return engine_counters(self.urls)

    def start_empty(self) -> None:
        reset_caches(self.urls)

    def settle(self) -> EngineCounters:
        reset_caches(self.urls, timeout_s=120.0)  # idle again: every counter is in
        return engine_counters(self.urls)


class Engines(Protocol):
    """Where an arm's engines are counted: idle and empty before it, settled after it."""

    def counters(self) -> EngineCounters: ...
    def start_empty(self) -> None: ...
    def settle(self) -> EngineCounters: ...


def run_arm(
    arm: str,
    requests: Sequence[ServeRequest],
    engines: Sequence[str] | Engines,
    target: Callable[[int], str],
    model: str,
    *,
    as_text: bool = False,
) -> tuple[dict[str, Any], list[Outcome]]:
    """One arm from empty engine caches: its row, and what the client saw of each request
    (a request sent straight to an engine's URL has that engine's rank). `engines`: the
    engines' URLs, or an application that counts its own (kvfold.bench.serve_llm);
    `as_text`: each request's prompt as its text."""
    if as_text and not all(r.text for r in requests):
        raise ValueError(f"{arm}: as_text=True: allowed: requests that carry their text")
    counted: Engines = UrlEngines(engines) if isinstance(engines, Sequence) else engines
    counted.start_empty()
    before = counted.counters()
    t0 = time.monotonic()
    outcomes = asyncio.run(replay_http(requests, target, model, as_text=as_text))
    wall = time.monotonic() - t0
    after = counted.settle()
    if isinstance(counted, UrlEngines):
        sent_straight_to(outcomes, target, counted.urls)
    return summarize(arm, requests, outcomes, before, after, wall), outcomes


def sent_straight_to(
    outcomes: Sequence[Outcome], target: Callable[[int], str], engine_urls: Sequence[str]
) -> None:
    """A request sent to an engine's own URL was answered by that engine: its rank, where
    no header said it."""
    for i, o in enumerate(outcomes):
        if o.engine is None and target(i) in engine_urls:
            o.engine = list(engine_urls).index(target(i))


REQUEST_COLUMNS = ("arm", "request_id", "arrival_s", "prompt_tokens", "max_tokens", "status",
                   "engine", "ttft_ms", "e2e_ms", "door_wait_ms", "error")  # fmt: skip


def request_rows(
    arm: str, requests: Sequence[ServeRequest], outcomes: Sequence[Outcome]
) -> list[dict[str, Any]]:
    """One row per request of an arm: when it came, where it went, what the client saw."""
    return [
        {
            "arm": arm,
            "request_id": r.request_id,
            "arrival_s": round(r.arrival_s, 3),
            "prompt_tokens": len(r.prompt),
            "max_tokens": r.max_tokens,
            "status": o.status,
            "engine": o.engine,
            "ttft_ms": _ms(o.ttft_s),
            "e2e_ms": _ms(o.e2e_s),
            "door_wait_ms": _ms(o.door_wait_s),
            "error": o.error,
        }
        for r, o in zip(requests, outcomes, strict=True)
    ]


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    cols = [c for c in COLUMNS if c not in ("prompt_tokens",)]
    widths = {c: max(len(c), *(len(str(r.get(c))) for r in rows)) for c in cols}
    lines = ["  ".join(c.rjust(widths[c]) for c in cols)]
    for r in rows:
        lines.append("  ".join(str(r.get(c)).rjust(widths[c]) for c in cols))
    return "\n".join(lines)


def write_outputs(
    rows: Sequence[dict[str, Any]],
    meta: dict[str, Any],
    out_dir: str,
    per_request: Sequence[dict[str, Any]] = (),
) -> list[Path]:
    """bench_serve.json (rows and how they were made), .csv, .png (three panels), and
    bench_serve_requests.csv (every request of every arm) when `per_request` is given."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if per_request:
        import csv

        requests_csv = out / "bench_serve_requests.csv"
        with open(requests_csv, "w", encoding="utf-8", newline="") as f:
            w = csv.DictWriter(f, REQUEST_COLUMNS)
            w.writeheader()
            w.writerows(per_request)
        written.append(requests_csv)
    js = out / "bench_serve.json"
    js.write_text(json.dumps({"meta": meta, "rows": list(rows)}, indent=2) + "\n")
    csv_path = out / "bench_serve.csv"
    with open(csv_path, "w", encoding="utf-8") as f:
        f.write(",".join(COLUMNS) + "\n")
        for r in rows:
            f.write(",".join("" if r.get(c) is None else str(r.get(c)) for c in COLUMNS) + "\n")
    png = out / "bench_serve.png"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    names = [r["arm"] for r in rows]
    panels = (
        ("prompt tokens from cache (engines' count)", [r["cached_tokens"] for r in rows]),
        ("TTFT p90 (ms, client)", [r["ttft_p90_ms"] or 0 for r in rows]),
        ("preemptions (engines' count)", [r["preemptions"] for r in rows]),
    )
    for ax, (title, values) in zip(axes, panels, strict=True):
        ax.bar(names, values, color=["#999", "#bbb", "#6a9", "#27a"][: len(names)])
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return [js, csv_path, png, *written]


__all__ = [
    "ARMS",
    "COLUMNS",
    "REQUEST_COLUMNS",
    "Engines",
    "Outcome",
    "UrlEngines",
    "engine_counters",
    "first_text",
    "format_table",
    "replay_http",
    "request_rows",
    "reset_caches",
    "run_arm",
    "sent_straight_to",
    "summarize",
    "write_outputs",
]

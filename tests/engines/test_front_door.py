"""kvfold's front door in front of 3 real vLLM engines, judged by the engines' own word. The
door answers HTTP itself (the default ingress); a second front door on Ray Serve's proxy
(ingress="serve") takes the retry test.

- text and chat prompts are tokenized exactly as the engine tokenizes them (the engine's
  `prompt_token_ids`), so what the door counts is what the engine holds;
- a burst that makes round robin preempt (the engines' `vllm:num_preemptions`) leaves
  every engine's preemption counter where it was through the front door; every request is
  answered (a completion or a 429); at every moment sampled, kvfold had committed at least
  the blocks the engine reported in use; nothing stays committed;
- OpenAI's routes pass through (streaming chunk by chunk); what cannot be counted is refused
  by name;
- kvfold's RequestRouter in a Serve deployment of the engines sends a shared prefix to the
  engine that holds it (the engine's `cached_tokens`), and frees it when it completes;
- a small bench-serve: vllm-router beside the door on the same engines;
- nothing the front door starts listens beyond loopback;
- an engine killed mid-run: its requests end with an error naming it, or go elsewhere
  when nothing was streamed yet; its commitments are released; nothing waits forever.

Order matters: the last test kills an engine.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import psutil
import pytest
import ray
from ray import serve

from kvfold.cluster import launch, start_local_cluster
from kvfold.engines.engine_fleet import EngineFleet
from kvfold.engines.vllm_metrics import parse_vllm_metrics
from kvfold.engines.vllm_server import VLLMServerSettings, free_loopback_port
from kvfold.errors import DoorRefused
from kvfold.serving.door_actor import start_door
from kvfold.serving.door_admission import LEAST_LOADED
from kvfold.serving.engine_replica import engine_deployment
from kvfold.serving.front_door import FrontDoorApp, serve_front_door, start_serve
from kvfold.serving.openai_body import parse_chat, parse_completion
from kvfold.serving.prompt_tokens import PromptTokenizer
from kvfold.serving.request_router import kvfold_router_config
from kvfold.serving.settings import FrontDoorSettings
from tests.integration.conftest import wait_until

pytestmark = pytest.mark.engines

B = 32
BLOCKS = 64  # 63 usable: the preemption recipe of the vLLM fixture's README
ENGINES = 3
QUEUE_LIMIT = 12  # a burst of 48 overflows it: some are answered 429
LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")


@dataclass
class Door:
    fleet: EngineFleet
    kv: Any
    app: FrontDoorApp  # the door answering HTTP itself (the default ingress)
    tokenizer: PromptTokenizer
    serve_port: int  # Ray Serve's proxy, for the Serve ingress and the engines' deployment

    def post(
        self, path: str, body: dict[str, Any], timeout_s: float = 180
    ) -> tuple[int, dict[str, str], bytes]:
        return post(self.app.url + path, body, timeout_s)

    def metrics(self, i: int) -> Any:
        text = urllib.request.urlopen(self.fleet.urls[i] + "/metrics", timeout=30).read().decode()
        return parse_vllm_metrics(text)["0"]


def post(
    url: str, body: dict[str, Any], timeout_s: float = 180
) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


@pytest.fixture(scope="module")
def door(engine_python: str, tiny_llama_dir: str) -> Iterator[Door]:
    settings = VLLMServerSettings(
        python=engine_python, model_dir=tiny_llama_dir, block_size=B, num_gpu_blocks=BLOCKS,
        max_num_seqs=16, max_model_len=1024,
    )  # fmt: skip
    fleet = EngineFleet(settings, ENGINES)
    fleet.start()
    cluster = start_local_cluster(num_nodes=1, gpus_per_node=ENGINES)
    try:
        kv = launch(ENGINES, ENGINES, engines=fleet.endpoints, dead_after_s=2.0)
        serve_port = free_loopback_port()
        start_serve(http_port=serve_port)
        app = serve_front_door(
            FrontDoorSettings(
                engine_urls=tuple(fleet.urls),
                model_dir=tiny_llama_dir,
                namespace=kv.namespace,
                queue_limit=QUEUE_LIMIT,
                queue_timeout_s=120.0,
                http_port=free_loopback_port(),
            )
        )
        assert app.server is not None  # the default: the door's own HTTP, no Serve proxy
        yield Door(fleet, kv, app, PromptTokenizer(tiny_llama_dir), serve_port)
    finally:
        try:
            serve.shutdown()
        finally:
            cluster.shutdown()
            fleet.stop()


def test_prompts_are_tokenized_as_the_engine_tokenizes_them(door: Door) -> None:
    texts = ["Hello the cache block! 123", "  rank\tnode\n\nhost tier?", "über 日本 ✓"]
    for text in texts:
        body = {"model": "tiny-llama", "prompt": text, "max_tokens": 2, "return_token_ids": True}
        status, headers, data = door.post("/v1/completions", body)
        assert status == 200, data
        engine_ids = json.loads(data)["choices"][0]["prompt_token_ids"]
        assert door.tokenizer.ids(parse_completion(body)) == engine_ids
        want = -(-(len(engine_ids) + 2) // B)
        assert headers["x-kvfold-committed-blocks"] == str(want)
    chats = [
        [{"role": "user", "content": "hi there"}],
        [{"role": "system", "content": "be brief "}, {"role": "user", "content": "rank?"}],
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            }
        ],
    ]
    for messages in chats:
        for extra in ({}, {"add_generation_prompt": False}):
            body = {"model": "tiny-llama", "messages": messages, "max_tokens": 2,
                    "return_token_ids": True, **extra}  # fmt: skip
            status, _, data = door.post("/v1/chat/completions", body)
            assert status == 200, data
            assert door.tokenizer.ids(parse_chat(body)) == json.loads(data)["prompt_token_ids"]


def burst(rng: random.Random, n: int) -> list[dict[str, Any]]:
    """The fixture README's preemption recipe: prompts of 200-600 random ids, 64-200 new
    tokens each, generated to the end."""
    return [
        {
            "model": "tiny-llama",
            "prompt": [rng.randrange(3, 1024) for _ in range(rng.randint(200, 600))],
            "max_tokens": rng.randint(64, 200),
            "ignore_eos": True,
            "temperature": 0,
        }
        for _ in range(n)
    ]


def engines(door: Door) -> dict[int, dict[str, Any]]:
    """The door's word on each engine: committed, running, live, the engine's gauge."""
    out: dict[int, dict[str, Any]] = door.app.stats()["engines"]
    return out


def preemptions(door: Door) -> list[int]:
    return [int(door.metrics(i).num_preemptions) for i in range(ENGINES)]


def test_through_kvfold_no_engine_preempts_where_round_robin_does(door: Door) -> None:
    rng = random.Random(11)
    before = preemptions(door)
    direct = burst(rng, 16 * ENGINES)
    with ThreadPoolExecutor(len(direct)) as pool:
        answers = list(pool.map(
            lambda ib: post(door.fleet.urls[ib[0] % ENGINES] + "/v1/completions", ib[1]),
            enumerate(direct),
        ))  # fmt: skip
    assert all(a[0] == 200 for a in answers)
    after_direct = preemptions(door)
    assert sum(after_direct) > sum(before), "the load must make round robin preempt"
    # the door's cross-check saw that traffic, which was not its own; then the engines idle
    wait_until(lambda: all(e["used_blocks"] == 0 for e in engines(door).values()), timeout_s=30)
    foreign = {r: e["above_committed"] for r, e in engines(door).items()}
    assert sum(foreign.values()) > 0

    sampled: list[tuple[int, int, int]] = []  # engine, used by its /metrics, kvfold committed
    done = False

    def sample() -> None:
        while not done:
            for i in range(ENGINES):
                t0 = time.time()
                used = door.metrics(i).num_blocks_used
                t1 = time.time()
                most = door.app.committed_between(i, t0, t1)
                sampled.append((i, used, most))

    through = burst(rng, 16 * ENGINES)
    with ThreadPoolExecutor(len(through) + 1) as pool:
        watcher = pool.submit(sample)
        answers = list(pool.map(lambda b: door.post("/v1/completions", b), through))
        done = True
        watcher.result()
    statuses = [a[0] for a in answers]
    assert set(statuses) <= {200, 429}, [a for a in answers if a[0] not in (200, 429)][:2]
    assert statuses.count(200) >= QUEUE_LIMIT  # what ran, and all that could wait, got through
    for status, headers, _ in answers:
        if status == 429:
            assert int(headers["retry-after"]) >= 1
    assert preemptions(door) == after_direct  # the engines' own counters did not move
    assert len(sampled) >= ENGINES and any(u > 0 for _, u, _ in sampled)
    assert all(used <= most for _, used, most in sampled), [s for s in sampled if s[1] > s[2]]
    stats = wait_until(
        lambda: (
            (s := door.app.stats())["queued"] == 0
            and all(e["committed_blocks"] == 0 for e in s["engines"].values())
            and all(e["prefilling_blocks"] == 0 for e in s["engines"].values())
            and s
        ),
        timeout_s=30,
    )
    assert {r: e["above_committed"] for r, e in stats["engines"].items()} == foreign
    assert stats["refused"].get("queue_full", 0) == statuses.count(429)


def test_openai_routes_pass_through_and_what_cannot_be_counted_is_refused(door: Door) -> None:
    body = {"model": "tiny-llama", "prompt": "the rank holds a block", "max_tokens": 6,
            "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    status, headers, data = door.post("/v1/completions", body)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [e for e in data.decode().split("\n\n") if e.startswith("data: ")]
    # text chunks (vLLM may hold a token back until its text is whole), the usage, then DONE
    assert events[-1] == "data: [DONE]" and len(events) >= 4
    usage = json.loads(events[-2].removeprefix("data: "))["usage"]
    assert usage["completion_tokens"] == 6
    # a stream's first token back: its engine has prefilled it, so its prompt no longer
    # counts as prefill there; its blocks stay committed until the stream ends
    body = {"model": "tiny-llama", "prompt": list(range(3, 200)), "max_tokens": 400,
            "stream": True, "ignore_eos": True}  # fmt: skip
    req = urllib.request.Request(
        door.app.url + "/v1/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=180) as r:
        engine = int(r.headers["x-kvfold-engine"])
        assert r.readline().startswith(b"data: {")  # the first token
        mid = door.app.stats()["engines"][engine]
        rest = r.read()
    assert rest.rstrip().endswith(b"data: [DONE]")
    assert mid["prefilling_blocks"] == 0
    # still running when read: its blocks (197 + 400 tokens) still committed
    assert mid["committed_blocks"] == int(r.headers["x-kvfold-committed-blocks"]) == 19
    models = json.loads(urllib.request.urlopen(door.app.url + "/v1/models").read())
    assert models["data"][0]["id"] == "tiny-llama"
    # every engine fresh again once the burst above has drained (a busy engine's /metrics
    # can answer late enough for its rank to go stale for a moment)
    wait_until(
        lambda: (
            json.loads(urllib.request.urlopen(door.app.url + "/health").read())["live_engines"]
            == [0, 1, 2]
        ),
        timeout_s=30,
    )
    for bad, param in (
        ({"prompt": [1, -1]}, "prompt"),
        ({"prompt": [1], "max_tokens": 0}, "max_tokens"),
    ):
        status, _, data = door.post("/v1/completions", {"model": "tiny-llama", **bad})
        assert status == 400 and json.loads(data)["error"]["param"] == param
    status, _, data = door.post("/v1/completions", {"model": "tiny-llama", "prompt": [5] * 1100})
    assert status == 400 and "prompt_too_long" in json.loads(data)["error"]["message"]
    status, _, data = door.post("/v1/completions", {"model": "tiny-llama", "prompt": [5] * 900,
                                                     "max_tokens": 100, "n": 3})  # fmt: skip
    assert status == 400 and "exceeds_engine_capacity" in json.loads(data)["error"]["message"]
    assert all(e["committed_blocks"] == 0 for e in door.app.stats()["engines"].values())


@ray.remote(num_cpus=0)
class HandleCaller:
    """Calls a Serve application through a DeploymentHandle from a Ray actor, as a caller
    in another deployment would: there `except DoorRefused` must catch the router's
    refusal (Serve copies the router's module by value into the caller's process). And a
    handle used in the test process would start Serve's router thread there, which
    outlives every cluster of the session and records metrics into Ray's core every 5 s
    until the interpreter exits; here it ends with the cluster."""

    def __init__(self, app_name: str) -> None:
        self.handle = serve.get_app_handle(app_name)

    def generate(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = self.handle.generate.remote(path, body).result(timeout_s=120)
        return result

    def refusal(self, path: str, body: dict[str, Any]) -> str | None:
        """The DoorRefused a call ends with, as `type: message`; None if it is answered."""
        try:
            self.handle.generate.remote(path, body).result(timeout_s=60)
        except DoorRefused as e:
            return f"{type(e).__name__}: {e}"
        return None


def test_kvfolds_request_router_routes_a_serve_deployment_of_the_engines(door: Door) -> None:
    # the router asks the namespace's door actor (the front door above keeps its own door in
    # its replica; the two are used one after the other here, never at once)
    shared = start_door(door.app.settings)
    ray.get(shared.ready.remote(), timeout=60)
    serve.run(
        engine_deployment(door.fleet.urls, kvfold_router_config(door.kv.namespace)),
        name="engines-routed",
        route_prefix="/engines-routed",
    )
    caller = HandleCaller.remote("engines-routed")  # type: ignore[attr-defined]
    rng = random.Random(5)
    prefix = [rng.randrange(3, 1024) for _ in range(8 * B)]
    first = ray.get(
        caller.generate.remote(
            "/v1/completions", {"model": "tiny-llama", "prompt": [*prefix, 1], "max_tokens": 2}
        )
    )
    engine = first["kvfold_rank"]
    # the engine's stored blocks reach the index through its KV events, and the door's copy
    # of it with the door's next follow (a view newer than the one it had then)
    wait_until(
        lambda: door.kv.client.index().match([*prefix, 2]).gpu.get(engine, 0) == 8, timeout_s=30
    )
    seen = ray.get(shared.stats.remote())["view_version"]
    wait_until(lambda: ray.get(shared.stats.remote())["view_version"] > seen, timeout_s=30)
    again = ray.get(
        caller.generate.remote(
            "/v1/completions", {"model": "tiny-llama", "prompt": [*prefix, 2], "max_tokens": 2}
        )
    )
    assert again["kvfold_rank"] == engine
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 8 * B
    wait_until(
        lambda: all(
            e["committed_blocks"] == 0 for e in ray.get(shared.stats.remote())["engines"].values()
        ),
        timeout_s=30,
    )
    assert ray.get(shared.stats.remote())["placed"] == 2
    # what the door refuses fails the handle call by name, and places nothing
    for body, match in (
        ({"prompt": [5] * 1100, "max_tokens": 2}, "prompt_too_long"),
        ({"prompt": [5] * 40, "max_tokens": 0}, "max_tokens"),
    ):
        refusal = ray.get(caller.refusal.remote("/v1/completions", {"model": "tiny-llama", **body}))
        assert refusal is not None and refusal.startswith("DoorRefused") and match in refusal
    assert ray.get(shared.stats.remote())["placed"] == 2
    ray.kill(caller)
    serve.delete("engines-routed")
    ray.kill(shared)


def _command(p: psutil.Process) -> str:
    """Its name and command line; empty for a child gone or a zombie not yet reaped."""
    try:
        return f"{p.name()} {' '.join(p.cmdline())}"
    except psutil.Error:
        return ""


def test_a_small_bench_serve_runs_kvfold_beside_vllm_router_on_the_same_engines(
    door: Door,
) -> None:
    """bench-serve's arms keep working: the same requests (two prompts sharing a prefix of
    3 blocks, sent one after another) behind vllm-router's cache_aware and behind kvfold's
    front door, each from empty caches, judged by the engines' counters. The router listens
    on loopback only."""
    from kvfold.bench.bench_serve import run_arm
    from kvfold.bench.bench_trace import ServeRequest
    from kvfold.bench.vllm_router import VllmRouter

    rng = random.Random(7)
    shared = [rng.randrange(3, 1000) for _ in range(3 * B)]
    requests = [
        ServeRequest(
            f"r{i}", 1.5 * i, tuple(shared + [rng.randrange(3, 1000) for _ in range(8)]), 4
        )
        for i in range(4)
    ]
    urls = door.fleet.urls
    binary = str(
        pathlib.Path(__file__).resolve().parents[2] / ".venv-router" / "bin" / "vllm-router"
    )
    router = VllmRouter(binary, "cache_aware", urls, model="tiny-llama")
    assert "0.0.0.0" not in router.command()
    with router:
        listening = [
            c.laddr.ip
            for p in [
                psutil.Process(router._proc.pid),
                *psutil.Process(router._proc.pid).children(True),
            ]
            for c in p.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN
        ]
        row, seen = run_arm(
            "vllm_router_cache_aware", requests, urls, lambda i: router.url, "tiny-llama"
        )
    assert listening and set(listening) <= set(LOOPBACK), listening
    door_row, door_seen = run_arm(
        "precise_prefix", requests, urls, lambda i: door.app.url, "tiny-llama"
    )
    for r, outcomes in ((row, seen), (door_row, door_seen)):
        assert (r["completed"], r["failed"], r["refused_429"]) == (4, 0, 0), (r, outcomes)
        assert r["preemptions"] == 0, r
        # later prompts find the shared 3 blocks where they were sent (round robin over 3
        # engines: once)
        assert r["cached_tokens"] >= 2 * 3 * B, r
    assert {o.engine for o in door_seen} and all(o.ttft_s for o in door_seen)


def test_nothing_the_front_door_starts_listens_beyond_loopback(door: Door) -> None:
    ours = {p.pid: p for p in psutil.Process(os.getpid()).children(recursive=True)}
    assert any("DoorServer" in _command(p) for p in ours.values())  # the door's own HTTP
    assert any("ProxyActor" in _command(p) for p in ours.values())  # Serve's proxy
    door_port = door.app.settings.http_port
    wide, door_listens = [], []
    for pid, p in ours.items():
        try:
            for c in p.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN and c.laddr.ip not in LOOPBACK:
                    wide.append((pid, p.name(), c.laddr.ip, c.laddr.port))
                if c.status == psutil.CONN_LISTEN and c.laddr.port == door_port:
                    door_listens.append(c.laddr.ip)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    assert not wide, wide
    assert door_listens == ["127.0.0.1"], door_listens


def test_an_engine_failing_before_a_byte_leaves_the_request_to_another_once(door: Door) -> None:
    """A second front door, on Ray Serve's ingress, whose engine rank 0 is reached at a
    server that answers /v1/models as that engine does and drops every request unanswered
    (an engine dying
    between accepting a request and answering it). kvfold's view holds rank 0 live: it reads
    the real engine. Under least_loaded, idle engines tie and the lowest rank wins, so each
    request is placed on rank 0 first, fails there before a byte, and is placed once more,
    on rank 1, whose answer the client gets. Nothing stays committed."""
    card = urllib.request.urlopen(door.fleet.urls[0] + "/v1/models", timeout=30).read()
    dropped: list[str] = []

    class Dropping(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # http.server's names
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(card)))
            self.end_headers()
            self.wfile.write(card)

        def do_POST(self) -> None:
            dropped.append(self.path)
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)  # no status line, no byte

        def log_message(self, *args: Any) -> None:
            pass

    standin = ThreadingHTTPServer(("127.0.0.1", 0), Dropping)
    threading.Thread(target=standin.serve_forever, daemon=True).start()
    app = serve_front_door(
        FrontDoorSettings(
            engine_urls=(f"http://127.0.0.1:{standin.server_address[1]}", *door.fleet.urls[1:]),
            model_dir=door.app.settings.model_dir, namespace=door.kv.namespace,
            policy=LEAST_LOADED, app_name="kvfold-front-door-retry", route_prefix="/retry",
            ingress="serve", http_port=door.serve_port,
        )
    )  # fmt: skip
    try:
        for stream in (False, True):
            body = {"model": "tiny-llama", "prompt": [9] * 40, "max_tokens": 3, "stream": stream}
            status, headers, data = post(app.url + "/v1/completions", body)
            assert status == 200, data
            assert headers["x-kvfold-engine"] == "1"
            if stream:
                assert data.rstrip().endswith(b"data: [DONE]")
        assert dropped == ["/v1/completions", "/v1/completions"]  # each tried rank 0 first

        def settled() -> dict[str, Any] | None:
            s = app.stats()
            return s if all(e["committed_blocks"] == 0 for e in s["engines"].values()) else None

        stats: Any = wait_until(settled, timeout_s=30)
        assert stats["placed"] == 4  # two requests, each placed twice
    finally:
        app.shutdown()
        standin.shutdown()


def test_an_engine_killed_mid_run_fails_its_requests_by_name_and_frees_them(door: Door) -> None:
    rng = random.Random(3)
    bodies = [{**b, "max_tokens": 400, "stream": True} for b in burst(rng, 9)]
    victim = door.fleet.servers[2]
    streaming_from_victim = threading.Event()

    def stream(body: dict[str, Any]) -> tuple[str, bytes]:
        """Which engine answered, and the whole stream; marks a stream of the victim's
        that has begun."""
        req = urllib.request.Request(
            door.app.url + "/v1/completions", json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(req, timeout=120) as r:
            engine = r.headers["x-kvfold-engine"]
            first = r.read1()
            if engine == "2":
                streaming_from_victim.set()
            return engine, first + r.read()

    with ThreadPoolExecutor(len(bodies)) as pool:
        futures = [pool.submit(stream, b) for b in bodies]
        assert streaming_from_victim.wait(timeout=120)
        os.killpg(victim.pid, signal.SIGKILL)  # type: ignore[arg-type]
        answers = [f.result(timeout=180) for f in futures]  # nothing waits forever
    broken = [data for engine, data in answers if engine == "2"]
    assert broken, "a stream of the killed engine had begun"
    for data in broken:  # the stream ends with an error event that names the engine
        last = [e for e in data.decode().split("\n\n") if e.startswith("data: ")][-1]
        error = json.loads(last.removeprefix("data: "))["error"]
        assert error["type"] == "engine_failed" and "engine rank 2" in error["message"]
    for engine, data in answers:
        if engine != "2":
            assert data.rstrip().endswith(b"data: [DONE]")
    wait_until(lambda: engines(door)[2]["committed_blocks"] == 0, timeout_s=30)
    wait_until(lambda: not engines(door)[2]["live"], timeout_s=30)
    status, headers, _ = door.post(
        "/v1/completions", {"model": "tiny-llama", "prompt": [7] * 40, "max_tokens": 2}
    )
    assert status == 200 and headers["x-kvfold-engine"] in ("0", "1")
    victim.stop()


def test_a_front_door_started_with_an_engine_down_serves_the_others(door: Door) -> None:
    """Engine 2 is down (killed above; stopped here again, which changes nothing if so). A
    front door started now asks each engine for its max_model_len only once the engine is
    live, so it starts on the two that are up, sends requests only there, and keeps engine
    2 out of every promise; one that waited for all three would time out."""
    door.fleet.servers[2].stop()
    with pytest.raises(ValueError, match="engines_live=4"):
        serve_front_door(door.app.settings, engines_live=4)
    app = serve_front_door(
        FrontDoorSettings(
            engine_urls=tuple(door.fleet.urls), model_dir=door.app.settings.model_dir,
            namespace=door.kv.namespace, app_name="kvfold-front-door-late",
            route_prefix="/late", http_port=free_loopback_port(),
        ),
        engines_live=2,
    )  # fmt: skip
    try:
        seen = app.stats()["engines"]
        assert [seen[r]["live"] for r in range(ENGINES)] == [True, True, False]
        assert app.stats()["max_model_len"] == 1024
        for i in range(4):
            body = {"model": "tiny-llama", "prompt": [5 + i] * 40, "max_tokens": 2}
            status, headers, data = post(app.url + "/v1/completions", body)
            assert status == 200, data
            assert headers["x-kvfold-engine"] in ("0", "1")
        wait_until(lambda: all(e["committed_blocks"] == 0 for e in app.stats()["engines"].values()))
    finally:
        app.shutdown()

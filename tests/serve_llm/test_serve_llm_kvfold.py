"""kvfold inside a real Ray Serve LLM application (kvfold.serving.serve_llm): two vLLM replicas
on CPU built by Ray Serve LLM's own `build_openai_app`, with `with_kvfold` added. Runs in the
engine virtualenv, where Ray Serve LLM lives beside vLLM (`make test` builds it and runs this
directory there):
- the replicas are kvfold's engine ranks, fresh in the view, with the engines' own capacity;
- requests through Serve's OpenAI route, one at a time (text and token ids): the engine's own
  `cached_tokens` equals what kvfold's index predicts for the prompt, request by request;
- nothing this starts listens beyond loopback, every socket listed."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.conftest import wait_until

REPO = pathlib.Path(__file__).resolve().parents[2]
MODEL = str(REPO / "examples" / "models" / "small-llama")
EXAMPLE = REPO / "examples" / "serve_llm_kvfold.py"
B = 32  # tokens per block
BLOCKS = 96  # per engine: a burst of long requests overflows it
QUEUE_TIMEOUT_S = 1.0  # in kvfold's queue; then 429
REPLICAS = 2


def _example() -> Any:
    """examples/serve_llm_kvfold.py, the users' example: this directory runs it."""
    spec = importlib.util.spec_from_file_location("serve_llm_kvfold", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return dict(json.loads(r.read()))


@pytest.fixture(scope="module")
def example() -> Any:
    return _example()


@pytest.fixture(scope="module")
def app(example: Any) -> Iterator[Any]:
    with example.serve_llm_with_kvfold(REPLICAS, BLOCKS, QUEUE_TIMEOUT_S) as running:
        yield running


def test_the_example_follows_a_shared_prefix(example: Any, app: Any) -> None:
    cached = example.show(app)
    assert cached[0] == 0 and all(c >= 12 * 8 for c in cached[1:]), cached  # its prefix


def test_the_replicas_are_kvfold_ranks_with_their_engines_capacity(app: Any) -> None:
    view = app.kv.view()
    ranks = [r for node in view.nodes for r in node.ranks]
    assert [r.rank for r in ranks] == list(range(REPLICAS))
    for r in ranks:
        assert r.state.value == "fresh", r
        gauges = r.gpu[None]
        # vLLM's own count (one of its blocks is its null block), read from the replica
        assert gauges.num_blocks_total == BLOCKS - 1 and gauges.tokens_per_block == B
    for url in app.plan.urls:  # each replica's numbers page is on loopback, vLLM's series
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            assert "vllm:cache_config_info{" in r.read().decode()


def _held_everywhere(app: Any, ids: list[int]) -> int:
    index = app.kv.client.index()
    return max(index.match(ids).gpu.get(r, 0) for r in range(REPLICAS))


def test_the_index_predicts_each_requests_cached_tokens_through_serve_llm(app: Any) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    shared = " the rank holds a block of the cache and the node" * 8
    other = " a request waits in the queue for an engine" * 9
    prompts: list[str | list[int]] = [
        shared + " one",
        shared + " two",
        other + " one",
        shared + " three",
        other + " two",
    ]
    prompts.append(tok.encode(shared + " four"))  # token ids, the same prefix
    total = 0
    for i, prompt in enumerate(prompts):
        ids = list(prompt) if isinstance(prompt, list) else tok.encode(prompt)
        predicted = _held_everywhere(app, ids) * B
        answer = post(app.url + "/v1/completions", {"model": "tiny-llama", "prompt": prompt,
                                                    "max_tokens": 4, "temperature": 0})  # fmt: skip
        got = int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert answer["usage"]["prompt_tokens"] == len(ids)
        assert got == predicted, f"request {i}: the engine reused {got}, kvfold said {predicted}"
        total += got
        # its blocks reach the index before the next
        wait_until(lambda ids=ids: _held_everywhere(app, ids) >= len(ids) // B, timeout_s=30)
    assert total >= 3 * (len(tok.encode(shared)) // B) * B  # the shared prefix was followed


def _preemptions(app: Any) -> int:
    from kvfold.engines.vllm_metrics import parse_vllm_metrics

    total = 0
    for url in app.plan.urls:  # each replica's engine's own counter
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            total += int(parse_vllm_metrics(r.read().decode())["0"].num_preemptions or 0)
    return total


def _send(url: str, prompt: list[int], max_tokens: int) -> tuple[int, Any, str]:
    """Its status, its headers (case-insensitive), its body."""
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0}  # fmt: skip
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, r.headers, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read().decode()


def test_a_burst_past_the_engines_kv_never_preempts_and_each_request_ends(app: Any) -> None:
    """Twenty requests at once, each promised 23 of an engine's 95 blocks, each decoding 128
    tokens: the engines hold 4 each. Serve's router asks kvfold for at most 2 per replica at
    a time (the rest wait in Serve's handle queue); those kvfold cannot place within its
    queue deadline (1 s here) are answered 429 with Retry-After through Ray Serve LLM's
    OpenAI ingress. None waits forever, none fails otherwise, and the engines' own
    preemption counters do not move."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    rng = random.Random(11)
    prompts = [[rng.randrange(3, 1000) for _ in range(600)] for _ in range(20)]
    before = _preemptions(app)
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: _send(app.url, p, 128), prompts))
    statuses = sorted(status for status, _, _ in answers)
    assert set(statuses) <= {200, 429}, answers
    assert statuses.count(200) >= 2 * 4, statuses  # what the engines hold, and more
    refused = [(h, text) for status, h, text in answers if status == 429]
    assert refused, statuses  # the engines' KV stayed full past the queue's deadline
    for headers, text in refused:
        assert int(headers.get("Retry-After")) >= 1, dict(headers)
        error = json.loads(text)["error"]
        assert error["code"] == 429 and error["type"] == "kvfold_refused", text
    for status, _, text in answers:
        if status == 200:
            assert json.loads(text)["usage"]["completion_tokens"] == 128
    assert _preemptions(app) == before


def _loopback(ip: str) -> bool:
    import ipaddress

    addr = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(addr, "ipv4_mapped", None)  # ::ffff:127.0.0.1 is 127.0.0.1
    return bool(addr.is_loopback or (mapped is not None and mapped.is_loopback))


def test_nothing_it_starts_listens_beyond_loopback(app: Any) -> None:
    """Every listening socket of every process this test started: Ray's, Serve's (the
    proxy, the controller, Ray Serve LLM's ingress and its replicas, their gRPC servers),
    vLLM's (the replay sockets) and kvfold's (ranks, numbers pages, the door)."""
    import psutil

    wide = []
    for p in psutil.Process(os.getpid()).children(recursive=True):
        try:
            for c in p.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN and not _loopback(c.laddr.ip):
                    wide.append((p.pid, " ".join(p.cmdline())[:80], c.laddr))
        except psutil.Error:
            continue
    assert wide == [], wide


def _replica_pid(app: Any, rank: int) -> int:
    """The Serve replica process of kvfold rank `rank`: the one serving its numbers page."""
    import psutil

    port = app.plan.of(rank).numbers
    for p in psutil.Process(os.getpid()).children(recursive=True):
        try:
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
                   for c in p.net_connections(kind="inet")):  # fmt: skip
                return int(p.pid)
        except psutil.Error:
            continue
    raise AssertionError(f"no process serves rank {rank}'s numbers page on port {port}")


def _requests_served(app: Any, rank: int) -> float:
    """The engine's own count of requests it finished, from its numbers page."""
    with urllib.request.urlopen(app.plan.urls[rank] + "/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith("vllm:request_success_total{"))  # fmt: skip


def _stream(url: str, body: dict[str, Any], begun: list[int]) -> tuple[int, str]:
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            first = r.read1()
            begun.append(1)
            return r.status, (first + r.read()).decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_a_replica_killed_mid_run_ends_its_requests_and_comes_back_a_new_incarnation(
    app: Any,
) -> None:
    """Streams on both replicas, and answers not streamed (each engine holds the three it
    is given, and two more); rank 1's replica process is killed (SIGKILL) once its streams
    have begun. Each request ends: a whole stream, a stream whose last event is
    `engine_failed` naming the failure, or (not streamed: sent again by the ingress) a
    whole answer or a 429. Rank 1's promises are freed, it is dead in the
    view and its blocks leave the index; Serve starts its successor, which takes rank 1 as
    a new incarnation, and kvfold's router sends it requests again."""
    import random
    import signal
    from concurrent.futures import ThreadPoolExecutor

    from kvfold.view import SourceState

    def door() -> dict[Any, Any]:
        return dict(ray_get(app.door.stats.remote())["engines"])

    wait_until(lambda: all(e["committed_blocks"] == 0 for e in door().values()), timeout_s=60)
    old = {r.rank: r.incarnation for node in app.kv.view().nodes for r in node.ranks}
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 1000) for _ in range(200)] for _ in range(6)]
    begun: list[int] = []
    bodies = [{"model": "tiny-llama", "prompt": p, "max_tokens": 360, "ignore_eos": True,
               "temperature": 0, "stream": i < 4} for i, p in enumerate(prompts)]  # fmt: skip
    with ThreadPoolExecutor(len(bodies)) as pool:
        futures = [pool.submit(_stream, app.url, b, begun) for b in bodies]
        wait_until(lambda: door()[1]["committed_blocks"] > 0 and len(begun) >= 2, timeout_s=120)
        on_victim: Any = wait_until(  # in the index: its blocks were computed
            lambda: [p for p in prompts if app.kv.client.index().match(p).gpu.get(1, 0)],
            timeout_s=60, interval_s=0.2,
        )  # fmt: skip
        os.kill(_replica_pid(app, 1), signal.SIGKILL)
        answers = [f.result(timeout=300) for f in futures]  # nothing waits forever
    failed = 0
    for body, (status, text) in zip(bodies, answers, strict=True):
        if body["stream"]:
            assert status == 200, text
            events = [e for e in text.split("\n\n") if e.startswith("data: ")]
            if events[-1] != "data: [DONE]":
                error = json.loads(events[-1].removeprefix("data: "))["error"]
                assert error["type"] == "engine_failed", error
                assert error["message"].startswith("the engine replica serving this request")
                failed += 1
        elif status == 200:  # not streamed: whole (sent again if its replica died)
            assert json.loads(text)["usage"]["completion_tokens"] == 360
        else:  # sent again, it found no room within the queue's deadline
            assert status == 429 and json.loads(text)["error"]["type"] == "kvfold_refused"
    assert failed >= 1, answers  # a stream of the killed replica had begun
    wait_until(lambda: door()[1]["committed_blocks"] == 0, timeout_s=30)  # its promises freed
    view = app.kv.view
    wait_until(lambda: view().rank_states()[1] is not SourceState.FRESH, timeout_s=30)
    index = app.kv.client.index  # rank 1's blocks leave the index
    wait_until(lambda: not any(index().match(p).gpu.get(1, 0) for p in on_victim),
               timeout_s=60)  # fmt: skip

    def successor() -> bool:
        s = view().rank_summary(1)
        return bool(s and s[0].state is SourceState.FRESH and s[0].incarnation != old[1])

    wait_until(successor, timeout_s=300)  # Serve restarts the replica; rank 1 again
    assert view().rank_summary(0)[0].incarnation == old[0]
    wait_until(lambda: door()[1]["live"], timeout_s=60)
    before = _requests_served(app, 1)
    more = [[rng.randrange(3, 1000) for _ in range(200)] for _ in range(4)]
    with ThreadPoolExecutor(len(more)) as pool:
        served = list(pool.map(lambda p: _send(app.url, p, 64), more))
    assert [status for status, _, _ in served] == [200] * len(more), served
    assert _requests_served(app, 1) > before  # the router sends to the new incarnation


def ray_get(ref: Any) -> Any:
    import ray

    return ray.get(ref, timeout=60)

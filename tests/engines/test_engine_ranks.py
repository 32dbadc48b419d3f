"""A real vLLM engine as a kvfold rank, through the running system: an EngineRankActor
reads the engine's KV events and /metrics; the cluster block index and the view are
held against the engine's own word, never kvfold's belief:

- before each request, the prefix kvfold's index predicts for the engine equals the
  `cached_tokens` the engine then reports for it (eviction included: a 48-block cache);
- the index equals what the engine rank holds, after every request;
- the view's total and used blocks, running and waiting, are the engine's /metrics;
  what vLLM does not publish is unknown;
- a lost batch is filled from the engine's replay; `reset_prefix_cache` empties the
  index; a killed engine is stale, then dead, and leaves the index; a restarted one is a
  new incarnation holding only what it stores.

Order matters: one engine, one cluster, growing damage.
"""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
import pytest
import zmq

from kvfold.cluster import launch, start_local_cluster
from kvfold.engines.endpoints import EngineEndpoints
from kvfold.engines.vllm_metrics import parse_vllm_metrics
from kvfold.engines.vllm_server import VLLMServer, VLLMServerSettings, free_loopback_port
from kvfold.errors import RankUnavailable
from kvfold.view import SourceState
from kvfold.worker.hashing import block_keys
from tests.integration.conftest import wait_until

pytestmark = pytest.mark.engines

B = 32
BLOCKS = 48


@dataclass
class Fleet:
    settings: VLLMServerSettings
    server: VLLMServer
    kv: Any
    cluster: Any = None

    def start_engine(self) -> None:
        self.server = VLLMServer(self.settings)
        self.server.start()
        self.server.wait_ready(240)


@pytest.fixture(scope="module")
def fleet(engine_python: str, tiny_llama_dir: str) -> Iterator[Fleet]:
    events = f"tcp://127.0.0.1:{free_loopback_port()}"
    replay = f"tcp://127.0.0.1:{free_loopback_port()}"
    settings = VLLMServerSettings(
        python=engine_python,
        model_dir=tiny_llama_dir,
        block_size=B,
        num_gpu_blocks=BLOCKS,
        port=free_loopback_port(),
        events_endpoint=events,
        replay_endpoint=replay,
        topic="kv-events",
    )
    f = Fleet(settings, VLLMServer(settings), None)
    f.server.start()
    cluster = f.cluster = start_local_cluster(num_nodes=1, gpus_per_node=1)
    try:
        f.server.wait_ready(240)
        endpoints = EngineEndpoints(
            events=events,
            replay=replay,
            metrics=f.server.base_url + "/metrics",
            topic="kv-events",
        )
        f.kv = launch(1, 1, engines=[endpoints], dead_after_s=2.0, placement_timeout_s=60)
        yield f
    finally:
        if f.kv is not None:
            f.kv.shutdown()  # idempotent: the CLI test may have stopped it
        f.server.stop()
        cluster.shutdown()


def bindable(endpoint: str) -> bool:
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as zmq binds
        try:
            probe.bind((host, int(port)))
        except OSError:
            return False
    return True


def held(f: Fleet) -> set[bytes]:
    """What the engine rank holds (from the engine's events)."""
    return set().union(*f.kv.client.held_keys(0).values())


def indexed(f: Fleet) -> set[bytes]:
    """What the cluster block index holds for the engine."""
    return set().union(*f.kv.client.indexed_keys("rank", 0).values())


def settled(f: Fleet, *prompts: list[int]) -> bool:
    """The engine's events for `prompts` are in: every full block of each is held, and
    the index equals what the engine rank holds."""
    try:
        f.kv.rank(0).call("report_now")
        live = held(f)
    except RankUnavailable:
        return False
    want = {k for p in prompts for k in block_keys(p, B)[: len(p) // B]}
    return want <= live and indexed(f) == live


def cached_tokens(response: dict[str, Any]) -> int:
    return int(response["usage"]["prompt_tokens_details"]["cached_tokens"])


def workload(seed: int) -> list[list[int]]:
    """Three 192-token prefixes (6 blocks each), three users each (276 tokens), then
    repeats and longer users (327 tokens) that overflow the 47 usable blocks."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 1024) for _ in range(192)] for _ in range(3)]
    users = [p + [rng.randrange(1, 1024) for _ in range(84)] for p in prefixes for _ in range(3)]
    longer = [p + [rng.randrange(1, 1024) for _ in range(135)] for p in prefixes for _ in range(3)]
    return [*users, users[0], users[4], *longer, users[8]]


def test_the_index_predicts_what_the_engine_reuses(fleet: Fleet) -> None:
    f = fleet
    hits_before = parse_vllm_metrics(f.server.metrics_text())["0"].prefix_cache_hits_tokens
    index = f.kv.client.index()
    served = 0
    for i, prompt in enumerate(workload(1)):
        predicted = index.match(prompt).gpu.get(0, 0) * B
        got = cached_tokens(f.server.complete(prompt, max_tokens=4))
        assert got == predicted, f"request {i}: the engine reused {got}, kvfold said {predicted}"
        served += got
        wait_until(lambda: settled(f, prompt), timeout_s=30)
        index.refresh()
    hits = parse_vllm_metrics(f.server.metrics_text())["0"].prefix_cache_hits_tokens
    assert hits is not None and hits_before is not None
    assert hits - hits_before == served > 0  # the engine's own counter
    info = f.kv.rank(0).info()
    assert info["counts"].get("removed_unknown", 0) == 0 and info["refused"] == {}
    assert info["counts"].get("applied", 0) > 0 and info["blocks_unkeyed"] == 0
    assert len(held(f)) <= BLOCKS - 1  # vLLM keeps one null block; eviction happened:
    assert sum(len(p) // B for p in workload(1)) > BLOCKS


def test_the_view_is_what_the_engine_publishes(fleet: Fleet) -> None:
    f = fleet
    m = parse_vllm_metrics(f.server.metrics_text())["0"]
    view = f.kv.view()
    rank = view.nodes[0].ranks[0]
    assert rank.state is SourceState.FRESH
    assert rank.gpu is not None
    g = rank.gpu[None]
    assert (g.num_blocks_total, g.tokens_per_block) == (m.num_gpu_blocks - 1, m.block_size)
    assert g.num_blocks_used == m.num_blocks_used == 0  # idle: nothing running holds blocks
    assert rank.num_valid_sequences == m.num_requests_running == 0
    assert rank.unknown == {"cached", "committed", "deltas"}
    assert view.unknown == {"cached": (0,), "committed": (0,), "deltas": (0,)}


def test_a_lost_batch_is_filled_from_the_engines_replay(fleet: Fleet) -> None:
    f = fleet
    rng = random.Random(7)
    first, second = ([rng.randrange(1, 1024) for _ in range(100)] for _ in range(2))
    before = f.kv.rank(0).info()["counts"]
    f.kv.rank(0).call("lose_next_batches", 1)
    f.server.complete(first, max_tokens=2)  # its BlockStored is lost in transit
    f.server.complete(second, max_tokens=2)  # the next batch shows the gap
    wait_until(lambda: settled(f, first, second), timeout_s=30)
    after = f.kv.rank(0).info()["counts"]
    assert after.get("gaps", 0) == before.get("gaps", 0) + 1
    assert after.get("replayed", 0) > before.get("replayed", 0)
    assert after.get("out_of_sync", 0) == before.get("out_of_sync", 0)


def test_reset_prefix_cache_empties_the_index(fleet: Fleet) -> None:
    f = fleet
    assert indexed(f)
    f.server.reset_prefix_cache()
    f.server.complete([1, 2, 3, 4, 5], max_tokens=1)  # the reset is published on a step
    wait_until(lambda: not held(f) and not indexed(f), timeout_s=30)


def test_a_hostile_publisher_is_refused_counted_and_changes_nothing(fleet: Fleet) -> None:
    """A second publisher on the engine rank's events endpoint floods it with garbage:
    each message is refused and counted by reason; the index, the engine's stream and
    the rank stay as they were."""
    f = fleet
    prompt = [random.Random(8).randrange(1, 1024) for _ in range(100)]
    f.server.complete(prompt, max_tokens=2)
    wait_until(lambda: settled(f, prompt), timeout_s=30)
    before = indexed(f)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.SNDHWM, 0)  # queue everything: none may be dropped on our side
    pub.connect(str(f.settings.events_endpoint))
    garbage = [
        [b"kv-events", b"\0" * 8, b"\xc1not msgpack"],  # bad_msgpack
        [b"kv-events", b"\0" * 3, b"\x90"],  # bad_frame
        [b"kv-events", (2**40).to_bytes(8, "big"),
         msgpack.packb([0.0, [{"type": "BlockExploded"}], 0])],  # unknown_event
    ]  # fmt: skip

    def refused(*reasons: str) -> int:
        counts = f.kv.rank(0).info()["refused"]
        return sum(counts.get(r, 0) for r in reasons)

    try:
        start = refused("bad_msgpack")

        def joined() -> bool:  # a PUB drops what it sends before the subscription arrives
            pub.send_multipart(garbage[0])
            return refused("bad_msgpack") > start

        wait_until(joined, timeout_s=30, interval_s=0.1)
        # the flood: kinds the join did not send, so what was in flight then cannot count
        before_flood = (refused("bad_frame"), refused("unknown_event"))
        flood = 3000
        for i in range(flood):
            pub.send_multipart(garbage[1 + i % 2])
        wait_until(
            lambda: (
                (refused("bad_frame"), refused("unknown_event"))
                == (before_flood[0] + flood // 2, before_flood[1] + flood // 2)
            ),
            timeout_s=60,
        )
    finally:
        pub.close()
        ctx.term()
    info = f.kv.rank(0).info()
    assert {"bad_msgpack", "bad_frame", "unknown_event"} <= set(info["refused"])
    assert indexed(f) == before == held(f)
    other = [random.Random(12).randrange(1, 1024) for _ in range(100)]
    predicted = f.kv.client.index().match(other).gpu.get(0, 0) * B
    assert cached_tokens(f.server.complete(other, max_tokens=2)) == predicted
    wait_until(lambda: settled(f, other), timeout_s=30)  # the engine's stream goes on


def test_a_killed_engine_is_dead_and_a_restarted_one_a_new_incarnation(fleet: Fleet) -> None:
    f = fleet
    prompt = [random.Random(9).randrange(1, 1024) for _ in range(130)]
    f.server.complete(prompt, max_tokens=2)
    wait_until(lambda: settled(f, prompt), timeout_s=30)
    old = f.kv.view().nodes[0].ranks[0].incarnation
    f.server.stop()  # the engine goes away: stale, then dead, never capacity
    states: set[SourceState] = set()

    def dead() -> bool:
        state = f.kv.view().rank_states()[0]
        states.add(state)
        return state is SourceState.DEAD

    wait_until(dead, timeout_s=30)
    assert f.kv.view().gpu_total.num_blocks_total == 0  # its blocks count nowhere
    wait_until(lambda: not indexed(f), timeout_s=30)  # nor in the index
    f.start_engine()  # the same endpoints: a new process
    other = [random.Random(10).randrange(1, 1024) for _ in range(100)]
    f.server.complete(other, max_tokens=2)

    def back() -> bool:
        s = f.kv.view().rank_summary(0)
        return bool(s and s[0].state is SourceState.FRESH and s[0].incarnation != old)

    wait_until(back, timeout_s=60)
    wait_until(lambda: settled(f, other), timeout_s=30)
    assert indexed(f) == set(block_keys(other, B)[: len(other) // B])  # only the new life's


def test_kvfold_up_reads_the_engine_from_the_command_line(fleet: Fleet) -> None:
    """`kvfold up --engine vllm ...` in another process, on the same engine; `kvfold
    status --json` shows the engine's numbers and what it does not publish."""
    f = fleet
    f.kv.shutdown()  # frees the events endpoint for the new deployment
    s = f.settings
    wait_until(lambda: bindable(str(s.events_endpoint)), timeout_s=30)  # kills are async
    cli = [sys.executable, "-m", "kvfold.cli"]
    where = ["--address", f.cluster.address, "--namespace", "kv-engine-up"]
    engine = [
        "--engine", "vllm",
        "--engine-events", str(s.events_endpoint),
        "--engine-replay", str(s.replay_endpoint),
        "--engine-metrics", f.server.base_url + "/metrics",
        "--engine-topic", s.topic,
        "--gpus-per-node", "1",
    ]  # fmt: skip
    up = subprocess.run([*cli, "up", *where, *engine], capture_output=True, text=True, timeout=300)
    try:
        assert up.returncode == 0, up.stderr[-2000:]
        assert "unknown: cached (ranks [0])" in up.stdout
        prompt = [random.Random(11).randrange(1, 1024) for _ in range(100)]
        f.server.complete(prompt, max_tokens=2)

        def status() -> dict[str, Any]:
            out = subprocess.run(
                [*cli, "status", "--json", *where], capture_output=True, text=True, timeout=120
            )
            assert out.returncode == 0, out.stderr[-2000:]
            return json.loads(out.stdout)  # type: ignore[no-any-return]

        view = status()
        assert view["unknown"] == {"cached": [0], "committed": [0], "deltas": [0]}
        assert view["totals"]["gpu"]["num_blocks_total"] == BLOCKS - 1  # less the null block
    finally:
        down = subprocess.run([*cli, "down", *where], capture_output=True, text=True, timeout=120)
        assert down.returncode == 0, down.stderr[-2000:]

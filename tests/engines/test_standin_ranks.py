"""SGLang and TensorRT-LLM as kvfold ranks, through the running system, against stand-in
processes that speak their wire (tests/engines/standins; neither engine runs on these
machines): rank 0 reads an SGLang publisher (its PUB connects to the rank's SUB, its
ROUTER answers replays, its /metrics counts tokens), rank 1 a trtllm-serve
(/kv_cache_events polled, /metrics its iteration stats). Held against the fixtures'
ground truth, never kvfold's belief:

- the cluster block index and each rank's held keys are the engine's GPU pool, as
  kvfold's content keys (SGLang's batch 3 skipped live: filled from its replay);
- the view's blocks, tokens per block, running and waiting are the stand-ins' pages;
  what each kind cannot give is unknown (TensorRT-LLM's counters are known: they show);
- stand-ins killed: their ranks go stale, then dead, and leave the index;
- a trtllm-serve back on the same port whose event buffer dropped a page: a new
  incarnation, out of sync, crediting only what came after the gap.

Order matters: one cluster, growing damage.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvfold.cluster import launch, start_local_cluster
from kvfold.engines.endpoints import EngineEndpoints
from kvfold.engines.vllm_settings import free_loopback_port
from kvfold.errors import RankUnavailable
from kvfold.stats import BlockDeltas, SequenceStatus
from kvfold.view import SourceState
from kvfold.worker.hashing import block_keys
from tests.engines.standins.process import StandInProcess
from tests.integration.conftest import wait_until

pytestmark = pytest.mark.integration

TESTS = Path(__file__).resolve().parents[1]
STANDINS = TESTS / "engines" / "standins"
SGL = TESTS / "fixtures" / "sglang-kv-events"
TRT = TESTS / "fixtures" / "trtllm-kv-events"
SGL_TRUTH = json.loads((SGL / "ground_truth.json").read_text())
TRT_TRUTH = json.loads((TRT / "ground_truth.json").read_text())
SGL_LAST = SGL_TRUTH["map"]["last_seq"]  # batches 0..7 sent (8 is the flush)
SKIPPED = 3  # never sent live: the rank must ask the replay for it


def sglang_keys() -> dict[int, set[bytes]]:
    """After batch 7 the GPU holds A's 4 pages and B's 2 of its own (pages of 4 tokens)."""
    prompts, page = SGL_TRUTH["prompts"], SGL_TRUTH["page_size"]
    return {0: {k for p in SGL_TRUTH["map"]["gpu_prompts"] for k in block_keys(prompts[p], page)}}


def trtllm_keys(blocks_by_window: dict[str, dict[str, int]]) -> dict[int, set[bytes]]:
    """Per window group (the full window, 4096, is group 0; the 128 window group 1)."""
    b, prompts = TRT_TRUTH["tokens_per_block"], TRT_TRUTH["prompts"]
    windows = TRT_TRUTH["window_sizes"]
    out: dict[int, set[bytes]] = {}
    for group, window in ((0, windows["full"]), (1, windows["sliding"])):
        blocks = blocks_by_window.get(str(window), {})
        keys = {k for p, n in blocks.items() for k in block_keys(prompts[p], b)[:n]}
        if keys:
            out[group] = keys
    return out


def standin(script: str, *args: str) -> StandInProcess:
    return StandInProcess(script, "--deadline-s", "300", *args)


def trtllm_standin(port: int, *args: str) -> StandInProcess:
    s = standin(
        "trtllm_server.py", "--events", str(TRT / "kv_cache_events.jsonl"),
        "--metrics", str(TRT / "metrics.json"), "--port", str(port), "--drain-metrics", *args,
    )  # fmt: skip
    assert s.line().split() == ["PORT", str(port)]
    return s


@dataclass
class Fleet:
    kv: Any
    sglang: StandInProcess
    trtllm: StandInProcess
    trtllm_port: int

    def held(self, rank: int) -> dict[int, set[bytes]]:
        return {g: set(ks) for g, ks in self.kv.client.held_keys(rank).items()}

    def indexed(self, rank: int) -> dict[int, set[bytes]]:
        return {g: set(ks) for g, ks in self.kv.client.indexed_keys("rank", rank).items()}

    def settled(self, rank: int, want: dict[int, set[bytes]]) -> bool:
        """The rank holds `want`, and the cluster index holds the same for it."""
        try:
            self.kv.rank(rank).call("report_now")
            return self.held(rank) == want == self.indexed(rank)
        except RankUnavailable:
            return False


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    events = f"tcp://127.0.0.1:{free_loopback_port()}"  # the SGLang rank binds its SUB here
    sglang = standin(
        "sglang_publisher.py", "--connect", events, "--frames", str(SGL / "map-live.msgpack"),
        "--count", str(SGL_LAST + 1), "--skip", str(SKIPPED), "--metrics", str(SGL / "metrics.txt"),
    )  # fmt: skip
    f: Fleet | None = None
    cluster = None
    try:
        replay, metrics = sglang.line().split()[1], sglang.line().split()[1]
        port = free_loopback_port()
        f = Fleet(None, sglang, trtllm_standin(port), port)
        engines = [
            EngineEndpoints(events=events, replay=replay, metrics=metrics, kind="sglang"),
            EngineEndpoints(
                events=f"http://127.0.0.1:{port}",
                metrics=f"http://127.0.0.1:{port}/metrics",
                kind="trtllm",
            ),
        ]
        cluster = start_local_cluster(num_nodes=1, gpus_per_node=2)
        f.kv = launch(2, 2, engines=engines, dead_after_s=2.0, placement_timeout_s=60)
        yield f
    finally:
        if f is not None and f.kv is not None:
            f.kv.shutdown()
        sglang.kill()
        if f is not None:
            f.trtllm.kill()  # the one running now (the gap test starts another)
        if cluster is not None:
            cluster.shutdown()


def test_the_index_holds_what_each_engine_holds(fleet: Fleet) -> None:
    f = fleet
    # the SGLang stand-in says hello until told to go: a hello reaching the rank (refused,
    # it is no batch) says its PUB is connected, so nothing published after is lost
    wait_until(lambda: f.kv.rank(0).info()["refused"].get("bad_frame", 0) > 0, timeout_s=30)
    f.sglang.say("go")
    wait_until(lambda: f.settled(0, sglang_keys()), timeout_s=30)
    wait_until(lambda: f.settled(1, trtllm_keys(TRT_TRUTH["after_page_7"]["gpu_blocks"])), 30)
    sgl = f.kv.rank(0).info()
    assert sgl["kind"] == "sglang" and set(sgl["refused"]) == {"bad_frame"}  # hellos only
    counts = sgl["counts"]
    assert counts["gaps"] == 1 and counts["replayed"] >= 1  # batch 3, from the replay
    assert counts.get("out_of_sync", 0) == 0 and counts.get("restarts", 0) == 0
    assert counts["applied"] == SGL_LAST + 1 and sgl["blocks_unkeyed"] == 0
    trt = f.kv.rank(1).info()
    assert trt["kind"] == "trtllm" and trt["refused"] == {} and trt["events_error"] is None
    assert trt["counts"]["applied"] == TRT_TRUTH["after_page_7"]["last_event_id"] + 1


def test_the_view_is_what_the_engines_publish(fleet: Fleet) -> None:
    view = fleet.kv.view()
    sgl, trt = view.nodes[0].ranks
    assert sgl.state is SourceState.FRESH and trt.state is SourceState.FRESH
    assert sgl.gpu is not None and trt.gpu is not None
    g = sgl.gpu[None]  # metrics.txt: 1280 tokens, 26 used, pages of 4
    assert (g.num_blocks_total, g.num_blocks_used, g.tokens_per_block) == (1280 // 4, 26 // 4, 4)
    g = trt.gpu[None]  # metrics.json, iteration 42: maxNumBlocks, usedNumBlocks
    assert (g.num_blocks_total, g.num_blocks_used, g.tokens_per_block) == (320, 8, 4)
    assert sgl.num_valid_sequences == 2 and trt.num_valid_sequences == 2  # running
    assert view.num_sequences_by_status[SequenceStatus.QUEUEING] == 1 + 1  # waiting
    assert sgl.unknown == {"cached", "committed", "deltas"}
    assert trt.unknown == {"cached", "committed"}
    assert view.unknown == {"cached": (0, 1), "committed": (0, 1), "deltas": (0,)}
    # TensorRT-LLM's counters grew from iteration 41 to 42 while kvfold read them (its
    # later answers are empty: trtllm-serve drains its stats queue)
    assert view.counters.total == BlockDeltas(
        alloc_total_blocks=22 - 20, alloc_new_blocks=15 - 14, reused_blocks=7 - 6,
        missed_blocks=15 - 14,
    )  # fmt: skip


def test_killed_engines_go_stale_then_dead_and_leave_the_index(fleet: Fleet) -> None:
    f = fleet
    assert f.indexed(0) and f.indexed(1)
    f.sglang.kill()
    f.trtllm.kill()
    seen: dict[int, set[SourceState]] = {0: set(), 1: set()}

    def dead() -> bool:
        states = f.kv.view().rank_states()
        for r in seen:
            seen[r].add(states[r])
        return states[0] is states[1] is SourceState.DEAD

    wait_until(dead, timeout_s=30)
    assert all(SourceState.STALE in s for s in seen.values()), seen
    assert f.kv.view().gpu_total.num_blocks_total == 0  # their blocks count nowhere
    wait_until(lambda: not f.indexed(0) and not f.indexed(1), timeout_s=30)  # nor index


def test_an_event_id_gap_leaves_no_false_credit(fleet: Fleet) -> None:
    """trtllm-serve is back on the same port, its ids from 0 again, and its event buffer
    overflowed: page 6 (C's last block evicted, event 13) never reaches kvfold. A new
    incarnation; the gap cannot be replayed, so only what came after it is credited."""
    f = fleet
    old = f.kv.view().nodes[0].ranks[1].incarnation
    f.trtllm = trtllm_standin(f.trtllm_port, "--drop-page", "6")

    def back() -> bool:
        s = f.kv.view().rank_summary(1)
        return bool(s and s[0].state is SourceState.FRESH and s[0].incarnation != old)

    wait_until(back, timeout_s=30)
    d_only = trtllm_keys({str(TRT_TRUTH["window_sizes"]["full"]): {"D": 2}})
    wait_until(lambda: f.settled(1, d_only), timeout_s=30)
    info = f.kv.rank(1).info()
    assert info["out_of_sync_since_s"] is not None and info["counts"]["out_of_sync"] == 1
    c_last = block_keys(TRT_TRUTH["prompts"]["C"], TRT_TRUTH["tokens_per_block"])[1]
    assert all(c_last not in keys for keys in f.indexed(1).values())  # never credited
    assert f.kv.view().rank_states()[0] is SourceState.DEAD  # SGLang's stays gone

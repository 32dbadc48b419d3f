"""Each kind of engine's numbers page read as kvfold's rank numbers (blocks, tokens per
block, requests, per-interval counters), what each cannot give, the endpoints each is
read at, and `kvfold up --engine ...`'s flags. Pages from tests/fixtures (their READMEs
say where their shapes come from)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvfold.cli_args import engine_args, engine_endpoints
from kvfold.engines.endpoints import ENGINE_KINDS, ZMQ_KINDS, EngineEndpoints
from kvfold.engines.engine_intake import EngineIntake
from kvfold.engines.engine_numbers import EngineNumbers, trtllm_numbers
from kvfold.engines.kinds import KINDS, engine_kind
from kvfold.engines.trtllm_stats import parse_trtllm_iterations
from kvfold.engines.vllm_metrics import MetricsError
from kvfold.stats import UNKNOWABLE, BlockDeltas
from kvfold.worker.hashing import block_keys

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
VLLM_PAGE = (FIXTURES / "vllm-cpu-real" / "metrics_after.txt").read_text()
SGLANG_PAGE = (FIXTURES / "sglang-kv-events" / "metrics.txt").read_text()
TRTLLM_PAGE = (FIXTURES / "trtllm-kv-events" / "metrics.json").read_text()
TRTLLM_EVENTS = (FIXTURES / "trtllm-kv-events" / "kv_cache_events.jsonl").read_text().splitlines()

VLLM = EngineEndpoints(events="tcp://127.0.0.1:5557", metrics="http://127.0.0.1:8000/metrics")
SGLANG = EngineEndpoints(
    events="tcp://127.0.0.1:5557", metrics="http://127.0.0.1:30000/metrics", kind="sglang"
)
TRTLLM = EngineEndpoints(
    events="http://127.0.0.1:8000", metrics="http://127.0.0.1:8000/metrics", kind="trtllm"
)


def numbers(
    endpoints: EngineEndpoints, page: str, previous: EngineNumbers | None = None
) -> EngineNumbers:
    return engine_kind(endpoints.kind).read_numbers(page, endpoints, previous)


def test_every_kind_is_read_and_only_those() -> None:
    assert tuple(KINDS) == ENGINE_KINDS == ("vllm", "sglang", "trtllm")
    assert {k.name for k in KINDS.values() if k.zmq} == set(ZMQ_KINDS) == {"vllm", "sglang"}
    assert KINDS["trtllm"].take_live is None and KINDS["trtllm"].take_replay is None
    with pytest.raises(ValueError, match="kind must be one of"):
        engine_kind("tgi")


# ---------------------------------------------------------------- numbers, per kind


def test_vllm_numbers_are_what_the_rank_reported_before_kinds() -> None:
    n = numbers(VLLM, VLLM_PAGE)
    assert (n.num_blocks_total, n.tokens_per_block) == (
        47,
        32,
    )  # 48 in cache_config_info, less vLLM's null block
    assert n.num_blocks_used == 0  # usage 0.0 x 48
    assert (n.num_requests_running, n.num_requests_waiting) == (0, 0)
    assert n.num_blocks_cached is None and n.deltas is None
    assert n.unknown == frozenset(UNKNOWABLE)  # cached, committed, deltas
    assert n.process_start_time_s == pytest.approx(1.79612464236e09)


def test_sglang_counts_tokens_kvfold_counts_whole_pages() -> None:
    n = numbers(SGLANG, SGLANG_PAGE)
    assert n.tokens_per_block == 4  # sglang:page_size
    assert n.num_blocks_total == 1280 // 4 == 320
    assert n.num_blocks_used == 26 // 4 == 6  # a part-filled page is not counted
    assert (n.num_requests_running, n.num_requests_waiting) == (2, 1)
    assert n.unknown == {"cached", "committed", "deltas"}


def test_sglang_without_a_page_size_on_its_page_needs_the_users() -> None:
    page = "\n".join(line for line in SGLANG_PAGE.splitlines() if "page_size" not in line)
    with pytest.raises(MetricsError, match="no sglang:page_size"):
        numbers(SGLANG, page)
    told = EngineEndpoints(
        events=SGLANG.events, metrics=SGLANG.metrics, kind="sglang", tokens_per_block=4
    )
    assert numbers(told, page) == numbers(SGLANG, SGLANG_PAGE)
    wrong = EngineEndpoints(
        events=SGLANG.events, metrics=SGLANG.metrics, kind="sglang", tokens_per_block=16
    )
    with pytest.raises(MetricsError, match=r"sglang:page_size = 4 .* tokens_per_block = 16"):
        numbers(wrong, SGLANG_PAGE)


def test_sglang_picks_its_data_parallel_rank_on_a_shared_page() -> None:
    second = SGLANG_PAGE.replace('dp_rank="0"', 'dp_rank="1"').replace("1280.0", "640.0")
    page = SGLANG_PAGE + "\n".join(line for line in second.splitlines() if not line.startswith("#"))
    rank1 = EngineEndpoints(events=SGLANG.events, metrics=SGLANG.metrics, kind="sglang", engine="1")
    assert numbers(rank1, page).num_blocks_total == 640 // 4 == 160
    assert numbers(SGLANG, page).num_blocks_total == 320
    nobody = EngineEndpoints(
        events=SGLANG.events, metrics=SGLANG.metrics, kind="sglang", engine="7"
    )
    with pytest.raises(MetricsError, match="no dp_rank '7'"):
        numbers(nobody, page)


def test_trtllm_gives_blocks_exactly_and_its_counters_per_interval() -> None:
    """metrics.json holds iterations 41 and 42: the first page's baseline is its oldest,
    so kvfold counts what grew while it read (never what came before)."""
    n = numbers(TRTLLM, TRTLLM_PAGE)
    assert (n.num_blocks_total, n.num_blocks_used, n.tokens_per_block) == (320, 8, 4)
    assert (n.num_requests_running, n.num_requests_waiting) == (2, 1)  # iteration 42
    assert n.deltas == BlockDeltas(
        alloc_total_blocks=22 - 20, alloc_new_blocks=15 - 14, reused_blocks=7 - 6,
        missed_blocks=15 - 14,
    )  # fmt: skip
    assert n.counters == BlockDeltas(22, 15, 7, 0, 0, 15)
    assert n.unknown == {"cached", "committed"}  # its deltas are known


def test_trtllm_counters_grow_from_the_previous_page_and_restart_from_zero() -> None:
    first = numbers(TRTLLM, TRTLLM_PAGE)
    idle = numbers(TRTLLM, "[]", first)  # no iteration since: the numbers stand, 0 counted
    assert (idle.num_blocks_total, idle.num_blocks_used) == (320, 8)
    assert idle.deltas == BlockDeltas() and idle.counters == first.counters
    items = json.loads(TRTLLM_PAGE)
    later = dict(items[-1], iter=50)
    later["kvCacheStats"] = dict(later["kvCacheStats"], allocTotalBlocks=30, reusedBlocks=12,
                                 missedBlocks=18, allocNewBlocks=17)  # fmt: skip
    grown = numbers(TRTLLM, json.dumps([later]), idle)
    assert grown.deltas == BlockDeltas(30 - 22, 17 - 15, 12 - 7, 0, 0, 18 - 15)
    restarted = dict(later, iter=3)
    restarted["kvCacheStats"] = dict(later["kvCacheStats"], allocTotalBlocks=5, reusedBlocks=1,
                                     missedBlocks=4, allocNewBlocks=4)  # fmt: skip
    after = numbers(TRTLLM, json.dumps([restarted]), grown)  # a counter went down
    assert after.deltas == BlockDeltas(5, 4, 1, 0, 0, 4)  # all of the new process's


def test_trtllm_before_any_iteration_and_with_a_wrong_block_size() -> None:
    n = trtllm_numbers([], None, None)  # an engine that has run nothing since kvfold came
    assert (n.num_blocks_total, n.tokens_per_block, n.deltas) == (0, 0, BlockDeltas())
    told = EngineEndpoints(
        events=TRTLLM.events, metrics=TRTLLM.metrics, kind="trtllm", tokens_per_block=32
    )
    with pytest.raises(MetricsError, match="tokensPerBlock = 4"):
        numbers(told, TRTLLM_PAGE)
    no_stats = json.dumps([{"iter": 1, "numActiveRequests": 1, "numQueuedRequests": 0}])
    n = trtllm_numbers(parse_trtllm_iterations(no_stats), None, 8)
    assert n.tokens_per_block == 8 and n.deltas is None and "deltas" in n.unknown


# ---------------------------------------------------------------- endpoints


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"kind": "trtllm", "events": "tcp://127.0.0.1:5557"}, "events must be TensorRT-LLM"),
        ({"kind": "trtllm", "replay": "tcp://127.0.0.1:5558"}, "replay must be None"),
        ({"kind": "trtllm", "topic": "kv"}, "topic must be ''"),
        ({"kind": "trtllm", "engine": "dp0"}, "attention_dp_rank in digits"),
        ({"kind": "sglang", "events": "http://127.0.0.1:8000"}, "tcp://127.0.0.1:PORT"),
        ({"kind": "sglang", "events": "tcp://0.0.0.0:5557"}, "loopback"),
        ({"kind": "sglang", "tokens_per_block": 0}, "tokens_per_block must be an int >= 1"),
        ({"kind": "sglang", "tokens_per_block": True}, "tokens_per_block must be an int"),
        ({"kind": "vllm", "tokens_per_block": 16}, "None for kind 'vllm'"),
        ({"kind": "trtllm", "metrics": "ftp://x/metrics"}, "metrics must be an http"),
        ({"kind": "tgi"}, "kind must be one of"),
    ],
)
def test_endpoints_each_kind_refuses(fields: dict[str, object], match: str) -> None:
    kind = fields.get("kind")
    base: dict[str, object] = {
        "events": "http://127.0.0.1:8000" if kind == "trtllm" else "tcp://127.0.0.1:5557",
        "metrics": "http://127.0.0.1:8000/metrics",
    }
    with pytest.raises(ValueError, match=match):
        EngineEndpoints(**(base | fields))  # type: ignore[arg-type]


def test_trtllm_endpoints_take_any_http_host() -> None:
    e = EngineEndpoints(events="https://engine-3:8000/", metrics="https://engine-3:8000/metrics",
                        kind="trtllm", engine="1", tokens_per_block=32)  # fmt: skip
    assert e.replay is None and e.topic == ""


# ---------------------------------------------------------------- TensorRT-LLM's intake


def test_trtllm_pages_wait_in_the_engine_until_kvfold_knows_its_block_size() -> None:
    intake = EngineIntake(KINDS["trtllm"], TRTLLM)
    assert not intake.can_take_pages
    assert intake.take_page(TRTLLM_EVENTS[0], 0.0) is False  # not read: left to the engine
    intake.set_tokens_per_block(4)  # from its first iteration stats
    for page in TRTLLM_EVENTS:
        assert intake.take_page(page, 1.0)
    held = intake.source.held()
    # after page 7 the full window holds A's 4 blocks, B's own 2, C's first and D's 2
    prompts = json.loads((FIXTURES / "trtllm-kv-events" / "ground_truth.json").read_text())[
        "prompts"
    ]
    want = set(block_keys(prompts["A"], 4)) | set(block_keys(prompts["B"], 4))
    want |= set(block_keys(prompts["C"], 4)[:1]) | set(block_keys(prompts["D"], 4))
    assert set(held[0]) == want and len(want) == 4 + 2 + 1 + 2
    assert intake.drain() and intake.drain() == []


def test_trtllm_a_lost_page_is_a_gap_without_false_credit() -> None:
    told = EngineEndpoints(
        events=TRTLLM.events, metrics=TRTLLM.metrics, kind="trtllm", tokens_per_block=4
    )
    intake = EngineIntake(KINDS["trtllm"], told)
    assert intake.can_take_pages  # the user said the block size
    for page in TRTLLM_EVENTS[:6]:
        intake.take_page(page, 1.0)
    intake.lose_next(1)
    assert intake.take_page("[]", 2.0)  # an empty answer is no message to lose
    for page in TRTLLM_EVENTS[6:]:
        intake.take_page(page, 3.0)  # page 6 lost: event 13 never seen
    assert intake.source.out_of_sync_since_s == 3.0
    prompts = json.loads((FIXTURES / "trtllm-kv-events" / "ground_truth.json").read_text())[
        "prompts"
    ]
    assert set(intake.source.held()[0]) == set(block_keys(prompts["D"], 4))
    with pytest.raises(TypeError, match="takes pages"):
        intake.take_live([b"", b"", b""], 0.0)


# ---------------------------------------------------------------- kvfold up --engine ...


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    engine_args(p)
    return p.parse_args(list(argv))


def test_kvfold_up_flags_for_each_kind() -> None:
    sglang = engine_endpoints(parse(
        "--engine", "sglang", "--engine-events", "tcp://127.0.0.1:5557",
        "--engine-replay", "tcp://127.0.0.1:5558",
        "--engine-metrics", "http://127.0.0.1:30000/metrics", "--engine-page-size", "16",
    ))  # fmt: skip
    assert sglang == [
        EngineEndpoints(
            events="tcp://127.0.0.1:5557", metrics="http://127.0.0.1:30000/metrics",
            replay="tcp://127.0.0.1:5558", kind="sglang", tokens_per_block=16,
        )
    ]  # fmt: skip
    trtllm = engine_endpoints(parse(
        "--engine", "trtllm",
        "--engine-events", "http://127.0.0.1:8000", "--engine-metrics", "http://127.0.0.1:8000/metrics",
        "--engine-events", "http://127.0.0.1:8001", "--engine-metrics", "http://127.0.0.1:8001/metrics",
    ))  # fmt: skip
    assert trtllm is not None and [e.events for e in trtllm] == [
        "http://127.0.0.1:8000",
        "http://127.0.0.1:8001",
    ]
    with pytest.raises(ValueError, match="replay must be None"):
        engine_endpoints(parse(
            "--engine", "trtllm", "--engine-events", "http://127.0.0.1:8000",
            "--engine-replay", "tcp://127.0.0.1:5558", "--engine-metrics", "http://h:1/metrics",
        ))  # fmt: skip
    with pytest.raises(ValueError, match="need --engine"):
        engine_endpoints(parse("--engine-page-size", "16"))
    with pytest.raises(SystemExit):
        parse("--engine", "tgi")


def test_a_launch_refuses_two_trtllm_ranks_draining_one_page() -> None:
    from kvfold.cluster.settings import LaunchSettings

    def settings(*engines: EngineEndpoints) -> LaunchSettings:
        return LaunchSettings(
            world_size=len(engines), gpus_per_node=None, cache=None, host_num_blocks=0,
            report_interval_s=0.1, stale_after_s=0.3, dead_after_s=3.0, namespace="ns",
            placement_timeout_s=1.0, detached=False, gpus_per_rank=1.0, rank_max_restarts=0,
            engines=engines,
        )  # fmt: skip

    other = EngineEndpoints(events="http://127.0.0.1:8001", metrics=TRTLLM.metrics, kind="trtllm")
    with pytest.raises(ValueError, match="drains its stats queue"):
        settings(TRTLLM, other)
    with pytest.raises(ValueError, match="its own events endpoint"):
        settings(SGLANG, SGLANG)
    assert len(settings(SGLANG, TRTLLM).engines) == 2  # kinds may be mixed

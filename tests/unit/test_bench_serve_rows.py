"""`kvfold bench-serve`'s pure parts: an arm's row from what the client saw and the engines'
counters, and every request's row, written and read back."""

import csv
import json
from pathlib import Path

from kvfold.bench.bench_serve import (
    COLUMNS,
    REQUEST_COLUMNS,
    EngineCounters,
    Outcome,
    first_text,
    request_rows,
    sent_straight_to,
    summarize,
    write_outputs,
)
from kvfold.bench.bench_trace import ServeRequest


def _requests(n: int) -> list[ServeRequest]:
    return [ServeRequest(f"r{i}", i * 0.5, tuple(range(3, 3 + 10 * (i + 1))), 4) for i in range(n)]


def _outcomes() -> list[Outcome]:
    ok = [Outcome(200, engine=i % 3, ttft_s=0.01 * (i + 1), e2e_s=0.1 * (i + 1)) for i in range(8)]
    return [
        *ok,
        Outcome(429, error="queue_full"),
        Outcome(200, engine=2, ttft_s=0.5, e2e_s=0.9, error='data: {"error": "engine_failed"}'),
    ]


def test_an_arms_row_counts_what_the_client_and_the_engines_saw() -> None:
    requests, outcomes = _requests(10), _outcomes()
    before = EngineCounters(cached_tokens=100, preemptions=2)
    after = EngineCounters(cached_tokens=160, preemptions=2)
    row = summarize("precise_prefix", requests, outcomes, before, after, wall_s=12.34)
    assert set(row) == set(COLUMNS)
    assert (row["requests"], row["completed"], row["refused_429"], row["failed"]) == (10, 8, 1, 1)
    assert row["prompt_tokens"] == sum(10 * (i + 1) for i in range(10))
    assert row["cached_tokens"] == 60 and row["preemptions"] == 0
    # percentiles over the 8 answered only, TTFTs 10, 20, ..., 80 ms (the failed stream's
    # 500 ms left out): p50 is sorted[int(0.5 x 8)] = sorted[4] = 50, p90 sorted[7] = 80
    assert (row["ttft_p50_ms"], row["ttft_p90_ms"]) == (50.0, 80.0)
    assert row["door_wait_p50_ms"] is None  # no front door said how long it waited


def test_every_requests_row_is_written_and_read_back(tmp_path: Path) -> None:
    requests, outcomes = _requests(10), _outcomes()
    row = summarize("round_robin", requests, outcomes, EngineCounters(), EngineCounters(), 1.0)
    per_request = request_rows("round_robin", requests, outcomes)
    paths = write_outputs([row], {"command": "bench-serve"}, str(tmp_path), per_request)
    assert {p.name for p in paths} == {
        "bench_serve.json", "bench_serve.csv", "bench_serve.png", "bench_serve_requests.csv"
    }  # fmt: skip
    with open(tmp_path / "bench_serve_requests.csv", encoding="utf-8") as f:
        back = list(csv.DictReader(f))
    assert len(back) == 10 and list(back[0]) == list(REQUEST_COLUMNS)
    assert [r["request_id"] for r in back] == [r.request_id for r in requests]
    assert {r["arm"] for r in back} == {"round_robin"}
    # request 3: engine 3 % 3 = 0, TTFT 0.01 x (3 + 1) s = 40.0 ms, e2e 0.1 x 4 s = 400.0 ms,
    # arrival 3 x 0.5 s, prompt 10 x (3 + 1) tokens
    assert (back[3]["engine"], back[3]["ttft_ms"], back[3]["e2e_ms"]) == ("0", "40.0", "400.0")
    assert (back[3]["arrival_s"], back[3]["prompt_tokens"]) == ("1.5", "40")
    assert back[8]["status"] == "429" and back[8]["engine"] == "" and back[8]["error"]
    assert back[9]["status"] == "200" and "engine_failed" in back[9]["error"]
    assert json.loads((tmp_path / "bench_serve.json").read_text())["rows"] == [row]


def test_a_request_sent_to_an_engines_own_url_is_that_engines() -> None:
    urls = ["http://e0", "http://e1", "http://e2"]
    said = Outcome(200, engine=1)  # a header said which engine answered: kept
    outcomes = [Outcome(200), Outcome(200), said, Outcome(429)]
    sent_straight_to(outcomes, lambda i: urls[i % 3], urls)  # round robin
    assert [o.engine for o in outcomes] == [0, 1, 1, 0]
    through = [Outcome(200)]
    sent_straight_to(through, lambda i: "http://proxy/engines", urls)  # not an engine's URL
    assert through[0].engine is None


def test_time_to_first_token_counts_the_first_event_with_text() -> None:
    assert first_text(b'data: {"choices":[{"index":0,"text":"a"}]}\n')
    assert not first_text(b'data: {"choices":[{"index":0,"text":""}]}\n')  # text held back
    assert not first_text(b"data: [DONE]\n")
    assert not first_text(b"\n")


def test_vllm_routers_counters_are_read_by_result() -> None:
    from kvfold.bench.serve_runner import router_counters

    page = "\n".join(
        [
            "# TYPE vllm_router_kv_placement_lookups_total counter",
            'vllm_router_kv_placement_lookups_total{result="hit",model="m"} 3',
            'vllm_router_kv_placement_lookups_total{result="miss",model="m"} 7',
            'vllm_router_kv_placement_lookups_total{result="miss",model="n"} 1',
            'vllm_router_prefix_routing_decisions_total{outcome="prefix_cost"} 11',
            "vllm_router_requests_total 11",
            "vllm_router_cache_size not-a-number",
        ]
    )
    assert router_counters(page) == {
        "vllm_router_kv_placement_lookups_total:hit": 3.0,
        "vllm_router_kv_placement_lookups_total:miss": 8.0,
        "vllm_router_prefix_routing_decisions_total:prefix_cost": 11.0,
    }


def test_engines_get_a_longer_context_through_hf_overrides_only_past_the_models_own(
    tmp_path: Path,
) -> None:
    import argparse

    from kvfold.bench.serve_runner import engine_settings

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    python = tmp_path / "python"
    python.write_text("")
    args = argparse.Namespace(
        engine_python=str(python), model_dir=str(tmp_path), blocks=64, max_num_seqs=4,
        max_model_len=4096,
    )  # fmt: skip
    assert engine_settings(args).extra_args == ()
    args.max_model_len = 8192
    s = engine_settings(args)
    assert s.max_model_len == 8192
    assert s.extra_args == ("--hf-overrides", '{"max_position_embeddings": 8192}')


def test_one_picture_holds_every_arm_of_every_load(tmp_path: Path) -> None:
    from kvfold.bench.picture import main

    for load, scale in (("half", 0.25), ("85", 0.4)):
        arms = ("round_robin", "precise_prefix")
        rows = [
            summarize(a, _requests(10), _outcomes(), EngineCounters(),
                      EngineCounters(cached_tokens=100 * (i + 1)), 3.0)
            for i, a in enumerate(arms)
        ]  # fmt: skip
        (tmp_path / load).mkdir()
        (tmp_path / load / "bench_serve.json").write_text(
            json.dumps({"meta": {"time_scale": scale}, "rows": rows})
        )
    out = tmp_path / "frontier.png"
    assert main([str(tmp_path / "half" / "bench_serve.json"),
                 str(tmp_path / "85" / "bench_serve.json"), "-o", str(out)]) == 0  # fmt: skip
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000

"""TensorRT-LLM's KV cache events and iteration stats, from JSON shaped as trtllm-serve hands
them out (fixtures built from its source: tests/fixtures/trtllm-kv-events), through kvfold's
engine source: per window group, the live set equals the engine's GPU pool, keyed by kvfold's
own prefix keys; offloads and onboards move blocks off and onto the GPU; a gap in the event
ids (there is no replay) leaves no false credit. One test runs a stand-in trtllm-serve
process over HTTP."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvfold.engines.engine_source import EngineSource
from kvfold.engines.trtllm_events import TRTLLMTranslator, decode_events, feed_page
from kvfold.engines.trtllm_stats import TRTLLMStats, parse_trtllm_stats
from kvfold.engines.vllm_metrics import MetricsError
from kvfold.engines.vllm_wire import EngineRemoved, EngineStored, WireError
from kvfold.worker.hashing import block_keys
from tests.engines.standins.process import StandInProcess

TESTS = Path(__file__).resolve().parents[1]
FIXTURES = TESTS / "fixtures" / "trtllm-kv-events"  # README there
TRUTH = json.loads((FIXTURES / "ground_truth.json").read_text())
PAGES = (FIXTURES / "kv_cache_events.jsonl").read_text().splitlines()
METRICS = (FIXTURES / "metrics.json").read_bytes()
B = TRUTH["tokens_per_block"]
PROMPTS: dict[str, list[int]] = TRUTH["prompts"]
FULL, SLIDING = TRUTH["window_sizes"]["full"], TRUTH["window_sizes"]["sliding"]


def keys(blocks: dict[str, int]) -> set[bytes]:
    """kvfold's prefix keys of each prompt's first n blocks."""
    return {k for p, n in blocks.items() for k in block_keys(PROMPTS[p], B)[:n]}


def truth_keys(when: str) -> dict[int, set[bytes]]:
    """Per window group (the full window is group 0): the keys the GPU pool holds."""
    blocks = TRUTH[when]["gpu_blocks"]
    return {0: keys(blocks[str(FULL)]), 1: keys(blocks[str(SLIDING)])}


def run(pages: list[str], now_s: float = 0.0) -> tuple[EngineSource, TRTLLMTranslator]:
    source, translator = EngineSource(), TRTLLMTranslator(B)
    for page in pages:
        feed_page(source, translator, page, now_s)
    return source, translator


def held(source: EngineSource) -> dict[int, set[bytes]]:
    return {g: set(ks) for g, ks in source.held().items()}


def engine_hashes(source: EngineSource, group: int) -> set[Any]:
    return {h for (g, h), e in source.keys.table.items() if e and g == group}


# ---------------------------------------------------------------- decoding


def test_the_pages_decode_to_what_the_serializer_wrote() -> None:
    events = [e for page in PAGES for e in decode_events(page)]
    assert [e.event_id for e in events] == list(range(15))  # one sequence, from 0
    assert [e.kind for e in events[:3]] == ["created", "created", "stored"]
    assert events[0].window_size == SLIDING and events[0].num_blocks_per_cache_level == (64, 128)
    a = events[2]
    assert a.parent_hash is None and len(a.blocks) == 4
    assert a.blocks[0].token_ids == tuple(PROMPTS["A"][:B]) and a.blocks[0].extra == ()
    assert {e.cache_level for e in events if e.kind == "updated"} == {(0, 1), (1, 0), None}


def test_window_sizes_make_groups_the_full_window_first() -> None:
    """TensorRT-LLM announces its windows smallest first; the largest is group 0."""
    source, translator = run(PAGES[:2])
    assert translator.groups == {FULL: 0, SLIDING: 1}
    assert translator.num_blocks_per_cache_level == {SLIDING: (64, 128), FULL: (256, 512)}
    assert source.windows == {0: None, 1: SLIDING}
    assert TRTLLMTranslator(B, window_sizes=[SLIDING, FULL]).groups == {FULL: 0, SLIDING: 1}


# ---------------------------------------------------------------- the live set


def test_the_live_set_equals_the_engines_gpu_pool_per_window() -> None:
    source, translator = run(PAGES[:6])
    gpu = TRUTH["after_page_5"]["gpu"]
    assert engine_hashes(source, 0) == set(gpu[str(FULL)])
    assert engine_hashes(source, 1) == set(gpu[str(SLIDING)])
    assert held(source) == truth_keys("after_page_5")  # A 4 + B 2 + C 2; A 4 + B 2
    assert source.refused == {} and source.num_blocks_unkeyed == 0
    assert translator.counts["offloaded"] == 2 and translator.counts["onboarded"] == 1
    assert translator.counts["priority_updates"] == 1
    source, _ = run(PAGES)
    assert held(source) == truth_keys("after_page_7")  # C's last block gone, D's 2 in


def test_offloaded_blocks_leave_the_gpu_and_onboarded_ones_come_back() -> None:
    """Page 3 offloads A's blocks 2 and 3 to the host pool; page 4 drops block 3 from the
    host; page 5 onboards block 2 (its tokens kept from its stored event) and stores 3."""
    a_keys = block_keys(PROMPTS["A"], B)
    source, translator = EngineSource(), TRTLLMTranslator(B)
    on_host = []
    for n, page in enumerate(PAGES):
        events = feed_page(source, translator, page, float(n))
        on_host.append(translator.num_blocks_secondary)
        if n == 3:
            assert held(source)[0] >= set(a_keys[:2]) and not held(source)[0] & set(a_keys[2:])
            assert [type(e).__name__ for e in events] == ["BlockRemoved", "BlockRemoved"]
        if n == 5:
            assert list(events[0].block_hashes) == [a_keys[2]]  # type: ignore[union-attr]
    assert on_host == TRUTH["host_blocks_after_page"]
    assert translator.counts["removed_from_host"] == 1 and source.counts["removed_unknown"] == 0


def test_a_block_onboarded_whose_store_was_never_seen_is_not_credited() -> None:
    source, translator = run([])
    offload = [{"event_id": 0, "window_size": FULL, "data": {"type": "updated",
                "block_hash": 77, "cache_level": {"type": "event_diff", "old_value": 1,
                "new_value": 0}, "priority": None}}]  # fmt: skip
    assert feed_page(source, translator, json.dumps(offload), 0.0) == []
    assert translator.counts["updated_unknown"] == 1 and source.held() == {}


def stored_page(event_id: int, tokens: list[int], **block: Any) -> str:
    """A page of one stored event: one block (hash 1000 + event_id) under the root."""
    token_list = [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in tokens]
    one = {"type": "stored_block", "block_hash": 1000 + event_id, "cache_level": 0}
    data = {"type": "stored", "parent_hash": None,
            "blocks": [{**one, "priority": 35, "tokens": token_list, **block}]}  # fmt: skip
    return json.dumps([{"event_id": event_id, "window_size": FULL, "data": data}])


def test_partial_blocks_and_extras_are_never_credited_as_plain_prompts() -> None:
    tokens = [1, 2, 3, 4]
    plain = set(block_keys(tokens, B))
    source, translator = run([])
    feed_page(source, translator, stored_page(0, tokens[:3]), 0.0)  # partial: no key
    assert source.held() == {} and source.num_blocks_unkeyed == 1
    for extra in [
        {"lora_id": 5},
        {"cache_salt": "tenant"},
        {"mm_keys": [{"type": "mm_key", "hash": "ab", "start_offset": 0}]},
    ]:
        s, t = run([])
        feed_page(s, t, stored_page(0, tokens, **extra), 0.0)
        assert s.held()[0] and not set(s.held()[0]) & plain
    s, t = run([])
    feed_page(s, t, stored_page(0, tokens), 0.0)
    assert set(s.held()[0]) == plain


def test_token_extra_ids_make_keys_of_their_own() -> None:
    page = json.loads(stored_page(0, [1, 2, 3, 4]))
    page[0]["data"]["blocks"][0]["tokens"][0]["token_extra_id"] = 9  # prompt tuning
    event = decode_events(json.dumps(page))[0]
    assert event.blocks[0].extra == (("trtllm-token-extra-ids", (9, 0, 0, 0)),)


# ---------------------------------------------------------------- gaps, restarts, ranks


def test_an_event_id_gap_puts_the_source_out_of_sync_without_false_credit() -> None:
    """Page 6 (C's last block evicted) never reached kvfold: the engine dropped it from its
    event buffer. There is no replay: what the source held leaves, and comes back only as
    the engine stores blocks again."""
    source, _ = run(PAGES[:6] + PAGES[7:], now_s=4.0)
    assert source.out_of_sync_since_s == 4.0 and source.wanted_replay() is None
    c_last = block_keys(PROMPTS["C"], B)[1]
    assert all(c_last not in ks for ks in held(source).values())  # not credited
    assert held(source) == {0: keys({"D": 2})}
    for g, ks in held(source).items():
        assert ks <= truth_keys("after_page_7")[g]


def test_a_reader_that_joins_late_is_out_of_sync_until_blocks_are_stored_again() -> None:
    """kvfold started after the engine: its first page begins at event 5. Nothing can say
    what the engine stored before; what it stores from now on is credited."""
    source, translator = run([])
    feed_page(source, translator, stored_page(5, [1, 2, 3, 4]), 3.0)
    assert source.out_of_sync_since_s == 3.0
    assert set(source.held()[0]) == set(block_keys([1, 2, 3, 4], B))


def test_event_ids_that_start_over_are_a_new_engine_process() -> None:
    source, translator = run(PAGES[:3])
    feed_page(source, translator, PAGES[0], 1.0)  # event 0 again
    assert source.counts["restarts"] == 1 and translator.counts["restarts"] == 1
    assert source.held() == {} and translator.held == {}


def test_each_attention_dp_rank_reads_its_own_events_from_the_shared_page() -> None:
    events = json.loads(stored_page(0, [1, 2, 3, 4]))
    mixed = [{**events[0], "attention_dp_rank": 1}, {**events[0], "attention_dp_rank": 0}]
    batches = TRTLLMTranslator(B, attention_dp_rank=1).take_page(json.dumps(mixed), 0.0)
    assert len(batches) == 1 and batches[0].data_parallel_rank == 1
    assert isinstance(batches[0].events[0], EngineStored)


def test_the_translator_refuses_a_bad_configuration() -> None:
    for kwargs in ({"tokens_per_block": 0}, {"tokens_per_block": 4, "attention_dp_rank": -1},
                   {"tokens_per_block": 4, "window_sizes": [0]}):  # fmt: skip
        with pytest.raises(ValueError):
            TRTLLMTranslator(**kwargs)  # type: ignore[arg-type]


# ---------------------------------------------------------------- hostile output

GOOD = json.loads(PAGES[1])[0]


def with_data(**data: Any) -> str:
    return json.dumps([{**GOOD, "data": {**GOOD["data"], **data}}])


def with_event(**fields: Any) -> str:
    return json.dumps([{**GOOD, **fields}])


def with_block(**fields: Any) -> str:
    block = {**GOOD["data"]["blocks"][0], **fields}
    return json.dumps([{**GOOD, "data": {**GOOD["data"], "blocks": [block]}}])


@pytest.mark.parametrize(
    ("page", "reason"),
    [
        ("{not json", "bad_json"),
        (b"\xff\xfe", "bad_json"),
        ('[{"event_id": NaN}]', "bad_json"),
        ('{"events": []}', "bad_page"),
        ("[7]", "bad_event"),
        (with_event(data=[1]), "bad_event"),
        (with_data(type="moved"), "unknown_event"),
        (with_event(event_id=-1), "bad_field"),
        (with_event(event_id="2"), "bad_field"),
        (with_event(window_size=0), "bad_field"),
        (with_event(attention_dp_rank=1.5), "bad_field"),
        (with_data(blocks=[]), "bad_field"),
        (with_data(parent_hash="zz"), "bad_field"),
        (with_block(block_hash=1.5), "bad_field"),
        (with_block(block_hash=2**64), "bad_field"),
        (with_block(tokens=[{"token_id": -3, "token_extra_id": 0}]), "bad_field"),
        (with_block(tokens=[5]), "bad_field"),
        (with_block(cache_level="gpu"), "bad_field"),
        (with_block(mm_keys=[{"hash": 5}]), "bad_field"),
        (with_block(lora_id=True), "bad_field"),
        (json.dumps([{**GOOD, "data": {"type": "removed", "block_hashes": []}}]), "bad_field"),
        (
            json.dumps([{**GOOD, "data": {"type": "updated", "block_hash": 1, "cache_level": 1}}]),
            "bad_field",
        ),
        (
            json.dumps(
                [{**GOOD, "data": {"type": "created", "num_blocks_per_cache_level": "many"}}]
            ),
            "bad_field",
        ),
        ("[" + ",".join(["{}"] * 70_000) + "]", "too_large"),
    ],
)
def test_hostile_output_is_refused_counted_and_changes_nothing(
    page: str | bytes, reason: str
) -> None:
    source, translator = run(PAGES[:3])
    before = (held(source), source.expected, dict(translator.held))
    assert feed_page(source, translator, page, 0.0) == []  # type: ignore[arg-type]
    assert source.refused == {reason: 1}
    assert (held(source), source.expected, dict(translator.held)) == before
    with pytest.raises(WireError, match=reason):
        decode_events(page)  # type: ignore[arg-type]


def test_a_removal_run_is_one_event_per_group() -> None:
    page = json.dumps([{**GOOD, "event_id": 9, "data": {"type": "removed",
                                                        "block_hashes": [5, 6]}}])  # fmt: skip
    batch = TRTLLMTranslator(B).take_page(page, 0.0)[0]
    assert batch.seq == 9 and batch.events == (EngineRemoved((5, 6), 0, "GPU"),)


# ---------------------------------------------------------------- iteration stats


def test_the_stats_page_gives_the_latest_iterations_kv_numbers() -> None:
    s = parse_trtllm_stats(METRICS)
    assert s.iteration == 42 and s.tokens_per_block == B
    assert (s.num_blocks_max, s.num_blocks_used, s.num_blocks_free) == (320, 8, 312)
    assert s.usage == pytest.approx(8 / 320)
    assert (s.num_blocks_reused, s.num_blocks_missed, s.num_blocks_alloc_total) == (7, 15, 22)
    assert s.cache_hit_rate == pytest.approx(7 / 22)  # reused / (reused + missed)
    assert s.num_blocks_alloc_new == 15
    assert (s.num_requests_active, s.num_requests_queued) == (2, 1)


def test_a_stat_the_page_lacks_is_unknown_not_zero() -> None:
    assert parse_trtllm_stats(b"[]") == TRTLLMStats()
    s = parse_trtllm_stats(json.dumps([{"iter": 3, "numActiveRequests": 1}]))
    assert s.iteration == 3 and s.num_requests_active == 1
    assert s.num_blocks_max is None and s.usage is None and s.cache_hit_rate is None


@pytest.mark.parametrize(
    "page",
    [
        "<html>502</html>",
        '{"iter": 1}',
        "[1, 2]",
        '[{"iter": 1, "kvCacheStats": []}]',
        '[{"iter": 1, "kvCacheStats": {"usedNumBlocks": -1}}]',
        '[{"iter": 1, "kvCacheStats": {"usedNumBlocks": 2.5}}]',
        '[{"iter": 1, "kvCacheStats": {"cacheHitRate": 1.5}}]',
        '[{"iter": 1, "kvCacheStats": {"cacheHitRate": NaN}}]',
    ],
)
def test_a_garbage_stats_page_is_refused(page: str) -> None:
    with pytest.raises(MetricsError):
        parse_trtllm_stats(page)


# ---------------------------------------------------------------- a stand-in trtllm-serve


class StandIn(StandInProcess):
    """tests/engines/standins/trtllm_server.py in a process of its own."""

    def __init__(self, *args: str) -> None:
        events, metrics = str(FIXTURES / "kv_cache_events.jsonl"), str(FIXTURES / "metrics.json")
        super().__init__("trtllm_server.py", "--events", events, "--metrics", metrics, *args)
        try:
            word, port = self.line(10.0).split()
        except AssertionError:
            self.stop()
            raise
        assert word == "PORT"
        self.url = f"http://127.0.0.1:{port}"

    def post_events(self) -> bytes:
        request = urllib.request.Request(f"{self.url}/kv_cache_events", data=b"", method="POST")
        with urllib.request.urlopen(request, timeout=5) as answer:
            body: bytes = answer.read()
            return body

    def get_metrics(self) -> bytes:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=5) as answer:
            body: bytes = answer.read()
            return body


def poll_all(server: StandIn, source: EngineSource, translator: TRTLLMTranslator) -> int:
    """POST /kv_cache_events until the engine has nothing more (at most 50 polls)."""
    for polls in range(1, 51):
        body = server.post_events()
        if json.loads(body) == []:
            return polls
        feed_page(source, translator, body, float(polls))
    raise AssertionError("the event pages never ran out")


def test_a_stand_in_trtllm_serve_over_http() -> None:
    server = StandIn()
    try:
        source, translator = EngineSource(), TRTLLMTranslator(B)
        assert poll_all(server, source, translator) == len(PAGES) + 1
        assert held(source) == truth_keys("after_page_7")
        for g, window in ((0, FULL), (1, SLIDING)):
            assert engine_hashes(source, g) == set(TRUTH["after_page_7"]["gpu"][str(window)])
        stats = parse_trtllm_stats(server.get_metrics())
        assert stats.tokens_per_block == B == translator.tokens_per_block
        assert source.out_of_sync_since_s is None and source.refused == {}
    finally:
        server.stop()


def test_a_stand_in_trtllm_serve_that_dropped_events_leaves_no_false_credit() -> None:
    server = StandIn("--drop-page", "6")  # the engine's event buffer overflowed
    try:
        source, translator = EngineSource(), TRTLLMTranslator(B)
        poll_all(server, source, translator)
        assert source.out_of_sync_since_s is not None and source.counts["out_of_sync"] == 1
        assert held(source) == {0: keys({"D": 2})}  # only what came after the gap
    finally:
        server.stop()

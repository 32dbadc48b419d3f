"""A real vLLM engine's own bytes, through kvfold's engine source into a block index:
what the index then predicts for each next request equals the `cached_tokens` the engine
reported for it, the live set equals the engine's, and gaps, replays, restarts and
hostile output keep that true (or leave no false credit)."""

from __future__ import annotations

import json
from pathlib import Path

import msgpack
import pytest

from kvfold.blockindex.index import BlockIndex
from kvfold.blockindex.prompt_match import match_prompt
from kvfold.engines.engine_source import EngineSource
from kvfold.engines.vllm_metrics import MetricsError, parse_vllm_metrics
from kvfold.engines.vllm_wire import (
    EngineCleared,
    EngineStored,
    WireError,
    decode_live,
    decode_payload,
    decode_replay,
    replay_request,
)
from kvfold.kvevents.events import RANK, AllBlocksCleared, BlockStored, decode_batch
from kvfold.worker.hashing import block_keys

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
REAL = FIXTURES / "vllm-cpu-real"  # README there
B = 32
SOURCE = (RANK, 0)


def frames(name: str) -> list[list[bytes]]:
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed((REAL / name).read_bytes())
    return list(unpacker)


LIVE = frames("zmq_frames.msgpack")
REPLAY = frames("replay_frames.msgpack")
REQUESTS = [json.loads(line) for line in (REAL / "requests.jsonl").read_text().splitlines()]
TRUTH = json.loads((REAL / "ground_truth.json").read_text())


def feed(
    source: EngineSource, index: BlockIndex, messages: list[list[bytes]], now_s: float = 0.0
) -> None:
    for m in messages:
        index.apply(SOURCE, source.take_live(m, now_s))


def test_the_live_stream_decodes_to_what_the_engine_published() -> None:
    batches = [decode_live(m) for m in LIVE]
    assert [b.seq for b in batches] == list(range(len(LIVE)))  # from 0, no gap
    kinds: dict[str, int] = {}
    for b in batches:
        for e in b.events:
            n = 1 if isinstance(e, (EngineStored, EngineCleared)) else len(e.block_hashes)
            kinds[type(e).__name__] = kinds.get(type(e).__name__, 0) + n
    # 20 BlockStored, 30 BlockRemoved (one per evicted block: read as runs), 1 reset
    assert kinds == {"EngineStored": 20, "EngineRemoved": 30, "EngineCleared": 1}
    stored = next(e for b in batches for e in b.events if isinstance(e, EngineStored))
    assert stored.block_size == B and len(stored.token_ids) == B * len(stored.block_hashes)
    assert stored.parent_block_hash is None and all(h >= 0 for h in stored.block_hashes)  # type: ignore[operator]


def test_the_replay_answer_equals_the_live_stream() -> None:
    replayed = [decode_replay(m) for m in REPLAY]
    assert replayed[-1] is None  # the end marker
    assert [(b.seq, b.events) for b in replayed[:-1] if b] == [
        (b.seq, b.events) for b in map(decode_live, LIVE[: len(replayed) - 1])
    ]
    assert replay_request(3) == [b"", (3).to_bytes(8, "big")]


def test_the_index_predicts_every_requests_cached_tokens() -> None:
    """Before each request, the index built from the frames the engine had sent says how
    many of its prompt tokens it will find cached; the engine's own count agrees."""
    source, index = EngineSource(), BlockIndex([0])
    sent = 0
    for req in REQUESTS:
        feed(source, index, LIVE[sent : req["first_frame_seq"]])
        sent = max(sent, req["first_frame_seq"])
        predicted = match_prompt(index, req["prompt"]).gpu.get(0, 0) * B
        assert predicted == req["engine_cached_tokens"], req["name"]
    assert sum(r["engine_cached_tokens"] for r in REQUESTS) == 3776  # vllm:prefix_cache_hits


def test_the_live_set_equals_the_engines_and_the_reset_empties_it() -> None:
    source, index = EngineSource(), BlockIndex([0])
    feed(source, index, LIVE[: TRUTH["last_seq"] + 1])
    live = {h for h in TRUTH["live_block_hashes"]}
    assert {h for (_, h), entry in source.keys.table.items() if entry} == live
    assert sum(len(ks) for ks in index.keys_of(SOURCE).values()) == TRUTH["num_live_blocks"]
    # every live block's key is kvfold's own prefix key of some request's prompt
    prompt_keys = {k for r in REQUESTS for k in block_keys(r["prompt"], B)}
    assert index.keys_of(SOURCE)[0] <= prompt_keys
    feed(source, index, LIVE[TRUTH["last_seq"] + 1 :])  # the reset
    assert index.keys_of(SOURCE) == {}
    assert source.held() == {}


def keys_after(n: int) -> set[bytes]:
    """What the engine held after its first n batches (every one of them applied)."""
    source, index = EngineSource(), BlockIndex([0])
    feed(source, index, LIVE[:n])
    return index.keys_of(SOURCE).get(0, set())


def final_keys() -> set[bytes]:
    return keys_after(TRUTH["last_seq"] + 1)


def test_a_lost_batch_is_filled_from_the_replay() -> None:
    source, index = EngineSource(), BlockIndex([0])
    feed(source, index, LIVE[:5])
    feed(source, index, LIVE[6 : TRUTH["last_seq"] + 1])  # batch 5 was lost
    assert source.wanted_replay() == 5
    index.apply(SOURCE, source.take_replay(REPLAY, 1.0))
    assert source.wanted_replay() is None and source.out_of_sync_since_s is None
    assert index.keys_of(SOURCE)[0] == final_keys()


def test_live_batches_the_replay_already_gave_are_duplicates_not_a_restart() -> None:
    """A replay answers up to the engine's latest batch: the live copies of those still on
    their way come after it, and are dropped (the same seq and ts), never read as the
    engine starting over."""
    source, index = EngineSource(), BlockIndex([0])
    last = TRUTH["last_seq"]
    feed(source, index, LIVE[:5])
    feed(source, index, LIVE[6:7])  # batch 5 lost; 6 shows the gap, 7.. still on their way
    index.apply(SOURCE, source.take_replay(REPLAY, 1.0))  # 5..19
    feed(source, index, LIVE[7 : last + 1])  # the live copies arrive: 13 duplicates
    assert source.counts["duplicates"] == last + 1 - 7 and source.counts["restarts"] == 0
    assert index.keys_of(SOURCE)[0] == final_keys()
    feed(source, index, LIVE[:1])  # seq 0 again, not from the replay: a new engine process
    assert source.counts["restarts"] == 1


def test_lost_last_batches_are_found_by_probing_a_quiet_streams_tail() -> None:
    """Batches lost with nothing after them show no gap (the first ones an engine sends
    before the subscription took, say): the reader asks the replay from `tail_from()` when
    the stream has been quiet, and what it gives is applied in order; their live copies,
    should they come after all, are duplicates, not a restart."""
    source, index = EngineSource(), BlockIndex([0])
    last = TRUTH["last_seq"]
    feed(source, index, LIVE[:5])  # 5..19 lost, and nothing after them
    assert source.wanted_replay() is None and source.tail_from() == 5
    index.apply(SOURCE, source.take_replay(REPLAY, 3.0))  # the probe's answer: 5..19
    assert index.keys_of(SOURCE)[0] == final_keys()
    assert source.counts["tail_recovered"] == last + 1 - 5 and source.tail_from() == last + 1
    feed(source, index, LIVE[7:9])
    assert source.counts["duplicates"] == 2 and source.counts["restarts"] == 0


def test_probing_a_tail_that_lost_nothing_changes_nothing() -> None:
    source, index = EngineSource(), BlockIndex([0])
    assert source.tail_from() == 0  # before any batch: from the first
    assert source.take_replay([REPLAY[-1]], 1.0) == []  # the end marker alone
    assert source.tail_from() == 0 and source.expected is None
    feed(source, index, LIVE[: TRUTH["last_seq"] + 1])
    before = dict(source.counts)
    assert source.take_replay(REPLAY, 2.0) == []  # all of it already applied
    assert dict(source.counts) == before and source.out_of_sync_since_s is None
    assert index.keys_of(SOURCE)[0] == final_keys()


def test_a_gap_the_replay_no_longer_covers_leaves_no_false_credit() -> None:
    source, index = EngineSource(), BlockIndex([0])
    feed(source, index, LIVE[:5])
    feed(source, index, LIVE[9 : TRUTH["last_seq"] + 1])  # 5..8 lost
    truncated = [m for m in REPLAY if m[2] == b"\xff" * 8 or int.from_bytes(m[2], "big") >= 7]
    index.apply(SOURCE, source.take_replay(truncated, 2.0))
    assert source.out_of_sync_since_s == 2.0
    held = index.keys_of(SOURCE).get(0, set())
    assert held <= final_keys()  # whatever it holds, the engine holds: no false credit
    assert source.counts["out_of_sync"] == 1 and source.wanted_replay() is None


def test_a_replay_that_never_answers_is_out_of_sync() -> None:
    source, index = EngineSource(), BlockIndex([0])
    feed(source, index, LIVE[:3])
    feed(source, index, LIVE[4:8])
    events = source.replay_failed(3.0)
    assert isinstance(events[0], AllBlocksCleared)
    index.apply(SOURCE, events)
    assert index.keys_of(SOURCE).get(0, set()) <= keys_after(8)


def test_an_engine_restart_starts_the_source_over() -> None:
    source, index = EngineSource(), BlockIndex([0])
    feed(source, index, LIVE[:10])
    assert index.keys_of(SOURCE)
    feed(source, index, LIVE[:1])  # seq 0 again: a new engine process
    assert source.counts["restarts"] == 1
    first = decode_live(LIVE[0]).events[0]
    assert isinstance(first, EngineStored)
    assert index.keys_of(SOURCE)[0] == set(block_keys(REQUESTS[0]["prompt"], B)[:8])


def test_a_stream_joined_late_asks_for_what_came_before() -> None:
    source = EngineSource()
    assert source.take_live(LIVE[3], 0.0) == []
    assert source.wanted_replay() == 0


# ---------------------------------------------------------------- hostile output

STORED = {
    "type": "BlockStored",
    "block_hashes": [1, 2],
    "parent_block_hash": None,
    "token_ids": list(range(2 * B)),
    "block_size": B,
    "medium": "GPU",
    "group_idx": 0,
}


def live(seq: int, events: object, ts: object = 1.0) -> list[bytes]:
    payload = msgpack.packb([ts, events, 0], use_bin_type=True)
    return [b"kv-events", seq.to_bytes(8, "big"), payload]


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        ([b"kv-events", b"\0" * 8], "bad_frame"),
        ([b"kv-events", b"\0" * 4, b"\x90"], "bad_frame"),
        ([b"kv-events", b"\0" * 8, b"\xc1\xc1"], "bad_msgpack"),
        (live(0, [{"type": "BlockExploded"}]), "unknown_event"),
        (live(0, [["BlockExploded", 1]]), "unknown_event"),
        (live(0, [{**STORED, "block_hashes": "many"}]), "bad_field"),
        (live(0, [{**STORED, "block_hashes": [1.5, 2]}]), "bad_field"),
        (live(0, [{**STORED, "token_ids": list(range(B))}]), "bad_field"),  # 2 blocks, 1 block's
        (live(0, [{**STORED, "token_ids": [-1] * 2 * B}]), "bad_field"),
        (live(0, [{**STORED, "block_size": "32"}]), "bad_field"),
        (live(0, [{**STORED, "extra_keys": [None]}]), "bad_field"),
        (live(0, [{**STORED, "group_idx": 2**40}]), "bad_field"),
        (live(0, [7]), "bad_event"),
        (live(0, {"events": []}), "bad_batch"),
        (live(0, [], ts="now"), "bad_batch"),
        (live(0, [{"type": "AllBlocksCleared"}] * 70_000), "too_large"),
        ([b"kv-events", b"\0" * 8, b"\x90" * (17 * 2**20)], "too_large"),
    ],
)
def test_hostile_output_is_refused_counted_and_changes_nothing(
    message: list[bytes], reason: str
) -> None:
    source, index = EngineSource(), BlockIndex([0])
    feed(source, index, LIVE[:4])
    before = (index.keys_of(SOURCE), source.expected, dict(source.live))
    assert source.take_live(message, 0.0) == []
    assert source.refused == {reason: 1}
    assert (index.keys_of(SOURCE), source.expected, dict(source.live)) == before
    with pytest.raises(WireError, match=reason):
        decode_live(message)


def test_blocks_that_cannot_be_keyed_are_counted_never_credited() -> None:
    source, index = EngineSource(), BlockIndex([0])
    orphan = {**STORED, "parent_block_hash": 99}  # a parent never seen
    no_tokens = {**STORED, "block_hashes": [5], "token_ids": []}
    index.apply(SOURCE, source.take_live(live(0, [orphan, no_tokens]), 0.0))
    assert index.keys_of(SOURCE) == {} and source.num_blocks_unkeyed == 3
    child = {**STORED, "block_hashes": [3], "parent_block_hash": 2, "token_ids": [1] * B}
    index.apply(SOURCE, source.take_live(live(1, [child]), 0.0))  # a child of an unkeyed one
    assert index.keys_of(SOURCE) == {} and source.num_blocks_unkeyed == 4
    removed = {"type": "BlockRemoved", "block_hashes": [1, 77], "medium": "GPU"}
    assert source.take_live(live(2, [removed]), 0.0) == []
    assert source.counts["removed_unknown"] == 1


def test_two_engine_blocks_with_one_content_key_leave_once_both_are_gone() -> None:
    source, index = EngineSource(), BlockIndex([0])
    twin = {**STORED, "block_hashes": [10, 20]}  # the same tokens, other engine hashes
    index.apply(SOURCE, source.take_live(live(0, [STORED, twin]), 0.0))
    keys = set(block_keys(list(range(2 * B)), B))
    assert index.keys_of(SOURCE)[0] == keys
    remove = {"type": "BlockRemoved", "block_hashes": [1, 2], "medium": "GPU"}
    index.apply(SOURCE, source.take_live(live(1, [remove]), 0.0))
    assert index.keys_of(SOURCE)[0] == keys  # 10 and 20 still hold them
    remove = {"type": "BlockRemoved", "block_hashes": [10, 20], "medium": "GPU"}
    index.apply(SOURCE, source.take_live(live(2, [remove]), 0.0))
    assert index.keys_of(SOURCE) == {}


def test_extra_keys_and_lora_make_keys_of_their_own() -> None:
    plain = EngineSource().keys.store(decode_payload(0, live(0, [STORED])[2]).events[0])  # type: ignore[arg-type]
    salted = {**STORED, "extra_keys": [["tenant-a"], None]}
    lora = {**STORED, "lora_name": "adapter-1"}
    for variant in (salted, lora):
        keys = EngineSource().keys.store(decode_payload(0, live(0, [variant])[2]).events[0])  # type: ignore[arg-type]
        assert not set(keys) & set(plain)
    assert plain == block_keys(list(range(2 * B)), B)


# ---------------------------------------------------------------- older vLLM bytes


def flat(events: object) -> list[tuple[str, object]]:
    """(kind, hash) per block, in order: what two readers must agree on."""
    out: list[tuple[str, object]] = []
    for e in events:  # type: ignore[attr-defined]
        kind = "stored" if "Stored" in type(e).__name__ else "removed"
        if "Cleared" in type(e).__name__:
            out.append(("cleared", None))
        else:
            out += [(kind, h) for h in e.block_hashes]
    return out


@pytest.mark.parametrize(
    "name",
    ["batches-int-hashes.json", "batches-bytes-hashes.json", "batches-int-hashes-vllm-0.11.json"],
)
def test_older_vllm_bytes_decode_as_kvfolds_own_reader_reads_them(name: str) -> None:
    """Both event encodings, both hash kinds: each step decodes to the same events as
    kvfold's block-event reader gives, and the source's live set follows vLLM's."""
    steps = json.loads((FIXTURES / "vllm-kv-events" / name).read_text())["steps"]
    source = EngineSource()
    for seq, step in enumerate(steps):
        payload = bytes.fromhex(step["payload"])
        batch = decode_payload(seq, payload)
        ours = decode_batch(payload)
        assert [type(e).__name__ for e in ours.events] == step["events"]
        assert flat(batch.events) == flat(ours.events)  # a run of removals reads as one
        source.take_live([b"", seq.to_bytes(8, "big"), payload], 0.0)
        want = step["cached_after"]
        as_sent = {bytes.fromhex(h) if "bytes" in name else h for h in want}
        assert {h for (_, h), e in source.keys.table.items() if e} == as_sent, step["step"]
    assert source.refused == {}


def test_zmq_frames_and_replay_of_an_older_vllm() -> None:
    data = json.loads((FIXTURES / "vllm-kv-events" / "zmq-int-hashes.json").read_text())
    live_frames = [[bytes.fromhex(f) for f in m] for m in data["sub_frames"]]
    replay = [[bytes.fromhex(f) for f in m] for m in data["replay_from_seq_1"]]
    full, gapped = EngineSource(), EngineSource()
    for m in live_frames:
        full.take_live(m, 0.0)
    gapped.take_live(live_frames[0], 0.0)
    for m in live_frames[2:]:
        gapped.take_live(m, 0.0)
    assert gapped.wanted_replay() == 1
    gapped.take_replay(replay, 0.0)
    assert gapped.held() == full.held() and gapped.wanted_replay() is None


# ---------------------------------------------------------------- /metrics


def test_the_metrics_page_gives_what_the_engine_publishes() -> None:
    m = parse_vllm_metrics((REAL / "metrics_after.txt").read_text())["0"]
    assert (m.num_gpu_blocks, m.block_size) == (48, 32)
    assert m.prefix_cache_hits_tokens == 3776 and m.prefix_cache_queries_tokens == 6531
    assert m.num_requests_running == 0 and m.num_requests_waiting == 0
    assert m.num_preemptions == 0 and m.kv_cache_usage == 0.0 and m.num_blocks_used == 0


@pytest.mark.parametrize("page", ["metrics_after.txt", "metrics_after_reset.txt"])
def test_reading_only_the_wanted_families_gives_what_the_whole_page_gives(page: str) -> None:
    from urllib.parse import parse_qs

    from prometheus_client.parser import text_string_to_metric_families

    from kvfold.engines.vllm_metrics import METRICS_QUERY

    text = (REAL / page).read_text()
    whole = {  # every sample of the whole page, parsed whole (the reader before the filter)
        s.name: s for f in text_string_to_metric_families(text) for s in f.samples
    }
    m = parse_vllm_metrics(text)["0"]
    info = whole["vllm:cache_config_info"].labels
    assert (m.num_gpu_blocks, m.block_size) == (
        int(info["num_gpu_blocks"]),
        int(info["block_size"]),
    )
    for name, value in (
        ("vllm:kv_cache_usage_perc", m.kv_cache_usage),
        ("vllm:num_requests_running", m.num_requests_running),
        ("vllm:num_requests_waiting", m.num_requests_waiting),
        ("vllm:prefix_cache_queries_total", m.prefix_cache_queries_tokens),
        ("vllm:prefix_cache_hits_total", m.prefix_cache_hits_tokens),
        ("vllm:num_preemptions_total", m.num_preemptions),
        ("process_start_time_seconds", m.process_start_time_s),
    ):
        assert value == whole[name].value, name
    # the query asks the server for exactly those samples
    asked = parse_qs(METRICS_QUERY.removeprefix("?"))["name[]"]
    assert sorted(asked) == sorted(
        ["vllm:cache_config_info", "process_start_time_seconds", "vllm:kv_cache_usage_perc",
         "vllm:num_requests_running", "vllm:num_requests_waiting",
         "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
         "vllm:num_preemptions_total"]
    )  # fmt: skip


def test_a_metric_the_page_lacks_is_unknown_not_zero() -> None:
    m = parse_vllm_metrics('vllm:num_requests_running{engine="0"} 2\n')["0"]
    assert m.num_requests_running == 2
    assert m.num_gpu_blocks is None and m.num_blocks_used is None and m.num_preemptions is None


@pytest.mark.parametrize(
    "page",
    [
        "<html>502 Bad Gateway</html>",
        'vllm:kv_cache_usage_perc{engine="0"} 1.5\n',
        'vllm:num_requests_running{engine="0"} -3\n',
        'vllm:num_requests_running{engine="0"} NaN\n',
    ],
)
def test_a_garbage_metrics_page_is_refused(page: str) -> None:
    with pytest.raises(MetricsError):
        parse_vllm_metrics(page)


def test_stored_events_carry_content_keys_not_engine_hashes() -> None:
    source = EngineSource()
    events = source.take_live(LIVE[0], 0.0)
    stored = [e for e in events if isinstance(e, BlockStored)]
    engine_hashes = set(decode_live(LIVE[0]).events[0].block_hashes)  # type: ignore[union-attr]
    assert stored and not set(stored[0].block_hashes) & engine_hashes
    assert list(stored[0].block_hashes) == block_keys(REQUESTS[0]["prompt"], B)[:8]


def test_a_new_engine_process_seen_on_its_metrics_starts_the_source_over() -> None:
    source, index = EngineSource(), BlockIndex([0])
    feed(source, index, LIVE[:5])
    index.apply(SOURCE, source.restart())  # before the new process's first batch
    assert index.keys_of(SOURCE) == {} and source.expected is None
    feed(source, index, LIVE[:1])  # its first batch: seq 0, no second restart
    assert source.counts["restarts"] == 1 and index.keys_of(SOURCE)
    assert parse_vllm_metrics((REAL / "metrics_after.txt").read_text())[
        "0"
    ].process_start_time_s == pytest.approx(1.79612464236e09)

"""SGLang's KV events, from bytes shaped as its publisher sends them (fixtures built from its
source: tests/fixtures/sglang-kv-events), through kvfold's engine source: the live set
equals the engine's, keyed by kvfold's own prefix keys; replays, restarts and hostile output
keep that true or leave no false credit. One test runs a stand-in publisher process that
speaks SGLang's ZMQ wire (PUB + replay ROUTER)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from kvfold.engines.engine_source import EngineSource
from kvfold.engines.sglang_metrics import parse_sglang_metrics
from kvfold.engines.sglang_wire import (
    ROOT_PARENT_HASH,
    decode_live,
    decode_payload,
    decode_replay,
    replay_request,
    take_live,
    take_replay,
)
from kvfold.engines.vllm_metrics import MetricsError
from kvfold.engines.vllm_wire import EngineRemoved, EngineStored, WireError
from kvfold.kvevents.events import CPU, GPU, BlockStored
from kvfold.worker.hashing import block_keys
from tests.engines.standins.process import StandInProcess

TESTS = Path(__file__).resolve().parents[1]
FIXTURES = TESTS / "fixtures" / "sglang-kv-events"  # README there
TRUTH = json.loads((FIXTURES / "ground_truth.json").read_text())
B = TRUTH["page_size"]
PROMPTS: dict[str, list[int]] = TRUTH["prompts"]
END = b"\xff" * 8


def stream(name: str) -> list[list[bytes]]:
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed((FIXTURES / name).read_bytes())
    return [list(m) for m in unpacker]


LIVE = stream("map-live.msgpack")  # SGLang with HiCache tiers: tagged maps, medium
REPLAY_FROM_3 = stream("map-replay-from-3.msgpack")
ARRAY_LIVE = stream("array-live.msgpack")  # sgl-project/sglang 612d579: positional arrays


def keys(*prompts: str, blocks: dict[str, int] | None = None) -> set[bytes]:
    """kvfold's prefix keys of the prompts' first blocks (all full blocks by default)."""
    out: set[bytes] = set()
    for p in prompts:
        ks = block_keys(PROMPTS[p], B)
        out |= set(ks[: (blocks or {}).get(p, len(ks))])
    return out


def feed(source: EngineSource, messages: list[list[bytes]], now_s: float = 0.0) -> None:
    for m in messages:
        take_live(source, m, now_s)


def engine_hashes(source: EngineSource) -> set[Any]:
    return {h for (_, h), entry in source.keys.table.items() if entry}


GPU_KEYS = keys(*TRUTH["map"]["gpu_prompts"])  # A's 4 pages, B's 2 of its own: 6
LAST = TRUTH["map"]["last_seq"]


# ---------------------------------------------------------------- decoding


def test_the_live_stream_decodes_to_what_sglang_published() -> None:
    batches = [decode_live(m) for m in LIVE]
    assert [b.seq for b in batches] == list(range(len(LIVE)))  # from 0, no gap
    assert {b.data_parallel_rank for b in batches} == {0}  # attn_dp_rank
    media = {(type(e).__name__, getattr(e, "medium", None)) for b in batches for e in b.events}
    assert media == {
        ("EngineStored", GPU),
        ("EngineStored", CPU),  # CPU_PINNED: HiCache's host pool is kvfold's host tier
        ("EngineRemoved", GPU),
        ("EngineRemoved", CPU),
        ("EngineCleared", None),
    }
    first = batches[0].events[0]
    assert isinstance(first, EngineStored)
    assert first.block_size == B and first.token_ids == tuple(PROMPTS["A"][:B])
    assert first.parent_block_hash is None and first.extra_keys is None
    # a node split: SGLang removes A's node (one BlockRemoved per page: read as one removal)
    # and stores both halves again
    split = batches[1].events
    assert isinstance(split[0], EngineRemoved) and len(split[0].block_hashes) == 4
    assert [type(e).__name__ for e in split[1:]] == ["EngineStored"] * 6


def test_the_replay_answer_has_no_topic_frame_and_ends_with_the_marker() -> None:
    assert all(len(m) == 3 and m[0] == b"" for m in REPLAY_FROM_3)
    replayed = [decode_replay(m) for m in REPLAY_FROM_3]
    assert replayed[-1] is None
    assert [(b.seq, b.events) for b in replayed[:-1] if b] == [
        (b.seq, b.events) for b in map(decode_live, LIVE[3 : LAST + 1])
    ]
    assert replay_request(3) == [b"", (3).to_bytes(8, "big")]
    with pytest.raises(WireError, match="bad_frame"):  # vLLM's shape, with a topic
        decode_replay([b"", b"", (3).to_bytes(8, "big"), LIVE[3][2]])


# ---------------------------------------------------------------- the live set


def test_the_live_set_equals_the_engines_and_the_reset_empties_it() -> None:
    source = EngineSource()
    feed(source, LIVE[: LAST + 1])
    assert engine_hashes(source) == set(TRUTH["map"]["gpu_hashes"])
    assert set(source.held()[0]) == GPU_KEYS  # 4 of A + 2 of B's own
    assert source.num_blocks_unkeyed == 0 and source.refused == {}
    assert source.counts["other_medium"] == 7  # 6 host stores, 1 host removal (of 2 pages)
    feed(source, LIVE[LAST + 1 :])  # flush_cache
    assert source.held() == {}


def test_the_host_pool_is_a_source_of_its_own() -> None:
    """HiCache's host pool (CPU_PINNED) read by a host-tier source: A's pages stay there
    after B's node leaves it."""
    host = EngineSource(medium=CPU)
    feed(host, LIVE[: LAST + 1])
    assert engine_hashes(host) == set(TRUTH["map"]["host_hashes"])
    assert set(host.held()[0]) == keys("A")


def test_stored_events_carry_kvfolds_prefix_keys_not_sglangs_hashes() -> None:
    source = EngineSource()
    events = take_live(source, LIVE[0], 0.0)
    stored = [k for e in events if isinstance(e, BlockStored) for k in e.block_hashes]
    assert stored == block_keys(PROMPTS["A"], B)  # one page per event, chained by parent
    assert not set(stored) & set(decode_live(LIVE[0]).events[0].block_hashes)  # type: ignore[union-attr]


def test_early_sglang_arrays_decode_and_key_the_same_way() -> None:
    """sglang 612d579's positional events, content-only page hashes and root children
    linked to hash(()) (the empty root key), read as having no parent."""
    first = decode_live(ARRAY_LIVE[0]).events[0]
    assert isinstance(first, EngineStored) and first.parent_block_hash is None
    assert first.medium == GPU  # no medium before HiCache events
    source = EngineSource()
    feed(source, ARRAY_LIVE[: TRUTH["array"]["last_seq"] + 1])
    assert engine_hashes(source) == set(TRUTH["array"]["gpu_hashes"])
    assert set(source.held()[0]) == keys("A", "B", blocks=TRUTH["array"]["gpu_blocks"])
    feed(source, ARRAY_LIVE[TRUTH["array"]["last_seq"] + 1 :])
    assert source.held() == {} and source.refused == {}


# ---------------------------------------------------------------- gaps and restarts


def test_a_lost_batch_is_filled_from_sglangs_replay() -> None:
    source = EngineSource()
    feed(source, LIVE[:3])
    feed(source, LIVE[4 : LAST + 1])  # batch 3 was lost
    assert source.wanted_replay() == 3
    take_replay(source, REPLAY_FROM_3, 1.0)
    assert source.wanted_replay() is None and source.out_of_sync_since_s is None
    assert set(source.held()[0]) == GPU_KEYS


def test_a_replay_that_begins_past_the_gap_leaves_no_false_credit() -> None:
    source = EngineSource()
    feed(source, LIVE[:3])
    feed(source, LIVE[6 : LAST + 1])  # 3..5 lost; the replay kept only 5 on
    take_replay(source, REPLAY_FROM_3[2:], 2.0)
    assert source.counts["out_of_sync"] == 1
    assert source.out_of_sync_since_s == 2.0 and source.wanted_replay() is None
    assert set(source.held().get(0, [])) <= GPU_KEYS  # whatever it holds, the engine holds


def test_an_engine_restart_starts_the_source_over() -> None:
    source = EngineSource()
    feed(source, LIVE[:5])
    feed(source, LIVE[:1])  # seq 0 again: a new engine process
    assert source.counts["restarts"] == 1
    assert set(source.held()[0]) == keys("A")


# ---------------------------------------------------------------- shapes SGLang sends


def payload(events: list[Any], *tail: Any) -> bytes:
    out: bytes = msgpack.packb([1.5, events, *tail], use_bin_type=True)
    return out


PAGE = {
    "type": "BlockStored",
    "block_hashes": [11],
    "parent_block_hash": None,
    "token_ids": [1, 2, 3, 4],
    "block_size": 4,
    "lora_id": None,
    "medium": "GPU",
}


def stored(**fields: Any) -> EngineStored:
    ev = decode_payload(0, payload([{**PAGE, **fields}])).events[0]
    assert isinstance(ev, EngineStored)
    return ev


def test_versions_of_the_batch_and_event_shapes() -> None:
    assert decode_payload(0, payload([])).data_parallel_rank is None  # [ts, events]
    assert decode_payload(0, payload([], 3)).data_parallel_rank == 3
    positional = [
        "BlockStored",
        [11],
        None,
        [1, 2, 3, 4],
        4,
        None,
        "CPU_PINNED",
        {"cache_salt": "t"},
    ]
    ev = decode_payload(0, payload([positional])).events[0]
    assert isinstance(ev, EngineStored) and ev.medium == CPU
    assert ev.extra_keys == ((("sglang-cache-salt", "t"),),)
    removed = decode_payload(0, payload([["BlockRemoved", [11, 12]]])).events[0]
    assert removed == EngineRemoved((11, 12), 0, GPU)
    assert stored(medium="DISK").medium == "DISK"  # no source takes it
    assert stored(token_ids=[]).token_ids == ()  # no tokens: unkeyed


def test_extras_make_keys_of_their_own_and_odd_pages_are_never_credited() -> None:
    plain = EngineSource().keys.store(stored())
    assert plain == block_keys([1, 2, 3, 4], 4)
    for ev in (
        stored(cache_salt="tenant"),
        stored(metadata={"cache_salt": "t"}),
        stored(lora_id=3),
    ):
        assert not set(EngineSource().keys.store(ev)) & set(plain)
    bigram = stored(token_ids=[[1, 2], [2, 3], [3, 4], [4, 5]])  # EAGLE bigram page
    mamba = stored(type="BlockStoredWithComponentType", component_type="mamba")
    swa = stored(type="BlockStoredWithComponentType", component_type="swa")
    assert bigram.token_ids == () and mamba.token_ids == () and mamba.group_idx == 2
    assert swa.group_idx == 1 and swa.token_ids == (1, 2, 3, 4)
    assert EngineSource().keys.store(bigram) == [None]


def test_the_empty_root_keys_hash_is_no_parent() -> None:
    assert hash(()) == ROOT_PARENT_HASH
    assert stored(parent_block_hash=hash(())).parent_block_hash is None
    assert stored(parent_block_hash=-5).parent_block_hash == -5  # signed int64 hashes


# ---------------------------------------------------------------- hostile output


def live(events: Any, ts: Any = 1.0, dp: Any = 0) -> list[bytes]:
    return [b"", (0).to_bytes(8, "big"), msgpack.packb([ts, events, dp], use_bin_type=True)]


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        ([b"", b"\0" * 8], "bad_frame"),
        ([b"", b"\0" * 7, b"\x90"], "bad_frame"),
        ([b"", b"\0" * 8, "text"], "bad_frame"),
        ([b"", b"\0" * 8, b"\xc1"], "bad_msgpack"),
        ([b"", b"\0" * 8, b"\x92\xcb"], "bad_msgpack"),  # truncated
        (live([{"type": "BlockMoved"}]), "unknown_event"),
        (live([["BlockMoved", [1]]]), "unknown_event"),
        (live([["BlockStored", [1]]]), "bad_event"),  # too few fields
        (live([["BlockRemoved", [1], "GPU", 7]]), "bad_event"),  # an odd trailing field
        (live([3]), "bad_event"),
        (live([{**PAGE, "block_hashes": []}]), "bad_field"),
        (live([{**PAGE, "block_hashes": [1.5]}]), "bad_field"),
        (live([{**PAGE, "block_hashes": [b""]}]), "bad_field"),
        (live([{**PAGE, "token_ids": [1, 2, 3]}]), "bad_field"),  # 3 tokens, a page of 4
        (live([{**PAGE, "token_ids": ["a", "b", "c", "d"]}]), "bad_field"),
        (live([{**PAGE, "token_ids": [-1, 2, 3, 4]}]), "bad_field"),
        (live([{**PAGE, "block_size": 0}]), "bad_field"),
        (live([{**PAGE, "medium": 7}]), "bad_field"),
        (live([{**PAGE, "lora_id": "x"}]), "bad_field"),
        (live([{**PAGE, "metadata": [1]}]), "bad_field"),
        (live([{**PAGE, "component_type": "moe"}]), "bad_field"),
        (live({"events": []}), "bad_batch"),
        (live([], ts="now"), "bad_batch"),
        (live([], dp=-1), "bad_batch"),
        (live([{"type": "AllBlocksCleared"}] * 70_000), "too_large"),
    ],
)
def test_hostile_output_is_refused_counted_and_changes_nothing(
    message: list[bytes], reason: str
) -> None:
    source = EngineSource()
    feed(source, LIVE[:2])
    before = (source.held(), source.expected, dict(source.live))
    assert take_live(source, message, 0.0) == []
    assert source.refused == {reason: 1}
    assert (source.held(), source.expected, dict(source.live)) == before
    with pytest.raises(WireError, match=reason):
        decode_live(message)


# ---------------------------------------------------------------- /metrics

PAGE_TEXT = """# HELP sglang:max_total_num_tokens Maximum total number of tokens
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{model_name="m",tp_rank="0",dp_rank="0"} 20480.0
sglang:max_total_num_tokens{model_name="m",tp_rank="1",dp_rank="0"} 1.0
sglang:max_total_num_tokens{model_name="m",tp_rank="0",dp_rank="1"} 20480.0
# TYPE sglang:num_used_tokens gauge
sglang:num_used_tokens{model_name="m",tp_rank="0",dp_rank="0"} 5120.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m",tp_rank="0",dp_rank="0"} 0.25
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="m",tp_rank="0",dp_rank="0"} 0.4
# TYPE sglang:hicache_host_used_tokens gauge
sglang:hicache_host_used_tokens{model_name="m",tp_rank="0",dp_rank="0"} 7296.0
# TYPE sglang:hicache_host_total_tokens gauge
sglang:hicache_host_total_tokens{model_name="m",tp_rank="0",dp_rank="0"} 41024.0
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m",tp_rank="0",dp_rank="0"} 3.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m",tp_rank="0",dp_rank="0"} 1.0
# TYPE sglang:page_size gauge
sglang:page_size{model_name="m",tp_rank="0",dp_rank="0"} 64.0
# TYPE process_start_time_seconds gauge
process_start_time_seconds 1.7962e+09
"""


def test_the_metrics_page_gives_what_sglang_publishes_in_tokens() -> None:
    pages = parse_sglang_metrics(PAGE_TEXT)
    m = pages["0"]
    assert m.max_total_num_tokens == 20480  # tp_rank 1's sample skipped
    assert m.num_used_tokens == 5120 and m.token_usage == 0.25  # 5120 / 20480
    assert m.cache_hit_rate == 0.4 and (m.num_running_reqs, m.num_queue_reqs) == (3, 1)
    assert (m.hicache_host_used_tokens, m.hicache_host_total_tokens) == (7296, 41024)
    assert m.host_usage == pytest.approx(7296 / 41024)
    assert m.page_size == 64 and m.max_total_num_tokens // m.page_size == 320  # blocks
    assert m.process_start_time_s == pytest.approx(1.7962e09)
    other = pages["1"]  # a second data-parallel rank: only its pool size is on the page
    assert other.max_total_num_tokens == 20480
    assert other.num_used_tokens is None and other.host_usage is None  # unknown, not 0


@pytest.mark.parametrize(
    "page",
    [
        "<html>502</html>",
        "sglang:token_usage 1.5\n",
        "sglang:cache_hit_rate 2\n",
        "sglang:num_used_tokens -1\n",
        "sglang:num_used_tokens NaN\n",
        "sglang:hicache_host_used_tokens 9\nsglang:hicache_host_total_tokens 4\n",
    ],
)
def test_a_garbage_metrics_page_is_refused(page: str) -> None:
    with pytest.raises(MetricsError):
        parse_sglang_metrics(page)


# ---------------------------------------------------------------- a stand-in publisher


def receive(sock: zmq.Socket[bytes], until: Any, deadline: float) -> list[list[bytes]]:
    """Messages until `until(message)` is true; fails at the deadline."""
    out: list[list[bytes]] = []
    while time.monotonic() < deadline:
        if sock.poll(timeout=50):
            m = sock.recv_multipart()
            out.append(m)
            if until(m):
                return out
    raise AssertionError(f"timed out after {len(out)} messages")


def test_a_stand_in_sglang_publisher_over_zmq_with_a_replay_after_a_skipped_message() -> None:
    """The test binds a SUB, the stand-in's PUB connects to it (as SGLang's does to an
    endpoint without a wildcard) and sends the fixture's batches 0..7; the source skips
    seq 3 on purpose, asks the stand-in's ROUTER to replay from 3, and ends with the
    engine's live set."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    standin = StandInProcess(
        "sglang_publisher.py",
        "--connect", f"tcp://127.0.0.1:{port}",
        "--frames", str(FIXTURES / "map-live.msgpack"),
        "--count", str(LAST + 1),
    )  # fmt: skip
    deadline = time.monotonic() + 15.0
    try:
        replay_at = standin.line(10.0)
        assert replay_at.startswith("REPLAY tcp://127.0.0.1:")
        receive(sub, lambda m: m[0] == b"standin-hello", deadline)  # the link is up
        standin.say("go")
        got = receive(sub, lambda m: m[1:2] == [LAST.to_bytes(8, "big")], deadline)
        messages = [m for m in got if m[0] != b"standin-hello"]
        assert messages == LIVE[: LAST + 1]  # byte for byte, in order

        source = EngineSource()
        for m in messages:
            if m[1] != (3).to_bytes(8, "big"):  # lost on purpose
                take_live(source, m, 1.0)
        assert source.wanted_replay() == 3

        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(replay_at.split()[1])
        dealer.send_multipart(replay_request(3))
        answer = receive(dealer, lambda m: m[1:2] == [END], deadline)
        dealer.close()
        assert all(len(m) == 3 and m[0] == b"" for m in answer)  # no topic frame
        assert [m[1] for m in answer[:-1]] == [s.to_bytes(8, "big") for s in range(3, LAST + 1)]

        take_replay(source, answer, 2.0)
        assert source.wanted_replay() is None and source.out_of_sync_since_s is None
        assert source.counts["applied"] == LAST + 1 and source.refused == {}
        assert engine_hashes(source) == set(TRUTH["map"]["gpu_hashes"])
        assert set(source.held()[0]) == GPU_KEYS
    finally:
        standin.stop()
        sub.close()
        ctx.term()

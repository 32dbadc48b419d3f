"""Block events read from vLLM's own bytes, the journal's compaction, the index's matches,
and the router's choice (precise_prefix) over them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvfold.admission import AdmissionPolicy, AdmissionRequest, Outcome, Router
from kvfold.blockindex.feed import IndexFeed, Replica
from kvfold.blockindex.index import BlockIndex
from kvfold.kvevents.events import (
    GPU,
    HOST,
    RANK,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Envelope,
    EventBatch,
    EventError,
    decode_batch,
    decode_envelope,
    encode_batch,
    encode_envelope,
)
from kvfold.kvevents.journal import EventJournal
from kvfold.kvevents.snapshot import Snapshot
from kvfold.topology import Topology
from kvfold.worker.hashing import block_keys
from tests.unit.test_admission import make_view

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-kv-events"  # README there
FIXTURE_FILES = (
    "batches-int-hashes.json",
    "batches-bytes-hashes.json",
    "batches-int-hashes-vllm-0.11.json",
)


def _steps(name: str) -> list[dict]:  # type: ignore[type-arg]
    return json.loads((FIXTURES / name).read_text())["steps"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", FIXTURE_FILES)
def test_vllm_batches_replay_to_what_vllm_held(name: str) -> None:
    """vLLM's own bytes, both encodings and both hash kinds: after each step the index
    holds exactly the hashes vLLM said it held."""
    idx = BlockIndex([0])
    as_bytes = "bytes" in name
    for step in _steps(name):
        batch = decode_batch(bytes.fromhex(step["payload"]))
        assert [type(e).__name__ for e in batch.events] == step["events"]
        idx.apply((RANK, 0), batch.events)
        want = {bytes.fromhex(h) if as_bytes else h for h in step["cached_after"]}
        assert idx.keys_of((RANK, 0)).get(0, set()) == want, step["step"]


def test_vllm_zmq_frames_carry_the_same_batches() -> None:
    frames = json.loads((FIXTURES / "zmq-int-hashes.json").read_text())["sub_frames"]
    steps = _steps("batches-int-hashes.json")
    for i, (_topic, seq, payload) in enumerate(frames):
        assert int(seq, 16) == i
        assert decode_batch(bytes.fromhex(payload)) == decode_batch(
            bytes.fromhex(steps[i]["payload"])
        )


def test_bad_batches_are_refused_by_name() -> None:
    for data, words in [
        (b"\xc1", "not msgpack"),
        (encode_batch(EventBatch(0.0, ())) + b"x", "not msgpack"),
        (b"\x93\xa1x\x90\xc0", "ts must be a number"),
        (b"\x93\x00\x91\x81\xa4type\xa3Foo\xc0", "unknown event type"),
    ]:
        with pytest.raises(EventError, match=words):
            decode_batch(data)
    with pytest.raises(EventError, match="source kind"):
        decode_envelope(encode_envelope(Envelope("gpu", 0, 1, 1)))


def test_our_events_round_trip_in_vllm_shape() -> None:
    batch = EventBatch(
        1.5,
        (
            BlockStored((b"a" * 32, b"b" * 32), None, 16, GPU, 1, 128),
            BlockRemoved((7,), "CPU", 0),
            AllBlocksCleared(),
        ),
        3,
    )
    assert decode_batch(encode_batch(batch)) == batch
    env = Envelope(HOST, 2, 9, 4, batch)
    assert decode_envelope(encode_envelope(env)) == env


def test_journal_compacts_within_a_batch_and_keeps_true_parents() -> None:
    j = EventJournal([None], 4)
    j.stored(None, [b"k1", b"k2", b"k3"], b"k0")
    j.removed(None, b"k2")  # stored and removed: cancels
    j.removed(None, b"old")  # held before: reported removed
    j.removed(None, b"again")
    j.stored(None, [b"again"], None)  # removed then stored: nothing
    events = j.drain()
    assert events == [
        BlockRemoved((b"old",), GPU, 0),
        BlockStored((b"k1",), b"k0", 4, GPU, 0, None),
        BlockStored((b"k3",), b"k2", 4, GPU, 0, None),
    ]
    assert j.drain() == [] and not j


def test_a_lost_last_batch_is_noticed_by_the_next_heartbeat() -> None:
    feed = IndexFeed(BlockIndex([0, 0]))
    stored = (BlockStored((b"a",), None, 4),)
    assert feed.ingest(Envelope(RANK, 1, 5, 1, EventBatch(0.0, stored))) == "applied"
    # batch 2 is lost; nothing follows it but the source's heartbeat at seq 2
    assert feed.ingest(Envelope(RANK, 1, 5, 2, EventBatch(0.0, ()))) == "heartbeat"
    assert feed.wanted() == [(RANK, 1)]
    feed.install(Snapshot(RANK, 1, 5, 2, {0: [b"a", b"b"]}, {0: None}))
    assert feed.wanted() == [] and feed.index.keys_of((RANK, 1)) == {0: {b"a", b"b"}}


def test_batches_kept_while_out_of_sync_apply_after_the_snapshot() -> None:
    feed = IndexFeed(BlockIndex([0]))
    ev = [EventBatch(0.0, (BlockStored((k,), None, 4),)) for k in (b"a", b"b", b"c", b"d")]
    feed.ingest(Envelope(RANK, 0, 1, 1, ev[0]))
    assert feed.ingest(Envelope(RANK, 0, 1, 3, ev[2])) == "kept"  # 2 lost
    assert feed.ingest(Envelope(RANK, 0, 1, 4, ev[3])) == "kept"
    feed.install(Snapshot(RANK, 0, 1, 2, {0: [b"a", b"b"]}, {0: None}))
    assert feed.index.keys_of((RANK, 0)) == {0: {b"a", b"b", b"c", b"d"}}
    assert not feed.wanted()
    replica = Replica([0])
    cursor, ops = feed.snapshot_ops()
    replica.take(cursor, ops, whole=True)
    assert replica.index.keys_of((RANK, 0)) == feed.index.keys_of((RANK, 0))


def test_match_walks_gpu_then_host_like_the_cache() -> None:
    """Ranks 0, 1 on node 0 and rank 2 on node 1; keys k0..k5 of a 6-block prompt."""
    idx = BlockIndex([0, 0, 1])
    keys = [bytes([i]) * 32 for i in range(6)]
    stored = (BlockStored(tuple(keys[:3]), None, 4),)
    idx.apply((RANK, 0), stored)
    idx.apply((RANK, 1), (BlockStored(tuple(keys[:1]), None, 4),))
    idx.apply((HOST, 0), (BlockStored(tuple(keys[1:5]), None, 4, "CPU"),))
    idx.apply((RANK, 2), (BlockStored((keys[1],), keys[0], 4),))  # not from the first
    m = idx.match(keys, prompt_tokens=6 * 4 + 1)
    assert m.gpu.tolist() == [3, 1, 0]
    assert m.total.tolist() == [5, 5, 0]  # host continues each GPU run on node 0
    m = idx.match(keys, prompt_tokens=6 * 4)  # the last token is always computed
    assert m.total.tolist() == [5, 5, 0]
    idx.clear((HOST, 0))
    assert idx.match(keys, 25).total.tolist() == [3, 1, 0]


def test_match_over_many_ranks_uses_the_bit_path() -> None:
    n = 300
    idx = BlockIndex([r // 8 for r in range(n)])
    keys = [i.to_bytes(8, "little") for i in range(20)]
    for r in range(n):
        idx.store((RANK, r), 0, keys[: r % 20])
    idx.windows[0], idx.block_size = None, 4
    m = idx.match(keys, 20 * 4 + 1)
    assert m.gpu.tolist() == [r % 20 for r in range(n)]


def _policy_with_index(
    router: Router, used: dict[int, int] | None = None
) -> tuple[AdmissionPolicy, list[bytes]]:
    """Four ranks of 128 blocks; rank 0 holds the prompt's first 60 blocks, rank 3 its
    first 20, on their GPUs."""
    used = used if used is not None else dict.fromkeys(range(4), 40)
    view = make_view(Topology.from_mapping([0, 0, 1, 1]), used=used, total=128)
    policy = AdmissionPolicy(router=router)
    policy.load_view(view, 0.0)
    keys = block_keys(np.arange(64 * 4 + 1), 4)
    replica = Replica([0, 0, 1, 1])
    replica.index.apply((RANK, 0), (BlockStored(tuple(keys[:60]), None, 4),))
    replica.index.apply((RANK, 3), (BlockStored(tuple(keys[:20]), None, 4),))
    policy.blocks = replica
    return policy, keys


def test_precise_router_takes_the_longest_prefix_when_it_has_room() -> None:
    policy, keys = _policy_with_index(Router.PRECISE_PREFIX)  # equal load everywhere
    d = policy.decide(AdmissionRequest("a", 30 * 4 + 1, 1, tuple(keys[:30])), 0.0)
    assert (d.outcome, d.rank, d.prefix_blocks, d.reason) == (Outcome.ADMIT, 0, 30, "fits_prefix")
    d = policy.decide(AdmissionRequest("b", 10 * 4 + 1, 1, tuple(keys[:10])), 0.0)
    assert d.rank in (0, 3) and d.prefix_blocks == 10  # both hold all of it


def test_precise_router_never_picks_a_rank_without_room() -> None:
    policy, keys = _policy_with_index(Router.PRECISE_PREFIX, used={0: 100})
    big = AdmissionRequest("b", 64 * 4 + 1, 1, tuple(keys))  # 66 blocks; rank 0 has 28
    d = policy.decide(big, 0.0)
    assert (d.outcome, d.rank, d.prefix_blocks) == (Outcome.ADMIT, 3, 20)
    d = policy.decide(AdmissionRequest("c", 64 * 4 + 1, 1, tuple(keys)), 0.0)
    assert d.rank in (1, 2) and d.prefix_blocks == 0  # rank 3 is promised now (62 left)
    d = policy.decide(AdmissionRequest("d", 64 * 4 + 1, 1, tuple(keys)), 0.0)
    d = policy.decide(AdmissionRequest("e", 64 * 4 + 1, 1, tuple(keys)), 0.0)
    assert d.outcome is Outcome.QUEUE  # nowhere left, however much rank 0 holds


def test_a_tie_that_rounding_would_split_goes_to_the_most_room() -> None:
    """With the default weights (w 4, onboard 0.06: a host block weighs 3.76, not exact in
    binary) rank 0 (load 0, nothing on its GPU, 3 blocks its host tier can onboard) and
    rank 1 (load 5, 1 block on its GPU, 3 more on its host tier) cost the same:
    0 - 5 x 0 - 3.76 x 3 = 5 - 5 x 1 - 3.76 x 3. In floats the second comes out an ulp
    lower; the tie must still go to the most room, rank 0's."""
    view = make_view(Topology.from_mapping([0, 1]), used={1: 5}, total=128)
    policy = AdmissionPolicy(router=Router.PRECISE_PREFIX)
    policy.load_view(view, 0.0)
    keys = block_keys(np.arange(5 * 4 + 1), 4)
    replica = Replica([0, 1])
    replica.index.apply((RANK, 1), (BlockStored(tuple(keys[:1]), None, 4),))
    replica.index.apply((HOST, 0), (BlockStored(tuple(keys[:3]), None, 4, medium="CPU"),))
    replica.index.apply((HOST, 1), (BlockStored(tuple(keys[1:4]), None, 4, medium="CPU"),))
    policy.blocks = replica
    d = policy.decide(AdmissionRequest("a", 5 * 4 + 1, 1, tuple(keys[:5])), 0.0)
    assert (d.outcome, d.rank, d.prefix_blocks) == (Outcome.ADMIT, 0, 3)


def test_other_routers_choose_among_ranks_that_fit() -> None:
    for router in Router:
        policy, keys = _policy_with_index(router, used={0: 100})
        ranks = []
        for i in range(3):
            d = policy.decide(AdmissionRequest(f"r{i}", 30 * 4, 1, tuple(keys[:30])), 0.0)
            assert d.outcome is Outcome.ADMIT and d.rank != 0, (router, d)  # 0 has 28 left
            ranks.append(d.rank)
        if router is Router.ROUND_ROBIN:
            assert ranks == [1, 2, 3]


def test_a_prompt_just_sent_counts_as_held_until_the_index_shows_it() -> None:
    """Two requests with one prefix, the second decided before the first's blocks reach
    the index: it follows the first (SentPrefixes), and only within the TTL."""
    view = make_view(Topology.from_mapping([0, 0, 1, 1]), total=128)
    keys = block_keys(np.arange(40 * 4 + 1), 4)
    for later_s, expect_same in ((0.5, True), (5.0, False)):
        policy = AdmissionPolicy(router=Router.PRECISE_PREFIX)
        policy.load_view(view, 0.0)
        policy.blocks = Replica([0, 0, 1, 1])  # the index knows nothing yet
        first = policy.decide(AdmissionRequest("a", 40 * 4 + 1, 1, tuple(keys)), 0.0)
        second = policy.decide(AdmissionRequest("b", 40 * 4 + 1, 1, tuple(keys)), later_s)
        assert (second.rank == first.rank) is expect_same, (later_s, first, second)
        assert second.prefix_blocks == (40 if expect_same else 0)


def test_a_key_another_block_holds_is_not_reported_again() -> None:
    """Block 0 holds key k; keying block 1 with k again is skipped. When block 0 is
    evicted, the pool no longer holds k, and the batch must say so."""
    from kvfold.worker.block_pool import BlockPool

    pool = BlockPool(2)
    pool.journal, pool.window = EventJournal([None], 4), None
    b0 = pool.take(1)
    assert b0 is not None
    pool.set_keys(b0, [b"k"])
    pool.release(b0)
    pool.journal.drain()  # the index now holds k
    b1 = pool.take(1)
    assert b1 is not None and b1 != b0
    pool.set_keys(b1, [b"k", b"x"])  # k is taken by block 0: skipped
    assert pool.take(1) == b0  # block 0, cached, is evicted: k is gone from the pool
    assert b"k" not in pool.key_to_block
    assert BlockRemoved((b"k",), GPU, 0) in pool.journal.drain()


def test_a_snapshot_older_than_what_was_applied_is_ignored() -> None:
    """Incarnation 1 answers a snapshot request, then restarts as 2, whose first batch is
    applied before the old snapshot arrives: the old snapshot changes nothing."""
    feed = IndexFeed(BlockIndex([0]))
    feed.ingest(Envelope(RANK, 0, 1, 3, EventBatch(0.0, (BlockStored((b"old",), None, 4),))))
    assert feed.wanted() == [(RANK, 0)]
    feed.ingest(Envelope(RANK, 0, 2, 1, EventBatch(0.0, (BlockStored((b"new",), None, 4),))))
    assert not feed.install(Snapshot(RANK, 0, 1, 3, {0: [b"old"]}, {0: None}, 4))
    assert feed.index.keys_of((RANK, 0)) == {0: {b"new"}} and not feed.wanted()
    assert feed.counts["stale_snapshot"] == 1


def test_a_replica_of_a_feed_that_started_again_is_rebuilt() -> None:
    """An aggregator restart starts a new feed: its cursor means another log."""
    old, new = IndexFeed(BlockIndex([0])), IndexFeed(BlockIndex([0]))
    stored = EventBatch(0.0, (BlockStored((b"a",), None, 4),))
    old.ingest(Envelope(RANK, 0, 1, 1, stored))
    replica = Replica([0])
    replica.take(*old.snapshot_ops(), whole=True)
    for seq in (1, 2, 3):  # the new feed has more ops than the old one had
        new.ingest(
            Envelope(RANK, 0, 7, seq, EventBatch(0.0, (BlockStored((bytes([seq]),), None, 4),)))
        )
    assert new.since(replica.cursor)[1] is None  # not ops 2.. of another log


def test_a_host_key_after_every_gpu_run_adds_nothing() -> None:
    idx = BlockIndex([0, 0])
    keys = [bytes([i]) * 8 for i in range(5)]
    idx.apply((RANK, 0), (BlockStored((keys[0],), None, 4),))
    idx.apply((HOST, 0), (BlockStored((keys[3],), None, 4, "CPU"),))
    m = idx.match(keys, 5 * 4 + 1)
    assert m.total.tolist() == [1, 0] and m.longest == 1


def test_after_a_clear_a_key_removed_and_stored_again_is_stored() -> None:
    j = EventJournal([None], 4)
    j.cleared()
    j.removed(None, b"k")
    j.stored(None, [b"k"], None)
    assert j.drain() == [AllBlocksCleared(), BlockStored((b"k",), None, 4, GPU, 0, None)]


def test_a_host_source_on_a_node_without_ranks_is_refused() -> None:
    idx = BlockIndex([0, 0, 2])  # node 1 has no rank
    with pytest.raises(ValueError, match="unknown source"):
        idx.check_source((HOST, 1))

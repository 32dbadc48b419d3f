"""The cluster block index through the running system: real rank actors (full attention
and a sliding window, small pools: evictions, offloads to the nodes' host tiers) publish
their block events through their node actors to a rack actor per node, which keeps its
node's shard of the index (the fleet-scale path: docs/scale.md); after a quiescent
interval the index, and a replica a client keeps from every shard's op log, equal the
ranks' and host tiers' own key sets. Then the index must heal on its own: a rack restarts
(an empty shard; its sources are resynchronised from snapshots), the aggregator restarts
(the shards keep the index), a rank restarts (its old keys leave). The aggregator's own
index heals after its restart in tests/faults/test_faults.py."""

from __future__ import annotations

import contextlib
import pickle
import random
from typing import Any

import pytest
import ray
from ray.exceptions import RayError

from kvfold.aggregator.client import KVFoldClient
from kvfold.errors import AggregatorUnavailable, NodeUnavailable, RankUnavailable
from kvfold.kvevents.events import HOST, RANK
from kvfold.naming import AGGREGATOR_NAME
from tests.integration.conftest import running, wait_until
from tests.unit.builders import make_config

pytestmark = pytest.mark.integration

B = 4
CACHE = make_config(
    {None: 24, 32: 16},
    windows=(None, 32),
    tokens_per_block=B,
    num_kv_heads=1,
    head_dim=4,
    dtype="float16",
    device="auto",
)
PREFIXES = [list(range(1000, 1000 + 6 * B)), list(range(2000, 2000 + 3 * B)), []]


@pytest.fixture(scope="module")
def kv():  # type: ignore[no-untyped-def]
    with running(
        2, 2, 3, cache=CACHE, host_num_blocks=20, report_interval_s=0.05, nodes_per_rack=1
    ) as (_, dep):
        dep.wait_until_fresh()
        yield dep


def _truth(kv: Any) -> dict[tuple[str, int], dict[int, frozenset[bytes]]]:
    """Every source's own keys, asked of the actors themselves (through the client)."""
    out = {(RANK, r): kv.client.held_keys(r) for r in range(kv.topology.world_size)}
    out.update({(HOST, n): kv.client.host_keys(n) for n in range(kv.topology.num_nodes)})
    return out


def _indexed(kv: Any, source: tuple[str, int]) -> dict[int, frozenset[bytes]]:
    return kv.client.indexed_keys(*source)  # type: ignore[no-any-return]


def _settle(kv: Any) -> None:
    """Publish everything now (the loops do it every interval anyway)."""
    ray.get([h.report_now.remote() for h in kv.rank_handles])
    ray.get([h.publish_events.remote() for h in kv.node_handles])


def _index_equals_truth(kv: Any) -> bool:
    try:
        _settle(kv)
        truth = _truth(kv)
        return all(_indexed(kv, s) == keys for s, keys in truth.items())
    except (RayError, AggregatorUnavailable, RankUnavailable, NodeUnavailable):
        return False  # an actor restarting: ask again


def _drive(kv: Any, rng: random.Random, n_ops: int, tag: str) -> None:
    live: list[list[str]] = [[], [], []]
    for i in range(n_ops):
        r = rng.randrange(3)
        h = kv.rank_handles[r]
        op = rng.random()
        if op < 0.45 or not live[r]:
            sid = f"{tag}{i}"
            suffix = [rng.randrange(50_000) for _ in range(rng.randrange(1, 30))]
            prompt = rng.choice(PREFIXES) + suffix
            if ray.get(h.add_sequence.remote(sid, prompt)):
                live[r].append(sid)
        elif op < 0.7:
            sid = rng.choice(live[r])
            ray.get(h.append_tokens.remote(sid, [7] * rng.randrange(1, 9)))
        else:
            ray.get(h.free_sequence.remote(live[r].pop(rng.randrange(len(live[r])))))
    for r, sids in enumerate(live):  # leave the keys cached, the blocks free
        for sid in sids:
            ray.get(kv.rank_handles[r].free_sequence.remote(sid))


def test_index_equals_every_sources_keys_after_random_work(kv: Any) -> None:
    _drive(kv, random.Random(16), 150, "a")
    wait_until(lambda: _index_equals_truth(kv), timeout_s=60)
    truth = _truth(kv)
    assert any(truth[(HOST, n)] for n in range(2)), "the pools were meant to offload"
    replica = kv.client.index()  # a read-only replica, kept from the op log
    for source, keys in truth.items():
        assert replica.keys(*source) == keys, source


def test_the_index_answers_what_a_prompt_finds_on_each_rank(kv: Any) -> None:
    prompt = list(range(90_000, 90_000 + 5 * B + 1))  # 5 full blocks + 1 token, all new
    before = kv.client.index()
    assert before.match(prompt).longest == 0
    assert kv.rank(0).add_sequence("probe", prompt)
    kv.rank(0).free_sequence("probe")  # its 5 blocks stay cached, reusable
    wait_until(lambda: _index_equals_truth(kv), timeout_s=60)
    before.refresh()
    m = before.match(prompt)
    assert m.num_blocks == 5  # floor((21 - 1) / 4): the last token is always computed
    assert m.gpu == {0: 5}  # rank 0 alone holds it, in both window groups
    assert m.with_host[0] == 5
    # and the rank itself reuses what the index said (its own counters, both groups)
    before_counts = kv.rank(0).cumulative().windows
    assert kv.rank(0).add_sequence("again", prompt)
    after_counts = kv.rank(0).cumulative().windows
    kv.rank(0).free_sequence("again")
    for w, d in after_counts.items():
        assert d.reused_blocks - before_counts[w].reused_blocks == m.gpu[0], w
    with pytest.raises(ValueError, match=r"rank must be 0\.\.2, got 7"):
        kv.client.held_keys(7)


def test_the_index_outlives_an_aggregator_restart_in_its_racks(kv: Any) -> None:
    """The racks keep the index here (its shards): the aggregator restarting loses none
    of it, and no source needs a snapshot for it."""
    _drive(kv, random.Random(17), 60, "b")
    wait_until(lambda: _index_equals_truth(kv), timeout_s=60)
    snapshots = kv.client.block_index_counts()["snapshots"]
    agg = ray.get_actor(AGGREGATOR_NAME, namespace=kv.namespace)
    ray.kill(agg, no_restart=False)
    _drive_when_up(kv, random.Random(170), "b2")
    wait_until(lambda: _index_equals_truth(kv), timeout_s=90, interval_s=0.2)
    counts = kv.client.block_index_counts()
    assert counts["snapshots"] == snapshots and counts["out_of_sync"] == []


def test_a_restarted_ranks_old_keys_leave_the_index(kv: Any) -> None:
    _drive(kv, random.Random(18), 60, "c")
    wait_until(lambda: _index_equals_truth(kv), timeout_s=60)
    assert _indexed(kv, (RANK, 1)), "rank 1 was meant to hold keys"
    ray.kill(kv.rank_handles[1], no_restart=False)  # comes back empty, a new incarnation
    wait_until(lambda: _index_equals_truth(kv) and not _indexed(kv, (RANK, 1)), timeout_s=90)


def _sources(kv: Any) -> list[tuple[str, int]]:
    return [(RANK, r) for r in range(kv.topology.world_size)] + [
        (HOST, n) for n in range(kv.topology.num_nodes)
    ]


def _follower_equals_a_full_fetch(kv: Any, follower: KVFoldClient, replica: Any) -> bool:
    """The follower's view (kept from deltas) is the aggregator's whole view, and its
    index replica (kept from ops) holds what a replica rebuilt from a snapshot holds."""
    try:
        _settle(kv)
        replica.refresh()
        fresh = KVFoldClient(namespace=kv.namespace).index()  # from empty: a whole snapshot
        if any(replica.keys(*s) != fresh.keys(*s) for s in _sources(kv)):
            return False
        agg = ray.get_actor(AGGREGATOR_NAME, namespace=kv.namespace)
        whole = pickle.loads(ray.get(agg.view.remote(), timeout=10))
        return bool(follower.view() == whole)  # equal only at the same version: asked again
    except (RayError, AggregatorUnavailable, RankUnavailable, NodeUnavailable):
        return False  # an actor restarting: ask again


def test_followers_end_equal_to_a_full_fetch_through_restarts(kv: Any) -> None:
    """Random work and restarts of the aggregator, rack actors and node actors (which
    hold their ranks' event batches for a moment: lost ones resynchronise) and ranks, in
    a random order;
    a reader following deltas and ops all along ends where a full fetch is, each time."""
    rng = random.Random(19)
    follower = KVFoldClient(namespace=kv.namespace)
    replica = follower.index()
    assert len(kv.rack_handles) == 2, "every node pushes through a rack actor here"
    restarts = ["aggregator", "rack0", "rack1", "node0", "node1", "rank0", "rank2"]
    rng.shuffle(restarts)
    for step, what in enumerate(restarts):
        _drive(kv, rng, 30, f"f{step}")
        with contextlib.suppress(RayError, AggregatorUnavailable):
            follower.view()
            replica.refresh()  # the follower moves along while things change
        if what == "aggregator":
            ray.kill(ray.get_actor(AGGREGATOR_NAME, namespace=kv.namespace), no_restart=False)
        elif what.startswith("rack"):
            ray.kill(kv.rack_handles[int(what[4:])], no_restart=False)
        elif what.startswith("node"):
            ray.kill(kv.node_handles[int(what[4:])], no_restart=False)
        else:
            ray.kill(kv.rank_handles[int(what[4:])], no_restart=False)
        _drive_when_up(kv, rng, f"g{step}")
        wait_until(lambda: _index_equals_truth(kv), timeout_s=90, interval_s=0.2)
        wait_until(
            lambda: _follower_equals_a_full_fetch(kv, follower, replica),
            timeout_s=60,
            interval_s=0.1,
        )
    counts = kv.client.block_index_counts()
    assert counts["out_of_sync"] == [] and counts["snapshots"] >= 1


def _drive_when_up(kv: Any, rng: random.Random, tag: str) -> None:
    """Some work, once the restarted actor takes it (a kill lands a moment later)."""
    tries = iter(range(1_000))

    def drove() -> bool:
        try:
            _drive(kv, rng, 20, f"{tag}-{next(tries)}")
            return True
        except RayError:
            return False

    wait_until(drove, timeout_s=90, interval_s=0.2)


def test_a_rank_gone_for_good_leaves_its_racks_shard(kv: Any) -> None:
    """Last here: it leaves the world a rank short. Nothing of the rank's own says its
    keys are gone; the rack keeping them drops them by the aggregator's word on its nodes
    (`liveness_of`)."""
    _drive_when_up(kv, random.Random(19), "d")
    wait_until(lambda: _index_equals_truth(kv), timeout_s=60)
    gone = kv.topology.world_size - 1
    if not _indexed(kv, (RANK, gone)):  # give it keys of its own
        ray.get(
            kv.rank_handles[gone].add_sequence.remote("d-last", list(range(7000, 7000 + 3 * B)))
        )
        wait_until(lambda: _index_equals_truth(kv) and _indexed(kv, (RANK, gone)), timeout_s=60)
    ray.kill(kv.rank_handles[gone], no_restart=True)
    others = [s for s in _sources(kv) if s != (RANK, gone)]

    def left() -> bool:
        try:
            _settle_live(kv, gone)
            if _indexed(kv, (RANK, gone)):
                return False
            truth = {(RANK, r): kv.client.held_keys(r) for r in range(gone)}
            truth.update({(HOST, n): kv.client.host_keys(n) for n in range(kv.topology.num_nodes)})
            return all(_indexed(kv, s) == truth[s] for s in others)
        except (RayError, AggregatorUnavailable, RankUnavailable, NodeUnavailable):
            return False

    wait_until(left, timeout_s=90, interval_s=0.2)


def _settle_live(kv: Any, dead_rank: int) -> None:
    ray.get([h.report_now.remote() for r, h in enumerate(kv.rank_handles) if r != dead_rank])
    ray.get([h.publish_events.remote() for h in kv.node_handles])

"""The cluster block index through the running system: real rank actors (full attention
and a sliding window, small pools: evictions, offloads to the nodes' host tiers) publish
their block events to the aggregator; after a quiescent interval the index, and a
replica a client keeps from its op log, equal the ranks' and host tiers' own key sets.
Then the index must heal on its own: the aggregator restarts (empty index; the sources
are resynchronised from snapshots) and a rank restarts (its old keys leave)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import ray
from ray.exceptions import RayError

from kvfold.blockindex.events import HOST, RANK
from kvfold.blockindex.feed import Replica
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
    with running(2, 2, 3, cache=CACHE, host_num_blocks=20, report_interval_s=0.05) as (_, dep):
        dep.wait_until_fresh()
        yield dep


def _truth(kv: Any) -> dict[tuple[str, int], dict[int, set[bytes]]]:
    """Every source's own keys, asked of the actors themselves."""
    out = {}
    for r, h in enumerate(kv.rank_handles):
        out[(RANK, r)] = {g: set(k) for g, k in ray.get(h.reusable_keys.remote()).items() if k}
    for n, h in enumerate(kv.node_handles):
        out[(HOST, n)] = {g: set(k) for g, k in ray.get(h.host_keys.remote()).items() if k}
    return out


def _indexed(kv: Any, source: tuple[str, int]) -> dict[int, set[bytes]]:
    agg = ray.get_actor(AGGREGATOR_NAME, namespace=kv.namespace)
    keys = ray.get(agg.block_keys.remote(*source))
    return {g: set(k) for g, k in keys.items() if k}


def _settle(kv: Any) -> None:
    """Publish everything now (the loops do it every interval anyway)."""
    ray.get([h.report_now.remote() for h in kv.rank_handles])
    ray.get([h.publish_events.remote() for h in kv.node_handles])


def _index_equals_truth(kv: Any) -> bool:
    try:
        _settle(kv)
        truth = _truth(kv)
        return all(_indexed(kv, s) == keys for s, keys in truth.items())
    except RayError:  # an actor restarting: ask again
        return False


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
    replica = Replica(list(kv.topology.as_list()))
    cursor, ops, whole = kv.client.block_index_since(replica.cursor)
    replica.take(cursor, ops, whole)
    for source, keys in truth.items():
        assert replica.index.keys_of(source) == keys, source


def test_index_heals_after_the_aggregator_restarts(kv: Any) -> None:
    _drive(kv, random.Random(17), 60, "b")
    agg = ray.get_actor(AGGREGATOR_NAME, namespace=kv.namespace)
    ray.kill(agg, no_restart=False)
    wait_until(lambda: _index_equals_truth(kv), timeout_s=90, interval_s=0.2)
    counts = kv.client.block_index_counts()
    assert counts["snapshots"] >= 1 and counts["out_of_sync"] == []


def test_a_restarted_ranks_old_keys_leave_the_index(kv: Any) -> None:
    _drive(kv, random.Random(18), 60, "c")
    wait_until(lambda: _index_equals_truth(kv), timeout_s=60)
    assert _indexed(kv, (RANK, 1)), "rank 1 was meant to hold keys"
    ray.kill(kv.rank_handles[1], no_restart=False)  # comes back empty, a new incarnation
    wait_until(lambda: _index_equals_truth(kv) and not _indexed(kv, (RANK, 1)), timeout_s=90)

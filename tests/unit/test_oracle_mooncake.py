"""Oracle: the first 500 Mooncake requests, one at a time, on one rank without a host tier,
reuse and miss exactly as an independent offline LRU simulation says."""

from __future__ import annotations

from collections import OrderedDict

from kvfold.worker import KVCacheConfig, PagedKVCache
from kvfold.workload.traces import load_mooncake
from tests.traces import MOONCAKE

B = 64
CAPACITY = 4096


class OfflineLRU:
    """The reuse rules, restated over hash-id prefixes (no token hashing, no block ids).

    The key of block k is (hash_ids[: k*B // 512 + 1], k): the ids fix the tokens.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.cached: OrderedDict[tuple, None] = OrderedDict()  # type: ignore[type-arg]
        self.unkeyed = capacity  # free blocks without a key

    def run(self, hash_ids: list[int], length: int) -> tuple[int, int] | None:
        n = -(-length // B)
        if n > self.capacity:
            return None
        full = length // B
        reusable = (length - 1) // B
        keys = [(tuple(hash_ids[: k * B // 512 + 1]), k) for k in range(full)]
        hits = 0
        while hits < reusable and keys[hits] in self.cached:
            hits += 1
        for k in range(hits):
            del self.cached[keys[k]]  # in use: not evictable
        new = n - hits
        take_unkeyed = min(new, self.unkeyed)
        self.unkeyed -= take_unkeyed
        for _ in range(new - take_unkeyed):
            self.cached.popitem(last=False)  # evict the least recently released
        # new full blocks get keys unless another block already holds that key
        held_keys = set(keys[:hits])
        block_key: list[tuple | None] = []  # type: ignore[type-arg]
        for k in range(n):
            if k < hits:
                block_key.append(keys[k])
            elif k < full and keys[k] not in self.cached and keys[k] not in held_keys:
                block_key.append(keys[k])
                held_keys.add(keys[k])
            else:
                block_key.append(None)
        for key in reversed(block_key):  # released tail first
            if key is None:
                self.unkeyed += 1
            else:
                self.cached[key] = None
        return hits, n - hits


def test_first_500_requests_match_offline_lru_to_the_block() -> None:
    import json

    records = [json.loads(line) for line in MOONCAKE.read_text().splitlines()[:500]]
    requests = load_mooncake(MOONCAKE, limit=500)
    cache = PagedKVCache(
        KVCacheConfig(
            tokens_per_block=B,
            num_blocks=CAPACITY,
            num_layers=1,
            num_kv_heads=1,
            head_dim=1,
            device="cpu",
        )
    )
    oracle = OfflineLRU(CAPACITY)
    reused = missed = expected_reused = expected_missed = skipped = evicted = 0
    for rec, req in zip(records, requests, strict=True):
        want = oracle.run(rec["hash_ids"], rec["input_length"])
        ok = cache.add_sequence(req.request_id, req.prompt)
        assert ok == (want is not None)
        if want is None:
            skipped += 1
            continue
        d = cache.commit_iteration().total
        assert (d.reused_blocks, d.missed_blocks) == want, req.request_id
        reused += d.reused_blocks
        missed += d.missed_blocks
        evicted += d.evicted_blocks
        expected_reused += want[0]
        expected_missed += want[1]
        cache.free_sequence(req.request_id)
    cache.check_integrity()
    assert (reused, missed) == (expected_reused, expected_missed)
    assert reused > 500 and missed > 10_000 and evicted > 10_000  # hits, misses and evictions
    print(f"reused {reused}, missed {missed}, evicted {evicted}, skipped {skipped}")

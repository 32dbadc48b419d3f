"""The seed's stats facade, with the seed's semantics, over real kvfold parts:
free pages, the host utilization of a partial node, and the prefill trigger.

    python examples/seed_facade.py

No cluster needed: a real PagedKVCache and a real host pool stand behind the
`KVCacheManager(backend)` the seed's callers already use (kvfold.kv_manager).
"""

from __future__ import annotations

import numpy as np

from kvfold.hosttier import HostKVPool
from kvfold.kv_manager import (
    KVCacheManager,
    KVUtilizationRequest,
    PagedCacheBackend,
    RankStatusCounts,
    should_trigger_prefill,
)
from kvfold.stats import SequenceStatus
from kvfold.worker import KVCacheConfig, PagedKVCache

# One rank's GPU cache (64 pages of 16 tokens) and its node's host tier (32 pages).
cache = PagedKVCache(KVCacheConfig(tokens_per_block=16, num_blocks=64, device="auto"))
host = HostKVPool(num_blocks=32, slot_nbytes=4096, pin_memory=False)
manager = KVCacheManager(PagedCacheBackend(cache, host))

assert cache.add_sequence("a", list(range(100)))  # 7 pages
cache.set_status("a", SequenceStatus.IN_DECODE)
for i in range(8):  # 8 blocks offloaded to the host tier
    host.put(None, f"block-{i}".encode(), np.zeros(4096, dtype=np.uint8))
print(f"GPU free pages {manager.get_gpu_free_pages()} of 64, "
      f"host free pages {manager.get_host_free_pages()} of 32")  # fmt: skip
assert (manager.get_gpu_free_pages(), manager.get_host_free_pages()) == (57, 24)

# World size 10 on 4-GPU nodes: node 2 holds ranks 8 and 9 only (a partial node). Rank 9
# asks for its node's host utilization; the seed counts every rank of the node, clamped
# to the world size, in the statuses whose KV is in host memory.
counts = {
    8: {SequenceStatus.IN_DECODE: 3, SequenceStatus.ON_HOLD: 1},
    9: {SequenceStatus.PREFILLED: 2, SequenceStatus.IN_PREFILL: 5},  # IN_PREFILL: not host
    10: {SequenceStatus.IN_DECODE: 99},  # outside the world: never counted
}
batch = RankStatusCounts(counts)
request = KVUtilizationRequest(
    rank=9, world_size=10, local_rank=1, num_gpus_per_node=4, global_batch=batch
)
u = manager.get_host_utilization(request)
print(
    f"node {u.node_id} host: {u.num_used_pages}/{u.num_total_pages} pages used, "
    f"free {u.free_percent}% ; in host memory: {u.num_in_decode} decoding, "
    f"{u.num_onhold} on hold, {u.num_prefilled} prefilled ({u.num_valid_sequences} valid)"
)

# The seed's trigger: prefill when some node's host tier is freer than the watermark
# and work is waiting.
trigger = should_trigger_prefill([u], watermark_free_percent=50, has_queued=True)
print(f"trigger prefill: {trigger.should_trigger} (max host free {trigger.max_free_percent}% "
      f"> watermark 50%, work queued)")  # fmt: skip
quiet = should_trigger_prefill([u], watermark_free_percent=90, has_queued=True)
print(f"with a 90% watermark: {quiet.should_trigger}")
assert (u.node_id, u.num_valid_sequences, trigger.should_trigger) == (2, 6, True)
print("done")

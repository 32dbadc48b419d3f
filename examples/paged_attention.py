"""Attention over a paged KV cache equals dense attention, with a reused prefix.

Run: python examples/paged_attention.py
"""

import torch

from kvfold.worker import KVCacheConfig, PagedKVCache
from kvfold.worker.attention import dense_attention, paged_attention

cfg = KVCacheConfig(
    tokens_per_block=4,
    num_blocks=32,
    num_layers=2,
    num_kv_heads=2,
    head_dim=16,
    dtype="float32",
    device="auto",
)
cache = PagedKVCache(cfg)
torch.manual_seed(0)

# The first request computes a 12-token system prompt and writes its K/V.
system = list(range(100, 112))
assert cache.add_sequence("first", [*system, 1, 2, 3])
k = torch.randn(15, 2, 16)
v = torch.randn(15, 2, 16)
for layer in range(cfg.num_layers):
    cache.write_kv("first", layer, list(range(15)), k, v)
cache.free_sequence("first")
cache.commit_iteration()

# The second request shares the system prompt: its 3 blocks are reused, not recomputed.
assert cache.add_sequence("second", [*system, 7, 8])
print("reused blocks:", cache.commit_iteration().total.reused_blocks)  # 3
k2 = torch.cat([k[:12], torch.randn(2, 2, 16)])
v2 = torch.cat([v[:12], torch.randn(2, 2, 16)])
cache.write_kv("second", 0, [12, 13], k2[12:], v2[12:])

q = torch.randn(4, 16)  # 4 query heads share 2 KV heads
paged = paged_attention(cache, "second", 0, q)
dense = dense_attention(q, k2, v2)
print("block table:", cache.block_table("second"))
print("max |paged - dense|:", float((paged - dense).abs().max()))
assert torch.allclose(paged, dense, atol=1e-5)
print(cache.stats().total)

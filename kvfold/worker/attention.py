"""Attention over the paged cache: the reference a kernel is checked against.

`paged_attention` reads K/V the way a paged decode kernel does: block by block
straight from the pool, through the sequence's block table, masking the tokens
outside the window, and merging blocks with a running log-sum-exp
(flash-decoding). `dense_attention` is the textbook formula over contiguous K/V;
the two agree when the block table, the window arithmetic and the bytes are right.
"""

from __future__ import annotations

import math

import torch

from kvfold.worker.cache import PagedKVCache
from kvfold.worker.sequence import SeqId


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q: [num_heads, d]; k, v: [n, num_kv_heads, d] -> [num_heads, d] (one query token)."""
    num_heads, d = q.shape
    group = num_heads // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)  # [n, num_heads, d]
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,nhd->hn", q.float(), k) / math.sqrt(d)
    return torch.einsum("hn,nhd->hd", scores.softmax(dim=-1), v)


def paged_attention(
    cache: PagedKVCache, seq_id: SeqId, layer: int, q: torch.Tensor
) -> torch.Tensor:
    """Decode attention of one query token over `seq_id`'s paged K/V of `layer`.

    logical block  first+0   first+1   ...      tokens seen: [max(0, L-W), L)
    pool row       table[0]  table[1]  ...      (W = the layer's window; full: 0)
    """
    window = cache.config.window_of_layer(layer)
    table = cache.block_table(seq_id, window)
    first = cache.first_block_index(seq_id, window)
    length = cache.num_tokens(seq_id)
    B = cache.block_size
    start = cache.managers[window].first_token(length)
    pool = cache.storage.pools[window]
    slot = cache.storage.slot_of_layer(layer)
    num_heads, d = q.shape
    qf = q.float().to(pool.device)
    running_max = torch.full((num_heads,), -math.inf, device=pool.device)
    running_sum = torch.zeros(num_heads, device=pool.device)
    acc = torch.zeros(num_heads, d, device=pool.device)
    for j, block in enumerate(table):
        base = (first + j) * B
        lo, hi = max(start, base) - base, min(length, base + B) - base
        if lo >= hi:
            continue
        group = num_heads // pool.shape[-2]
        k = pool[block, slot, 0, lo:hi].float().repeat_interleave(group, dim=1)  # [n, h, d]
        v = pool[block, slot, 1, lo:hi].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", qf, k) / math.sqrt(d)
        new_max = torch.maximum(running_max, scores.max(dim=-1).values)
        rescale = torch.exp(running_max - new_max)
        p = torch.exp(scores - new_max[:, None])
        running_sum = running_sum * rescale + p.sum(dim=-1)
        acc = acc * rescale[:, None] + torch.einsum("hn,nhd->hd", p, v)
        running_max = new_max
    return acc / running_sum[:, None]

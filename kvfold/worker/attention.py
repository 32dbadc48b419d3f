"""Attention over the paged cache: the reference a kernel is checked against.

Reads K/V through the block table (the same path an engine's kernel takes)
and computes softmax(q K^T / sqrt(d)) V with grouped-query heads.
"""

from __future__ import annotations

import math

import torch

from kvfold.worker.cache import PagedKVCache, SeqId


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
    """Decode attention of one query token over `seq_id`'s paged K/V of `layer`."""
    k, v = cache.gather_kv(seq_id, layer)
    return dense_attention(q.to(k.device), k, v)

"""K/V bytes go through the block table and come back exactly."""

from __future__ import annotations

import torch

from kvfold.worker.attention import dense_attention, paged_attention
from tests.unit.builders import make_cache, toks


def test_write_then_gather_round_trips() -> None:
    cache = make_cache(num_blocks=8)
    assert cache.add_sequence("a", toks(0, 10))
    g = torch.Generator().manual_seed(0)
    k = torch.randn(10, 2, 8, generator=g)
    v = torch.randn(10, 2, 8, generator=g)
    for layer in range(2):
        cache.write_kv("a", layer, list(range(10)), k + layer, v - layer)
    for layer in range(2):
        gk, gv = cache.gather_kv("a", layer)
        assert torch.equal(gk, k + layer) and torch.equal(gv, v - layer)


def test_reused_prefix_gathers_first_owners_kv() -> None:
    cache = make_cache(num_blocks=8)
    assert cache.add_sequence("a", toks(0, 9))
    k = torch.randn(9, 2, 8)
    v = torch.randn(9, 2, 8)
    cache.write_kv("a", 0, list(range(9)), k, v)
    cache.free_sequence("a")
    assert cache.add_sequence("b", [*toks(0, 8), 77, 78])  # reuses blocks 0, 1
    assert cache.commit_iteration().total.reused_blocks == 2
    gk, gv = cache.gather_kv("b", 0)
    assert torch.equal(gk[:8], k[:8]) and torch.equal(gv[:8], v[:8])


def test_window_gathers_only_the_window() -> None:
    cache = make_cache(windows=(8,), num_layers=1)
    assert cache.add_sequence("a", toks(0, 14))  # window [6, 14)
    k = torch.arange(14 * 16, dtype=torch.float32).reshape(14, 2, 8)
    cache.write_kv("a", 0, list(range(4, 14)), k[4:], -k[4:])
    gk, gv = cache.gather_kv("a", 0)
    assert torch.equal(gk, k[6:14]) and torch.equal(gv, -k[6:14])


def test_paged_attention_block_by_block_equals_dense_over_what_was_written() -> None:
    """The paged path reads the pool through the block table, one block at a time; the
    reference is dense attention over the K/V the test wrote, never over a gather."""
    g = torch.Generator().manual_seed(1)
    for windows, layer, seen in (((None,), 1, slice(0, 23)), ((None, 8), 1, slice(15, 23))):
        cache = make_cache(num_blocks=16, windows=windows, num_kv_heads=2, head_dim=8)
        # share a prefix and take blocks out of order, so the table is not simply 0..n
        assert cache.add_sequence("x", toks(500, 5))
        assert cache.add_sequence("a", toks(0, 23))
        k = torch.randn(23, 2, 8, generator=g)
        v = torch.randn(23, 2, 8, generator=g)
        held_from = cache.first_block_index("a", cache.config.window_of_layer(layer)) * 4
        cache.write_kv("a", layer, list(range(held_from, 23)), k[held_from:], v[held_from:])
        q = torch.randn(4, 8, generator=g)  # 4 query heads over 2 KV heads (GQA)
        out = paged_attention(cache, "a", layer, q)
        ref = dense_attention(q, k[seen], v[seen])  # window 8 over 23 tokens: [15, 23)
        assert torch.allclose(out, ref, atol=1e-5), (windows, (out - ref).abs().max())
        # a wrong block in the table must show: swap two blocks' bytes
        table = cache.block_table("a", cache.config.window_of_layer(layer))
        pool = cache.storage.pools[cache.config.window_of_layer(layer)]
        pool[[table[-1], table[-2]]] = pool[[table[-2], table[-1]]]
        assert not torch.allclose(paged_attention(cache, "a", layer, q), ref, atol=1e-3)


def test_block_bytes_round_trip() -> None:
    cache = make_cache(num_blocks=4, dtype="float16")
    assert cache.add_sequence("a", toks(0, 4))
    k = torch.randn(4, 2, 8)
    cache.write_kv("a", 0, list(range(4)), k, k * 2)
    block = cache.block_table("a")[0]
    data = cache.storage.read_block(None, block)
    assert data.nbytes == cache.config.bytes_per_block(None)
    cache.storage.write_block(None, 3, data)
    assert torch.equal(cache.storage.pools[None][3], cache.storage.pools[None][block])

"""Bad input raises ValueError/TypeError naming what was wrong, and changes nothing."""

from __future__ import annotations

import pytest

from kvfold.stats import SequenceStatus
from kvfold.worker import KVCacheConfig
from tests.unit.builders import make_cache, toks


def snapshot(cache):  # type: ignore[no-untyped-def]
    return (
        cache.stats(),
        {s: cache.block_table(s) for s in cache.sequence_ids()},
        list(cache.pools[None].ref_counts),
        cache.cumulative(),
    )


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda c: c.add_sequence("a", toks(0, 4)), ValueError, "'a' already exists"),
        (lambda c: c.add_sequence("z", [1, -2]), ValueError, "non-negative"),
        (lambda c: c.add_sequence("z", [1, 2.5]), TypeError, "2.5"),
        (lambda c: c.add_sequence("z", [1, None]), TypeError, "None"),
        (lambda c: c.add_sequence("z", [2**70]), ValueError, "2\\*\\*63"),
        (lambda c: c.add_sequence("z", "abc"), TypeError, "token_ids"),
        (lambda c: c.add_sequence("z", []), ValueError, "empty"),
        (lambda c: c.add_sequence(1.5, [1]), TypeError, "seq_id"),
        (lambda c: c.append_tokens("nope", [1]), ValueError, "unknown seq_id 'nope'"),
        (lambda c: c.append_tokens("a", [1, -1]), ValueError, "non-negative"),
        (lambda c: c.free_sequence("nope"), ValueError, "unknown seq_id"),
        (lambda c: c.set_status("a", 3), TypeError, "status"),
        (lambda c: c.block_table("a", window=8), ValueError, "window 8"),
        (lambda c: c.write_kv("a", 7, [0], None, None), ValueError, "layer"),
    ],
)
def test_bad_calls_raise_and_change_nothing(call, exc, match) -> None:  # type: ignore[no-untyped-def]
    cache = make_cache()
    assert cache.add_sequence("a", toks(0, 6))
    before = snapshot(cache)
    with pytest.raises(exc, match=match):
        call(cache)
    assert snapshot(cache) == before
    cache.check_integrity()


def test_set_running_status_on_queued_sequence_is_refused() -> None:
    cache = make_cache()
    cache.queue_sequence("q")
    with pytest.raises(ValueError, match="holds no blocks"):
        cache.set_status("q", SequenceStatus.IN_DECODE)
    assert cache.status_of("q") is SequenceStatus.QUEUEING


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"tokens_per_block": 0}, ValueError, "tokens_per_block must be >= 1, got 0"),
        ({"tokens_per_block": 2.0}, TypeError, "tokens_per_block"),
        ({"windows": ()}, ValueError, "windows must be a non-empty tuple"),
        ({"windows": (None, 0)}, ValueError, "window 0"),
        ({"windows": (None, None)}, ValueError, "distinct"),
        ({"num_blocks": 0}, ValueError, "num_blocks must be >= 1, got 0"),
        ({"num_blocks": {None: 4, 8: 4}}, ValueError, "exactly the windows"),
        ({"dtype": "int8"}, ValueError, "dtype"),
        ({"device": "tpu"}, ValueError, "device"),
    ],
)
def test_bad_config(kwargs, exc, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(exc, match=match):
        KVCacheConfig(**kwargs)


def test_budget_sizing() -> None:
    kw = dict(tokens_per_block=4, num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16")
    # one block: 2 layers * 2 (K, V) * 4 tokens * 2 heads * 8 dims * 2 bytes = 512 bytes
    cfg = KVCacheConfig.from_memory_budget(512 * 10 + 100, **kw)
    assert cfg.num_blocks_of(None) == 10
    assert cfg.total_bytes == 5120
    two = KVCacheConfig.from_memory_budget(4096, windows=(None, 8), **kw)
    # each window has 1 layer: 256 bytes a block, 512 for one block in both pools
    assert two.num_blocks_of(None) == two.num_blocks_of(8) == 8
    with pytest.raises(ValueError, match="budget_bytes=100 is too small for one block"):
        KVCacheConfig.from_memory_budget(100, **kw)


def test_write_outside_window_is_refused() -> None:
    import torch

    cache = make_cache(windows=(8,), num_layers=1)
    assert cache.add_sequence("a", toks(0, 16))  # window [8, 16): blocks 2, 3 held
    bytes_before = cache.storage.pools[8].clone()
    before = (cache.stats(), cache.block_table("a", 8), cache.cumulative())
    k = torch.ones(1, 2, 8)
    with pytest.raises(ValueError, match=r"held range \[8, 16\) of window 8, got \[0, 0\]"):
        cache.write_kv("a", 0, [0], k, k)
    with pytest.raises(ValueError, match=r"k must be a tensor of shape \(1, 2, 8\)"):
        cache.write_kv("a", 0, [12], torch.ones(2, 2, 8), k)
    with pytest.raises(ValueError, match="positions must hold non-negative"):
        cache.write_kv("a", 0, [-1], k, k)
    assert torch.equal(cache.storage.pools[8], bytes_before)  # not one byte written
    assert (cache.stats(), cache.block_table("a", 8), cache.cumulative()) == before

from __future__ import annotations

import numpy as np
import pytest

from kvfold.hosttier import HostKVPool


def payload(i: int, n: int = 32) -> np.ndarray:
    return (np.arange(n, dtype=np.uint8) + i).astype(np.uint8)


def test_bytes_put_are_bytes_got() -> None:
    pool = HostKVPool(num_blocks=4, slot_nbytes=64, pin_memory=False)
    assert pool.put(None, b"k0", payload(0))
    assert pool.put(8, b"k0", payload(1, 48))  # same key, other window: its own entry
    [got] = pool.get(None, [b"k0"])
    assert np.array_equal(got, payload(0))
    [got] = pool.get(8, [b"k0"])
    assert np.array_equal(got, payload(1, 48))
    pool.check_integrity()


def test_lookup_of_absent_key_is_a_miss() -> None:
    pool = HostKVPool(num_blocks=2, slot_nbytes=8, pin_memory=False)
    assert pool.lookup(None, [b"nope"]) == 0
    assert pool.get(None, [b"nope"]) == []
    pool.put(None, b"a", payload(0, 8))
    assert pool.lookup(None, [b"a", b"b", b"a"]) == 1  # leading hits only


def test_lru_order_and_dropped_counts_exactly_the_unread() -> None:
    pool = HostKVPool(num_blocks=3, slot_nbytes=8, pin_memory=False)
    for k in (b"a", b"b", b"c"):
        pool.put(None, k, payload(0, 8))
    pool.get(None, [b"a"])  # a onboarded and touched: LRU is now b, c, a
    assert [k for _, k in pool.keys_lru()] == [b"b", b"c", b"a"]
    pool.put(None, b"d", payload(0, 8))  # evicts b (never onboarded): dropped
    pool.put(None, b"e", payload(0, 8))  # evicts c (never onboarded): dropped
    pool.put(None, b"f", payload(0, 8))  # evicts a (onboarded): evicted, not dropped
    assert [k for _, k in pool.keys_lru()] == [b"d", b"e", b"f"]
    s = pool.stats()
    assert (s.evicted_blocks, s.dropped_blocks) == (3, 2)
    assert (s.offloaded_blocks, s.onboarded_blocks) == (6, 1)
    assert (s.num_blocks_used, s.num_blocks_free) == (3, 0)
    pool.check_integrity()


def test_duplicate_put_touches_and_is_not_counted_twice() -> None:
    pool = HostKVPool(num_blocks=2, slot_nbytes=8, pin_memory=False)
    pool.put(None, b"a", payload(0, 8))
    pool.put(None, b"b", payload(0, 8))
    assert not pool.put(None, b"a", payload(0, 8))
    assert [k for _, k in pool.keys_lru()] == [b"b", b"a"]
    assert pool.stats().offloaded_blocks == 2


def test_tier_off_and_bad_input() -> None:
    off = HostKVPool(num_blocks=0, slot_nbytes=0)
    assert not off.put(None, b"a", payload(0, 8))
    assert off.stats().refused_blocks == 1 and off.stats().num_blocks_total == 0
    pool = HostKVPool(num_blocks=1, slot_nbytes=8, pin_memory=False)
    assert not pool.put(None, b"big", payload(0, 9))  # larger than a slot: refused
    with pytest.raises(TypeError, match="payload"):
        pool.put(None, b"a", np.zeros(4, dtype=np.float32))
    with pytest.raises(ValueError, match="num_blocks"):
        HostKVPool(num_blocks=-1, slot_nbytes=8)

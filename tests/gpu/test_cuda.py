"""The storage path on CUDA. Skipped where there is no GPU (CI has none)."""

from __future__ import annotations

import pytest
import torch

from kvfold.worker import KVCacheConfig, PagedKVCache
from kvfold.worker.attention import dense_attention, paged_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def make(**kw: object) -> PagedKVCache:
    return PagedKVCache(
        KVCacheConfig(
            tokens_per_block=16,
            num_blocks=64,
            num_layers=2,
            num_kv_heads=4,
            head_dim=64,
            dtype="float16",
            device="auto",
            **kw,
        )
    )  # type: ignore[arg-type]


def test_storage_is_on_the_gpu_and_round_trips() -> None:
    cache = make()
    assert cache.storage.device.type == "cuda"
    assert cache.add_sequence("a", list(range(100)))
    k = torch.randn(100, 4, 64, device="cuda", dtype=torch.float16)
    cache.write_kv("a", 1, list(range(100)), k, -k)
    gk, gv = cache.gather_kv("a", 1)
    assert gk.is_cuda and torch.equal(gk, k) and torch.equal(gv, -k)


def test_paged_attention_equals_dense_on_gpu() -> None:
    cache = make()
    assert cache.add_sequence("x", list(range(7, 40)))
    assert cache.add_sequence("a", list(range(300)))
    k = torch.randn(300, 4, 64, device="cuda", dtype=torch.float16)
    v = torch.randn(300, 4, 64, device="cuda", dtype=torch.float16)
    cache.write_kv("a", 0, list(range(300)), k, v)
    q = torch.randn(8, 64, device="cuda")
    assert torch.allclose(paged_attention(cache, "a", 0, q), dense_attention(q, k, v), atol=2e-2)


def test_block_bytes_survive_a_host_round_trip() -> None:
    cache = make()
    assert cache.add_sequence("a", list(range(32)))
    k = torch.randn(32, 4, 64, device="cuda", dtype=torch.float16)
    cache.write_kv("a", 0, list(range(32)), k, k)
    b = cache.block_table("a")[1]
    data = cache.storage.read_block(None, b)  # GPU -> host bytes
    cache.storage.write_block(None, 60, data)  # host bytes -> GPU
    assert torch.equal(cache.storage.pools[None][60], cache.storage.pools[None][b])


def test_the_cache_state_machine_on_cuda_storage() -> None:
    """The byte-exactness and atomicity model (tests/unit/test_cache_state_machine.py) with
    every pool on the GPU: evicted blocks reach the host tier as copies, onboarded bytes land."""
    from hypothesis import settings

    from tests.unit.test_cache_state_machine import CacheMachine

    class CudaCacheMachine(CacheMachine):
        DEVICE = "cuda"

    test = CudaCacheMachine.TestCase
    test.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
    test().runTest()

"""vLLM 0.33.0's own prefix-cache block pool, run in this process as a benchmark anchor.

vLLM is neither a dependency of kvfold nor vendored here. The first use runs
``<python> -m pip download vllm==0.33.0 --no-deps`` into a cache folder outside the
repository (``$KVFOLD_BENCH_CACHE/vllm-0.33.0``, default ``~/.cache/kvfold/bench/vllm-0.33.0``),
checks the few ``.py`` files needed against the wheel's RECORD, extracts only those (once;
later runs reuse them and re-check their digests), and loads them. Anything that stops this
(no network, pip failing, a missing package, an import error) raises `AnchorUnavailable`, so
a benchmark can print ``skipped: <reason>`` and go on.

What runs is vLLM's (loaded by benchmarks/_vllm_load.py, with the stand-ins it lists):
its BlockPool, free block queue and request hashing, unmodified.

vLLM's ``Request`` (``vllm/v1/request.py``) is not built: constructing it needs
``SamplingParams``, multimodal and engine types (msgspec, pydantic). `_AnchorRequest` carries
exactly the attributes vLLM's code reads on these paths, set as ``Request.__init__`` sets them:
``_all_token_ids`` (a copy of the prompt), ``all_token_ids`` (vLLM's ``ConstantList`` view),
``num_tokens`` (property), ``block_hashes`` (filled at construction by the block hasher, as
``Request.__init__`` -> ``update_block_hashes`` does), ``mm_features`` (``[]``),
``lora_request`` (None), ``cache_salt``, ``prompt_embeds`` (None). ``cache_full_blocks`` reads
only ``block_hashes`` (with events off).

The per-request glue -- what ``FullAttentionManager`` / ``SingleTypeKVCacheManager``
(``vllm/v1/core/single_type_kv_cache_manager.py``) do around the pool for a one-group,
full-attention model under ``UnitaryKVCacheCoordinator`` -- is restated in `VllmPool` line for
line (that module itself needs the torch-heavy ``kv_cache_interface``); see each method.
Left out: the scheduler's admission checks (``get_num_blocks_to_allocate``), the
``KVCacheBlocks`` wrapper objects (no pool or hashing work), and in `fresh` the prefix lookup
vLLM also runs for a request that turns out not to be cached (one ``get_cached_block`` miss).
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from typing import Any

from _vllm_fetch import AnchorUnavailable
from _vllm_load import _load, default_hash_algo

__all__ = ["AnchorUnavailable", "VllmPool", "default_hash_algo", "describe"]


# ---------------------------------------------------------------------------------------
# The pool
# ---------------------------------------------------------------------------------------


class _AnchorRequest:
    """The attributes of vllm.v1.request.Request that vLLM reads on these paths, set as
    Request.__init__ sets them (a plain class, like Request: attributes in __dict__)."""

    constant_list: type  # vLLM's ConstantList, set per loaded copy

    def __init__(
        self,
        prompt_token_ids: list[int],
        block_hasher: Callable[[_AnchorRequest], list[bytes]],
        cache_salt: str | None,
    ) -> None:
        self.lora_request = None
        self.prompt_token_ids = prompt_token_ids
        self.prompt_embeds = None
        self._prompt_embeds_per_block_hashes: dict[tuple[int, int], bytes] = {}
        self._all_token_ids = self.prompt_token_ids.copy()
        self.cache_salt = cache_salt
        self.mm_features: list[Any] = []
        self.all_token_ids = self.constant_list(self._all_token_ids)
        self.block_hashes: list[bytes] = []
        self._block_hasher = block_hasher
        self.update_block_hashes()

    def update_block_hashes(self) -> None:
        """Compute block hashes for any new full blocks and append them."""
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)


class VllmPool:
    """One vLLM BlockPool (prefix caching on, one full-attention KV cache group) and the
    per-request work vLLM's KV cache manager does around it.

    `fresh` and `cached` each take a prompt as a list of token ids and build the request
    (hashing its full blocks, as vLLM does when a request arrives) inside the call.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, hash_algo: str | None = None):
        """`hash_algo`: one of vLLM's prefix_caching_hash_algo names; None is vLLM's default."""
        v = _load(hash_algo)
        self._v = v
        self.hash_algo = v.hash_algo
        self.block_size = block_size
        self.kv_cache_group_id = 0
        # KVCacheCoordinator.__init__ (one group: hash_block_size == block_size; events and
        # metrics off, no lookahead tokens without speculative decoding).
        self.block_pool = v.block_pool.BlockPool(
            num_gpu_blocks=num_blocks,
            enable_caching=True,
            hash_block_size=block_size,
            enable_kv_cache_events=False,
            metrics_collector=None,
            num_hash_lookahead_tokens=0,
        )
        # EngineCore.__init__: get_request_block_hasher(hash_block_size, caching_hash_fn, 0).
        self._block_hasher = v.kv_cache_utils.get_request_block_hasher(block_size, v.hash_fn, 0)
        self._request_cls = type("Request", (_AnchorRequest,), {"constant_list": v.constant_list})
        self._trim_null_head = v.kv_cache_utils.trim_null_head
        self._resolve_block_hashes = v.kv_cache_utils.resolve_block_hashes
        self._cdiv = v.cdiv

    def describe(self) -> str:
        return f"vLLM {self._v.version} BlockPool, hash {self.hash_algo}, loaded from {self._v.src}"

    def num_free_blocks(self) -> int:
        return int(self.block_pool.get_num_free_blocks())

    def _request(self, tokens: list[int], cache_salt: str | None) -> _AnchorRequest:
        # Request.__init__ runs the block hasher over the prompt's full blocks.
        return self._request_cls(tokens, self._block_hasher, cache_salt)

    def fresh(self, tokens: list[int], cache_salt: str | None = None) -> None:
        """A request whose prompt is not cached: hash, allocate, cache the full blocks, free.

        Allocation pops the free queue's head, evicting cached blocks from the prefix cache
        when it reaches them (BlockPool.get_new_blocks), so this works with a pool smaller
        than the prompts sent through it. A prompt needing more blocks than are free raises
        vLLM's ValueError.
        """
        self._allocate_cache_free(self._request(tokens, cache_salt), [])

    def _allocate_cache_free(self, request: _AnchorRequest, req_blocks: list[Any]) -> None:
        """After the hits (`req_blocks`, held): allocate the rest, cache the full blocks,
        free every block, tail first."""
        pool = self.block_pool
        block_size = self.block_size
        num_tokens = request.num_tokens
        # SingleTypeKVCacheManager.allocate_new_blocks
        num_new_blocks = self._cdiv(num_tokens, block_size) - len(req_blocks)
        if num_new_blocks > 0:
            req_blocks.extend(pool.get_new_blocks(num_new_blocks))
        # SingleTypeKVCacheManager.cache_blocks (full attention: block_mask None); what the
        # hits hold is cached already
        num_cached_blocks = len(req_blocks) - max(num_new_blocks, 0)
        num_hashed_tokens = len(request.block_hashes) * pool.hash_block_size
        num_full_blocks = min(num_tokens, num_hashed_tokens) // block_size
        if num_cached_blocks < num_full_blocks:
            pool.cache_full_blocks(
                request=request,
                blocks=req_blocks,
                num_cached_blocks=num_cached_blocks,
                num_full_blocks=num_full_blocks,
                block_size=block_size,
                kv_cache_group_id=self.kv_cache_group_id,
                block_mask=None,
            )
        # SingleTypeKVCacheManager.free: tail blocks first
        pool.free_blocks(reversed(self._trim_null_head(req_blocks)))

    def cached(
        self,
        tokens: list[int],
        max_hit_tokens: int | None = None,
        cache_salt: str | None = None,
    ) -> int:
        """A request's prefix-cache hit: hash, find the longest cached prefix, hold (touch)
        those blocks, free them. Returns the number of hit blocks.

        `max_hit_tokens` None is what vLLM's scheduler passes (KVCacheManager
        .get_computed_blocks: ``request.num_tokens - 1``, so the last token is recomputed):
        a prompt of 64 full blocks plus one token hits 64 blocks, one of exactly 64 blocks
        hits 63.
        """
        pool = self.block_pool
        request = self._request(tokens, cache_salt)
        if max_hit_tokens is None:
            max_hit_tokens = request.num_tokens - 1
        hit_blocks = self._find_longest_cache_hit(request.block_hashes, max_hit_tokens)[0][0]
        # SingleTypeKVCacheManager.add_local_computed_blocks: touch, then hold
        req_blocks: list[Any] = []
        pool.touch(hit_blocks)
        req_blocks.extend(hit_blocks)
        # SingleTypeKVCacheManager.free
        pool.free_blocks(reversed(self._trim_null_head(req_blocks)))
        return len(hit_blocks)

    def request(self, tokens: list[int], cache_salt: str | None = None) -> int:
        """A request's whole prefill as the scheduler runs it: hash, find the longest
        cached prefix, hold (touch) it, allocate the rest, cache the full blocks, free.
        Returns the number of hit blocks."""
        request = self._request(tokens, cache_salt)
        hit_blocks = self._find_longest_cache_hit(request.block_hashes, request.num_tokens - 1)[0][
            0
        ]
        # SingleTypeKVCacheManager.add_local_computed_blocks: touch, then hold
        self.block_pool.touch(hit_blocks)
        self._allocate_cache_free(request, list(hit_blocks))
        return len(hit_blocks)

    def _find_longest_cache_hit(
        self, block_hashes: list[bytes], max_length: int
    ) -> tuple[tuple[list[Any], ...], int]:
        """FullAttentionManager.find_longest_cache_hit as UnitaryKVCacheCoordinator calls it:
        one group, alignment_tokens = block_size (not fine-grained), no EAGLE, no DCP."""
        block_pool = self.block_pool
        block_size = self.block_size
        alignment_tokens = block_size
        kv_cache_group_ids = [self.kv_cache_group_id]
        block_hashes = self._resolve_block_hashes(
            block_hashes,
            block_pool.hash_block_size,
            block_size,
            supports_fine_grained_hash_lookup=True,
            alignment_tokens=alignment_tokens,
        )
        computed_blocks: tuple[list[Any], ...] = tuple([] for _ in range(len(kv_cache_group_ids)))
        for block_hash in itertools.islice(block_hashes, max_length // block_size):
            cached_block = block_pool.get_cached_block(block_hash, kv_cache_group_ids)
            if not cached_block:
                break
            for computed, cached in zip(computed_blocks, cached_block, strict=False):
                computed.append(cached)
        hit_length = len(computed_blocks[0]) * block_size
        hit_length -= hit_length % alignment_tokens
        num_blocks = self._cdiv(hit_length, block_size)
        for computed in computed_blocks:
            del computed[num_blocks:]
        return computed_blocks, hit_length


def describe(hash_algo: str | None = None) -> str:
    """One line naming what the anchor runs, e.g. for a benchmark's header."""
    v = _load(hash_algo)
    return f"vLLM {v.version} BlockPool, hash {v.hash_algo}, loaded from {v.src}"


# ---------------------------------------------------------------------------------------
# Self-check
# ---------------------------------------------------------------------------------------


def _median_us(fn: Callable[[int], object], iterations: int) -> float:
    import statistics
    import time

    samples = []
    for i in range(iterations):
        t0 = time.perf_counter()
        fn(i)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def _main() -> int:
    b = 16
    try:
        pool = VllmPool(2_000, b)
    except AnchorUnavailable as e:
        print(f"skipped: {e.reason}")
        return 0
    print(pool.describe())
    iterations = 300
    vllm_loaded = any(n == "vllm" or n.startswith("vllm.") for n in sys.modules)
    assert not vllm_loaded, "vllm.* left in sys.modules"

    # (1) fresh, 1,000-block prompt: a new salt each call, so every block is hashed anew
    # and, from the second call on, allocation evicts the previous call's cached blocks.
    big = list(range(1_000 * b))
    us = _median_us(lambda i: pool.fresh(big, cache_salt=f"big-{i}"), iterations)
    assert pool.cached([*big, 0], cache_salt=f"big-{iterations - 1}") == 1_000
    print(f"fresh  1,000-block prompt (hash + alloc + cache + free): {us / 1e3:8.3f} ms")

    # (2) fresh, 64-block prompt (64 full blocks + 1 token, as the scheduler sees a prompt).
    p64 = list(range(64 * b + 1))
    us = _median_us(lambda i: pool.fresh(p64, cache_salt=f"p64-{i}"), iterations)
    print(f"fresh     64-block prompt (hash + alloc + cache + free): {us:8.1f} us")

    # (3) cached: the same 64-block prompt, once through fresh, then hit.
    pool.fresh(p64)
    assert pool.cached(p64) == 64
    assert pool.cached(p64[: 64 * b]) == 63  # vLLM recomputes the last token
    hits: list[int] = []
    us = _median_us(lambda i: hits.append(pool.cached(p64)), iterations)
    assert hits == [64] * iterations
    print(f"cached    64-block prompt (hash + lookup + touch + free): {us:8.1f} us")
    assert pool.num_free_blocks() == 2_000 - 1  # all but the null block
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())

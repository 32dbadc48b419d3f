"""The window arithmetic, written once: which logical blocks a window group holds.

A sequence of L tokens (B tokens a block) spans logical blocks [0, ceil(L/B)).
Full attention holds all of them; a sliding window W holds the blocks that meet
token positions [max(0, L-W), L):

    B = 4, W = 8, L = 14     tokens 0 ........................ 13
    logical blocks            [ 0 ][ 1 ][ 2 ][ 3 ]
    window [6, 14)                  ^^^^^^^^^^^^^^^  -> first_block 1, held 1, 2, 3

As vLLM's FullAttentionManager / SlidingWindowManager: one small manager per
window kind, asked by the cache (allocation, release, reuse), the integrity
check and admission (what a request can ever need).
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple, Protocol

from kvfold.stats import Window


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class Growth(NamedTuple):
    first: int  # the first held block after the growth
    num_release: int  # blocks that fell wholly out of the window
    start: int  # logical index of the first new block
    num_new: int  # blocks to take


class FullAttentionManager:
    """Every block from the first token on."""

    window: Window = None

    def __init__(self, tokens_per_block: int) -> None:
        self.block_size = tokens_per_block

    def first_token(self, num_tokens: int) -> int:
        """The first token position attention still reads."""
        return 0

    def first_block(self, num_tokens: int) -> int:
        """Logical index of the first block the group still holds."""
        return self.first_token(num_tokens) // self.block_size

    def num_blocks(self, num_tokens: int) -> int:
        """Blocks held for a sequence of `num_tokens` tokens."""
        return ceil_div(num_tokens, self.block_size) - self.first_block(num_tokens)

    def max_blocks(self, num_tokens: int) -> int:
        """The most blocks the group ever holds at once while a sequence grows from
        nothing to `num_tokens` tokens (what admission must be able to promise)."""
        return ceil_div(num_tokens, self.block_size)

    def peak_blocks(self, num_tokens: int, end_tokens: int) -> int:
        """The most blocks the group holds at once while a sequence grows from
        `num_tokens` to `end_tokens` tokens (num_tokens <= end_tokens)."""
        return ceil_div(end_tokens, self.block_size)

    def commitment(self, num_tokens: int, end_tokens: int) -> int:
        """What a sequence of `num_tokens` tokens, declared to reach `end_tokens`,
        commits in this group beyond the blocks the pool already counts as used:
        the blocks it has still to take. (Full attention never releases a block while
        a sequence grows, so its held blocks stay in the pool's used count.)"""
        return ceil_div(max(num_tokens, end_tokens), self.block_size) - ceil_div(
            num_tokens, self.block_size
        )

    counts_held = False
    """Whether `commitment` includes the blocks a sequence holds (True where a held
    block may be released while its sharers keep it, so the pool's used count
    cannot stand for it)."""

    def reuse_limit(self, num_tokens: int) -> int:
        """Blocks [first_block, reuse_limit) of a prompt may come from a cache: the last
        token is always computed, as in vLLM and TensorRT-LLM."""
        return (num_tokens - 1) // self.block_size

    def growth(self, first: int, num_tokens: int, new_num_tokens: int) -> Growth:
        """What growing from `num_tokens` to `new_num_tokens` does to a sequence whose
        first held block is `first`:

            held  [first ............ ceil(L0/B))      L0 -> L1
            after       [first' ............................ ceil(L1/B))
                  ^^^^^ released (left the window)   ^^^^^^^^ new, from max(ceil(L0/B), first')
        """
        n0, n1 = ceil_div(num_tokens, self.block_size), ceil_div(new_num_tokens, self.block_size)
        new_first = max(first, self.first_block(new_num_tokens))
        start = max(n0, new_first)
        return Growth(new_first, max(0, min(new_first, n0) - first), start, n1 - start)


class SlidingWindowManager(FullAttentionManager):
    """The blocks that meet the last `window` token positions."""

    def __init__(self, tokens_per_block: int, window: int) -> None:
        super().__init__(tokens_per_block)
        self.window = window
        self.window_tokens = window

    def first_token(self, num_tokens: int) -> int:
        return max(0, num_tokens - self.window_tokens)

    def max_blocks(self, num_tokens: int) -> int:
        # a W-token span meets at most ceil(W / B) + 1 blocks (one partial at each end)
        bound = ceil_div(self.window_tokens, self.block_size) + 1
        return min(ceil_div(num_tokens, self.block_size), bound)

    counts_held = True

    def commitment(self, num_tokens: int, end_tokens: int) -> int:
        """Every block the sequence may hold at once on its way to `end_tokens`, held
        ones included: a shared block it slides past stays used by its sharers, so
        each holder counts its own (exact when nothing is shared)."""
        return self.peak_blocks(num_tokens, max(num_tokens, end_tokens))

    def peak_blocks(self, num_tokens: int, end_tokens: int) -> int:
        """Exact, in O(1). Up to W tokens the group holds ceil(L/B) blocks (growing);
        from W on, with W = qB + r and t = L mod B, it holds q + [t > 0] + [t < r]
        blocks: periodic in L, so only the residues [num_tokens, end_tokens] meets matter."""
        B, W = self.block_size, self.window_tokens
        best = 0
        if num_tokens < W:
            best = ceil_div(min(end_tokens, W), B)
        a = max(num_tokens, W)
        if a > end_tokens:
            return best
        q, r = divmod(W, B)
        n = min(end_tokens - a + 1, B)  # how many residues the range meets
        s = a % B
        if _meets(s, n, B, 1, r - 1):
            extra = 2
        elif n > 1 or s > 0 or r > 0:
            extra = 1  # some t > 0, or t = 0 with r > 0
        else:
            extra = 0
        return max(best, q + extra)


def _meets(s: int, n: int, B: int, lo: int, hi: int) -> bool:
    """Whether the cyclic residue range s, s+1, ... (n of them, mod B) meets [lo, hi]."""
    if lo > hi:
        return False
    if n >= B:
        return True
    end = s + n - 1
    if end < B:
        return s <= hi and lo <= end
    return (s <= hi) or (lo <= end - B)


class WindowManager(Protocol):
    """What every window kind answers (FullAttentionManager, SlidingWindowManager)."""

    window: Window
    block_size: int

    def first_token(self, num_tokens: int) -> int: ...
    def first_block(self, num_tokens: int) -> int: ...
    def num_blocks(self, num_tokens: int) -> int: ...
    def max_blocks(self, num_tokens: int) -> int: ...
    def peak_blocks(self, num_tokens: int, end_tokens: int) -> int: ...
    def commitment(self, num_tokens: int, end_tokens: int) -> int: ...

    counts_held: bool

    def reuse_limit(self, num_tokens: int) -> int: ...
    def growth(self, first: int, num_tokens: int, new_num_tokens: int) -> Growth: ...


@lru_cache(maxsize=256)
def window_manager(window: Window, tokens_per_block: int) -> WindowManager:
    """The (shared, stateless) manager of a window kind and block size."""
    if window is None:
        return FullAttentionManager(tokens_per_block)
    return SlidingWindowManager(tokens_per_block, window)

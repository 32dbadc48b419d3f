"""How a prompt or a growth lands in one window group's pool: planned first (nothing
changes; None when it does not fit), then applied (cannot fail), and counted with
TensorRT-LLM's meanings (kvfold.worker.deltas).

    a prompt, in one window:   [first ... hits ... | onboarded ... | computed ... ]
                                reused: attached     taken, copied   taken: missed
                                                     in from host
    a growth, in one window:   key the held blocks that filled, release those that
                               left the window, take the new ones (gen_alloc)

Every function here reads or changes one pool and one sequence's table in it; the
cache loops over its windows and owns the sequences and the commitments.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvfold.stats import Window
from kvfold.worker.block_pool import BlockPool
from kvfold.worker.deltas import Counts
from kvfold.worker.sequence import SeqState
from kvfold.worker.windows import Growth, WindowManager

if TYPE_CHECKING:
    from kvfold.worker.storage import KVStorage


@dataclass(slots=True)
class PromptPlan:
    """What adding a prompt does to one window pool, decided before anything changes."""

    window: Window
    pool: BlockPool
    first: int  # logical index of the first block the window holds
    limit: int  # blocks [first, limit) may be reused or onboarded
    hits: list[int]  # cached blocks reused, from `first` on
    num_new: int  # blocks to take: onboarded into, or computed
    pool_block_size: int  # tokens per block
    payloads: list[np.ndarray] = field(default_factory=list)  # from the host tier

    def covered(self, num_blocks: int) -> int:
        """How far into the prompt `num_blocks` blocks from the window's first cover it
        (tokens; nothing when they are none)."""
        return (self.first + num_blocks) * self.pool_block_size if num_blocks else 0


@dataclass(slots=True)
class GrowthPlan:
    """What appending tokens does to one window pool (kvfold.worker.windows.Growth)."""

    window: Window
    pool: BlockPool
    growth: Growth


def parent(keys: list[bytes], i: int) -> bytes | None:
    """The key of the block before block i (its block event's parent), if known."""
    return keys[i - 1] if 0 < i <= len(keys) else None


def take_counted(pool: BlockPool, n: int, counts: Counts) -> list[int]:
    """Take `n` blocks (room already checked) and count them as TensorRT-LLM's
    `getFreeBlock` does: all in alloc_total, those that had never held a token in
    alloc_new (kvfold.worker.block_pool)."""
    new_before = pool.new_total
    blocks = pool.take(n)
    assert blocks is not None  # room was checked by the caller
    counts.alloc_total_blocks += n
    counts.alloc_new_blocks += pool.new_total - new_before
    return blocks


# ------------------------------------------------------------------------- prompts


def plan_prompt(
    window: Window,
    pool: BlockPool,
    mgr: WindowManager,
    length: int,
    keys: list[bytes],
    end: int,
    committed: int,
    block_size: int,
) -> PromptPlan | None:
    """The reusable run and the blocks to take in one window for a prompt of `length`
    tokens; None if the pool lacks room, or if the sequence's commitment to `end` tokens
    would take the window's committed blocks (`committed` now) past its total."""
    first, limit = mgr.first_block(length), min(mgr.reuse_limit(length), len(keys))
    hits = pool.cached_run(keys[first:limit])
    num_new = mgr.num_blocks(length) - len(hits)
    if not pool.can_take(num_new, attaching=hits):
        return None
    grows = mgr.commitment(length, end)
    if not mgr.counts_held:  # the blocks it makes used join the pool's count
        grows += num_new + pool.num_unheld(hits)
    if committed + grows > pool.num_blocks:
        return None
    return PromptPlan(window, pool, first, limit, hits, num_new, block_size)


def apply_prompt(
    seq: SeqState, plan: PromptPlan, counts: Counts, storage: Callable[[], KVStorage]
) -> None:
    """Attach the hits, take the rest, copy in what the host tier had (into `storage()`,
    asked only then), key the new blocks. Cannot fail: room was checked by `plan_prompt`."""
    w, pool = plan.window, plan.pool
    pool.attach_all(plan.hits)
    new = take_counted(pool, plan.num_new, counts)
    for block, payload in zip(new, plan.payloads, strict=False):
        storage().write_block(w, block, payload)
    start = plan.first + len(plan.hits)
    pool.set_keys(new, seq.keys[start:], parent(seq.keys, start))
    seq.tables[w] = plan.hits + new
    seq.first[w] = plan.first
    counts.reused_blocks += len(plan.hits)
    counts.onboarded_blocks += len(plan.payloads)
    counts.onboarded_bytes += sum(int(p.nbytes) for p in plan.payloads)
    counts.missed_blocks += plan.num_new - len(plan.payloads)


# ------------------------------------------------------------------------- growth


def plan_growth(
    window: Window, pool: BlockPool, mgr: WindowManager, seq: SeqState, length: int
) -> GrowthPlan | None:
    """What growing `seq` to `length` tokens does in one window; None if out of room."""
    g = mgr.growth(seq.first[window], seq.num_tokens, length)
    if not pool.can_take(g.num_new, releasing=seq.tables[window][: g.num_release]):
        return None
    return GrowthPlan(window, pool, g)


def growth_fits(plan: GrowthPlan, mgr: WindowManager, grows: int, committed: int) -> bool:
    """Whether a growth whose commitment grows by `grows` keeps the window's committed
    blocks (`committed` now) within its total."""
    if not mgr.counts_held:  # full attention: every new block joins used
        grows += plan.growth.num_new
    return grows <= 0 or committed + grows <= plan.pool.num_blocks


def apply_growth(seq: SeqState, plan: GrowthPlan, key_start: int, counts: Counts) -> int:
    """Key the held blocks that just became full, release what left the window, take
    the new blocks (keyed when already full). Returns how many were released. Cannot
    fail: room was checked by `plan_growth`."""
    w, pool, g, table = plan.window, plan.pool, plan.growth, seq.tables[plan.window]
    first0 = seq.first[w]
    # a block that fills up and leaves the window in the same growth is never keyed:
    # its last positions were never written in this group (they are outside the
    # window by the time the engine writes them), so its bytes are not the prefix's
    for i in range(max(key_start, first0, g.first), min(len(seq.keys), first0 + len(table))):
        pool.set_key(table[i - first0], seq.keys[i], parent(seq.keys, i))
    if g.num_release:
        pool.release(table[: g.num_release])
        del table[: g.num_release]
    new = take_counted(pool, g.num_new, counts)
    pool.set_keys(new, seq.keys[g.start :], parent(seq.keys, g.start))
    table.extend(new)
    seq.first[w] = g.first
    counts.gen_alloc_blocks += g.num_new
    return g.num_release

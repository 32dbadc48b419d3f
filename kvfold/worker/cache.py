"""PagedKVCache: one rank's paged KV cache, with prefix reuse, windows and exact stats.

Each window group has its own block pool; a sequence holds, in each, the blocks
its window still needs (kvfold.worker.windows). Prompt lookup, per window from the
window's first block: contiguous hits in this rank's pool (reused), then contiguous
hits in the node's host tier (onboarded; kvfold.worker.host_path), then the rest
taken and left for the engine to compute (missed). At most floor((L-1)/B) blocks
are reused: the last token is always computed.

Every public method either completes or raises before changing anything; lack of
room returns False. Counters are interval deltas handed out by `commit_iteration()`
(kvfold.worker.deltas), with TensorRT-LLM's meanings.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvfold.blockindex.journal import EventJournal
from kvfold.stats import (
    VALID_STATUSES,
    BlockGauges,
    IterationStats,
    KVStats,
    SequenceStatus,
    Window,
)
from kvfold.worker.block_pool import BlockPool
from kvfold.worker.commitments import Policy, declared_end
from kvfold.worker.config import KVCacheConfig
from kvfold.worker.deltas import DeltaLedger
from kvfold.worker.hashing import TokenIds, as_token_array, extend_keys, new_hasher
from kvfold.worker.host_path import HostLink, HostTier
from kvfold.worker.integrity import check_cache_integrity
from kvfold.worker.sequence import SeqId, SeqState, check_seq_id
from kvfold.worker.storage import KVStorage
from kvfold.worker.trtllm import trtllm_stats
from kvfold.worker.windows import Growth, WindowManager, window_manager


@dataclass(slots=True)
class _PromptPlan:
    """What adding a prompt does to one window pool, decided before anything changes."""

    window: Window
    pool: BlockPool
    first: int  # logical index of the first block the window holds
    limit: int  # blocks [first, limit) may be reused or onboarded
    hits: list[int]  # cached blocks reused, from `first` on
    num_new: int  # blocks to take: onboarded into, or computed
    pool_block_size: int  # tokens per block
    payloads: list[np.ndarray] = field(default_factory=list)  # from the host tier


@dataclass(slots=True)
class _GrowthPlan:
    """What appending tokens does to one window pool (kvfold.worker.windows.Growth)."""

    window: Window
    pool: BlockPool
    growth: Growth


def _covered(plan: _PromptPlan, num_blocks: int) -> int:
    """How far into the prompt `num_blocks` blocks from the window's first cover it
    (tokens; nothing when they are none)."""
    return (plan.first + num_blocks) * plan.pool_block_size if num_blocks else 0


def _parent(keys: list[bytes], i: int) -> bytes | None:
    """The key of the block before block i (its block event's parent), if known."""
    return keys[i - 1] if 0 < i <= len(keys) else None


class PagedKVCache:
    """Owns the block pools, the sequences' block tables and the K/V storage of one rank."""

    def __init__(self, config: KVCacheConfig, host_tier: HostTier | None = None) -> None:
        if not isinstance(config, KVCacheConfig):
            raise TypeError(f"config must be a KVCacheConfig, got {type(config).__name__}")
        self.config = config
        self.block_size = config.tokens_per_block
        self.windows = config.windows
        self.pools = {w: BlockPool(config.num_blocks_of(w)) for w in self.windows}
        self.managers: dict[Window, WindowManager] = {
            w: window_manager(w, self.block_size) for w in self.windows
        }
        self.storage = KVStorage(config)
        self.seqs: dict[SeqId, SeqState] = {}
        self.status_counts = dict.fromkeys(SequenceStatus, 0)
        self.ledger = DeltaLedger(self.pools)
        self.released_refs = dict.fromkeys(self.windows, 0)  # cumulative, for integrity
        # per window: the sequences' commitments summed (kvfold.worker.commitments)
        self.commit_sums = dict.fromkeys(self.windows, 0)
        self.num_refused = 0  # adds refused: they would over-commit a window (cumulative)
        self.events = EventJournal(self.windows, self.block_size)  # block events, per batch
        for w, pool in self.pools.items():
            pool.window, pool.journal = w, self.events
        self.host: HostLink | None = None
        self.set_host_tier(host_tier)

    # ----------------------------------------------------------------- host tier

    def set_host_tier(self, host_tier: HostTier | None) -> None:
        """Attach (or detach with None) the node's host tier: evictions offload to it,
        prompt misses onboard from it (kvfold.worker.host_path)."""
        self.host = None if host_tier is None else HostLink(host_tier, self.storage)
        for w, pool in self.pools.items():
            pool.evict_listener = None if self.host is None else self.host.copier(w)

    def _flush_offloads(self) -> None:
        if self.host is not None:
            for window, nbytes in self.host.flush():
                self.record_offload(window, nbytes)

    def record_offload(self, window: Window, nbytes: int, num_blocks: int = 1) -> None:
        """Count blocks the host tier confirmed it stored (for tiers that answer later)."""
        self._check_window(window)
        c = self.ledger.pending[window]
        c.offloaded_blocks += num_blocks
        c.offloaded_bytes += nbytes

    # ----------------------------------------------------------------- sequences

    def queue_sequence(self, seq_id: SeqId) -> None:
        """Register a known sequence that holds no blocks yet (QUEUEING)."""
        check_seq_id(seq_id)
        if seq_id in self.seqs:
            raise ValueError(f"seq_id {seq_id!r} already exists")
        self.seqs[seq_id] = SeqState(seq_id, None, SequenceStatus.QUEUEING)
        self.status_counts[SequenceStatus.QUEUEING] += 1

    def add_sequence(
        self,
        seq_id: SeqId,
        token_ids: TokenIds,
        salt: str | bytes | None = None,
        *,
        max_new_tokens: int = 0,
        policy: Policy = Policy.GUARANTEED_NO_EVICT,
        count_refusal: bool = True,
    ) -> bool:
        """Allocate a prompt with prefix reuse; status becomes IN_PREFILL.

        The sequence is declared to reach prompt + max_new_tokens (GUARANTEED_NO_EVICT)
        or prompt + one block (MAX_UTILIZATION). Returns False (nothing changed,
        counted in `num_refused`) when that would make some window's committed blocks
        exceed its total (`count_refusal=False`: an engine retrying its own preempted
        sequence, not a placement). A QUEUEING sequence may be added; any other existing id is
        an error. The host tier is asked before anything changes; its failures are misses.
        """
        check_seq_id(seq_id)
        old = self.seqs.get(seq_id)
        if old is not None and old.status is not SequenceStatus.QUEUEING:
            raise ValueError(f"seq_id {seq_id!r} already exists (status {old.status.name})")
        tokens = as_token_array(token_ids)
        if tokens.size == 0:
            raise ValueError(f"token_ids must not be empty (seq_id {seq_id!r})")
        B = self.block_size
        end = declared_end(int(tokens.size), max_new_tokens, policy, B)
        hasher = new_hasher(salt)
        keys = extend_keys(hasher, tokens, B) if self.config.enable_prefix_reuse else []
        plans = self._plan_prompt(int(tokens.size), keys, end)
        if plans is None:
            self.num_refused += count_refusal  # an engine's own retries are not placements
            return False
        if self.host is not None:
            for plan in plans:
                start = plan.first + len(plan.hits)
                plan.payloads = self.host.fetch(plan.window, keys[start : plan.limit])
        seq = SeqState(
            seq_id, hasher, SequenceStatus.IN_PREFILL, num_tokens=int(tokens.size), end=end
        )
        if self.config.enable_prefix_reuse:
            seq.keys = keys
            seq.tail = tokens[len(keys) * B :].tolist()
        for plan in plans:
            self._apply_prompt(seq, plan)
        seq.prompt_reused_tokens = min(_covered(p, len(p.hits)) for p in plans)
        seq.prompt_covered_tokens = min(_covered(p, len(p.hits) + len(p.payloads)) for p in plans)
        L = seq.num_tokens
        self._set_commitment(seq, {w: m.commitment(L, end) for w, m in self.managers.items()})
        if old is not None:
            self.status_counts[SequenceStatus.QUEUEING] -= 1
        self.seqs[seq_id] = seq
        self.status_counts[SequenceStatus.IN_PREFILL] += 1
        self._flush_offloads()
        return True

    def _plan_prompt(self, length: int, keys: list[bytes], end: int) -> list[_PromptPlan] | None:
        """Per window: the reusable run and the blocks to take; None if one lacks room,
        or if the sequence's commitment to `end` tokens would over-commit the window."""
        plans = []
        for w, pool in self.pools.items():
            mgr = self.managers[w]
            first, limit = mgr.first_block(length), min(mgr.reuse_limit(length), len(keys))
            hits = pool.cached_run(keys[first:limit])
            num_new = mgr.num_blocks(length) - len(hits)
            if not pool.can_take(num_new, attaching=hits):
                return None
            grows = mgr.commitment(length, end)
            if not mgr.counts_held:  # the blocks it makes used join the pool's count
                grows += num_new + pool.num_unheld(hits)
            if self.committed(w) + grows > pool.num_blocks:
                return None
            plans.append(_PromptPlan(w, pool, first, limit, hits, num_new, self.block_size))
        return plans

    def committed(self, window: Window) -> int:
        """Blocks of `window` its sequences hold plus those they may still need to reach
        their declared lengths (kvfold.worker.commitments); never above total."""
        own = self.commit_sums[window]
        return own if self.managers[window].counts_held else own + self.pools[window].num_used

    def _set_commitment(self, seq: SeqState, commit: dict[Window, int]) -> None:
        sums = self.commit_sums
        for w, n in seq.commit.items():
            sums[w] -= n
        for w, n in commit.items():
            sums[w] += n
        seq.commit = commit

    def _apply_prompt(self, seq: SeqState, plan: _PromptPlan) -> None:
        """Attach the hits, take the rest, copy in what the host tier had, key the new
        blocks. Cannot fail: room was checked by `_plan_prompt`."""
        w, pool = plan.window, plan.pool
        pool.attach_all(plan.hits)
        new = self._take(w, pool, plan.num_new)
        for block, payload in zip(new, plan.payloads, strict=False):
            self.storage.write_block(w, block, payload)
        start = plan.first + len(plan.hits)
        pool.set_keys(new, seq.keys[start:], _parent(seq.keys, start))
        seq.tables[w] = plan.hits + new
        seq.first[w] = plan.first
        c = self.ledger.pending[w]
        c.reused_blocks += len(plan.hits)
        c.onboarded_blocks += len(plan.payloads)
        c.onboarded_bytes += sum(int(p.nbytes) for p in plan.payloads)
        c.missed_blocks += plan.num_new - len(plan.payloads)

    def _take(self, window: Window, pool: BlockPool, n: int) -> list[int]:
        """Take `n` blocks (room already checked) and count them as TensorRT-LLM does:
        all in alloc_total, those that held no cached content in alloc_new."""
        evicted_before = pool.evicted_total
        new = pool.take(n)
        assert new is not None  # room was checked by the caller
        c = self.ledger.pending[window]
        c.alloc_total_blocks += n
        c.alloc_new_blocks += n - (pool.evicted_total - evicted_before)
        return new

    def append_tokens(self, seq_id: SeqId, token_ids: TokenIds) -> bool:
        """Grow a sequence by decoded tokens. False (nothing changed) when out of room.

        Growth within the sequence's declared length always finds its blocks; growth
        past it extends the declaration, and is refused when that would over-commit
        a window. Sliding-window pools release the blocks that fall wholly out of the
        window before taking new ones.
        """
        seq = self._get(seq_id)
        if not seq.holds_blocks:
            raise ValueError(
                f"seq_id {seq_id!r} holds no blocks (status {seq.status.name}); "
                "add_sequence it first"
            )
        tokens = as_token_array(token_ids)
        if tokens.size == 0:
            return True
        length = seq.num_tokens + int(tokens.size)
        plans = self._plan_growth(seq, length)
        if plans is None:
            return False
        end = max(seq.end, length)
        commit = {w: m.commitment(length, end) for w, m in self.managers.items()}
        if end > seq.end and not self._fits_growth(seq, plans, commit):
            return False
        key_start = len(seq.keys)
        if self.config.enable_prefix_reuse:
            tail = np.concatenate([np.asarray(seq.tail, dtype=np.int64), tokens])
            new_keys = extend_keys(seq.hasher, tail, self.block_size)
            seq.tail = tail[len(new_keys) * self.block_size :].tolist()
            seq.keys.extend(new_keys)
        for plan in plans:
            self._apply_growth(seq, plan, key_start)
        seq.num_tokens = length
        seq.end = end
        self._set_commitment(seq, commit)
        self._flush_offloads()
        return True

    def _fits_growth(
        self, seq: SeqState, plans: list[_GrowthPlan], commit: dict[Window, int]
    ) -> bool:
        """Whether growing past the declared end keeps every window's committed <= total."""
        for plan in plans:
            w, mgr = plan.window, self.managers[plan.window]
            grows = commit[w] - seq.commit.get(w, 0)
            if not mgr.counts_held:  # full attention: every new block joins used
                grows += plan.growth.num_new
            if grows > 0 and self.committed(w) + grows > plan.pool.num_blocks:
                return False
        return True

    def _plan_growth(self, seq: SeqState, length: int) -> list[_GrowthPlan] | None:
        plans = []
        for w, pool in self.pools.items():
            g = self.managers[w].growth(seq.first[w], seq.num_tokens, length)
            if not pool.can_take(g.num_new, releasing=seq.tables[w][: g.num_release]):
                return None
            plans.append(_GrowthPlan(w, pool, g))
        return plans

    def _apply_growth(self, seq: SeqState, plan: _GrowthPlan, key_start: int) -> None:
        """Key the held blocks that just became full, release what left the window, take
        the new blocks (keyed when already full). Cannot fail: room was checked."""
        w, pool, g, table = plan.window, plan.pool, plan.growth, seq.tables[plan.window]
        first0 = seq.first[w]
        # a block that fills up and leaves the window in the same growth is never keyed:
        # its last positions were never written in this group (they are outside the
        # window by the time the engine writes them), so its bytes are not the prefix's
        for i in range(max(key_start, first0, g.first), min(len(seq.keys), first0 + len(table))):
            pool.set_key(table[i - first0], seq.keys[i], _parent(seq.keys, i))
        if g.num_release:
            pool.release(table[: g.num_release])
            self.released_refs[w] += g.num_release
            del table[: g.num_release]
        new = self._take(w, pool, g.num_new)
        pool.set_keys(new, seq.keys[g.start :], _parent(seq.keys, g.start))
        table.extend(new)
        seq.first[w] = g.first
        self.ledger.pending[w].gen_alloc_blocks += g.num_new

    def set_status(self, seq_id: SeqId, status: SequenceStatus) -> None:
        """Move a sequence between statuses.

        Block-holding statuses need a sequence that holds blocks; QUEUEING
        (preempted) and COMPLETED release its blocks and keep the record.
        """
        seq = self._get(seq_id)
        if not isinstance(status, SequenceStatus):
            raise TypeError(f"status must be a SequenceStatus, got {status!r}")
        if status in VALID_STATUSES and not seq.holds_blocks:
            raise ValueError(
                f"seq_id {seq_id!r} holds no blocks (status {seq.status.name}); "
                f"cannot set {status.name}; add_sequence it first"
            )
        if status not in VALID_STATUSES:
            self._release_all(seq)
            self._set_commitment(seq, {})
        self.status_counts[seq.status] -= 1
        self.status_counts[status] += 1
        seq.status = status

    def free_sequence(self, seq_id: SeqId) -> None:
        """Release every block (tail first) and forget the sequence."""
        seq = self._get(seq_id)
        self._release_all(seq)
        self._set_commitment(seq, {})
        self.status_counts[seq.status] -= 1
        del self.seqs[seq_id]

    def _release_all(self, seq: SeqState) -> None:
        for w, table in seq.tables.items():
            self.pools[w].release(reversed(table))
            self.released_refs[w] += len(table)
        seq.tables = {}
        seq.first = {}

    def _get(self, seq_id: SeqId) -> SeqState:
        check_seq_id(seq_id)
        seq = self.seqs.get(seq_id)
        if seq is None:
            raise ValueError(f"unknown seq_id {seq_id!r}")
        return seq

    # ----------------------------------------------------------------- queries

    def has_sequence(self, seq_id: SeqId) -> bool:
        return seq_id in self.seqs

    def sequence_ids(self) -> list[SeqId]:
        return list(self.seqs)

    def status_of(self, seq_id: SeqId) -> SequenceStatus:
        return self._get(seq_id).status

    def num_tokens(self, seq_id: SeqId) -> int:
        return self._get(seq_id).num_tokens

    def block_table(self, seq_id: SeqId, window: Window = None) -> list[int]:
        """The blocks `seq_id` holds in `window`'s pool, oldest first."""
        seq = self._get(seq_id)
        self._check_window(window)
        return list(seq.tables.get(window, ()))

    def first_block_index(self, seq_id: SeqId, window: Window = None) -> int:
        """Logical index of block_table(seq_id, window)[0] (> 0 once a window slides)."""
        self._check_window(window)
        return self._get(seq_id).first.get(window, 0)

    def block_keys(self, seq_id: SeqId) -> list[bytes]:
        return list(self._get(seq_id).keys)

    def prompt_reuse(self, seq_id: SeqId) -> tuple[int, int]:
        """(tokens of its prompt reused on this GPU, tokens reused or onboarded from the
        host tier): the leading part every window found; the rest was computed."""
        seq = self._get(seq_id)
        return seq.prompt_reused_tokens, seq.prompt_covered_tokens

    def reusable_keys(self) -> dict[int, list[bytes]]:
        """Per window group (its index in `windows`), every key a prompt could reuse
        now: what the cluster block index should hold for this rank."""
        return {g: list(self.pools[w].key_to_block) for g, w in enumerate(self.windows)}

    def _check_window(self, window: Window) -> None:
        if window not in self.pools:
            raise ValueError(f"window {window!r} is not one of {list(self.windows)}")

    def stats(self) -> KVStats:
        """A snapshot: per-window block gauges and sequences by status. O(windows)."""
        B = self.block_size
        return KVStats(
            windows={
                w: BlockGauges(p.num_blocks, p.num_used, p.num_cached, B, self.committed(w))
                for w, p in self.pools.items()
            },
            num_sequences_by_status=dict(self.status_counts),
        )

    def commit_iteration(self) -> IterationStats:
        """Hand out the deltas since the previous commit and start a new interval."""
        return self.ledger.commit()

    def cumulative(self) -> IterationStats:
        """Every delta since the cache was built, committed or pending."""
        return self.ledger.cumulative()

    def trtllm_stats(self) -> dict[str, Any]:
        """Gauges and cumulative counters with TensorRT-LLM's kvCacheStats names and
        meanings (kvfold.worker.trtllm), summed and per window."""
        return trtllm_stats(self.stats(), self.cumulative())

    # ----------------------------------------------------------------- storage

    def write_kv(
        self, seq_id: SeqId, layer: int, positions: Sequence[int], k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Write K and V ([len(positions), num_kv_heads, head_dim]) of one layer at token
        positions the sequence holds in the layer's window group."""
        seq = self._get(seq_id)
        window = self.config.window_of_layer(layer)
        pos = as_token_array(positions, "positions")
        if pos.size and not seq.holds_blocks:
            raise ValueError(f"seq_id {seq_id!r} holds no blocks (status {seq.status.name})")
        held = (seq.tables.get(window, []), seq.first.get(window, 0), seq.num_tokens)
        self.storage.write_tokens(window, layer, held, pos, k, v)

    def gather_kv(self, seq_id: SeqId, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer for the tokens attention sees: [0, L) for full
        attention, [max(0, L-W), L) for a window W. Shapes [n, heads, head_dim]."""
        seq = self._get(seq_id)
        window = self.config.window_of_layer(layer)
        if not seq.holds_blocks:
            raise ValueError(f"seq_id {seq_id!r} holds no blocks (status {seq.status.name})")
        L = seq.num_tokens
        base = seq.first[window] * self.block_size
        start = self.managers[window].first_token(L)
        return self.storage.gather(window, layer, seq.tables[window], start - base, L - base)

    def check_integrity(self) -> None:
        """Recount everything from the block tables; raise IntegrityError with the numbers."""
        check_cache_integrity(self)

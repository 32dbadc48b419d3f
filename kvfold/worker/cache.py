"""PagedKVCache: one rank's paged KV cache, with prefix reuse, windows and exact stats.

Each window group has its own block pool; a sequence holds, in each, the blocks
its window still needs (kvfold.worker.windows). Prompt lookup, per window from the
window's first block: contiguous hits in this rank's pool (reused), then contiguous
hits in the node's host tier (onboarded; kvfold.worker.host_path), then the rest
taken and left for the engine to compute (missed). At most floor((L-1)/B) blocks
are reused: the last token is always computed.

Every public method either completes or raises before changing anything; lack of
room returns False. Counters are interval deltas handed out by `commit_iteration()`
(kvfold.worker.deltas), with TensorRT-LLM's meanings. This module changes the block
tables (per window, through kvfold.worker.placement); what reads them (queries,
stats, K/V reads and writes) is the base class, kvfold.worker.cache_reads.
"""

from __future__ import annotations

import numpy as np

from kvfold.kvevents.journal import EventJournal
from kvfold.stats import VALID_STATUSES, SequenceStatus, Window
from kvfold.worker.block_pool import BlockPool
from kvfold.worker.cache_reads import CacheReads
from kvfold.worker.commitments import Policy, declared_end
from kvfold.worker.config import KVCacheConfig
from kvfold.worker.deltas import DeltaLedger
from kvfold.worker.hashing import TokenIds, as_token_array, extend_keys, new_hasher
from kvfold.worker.host_path import HostLink, HostTier
from kvfold.worker.placement import (
    GrowthPlan,
    PromptPlan,
    apply_growth,
    apply_prompt,
    growth_fits,
    plan_growth,
    plan_prompt,
)
from kvfold.worker.sequence import SeqId, SeqState, check_seq_id
from kvfold.worker.storage_holder import StorageHolder
from kvfold.worker.windows import WindowManager, window_manager


class PagedKVCache(CacheReads):
    """Owns the block pools, the sequences' block tables and the K/V storage of one rank."""

    def __init__(
        self,
        config: KVCacheConfig,
        host_tier: HostTier | None = None,
        *,
        storage_later: bool = False,
    ) -> None:
        if not isinstance(config, KVCacheConfig):
            raise TypeError(f"config must be a KVCacheConfig, got {type(config).__name__}")
        self.config = config
        self.block_size = config.tokens_per_block
        self.windows = config.windows
        reuse = config.enable_prefix_reuse  # without it blocks record no tokens (block_pool)
        self.pools = {w: BlockPool(config.num_blocks_of(w), reuse) for w in self.windows}
        self.managers: dict[Window, WindowManager] = {
            w: window_manager(w, self.block_size) for w in self.windows
        }
        # the K/V bytes: now, or (storage_later) at their first use
        self.storage_holder = StorageHolder(config, build_now=not storage_later)
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
        self.host = None if host_tier is None else HostLink(host_tier, self.storage_holder.get)
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
        max_new_tokens: int | None = None,
        policy: Policy = Policy.GUARANTEED_NO_EVICT,
        count_refusal: bool = True,
    ) -> bool:
        """Allocate a prompt with prefix reuse; status becomes IN_PREFILL.

        The sequence is declared to reach prompt + max_new_tokens (GUARANTEED_NO_EVICT)
        or prompt + one block (MAX_UTILIZATION). `max_new_tokens=None` (not declared)
        declares the prompt alone, for direct uses; a placement made under an admission
        decision goes through the rank (kvfold.worker.rank_actor), which requires it
        where the promise depends on it. Returns False (nothing changed,
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
        new_tokens = 0 if max_new_tokens is None else max_new_tokens
        end = declared_end(int(tokens.size), new_tokens, policy, B)
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
            apply_prompt(seq, plan, self.ledger.pending[plan.window], self.storage_holder.get)
        seq.prompt_reused_tokens = min(p.covered(len(p.hits)) for p in plans)
        seq.prompt_covered_tokens = min(p.covered(len(p.hits) + len(p.payloads)) for p in plans)
        L = seq.num_tokens
        self._set_commitment(seq, {w: m.commitment(L, end) for w, m in self.managers.items()})
        if old is not None:
            self.status_counts[SequenceStatus.QUEUEING] -= 1
        self.seqs[seq_id] = seq
        self.status_counts[SequenceStatus.IN_PREFILL] += 1
        self._flush_offloads()
        return True

    def _plan_prompt(self, length: int, keys: list[bytes], end: int) -> list[PromptPlan] | None:
        """Per window: the reusable run and the blocks to take; None if one lacks room,
        or if the sequence's commitment to `end` tokens would over-commit the window."""
        plans = []
        for w, pool in self.pools.items():
            plan = plan_prompt(
                w, pool, self.managers[w], length, keys, end, self.committed(w), self.block_size
            )
            if plan is None:
                return None
            plans.append(plan)
        return plans

    def _set_commitment(self, seq: SeqState, commit: dict[Window, int]) -> None:
        sums = self.commit_sums
        for w, n in seq.commit.items():
            sums[w] -= n
        for w, n in commit.items():
            sums[w] += n
        seq.commit = commit

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
            counts = self.ledger.pending[plan.window]
            self.released_refs[plan.window] += apply_growth(seq, plan, key_start, counts)
        seq.num_tokens = length
        seq.end = end
        self._set_commitment(seq, commit)
        self._flush_offloads()
        return True

    def _fits_growth(
        self, seq: SeqState, plans: list[GrowthPlan], commit: dict[Window, int]
    ) -> bool:
        """Whether growing past the declared end keeps every window's committed <= total."""
        return all(
            growth_fits(
                p,
                self.managers[p.window],
                commit[p.window] - seq.commit.get(p.window, 0),
                self.committed(p.window),
            )
            for p in plans
        )

    def _plan_growth(self, seq: SeqState, length: int) -> list[GrowthPlan] | None:
        plans = []
        for w, pool in self.pools.items():
            plan = plan_growth(w, pool, self.managers[w], seq, length)
            if plan is None:
                return None
            plans.append(plan)
        return plans

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

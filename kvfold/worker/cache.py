"""PagedKVCache: one rank's paged KV cache, with prefix reuse, windows and exact stats.

A sequence of L tokens holds, in each window pool, the blocks that intersect
its window (full attention: all of them):

    B = 4, W = 8, L = 14     tokens 0 ........................ 13
    logical blocks            [ 0 ][ 1 ][ 2 ][ 3 ]
    window [L-W, L) = [6,14)        ^^^^^^^^^^^^^^^  -> held: 1, 2, 3 (block 0 released)

Prompt lookup (per window, from the window's first block): contiguous hits in
this rank's pools, then contiguous hits in the node's host tier (onboarded),
then the rest computed (missed). At most floor((L-1)/B) blocks are reused:
the last token is always computed.

Every public method either completes or raises before changing anything;
lack of room returns False. Counters are interval deltas handed out by
`commit_iteration()`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvfold.checks import is_int
from kvfold.stats import (
    DELTA_FIELDS,
    VALID_STATUSES,
    BlockDeltas,
    BlockGauges,
    IterationStats,
    KVStats,
    SequenceStatus,
    Window,
)
from kvfold.worker.block_pool import BlockPool
from kvfold.worker.config import KVCacheConfig
from kvfold.worker.hashing import Hasher, TokenIds, as_token_array, extend_keys, new_hasher
from kvfold.worker.host_path import HostLink, HostTier
from kvfold.worker.storage import KVStorage
from kvfold.worker.trtllm import trtllm_stats

SeqId = str | int


class _Counts:
    """Mutable deltas of one window for the open interval (frozen by `freeze`)."""

    __slots__ = DELTA_FIELDS

    alloc_total_blocks: int
    alloc_new_blocks: int
    reused_blocks: int
    onboarded_blocks: int
    onboarded_bytes: int
    missed_blocks: int
    gen_alloc_blocks: int
    evicted_blocks: int
    offloaded_blocks: int
    offloaded_bytes: int

    def __init__(self) -> None:
        for f in DELTA_FIELDS:
            setattr(self, f, 0)

    def freeze(self) -> BlockDeltas:
        return BlockDeltas(*(getattr(self, f) for f in DELTA_FIELDS))


@dataclass(slots=True)
class _Sequence:
    seq_id: SeqId
    hasher: Hasher  # running prefix hash, advanced past every full block
    status: SequenceStatus
    num_tokens: int = 0
    keys: list[bytes] = field(default_factory=list)  # keys of full blocks, in order
    tail: list[int] = field(default_factory=list)  # tokens of the partial last block
    tables: dict[Window, list[int]] = field(default_factory=dict)  # held blocks per window
    first: dict[Window, int] = field(default_factory=dict)  # logical index of tables[w][0]

    @property
    def holds_blocks(self) -> bool:
        return self.status in VALID_STATUSES


def _check_seq_id(seq_id: object) -> SeqId:
    if not isinstance(seq_id, str) and not is_int(seq_id):
        raise TypeError(f"seq_id must be a str or int, got {seq_id!r} ({type(seq_id).__name__})")
    return seq_id


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class PagedKVCache:
    """Owns the block pools, the sequences' block tables and the K/V storage of one rank."""

    def __init__(self, config: KVCacheConfig, host_tier: HostTier | None = None) -> None:
        if not isinstance(config, KVCacheConfig):
            raise TypeError(f"config must be a KVCacheConfig, got {type(config).__name__}")
        self.config = config
        self.block_size = config.tokens_per_block
        self.windows = config.windows
        self.pools = {w: BlockPool(config.num_blocks_of(w)) for w in self.windows}
        self.storage = KVStorage(config)
        self._seqs: dict[SeqId, _Sequence] = {}
        self._status_counts = dict.fromkeys(SequenceStatus, 0)
        self._pending = {w: _Counts() for w in self.windows}
        self._committed = {w: BlockDeltas() for w in self.windows}  # cumulative
        self._released_refs = dict.fromkeys(self.windows, 0)  # cumulative, for integrity
        self._evicted_committed = dict.fromkeys(self.windows, 0)
        self.host: HostLink | None = None
        self.set_host_tier(host_tier)

    # ----------------------------------------------------------------- host tier

    def set_host_tier(self, host_tier: HostTier | None) -> None:
        """Attach (or detach with None) the node's host tier: evictions offload to it,
        prompt misses onboard from it (kvfold.worker.host_path)."""
        self.host = None if host_tier is None else HostLink(host_tier, self.storage)
        for w, pool in self.pools.items():
            pool.evict_listener = None if self.host is None else self.host.copier(w)

    @property
    def host_tier(self) -> HostTier | None:
        return None if self.host is None else self.host.tier

    def _flush_offloads(self) -> None:
        if self.host is not None:
            for window, nbytes in self.host.flush():
                self.record_offload(window, nbytes)

    def record_offload(self, window: Window, nbytes: int, num_blocks: int = 1) -> None:
        """Count blocks the host tier confirmed it stored (for tiers that answer later)."""
        self._check_window(window)
        c = self._pending[window]
        c.offloaded_blocks += num_blocks
        c.offloaded_bytes += nbytes

    # ----------------------------------------------------------------- sequences

    def queue_sequence(self, seq_id: SeqId) -> None:
        """Register a known sequence that holds no blocks yet (QUEUEING)."""
        _check_seq_id(seq_id)
        if seq_id in self._seqs:
            raise ValueError(f"seq_id {seq_id!r} already exists")
        self._seqs[seq_id] = _Sequence(seq_id, None, SequenceStatus.QUEUEING)
        self._status_counts[SequenceStatus.QUEUEING] += 1

    def add_sequence(
        self, seq_id: SeqId, token_ids: TokenIds, salt: str | bytes | None = None
    ) -> bool:
        """Allocate a prompt with prefix reuse; status becomes IN_PREFILL.

        Per window: blocks cached on this rank are attached (reused), then the
        blocks the node's host tier holds are copied into taken blocks
        (onboarded), then the rest is taken and left for the engine to compute
        (missed). Returns False (nothing changed) when some window pool lacks
        room. A QUEUEING sequence may be added; any other existing id is an error.
        The host tier is asked before anything changes; its failures are misses.
        """
        _check_seq_id(seq_id)
        old = self._seqs.get(seq_id)
        if old is not None and old.status is not SequenceStatus.QUEUEING:
            raise ValueError(f"seq_id {seq_id!r} already exists (status {old.status.name})")
        tokens = as_token_array(token_ids)
        if tokens.size == 0:
            raise ValueError(f"token_ids must not be empty (seq_id {seq_id!r})")
        hasher = new_hasher(salt)
        B = self.block_size
        L = int(tokens.size)
        num_logical = _ceil_div(L, B)
        reuse = self.config.enable_prefix_reuse
        keys = extend_keys(hasher, tokens, B) if reuse else []
        limit = min((L - 1) // B, len(keys))  # reusable blocks: the last token is computed

        plans: list[tuple[Window, BlockPool, int, list[int], int]] = []
        for w, pool in self.pools.items():
            first = 0 if w is None else max(0, L - w) // B
            hits: list[int] = []
            lookup = pool.key_to_block.get
            for i in range(first, limit):
                b = lookup(keys[i])
                if b is None:
                    break
                hits.append(b)
            num_new = num_logical - first - len(hits)
            refs = pool.ref_counts
            revived = sum(1 for b in hits if refs[b] == 0)
            if num_new + revived > pool.num_free:
                return False
            plans.append((w, pool, first, hits, num_new))

        onboard: dict[Window, list[np.ndarray]] = {}
        if self.host is not None:
            for w, _, first, hits, _ in plans:
                start = first + len(hits)
                onboard[w] = self.host.fetch(w, keys[start:limit])

        seq = _Sequence(seq_id, hasher, SequenceStatus.IN_PREFILL, num_tokens=L)
        if reuse:
            seq.keys = keys
            seq.tail = tokens[len(keys) * B :].tolist()
        for w, pool, first, hits, num_new in plans:
            for b in hits:
                pool.attach(b)
            new = self._take(w, pool, num_new)
            payloads = onboard.get(w, [])
            for block, payload in zip(new, payloads, strict=False):
                self.storage.write_block(w, block, payload)
            if reuse:
                pool.set_keys(new, keys[first + len(hits) :])
            seq.tables[w] = hits + new
            seq.first[w] = first
            c = self._pending[w]
            c.reused_blocks += len(hits)
            c.onboarded_blocks += len(payloads)
            c.onboarded_bytes += sum(int(p.nbytes) for p in payloads)
            c.missed_blocks += num_new - len(payloads)
        if old is not None:
            self._status_counts[SequenceStatus.QUEUEING] -= 1
        self._seqs[seq_id] = seq
        self._status_counts[SequenceStatus.IN_PREFILL] += 1
        self._flush_offloads()
        return True

    def _take(self, window: Window, pool: BlockPool, n: int) -> list[int]:
        """Take `n` blocks (room already checked) and count them as TensorRT-LLM does:
        all in alloc_total, those that held no cached content in alloc_new."""
        evicted_before = pool.evicted_total
        new = pool.take(n)
        assert new is not None  # room was checked by the caller
        c = self._pending[window]
        c.alloc_total_blocks += n
        c.alloc_new_blocks += n - (pool.evicted_total - evicted_before)
        return new

    def append_tokens(self, seq_id: SeqId, token_ids: TokenIds) -> bool:
        """Grow a sequence by decoded tokens. False (nothing changed) when out of room.

        Sliding-window pools release the blocks that fall wholly out of the
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
        B = self.block_size
        L0 = seq.num_tokens
        L1 = L0 + int(tokens.size)
        n0, n1 = _ceil_div(L0, B), _ceil_div(L1, B)
        plans: list[tuple[Window, BlockPool, int, int, int]] = []
        for w, pool in self.pools.items():
            first0 = seq.first[w]
            first1 = first0 if w is None else max(first0, max(0, L1 - w) // B)
            num_release = max(0, min(first1, n0) - first0)
            num_new = n1 - max(n0, first1)
            refs = pool.ref_counts
            freed = sum(1 for b in seq.tables[w][:num_release] if refs[b] == 1)
            if num_new > pool.num_free + freed:
                return False
            plans.append((w, pool, first1, num_release, num_new))

        new_keys: list[bytes] = []
        if self.config.enable_prefix_reuse:
            tail = np.concatenate([np.asarray(seq.tail, dtype=np.int64), tokens])
            new_keys = extend_keys(seq.hasher, tail, B)
            seq.tail = tail[len(new_keys) * B :].tolist()
        key_start = len(seq.keys)
        seq.keys.extend(new_keys)
        for w, pool, first1, num_release, num_new in plans:
            table = seq.tables[w]
            first0 = seq.first[w]
            # key the blocks that just became full and are still held
            for i in range(key_start, key_start + len(new_keys)):
                if first0 <= i < first0 + len(table):
                    pool.set_key(table[i - first0], seq.keys[i])
            if num_release:
                pool.release(table[:num_release])
                self._released_refs[w] += num_release
                del table[:num_release]
            new = self._take(w, pool, num_new)
            for j, b in enumerate(new):
                i = max(n0, first1) + j
                if i < len(seq.keys):
                    pool.set_key(b, seq.keys[i])
            table.extend(new)
            seq.first[w] = first1
            self._pending[w].gen_alloc_blocks += num_new
        seq.num_tokens = L1
        self._flush_offloads()
        return True

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
        self._status_counts[seq.status] -= 1
        self._status_counts[status] += 1
        seq.status = status

    def free_sequence(self, seq_id: SeqId) -> None:
        """Release every block (tail first) and forget the sequence."""
        seq = self._get(seq_id)
        self._release_all(seq)
        self._status_counts[seq.status] -= 1
        del self._seqs[seq_id]

    def _release_all(self, seq: _Sequence) -> None:
        for w, table in seq.tables.items():
            self.pools[w].release(reversed(table))
            self._released_refs[w] += len(table)
        seq.tables = {}
        seq.first = {}

    def _get(self, seq_id: SeqId) -> _Sequence:
        _check_seq_id(seq_id)
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise ValueError(f"unknown seq_id {seq_id!r}")
        return seq

    # ----------------------------------------------------------------- queries

    def has_sequence(self, seq_id: SeqId) -> bool:
        return seq_id in self._seqs

    def sequence_ids(self) -> list[SeqId]:
        return list(self._seqs)

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

    def _check_window(self, window: Window) -> None:
        if window not in self.pools:
            raise ValueError(f"window {window!r} is not one of {list(self.windows)}")

    def stats(self) -> KVStats:
        """A snapshot: per-window block gauges and sequences by status. O(windows)."""
        B = self.block_size
        return KVStats(
            windows={
                w: BlockGauges(p.num_blocks, p.num_used, len(p.evictable), B)
                for w, p in self.pools.items()
            },
            num_sequences_by_status=dict(self._status_counts),
        )

    def commit_iteration(self) -> IterationStats:
        """Hand out the deltas since the previous commit and start a new interval."""
        out: dict[Window, BlockDeltas] = {}
        for w, pool in self.pools.items():
            c = self._pending[w]
            c.evicted_blocks = pool.evicted_total - self._evicted_committed[w]
            self._evicted_committed[w] = pool.evicted_total
            d = c.freeze()
            out[w] = d
            self._committed[w] = self._committed[w] + d
            self._pending[w] = _Counts()
        return IterationStats(out)

    def trtllm_stats(self) -> dict[str, Any]:
        """Gauges and cumulative counters with TensorRT-LLM's kvCacheStats names and
        meanings (kvfold.worker.trtllm), summed and per window."""
        return trtllm_stats(self.stats(), self.cumulative())

    def cumulative(self) -> IterationStats:
        """Every delta since the cache was built, committed or pending."""
        out = {}
        for w, pool in self.pools.items():
            c = self._pending[w].freeze()
            evicted = pool.evicted_total - self._evicted_committed[w]
            out[w] = self._committed[w] + c + BlockDeltas(evicted_blocks=evicted)
        return IterationStats(out)

    # ----------------------------------------------------------------- storage

    def write_kv(
        self,
        seq_id: SeqId,
        layer: int,
        positions: Sequence[int],
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Write K and V ([len(positions), num_kv_heads, head_dim]) of one layer."""
        seq = self._get(seq_id)
        window = self.config.window_of_layer(layer)
        pos = as_token_array(positions, "positions")
        shape = (int(pos.size), *self.storage.token_shape)
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name} must be a tensor of shape {shape}, got {got}")
        if pos.size == 0:
            return
        if not seq.holds_blocks:
            raise ValueError(f"seq_id {seq_id!r} holds no blocks (status {seq.status.name})")
        B = self.block_size
        logical = pos // B
        first = seq.first[window]
        table = seq.tables[window]
        lo, hi = int(pos.min()), int(pos.max())
        if hi >= seq.num_tokens or int(logical.min()) < first:
            raise ValueError(
                f"positions must lie in the held range [{first * B}, {seq.num_tokens}) of "
                f"window {window!r}, got [{lo}, {hi}]"
            )
        blocks = torch.tensor([table[i - first] for i in logical.tolist()], dtype=torch.long)
        offsets = torch.from_numpy(pos % B)
        dev = self.storage.device
        self.storage.write(window, layer, blocks.to(dev), offsets.to(dev), k, v)

    def gather_kv(self, seq_id: SeqId, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer for the tokens attention sees: [0, L) for full
        attention, [max(0, L-W), L) for a window W. Shapes [n, heads, head_dim]."""
        seq = self._get(seq_id)
        window = self.config.window_of_layer(layer)
        if not seq.holds_blocks:
            raise ValueError(f"seq_id {seq_id!r} holds no blocks (status {seq.status.name})")
        B = self.block_size
        L = seq.num_tokens
        start_tok = 0 if window is None else max(0, L - window)
        base = seq.first[window] * B
        return self.storage.gather(window, layer, seq.tables[window], start_tok - base, L - base)

    # ----------------------------------------------------------------- integrity

    def check_integrity(self) -> None:
        """Recount everything from the block tables; raise IntegrityError with the numbers."""
        from kvfold.worker.integrity import check_cache_integrity

        check_cache_integrity(self)

"""CacheReads: what a rank's paged KV cache answers, and the K/V it moves, given its
block tables.

PagedKVCache (kvfold.worker.cache) changes the block tables; this base class only
reads them: per-sequence queries, gauges and counters, the integrity recount, and
K/V written to and gathered from the blocks a sequence holds. It owns no state: the
attributes below are PagedKVCache's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvfold.stats import BlockGauges, IterationStats, KVStats, SequenceStatus, Window
from kvfold.worker.block_pool import BlockPool
from kvfold.worker.config import KVCacheConfig
from kvfold.worker.deltas import DeltaLedger
from kvfold.worker.hashing import as_token_array
from kvfold.worker.integrity import check_cache_integrity
from kvfold.worker.sequence import SeqId, SeqState, check_seq_id
from kvfold.worker.storage_holder import StorageHolder
from kvfold.worker.trtllm import trtllm_stats
from kvfold.worker.windows import WindowManager

if TYPE_CHECKING:
    import torch

    from kvfold.worker.storage import KVStorage


class CacheReads:
    """The read side of PagedKVCache (its state, declared here, is set by its __init__)."""

    config: KVCacheConfig
    block_size: int
    windows: tuple[Window, ...]
    pools: dict[Window, BlockPool]
    managers: dict[Window, WindowManager]
    storage_holder: StorageHolder
    seqs: dict[SeqId, SeqState]
    status_counts: dict[SequenceStatus, int]
    ledger: DeltaLedger
    released_refs: dict[Window, int]
    commit_sums: dict[Window, int]  # per window: the sequences' commitments summed

    @property
    def storage(self) -> KVStorage:
        """The K/V bytes (built now if they were left for their first use)."""
        return self.storage_holder.get()

    def committed(self, window: Window) -> int:
        """Blocks of `window` its sequences hold plus those they may still need to reach
        their declared lengths (kvfold.worker.commitments); never above total."""
        own = self.commit_sums[window]
        return own if self.managers[window].counts_held else own + self.pools[window].num_used

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

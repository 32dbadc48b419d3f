"""BlockLayout: the shape of a block's bytes, which a rank declares and its node's host
tier checks before it stores or serves a block. Pure."""

from __future__ import annotations

from dataclasses import dataclass

from kvfold.stats import Window


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """The shape of a block's bytes: what the host tier checks before storing or serving."""

    tokens_per_block: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    bytes_per_block: tuple[tuple[Window, int], ...]  # per window group, in window order

    @property
    def max_block_nbytes(self) -> int:
        return max(n for _, n in self.bytes_per_block)

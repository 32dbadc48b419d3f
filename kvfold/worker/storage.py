"""KVStorage: the real K/V bytes of one rank, one torch tensor per window pool.

    pool[window]: [num_blocks, layers_in_group, 2 (K, V), tokens_per_block, num_kv_heads, head_dim]

On CUDA when present (device="auto"), else CPU. Owns no block accounting: the
cache decides which block and offset a token lives in.
"""

from __future__ import annotations

import numpy as np
import torch

from kvfold.stats import Window
from kvfold.worker.config import KVCacheConfig

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def resolve_device(device: str) -> torch.device:
    """'auto' -> the current CUDA device when there is one, else CPU."""
    if device == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} was asked for, but CUDA is not available here")
    return torch.device(device)


class KVStorage:
    def __init__(self, config: KVCacheConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = TORCH_DTYPES[config.dtype]
        self.pools: dict[Window, torch.Tensor] = {}
        self._layer_slot: dict[int, int] = {}
        for w in config.windows:
            layers = config.layers_of(w)
            for slot, layer in enumerate(layers):
                self._layer_slot[layer] = slot
            self.pools[w] = torch.zeros(
                (
                    config.num_blocks_of(w),
                    len(layers),
                    2,
                    config.tokens_per_block,
                    config.num_kv_heads,
                    config.head_dim,
                ),
                dtype=self.dtype,
                device=self.device,
            )

    def slot_of_layer(self, layer: int) -> int:
        """Where `layer` sits in its window group's pool (dimension 1)."""
        return self._layer_slot[layer]

    @property
    def token_shape(self) -> tuple[int, int]:
        return (self.config.num_kv_heads, self.config.head_dim)

    def write(
        self,
        window: Window,
        layer: int,
        block_ids: torch.Tensor,
        offsets: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        pool = self.pools[window]
        slot = self._layer_slot[layer]
        pool[block_ids, slot, 0, offsets] = k.to(device=self.device, dtype=self.dtype)
        pool[block_ids, slot, 1, offsets] = v.to(device=self.device, dtype=self.dtype)

    def write_tokens(
        self,
        window: Window,
        layer: int,
        held: tuple[list[int], int, int],
        positions: np.ndarray,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Write K/V of one layer at token `positions` of a sequence whose `held` blocks
        are (block table, logical index of its first block, number of tokens). Checks
        everything before writing a byte."""
        table, first, num_tokens = held
        B = self.config.tokens_per_block
        shape = (int(positions.size), *self.token_shape)
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name} must be a tensor of shape {shape}, got {got}")
        if positions.size == 0:
            return
        logical = positions // B
        if int(positions.max()) >= num_tokens or int(logical.min()) < first:
            raise ValueError(
                f"positions must lie in the held range [{first * B}, {num_tokens}) of "
                f"window {window!r}, got [{int(positions.min())}, {int(positions.max())}]"
            )
        blocks = torch.tensor([table[i - first] for i in logical.tolist()], dtype=torch.long)
        offsets = torch.from_numpy(positions % B)
        self.write(window, layer, blocks.to(self.device), offsets.to(self.device), k, v)

    def gather(
        self, window: Window, layer: int, block_ids: list[int], start: int, stop: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of token slots [start, stop) of the concatenated blocks."""
        pool = self.pools[window]
        slot = self._layer_slot[layer]
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        kv = pool.index_select(0, idx)[:, slot]  # [n, 2, B, H, D]
        h, d = self.token_shape
        k = kv[:, 0].reshape(-1, h, d)[start:stop]
        v = kv[:, 1].reshape(-1, h, d)[start:stop]
        return k, v

    def block_nbytes(self, window: Window) -> int:
        pool = self.pools[window]
        return int(pool[0].numel() * pool.element_size())

    def read_block(self, window: Window, block: int) -> np.ndarray:
        """A copy of one block's K/V of every layer in the group, as raw bytes (uint8, on
        the host). Never a view of the pool: the block may be rewritten right after."""
        t = self.pools[window][block]
        t = t.clone() if t.device.type == "cpu" else t.cpu()
        return t.view(torch.uint8).reshape(-1).numpy()

    def write_block(self, window: Window, block: int, data: np.ndarray) -> None:
        """Overwrite one block from raw bytes produced by `read_block` on the same geometry."""
        pool = self.pools[window]
        nbytes = self.block_nbytes(window)
        if data.dtype != np.uint8 or data.shape != (nbytes,):
            raise ValueError(
                f"block payload must be {nbytes} uint8 bytes for window {window!r}, "
                f"got {data.size} {data.dtype}"
            )
        src = torch.from_numpy(np.ascontiguousarray(data)).to(self.device)
        pool[block].view(-1).view(torch.uint8).copy_(src)

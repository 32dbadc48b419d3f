"""KVCacheConfig: the geometry of one rank's paged KV cache, validated up front."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvfold.checks import check_bool, check_index, check_int
from kvfold.hosttier.layout import BlockLayout
from kvfold.stats import Window, window_sort_key

DTYPE_BYTES: dict[str, int] = {"float16": 2, "bfloat16": 2, "float32": 4}
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class KVCacheConfig:
    """One rank's KV cache.

    windows: `None` is full attention; an int is a sliding window of that many
    tokens. Each window group has its own block pool. `num_blocks` is one int
    for every pool or `{window: int}`. `layer_windows[i]` is the window of layer
    i; by default layers are dealt round-robin over `windows` (as in models
    that interleave sliding and full attention layers).
    """

    tokens_per_block: int = 16
    num_blocks: int | Mapping[Window, int] = 256
    windows: tuple[Window, ...] = (None,)
    num_layers: int = 2
    num_kv_heads: int = 2
    head_dim: int = 64
    dtype: str = "float16"
    device: str = "auto"
    enable_prefix_reuse: bool = True
    layer_windows: tuple[Window, ...] | None = None
    _blocks: dict[Window, int] = field(init=False, repr=False, compare=False)
    _layers: dict[Window, tuple[int, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_int("tokens_per_block", self.tokens_per_block, 1)
        check_int("num_layers", self.num_layers, 1)
        check_int("num_kv_heads", self.num_kv_heads, 1)
        check_int("head_dim", self.head_dim, 1)
        if not isinstance(self.windows, tuple) or not self.windows:
            raise ValueError(f"windows must be a non-empty tuple, got {self.windows!r}")
        for w in self.windows:
            if w is not None:
                check_int(f"window {w!r}", w, 1)
        if len(set(self.windows)) != len(self.windows):
            raise ValueError(f"windows must be distinct, got {self.windows!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        if not isinstance(self.device, str) or not (
            self.device in DEVICES or self.device.startswith("cuda:")
        ):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        check_bool("enable_prefix_reuse", self.enable_prefix_reuse)
        object.__setattr__(self, "windows", tuple(sorted(self.windows, key=window_sort_key)))
        object.__setattr__(self, "_blocks", self._blocks_per_window())
        self._deal_layers()

    def _blocks_per_window(self) -> dict[Window, int]:
        blocks: dict[Window, int] = {}
        if isinstance(self.num_blocks, Mapping):
            if set(self.num_blocks) != set(self.windows):
                raise ValueError(
                    f"num_blocks keys {sorted(self.num_blocks, key=window_sort_key)} must be "
                    f"exactly the windows {list(self.windows)}"
                )
            for w in self.windows:
                blocks[w] = check_int(f"num_blocks[{w!r}]", self.num_blocks[w], 1)
        else:
            n = check_int("num_blocks", self.num_blocks, 1)
            blocks = dict.fromkeys(self.windows, n)
        return blocks

    def _deal_layers(self) -> None:
        """Check (or deal round-robin) which window group each layer belongs to."""
        layer_windows = self.layer_windows
        if layer_windows is None:
            layer_windows = tuple(
                self.windows[i % len(self.windows)] for i in range(self.num_layers)
            )
        if len(layer_windows) != self.num_layers:
            raise ValueError(
                f"layer_windows has {len(layer_windows)} entries, num_layers is {self.num_layers}"
            )
        layers: dict[Window, list[int]] = {w: [] for w in self.windows}
        for i, w in enumerate(layer_windows):
            if w not in layers:
                raise ValueError(f"layer_windows[{i}] = {w!r} is not one of windows {self.windows}")
            layers[w].append(i)
        for w, ls in layers.items():
            if not ls:
                raise ValueError(f"window {w!r} has no layer in layer_windows {layer_windows}")
        object.__setattr__(self, "layer_windows", tuple(layer_windows))
        object.__setattr__(self, "_layers", {w: tuple(ls) for w, ls in layers.items()})

    def num_blocks_of(self, window: Window) -> int:
        return self._blocks[window]

    def layers_of(self, window: Window) -> tuple[int, ...]:
        """The model layers whose K/V live in `window`'s pool, in order."""
        return self._layers[window]

    def window_of_layer(self, layer: int) -> Window:
        check_index("layer", layer, self.num_layers)
        assert self.layer_windows is not None
        return self.layer_windows[layer]

    def bytes_per_block(self, window: Window) -> int:
        """K and V of every layer in the window group, for one block."""
        return (
            len(self._layers[window])
            * 2
            * self.tokens_per_block
            * self.num_kv_heads
            * self.head_dim
            * DTYPE_BYTES[self.dtype]
        )

    def block_layout(self) -> BlockLayout:
        """What must match between a rank's blocks and its node's host tier."""
        return BlockLayout(
            self.tokens_per_block,
            self.num_kv_heads,
            self.head_dim,
            self.dtype,
            tuple((w, self.bytes_per_block(w)) for w in self.windows),
        )

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_per_block(w) * self._blocks[w] for w in self.windows)

    @classmethod
    def from_memory_budget(cls, budget_bytes: int, **kwargs: Any) -> KVCacheConfig:
        """Size every pool from a memory budget, as engines do.

        Every window pool gets the same number of blocks, the most that fits:
        num_blocks = budget_bytes // sum(bytes_per_block over windows).
        """
        check_int("budget_bytes", budget_bytes)
        if "num_blocks" in kwargs:
            raise ValueError("num_blocks is derived from budget_bytes; do not pass both")
        probe = cls(num_blocks=1, **kwargs)
        per_block = sum(probe.bytes_per_block(w) for w in probe.windows)
        n = budget_bytes // per_block
        if n < 1:
            raise ValueError(
                f"budget_bytes={budget_bytes} is too small for one block: one block in every "
                f"window pool needs {per_block} bytes"
            )
        return cls(num_blocks=n, **kwargs)

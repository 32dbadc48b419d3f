"""Small builders shared by unit tests."""

from __future__ import annotations

from kvfold.stats import Window
from kvfold.worker import KVCacheConfig, PagedKVCache


def make_config(
    num_blocks: int | dict[Window, int] = 16,
    windows: tuple[Window, ...] = (None,),
    tokens_per_block: int = 4,
    reuse: bool = True,
    **kw: object,
) -> KVCacheConfig:
    return KVCacheConfig(
        tokens_per_block=tokens_per_block,
        num_blocks=num_blocks,
        windows=windows,
        num_layers=kw.pop("num_layers", 2),  # type: ignore[arg-type]
        num_kv_heads=kw.pop("num_kv_heads", 2),  # type: ignore[arg-type]
        head_dim=kw.pop("head_dim", 8),  # type: ignore[arg-type]
        dtype=kw.pop("dtype", "float32"),  # type: ignore[arg-type]
        device="cpu",
        enable_prefix_reuse=reuse,
        **kw,  # type: ignore[arg-type]
    )


def make_cache(num_blocks: int | dict[Window, int] = 16, **kw: object) -> PagedKVCache:
    return PagedKVCache(make_config(num_blocks, **kw))  # type: ignore[arg-type]


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))

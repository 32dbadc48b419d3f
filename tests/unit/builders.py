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
        device=kw.pop("device", "cpu"),  # type: ignore[arg-type]
        enable_prefix_reuse=reuse,
        **kw,  # type: ignore[arg-type]
    )


def make_cache(num_blocks: int | dict[Window, int] = 16, **kw: object) -> PagedKVCache:
    return PagedKVCache(make_config(num_blocks, **kw))  # type: ignore[arg-type]


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def make_report(
    rank: int,
    used: int = 0,
    total: int = 16,
    cached: int = 0,
    window=None,  # type: ignore[no-untyped-def]
    incarnation: int = 1,
    seq: int = 1,
    reused: int = 0,
    missed: int = 0,
    statuses: dict | None = None,  # type: ignore[type-arg]
    unbound: bool = False,
    tickets: dict | None = None,  # type: ignore[type-arg]
    committed: int | None = None,
    refused: int = 0,
):  # type: ignore[no-untyped-def]
    from kvfold.stats import BlockDeltas, BlockGauges, RankReport, SequenceStatus

    counts = dict.fromkeys(SequenceStatus, 0)
    counts.update(statuses or {})
    return RankReport(
        rank=rank,
        incarnation=incarnation,
        seq=seq,
        gpu=None
        if unbound
        else {
            window: BlockGauges(total, used, cached, 4, used if committed is None else committed)
        },
        deltas={window: BlockDeltas(reused_blocks=reused, missed_blocks=missed)},
        num_sequences_by_status=counts,
        tickets=tickets or {},
        num_refused=refused,
    )


class PoolHostTier:
    """A HostTier over an in-process HostKVPool (the fake at the seam; the real one is a
    Ray actor)."""

    def __init__(self, num_blocks: int, slot_nbytes: int) -> None:
        from kvfold.hosttier import HostKVPool

        self.pool = HostKVPool(num_blocks, slot_nbytes, pin_memory=False)

    def fetch(self, window, keys):  # type: ignore[no-untyped-def]
        return self.pool.get(window, keys)

    def offload_many(self, items):  # type: ignore[no-untyped-def]
        return [self.pool.put(w, k, p) for w, k, p in items]

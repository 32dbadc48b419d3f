"""One GPU rank: block pool, paged KV cache, KV storage (and, in rank_actor, the Ray shell).

The names below are loaded on first use (PEP 562): a process that needs only a
light submodule (the aggregator and node actors need `config`, `tickets`,
`block_pool`) never imports torch through this package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvfold.stats import SequenceStatus
    from kvfold.worker.block_pool import BlockPool
    from kvfold.worker.cache import PagedKVCache
    from kvfold.worker.config import KVCacheConfig
    from kvfold.worker.hashing import block_keys
    from kvfold.worker.host_path import HostTier

_WHERE = {
    "BlockPool": "kvfold.worker.block_pool",
    "HostTier": "kvfold.worker.host_path",
    "KVCacheConfig": "kvfold.worker.config",
    "PagedKVCache": "kvfold.worker.cache",
    "SequenceStatus": "kvfold.stats",
    "block_keys": "kvfold.worker.hashing",
}

__all__ = ["BlockPool", "HostTier", "KVCacheConfig", "PagedKVCache", "SequenceStatus", "block_keys"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'kvfold.worker' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value

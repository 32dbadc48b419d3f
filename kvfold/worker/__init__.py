"""One GPU rank: block pool, paged KV cache, KV storage (and, in rank_actor, the Ray shell)."""

from kvfold.stats import SequenceStatus
from kvfold.worker.block_pool import BlockPool
from kvfold.worker.cache import PagedKVCache
from kvfold.worker.config import KVCacheConfig
from kvfold.worker.hashing import block_keys
from kvfold.worker.host_path import HostTier

__all__ = ["BlockPool", "HostTier", "KVCacheConfig", "PagedKVCache", "SequenceStatus", "block_keys"]

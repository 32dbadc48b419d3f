"""StorageHolder: a cache's KVStorage, built now or at its first use.

A rank on a GPU builds its storage before it reports (the capacity it reports is
memory it holds, as vLLM reserves its KV cache at start). A rank whose storage is on
the CPU (no GPU device here: the embedded cluster's simulated nodes) builds it at
first use, so ten starting ranks do not each load torch before they are fresh
(docs/decisions.md). `get()` builds under a lock: one build, whoever asks first.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from kvfold.devices import gpu_device_present
from kvfold.worker.config import KVCacheConfig

if TYPE_CHECKING:
    from kvfold.worker.storage import KVStorage


def storage_on_cpu(config: KVCacheConfig) -> bool:
    """Whether `config`'s storage will be on the CPU, known without loading torch."""
    return config.device == "cpu" or (config.device == "auto" and not gpu_device_present())


class StorageHolder:
    def __init__(self, config: KVCacheConfig, *, build_now: bool = True) -> None:
        self.config = config
        self._storage: KVStorage | None = None
        self._lock = threading.Lock()
        if build_now:
            self.get()

    @property
    def built(self) -> bool:
        return self._storage is not None

    def get(self) -> KVStorage:
        storage = self._storage
        if storage is not None:
            return storage
        with self._lock:
            if self._storage is None:
                from kvfold.worker.storage import KVStorage  # torch loads here

                self._storage = KVStorage(self.config)
            return self._storage

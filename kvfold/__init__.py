"""kvfold: one live, correct picture of KV-cache capacity across an LLM-serving cluster.

The core (topology, stats, worker, aggregator folds, admission policy) is plain
Python with no Ray import; the Ray shells live in `*_actor.py`, `cluster/`, `replay/`,
Ray Serve's modules in `serving/`, the `client.py` modules and `cli.py`, and are imported
lazily here. The rooms, from the ground up: the README's Layout.
"""

from __future__ import annotations

from typing import Any

from kvfold.stats import (
    BlockDeltas,
    BlockGauges,
    HostStats,
    IterationStats,
    KVStats,
    SequenceStatus,
)
from kvfold.topology import Topology

__version__ = "0.1.0"

_LAZY = {
    "KVCacheConfig": "kvfold.worker.config",
    "PagedKVCache": "kvfold.worker.cache",
    "HostKVPool": "kvfold.hosttier",
    "fold_node": "kvfold.aggregator.fold",
    "fold_cluster": "kvfold.aggregator.fold",
    "NodeUtilization": "kvfold.view",
    "ClusterView": "kvfold.view",
    "KVCacheManager": "kvfold.kv_manager",
    "KVStatsBackend": "kvfold.kv_manager",
    "KVUtilizationRequest": "kvfold.kv_manager",
    "HostKVUtilization": "kvfold.kv_manager",
    "should_trigger_prefill": "kvfold.kv_manager",
    "AdmissionController": "kvfold.admission",
    "AdmissionRequest": "kvfold.admission",
    "launch": "kvfold.cluster",
    "start_local_cluster": "kvfold.cluster",
    "KVFoldClient": "kvfold.aggregator.client",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvfold' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = [
    "BlockDeltas",
    "BlockGauges",
    "HostStats",
    "IterationStats",
    "KVStats",
    "SequenceStatus",
    "Topology",
    *_LAZY,
]

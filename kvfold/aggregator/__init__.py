"""Host tier, node fold, cluster fold, freshness (pure); the node and cluster actors and
the client (Ray shells, imported on their own)."""

from kvfold.aggregator.fold import fold_cluster, fold_node
from kvfold.aggregator.freshness import FreshnessTracker, Verdict
from kvfold.aggregator.host_kv import HostKVPool

__all__ = ["FreshnessTracker", "HostKVPool", "Verdict", "fold_cluster", "fold_node"]

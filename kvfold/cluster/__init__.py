"""Placing and launching kvfold on a Ray cluster; the embedded local cluster."""

from kvfold.cluster.handle import KVFold, RankClient
from kvfold.cluster.launch import attach, launch, teardown
from kvfold.cluster.local import LocalCluster, start_local_cluster

__all__ = [
    "KVFold",
    "LocalCluster",
    "RankClient",
    "attach",
    "launch",
    "start_local_cluster",
    "teardown",
]

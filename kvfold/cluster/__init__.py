"""Placing and launching kvfold on a Ray cluster; the embedded local cluster.

Importing this package does not import Ray: an embedded cluster must configure the
process (loopback, token auth; kvfold.ray_env) before Ray is first imported, so
`from kvfold.cluster import launch, start_local_cluster` then
`start_local_cluster()` then `launch(...)` keeps the cluster closed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvfold.cluster.local import LocalCluster, start_local_cluster

if TYPE_CHECKING:
    from kvfold.aggregator.client import KVFoldClient
    from kvfold.cluster.handle import KVFold, RankClient


def launch(*args: Any, **kwargs: Any) -> KVFold:
    """Launch kvfold on the connected cluster (kvfold.cluster.launcher.launch)."""
    from kvfold.cluster.launcher import launch as _launch

    return _launch(*args, **kwargs)


def attach(*args: Any, **kwargs: Any) -> KVFoldClient:
    """A client for a kvfold started elsewhere (kvfold.cluster.launcher.attach)."""
    from kvfold.cluster.launcher import attach as _attach

    return _attach(*args, **kwargs)


def teardown(*args: Any, **kwargs: Any) -> list[str]:
    """Stop kvfold's actors in a namespace (kvfold.cluster.launcher.teardown)."""
    from kvfold.cluster.launcher import teardown as _teardown

    return _teardown(*args, **kwargs)


def __getattr__(name: str) -> Any:
    if name in ("KVFold", "RankClient"):
        from kvfold.cluster import handle

        return getattr(handle, name)
    raise AttributeError(f"module 'kvfold.cluster' has no attribute {name!r}")


__all__ = [
    "KVFold",
    "LocalCluster",
    "RankClient",
    "attach",
    "launch",
    "start_local_cluster",
    "teardown",
]

"""Keeps what Ray Serve opens for kvfold's deployments on the node's own address.

Ray Serve 2.60 starts an inter-deployment gRPC server in every replica on `[::]:0`, every
interface, hard-coded (ray/serve/_private/replica.py, `_on_initialized`). kvfold's
deployments import this module (it is imported with their class, before the replica
starts that server), and it makes the replica bind that server to the address Ray gave
the node instead: 127.0.0.1 on an embedded cluster (nothing reachable from outside), the
node's address on a real one (where Ray's other processes already listen, and where the
other nodes would dial it). TLS (RAY_USE_TLS) is kept: the call is Ray's own helper with
only the address changed. A Ray without that code path is left as it is.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("kvfold")

EVERY_INTERFACE = ("[::]", "0.0.0.0", "")
_PATCHED = "_kvfold_node_address"


def keep_replica_grpc_on_node_address() -> bool:
    """Patch this process's Serve replica module; True when it is (or already was)."""
    try:
        import ray
        from ray.serve._private import replica
    except ImportError:
        return False
    original: Any = getattr(replica, "add_port_to_grpc_server", None)  # Ray's own helper
    if original is None:
        log.warning("kvfold: Ray Serve has no add_port_to_grpc_server; its replica gRPC "
                    "server binds where Ray puts it")  # fmt: skip
        return False
    if getattr(original, _PATCHED, False):
        return True

    def on_node_address(server: Any, address: str) -> Any:
        host, _, port = address.rpartition(":")
        if host in EVERY_INTERFACE:
            node = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
            address = f"[{node}]:{port}" if ":" in node else f"{node}:{port}"
        return original(server, address)

    setattr(on_node_address, _PATCHED, True)
    setattr(replica, "add_port_to_grpc_server", on_node_address)  # noqa: B010
    return True


__all__ = ["keep_replica_grpc_on_node_address"]

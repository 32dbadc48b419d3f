"""The embedded local cluster: several simulated nodes with simulated GPUs, on one machine.

Built on `ray.cluster_utils.Cluster`. Node 0 is the head. Every node gets
`gpus_per_node` simulated GPUs (Ray sets CUDA_VISIBLE_DEVICES as on a real node;
storage falls back to CPU when no CUDA is present) and a custom resource
`kvfold_sim_node_<i>` so tests can pin work to it.

Closed to the network (docs/security.md): every node binds and advertises
127.0.0.1, and Ray's token authentication is on with a random token
(kvfold.ray_env), written where `kvfold status --address ...` finds it.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from kvfold.checks import check_int
from kvfold.ray_env import save_token, secure_embedded_cluster

log = logging.getLogger("kvfold.cluster")

FAST_HEALTH_CHECKS = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 500,
    "health_check_failure_threshold": 4,
    "object_timeout_milliseconds": 200,
}


class LocalCluster:
    """A running embedded cluster; this process is connected to it as a driver."""

    def __init__(
        self,
        num_nodes: int = 3,
        gpus_per_node: int = 4,
        *,
        cpus_per_node: int = 4,
        object_store_bytes: int = 80 * 2**20,
        fast_health_checks: bool = True,
        namespace: str | None = None,
        connect: bool = True,
    ) -> None:
        check_int("num_nodes", num_nodes, 1)
        check_int("gpus_per_node", gpus_per_node, 1)
        self.token_auth = secure_embedded_cluster()
        if not self.token_auth:
            log.warning(
                "Ray was imported before the embedded cluster was configured: it runs "
                "without token auth, bound to 127.0.0.1 only (import kvfold.cluster first)"
            )
        import ray
        from ray.cluster_utils import Cluster

        self.num_nodes = num_nodes
        self.gpus_per_node = gpus_per_node
        self.namespace = namespace or f"kvfold-{uuid.uuid4().hex[:8]}"

        def node_args(i: int) -> dict[str, Any]:
            return {
                "num_cpus": cpus_per_node,
                "num_gpus": gpus_per_node,
                "resources": {f"kvfold_sim_node_{i}": 100},
                "object_store_memory": object_store_bytes,
                "node_ip_address": "127.0.0.1",
            }

        head = {**node_args(0), "include_dashboard": False}
        if fast_health_checks:
            head["_system_config"] = dict(FAST_HEALTH_CHECKS)
        self.cluster = Cluster(initialize_head=True, head_node_args=head)
        self.nodes: list[Any] = [self.cluster.head_node]
        for i in range(1, num_nodes):
            self.nodes.append(self.cluster.add_node(**node_args(i)))
        self.cluster.wait_for_nodes()
        self.token_path = save_token(self.address)
        if connect:
            ray.init(address=self.cluster.address, namespace=self.namespace, log_to_driver=False)

    @property
    def address(self) -> str:
        return str(self.cluster.address)

    def remove_node(self, index: int, allow_graceful: bool = False) -> None:
        """Take simulated node `index` away (index 0, the head, cannot be removed)."""
        if not 1 <= index < len(self.nodes):
            raise ValueError(f"index must be in [1, {len(self.nodes)}), got {index}")
        self.cluster.remove_node(self.nodes[index], allow_graceful=allow_graceful)

    def shutdown(self) -> None:
        import ray

        ray.shutdown()
        self.cluster.shutdown()
        if self.token_path is not None:
            self.token_path.unlink(missing_ok=True)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def start_local_cluster(num_nodes: int = 3, gpus_per_node: int = 4, **kwargs: Any) -> LocalCluster:
    """Start an embedded multi-node Ray cluster with simulated GPUs and connect to it."""
    return LocalCluster(num_nodes, gpus_per_node, **kwargs)

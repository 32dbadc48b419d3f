"""The embedded local cluster: several simulated nodes with simulated GPUs, on one machine.

Built on `ray.cluster_utils.Cluster`. Node 0 is the head. Every node gets
`gpus_per_node` simulated GPUs (Ray sets CUDA_VISIBLE_DEVICES as on a real node;
storage falls back to CPU when no CUDA is present) and a custom resource
`kvfold_sim_node_<i>` so tests can pin work to it.

Closed to the network (docs/security.md): every node binds and advertises
127.0.0.1, and Ray's token authentication is on with a random token
(kvfold.ray_env), written where `kvfold status --address ...` finds it. This holds
in a process that imported Ray first, too (`adopt_process_settings`).
"""

from __future__ import annotations

import logging
import sys
import time
import uuid
from typing import Any

from kvfold.checks import check_int
from kvfold.ray_env import save_token, secure_embedded_cluster

log = logging.getLogger("kvfold.cluster")

IMPORT_FIRST = (
    "call start_local_cluster() before `import ray`, or set "
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, RAY_AUTH_MODE=token and RAY_AUTH_TOKEN=<secret> in "
    "the environment before `import ray`"
)

FAST_HEALTH_CHECKS = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 500,
    "health_check_failure_threshold": 4,
    "object_timeout_milliseconds": 200,
}
# Ray starts num_cpus idle workers per node ahead of use; kvfold's actors are few and
# num_cpus=0, and on two cores those idle starts only delay the ones launch waits for
NO_PRESTART = {"enable_worker_prestart": False, "prestart_worker_first_driver": False}
# Ray starts its workers at nice 15 (worker_niceness): below every process started beside
# them. kvfold's actors and Ray Serve's proxy and replicas are on the path of requests to
# engines that run outside Ray on the same cores; at nice 15 they wait behind the engines
# (the front door's time to first token was several times round robin's from that alone).
SAME_PRIORITY = {"worker_niceness": 0}


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
        ray_imported_first = "ray" in sys.modules
        secure_embedded_cluster()
        import ray
        from ray.cluster_utils import Cluster

        if ray.is_initialized():  # its Ray settings cannot change under a live connection
            raise RuntimeError(
                "this process is already connected to a Ray cluster: call ray.shutdown() "
                "before start_local_cluster()"
            )
        if ray_imported_first:
            adopt_process_settings()
        check_closed()
        self.token_auth = True  # always on now; kept for callers that read it

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

        started = time.monotonic()
        head = {**node_args(0), "include_dashboard": False}
        head["_system_config"] = {
            **NO_PRESTART,
            **SAME_PRIORITY,
            **(FAST_HEALTH_CHECKS if fast_health_checks else {}),
        }
        self.cluster = Cluster(initialize_head=True, head_node_args=head)
        self.nodes: list[Any] = [self.cluster.head_node]
        for i in range(1, num_nodes):  # waited for together below
            self.nodes.append(self.cluster.add_node(wait=False, **node_args(i)))
        self.cluster.wait_for_nodes()
        self.token_path = save_token(self.address)
        if connect:
            ray.init(address=self.cluster.address, namespace=self.namespace, log_to_driver=False)
        self.started_in_s = time.monotonic() - started  # nodes up (and this driver connected)

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


def adopt_process_settings() -> None:
    """Make a Ray imported before kvfold configured the process see the settings
    kvfold.ray_env has put in the environment since. Ray 2.60 reads two of them at
    import, and both can be read again (Ray does the second itself when `ray.init()`
    turns token auth on after import, `authentication_token_setup._enable_token_auth`):

    - loopback: `ray._private.services.get_node_ip_address()` reads
      `ray_constants.ENABLE_RAY_CLUSTER` (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER at import)
      on every call. While it is True (Linux's default), `ray.init(address=
      "127.0.0.1:<port>")` resolves 127.0.0.1 to the machine's external address and
      retries, without end, a GCS that listens on loopback only;
    - token auth: the mode is cached in RayConfig at import (`Config.initialize("")`
      reads the environment again); the token in `AuthenticationTokenLoader` at its
      first use (`reset_cache()`: the next use reads RAY_AUTH_TOKEN).

    The cluster's own processes (GCS, raylets, workers) import Ray afresh and read the
    environment. Changes this process's Ray only; call it before the cluster starts
    and before `ray.init()`.
    """
    try:
        from ray._private import ray_constants
        from ray._private.authentication.authentication_utils import is_token_auth_enabled
        from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

        if ray_constants.ENABLE_RAY_CLUSTER:
            log.info("Ray was imported before kvfold: making it advertise 127.0.0.1 only")
            ray_constants.ENABLE_RAY_CLUSTER = False
        if not is_token_auth_enabled():
            Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
    except (ImportError, AttributeError) as e:  # a Ray other than 2.60
        raise RuntimeError(
            f"cannot reconfigure the Ray imported before kvfold: {IMPORT_FIRST}"
        ) from e


def check_closed(loopback_ip: str = "127.0.0.1") -> None:
    """Raise RuntimeError, before anything starts, where this process's Ray would turn
    `loopback_ip` into another address (`ray.init()` would then never reach the
    cluster) or run without token auth."""
    from ray._private.authentication.authentication_utils import is_token_auth_enabled
    from ray._private.services import resolve_ip_for_localhost

    ip = resolve_ip_for_localhost(loopback_ip)
    token_auth = is_token_auth_enabled()
    if ip != loopback_ip or not token_auth:
        raise RuntimeError(
            f"this process's Ray resolves {loopback_ip} to {ip}, token auth "
            f"{'on' if token_auth else 'off'}: the embedded cluster cannot start closed to "
            f"the network here. {IMPORT_FIRST}"
        )


def start_local_cluster(num_nodes: int = 3, gpus_per_node: int = 4, **kwargs: Any) -> LocalCluster:
    """Start an embedded multi-node Ray cluster with simulated GPUs and connect to it."""
    return LocalCluster(num_nodes, gpus_per_node, **kwargs)

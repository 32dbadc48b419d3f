"""KVFold, the handle `launch` returns, and RankClient, synchronous calls to one rank.

Every Ray failure of a rank call becomes RankUnavailable; views come through
KVFoldClient (AggregatorUnavailable).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import remove_placement_group

from kvfold.aggregator.client import KVFoldClient
from kvfold.cluster.settings import LaunchSettings
from kvfold.errors import AggregatorUnavailable, KVFoldError, RankUnavailable
from kvfold.naming import (
    AGGREGATOR_NAME,
    PLACEMENT_GROUP_NAME,
    node_actor_name,
    rack_actor_name,
    rank_actor_name,
)
from kvfold.ray_actor import named_actor
from kvfold.stats import IterationStats, KVStats, SequenceStatus, Window
from kvfold.tickets import Ticket
from kvfold.topology import Topology
from kvfold.view import ClusterView, SourceState
from kvfold.worker.commitments import Policy
from kvfold.worker.engine import StepResult

CALL_TIMEOUT_S = 30.0


class RankClient:
    """Synchronous calls to one rank actor; Ray failures become RankUnavailable."""

    def __init__(self, rank: int, handle: Any, timeout_s: float = CALL_TIMEOUT_S) -> None:
        self.rank = rank
        self.handle = handle
        self.timeout_s = timeout_s

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return ray.get(
                getattr(self.handle, method).remote(*args, **kwargs), timeout=self.timeout_s
            )
        except RayActorError as e:
            raise RankUnavailable(self.rank, str(e).splitlines()[0]) from e
        except GetTimeoutError as e:
            raise RankUnavailable(self.rank, f"no answer to {method} in {self.timeout_s} s") from e

    def add_sequence(
        self,
        seq_id: str | int,
        token_ids: Sequence[int] | np.ndarray,
        salt: str | None = None,
        report: bool = False,
        *,
        max_new_tokens: int | None = None,
        policy: Policy | str = Policy.GUARANTEED_NO_EVICT,
        ticket: Ticket | None = None,
    ) -> bool:
        """Place a request (kvfold.worker.rank_actor.RankWorker.add_sequence): pass the
        tokens it may generate and its admission's policy and ticket. False: the rank
        refused it (it would over-commit); nothing changed. `max_new_tokens` is required
        with a ticket under GUARANTEED_NO_EVICT (ValueError without it): the promise is
        prompt + max_new_tokens."""
        return bool(
            self.call(
                "add_sequence",
                seq_id,
                token_ids,
                salt,
                report,
                max_new_tokens=max_new_tokens,
                policy=policy,
                ticket=ticket,
            )
        )

    def append_tokens(
        self, seq_id: str | int, token_ids: Sequence[int], report: bool = False
    ) -> bool:
        return bool(self.call("append_tokens", seq_id, token_ids, report))

    def set_status(self, seq_id: str | int, status: SequenceStatus, report: bool = False) -> None:
        self.call("set_status", seq_id, int(status), report)

    def free_sequence(self, seq_id: str | int, report: bool = False) -> None:
        self.call("free_sequence", seq_id, report)

    def block_table(self, seq_id: str | int, window: Window = None) -> list[int]:
        table: list[int] = self.call("block_table", seq_id, window)
        return table

    def stats(self) -> KVStats | None:
        stats: KVStats | None = self.call("stats")
        return stats

    def cumulative(self) -> IterationStats | None:
        out: IterationStats | None = self.call("cumulative")
        return out

    def write_kv(
        self, seq_id: str | int, layer: int, positions: list[int], k: np.ndarray, v: np.ndarray
    ) -> None:
        self.call("write_kv", seq_id, layer, positions, k, v)

    def gather_kv(self, seq_id: str | int, layer: int) -> tuple[np.ndarray, np.ndarray]:
        k, v = self.call("gather_kv", seq_id, layer)
        return k, v

    def engine_step(self, admits: list[tuple[Any, ...]]) -> StepResult:
        result: StepResult = self.call("engine_step", admits)
        return result

    def report_now(self) -> str:
        verdict: str = self.call("report_now")
        return verdict

    def trtllm_stats(self) -> dict[str, Any] | None:
        """TensorRT-LLM's kvCacheStats shape (kvfold.worker.trtllm); None while unbound."""
        out: dict[str, Any] | None = self.call("trtllm_stats")
        return out

    def info(self) -> dict[str, Any]:
        info: dict[str, Any] = self.call("info")
        return info

    def check_integrity(self) -> None:
        self.call("check_integrity")


class KVFold:
    """A running kvfold deployment: its topology, its actors, and a client for views."""

    def __init__(
        self,
        settings: LaunchSettings,
        topology: Topology,
        aggregator: Any,
        nodes: list[Any],
        ranks: list[Any],
        pg: Any,
        ray_node_ids: list[str],
    ) -> None:
        self.settings = settings
        self.topology = topology
        self.namespace = settings.namespace
        self.aggregator = aggregator
        self.node_handles = nodes
        self.rank_handles = ranks
        self.placement_group = pg
        self.ray_node_ids = ray_node_ids
        self.client = KVFoldClient(namespace=settings.namespace)
        self._ranks = [RankClient(r, h) for r, h in enumerate(ranks)]
        self.rack_handles: list[Any] = []  # rack actors, when launched with nodes_per_rack
        # seconds each phase of launch() took, in order (set by launch; empty on attach)
        self.launch_phases: dict[str, float] = {}

    @classmethod
    def attach(cls, namespace: str) -> KVFold:
        """A handle on a deployment started elsewhere (`kvfold up`), found by its names.
        Its cache settings are the ranks' own; what launch was told is not kept."""
        aggregator = named_actor(AGGREGATOR_NAME, namespace)
        if aggregator is None:
            raise AggregatorUnavailable(f"no kvfold in namespace {namespace!r}; `kvfold up` first")
        try:
            d = ray.get(aggregator.describe.remote(), timeout=CALL_TIMEOUT_S)
        except (RayActorError, GetTimeoutError) as e:
            raise AggregatorUnavailable(f"kvfold in namespace {namespace!r}: {e}") from e
        topology = Topology.from_mapping(d["rank_to_node"])
        nodes = [named_actor(node_actor_name(n), namespace) for n in range(topology.num_nodes)]
        ranks = [named_actor(rank_actor_name(r), namespace) for r in range(topology.world_size)]
        if any(h is None for h in [*nodes, *ranks]):
            raise KVFoldError(f"kvfold in namespace {namespace!r} is missing some of its actors")
        settings = LaunchSettings(
            world_size=topology.world_size,
            gpus_per_node=None,
            cache=None,
            host_num_blocks=0,
            report_interval_s=d["report_interval_s"],
            stale_after_s=d["stale_after_s"],
            dead_after_s=d["dead_after_s"],
            namespace=namespace,
            placement_timeout_s=60.0,
            detached=True,
            gpus_per_rank=1.0,
            rank_max_restarts=-1,
        )
        try:
            pg = ray.util.get_placement_group(PLACEMENT_GROUP_NAME)
        except ValueError:
            pg = None
        kv = cls(settings, topology, aggregator, nodes, ranks, pg, d["ray_node_ids"])
        kv.rack_handles = _named_in_order(rack_actor_name, namespace)  # none without racks
        return kv

    def view(self) -> ClusterView:
        return self.client.view()

    def wait_for_version(self, version: int, timeout_s: float = 5.0) -> ClusterView | None:
        return self.client.wait_for_version(version, timeout_s)

    def rank(self, rank: int) -> RankClient:
        self.topology.check_rank(rank)
        return self._ranks[rank]

    def node(self, node: int) -> Any:
        """The node's HostKVActor handle (for `.counts.remote()`, `.view.remote()`)."""
        self.topology.check_node(node)
        return self.node_handles[node]

    def wait_until_fresh(self, timeout_s: float = 30.0) -> ClusterView:
        """Block until every rank of every node is fresh in the view."""
        deadline = time.monotonic() + timeout_s
        view = self.view()
        while True:
            states = view.rank_states()
            if (
                all(s is SourceState.FRESH for s in states.values())
                and len(states) == self.topology.world_size
            ):
                return view
            left = deadline - time.monotonic()
            if left <= 0:
                not_fresh = {r: s.value for r, s in states.items() if s is not SourceState.FRESH}
                raise KVFoldError(f"ranks not fresh after {timeout_s} s: {not_fresh}")
            view = self.client.wait_for_version(view.version, min(left, 1.0)) or self.view()

    def shutdown(self) -> None:
        """Stop every kvfold actor of this deployment and free its placement group."""
        for h in [*self.rank_handles, *self.node_handles, *self.rack_handles, self.aggregator]:
            with contextlib.suppress(RayActorError, ValueError):
                ray.kill(h, no_restart=True)
        if self.placement_group is not None:
            with contextlib.suppress(ValueError, RayActorError):
                remove_placement_group(self.placement_group)

    def __enter__(self) -> KVFold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _named_in_order(name_of: Callable[[int], str], namespace: str) -> list[Any]:
    """The named actors name_of(0), name_of(1), ... up to the first that is not there."""
    found: list[Any] = []
    while (handle := named_actor(name_of(len(found)), namespace)) is not None:
        found.append(handle)
    return found

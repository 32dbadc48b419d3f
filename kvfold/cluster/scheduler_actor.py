"""Admission in processes of its own (Ray actors), each with its own client to the
aggregator, the way a fleet runs N router replicas: each refreshes its own views and
admits into the same ranks.

    ControllerActor   an AdmissionController: decide / release (start_controllers)
    SchedulerActor    a replay's scheduler: a controller and a FIFO queue (start_schedulers)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray

from kvfold.admission import AdmissionController, AdmissionRequest, Decision, Policy
from kvfold.aggregator.client import KVFoldClient
from kvfold.workload.requests import TraceRequest
from kvfold.workload.scheduler import ReplayScheduler, SchedulerSettings, StepOutcome


class ControllerActor:
    def __init__(
        self,
        namespace: str,
        policy: Policy,
        num_controllers: int,
        watermark_blocks: int = 0,
        refresh_interval_s: float = 0.05,
    ) -> None:
        self.client = KVFoldClient(namespace=namespace)
        self.controller = AdmissionController(
            self.client,
            policy=policy,
            watermark_blocks=watermark_blocks,
            refresh_interval_s=refresh_interval_s,
            num_controllers=num_controllers,
        )

    def controller_id(self) -> str:
        return self.controller.controller_id

    def decide(self, request: AdmissionRequest) -> Decision:
        return self.controller.decide(request)

    def release(self, request_id: str) -> bool:
        return self.controller.release(request_id)

    def counts(self) -> dict[str, Any]:
        p = self.controller.policy
        return {
            "decisions": {f"{o}:{r}": n for (o, r), n in self.controller.decisions.items()},
            "unseen": len(p.reservations),
            "settled": p.settled,
            "expired": p.expired,
            "view_error": self.controller.view_error,
        }


def _beside_the_driver() -> Any:
    """Schedulers live on the driver's machine: losing a GPU node must not take the
    admission path with it (it is the same process tree as the driver's loop)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    return NodeAffinitySchedulingStrategy(node_id=node, soft=False)


def start_controllers(
    namespace: str, n: int, policy: Policy = Policy.GUARANTEED_NO_EVICT, **kwargs: Any
) -> list[Any]:
    """`n` ControllerActors sharing the ranks (each told there are `n`), each in its
    own worker process."""
    cls: Any = ray.remote(num_cpus=0, max_restarts=0)(ControllerActor).options(
        scheduling_strategy=_beside_the_driver()
    )
    actors = [cls.remote(namespace, policy, n, **kwargs) for _ in range(n)]
    ray.get([a.controller_id.remote() for a in actors])
    return actors


class SchedulerActor:
    def __init__(self, namespace: str, settings: SchedulerSettings) -> None:
        self.client = KVFoldClient(namespace=namespace)
        self.scheduler = ReplayScheduler(
            self.client.view, settings, index_source=self.client.block_index_since
        )

    def controller_id(self) -> str:
        return self.scheduler.controller.controller_id

    def step(
        self,
        arrivals: Sequence[TraceRequest],
        refused: Sequence[str],
        finished: Sequence[str],
        trace_now: float,
        step: int,
        restarted: Sequence[str] = (),
    ) -> StepOutcome:
        self.scheduler.finished(finished)
        return self.scheduler.step(arrivals, refused, trace_now, step, restarted)

    def decisions(self) -> dict[str, int]:
        return self.scheduler.decisions()


def start_schedulers(namespace: str, settings: list[SchedulerSettings]) -> list[Any]:
    """One SchedulerActor per settings, each in its own worker process (no GPU)."""
    cls: Any = ray.remote(num_cpus=0, max_restarts=0)(SchedulerActor).options(
        scheduling_strategy=_beside_the_driver()
    )
    actors = [cls.remote(namespace, s) for s in settings]
    ray.get([a.controller_id.remote() for a in actors])  # each is up before the replay starts
    return actors

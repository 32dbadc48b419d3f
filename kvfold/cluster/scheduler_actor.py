"""SchedulerActor: a ReplayScheduler in its own process (a Ray actor), with its own
client to the aggregator, so a replay runs N schedulers the way a fleet runs N
router replicas: each refreshes its own views and admits into the same ranks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray

from kvfold.aggregator.client import KVFoldClient
from kvfold.workload.requests import TraceRequest
from kvfold.workload.scheduler import ReplayScheduler, SchedulerSettings, StepOutcome


class SchedulerActor:
    def __init__(self, namespace: str, settings: SchedulerSettings) -> None:
        self.client = KVFoldClient(namespace=namespace)
        self.scheduler = ReplayScheduler(self.client.view, settings)

    def controller_id(self) -> str:
        return self.scheduler.controller.controller_id

    def step(
        self,
        arrivals: Sequence[TraceRequest],
        refused: Sequence[str],
        finished: Sequence[str],
        trace_now: float,
        step: int,
    ) -> StepOutcome:
        self.scheduler.finished(finished)
        return self.scheduler.step(arrivals, refused, trace_now, step)

    def decisions(self) -> dict[str, int]:
        return self.scheduler.decisions()


def start_schedulers(namespace: str, settings: list[SchedulerSettings]) -> list[Any]:
    """One SchedulerActor per settings, each in its own worker process (no GPU)."""
    cls: Any = ray.remote(num_cpus=0, max_restarts=0)(SchedulerActor)
    actors = [cls.remote(namespace, s) for s in settings]
    ray.get([a.controller_id.remote() for a in actors])  # each is up before the replay starts
    return actors

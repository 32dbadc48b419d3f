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

from kvfold.admission import AdmissionRequest, Decision, Policy, Router
from kvfold.admission.settings import SENT_TTL_S, ControllerSettings, settings_for_controllers
from kvfold.aggregator.client import KVFoldClient
from kvfold.workload.requests import TraceRequest
from kvfold.workload.scheduler import ReplayScheduler, SchedulerSettings, StepOutcome

FIRST_VIEW_TIMEOUT_S = 30.0  # past it the actor is up anyway: its decisions say why they queue


class ControllerActor:
    """An AdmissionController built from its settings (checked by the caller, before
    the actor was made), with its own client to the aggregator."""

    def __init__(self, namespace: str, settings: ControllerSettings) -> None:
        self.client = KVFoldClient(namespace=namespace)
        self.controller = settings.build(self.client)
        # up with a view when start_controllers returns (else its first decisions queue)
        self.controller.wait_for_view(FIRST_VIEW_TIMEOUT_S)

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
            "router": self.controller.router.value,
            "sent_ttl_s": p.chooser.weights.sent_ttl_s,
        }


def _beside_the_driver() -> Any:
    """Schedulers live on the driver's machine: losing a GPU node must not take the
    admission path with it (it is the same process tree as the driver's loop)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    return NodeAffinitySchedulingStrategy(node_id=node, soft=False)


def start_controllers(
    namespace: str,
    n: int,
    policy: Policy = Policy.GUARANTEED_NO_EVICT,
    *,
    router: Router | str | None = None,
    sent_ttl_s: float = SENT_TTL_S,
    controller_ids: Sequence[str] | None = None,
    watermark_blocks: int = 0,
    refresh_interval_s: float = 0.05,
    refresh_in_background: bool = True,
    claims: bool = True,
) -> list[Any]:
    """`n` ControllerActors sharing the ranks (each told there are `n`), each in its
    own worker process, up when this returns. `router`: a Router or its name (None:
    precise_prefix, by the cluster block index); `sent_ttl_s`: how long a prompt sent
    counts as held before the index shows it; `controller_ids`: None (each makes a new
    one), or `n` distinct ids no controller has used with these ranks before;
    `refresh_in_background`: each refreshes in a thread of its own, off the path of the
    decide calls it serves; `claims`: a request larger than every lease waits for a
    claim at the aggregator's desk (False: the overflow rule). Every argument is
    checked (ValueError, TypeError) before any Ray call."""
    settings = settings_for_controllers(
        n,
        policy,
        router=router,
        sent_ttl_s=sent_ttl_s,
        controller_ids=controller_ids,
        watermark_blocks=watermark_blocks,
        refresh_interval_s=refresh_interval_s,
        refresh_in_background=refresh_in_background,
        claims=claims,
    )
    cls: Any = ray.remote(num_cpus=0, max_restarts=0)(ControllerActor).options(
        scheduling_strategy=_beside_the_driver()
    )
    actors = [cls.remote(namespace, s) for s in settings]
    ray.get([a.controller_id.remote() for a in actors])
    return actors


class SchedulerActor:
    def __init__(self, namespace: str, settings: SchedulerSettings) -> None:
        self.client = KVFoldClient(namespace=namespace)
        self.scheduler = ReplayScheduler(  # capacity as deltas (KVFoldClient.capacity)
            self.client, settings, index_source=self.client.block_index_since
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

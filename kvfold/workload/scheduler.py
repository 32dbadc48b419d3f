"""ReplayScheduler: one scheduler of a replay, with its own admission controller, its own
FIFO queue and its own view refreshes. Pure (the view source is passed in); a replay
runs one in its own process, or N in N Ray actors (kvfold.replay.scheduler_actor).

Each step it takes the requests dealt to it, learns which of its requests finished
or were refused by their rank, and decides its queue's head in order:

    ADMIT  -> an admit for the chosen rank: (id, prompt, max_new_tokens, salt, policy, ticket)
    REJECT -> dropped (it can never fit)
    QUEUE  -> the pass stops (strict FIFO; docs/admission.md)

A request its rank refused goes back to the head of the queue and is decided again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvfold.admission import (
    AdmissionController,
    AdmissionRequest,
    FifoAdmissionQueue,
    Outcome,
    Policy,
    Router,
    RoutingWeights,
    new_controller_id,
)
from kvfold.admission.controller import IndexSource
from kvfold.admission.routing import as_router
from kvfold.checks import check_int, check_positive
from kvfold.worker.hashing import block_keys
from kvfold.workload.requests import TraceRequest

Admit = tuple[Any, ...]  # (seq_id, prompt, max_new_tokens, salt, policy value, ticket)


@dataclass(frozen=True)
class ReplayConfig:
    """How a replay runs (kvfold.replay.trace_replay); importing it does not import Ray."""

    time_scale: float = 1.0
    step_interval_s: float = 0.05
    decode_tokens_per_s: float = 40.0  # per running sequence, in trace time
    # trace seconds between samples of the view (None: one report interval of wall time)
    sample_interval_s: float | None = None
    policy: Policy = Policy.GUARANTEED_NO_EVICT
    watermark_blocks: int = 0
    max_wall_s: float | None = None
    prefix_affinity: bool = True
    schedulers: int = 1  # schedulers, each in its own process, sharing the ranks
    leases: bool = True  # each scheduler promises only its share of a rank's room
    claims: bool = True  # beyond a lease, by claims at the aggregator's desk
    router: str = Router.PRECISE_PREFIX.value  # kvfold.admission.routing
    overlap_weight: float = RoutingWeights().overlap_weight  # precise_prefix's cost

    def __post_init__(self) -> None:
        for name in ("time_scale", "step_interval_s", "decode_tokens_per_s"):
            check_positive(name, getattr(self, name))
        if self.sample_interval_s is not None:
            check_positive("sample_interval_s", self.sample_interval_s)
        check_int("schedulers", self.schedulers, 1)
        as_router(self.router)


@dataclass(frozen=True, slots=True)
class SchedulerSettings:
    tokens_per_block: int
    policy: Policy = Policy.GUARANTEED_NO_EVICT
    watermark_blocks: int = 0
    refresh_interval_s: float = 0.025
    prefix_affinity: bool = True
    num_controllers: int = 1
    claims: bool = True  # beyond a lease, by claims (kvfold.admission.claims)
    name: str = "replay"
    router: str = Router.PRECISE_PREFIX.value
    overlap_weight: float = RoutingWeights().overlap_weight


@dataclass(slots=True)
class StepOutcome:
    """What one scheduler did in one step (summed by the replay's recorder)."""

    admits: dict[int, list[Admit]] = field(default_factory=dict)
    decisions: dict[str, int] = field(default_factory=dict)  # "outcome:reason" -> count
    admitted: list[tuple[str, float]] = field(default_factory=list)  # (id, queueing delay)
    rejected: int = 0
    failed: list[tuple[str, str]] = field(default_factory=list)  # (id, why): admitted once
    ever_queued: int = 0
    queue_decisions: int = 0
    queued: int = 0  # waiting after the step


class ReplayScheduler:
    def __init__(
        self,
        view_source: Any,  # AdmissionController's: a KVFoldClient, or a callable of views
        settings: SchedulerSettings,
        index_source: IndexSource | None = None,
    ) -> None:
        self.settings = settings
        router = as_router(settings.router)
        self.controller = AdmissionController(
            view_source,
            policy=settings.policy,
            watermark_blocks=settings.watermark_blocks,
            refresh_interval_s=settings.refresh_interval_s,
            num_controllers=settings.num_controllers,
            claims=settings.claims,
            controller_id=new_controller_id(settings.name),
            router=router,
            index_source=index_source if router is Router.PRECISE_PREFIX else None,
            weights=RoutingWeights(overlap_weight=settings.overlap_weight),
        )
        self.needs_keys = settings.prefix_affinity and router in (
            Router.APPROX_PREFIX,
            Router.PRECISE_PREFIX,
        )
        self.by_id: dict[str, TraceRequest] = {}
        self.asked: dict[str, AdmissionRequest] = {}  # built (keys hashed) once per request
        self.queue: FifoAdmissionQueue[TraceRequest] = FifoAdmissionQueue(self._to_request)
        self.arrived_step: dict[str, int] = {}
        self.restarted: set[str] = set()  # lost their KV once: a REJECT now is a failure

    def _to_request(self, req: TraceRequest) -> AdmissionRequest:
        made = self.asked.get(req.request_id)
        if made is None:
            B = self.settings.tokens_per_block
            keys = tuple(block_keys(req.prompt, B)) if self.needs_keys else ()
            made = AdmissionRequest(req.request_id, req.prompt_tokens, req.max_new_tokens, keys)
            self.asked[req.request_id] = made
        return made

    def step(
        self,
        arrivals: Sequence[TraceRequest],
        refused: Sequence[str],
        trace_now: float,
        step: int,
        restarted: Sequence[str] = (),
    ) -> StepOutcome:
        """Take the new arrivals, the refusals and the requests that lost their KV, then
        decide the queue's head in order."""
        for req in arrivals:
            self.by_id[req.request_id] = req
            self.queue.push(req)
            self.arrived_step[req.request_id] = step
        again = [*refused, *restarted]
        for rid in again:  # nothing of it is at a rank: decide it again, first
            self.controller.release(rid)
        self.restarted.update(restarted)
        self.queue.push_front(self.by_id[rid] for rid in again)
        out = StepOutcome()
        self.controller.refresh()
        for req, d in self.queue.pump(self.controller.decide):
            key = f"{d.outcome.value}:{d.reason}"
            out.decisions[key] = out.decisions.get(key, 0) + 1
            if d.outcome is Outcome.QUEUE:
                out.queue_decisions += 1
                continue
            del self.asked[req.request_id]
            if self.arrived_step.pop(req.request_id, step) < step:
                out.ever_queued += 1  # it waited at least one step
            if d.outcome is Outcome.REJECT:
                if req.request_id in self.restarted:  # it ran once; no rank can hold it now
                    out.failed.append((req.request_id, f"no rank can hold it now ({d.reason})"))
                else:
                    out.rejected += 1
                continue
            assert d.rank is not None and d.policy is not None
            out.admitted.append((req.request_id, max(0.0, trace_now - req.arrival_s)))
            admit = (req.request_id, req.prompt, req.max_new_tokens, None, d.policy.value, d.ticket)
            out.admits.setdefault(d.rank, []).append(admit)
        out.queued = len(self.queue)
        return out

    def finished(self, request_ids: Sequence[str]) -> None:
        """Requests done at their rank: forget them (the rank already released their blocks)."""
        for rid in request_ids:
            self.controller.release(rid)  # a no-op once the rank showed its ticket
            self.by_id.pop(rid, None)
            self.restarted.discard(rid)

    def decisions(self) -> dict[str, int]:
        return {f"{o}:{r}": n for (o, r), n in self.controller.decisions.items()}

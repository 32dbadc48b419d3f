"""Replay a workload through admission onto the rank actors, with a simple engine model.

Every step (about `step_interval_s` of wall time, `time_scale` times more of
trace time):
  1. requests whose arrival time has come join the queue (FIFO);
  2. the queue's head is decided, in order: ADMIT sends it to the chosen rank,
     REJECT drops it, QUEUE stops the pass (strict FIFO: no request overtakes
     an earlier one, so large requests cannot starve; docs/admission.md);
  3. every rank runs one engine step in parallel: decoding
     `decode_tokens_per_s` x (trace time since the last step) tokens per running
     sequence, freeing finished ones, prefilling what was admitted to it;
  4. finished requests release their reservations; a request a rank refuses
     for lack of blocks is an over-commit (it goes back to the queue's head).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from kvfold.admission import (
    AdmissionController,
    AdmissionRequest,
    FifoAdmissionQueue,
    Outcome,
    Policy,
)
from kvfold.checks import check_positive
from kvfold.cluster.handle import KVFold
from kvfold.errors import KVFoldError
from kvfold.view import ClusterView
from kvfold.worker.engine import StepResult
from kvfold.worker.hashing import block_keys
from kvfold.workload.recorder import ReplayRecorder, sample_view
from kvfold.workload.requests import TraceRequest


@dataclass(frozen=True)
class ReplayConfig:
    time_scale: float = 1.0
    step_interval_s: float = 0.05
    decode_tokens_per_s: float = 40.0  # per running sequence, in trace time
    sample_interval_s: float = 0.25
    policy: Policy = Policy.GUARANTEED_NO_EVICT
    watermark_blocks: int = 0
    max_wall_s: float | None = None
    prefix_affinity: bool = True

    def __post_init__(self) -> None:
        for name in ("time_scale", "step_interval_s", "decode_tokens_per_s", "sample_interval_s"):
            check_positive(name, getattr(self, name))


def replay(
    kv: KVFold,
    workload: Sequence[TraceRequest],
    config: ReplayConfig = ReplayConfig(),
    on_sample: Callable[[ClusterView, ReplayRecorder, float], None] | None = None,
) -> ReplayRecorder:
    """Replay `workload` on `kv` until every request completed or was rejected (or
    `max_wall_s` passed); returns what was recorded."""
    run = _Replay(kv, workload, config)
    while True:
        wall, trace_now = run.clock()
        run.arrive(trace_now)
        admits = run.decide(trace_now)
        run.engine_step(admits, trace_now)
        run.sample(wall, trace_now, on_sample)
        if run.done() or (config.max_wall_s is not None and wall >= config.max_wall_s):
            break
        run.pace(wall)
    return run.finish()


class _Replay:
    """One replay's state: the controller, the FIFO queue, what runs where, the recorder."""

    def __init__(self, kv: KVFold, workload: Sequence[TraceRequest], config: ReplayConfig) -> None:
        self.kv, self.config = kv, config
        self.rec = ReplayRecorder(num_requests=len(workload))
        self.controller = AdmissionController(
            kv.client,
            policy=config.policy,
            watermark_blocks=config.watermark_blocks,
            refresh_interval_s=config.step_interval_s / 2,
        )
        # one source for the block size: what the ranks report
        self.tokens_per_block = kv.view().gpu_total.tokens_per_block
        if self.tokens_per_block < 1:
            raise KVFoldError("no fresh rank reports its block size; is kvfold up?")
        self.arrivals = sorted(workload, key=lambda r: r.arrival_s)
        self.by_id = {r.request_id: r for r in self.arrivals}
        self.asked: dict[str, AdmissionRequest] = {}  # built (keys hashed) once per request
        self.pending: FifoAdmissionQueue[TraceRequest] = FifoAdmissionQueue(self.to_request)
        self.arrived_step: dict[str, int] = {}  # the step each waiting request arrived in
        self.in_flight: dict[str, int] = {}
        self.step = 0
        self.next_arrival = 0
        self.start = time.monotonic()
        self.last_trace = 0.0
        self.last_sample = float("-inf")

    def to_request(self, req: TraceRequest) -> AdmissionRequest:
        made = self.asked.get(req.request_id)
        if made is None:
            keys = (
                tuple(block_keys(req.prompt, self.tokens_per_block))
                if self.config.prefix_affinity
                else ()
            )
            made = AdmissionRequest(req.request_id, req.prompt_tokens, req.max_new_tokens, keys)
            self.asked[req.request_id] = made
        return made

    def clock(self) -> tuple[float, float]:
        """(wall seconds since the start, trace seconds) for a new step."""
        self.step += 1
        wall = time.monotonic() - self.start
        return wall, wall * self.config.time_scale

    def arrive(self, trace_now: float) -> None:
        arrivals = self.arrivals
        while (
            self.next_arrival < len(arrivals) and arrivals[self.next_arrival].arrival_s <= trace_now
        ):
            req = arrivals[self.next_arrival]
            self.pending.push(req)
            self.arrived_step[req.request_id] = self.step
            self.next_arrival += 1

    def decide(self, trace_now: float) -> dict[int, list[tuple[Any, Any, int, None]]]:
        """Decide the queue's head in order; return what each rank is to prefill."""
        rec = self.rec
        self.controller.refresh()
        admits: dict[int, list[tuple[Any, Any, int, None]]] = {}
        for req, d in self.pending.pump(self.controller.decide):
            rec.decisions[f"{d.outcome.value}:{d.reason}"] += 1
            if d.outcome is Outcome.QUEUE:
                rec.queue_decisions += 1
                continue
            del self.asked[req.request_id]  # decided (a rank may refuse it: then built again)
            if self.arrived_step.pop(req.request_id, self.step) < self.step:
                rec.ever_queued += 1  # it waited at least one step
            if d.outcome is Outcome.REJECT:
                rec.rejected += 1
                continue
            assert d.rank is not None
            rec.admitted += 1
            rec.queue_delays_s.append(max(0.0, trace_now - req.arrival_s))
            admits.setdefault(d.rank, []).append(
                (req.request_id, req.prompt, req.max_new_tokens, None)
            )
            self.in_flight[req.request_id] = d.rank
        return admits

    def engine_step(
        self, admits: dict[int, list[tuple[Any, Any, int, None]]], trace_now: float
    ) -> None:
        """Every rank steps in parallel; finished requests release their reservations, and a
        request a rank refuses is an over-commit that goes back to the queue's head."""
        decode = max(1, round(self.config.decode_tokens_per_s * (trace_now - self.last_trace)))
        self.last_trace = trace_now
        handles = self.kv.rank_handles
        refs = [h.engine_step.remote(admits.get(r, []), decode) for r, h in enumerate(handles)]
        results: list[StepResult] = ray.get(refs)
        rec = self.rec
        for res in results:
            rec.decode_stalls += len(res.on_hold)
            for sid in res.finished:
                self.controller.release(str(sid))
                self.in_flight.pop(str(sid), None)
                rec.completed += 1
            for sid in res.refused:
                self.controller.release(str(sid))
                self.in_flight.pop(str(sid), None)
                rec.overcommits += 1
                rec.admitted -= 1
            self.pending.push_front(self.by_id[str(sid)] for sid in res.refused)

    def sample(
        self,
        wall: float,
        trace_now: float,
        on_sample: Callable[[ClusterView, ReplayRecorder, float], None] | None,
    ) -> None:
        if wall - self.last_sample < self.config.sample_interval_s:
            return
        self.last_sample = wall
        _publish_decisions(self.kv, self.controller)
        view = self.kv.view()
        self.rec.samples.append(
            sample_view(view, wall, trace_now, len(self.pending), len(self.in_flight))
        )
        if on_sample is not None:
            on_sample(view, self.rec, wall)

    def done(self) -> bool:
        return self.next_arrival == len(self.arrivals) and not self.pending and not self.in_flight

    def pace(self, wall: float) -> None:
        spare = self.config.step_interval_s - (time.monotonic() - self.start - wall)
        if spare > 0:
            time.sleep(spare)  # the step's wall-clock budget, not synchronisation

    def finish(self) -> ReplayRecorder:
        """Drain the ranks, then wait until the view has folded what they reported last."""
        kv, rec = self.kv, self.rec
        ray.get([h.engine_drain.remote() for h in kv.rank_handles])
        ray.get([h.report_now.remote() for h in kv.rank_handles])
        sent = {
            r: info["seq"]
            for r, info in enumerate(ray.get([h.info.remote() for h in kv.rank_handles]))
        }
        _publish_decisions(kv, self.controller)
        final = _view_with_reports(kv, sent, timeout_s=30 * kv.settings.report_interval_s + 5)
        rec.finish(final, time.monotonic() - self.start)
        wall = rec.wall_s
        rec.samples.append(
            sample_view(final, wall, wall * self.config.time_scale, len(self.pending), 0)
        )
        return rec


def _view_with_reports(kv: KVFold, sent: dict[int, int], timeout_s: float) -> ClusterView:
    """The first view that holds every rank's report up to `sent[rank]` (or, after
    `timeout_s`, the latest: a rank that died meanwhile never gets there)."""
    deadline = time.monotonic() + timeout_s
    view = kv.view()
    while time.monotonic() < deadline:
        seen = (view.rank_summary(r) for r in sent)
        if all(
            s is not None and s[0].report_seq >= sent[r] for s, r in zip(seen, sent, strict=True)
        ):
            return view
        view = (
            kv.wait_for_version(view.version, timeout_s=max(0.0, deadline - time.monotonic()))
            or view
        )
    return view


def _publish_decisions(kv: KVFold, controller: AdmissionController) -> None:
    """Hand the controller's cumulative decision counts to the aggregator's exporter."""
    counts = {f"{o}:{r}": n for (o, r), n in controller.decisions.items()}
    kv.client.report_admission("replay", counts)

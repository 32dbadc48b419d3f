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
    watermark: int = 0
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
    rec = ReplayRecorder(num_requests=len(workload))
    controller = AdmissionController(
        kv.client,
        policy=config.policy,
        watermark=config.watermark,
        refresh_interval_s=config.step_interval_s / 2,
    )
    tpb = kv.settings.cache.tokens_per_block if kv.settings.cache else 16
    arrivals = sorted(workload, key=lambda r: r.arrival_s)
    by_id = {r.request_id: r for r in arrivals}
    asked: dict[str, AdmissionRequest] = {}  # built (prefix keys hashed) once per request

    def to_request(req: TraceRequest) -> AdmissionRequest:
        made = asked.get(req.request_id)
        if made is None:
            keys = tuple(block_keys(req.prompt, tpb)) if config.prefix_affinity else ()
            made = AdmissionRequest(req.request_id, req.prompt_tokens, req.max_new_tokens, keys)
            asked[req.request_id] = made
        return made

    pending: FifoAdmissionQueue[TraceRequest] = FifoAdmissionQueue(to_request)
    arrived_step: dict[str, int] = {}  # the step each waiting request arrived in
    step = 0
    in_flight: dict[str, int] = {}
    next_arrival = 0
    start = time.monotonic()
    last_trace = 0.0
    last_sample = float("-inf")
    handles = kv.rank_handles
    while True:
        step += 1
        wall = time.monotonic() - start
        trace_now = wall * config.time_scale
        while next_arrival < len(arrivals) and arrivals[next_arrival].arrival_s <= trace_now:
            pending.push(arrivals[next_arrival])
            arrived_step[arrivals[next_arrival].request_id] = step
            next_arrival += 1
        controller.refresh()
        admits: dict[int, list[tuple[Any, Any, int, None]]] = {}
        for req, d in pending.pump(controller.decide):
            rec.decisions[f"{d.outcome.value}:{d.reason}"] += 1
            if d.outcome is Outcome.QUEUE:
                rec.queue_decisions += 1
                continue
            del asked[req.request_id]  # decided (a rank may still refuse it: then built again)
            if arrived_step.pop(req.request_id, step) < step:
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
            in_flight[req.request_id] = d.rank
        decode = max(1, round(config.decode_tokens_per_s * (trace_now - last_trace)))
        last_trace = trace_now
        refs = [h.engine_step.remote(admits.get(r, []), decode) for r, h in enumerate(handles)]
        results: list[StepResult] = ray.get(refs)
        for res in results:
            rec.decode_stalls += len(res.on_hold)
            for sid in res.finished:
                controller.release(str(sid))
                in_flight.pop(str(sid), None)
                rec.completed += 1
            for sid in res.refused:
                controller.release(str(sid))
                in_flight.pop(str(sid), None)
                rec.overcommits += 1
                rec.admitted -= 1
            pending.push_front(by_id[str(sid)] for sid in res.refused)
        if wall - last_sample >= config.sample_interval_s:
            last_sample = wall
            _publish_decisions(kv, controller)
            view = kv.view()
            rec.samples.append(sample_view(view, wall, trace_now, len(pending), len(in_flight)))
            if on_sample is not None:
                on_sample(view, rec, wall)
        done = next_arrival == len(arrivals) and not pending and not in_flight
        if done or (config.max_wall_s is not None and wall >= config.max_wall_s):
            break
        spare = config.step_interval_s - (time.monotonic() - start - wall)
        if spare > 0:
            time.sleep(spare)
    for h in handles:
        h.engine_drain.remote()
    ray.get([h.report_now.remote() for h in handles])
    _publish_decisions(kv, controller)
    time.sleep(3 * kv.settings.report_interval_s)  # let every node push what the ranks said
    final = kv.view()
    rec.finish(final, time.monotonic() - start)
    rec.samples.append(
        sample_view(final, rec.wall_s, rec.wall_s * config.time_scale, len(pending), 0)
    )
    return rec


def _publish_decisions(kv: KVFold, controller: AdmissionController) -> None:
    """Hand the controller's cumulative decision counts to the aggregator's exporter."""
    counts = {f"{o}:{r}": n for (o, r), n in controller.decisions.items()}
    kv.client.report_admission("replay", counts)

"""Replay a workload through admission onto the rank actors, with a simple engine model.

`schedulers` schedulers, each a Ray actor with its own admission controller, FIFO
queue and view refreshes (kvfold.workload.scheduler), share the ranks; arriving
requests are dealt among them round-robin. Every step (about `step_interval_s` of
wall time, `time_scale` times more of trace time):
  1. each scheduler takes the requests dealt to it and decides its queue's head, in
     order: ADMIT names a rank, REJECT drops, QUEUE stops its pass (strict FIFO);
  2. every rank runs one engine step in parallel: decoding `decode_tokens_per_s` x
     (trace time since the last step) tokens per running sequence, freeing finished
     ones, placing what was admitted to it in each scheduler's ticket order; a
     placement that would over-commit the rank is refused (counted: rank refusals)
     and goes back to the head of its scheduler's queue.
A GUARANTEED_NO_EVICT request that cannot grow would be a broken promise: counted as
an over-commit (must be 0).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import ray

from kvfold.admission import Policy
from kvfold.cluster.handle import KVFold
from kvfold.cluster.scheduler_actor import start_schedulers
from kvfold.errors import KVFoldError
from kvfold.view import ClusterView
from kvfold.worker.engine import StepResult
from kvfold.workload.recorder import ReplayRecorder, sample_view
from kvfold.workload.requests import TraceRequest
from kvfold.workload.scheduler import Admit, ReplayConfig, SchedulerSettings, StepOutcome

__all__ = ["ReplayConfig", "replay"]


def replay(
    kv: KVFold,
    workload: Sequence[TraceRequest],
    config: ReplayConfig | None = None,
    on_sample: Callable[[ClusterView, ReplayRecorder, float], None] | None = None,
) -> ReplayRecorder:
    """Replay `workload` on `kv` until every request completed or was rejected (or
    `max_wall_s` passed); returns what was recorded."""
    config = config or ReplayConfig()
    run = _Replay(kv, workload, config)
    while True:
        wall, trace_now = run.clock()
        admits = run.decide(trace_now)
        run.engine_step(admits, trace_now)
        run.sample(wall, trace_now, on_sample)
        if run.done() or (config.max_wall_s is not None and wall >= config.max_wall_s):
            break
        run.pace(wall)
    return run.finish()


class _Replay:
    """One replay's state: the schedulers, what runs where, the recorder."""

    def __init__(self, kv: KVFold, workload: Sequence[TraceRequest], config: ReplayConfig) -> None:
        self.kv, self.config = kv, config
        self.rec = ReplayRecorder(num_requests=len(workload), schedulers=config.schedulers)
        # one source for the block size: what the ranks report
        tokens_per_block = kv.view().gpu_total.tokens_per_block
        if tokens_per_block < 1:
            raise KVFoldError("no fresh rank reports its block size; is kvfold up?")
        n = config.schedulers
        settings = [
            SchedulerSettings(
                tokens_per_block=tokens_per_block,
                policy=config.policy,
                watermark_blocks=config.watermark_blocks,
                refresh_interval_s=config.step_interval_s / 2,
                prefix_affinity=config.prefix_affinity,
                num_controllers=n if config.leases else 1,
                name=f"replay-{i}",
            )
            for i in range(n)
        ]
        self.schedulers = start_schedulers(kv.settings.namespace, settings)
        self.arrivals = sorted(workload, key=lambda r: r.arrival_s)
        self.by_id = {r.request_id: r for r in self.arrivals}
        self.owner: dict[str, int] = {}  # request id -> the scheduler it was dealt to
        self.refused: list[list[str]] = [[] for _ in range(n)]  # to hand back next step
        self.finished: list[list[str]] = [[] for _ in range(n)]
        self.in_flight: dict[str, int] = {}
        self.queued = 0
        self.decisions: dict[str, int] = {}
        self.step = 0
        self.next_arrival = 0
        self.start = time.monotonic()
        self.last_trace = 0.0
        self.last_sample = float("-inf")

    def clock(self) -> tuple[float, float]:
        """(wall seconds since the start, trace seconds) for a new step."""
        self.step += 1
        wall = time.monotonic() - self.start
        return wall, wall * self.config.time_scale

    def _deal(self, trace_now: float) -> list[list[TraceRequest]]:
        """The requests arrived by `trace_now`, dealt round-robin among the schedulers."""
        n, arrivals = len(self.schedulers), self.arrivals
        dealt: list[list[TraceRequest]] = [[] for _ in range(n)]
        while (
            self.next_arrival < len(arrivals) and arrivals[self.next_arrival].arrival_s <= trace_now
        ):
            req, k = arrivals[self.next_arrival], self.next_arrival % n
            dealt[k].append(req)
            self.owner[req.request_id] = k
            self.next_arrival += 1
        return dealt

    def decide(self, trace_now: float) -> dict[int, list[Admit]]:
        """Every scheduler decides in parallel; return what each rank is to place, each
        scheduler's admits in its ticket order."""
        dealt = self._deal(trace_now)
        refs = [
            s.step.remote(dealt[k], self.refused[k], self.finished[k], trace_now, self.step)
            for k, s in enumerate(self.schedulers)
        ]
        self.refused = [[] for _ in self.schedulers]
        self.finished = [[] for _ in self.schedulers]
        outcomes: list[StepOutcome] = ray.get(refs)
        rec = self.rec
        admits: dict[int, list[Admit]] = {}
        self.queued = 0
        for out in outcomes:
            for key, count in out.decisions.items():
                rec.decisions[key] += count
                self.decisions[key] = self.decisions.get(key, 0) + count
            rec.queue_decisions += out.queue_decisions
            rec.ever_queued += out.ever_queued
            rec.rejected += out.rejected
            self.queued += out.queued
            for _, delay in out.admitted:
                rec.admitted += 1
                rec.queue_delays_s.append(delay)
            for rank, items in out.admits.items():
                admits.setdefault(rank, []).extend(items)
                for item in items:
                    self.in_flight[item[0]] = rank
        return admits

    def engine_step(self, admits: dict[int, list[Admit]], trace_now: float) -> None:
        """Every rank steps in parallel; finished and refused requests go back to the
        scheduler that admitted them."""
        decode = max(1, round(self.config.decode_tokens_per_s * (trace_now - self.last_trace)))
        self.last_trace = trace_now
        handles = self.kv.rank_handles
        refs = [h.engine_step.remote(admits.get(r, []), decode) for r, h in enumerate(handles)]
        results: list[StepResult] = ray.get(refs)
        rec = self.rec
        guaranteed = self.config.policy is Policy.GUARANTEED_NO_EVICT
        for res in results:
            rec.decode_stalls += len(res.on_hold)
            rec.preemptions += len(res.preempted)
            if guaranteed:  # a promise to run to the end without eviction, broken
                rec.overcommits += len(res.on_hold) + len(res.preempted)
            for sid in res.finished:
                rid = str(sid)
                self.in_flight.pop(rid, None)
                self.finished[self.owner[rid]].append(rid)
                rec.completed += 1
                req = self.by_id[rid]
                rec.admitted_tokens += req.prompt_tokens + req.max_new_tokens
                rec.last_completion_trace_s = trace_now
            for sid in res.refused:
                rid = str(sid)
                self.in_flight.pop(rid, None)
                self.refused[self.owner[rid]].append(rid)
                rec.rank_refusals += 1
                rec.admitted -= 1
                rec.queue_delays_s.pop()  # decided again later: its delay counts then

    def sample(
        self,
        wall: float,
        trace_now: float,
        on_sample: Callable[[ClusterView, ReplayRecorder, float], None] | None,
    ) -> None:
        if wall - self.last_sample < self.config.sample_interval_s:
            return
        self.last_sample = wall
        self._publish_decisions()
        view = self.kv.view()
        self.rec.samples.append(
            sample_view(view, wall, trace_now, self.queued, len(self.in_flight))
        )
        if on_sample is not None:
            on_sample(view, self.rec, wall)

    def done(self) -> bool:
        return (
            self.next_arrival == len(self.arrivals)
            and not self.queued
            and not self.in_flight
            and not any(self.refused)
        )

    def pace(self, wall: float) -> None:
        spare = self.config.step_interval_s - (time.monotonic() - self.start - wall)
        if spare > 0:
            time.sleep(spare)  # the step's wall-clock budget, not synchronisation

    def _publish_decisions(self) -> None:
        """Hand the schedulers' cumulative decision counts to the aggregator's exporter."""
        self.kv.client.report_admission("replay", dict(self.decisions))

    def finish(self) -> ReplayRecorder:
        """Drain the ranks, then wait until the view has folded what they reported last."""
        kv, rec = self.kv, self.rec
        ray.get([h.engine_drain.remote() for h in kv.rank_handles])
        ray.get([h.report_now.remote() for h in kv.rank_handles])
        infos = ray.get([h.info.remote() for h in kv.rank_handles])
        sent = {r: info["seq"] for r, info in enumerate(infos)}
        self._publish_decisions()
        for s in self.schedulers:
            ray.kill(s)
        final = _view_with_reports(kv, sent, timeout_s=30 * kv.settings.report_interval_s + 5)
        rec.finish(final, time.monotonic() - self.start)
        wall = rec.wall_s
        rec.samples.append(sample_view(final, wall, wall * self.config.time_scale, self.queued, 0))
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

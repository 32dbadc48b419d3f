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

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.exceptions import ActorDiedError, RayError

from kvfold.admission import Policy
from kvfold.blockindex.feed import Replica
from kvfold.cluster.handle import KVFold
from kvfold.errors import KVFoldError
from kvfold.replay.scheduler_actor import start_schedulers
from kvfold.view import ClusterView
from kvfold.worker.engine import StepResult
from kvfold.worker.hashing import block_keys
from kvfold.workload.recorder import ReplayRecorder, sample_view
from kvfold.workload.requests import TraceRequest
from kvfold.workload.scheduler import Admit, ReplayConfig, SchedulerSettings, StepOutcome

__all__ = ["ReplayConfig", "replay"]

RANK_STEP_TIMEOUT_S = 10.0  # a rank that takes longer to step is given up for now


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
                claims=config.claims,
                name=f"replay-{i}",
                router=config.router,
                overlap_weight=config.overlap_weight,
            )
            for i in range(n)
        ]
        self.schedulers = start_schedulers(kv.settings.namespace, settings)
        self.arrivals = sorted(workload, key=lambda r: r.arrival_s)
        self.by_id = {r.request_id: r for r in self.arrivals}
        self.owner: dict[str, int] = {}  # request id -> the scheduler it was dealt to
        self.refused: list[list[str]] = [[] for _ in range(n)]  # to hand back next step
        self.restarted: list[list[str]] = [[] for _ in range(n)]  # lost their KV: again
        self.finished: list[list[str]] = [[] for _ in range(n)]
        self.in_flight: dict[str, int] = {}
        self.delay_of: dict[str, float] = {}  # queueing delay of each placed request
        self.incarnation: dict[int, int] = {}  # each rank's, as its last answer said
        self.unanswered: dict[int, Any] = {}  # a rank's call still out: skip it till back
        self.to_drain: set[int] = set()  # ranks whose work was given up: clear them first
        self.gone: set[int] = set()  # ranks whose actor died for good: never called again
        self.queued = 0
        self.decisions: dict[str, int] = {}
        self.step = 0
        self.next_arrival = 0
        self.tokens_per_block = tokens_per_block
        # the driver's own copy of the cluster block index: what a perfect router could
        # have reused when each request arrived (`available`)
        self.blocks = Replica(list(kv.view().rank_to_node))
        self.arrived_keys: dict[str, int] = {}
        # samples on the trace clock: every report interval's worth of trace time; a
        # stretch the driver could not sample is a gap (kvfold.workload.recorder)
        self.rec.sample_every_s = config.sample_interval_s or (
            kv.settings.report_interval_s * config.time_scale
        )
        self.rec.step_interval_s = config.step_interval_s
        self.next_sample = 0.0
        self.start = time.monotonic()
        self.last_trace = 0.0

    def clock(self) -> tuple[float, float]:
        """(wall seconds since the start, trace seconds) for a new step."""
        self.step += 1
        wall = time.monotonic() - self.start
        return wall, wall * self.config.time_scale

    def _deal(self, trace_now: float) -> list[list[TraceRequest]]:
        """The requests arrived by `trace_now`, dealt round-robin among the schedulers."""
        n, arrivals = len(self.schedulers), self.arrivals
        dealt: list[list[TraceRequest]] = [[] for _ in range(n)]
        first = self.next_arrival
        while (
            self.next_arrival < len(arrivals) and arrivals[self.next_arrival].arrival_s <= trace_now
        ):
            req, k = arrivals[self.next_arrival], self.next_arrival % n
            dealt[k].append(req)
            self.owner[req.request_id] = k
            self.next_arrival += 1
        if self.next_arrival > first:
            self._available(arrivals[first : self.next_arrival])
        return dealt

    def _available(self, arrived: Sequence[TraceRequest]) -> None:
        """For each request arriving now: the longest run of its prompt's blocks, from the
        first, that one rank (GPU, then its node's host tier) holds, as the index knows."""
        with contextlib.suppress(KVFoldError):  # the aggregator is away: as it was
            cursor, ops, whole = self.kv.client.block_index_since(self.blocks.cursor)
            self.blocks.take(cursor, ops, whole)
        B = self.tokens_per_block
        for req in arrived:
            keys = block_keys(req.prompt, B)
            m = self.blocks.index.match(keys, req.prompt_tokens)
            self.rec.prompt_blocks += req.prompt_tokens // B
            self.rec.available_blocks += m.longest

    def decide(self, trace_now: float) -> dict[int, list[Admit]]:
        """Every scheduler decides in parallel; return what each rank is to place, each
        scheduler's admits in its ticket order."""
        dealt = self._deal(trace_now)
        refs = [
            s.step.remote(
                dealt[k],
                self.refused[k],
                self.finished[k],
                trace_now,
                self.step,
                self.restarted[k],
            )
            for k, s in enumerate(self.schedulers)
        ]
        self.refused = [[] for _ in self.schedulers]
        self.restarted = [[] for _ in self.schedulers]
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
            for _, reason in out.failed:
                rec.failed += 1
                rec.failures[reason] += 1
            self.queued += out.queued
            for rid, delay in out.admitted:
                rec.admitted += 1
                self.delay_of[rid] = delay  # a request decided again counts its last delay
            for rank, items in out.admits.items():
                admits.setdefault(rank, []).extend(items)
                for item in items:
                    self.in_flight[item[0]] = rank
        return admits

    def engine_step(self, admits: dict[int, list[Admit]], trace_now: float) -> None:
        """Every rank steps in parallel; finished and refused requests go back to the
        scheduler that admitted them. A rank that fails, restarts or does not answer is
        an event, not an error: the requests it held lost their KV and are decided
        again (counted `restarted`), and it is cleared before it is used again."""
        decode = max(1, round(self.config.decode_tokens_per_s * (trace_now - self.last_trace)))
        self.last_trace = trace_now
        calls: dict[int, Any] = {}
        for r, h in enumerate(self.kv.rank_handles):
            if r in self.gone:
                if admits.get(r):  # decided on a view that did not know yet
                    self._lose(r, "rank_gone")
                continue
            if r in self.unanswered and not self._answered(r, h):
                self._lose(r, "rank_not_answering")
                continue
            calls[r] = h.engine_step.remote(
                admits.get(r, []), decode, drain_first=r in self.to_drain, now_s=trace_now
            )
        _, late = ray.wait(
            list(calls.values()), num_returns=len(calls), timeout=RANK_STEP_TIMEOUT_S
        )
        late_refs = set(late)
        for r, ref in calls.items():
            if ref in late_refs:
                self.unanswered[r] = ref
                self._lose(r, "rank_not_answering")
                continue
            try:
                res: StepResult = ray.get(ref)
            except ActorDiedError:
                self.gone.add(r)  # its KV, and the rank, are gone for good
                self._lose(r, "rank_died")
                continue
            except RayError as e:
                self._lose(r, f"rank_call_failed:{type(e).__name__}")
                # stepped again once it answers a ping: a rank that cannot come back yet
                # (restarting, its node gone) must not hold every step for the timeout
                self.unanswered[r] = h.ping.remote()
                continue
            self.to_drain.discard(r)
            if self.incarnation.get(r, res.incarnation) != res.incarnation:
                keep = frozenset({*res.admitted, *res.refused})
                self._lose(r, "rank_restarted", keep=keep, cleared=True)
            self.incarnation[r] = res.incarnation
            self._account(res, trace_now)

    def _answered(self, r: int, handle: Any) -> bool:
        """Whether rank `r`, whose last call is still out or failed, answered it now (then
        it is stepped again; what that call carried was given up). A failed answer sends
        a ping in its place, and the rank waits for that one."""
        ref = self.unanswered[r]
        if not ray.wait([ref], timeout=0)[0]:
            return False
        try:
            ray.get(ref)
        except ActorDiedError:
            pass  # stepped, it says so, and is counted gone
        except RayError:
            self.unanswered[r] = handle.ping.remote()
            return False
        del self.unanswered[r]
        return True

    def _account(self, res: StepResult, trace_now: float) -> None:
        rec = self.rec
        B = self.tokens_per_block
        for p in res.prefills:
            rid = str(p.seq_id)
            if p.recomputed or rid in rec.ttft_s:
                continue  # counted when it was first computed
            rec.ttft_s[rid] = p.first_token_s - self.by_id[rid].arrival_s
            rec.achieved_blocks += p.covered_tokens // B
            rec.achieved_gpu_blocks += p.reused_tokens // B
        rec.decode_stalls += len(res.on_hold)
        rec.preemptions += len(res.preempted)
        if self.config.policy is Policy.GUARANTEED_NO_EVICT:  # a promise, broken
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
            self._unadmit(rid)

    def _unadmit(self, rid: str) -> None:
        """A request counted admitted is not running after all: it is decided again."""
        self.rec.admitted -= 1
        self.delay_of.pop(rid, None)  # its delay counts when it is placed for good

    def _lose(
        self, rank: int, fault: str, keep: frozenset[Any] = frozenset(), cleared: bool = False
    ) -> None:
        """The requests on `rank` (but `keep`), running or about to be placed (decide() put
        both in `in_flight`), lost their KV, or may have: give the rank up until it is
        cleared, and hand every one back to its scheduler to be decided again."""
        self.rec.faults[fault] += 1
        if not cleared:  # a restarted rank came back empty: nothing to clear
            self.to_drain.add(rank)
        lost = [rid for rid, r in self.in_flight.items() if r == rank and rid not in keep]
        for rid in lost:
            self.in_flight.pop(rid, None)
            self.restarted[self.owner[rid]].append(rid)
            self.rec.restarted += 1
            self._unadmit(rid)

    def sample(
        self,
        wall: float,
        trace_now: float,
        on_sample: Callable[[ClusterView, ReplayRecorder, float], None] | None,
    ) -> None:
        if trace_now < self.next_sample:
            return
        self.next_sample = trace_now + self.rec.sample_every_s
        self._publish_decisions()
        try:
            view = self.kv.view()
        except KVFoldError:  # the aggregator is away: no sample this time
            self.rec.faults["no_view"] += 1
            return
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
            and not any(self.restarted)
        )

    def pace(self, wall: float) -> None:
        took = time.monotonic() - self.start - wall
        self.rec.step_wall_s.append(took)  # a step longer than its interval: an overrun
        spare = self.config.step_interval_s - took
        if spare > 0:
            time.sleep(spare)  # the step's wall-clock budget, not synchronisation

    def _publish_decisions(self) -> None:
        """Hand the schedulers' cumulative decision counts to the aggregator's exporter."""
        with contextlib.suppress(KVFoldError):  # the aggregator is away: next time
            self.kv.client.report_admission("replay", dict(self.decisions))

    def finish(self) -> ReplayRecorder:
        """Drain the ranks, then wait until the view has folded what they reported last."""
        kv, rec = self.kv, self.rec
        sent: dict[int, int] = {}
        for r, h in enumerate(kv.rank_handles):  # a rank that is away is left out
            if r in self.gone or r in self.unanswered:
                continue
            with contextlib.suppress(RayError):
                ray.get(h.engine_drain.remote(), timeout=RANK_STEP_TIMEOUT_S)
                ray.get(h.report_now.remote(), timeout=RANK_STEP_TIMEOUT_S)
                sent[r] = ray.get(h.info.remote(), timeout=RANK_STEP_TIMEOUT_S)["seq"]
        self._publish_decisions()
        for s in self.schedulers:
            ray.kill(s)
        running: dict[int, int] = {}
        for r in self.in_flight.values():
            running[r] = running.get(r, 0) + 1
        rec.unfinished = {  # what a wall-clock limit left undone (empty when all is done)
            k: v
            for k, v in {
                "queued": self.queued,
                "running_by_rank": running,
                "to_decide_again": sum(map(len, self.refused)) + sum(map(len, self.restarted)),
                "not_arrived": len(self.arrivals) - self.next_arrival,
            }.items()
            if v
        }
        final = _view_with_reports(kv, sent, timeout_s=30 * kv.settings.report_interval_s + 5)
        rec.queue_delays_s = list(self.delay_of.values())
        rec.finish(final, time.monotonic() - self.start)
        wall = rec.wall_s
        rec.samples.append(sample_view(final, wall, wall * self.config.time_scale, self.queued, 0))
        return rec


def _view_with_reports(kv: KVFold, sent: dict[int, int], timeout_s: float) -> ClusterView:
    """The first view that holds every rank's report up to `sent[rank]` (or, after
    `timeout_s`, the latest: a rank that died meanwhile never gets there)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            view = kv.view()
            break
        except KVFoldError:  # the aggregator is coming back
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.1)
    while time.monotonic() < deadline:
        seen = (view.rank_summary(r) for r in sent)
        if all(
            s is not None and s[0].report_seq >= sent[r] for s, r in zip(seen, sent, strict=True)
        ):
            return view
        with contextlib.suppress(KVFoldError):
            left = max(0.0, deadline - time.monotonic())
            view = kv.wait_for_version(view.version, timeout_s=min(left, 1.0)) or view
    return view

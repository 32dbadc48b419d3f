"""What every kvfold actor shares, on the Ray side: one background loop, calls in flight,
and asking a named actor itself whether it lives.

    BackgroundLoop(name, interval_s, step)   runs step() every interval_s (on a phase,
                                             when given), when woken, or by a time asked
                                             for (wake_at), on one daemon thread; failures
                                             are logged
    node_phase_s                             the phase a node's ranks report on
    InFlight                                 calls sent and not waited on: answers are
                                             counted as they come, never waited on long
    incarnation_of / is_gone / gone_among    a named actor's own word
    EventPublisher                           a source's block-event stream to the cluster
                                             block index (DESIGN §9), sent from the same
                                             loop as its reports, through its node actor;
                                             a lost batch is a gap the index heals from a
                                             snapshot, so nothing is resent

Library code logs to the `kvfold` logger; nothing here prints.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from typing import Any, Generic, TypeVar

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError

from kvfold.kvevents.events import RANK, Envelope, Event, EventBatch, encode_envelope
from kvfold.kvevents.snapshot import Snapshot
from kvfold.naming import AGGREGATOR_NAME, node_actor_name
from kvfold.stats import Window

log = logging.getLogger("kvfold")

T = TypeVar("T")
K = TypeVar("K")

LOOP_ERRORS = (RayError, ValueError, RuntimeError, OSError)
"""What a background step may raise and the loop survives (logged, counted)."""


class BackgroundLoop:
    """One daemon thread running `step()` every `interval_s`, or sooner: when woken, or
    at the earliest time asked for since its last step (`wake_at`). With `phase_s`, the
    periodic steps fall on `phase_s + k x interval_s` of time.monotonic(): loops of one
    machine given one phase step together."""

    def __init__(
        self,
        name: str,
        interval_s: float,
        step: Callable[[], None],
        min_gap_s: float = 0.0,
        phase_s: float | None = None,
    ) -> None:
        self.name = name
        self.interval_s = interval_s
        self.phase_s = phase_s
        self.step = step
        self.min_gap_s = min_gap_s  # coalesce bursts of wake-ups into one step
        self.failures = 0
        self._cv = threading.Condition()
        self._woken = False
        self._due = float("inf")  # the earliest wake_at since the last step (monotonic s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> BackgroundLoop:
        self._thread.start()
        return self

    def wake(self) -> None:
        with self._cv:
            self._woken = True
            self._cv.notify()

    def wake_at(self, when_s: float) -> None:
        """Step no later than `when_s` (time.monotonic()), unless it steps sooner."""
        with self._cv:
            if when_s < self._due:
                self._due = when_s
                self._cv.notify()

    def stop(self) -> None:
        self._stop.set()
        self.wake()

    def _wait(self) -> None:
        """Until woken, the time asked for, or interval_s from now; then forget both."""
        deadline = next_tick_s(time.monotonic(), self.interval_s, self.phase_s)
        with self._cv:
            while not self._woken:
                left = min(deadline, self._due) - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            self._woken, self._due = False, float("inf")

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wait()
            if self._stop.is_set():
                return
            try:
                self.step()
            except LOOP_ERRORS as e:
                self.failures += 1
                log.warning("%s: step failed: %s: %s", self.name, type(e).__name__, e)
            if self.min_gap_s:
                self._stop.wait(self.min_gap_s)


def next_tick_s(now_s: float, interval_s: float, phase_s: float | None) -> float:
    """A loop's next periodic step after `now_s`: an interval on, or the next time on its
    phase (`phase_s + k x interval_s`, after now and at most an interval on)."""
    if phase_s is None:
        return now_s + interval_s
    t = phase_s + (math.floor((now_s - phase_s) / interval_s) + 1) * interval_s
    return t if t > now_s else t + interval_s  # now on a tick, rounded: the next one


def node_phase_s(node: int, interval_s: float) -> float:
    """The phase of a node's rank reports within the interval: ranks of one node report
    together (their node then pushes once a round is in, soon after), and nodes spread
    evenly over the interval (a golden-ratio sequence), so the aggregator is not sent
    every node's push at once."""
    return (node * 0.6180339887498949) % 1.0 * interval_s


class InFlight(Generic[T]):
    """Calls sent and not yet answered, each with what the caller needs to account for it."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit  # None: never give up on a call
        self.items: list[tuple[Any, T]] = []

    def __len__(self) -> int:
        return len(self.items)

    def add(self, ref: Any, tag: T) -> None:
        self.items.append((ref, tag))

    def wait(self, timeout_s: float, last_only: bool = False) -> None:
        """Wait up to `timeout_s` for every call (or only the newest) to be answered."""
        refs = [r for r, _ in self.items[-1:]] if last_only else [r for r, _ in self.items]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=timeout_s)

    def settle(
        self, on_answer: Callable[[Any, T], None], on_failure: Callable[[RayError, T], None]
    ) -> dict[Any, Any]:
        """Account for every call answered by now (no waiting); return {ref: answer}.
        Past `limit` calls still unanswered, the oldest are given up on (a failure)."""
        answers: dict[Any, Any] = {}
        if not self.items:
            return answers
        refs = [r for r, _ in self.items]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        done = set(ready)
        answered = [(r, t) for r, t in self.items if r in done]
        keep = [(r, t) for r, t in self.items if r not in done]
        given_up: list[tuple[Any, T]] = []
        if self.limit is not None and len(keep) > self.limit:
            given_up, keep = keep[: len(keep) - self.limit], keep[len(keep) - self.limit :]
        self.items = keep  # taken off first: a callback that raises never counts twice
        for ref, tag in answered:
            try:
                answers[ref] = ray.get(ref)
            except RayError as e:
                answers[ref] = e
                on_failure(e, tag)
                continue
            on_answer(answers[ref], tag)
        for _, tag in given_up:
            on_failure(RayError("no answer: given up"), tag)
        return answers


class Every:
    """True at most once per `period_s` (for probes that must not run on every step)."""

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s
        self._last_s = float("-inf")

    def due(self, now_s: float) -> bool:
        if now_s - self._last_s < self.period_s:
            return False
        self._last_s = now_s
        return True


def named_actor(name: str, namespace: str) -> Any | None:
    """The named actor's handle, or None when no such actor exists."""
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None


def incarnation_of(name: str, namespace: str, timeout_s: float) -> int | None:
    """The named actor's incarnation (its `ping()`), or None if it is gone or silent."""
    try:
        handle = ray.get_actor(name, namespace=namespace)
        answer: Any = ray.get(handle.ping.remote(), timeout=timeout_s)
    except (ValueError, RayActorError, GetTimeoutError):
        return None
    return int(answer)


def is_gone(name: str, namespace: str, timeout_s: float) -> bool:
    """True when Ray says the named actor is dead or unknown; False when it answers or is
    merely slow or restarting (freshness then decides)."""
    try:
        handle = ray.get_actor(name, namespace=namespace)
        ray.get(handle.ping.remote(), timeout=timeout_s)
    except (ValueError, RayActorError):
        return True
    except GetTimeoutError:
        return False
    return False


def gone_among(names: Mapping[K, str], namespace: str, timeout_s: float) -> list[K]:
    """The sources (keys of `names`) whose named actor Ray says is gone."""
    return [source for source, name in names.items() if is_gone(name, namespace, timeout_s)]


def silent(states: Iterable[tuple[K, Any]], silent_states: Iterable[Any]) -> list[K]:
    """The sources whose state is one of `silent_states`."""
    wanted = set(silent_states)
    return [source for source, state in states if state in wanted]


MAX_INFLIGHT_BATCHES = 64
HEARTBEAT_EVERY = 10  # idle publishes between heartbeats ("I stand at seq N")
Keys = dict[int, list[bytes]]


class EventPublisher:
    """Numbers, encodes and sends one source's batches; `drain()` gives each batch's events.

    Where they go: a rank's to its node actor (`via_node`: `rank_events`), which sends
    them on with its own report in one call per interval (docs/scale.md); a node's
    host tier's into its node's outbox (`sink`); else straight to the aggregator."""

    def __init__(
        self,
        kind: str,
        source: int,
        incarnation: int,
        namespace: str,
        *,
        via_node: int | None = None,
        sink: Callable[[bytes], object] | None = None,
    ) -> None:
        self.kind, self.source, self.incarnation = kind, source, incarnation
        self.namespace = namespace
        self.sink = sink
        self.via_node = via_node
        self.seq = 0
        self.failed = 0  # batches that did not arrive, or whose answer never came
        self.lock = threading.Lock()  # drain and send together: batches leave in order
        self._inflight: InFlight[None] = InFlight(MAX_INFLIGHT_BATCHES)
        self._agg: Any = None
        self._idle = 0

    def _next(self, events: list[Event], heartbeat: bool = False) -> bytes | None:
        if not events:
            if not heartbeat or not self.seq:
                return None
            env = Envelope(self.kind, self.source, self.incarnation, self.seq, EventBatch(0.0, ()))
            return encode_envelope(env)
        self.seq += 1
        batch = EventBatch(time.time(), tuple(events), self.source if self.kind == RANK else None)
        return encode_envelope(Envelope(self.kind, self.source, self.incarnation, self.seq, batch))

    def _send(self, data: bytes | None) -> None:
        if data is None:
            return
        if self.sink is not None:
            self.sink(data)
            return
        name = AGGREGATOR_NAME if self.via_node is None else node_actor_name(self.via_node)
        target = self._agg or named_actor(name, self.namespace)
        if target is None:
            self.failed += 1
            return
        self._agg = target
        method = target.block_events if self.via_node is None else target.rank_events
        self._inflight.add(method.remote(data), None)

    def publish(self, drain: Callable[[], list[Event]], wait_s: float) -> None:
        """Send what `drain()` returns as the next batch (nothing when it is empty)."""
        with self.lock:  # InFlight is not thread-safe: every use of it is under the lock
            events = drain()
            self._idle = 0 if events else self._idle + 1
            self._send(self._next(events, heartbeat=self._idle % HEARTBEAT_EVERY == 1))
            if wait_s:
                self._inflight.wait(wait_s)
            self._inflight.settle(lambda _a, _t: None, self._lost)

    def _lost(self, _error: RayError, _tag: None) -> None:
        self.failed += 1
        self._agg = None  # re-resolve: the node actor (or aggregator) may have restarted

    def snapshot(
        self,
        state_lock: AbstractContextManager[Any],
        drain: Callable[[], list[Event]],
        take: Callable[[], tuple[Keys, dict[int, Window], int]],
    ) -> Snapshot:
        """The source's keys and the seq they stand at, taken together: what changed
        since the last batch goes out as one more batch, and the snapshot stands after it."""
        with self.lock:
            with state_lock:
                data = self._next(drain())
                keys, windows, block_size = take()
                seq = self.seq
            self._send(data)
        return Snapshot(self.kind, self.source, self.incarnation, seq, keys, windows, block_size)

"""EventPublisher: one source's block-event stream to the cluster block index (DESIGN §9).

Rank actors (their GPU cache) and node actors (their host tier) publish from the same
loop that sends their reports, straight to the aggregator that holds the index (as
vLLM's publisher feeds llm-d's indexer): batches numbered 1, 2, ... per incarnation,
sent in order, never waited on long, never resent. A batch that does not arrive is a
gap the index heals from a snapshot of the source's keys (`snapshot`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from ray.exceptions import RayError

from kvfold.blockindex.events import RANK, Envelope, Event, EventBatch, encode_envelope
from kvfold.blockindex.feed import Snapshot
from kvfold.naming import AGGREGATOR_NAME
from kvfold.ray_actor import InFlight, named_actor
from kvfold.stats import Window

MAX_INFLIGHT_BATCHES = 64
HEARTBEAT_EVERY = 10  # idle publishes between heartbeats ("I stand at seq N")
Keys = dict[int, list[bytes]]


class EventPublisher:
    """Numbers, encodes and sends one source's batches; `drain()` gives each batch's events."""

    def __init__(self, kind: str, source: int, incarnation: int, namespace: str) -> None:
        self.kind, self.source, self.incarnation = kind, source, incarnation
        self.namespace = namespace
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
        agg = self._agg or named_actor(AGGREGATOR_NAME, self.namespace)
        if agg is None:
            self.failed += 1
            return
        self._agg = agg
        self._inflight.add(agg.block_events.remote(data), None)

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
        self._agg = None  # re-resolve: the aggregator may have restarted

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

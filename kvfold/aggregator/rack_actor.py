"""RackAggregator: a level between node actors and the cluster aggregator, for fleets
where one actor cannot take a call per node and interval (docs/scale.md).

Its nodes push to it what they would push to the aggregator (`node_push`: a node
report and its ranks' block-event batches). Twice per `report_interval_s` it sends
what came, in arrival order, as one `rack_push`: the aggregator takes two calls per
rack and interval instead of one per node, and a report waits about half an interval
on the way (more while the aggregator is slow to answer). It decodes nothing and holds
nothing that must survive: a rack that restarts loses at most the pushes it held (its nodes' next
reports replace theirs; their sources' lost batches resynchronise from snapshots).
"""

from __future__ import annotations

import secrets
import threading
from typing import Any

from ray.exceptions import RayError

from kvfold.naming import AGGREGATOR_NAME
from kvfold.ray_actor import BackgroundLoop, InFlight, named_actor

MAX_INFLIGHT = 16
FORWARDS_PER_INTERVAL = 2
MAX_HELD_PUSHES = 4096  # node pushes held for the next forward; past it the oldest go


class RackAggregator:
    def __init__(self, rack: int, *, namespace: str, report_interval_s: float) -> None:
        self.rack = rack
        self.namespace = namespace
        self.report_interval_s = report_interval_s
        self.incarnation = secrets.randbits(62) | 1
        self.lock = threading.Lock()
        self._pushes: list[tuple[bytes, list[bytes]]] = []
        self._inflight: InFlight[None] = InFlight(MAX_INFLIGHT)
        self.received = 0
        self.dropped = 0  # node pushes dropped while the aggregator did not keep up
        self.forwards = 0
        self.forwards_acked = 0
        self.forwards_failed = 0
        self.loop = BackgroundLoop(
            f"kvfold rack {rack} forwarder",
            report_interval_s / FORWARDS_PER_INTERVAL,
            self._forward,
        ).start()

    def ping(self) -> int:
        return self.incarnation

    def node_push(self, report: bytes, envelopes: list[bytes]) -> tuple[str, list[str]]:
        """A node's push, held for the next forward (the aggregator's verdicts are its)."""
        with self.lock:
            self.received += 1
            self._pushes.append((report, envelopes))
            if len(self._pushes) > MAX_HELD_PUSHES:
                del self._pushes[0]
                self.dropped += 1
        return "queued", []

    def _forward(self) -> None:
        with self.lock:
            pushes, self._pushes = self._pushes, []
        if pushes:
            agg = named_actor(AGGREGATOR_NAME, self.namespace)
            if agg is None:
                self.forwards_failed += 1
                return
            reports = [report for report, _ in pushes]
            batches = [b for _, envelopes in pushes for b in envelopes]
            self.forwards += 1
            self._inflight.add(agg.rack_push.remote(reports, batches), None)
            # never long: a slow aggregator must not hold back the next forward
            self._inflight.wait(3 * self.report_interval_s, last_only=True)
        self._inflight.settle(self._acked, self._failed)

    def _acked(self, _answer: Any, _tag: None) -> None:
        self.forwards_acked += 1

    def _failed(self, _error: RayError, _tag: None) -> None:
        self.forwards_failed += 1

    def counts(self) -> dict[str, int]:
        with self.lock:
            return {
                "received": self.received,
                "dropped": self.dropped,
                "forwards": self.forwards,
                "forwards_acked": self.forwards_acked,
                "forwards_failed": self.forwards_failed + self.loop.failures,
            }

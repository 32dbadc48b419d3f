"""RackAggregator: a level between node actors and the cluster aggregator, for fleets
where one actor cannot take a call per node and interval, nor every block event
(docs/scale.md).

Its nodes push to it what they would push to the aggregator (`node_push`: a node
report and its ranks' block-event batches).
- **Reports** go on: twice per `report_interval_s` it sends the reports that came, in
  arrival order, as one `rack_push`. The aggregator takes two calls per rack and
  interval instead of one per node, and a report waits about half an interval on the
  way (more while the aggregator is slow to answer).
- **Block events** stop here: the rack keeps its nodes' part of the cluster block index,
  an index shard (kvfold.aggregator.index_calls_actor: the same feed, op log and
  resynchronisation as the aggregator's). Readers follow every shard's op log as one
  replica (kvfold.aggregator.client.IndexClient), so the aggregator decodes no event, and the
  event rate one actor takes is its rack's, not the fleet's.

It holds nothing that must survive: a rack that restarts loses the reports it held (its
nodes' next reports replace theirs) and its shard, which starts again under a new epoch
(readers take it whole) and fills from its sources' snapshots, as the aggregator's index
does after a restart. What it drops sources by it asks the aggregator for, once per
interval: the view's word on the nodes of its sources alone (`liveness_of`, a few values
per rank; kvfold.blockindex.liveness), never the view, whose every entry changes with
every report.
"""

from __future__ import annotations

import secrets
import threading
from typing import Any

import psutil
import ray
from ray.exceptions import RayError

from kvfold.aggregator.index_calls_actor import IndexCalls
from kvfold.blockindex.feed import IndexFeed
from kvfold.blockindex.index import BlockIndex
from kvfold.blockindex.liveness import Liveness
from kvfold.naming import AGGREGATOR_NAME
from kvfold.ray_actor import BackgroundLoop, InFlight, named_actor

MAX_INFLIGHT = 16
FORWARDS_PER_INTERVAL = 2
MAX_HELD_REPORTS = 4096  # node reports held for the next forward; past it the oldest go


class RackAggregator(IndexCalls):
    def __init__(
        self,
        rack: int,
        rank_to_node: list[int],
        *,
        namespace: str,
        report_interval_s: float,
    ) -> None:
        self.rack = rack
        self.namespace = namespace
        self.report_interval_s = report_interval_s
        self.incarnation = secrets.randbits(62) | 1
        self.lock = threading.Lock()
        self._reports: list[bytes] = []
        self._inflight: InFlight[None] = InFlight(MAX_INFLIGHT)
        self.received = 0
        self.dropped = 0  # node reports dropped while the aggregator did not keep up
        self.forwards = 0
        self.forwards_acked = 0
        self.forwards_failed = 0
        # its nodes' shard of the cluster block index
        self.blocks = IndexFeed(BlockIndex(rank_to_node))
        self.blocks_lock = threading.Lock()
        self.events_refused = 0
        self.events_error: str | None = None
        self._asked: dict[tuple[str, int], tuple[Any, float]] = {}
        self.liveness_failures = 0
        self.loop = BackgroundLoop(
            f"kvfold rack {rack} forwarder",
            report_interval_s / FORWARDS_PER_INTERVAL,
            self._forward,
        ).start()
        self.resync = BackgroundLoop(
            f"kvfold rack {rack} index resync", report_interval_s, self._resync
        ).start()

    def ping(self) -> int:
        return self.incarnation

    @ray.method(concurrency_group="reports")
    def node_push(self, report: bytes, envelopes: list[bytes]) -> tuple[str, list[str]]:
        """A node's push: its report held for the next forward (the aggregator's verdict
        is its own), its batches taken into this rack's index shard now."""
        with self.lock:
            self.received += 1
            self._reports.append(report)
            if len(self._reports) > MAX_HELD_REPORTS:
                del self._reports[0]
                self.dropped += 1
        return "queued", self._ingest_all(envelopes)

    def _forward(self) -> None:
        with self.lock:
            reports, self._reports = self._reports, []
        if reports:
            agg = named_actor(AGGREGATOR_NAME, self.namespace)
            if agg is None:
                self.forwards_failed += 1
                return
            self.forwards += 1
            self._inflight.add(agg.rack_push.remote(reports, []), None)
            # never long: a slow aggregator must not hold back the next forward
            self._inflight.wait(3 * self.report_interval_s, last_only=True)
        self._inflight.settle(self._acked, self._failed)

    def _acked(self, _answer: Any, _tag: None) -> None:
        self.forwards_acked += 1

    def _failed(self, _error: RayError, _tag: None) -> None:
        self.forwards_failed += 1

    def _liveness(self, nodes: set[int]) -> Liveness | None:
        agg = named_actor(AGGREGATOR_NAME, self.namespace)
        if agg is None:
            self.liveness_failures += 1
            return None
        try:
            known: Liveness = ray.get(
                agg.liveness_of.remote(sorted(nodes)), timeout=self.report_interval_s
            )
        except RayError:
            self.liveness_failures += 1
            return None
        return known

    def cpu_seconds(self) -> float:
        """CPU time this process has used, user and system (for the load harness)."""
        t = psutil.Process().cpu_times()
        return float(t.user + t.system)

    def counts(self) -> dict[str, int]:
        with self.lock:
            return {
                "received": self.received,
                "dropped": self.dropped,
                "forwards": self.forwards,
                "forwards_acked": self.forwards_acked,
                "forwards_failed": self.forwards_failed + self.loop.failures,
                "liveness_failures": self.liveness_failures + self.resync.failures,
            }

    def stop(self) -> None:
        self.loop.stop()
        self.resync.stop()


# how a RackAggregator actor is declared: pushes and events each on one thread, in order;
# replicas' reads beside them (the default group, RACK_MAX_CONCURRENCY threads)
RACK_CONCURRENCY_GROUPS = {"reports": 1, "events": 1}
RACK_MAX_CONCURRENCY = 8

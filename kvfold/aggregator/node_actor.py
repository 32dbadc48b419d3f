"""HostKVActor: one per node, pinned to it. The Ray shell over NodeState and the node's
HostTierServer (kvfold.hosttier).

Takes rank reports (msgpack bytes), keeps per-rank freshness, folds the node, serves
the node's host KV tier, and pushes the node's report to the cluster aggregator every
`report_interval_s`, as soon as each of its fresh ranks has reported since the last push
(a round), half an interval after a round's first report at the latest, and at once after
a report its rank marked urgent (a change a scheduler waits to see). Its ranks' block-event
batches (and its host tier's) wait in an outbox and go with the report: one call per
node and interval, however many ranks (docs/scale.md). Pushes go out from one
background loop, so answering ranks never waits on the aggregator.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import deque
from collections.abc import Collection
from typing import Any

import numpy as np
import ray
from ray.exceptions import RayError

from kvfold.aggregator.node_state import NodeState
from kvfold.aggregator.receiver import ACCEPTED, LATE
from kvfold.codec import encode_node_report
from kvfold.hosttier import HostTierServer
from kvfold.hosttier.layout import BlockLayout
from kvfold.kvevents.events import HOST, Event
from kvfold.kvevents.snapshot import Snapshot
from kvfold.naming import AGGREGATOR_NAME, rack_actor_name, rank_actor_name
from kvfold.ray_actor import (
    BackgroundLoop,
    EventPublisher,
    Every,
    InFlight,
    gone_among,
    incarnation_of,
    named_actor,
    silent,
)
from kvfold.stats import HostStats, Window
from kvfold.topology import Topology
from kvfold.view import NodeUtilization, SourceState

VERIFY_TIMEOUT_S = 2.0
MAX_INFLIGHT = 64
MIN_PUSH_GAP_S = 0.005  # coalesce bursts of urgent rank reports into one node report
# a round's first rank report waits at most this many intervals for the node's other ranks
# (docs/scale.md: pushes per interval against the latency it adds)
ROUND_WAIT_INTERVALS = 0.5
MAX_OUTBOX_BATCHES = 2048  # event batches waiting for the next push; past it the oldest
# are dropped (counted): their sources see a gap and resynchronise from a snapshot


class HostKVActor:
    def __init__(
        self,
        node: int,
        rank_to_node: list[int],
        windows: Collection[Window] | None,
        *,
        namespace: str,
        report_interval_s: float,
        stale_after_s: float,
        dead_after_s: float,
        host_num_blocks: int = 0,
        layout: BlockLayout | None = None,
        rack: int | None = None,
    ) -> None:
        self.topology = Topology.from_mapping(rank_to_node)
        self.node = node
        self.namespace = namespace
        self.report_interval_s = report_interval_s
        # where pushes go: its rack's actor (kvfold.aggregator.rack_actor), or the aggregator
        self.push_to = AGGREGATOR_NAME if rack is None else rack_actor_name(rack)
        self.state = NodeState(self.topology, node, windows, stale_after_s, dead_after_s)
        self.host = HostTierServer(host_num_blocks, layout)
        self.incarnation = secrets.randbits(62) | 1
        self.seq = 0
        self.lock = threading.Lock()
        self.pushes_failed = 0
        self.pushes_acked = 0
        self._inflight: InFlight[None] = InFlight(MAX_INFLIGHT)
        self._probe = Every(5 * report_interval_s)
        self.outbox: deque[bytes] = deque()  # block-event batches for the next push
        self.outbox_lock = threading.Lock()
        self.batches_dropped = 0
        self.push_lock = threading.Lock()  # one push at a time (the loop, publish_events)
        self.events = EventPublisher(  # the host tier's, into the outbox
            HOST, node, self.incarnation, namespace, sink=self._queue
        )
        self.loop = BackgroundLoop(
            f"kvfold node {node} pusher", report_interval_s, self._push, MIN_PUSH_GAP_S
        ).start()

    # ------------------------------------------------------------ from ranks

    @ray.method(concurrency_group="reports")
    def report(self, data: bytes, urgent: bool = False) -> str:
        """A rank's report: "accepted", "late", or the reason it was refused (counted).
        `urgent`: push it now, without waiting for the node's other ranks.

        Runs in a one-thread concurrency group, so reports are taken one at a time; the
        few that still arrive out of order are folded as late (docs/decisions.md).
        """
        verdict = self.state.receive(data, time.monotonic, self._verify_rank, self.lock)
        if verdict in (ACCEPTED, LATE):
            with self.lock:
                if urgent or self.state.round_complete(time.monotonic()):
                    self.loop.wake()
                else:  # ranks out of step: what came in waits for the round, not long
                    due = self.state.round_due_s(ROUND_WAIT_INTERVALS * self.report_interval_s)
                    if due is not None:
                        self.loop.wake_at(due)
        return verdict

    def _verify_rank(self, rank: int, incarnation: int) -> bool:
        """Ask the named rank actor itself whether it is in that incarnation."""
        name = rank_actor_name(rank)
        return incarnation_of(name, self.namespace, VERIFY_TIMEOUT_S) == incarnation

    def host_stats(self) -> HostStats | None:
        with self.lock:
            return self.host.stats()

    @ray.method(concurrency_group="data")
    def host_put_many(
        self, layout: BlockLayout, items: list[tuple[Window, bytes, np.ndarray]]
    ) -> list[bool]:
        """Offload blocks (kvfold.hosttier.HostTierServer.put_many)."""
        with self.lock:
            return self.host.put_many(layout, items)

    @ray.method(concurrency_group="data")
    def host_get(
        self, layout: BlockLayout, window: Window, keys: list[bytes]
    ) -> tuple[np.ndarray, list[int]]:
        """Onboard: the bytes of the leading keys the tier holds, packed in one buffer."""
        with self.lock:
            return self.host.get_packed(layout, window, keys)

    # ------------------------------------------------------------ block events

    @ray.method(concurrency_group="events")
    def rank_events(self, data: bytes) -> str:
        """One of its ranks' block-event batches, sent on with the next push. One thread
        takes them, so each rank's batches queue in the order it sent them."""
        return "queued" if self._queue(data) else "dropped"

    def _queue(self, data: bytes) -> bool:
        with self.outbox_lock:
            self.outbox.append(data)
            if len(self.outbox) <= MAX_OUTBOX_BATCHES:
                return True
            self.outbox.popleft()
            self.batches_dropped += 1
            return False

    def _take_outbox(self) -> list[bytes]:
        with self.outbox_lock:
            batches = list(self.outbox)
            self.outbox.clear()
            return batches

    def _host_events(self) -> list[Event]:  # holds self.lock
        journal = self.host.pool.journal
        return [] if journal is None else journal.drain()

    def _drain_host_events(self) -> list[Event]:
        with self.lock:
            return self._host_events()

    def publish_events(self) -> None:
        """Push now, every batch waiting included, and wait for the answer (tests, drivers)."""
        self._push(wait_s=VERIFY_TIMEOUT_S)

    def host_keys(self) -> dict[int, list[bytes]]:
        """Every key the host tier holds, per window group (for checks)."""
        with self.lock:
            return self.host.pool.reusable_keys()

    def block_snapshot(self) -> Snapshot:
        """Every key the host tier holds, per window group, with the event seq it stands at."""
        journal = self.host.pool.journal

        def take() -> tuple[dict[int, list[bytes]], dict[int, Window], int]:
            if journal is None:
                return {}, {}, 0
            keys = self.host.pool.reusable_keys()
            return keys, dict(enumerate(journal.windows)), journal.block_size

        return self.events.snapshot(self.lock, self._host_events, take)

    # ------------------------------------------------------------ queries

    def ping(self) -> int:
        return self.incarnation

    def view(self) -> NodeUtilization:
        with self.lock:
            return self.state.fold(time.monotonic(), self.host.stats())

    def counts(self) -> dict[str, Any]:
        with self.lock:
            return {
                "received": self.state.num_received,
                "accepted": self.state.num_accepted,
                "refused": dict(self.state.refused),
                "pushes": self.seq,
                "pushes_acked": self.pushes_acked,
                "pushes_failed": self.pushes_failed + self.loop.failures,
                "event_batches_dropped": self.batches_dropped,
                "host_refused_layout": self.host.refused_layout,
                "ray_node_id": ray.get_runtime_context().get_node_id(),
            }

    # ------------------------------------------------------------ to the aggregator

    def _push(self, wait_s: float | None = None) -> None:
        with self.push_lock:
            util = self._push_now(3 * self.report_interval_s if wait_s is None else wait_s)
            due = self._probe.due(time.monotonic())
        if due:
            self._mark_gone_ranks(util)

    def _push_now(self, wait_s: float) -> NodeUtilization:
        """The report and the outbox in one call. Batches of a push that fails are lost:
        each of their sources then sees a gap and resynchronises (kvfold.blockindex.feed)."""
        with self.lock:
            self.state.start_round()
            util = self.state.fold(time.monotonic(), self.host.stats())
            self.seq += 1
            data = encode_node_report(
                util, self.incarnation, self.seq, refused=dict(self.state.refused)
            )
        self.events.publish(self._drain_host_events, 0.0)  # into the outbox
        batches = self._take_outbox()
        target = named_actor(self.push_to, self.namespace)  # its rack, or the aggregator
        if target is None:
            self.pushes_failed += 1
            return util
        # wait a little for the answer, never long: a slow or restarting aggregator must
        # not hold back the next push (answers that come later are counted then)
        self._inflight.add(target.node_push.remote(data, batches), None)
        self._inflight.wait(wait_s, last_only=True)
        self._settle()
        return util

    def _settle(self) -> None:
        self._inflight.settle(self._acked, self._failed)

    def _acked(self, _answer: Any, _tag: None) -> None:
        self.pushes_acked += 1

    def _failed(self, _error: RayError, _tag: None) -> None:
        self.pushes_failed += 1

    def _mark_gone_ranks(self, util: NodeUtilization) -> None:
        """Ask Ray about ranks that went silent: a dead actor is marked dead at once."""
        quiet = silent(((r.rank, r.state) for r in util.ranks), SILENT)
        for rank in gone_among(
            {r: rank_actor_name(r) for r in quiet}, self.namespace, self.report_interval_s
        ):
            with self.lock:
                self.state.mark_dead(rank)

    def stop(self) -> None:
        """Stop pushing (after settling the pushes still in flight)."""
        self.loop.stop()
        self._inflight.wait(2.0)
        self._settle()


SILENT = (SourceState.STALE, SourceState.MISSING)

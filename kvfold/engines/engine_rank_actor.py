"""EngineRankActor: one engine data-parallel rank as a kvfold rank. The Ray shell over
EngineSource (the engine's KV events) and its /metrics page (DESIGN §10).

    a reader thread   the engine's ZMQ KV events: a SUB socket kvfold binds on loopback
                      (the engine's PUB connects); on a gap, the engine's replay socket
                      (a DEALER asks from the first missing seq)
    a loop, every     scrape /metrics; report to the node's host-KV actor what the engine
    report interval   publishes (cached, committed and per-iteration counters marked
                      unknown); publish the block events, keyed by content, to the
                      cluster block index

Named like every rank (`rank_actor_name`), so the index's resync, a client's
`held_keys` and liveness probes find it. It reports only while the engine answers its
metrics page: an engine that stops is stale, then dead, as any rank. An engine that
restarts (its sequence numbers start over) is a new incarnation of this rank: its old
entries leave the index. kvfold never imports the engine; it reads what it publishes.
"""

from __future__ import annotations

import secrets
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import zmq

from kvfold.blockindex.events import RANK, Event
from kvfold.blockindex.feed import Snapshot
from kvfold.codec import encode_rank_report
from kvfold.engines.endpoints import EngineEndpoints
from kvfold.engines.engine_source import EngineSource
from kvfold.engines.vllm_metrics import MetricsError, VLLMMetrics, parse_vllm_metrics
from kvfold.engines.vllm_wire import replay_request
from kvfold.naming import node_actor_name
from kvfold.ray_actor import BackgroundLoop, EventPublisher, InFlight, named_actor
from kvfold.stats import UNKNOWABLE, BlockGauges, RankReport, SequenceStatus
from kvfold.topology import Topology

METRICS_TIMEOUT_S = 1.0
REPLAY_TIMEOUT_S = 2.0
POLL_MS = 50
MAX_INFLIGHT = 64


class EngineRankActor:
    def __init__(
        self,
        rank: int,
        rank_to_node: list[int],
        endpoints: EngineEndpoints,
        *,
        namespace: str,
        report_interval_s: float,
    ) -> None:
        self.topology = Topology.from_mapping(rank_to_node)
        self.rank = rank
        self.node = self.topology.node_of(rank)
        self.endpoints = endpoints
        self.namespace = namespace
        self.report_interval_s = report_interval_s
        self.lock = threading.RLock()  # the source, the pending events, the incarnation
        self.source = EngineSource()
        self.pending: list[Event] = []
        self.incarnation = secrets.randbits(62) | 1
        self.events = EventPublisher(RANK, rank, self.incarnation, namespace)
        self.metrics: VLLMMetrics | None = None
        self.metrics_error: str | None = None
        self.metrics_failures = 0
        self.seq = 0
        self.reports = 0
        self._inflight: InFlight[None] = InFlight(MAX_INFLIGHT)
        self._restarts_seen = 0
        self._lose = 0  # live messages to drop on arrival (`lose_next_batches`)
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, endpoints.topic.encode())
        self._sub.setsockopt(zmq.RCVHWM, 100_000)
        self._sub.bind(endpoints.events)  # loopback (EngineEndpoints checks it)
        self._reader = threading.Thread(
            target=self._read, name=f"kvfold engine rank {rank} reader", daemon=True
        )
        self._reader.start()
        self.loop = BackgroundLoop(
            f"kvfold engine rank {rank}", report_interval_s, self._tick
        ).start()

    # ------------------------------------------------------------------ events

    def _read(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(POLL_MS):
                continue
            while True:
                try:
                    frames = self._sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                with self.lock:
                    if self._lose > 0:  # fault injection (tests): lost in transit
                        self._lose -= 1
                        continue
                    self.pending += self.source.take_live(frames, time.monotonic())
                    wanted = self.source.wanted_replay()
                if wanted is not None:
                    self._replay(wanted)

    def _replay(self, start_seq: int) -> None:
        """Ask the engine's replay socket for what was lost, from `start_seq` on."""
        now = time.monotonic
        if self.endpoints.replay is None:
            with self.lock:
                self.pending += self.source.replay_failed(now())
            return
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        answer: list[list[bytes]] = []
        try:
            dealer.connect(self.endpoints.replay)
            dealer.send_multipart(replay_request(start_seq))
            deadline = now() + REPLAY_TIMEOUT_S
            while now() < deadline:
                if not dealer.poll(int(max(0.0, deadline - now()) * 1000)):
                    break
                frames = dealer.recv_multipart()
                answer.append(frames)
                if len(frames) >= 3 and frames[-2] == b"\xff" * 8:
                    break
        finally:
            dealer.close()
        with self.lock:
            ended = bool(answer) and answer[-1][-2:-1] == [b"\xff" * 8]
            if ended:
                self.pending += self.source.take_replay(answer, now())
            else:
                self.pending += self.source.replay_failed(now())

    def _drain(self) -> list[Event]:
        with self.lock:
            out, self.pending = self.pending, []
            return out

    # ------------------------------------------------------------------ reports

    def _tick(self) -> None:
        self._scrape()
        with self.lock:
            restarts = self.source.counts["restarts"]
            if restarts != self._restarts_seen:  # the engine restarted: a new incarnation
                self._restarts_seen = restarts
                self._new_incarnation()
        self.events.publish(self._drain, 0.0)
        if self.metrics is not None and self.metrics_error is None:
            self._report()

    def _new_incarnation(self) -> None:
        """Called under the lock: what the old engine held is gone with it."""
        self.incarnation = secrets.randbits(62) | 1
        self.seq = 0
        self.events = EventPublisher(RANK, self.rank, self.incarnation, self.namespace)

    def _scrape(self) -> None:
        try:
            with urllib.request.urlopen(self.endpoints.metrics, timeout=METRICS_TIMEOUT_S) as r:
                text = r.read(16 * 1024 * 1024).decode("utf-8", "replace")
            found = parse_vllm_metrics(text)
            metrics = found.get(self.endpoints.engine) or (
                next(iter(found.values())) if len(found) == 1 else None
            )
            if metrics is None:
                raise MetricsError(f"no engine {self.endpoints.engine!r} on the page")
            self._notice_restart(metrics)
            self.metrics, self.metrics_error = metrics, None
        except (OSError, urllib.error.URLError, MetricsError, ValueError) as e:
            self.metrics_failures += 1
            self.metrics_error = f"{type(e).__name__}: {e}"[:300]

    def _notice_restart(self, metrics: VLLMMetrics) -> None:
        """A new server process (its start time moved) whose first batch has not come
        yet: the old one's blocks are gone now, not when the new one first stores."""
        old = self.metrics.process_start_time_s if self.metrics is not None else None
        new = metrics.process_start_time_s
        if old is None or new is None or new == old:
            return
        with self.lock:
            if self.source.last_ts < new:  # nothing of the new process applied yet
                self.pending += self.source.restart()

    def _report(self) -> None:
        node = named_actor(node_actor_name(self.node), self.namespace)
        if node is None:
            return
        with self.lock:
            self.seq += 1
            report = self._build(self.seq)
        self._inflight.add(node.report.remote(encode_rank_report(report)), None)
        self._inflight.settle(lambda _a, _t: None, lambda _e, _t: None)
        self.reports += 1

    def _build(self, seq: int) -> RankReport:
        m = self.metrics
        assert m is not None
        total = m.num_gpu_blocks or 0
        used = min(m.num_blocks_used or 0, total)
        statuses = dict.fromkeys(SequenceStatus, 0)
        statuses[SequenceStatus.IN_DECODE] = m.num_requests_running or 0  # holding blocks
        statuses[SequenceStatus.QUEUEING] = m.num_requests_waiting or 0
        gauges = BlockGauges(total, used, 0, m.block_size or self.source.block_size, used)
        return RankReport(
            rank=self.rank,
            incarnation=self.incarnation,
            seq=seq,
            gpu={None: gauges},
            deltas={},
            num_sequences_by_status=statuses,
            unknown=frozenset(UNKNOWABLE),
        )

    # ------------------------------------------------------------------ calls

    def ping(self) -> int:
        return self.incarnation

    def block_snapshot(self) -> Snapshot:
        """The content keys the engine holds now, with the event seq they stand at."""

        def take() -> tuple[dict[int, list[bytes]], dict[int, Any], int]:
            return self.source.held(), dict(self.source.windows), self.source.block_size

        return self.events.snapshot(self.lock, self._drain, take)

    def reusable_keys(self) -> dict[int, list[bytes]]:
        """The content keys the engine holds now, per window group (for checks)."""
        with self.lock:
            return self.source.held()

    def lose_next_batches(self, n: int) -> None:
        """Fault injection for tests and drills: drop the next `n` live messages as if
        lost in transit (the gap is then filled from the engine's replay)."""
        if type(n) is not int or n < 0:
            raise ValueError(f"n must be an int >= 0, got {n!r}")
        with self.lock:
            self._lose = n

    def report_now(self) -> str:
        """Publish what came in since the last interval, and report, now."""
        self._tick()
        return "accepted" if self.metrics_error is None else "no_metrics"

    def info(self) -> dict[str, Any]:
        with self.lock:
            src = self.source
            return {
                "rank": self.rank,
                "node": self.node,
                "incarnation": self.incarnation,
                "kind": self.endpoints.kind,
                "events": self.endpoints.events,
                "metrics": self.endpoints.metrics,
                "expected_seq": src.expected,
                "refused": dict(src.refused),
                "counts": dict(src.counts),
                "blocks_unkeyed": src.num_blocks_unkeyed,
                "blocks_live": len(src.live),
                "out_of_sync_since_s": src.out_of_sync_since_s,
                "metrics_error": self.metrics_error,
                "metrics_failures": self.metrics_failures,
                "reports": self.reports,
                "engine_metrics": None if self.metrics is None else _fields(self.metrics),
            }

    def stop(self) -> None:
        self._stop.set()
        self.loop.stop()
        self._reader.join(timeout=2)
        self._sub.close(linger=0)
        self._ctx.term()


def _fields(m: VLLMMetrics) -> dict[str, Any]:
    return {name: getattr(m, name) for name in m.__slots__}


__all__ = ["EngineRankActor"]

"""EngineRankActor: one engine data-parallel rank as a kvfold rank. The Ray shell over
an EngineIntake (the engine's KV events) and its numbers page (DESIGN §10), for any kind
of engine (kvfold.engines.kinds): vLLM, SGLang, TensorRT-LLM.

    a reader thread   vLLM, SGLang: the engine's ZMQ KV events, a SUB socket kvfold binds
                      on loopback (the engine's PUB connects); on a gap, the engine's
                      replay socket (a DEALER asks from the first missing seq)
                      TensorRT-LLM: POST /kv_cache_events every report interval (each
                      answer drains the engine's queue; no replay: a gap is out of sync)
    a loop, every     scrape the numbers page (/metrics: Prometheus, or TensorRT-LLM's
    report interval   iteration stats); report to the node's host-KV actor what the
                      engine publishes (what it does not marked unknown); publish the
                      block events, keyed by content, to the cluster block index

Named like every rank (`rank_actor_name`), so the index's resync, a client's
`held_keys` and liveness probes find it. It reports only while the engine answers its
numbers page: an engine that stops is stale, then dead, as any rank. An engine that
restarts (its sequence numbers start over) is a new incarnation of this rank: its old
entries leave the index. kvfold never imports the engine; it reads what it publishes.
"""

from __future__ import annotations

import secrets
import urllib.error
import urllib.request
from typing import Any

from kvfold.codec import encode_rank_report
from kvfold.engines.endpoints import EngineEndpoints
from kvfold.engines.engine_intake import EngineIntake
from kvfold.engines.engine_numbers import EngineNumbers
from kvfold.engines.engine_readers import HttpEventsPoller, ZmqReader
from kvfold.engines.kinds import engine_kind
from kvfold.engines.vllm_metrics import MetricsError
from kvfold.kvevents.events import RANK, Event
from kvfold.kvevents.snapshot import Snapshot
from kvfold.naming import node_actor_name
from kvfold.ray_actor import BackgroundLoop, EventPublisher, InFlight, named_actor, node_phase_s
from kvfold.stats import BlockDeltas, BlockGauges, RankReport, SequenceStatus
from kvfold.topology import Topology

METRICS_TIMEOUT_S = 1.0
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
        self.kind = engine_kind(endpoints.kind)
        self.namespace = namespace
        self.report_interval_s = report_interval_s
        self.intake = EngineIntake(self.kind, endpoints)
        self.lock = self.intake.lock  # the source, the pending events, the incarnation
        self.source = self.intake.source
        self.incarnation = secrets.randbits(62) | 1
        self.events = EventPublisher(RANK, rank, self.incarnation, namespace, via_node=self.node)
        self.numbers: EngineNumbers | None = None
        self._unsent: BlockDeltas | None = None  # counted since the last report sent
        self.metrics_error: str | None = None
        self.metrics_failures = 0
        self.seq = 0
        self.reports = 0
        self._inflight: InFlight[None] = InFlight(MAX_INFLIGHT)
        self._restarts_seen = 0
        self.reader: ZmqReader | HttpEventsPoller
        if self.kind.zmq:
            self.reader = ZmqReader(endpoints, self.intake, f"kvfold engine rank {rank} reader")
        else:
            self.reader = HttpEventsPoller(
                endpoints, self.intake, report_interval_s, f"kvfold engine rank {rank} events"
            )
        self.loop = BackgroundLoop(
            f"kvfold engine rank {rank}",
            report_interval_s,
            self._tick,
            phase_s=node_phase_s(self.node, report_interval_s),  # with its node's other ranks
        ).start()

    # ------------------------------------------------------------------ events

    def _drain(self) -> list[Event]:
        return self.intake.drain()

    # ------------------------------------------------------------------ reports

    def _tick(self, urgent: bool = False) -> None:
        self._scrape()
        with self.lock:
            restarts = self.source.counts["restarts"]
            if restarts != self._restarts_seen:  # the engine restarted: a new incarnation
                self._restarts_seen = restarts
                self._new_incarnation()
        self.events.publish(self._drain, 0.0)
        if self.numbers is not None and self.metrics_error is None:
            self._report(urgent)

    def _new_incarnation(self) -> None:
        """Called under the lock: what the old engine held is gone with it."""
        self.incarnation = secrets.randbits(62) | 1
        self.seq = 0
        self.events = EventPublisher(
            RANK, self.rank, self.incarnation, self.namespace, via_node=self.node
        )

    def _scrape(self) -> None:
        try:
            url = self.kind.numbers_url(self.endpoints.metrics)
            with urllib.request.urlopen(url, timeout=METRICS_TIMEOUT_S) as r:
                text = r.read(16 * 1024 * 1024).decode("utf-8", "replace")
            numbers = self.kind.read_numbers(text, self.endpoints, self.numbers)
            self._notice_restart(numbers)
            with self.lock:
                self.numbers, self.metrics_error = numbers, None
                if numbers.deltas is not None:  # summed until a report carries them
                    self._unsent = numbers.deltas + (self._unsent or BlockDeltas())
        except (OSError, urllib.error.URLError, MetricsError, ValueError) as e:
            self.metrics_failures += 1
            self.metrics_error = f"{type(e).__name__}: {e}"[:300]
            return
        if numbers.tokens_per_block and not self.intake.can_take_pages and not self.kind.zmq:
            self.intake.set_tokens_per_block(numbers.tokens_per_block)

    def _notice_restart(self, numbers: EngineNumbers) -> None:
        """A new server process (its start time moved) whose first batch has not come
        yet: the old one's blocks are gone now, not when the new one first stores."""
        old = self.numbers.process_start_time_s if self.numbers is not None else None
        new = numbers.process_start_time_s
        if old is None or new is None or new == old:
            return
        self.intake.restart(new)

    def _report(self, urgent: bool) -> None:
        node = named_actor(node_actor_name(self.node), self.namespace)
        if node is None:
            return
        with self.lock:
            self.seq += 1
            report = self._build(self.seq)
            self._unsent = None
        self._inflight.add(node.report.remote(encode_rank_report(report), urgent), None)
        self._inflight.settle(lambda _a, _t: None, lambda _e, _t: None)
        self.reports += 1

    def _build(self, seq: int) -> RankReport:
        n = self.numbers
        assert n is not None
        total, used = n.num_blocks_total, n.num_blocks_used
        statuses = dict.fromkeys(SequenceStatus, 0)
        statuses[SequenceStatus.IN_DECODE] = n.num_requests_running  # holding blocks
        statuses[SequenceStatus.QUEUEING] = n.num_requests_waiting
        block_size = n.tokens_per_block or self.source.block_size
        gauges = BlockGauges(total, used, n.num_blocks_cached or 0, block_size, used)
        return RankReport(
            rank=self.rank,
            incarnation=self.incarnation,
            seq=seq,
            gpu={None: gauges},
            deltas={} if n.deltas is None else {None: self._unsent or BlockDeltas()},
            num_sequences_by_status=statuses,
            unknown=n.unknown,
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
        """Fault injection for tests and drills: drop the next `n` live messages (pages
        holding events) as if lost in transit (the gap is then filled from the engine's
        replay, where it has one)."""
        self.intake.lose_next(n)

    def report_now(self) -> str:
        """Publish what came in since the last interval, and report, now (pushed on by its
        node at once)."""
        self._tick(urgent=True)
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
                "engine_metrics": None if self.numbers is None else self.numbers.as_dict(),
                **self._reader_info(),
            }

    def _reader_info(self) -> dict[str, Any]:
        r, translator = self.reader, self.intake.translator
        if not isinstance(r, HttpEventsPoller):
            return {}
        return {
            "pages": r.pages,
            "events_error": r.error,
            "events_failures": r.failures,
            "translated": {} if translator is None else dict(translator.counts),
        }

    def stop(self) -> None:
        self.loop.stop()
        self.reader.stop()


__all__ = ["EngineRankActor"]

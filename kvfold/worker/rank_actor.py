"""RankWorker: the Ray shell over one GPU rank's PagedKVCache.

Holds the cache (and, through the `EngineFactory` seam, the engine that drives it),
forwards engine calls to it (kvfold.worker.rank_calls_actor), and pushes a msgpack
report to its node's host-KV actor every `report_interval_s` and, when asked, right
after a change. Reports go out from one background loop, so the engine's calls never
wait on the node's answer (kvfold.worker.report_actor). The rank is also the node
host tier's client: evicted blocks are offloaded to it and prompt misses are
onboarded from it (kvfold.worker.remote_host_actor).
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Mapping
from typing import Any

import ray

from kvfold.hosttier.layout import BlockLayout
from kvfold.kvevents.events import RANK
from kvfold.kvevents.snapshot import Snapshot
from kvfold.naming import node_actor_name
from kvfold.ray_actor import BackgroundLoop, EventPublisher, named_actor, node_phase_s
from kvfold.stats import (
    BlockDeltas,
    BlockGauges,
    RankReport,
    SequenceStatus,
    Window,
    sum_deltas,
)
from kvfold.tickets import TicketBook, TicketLike, as_ticket
from kvfold.topology import Topology
from kvfold.worker.cache import PagedKVCache
from kvfold.worker.config import KVCacheConfig
from kvfold.worker.engine import Engine, EngineFactory
from kvfold.worker.rank_calls_actor import RankCalls
from kvfold.worker.remote_host_actor import HOST_TIMEOUT_S, RemoteHostTier
from kvfold.worker.report_actor import MAX_INFLIGHT_REPORTS, RankReporter
from kvfold.worker.storage_holder import storage_on_cpu

__all__ = [
    "ACK_TIMEOUT_S",
    "HOST_TIMEOUT_S",
    "MAX_INFLIGHT_REPORTS",
    "RankWorker",
    "RemoteHostTier",
    "TicketLike",
    "as_ticket",
]

ACK_TIMEOUT_S = 2.0


class RankWorker(RankCalls):
    """One GPU rank. Built by `launch`, one GPU each; restartable (a new incarnation)."""

    def __init__(
        self,
        rank: int,
        rank_to_node: list[int],
        config: KVCacheConfig | None,
        *,
        namespace: str,
        report_interval_s: float = 0.1,
        host_tier: bool = False,
        engine_factory: EngineFactory | None = None,
    ) -> None:
        self.topology = Topology.from_mapping(rank_to_node)
        self.topology.check_rank(rank)
        self.rank = rank
        self.node = self.topology.node_of(rank)
        self.namespace = namespace
        self.report_interval_s = report_interval_s
        self.incarnation = secrets.randbits(62) | 1
        self.lock = threading.RLock()
        self.cache: PagedKVCache | None = None
        self.engine_factory = engine_factory
        self.engine: Engine | None = None
        self.layout: BlockLayout | None = None
        self.host = RemoteHostTier(self) if host_tier else None
        self._node: Any = None
        self.tickets = TicketBook()  # per controller, the highest ticket taken in
        self._refused_before = 0  # refusals counted by caches this rank has rebound
        self.reports = RankReporter(self.lock, self.node_handle, self._make_report)
        self.events = EventPublisher(RANK, rank, self.incarnation, namespace, via_node=self.node)
        self.urgent = False  # the next report is pushed on at once (kvfold.worker.rank_calls_actor)
        self.loop = BackgroundLoop(
            f"kvfold rank {rank} reporter",
            report_interval_s,
            self._tick,
            phase_s=node_phase_s(self.node, report_interval_s),  # with its node's other ranks
        )
        if config is not None:
            self._bind(config)
        self.loop.start()

    # ------------------------------------------------------------ lifecycle

    def bind(self, config: KVCacheConfig) -> dict[str, Any]:
        """Bind (or rebind, empty) the rank's KV cache, and its engine over it."""
        self._bind(config)
        return self.info()

    def _bind(self, config: KVCacheConfig) -> None:
        """CPU storage is built at its first use, GPU storage now (storage_holder)."""
        with self.lock:
            if self.host is not None and self.cache is not None:
                self.host.settle(self.cache)  # answers for the old cache count there
                self.host.pending.items.clear()  # the rest belong to a cache that is gone
            old = self.cache
            if old is not None:
                self._refused_before += old.num_refused
            self.cache = PagedKVCache(
                config, host_tier=self.host, storage_later=storage_on_cpu(config)
            )
            # a new cache starts its event stream empty: the index forgets whatever this
            # rank held before (an older cache, or an earlier incarnation)
            self.cache.events.cleared()
            self.engine = None if self.engine_factory is None else self.engine_factory(self.cache)
            self.layout = config.block_layout()

    def info(self) -> dict[str, Any]:
        ctx = ray.get_runtime_context()
        return {
            "rank": self.rank,
            "node": self.node,
            "ray_node_id": ctx.get_node_id(),
            "incarnation": self.incarnation,
            "seq": self.reports.seq,
            "device": self._device(),
            "bound": self.cache is not None,
            "reports_sent": self.reports.sent,
            "report_verdicts": dict(self.reports.verdicts),
            "reports_failed": self.reports.failed + self.loop.failures,
            "refused": self._refused_before + (self.cache.num_refused if self.cache else 0),
            "late_tickets": self.tickets.late,
            "event_batches": self.events.seq,
            "event_batches_failed": self.events.failed,
            **self._host_failures(),
        }

    def _device(self) -> str | None:
        """Where the K/V bytes are (or will be: CPU storage not built yet is not built here)."""
        cache = self.cache
        if cache is None:
            return None
        if not cache.storage_holder.built and storage_on_cpu(cache.config):
            return "cpu"
        return str(cache.storage.device)

    def _host_failures(self) -> dict[str, int]:
        link = self.cache.host if self.cache is not None else None
        return {
            "host_fetch_failures": link.fetch_failures if link else 0,
            "host_offload_failures": (link.offload_failures if link else 0)
            + (self.host.offload_failures if self.host else 0),
            "host_offload_refused": self.host.offload_refused if self.host else 0,
        }

    def ping(self) -> int:
        return self.incarnation

    def settle_offloads(self, timeout_s: float = 5.0) -> int:
        """Wait for the host's answers to every offload sent so far; return how many are
        still unanswered (0 when all are counted: stored, refused or failed)."""
        if self.host is None or self.cache is None:
            return 0
        with self.lock:
            self.host.settle(self.cache, timeout_s)
            return len(self.host.pending)

    def stop(self) -> None:
        """Stop reporting (after settling the reports still in flight)."""
        self.loop.stop()
        self.reports.drain(ACK_TIMEOUT_S)

    def node_handle(self) -> Any:
        if self._node is None:
            self._node = named_actor(node_actor_name(self.node), self.namespace)
        return self._node

    # ------------------------------------------------------------ reports

    def _make_report(self, seq: int, carried: Mapping[Window, BlockDeltas]) -> RankReport:
        """Report `seq`: the cache's interval committed (after counting the offloads the
        host has answered) on top of `carried`; gauges and tickets as of now. Called by
        the reporter under `self.lock`."""
        if self.cache is not None:
            if self.host is not None:
                self.host.settle(self.cache)
            deltas = sum_deltas([carried, self.cache.commit_iteration().windows])
            stats = self.cache.stats()
            gpu: dict[Window, BlockGauges] | None = dict(stats.windows)
            statuses = dict(stats.num_sequences_by_status)
            refused = self._refused_before + self.cache.num_refused
        else:
            deltas, gpu = dict(carried), None
            statuses, refused = dict.fromkeys(SequenceStatus, 0), self._refused_before
        return RankReport(
            rank=self.rank,
            incarnation=self.incarnation,
            seq=seq,
            gpu=gpu,
            deltas=deltas,
            num_sequences_by_status=statuses,
            tickets=self.tickets.snapshot(),
            num_refused=refused,
        )

    def report_now(self) -> str:
        """Build and push one report and this rank's block events, waiting for the
        answers (for drivers and tests)."""
        with self.reports.lock:  # events first: the push the report sets off carries them
            self._publish_events(wait_s=ACK_TIMEOUT_S)
            return self.reports.push(wait_s=ACK_TIMEOUT_S, urgent=True)

    def _tick(self) -> None:
        with self.reports.lock:
            with self.lock:
                urgent, self.urgent = self.urgent, False
            # sent before the report that may set off a push; an urgent push waits for them
            self._publish_events(wait_s=self.report_interval_s / 2 if urgent else 0.0)
            self.reports.push(wait_s=3 * self.report_interval_s, urgent=urgent)

    # ------------------------------------------------------------ block events

    def _publish_events(self, wait_s: float) -> None:
        self.events.publish(self._drain_events, wait_s)

    def _drain_events(self) -> list[Any]:
        with self.lock:
            return [] if self.cache is None else self.cache.events.drain()

    def reusable_keys(self) -> dict[int, list[bytes]]:
        """Every key this rank's cache could reuse now, per window group (for checks)."""
        with self.lock:
            return {} if self.cache is None else self.cache.reusable_keys()

    def block_snapshot(self) -> Snapshot:
        """Every key this rank's cache could reuse now, per window group, with the event
        seq it stands at (the cluster block index resynchronises from it)."""

        def take() -> tuple[dict[int, list[bytes]], dict[int, Window], int]:
            cache = self.cache
            if cache is None:
                return {}, {}, 0
            return cache.reusable_keys(), dict(enumerate(cache.windows)), cache.block_size

        return self.events.snapshot(self.lock, self._drain_events, take)

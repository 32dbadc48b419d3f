"""RankWorker: the Ray shell over one GPU rank's PagedKVCache.

Holds the cache (and, through the `EngineFactory` seam, the engine that drives it),
forwards engine calls to it, and pushes a msgpack report to its node's host-KV actor
every `report_interval_s` and, when asked, right after a change. Reports go out from
one background loop, so the engine's calls never wait on the node's answer. The rank
is also the node host tier's client: evicted blocks are offloaded to it and prompt
misses are onboarded from it.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import ray
import torch
from ray.exceptions import RayError

from kvfold.blockindex.events import RANK
from kvfold.blockindex.feed import Snapshot
from kvfold.codec import encode_rank_report
from kvfold.errors import NodeUnavailable
from kvfold.hosttier.packing import unpack_blocks
from kvfold.naming import node_actor_name
from kvfold.ray_actor import BackgroundLoop, EventPublisher, InFlight, named_actor
from kvfold.stats import (
    BlockDeltas,
    IterationStats,
    KVStats,
    RankReport,
    SequenceStatus,
    Window,
    sum_deltas,
)
from kvfold.topology import Topology
from kvfold.worker.cache import PagedKVCache
from kvfold.worker.commitments import Policy, as_policy
from kvfold.worker.config import BlockLayout, KVCacheConfig
from kvfold.worker.engine import Engine, EngineFactory, EngineRequest, StepResult
from kvfold.worker.sequence import SeqId
from kvfold.worker.tickets import Ticket, TicketBook

TicketLike = Ticket | tuple[str, int] | list[Any] | None


def as_ticket(value: TicketLike) -> Ticket | None:
    """A Ticket from itself, None, or a (controller id, number) pair."""
    if value is None or isinstance(value, Ticket):
        return value
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return Ticket(value[0], value[1])
    raise TypeError(f"ticket must be a Ticket or (controller id, number), got {value!r}")


ACK_TIMEOUT_S = 2.0
MAX_INFLIGHT_REPORTS = 64
HOST_TIMEOUT_S = 2.0


class RemoteHostTier:
    """The node's host tier as seen from a rank: the HostTier seam over the node actor.

    Failures raise (NodeUnavailable, Ray's errors, a timeout); the cache's HostLink
    turns each into a miss and counts it (kvfold.worker.host_path).
    """

    def __init__(self, worker: RankWorker) -> None:
        self.worker = worker
        self.offload_failures = 0  # answered with an error after the engine moved on
        self.offload_refused = 0  # the host did not store it (held already, tier off, too big)
        self.pending: InFlight[list[tuple[Window, int]]] = InFlight()  # [(window, nbytes)]

    def _node(self) -> Any:
        node = self.worker.node_handle()
        if node is None:
            raise NodeUnavailable(self.worker.node, "no host-KV actor found")
        return node

    def fetch(self, window: Window, keys: Sequence[bytes]) -> list[np.ndarray]:
        ref = self._node().host_get.remote(self.worker.layout, window, list(keys))
        packed, lengths = ray.get(ref, timeout=HOST_TIMEOUT_S)
        return unpack_blocks(packed, lengths)

    def offload_many(self, items: list[tuple[Window, bytes, np.ndarray]]) -> list[bool] | None:
        # the engine's step never waits on the host's answer: settle() counts it later
        ref = self._node().host_put_many.remote(self.worker.layout, items)
        self.pending.add(ref, [(w, int(p.nbytes)) for w, _, p in items])
        return None

    def settle(self, cache: PagedKVCache, timeout_s: float = 0.0) -> None:
        """Count the offloads the host has answered (waiting up to `timeout_s` for all)."""
        if timeout_s:
            self.pending.wait(timeout_s)

        def stored(answer: list[bool], blocks: list[tuple[Window, int]]) -> None:
            for (window, nbytes), ok in zip(blocks, answer, strict=True):
                if ok:
                    cache.record_offload(window, nbytes)
                else:
                    self.offload_refused += 1

        def failed(_error: RayError, blocks: list[tuple[Window, int]]) -> None:
            self.offload_failures += len(blocks)  # the node died, or refused the layout

        self.pending.settle(stored, failed)


class RankWorker:
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
        self.seq = 0
        self.lock = threading.RLock()
        self.cache: PagedKVCache | None = None
        self.engine_factory = engine_factory
        self.engine: Engine | None = None
        self.layout: BlockLayout | None = None
        self.host = RemoteHostTier(self) if host_tier else None
        self._node: Any = None
        self._unreported: dict[Window, BlockDeltas] = {}
        self.tickets = TicketBook()  # per controller, the highest ticket taken in
        self._refused_before = 0  # refusals counted by caches this rank has rebound
        self.reports_sent = 0  # answered by the node (accepted or refused)
        self.reports_failed = 0  # not answered: node down or timed out
        self.report_verdicts: dict[str, int] = {}
        self._inflight: InFlight[RankReport] = InFlight(MAX_INFLIGHT_REPORTS)
        self._report_lock = threading.Lock()  # one report path at a time
        self.events = EventPublisher(RANK, rank, self.incarnation, namespace)
        self.loop = BackgroundLoop(f"kvfold rank {rank} reporter", report_interval_s, self._tick)
        if config is not None:
            self.bind(config)
        self.loop.start()

    # ------------------------------------------------------------ lifecycle

    def bind(self, config: KVCacheConfig) -> dict[str, Any]:
        """Bind (or rebind, empty) the rank's KV cache, and its engine over it."""
        with self.lock:
            if self.host is not None and self.cache is not None:
                self.host.settle(self.cache)  # answers for the old cache count there
                self.host.pending.items.clear()  # the rest belong to a cache that is gone
            old = self.cache
            if old is not None:
                self._refused_before += old.num_refused
            self.cache = PagedKVCache(config, host_tier=self.host)
            # a new cache starts its event stream empty: the index forgets whatever this
            # rank held before (an older cache, or an earlier incarnation)
            self.cache.events.cleared()
            self.engine = None if self.engine_factory is None else self.engine_factory(self.cache)
            self.layout = config.block_layout()
        return self.info()

    def info(self) -> dict[str, Any]:
        ctx = ray.get_runtime_context()
        return {
            "rank": self.rank,
            "node": self.node,
            "ray_node_id": ctx.get_node_id(),
            "incarnation": self.incarnation,
            "seq": self.seq,
            "device": str(self.cache.storage.device) if self.cache else None,
            "bound": self.cache is not None,
            "reports_sent": self.reports_sent,
            "report_verdicts": dict(self.report_verdicts),
            "reports_failed": self.reports_failed + self.loop.failures,
            "refused": self._refused_before + (self.cache.num_refused if self.cache else 0),
            "late_tickets": self.tickets.late,
            "event_batches": self.events.seq,
            "event_batches_failed": self.events.failed,
            **self._host_failures(),
        }

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
        with self._report_lock:
            self._inflight.wait(ACK_TIMEOUT_S)
            self._settle_reports()

    def node_handle(self) -> Any:
        if self._node is None:
            self._node = named_actor(node_actor_name(self.node), self.namespace)
        return self._node

    # ------------------------------------------------------------ engine calls

    def _cache(self) -> PagedKVCache:
        if self.cache is None:
            raise ValueError(f"rank {self.rank} has no KV cache bound; call bind(config) first")
        return self.cache

    def _changed(self, report: bool) -> None:
        if report:
            self.loop.wake()

    def add_sequence(
        self,
        seq_id: SeqId,
        token_ids: Sequence[int],
        salt: str | None = None,
        report: bool = False,
        *,
        max_new_tokens: int = 0,
        policy: Policy | str = Policy.GUARANTEED_NO_EVICT,
        ticket: TicketLike = None,
    ) -> bool:
        """Place a request: its prompt, the tokens it may generate, what its admission
        promised, and the admitting controller's ticket. False: it would over-commit
        the rank (nothing changed; counted). The ticket is recorded either way."""
        stamp, pol = as_ticket(ticket), as_policy(policy)
        with self.lock:
            ok = self._cache().add_sequence(
                seq_id, token_ids, salt=salt, max_new_tokens=max_new_tokens, policy=pol
            )
            self.tickets.take(stamp)
        self._changed(report)
        return ok

    def append_tokens(self, seq_id: SeqId, token_ids: Sequence[int], report: bool = False) -> bool:
        with self.lock:
            ok = self._cache().append_tokens(seq_id, token_ids)
        self._changed(report)
        return ok

    def set_status(self, seq_id: SeqId, status: int | str, report: bool = False) -> None:
        try:
            s = SequenceStatus[status] if isinstance(status, str) else SequenceStatus(status)
        except (KeyError, ValueError):
            names = [m.name for m in SequenceStatus]
            raise ValueError(
                f"status must be one of {names} (or its value), got {status!r}"
            ) from None
        with self.lock:
            self._cache().set_status(seq_id, s)
        self._changed(report)

    def free_sequence(self, seq_id: SeqId, report: bool = False) -> None:
        with self.lock:
            self._cache().free_sequence(seq_id)
        self._changed(report)

    def block_table(self, seq_id: SeqId, window: Window = None) -> list[int]:
        with self.lock:
            return self._cache().block_table(seq_id, window)

    def stats(self) -> KVStats | None:
        with self.lock:
            return None if self.cache is None else self.cache.stats()

    def trtllm_stats(self) -> dict[str, Any] | None:
        """TensorRT-LLM's kvCacheStats shape (None while no cache is bound)."""
        with self.lock:
            return None if self.cache is None else self.cache.trtllm_stats()

    def cumulative(self) -> IterationStats | None:
        with self.lock:
            return None if self.cache is None else self.cache.cumulative()

    def check_integrity(self) -> None:
        with self.lock:
            self._cache().check_integrity()

    def write_kv(
        self, seq_id: SeqId, layer: int, positions: list[int], k: np.ndarray, v: np.ndarray
    ) -> None:
        with self.lock:
            self._cache().write_kv(
                seq_id, layer, positions, torch.from_numpy(k), torch.from_numpy(v)
            )

    def gather_kv(self, seq_id: SeqId, layer: int) -> tuple[np.ndarray, np.ndarray]:
        with self.lock:
            k, v = self._cache().gather_kv(seq_id, layer)
        return k.cpu().numpy(), v.cpu().numpy()

    def engine_step(
        self,
        admits: list[tuple[Any, ...]],
        decode_tokens: int = 1,
        report: bool = True,
        drain_first: bool = False,
        now_s: float | None = None,
    ) -> StepResult:
        """One step of this rank's engine (kvfold.worker.engine; the simulated one by
        default). Each admit: (seq_id, prompt, max_new_tokens, salt[, policy, ticket]).
        `drain_first`: free everything the engine holds before the step, in the same call
        (a driver that gave the rank's work up; separate calls to this threaded actor
        could run in either order). `now_s`: the step's trace time, for the engine's
        timing (kvfold.workload.timing)."""
        requests = [_engine_request(a) for a in admits]
        with self.lock:
            self._cache()
            if self.engine is None:
                raise ValueError(f"rank {self.rank} has no engine (launch with an engine_factory)")
            if drain_first:
                self.engine.drain()
            result = replace(
                self.engine.step(requests, decode_tokens, now_s), incarnation=self.incarnation
            )
            for req in requests:  # placed or refused: the rank has seen it
                self.tickets.take(req.ticket)
        self._changed(report and bool(result.admitted or result.finished))
        return result

    def engine_drain(self) -> None:
        with self.lock:
            if self.engine is not None:
                self.engine.drain()
        self.loop.wake()

    # ------------------------------------------------------------ reports

    def _build_report(self) -> RankReport:
        with self.lock:
            if self.cache is not None:
                if self.host is not None:
                    self.host.settle(self.cache)
                it = self.cache.commit_iteration()
                self._unreported = sum_deltas([self._unreported, it.windows])
                stats = self.cache.stats()
                gpu = dict(stats.windows)
                statuses = dict(stats.num_sequences_by_status)
                refused = self._refused_before + self.cache.num_refused
            else:
                gpu, statuses = None, dict.fromkeys(SequenceStatus, 0)
                refused = self._refused_before
            self.seq += 1
            report = RankReport(
                rank=self.rank,
                incarnation=self.incarnation,
                seq=self.seq,
                gpu=gpu,
                deltas=self._unreported,
                num_sequences_by_status=statuses,
                tickets=self.tickets.snapshot(),
                num_refused=refused,
            )
            self._unreported = {}
        return report

    def _restore(self, report: RankReport) -> None:
        """A report that certainly did not arrive: carry its deltas into the next one."""
        with self.lock:
            self._unreported = sum_deltas([report.deltas, self._unreported])

    def report_now(self) -> str:
        """Build and push one report and this rank's block events, waiting for the
        answers (for drivers and tests)."""
        with self._report_lock:
            verdict = self._push(wait_s=ACK_TIMEOUT_S)
            self._publish_events(wait_s=ACK_TIMEOUT_S)
            return verdict

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

    def _settle_reports(self) -> dict[Any, str]:
        """Account for reports whose answer has come since the last call (no waiting).

        A report the node never took (its actor died first) gives its deltas back to
        the next report; one it answered is counted by verdict.
        """

        def answered(verdict: str, _report: RankReport) -> None:
            self.reports_sent += 1
            self.report_verdicts[verdict] = self.report_verdicts.get(verdict, 0) + 1

        def lost(_error: RayError, report: RankReport) -> None:
            self._restore(report)
            self.reports_failed += 1

        answers = self._inflight.settle(answered, lost)
        return {r: a if isinstance(a, str) else "node_unavailable" for r, a in answers.items()}

    def _push(self, wait_s: float) -> str:
        """Send one report; wait up to `wait_s` for its answer, else leave it in flight."""
        self._settle_reports()
        if len(self._inflight) >= MAX_INFLIGHT_REPORTS:
            return "backlogged"  # the node is not answering: deltas keep accumulating
        node = self.node_handle()
        report = self._build_report()
        if node is None:
            self._restore(report)
            self.reports_failed += 1
            return "node_unavailable"
        ref = node.report.remote(encode_rank_report(report))
        self._inflight.add(ref, report)
        self._inflight.wait(wait_s, last_only=True)
        return self._settle_reports().get(ref, "in_flight")

    def _tick(self) -> None:
        with self._report_lock:
            self._push(wait_s=3 * self.report_interval_s)
            self._publish_events(wait_s=0.0)


def _engine_request(admit: tuple[Any, ...] | list[Any]) -> EngineRequest:
    if len(admit) == 4:
        return EngineRequest(*admit)
    if len(admit) == 6:
        seq_id, prompt, max_new, salt, policy, ticket = admit
        return EngineRequest(seq_id, prompt, max_new, salt, as_policy(policy), as_ticket(ticket))
    raise ValueError(
        "an admit is (seq_id, prompt, max_new_tokens, salt[, policy, ticket]), "
        f"got {len(admit)} fields"
    )

"""RankWorker: the Ray shell over one GPU rank's PagedKVCache.

Holds the cache, forwards engine calls to it, and pushes a msgpack report to
its node's host-KV actor every `report_interval_s` and, when asked, right after
a change. Reports go out from one reporter thread, so the engine's calls never
wait on the node's answer. The rank is also the node host tier's client:
evicted blocks are offloaded to it and prompt misses are onboarded from it.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import ray
import torch
from ray.exceptions import RayActorError, RayError

from kvfold.aggregator.host_kv import unpack_blocks
from kvfold.codec import encode_rank_report
from kvfold.errors import NodeUnavailable
from kvfold.naming import node_actor_name
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
from kvfold.worker.config import KVCacheConfig
from kvfold.worker.sequence import SeqId
from kvfold.workload.engine import EngineRequest, SimEngine, StepResult

ACK_TIMEOUT_S = 2.0
MAX_INFLIGHT_REPORTS = 64
HOST_TIMEOUT_S = 2.0


class NodeHostTier:
    """The node's host tier as seen from a rank: the HostTier seam over the node actor.

    Failures raise (NodeUnavailable, Ray's errors, a timeout); the cache's HostLink
    turns each into a miss and counts it (kvfold.worker.host_path).
    """

    def __init__(self, worker: RankWorker) -> None:
        self.worker = worker
        self.offload_failures = 0  # answered with an error after the engine moved on
        self.offload_refused = 0  # the host did not store it (held already, tier off, too big)
        self._pending: list[tuple[Any, list[tuple[Window, int]]]] = []  # (ref, [(window, nbytes)])

    def _node(self) -> Any:
        node = self.worker.node_handle()
        if node is None:
            raise NodeUnavailable(self.worker.node, "no host-KV actor found")
        return node

    def fetch(self, window: Window, keys: Sequence[bytes]) -> list[np.ndarray]:
        ref = self._node().host_get.remote(self.worker.geometry, window, list(keys))
        packed, lengths = ray.get(ref, timeout=HOST_TIMEOUT_S)
        return unpack_blocks(packed, lengths)

    def offload_many(self, items: list[tuple[Window, bytes, np.ndarray]]) -> list[bool] | None:
        # the engine's step never waits on the host's answer: settle() counts it later
        ref = self._node().host_put_many.remote(self.worker.geometry, items)
        self._pending.append((ref, [(w, int(p.nbytes)) for w, _, p in items]))
        return None

    def settle(self, cache: PagedKVCache, timeout_s: float = 0.0) -> None:
        """Count the offloads the host has answered (waiting up to `timeout_s` for all)."""
        if not self._pending:
            return
        refs = [p[0] for p in self._pending]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        done = set(ready)
        keep = []
        for ref, blocks in self._pending:
            if ref not in done:
                keep.append((ref, blocks))
                continue
            try:
                stored: list[bool] = ray.get(ref)
            except RayError:  # the node died, or refused the batch (layout): not stored
                self.offload_failures += len(blocks)
                continue
            for (window, nbytes), ok in zip(blocks, stored, strict=True):
                if ok:
                    cache.record_offload(window, nbytes)
                else:
                    self.offload_refused += 1
        self._pending = keep


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
        self.engine: SimEngine | None = None
        self.geometry: tuple[Any, ...] = ()
        self.host = NodeHostTier(self) if host_tier else None
        self._node: Any = None
        self._unreported: dict[Window, BlockDeltas] = {}
        self._added: list[SeqId] = []
        self.reports_sent = 0  # answered by the node (accepted or refused)
        self.reports_failed = 0  # not answered: node down or timed out
        self.report_verdicts: dict[str, int] = {}
        self._inflight: list[tuple[Any, RankReport]] = []
        self._report_lock = threading.Lock()  # one report path at a time
        self._wake = threading.Event()
        self._stop = threading.Event()
        if config is not None:
            self.bind(config)
        self._reporter = threading.Thread(target=self._report_loop, daemon=True)
        self._reporter.start()

    # ------------------------------------------------------------ lifecycle

    def bind(self, config: KVCacheConfig) -> dict[str, Any]:
        """Bind (or rebind, empty) the rank's KV cache."""
        with self.lock:
            self.cache = PagedKVCache(config, host_tier=self.host)
            self.engine = SimEngine(self.cache)
            self.geometry = config.block_geometry()
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
            "reports_failed": self.reports_failed,
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
            return len(self.host._pending)

    def stop(self) -> None:
        """Stop reporting (after settling the reports still in flight)."""
        self._stop.set()
        self._wake.set()
        with self._report_lock:
            if self._inflight:
                ray.wait(
                    [r for r, _ in self._inflight],
                    num_returns=len(self._inflight),
                    timeout=ACK_TIMEOUT_S,
                )
            self._settle_reports()

    def node_handle(self) -> Any:
        if self._node is None:
            try:
                self._node = ray.get_actor(node_actor_name(self.node), namespace=self.namespace)
            except ValueError:
                return None
        return self._node

    # ------------------------------------------------------------ engine calls

    def _cache(self) -> PagedKVCache:
        if self.cache is None:
            raise ValueError(f"rank {self.rank} has no KV cache bound; call bind(config) first")
        return self.cache

    def _changed(self, report: bool) -> None:
        if report:
            self._wake.set()

    def add_sequence(
        self, seq_id: SeqId, token_ids: Sequence[int], salt: str | None = None, report: bool = False
    ) -> bool:
        with self.lock:
            ok = self._cache().add_sequence(seq_id, token_ids, salt=salt)
            if ok:
                self._added.append(seq_id)
        self._changed(report)
        return ok

    def append_tokens(self, seq_id: SeqId, token_ids: Sequence[int], report: bool = False) -> bool:
        with self.lock:
            ok = self._cache().append_tokens(seq_id, token_ids)
        self._changed(report)
        return ok

    def set_status(self, seq_id: SeqId, status: int | str, report: bool = False) -> None:
        s = SequenceStatus[status] if isinstance(status, str) else SequenceStatus(status)
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
        admits: list[tuple[SeqId, np.ndarray, int, str | None]],
        decode_tokens: int = 1,
        report: bool = True,
    ) -> StepResult:
        """One step of the simple engine model (see kvfold.workload.engine)."""
        requests = [EngineRequest(s, p, n, salt) for s, p, n, salt in admits]
        with self.lock:
            self._cache()
            assert self.engine is not None
            result = self.engine.step(requests, decode_tokens)
            self._added.extend(result.admitted)
        self._changed(report and bool(result.admitted or result.finished))
        return result

    def engine_drain(self) -> None:
        with self.lock:
            if self.engine is not None:
                self.engine.drain()
        self._wake.set()

    def measure_host_transfer(
        self, num_blocks: int = 64, repeats: int = 5
    ) -> dict[str, list[float]]:
        """Time offload and onboard of `num_blocks` blocks of this rank's size to its node's
        host tier, and the same bytes as one plain numpy array through Ray's object store
        between the same two actors. Seconds per transfer, one entry per repeat."""
        node = self.node_handle()
        if node is None or self.cache is None:
            raise ValueError(f"rank {self.rank}: needs a bound cache and a reachable node actor")
        window = self.cache.windows[0]
        nbytes = self.cache.storage.block_nbytes(window)
        payload = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
        out: dict[str, list[float]] = {
            "offload": [],
            "onboard": [],
            "plain_put": [],
            "plain_get": [],
        }
        for rep in range(repeats):
            keys = [secrets.token_bytes(32) for _ in range(num_blocks)]
            items = [(window, k, payload) for k in keys]
            t0 = time.perf_counter()
            stored = ray.get(node.host_put_many.remote(self.geometry, items))
            out["offload"].append(time.perf_counter() - t0)
            if not all(stored):
                raise ValueError(f"host tier stored {sum(stored)} of {num_blocks} blocks")
            t0 = time.perf_counter()
            packed, lengths = ray.get(node.host_get.remote(self.geometry, window, keys))
            got = unpack_blocks(packed, lengths)
            out["onboard"].append(time.perf_counter() - t0)
            if len(got) != num_blocks or got[0].tobytes() != payload.tobytes():
                raise ValueError("onboarded bytes differ from offloaded bytes")
            arr = np.tile(payload, num_blocks)
            t0 = time.perf_counter()
            ray.get(node.sink.remote(ray.put(arr)))
            out["plain_put"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            back = ray.get(node.source.remote(arr.nbytes))
            out["plain_get"].append(time.perf_counter() - t0)
            del back, rep
        return out

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
            else:
                gpu, statuses = None, dict.fromkeys(SequenceStatus, 0)
            self.seq += 1
            report = RankReport(
                rank=self.rank,
                incarnation=self.incarnation,
                seq=self.seq,
                gpu=gpu,
                deltas=self._unreported,
                num_sequences_by_status=statuses,
                added_seq_ids=tuple(self._added),
            )
            self._unreported = {}
            self._added = []
        return report

    def _restore(self, report: RankReport) -> None:
        """A report that certainly did not arrive: carry its deltas into the next one."""
        with self.lock:
            self._unreported = sum_deltas([report.deltas, self._unreported])
            self._added = list(report.added_seq_ids) + self._added

    def report_now(self) -> str:
        """Build and push one report, waiting for the node's answer (for drivers and tests)."""
        with self._report_lock:
            return self._push(wait_s=ACK_TIMEOUT_S)

    def _settle_reports(self) -> dict[Any, str]:
        """Account for reports whose answer has come since the last call (no waiting).

        A report the node never took (its actor died first) gives its deltas back to
        the next report; one it answered is counted by verdict. Ray delivers one
        caller's calls to an actor in order, so reports are never folded out of order.
        """
        answers: dict[Any, str] = {}
        if not self._inflight:
            return answers
        refs = [r for r, _ in self._inflight]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        done = set(ready)
        keep = []
        for ref, report in self._inflight:
            if ref not in done:
                keep.append((ref, report))
                continue
            try:
                verdict: str = ray.get(ref)
            except RayActorError:
                self._restore(report)
                self.reports_failed += 1
                answers[ref] = "node_unavailable"
                continue
            self.reports_sent += 1
            self.report_verdicts[verdict] = self.report_verdicts.get(verdict, 0) + 1
            answers[ref] = verdict
        self._inflight = keep
        return answers

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
        self._inflight.append((ref, report))
        ray.wait([ref], timeout=wait_s)
        return self._settle_reports().get(ref, "in_flight")

    def _report_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.report_interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                with self._report_lock:
                    self._push(wait_s=3 * self.report_interval_s)
            except (RayError, ValueError, RuntimeError, OSError) as e:
                self.reports_failed += 1
                print(f"kvfold rank {self.rank}: report failed: {type(e).__name__}: {e}")

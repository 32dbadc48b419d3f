"""HostKVActor: one per node, pinned to it. The Ray shell over NodeState and HostKVPool.

Takes rank reports (msgpack bytes), keeps per-rank freshness, folds the node,
owns the node's host KV tier, and pushes the node's report to the cluster
aggregator every `report_interval_s` and soon after a rank report arrives.
Pushes go out from one thread, so answering ranks never waits on the aggregator.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Collection
from typing import Any

import numpy as np
import ray
from ray.exceptions import RayActorError, RayError

from kvfold.aggregator.client import incarnation_of, is_gone
from kvfold.aggregator.host_kv import HostKVPool
from kvfold.aggregator.node_state import NodeState
from kvfold.aggregator.receiver import ACCEPTED, LATE
from kvfold.codec import encode_node_report
from kvfold.naming import AGGREGATOR_NAME, rank_actor_name
from kvfold.stats import HostStats, Window
from kvfold.topology import Topology
from kvfold.view import NodeUtilization, SourceState

VERIFY_TIMEOUT_S = 2.0
MAX_INFLIGHT = 64
MIN_PUSH_GAP_S = 0.005  # coalesce bursts of rank reports into one node report


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
        host_slot_nbytes: int = 0,
        geometry: tuple[Any, ...] = (),
    ) -> None:
        self.topology = Topology.from_mapping(rank_to_node)
        self.node = node
        self.namespace = namespace
        self.report_interval_s = report_interval_s
        self.state = NodeState(self.topology, node, windows, stale_after_s, dead_after_s)
        self.host = HostKVPool(host_num_blocks, host_slot_nbytes if host_num_blocks else 0)
        self.geometry = tuple(geometry)
        self.host_refused_geometry = 0
        self.incarnation = secrets.randbits(62) | 1
        self.seq = 0
        self.lock = threading.Lock()
        self.pushes_failed = 0
        self.pushes_acked = 0
        self._inflight: list[Any] = []
        self._aggregator: Any = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._last_probe_s = 0.0
        threading.Thread(target=self._push_loop, daemon=True).start()

    # ------------------------------------------------------------ from ranks

    @ray.method(concurrency_group="reports")
    def report(self, data: bytes) -> str:
        """A rank's report: "accepted", "late", or the reason it was refused (counted).

        Runs in a one-thread concurrency group, so reports are taken one at a time; the
        few that still arrive out of order are folded as late (docs/decisions.md).
        """
        verdict = self.state.receive(data, time.monotonic, self._verify_rank, self.lock)
        if verdict in (ACCEPTED, LATE):
            self._wake.set()
        return verdict

    def _verify_rank(self, rank: int, incarnation: int) -> bool:
        """Ask the named rank actor itself whether it is in that incarnation."""
        name = rank_actor_name(rank)
        return incarnation_of(name, self.namespace, VERIFY_TIMEOUT_S) == incarnation

    def _check_geometry(self, geometry: Any) -> bool:
        if self.geometry and tuple(geometry) != self.geometry:
            self.host_refused_geometry += 1
            return False
        return True

    def host_stats(self) -> HostStats | None:
        with self.lock:
            return self._host_stats()

    @ray.method(concurrency_group="data")
    def host_put_many(
        self, geometry: Any, items: list[tuple[Window, bytes, np.ndarray]]
    ) -> list[bool]:
        """Offload blocks. All refused (counted) when the rank's block layout is not the node's."""
        if not self._check_geometry(geometry):
            return [False] * len(items)
        with self.lock:
            return [self.host.put(w, key, payload) for w, key, payload in items]

    @ray.method(concurrency_group="data")
    def host_get(
        self, geometry: Any, window: Window, keys: list[bytes]
    ) -> tuple[np.ndarray, list[int]]:
        """Onboard: the bytes of the leading keys the tier holds, packed in one buffer."""
        if not self._check_geometry(geometry):
            raise ValueError(
                f"node {self.node}: block layout {tuple(geometry)!r} does not match the host "
                f"tier's {self.geometry!r}; refusing to onboard"
            )
        with self.lock:
            return self.host.get_packed(window, keys)

    @ray.method(concurrency_group="data")
    def sink(self, data: np.ndarray) -> int:
        """Receive a plain array (the baseline a rank compares its offload path with)."""
        return int(data.nbytes)

    @ray.method(concurrency_group="data")
    def source(self, nbytes: int) -> np.ndarray:
        """Send a plain array of `nbytes` (the baseline for onboarding)."""
        if not 0 < nbytes <= 1 << 30:
            raise ValueError(f"nbytes must be in (0, 1 GiB], got {nbytes}")
        return np.ones(nbytes, dtype=np.uint8)

    # ------------------------------------------------------------ queries

    def ping(self) -> int:
        return self.incarnation

    def view(self) -> NodeUtilization:
        with self.lock:
            return self.state.fold(time.monotonic(), self._host_stats())

    def counts(self) -> dict[str, Any]:
        with self.lock:
            return {
                "received": self.state.num_received,
                "accepted": self.state.num_accepted,
                "refused": dict(self.state.refused),
                "pushes": self.seq,
                "pushes_acked": self.pushes_acked,
                "pushes_failed": self.pushes_failed,
                "host_refused_geometry": self.host_refused_geometry,
                "ray_node_id": ray.get_runtime_context().get_node_id(),
            }

    def _host_stats(self) -> HostStats | None:
        return self.host.stats() if self.host.enabled else None

    # ------------------------------------------------------------ to the aggregator

    def _aggregator_handle(self) -> Any:
        if self._aggregator is None:
            try:
                self._aggregator = ray.get_actor(AGGREGATOR_NAME, namespace=self.namespace)
            except ValueError:
                return None
        return self._aggregator

    def _push(self) -> None:
        now = time.monotonic()
        with self.lock:
            util = self.state.fold(now, self._host_stats())
            self.seq += 1
            data = encode_node_report(
                util, self.incarnation, self.seq, refused=dict(self.state.refused)
            )
        agg = self._aggregator_handle()
        if agg is None:
            self.pushes_failed += 1
            return
        # wait a little for the answer, never long: a slow or restarting aggregator must
        # not hold back the next push (answers that come later are counted then)
        self._inflight.append(agg.node_report.remote(data))
        ray.wait(self._inflight[-1:], timeout=3 * self.report_interval_s)
        self._settle()
        self._probe_silent_ranks(util, now)

    def _settle(self) -> None:
        if not self._inflight:
            return
        ready, pending = ray.wait(self._inflight, num_returns=len(self._inflight), timeout=0)
        for ref in ready:
            try:
                ray.get(ref)
                self.pushes_acked += 1
            except RayActorError:
                self.pushes_failed += 1
        self._inflight = pending[-MAX_INFLIGHT:]
        self.pushes_failed += max(0, len(pending) - MAX_INFLIGHT)  # given up on

    def _probe_silent_ranks(self, util: NodeUtilization, now: float) -> None:
        """Ask Ray about ranks that went silent: a dead actor is marked dead at once."""
        if now - self._last_probe_s < self.report_interval_s * 5:
            return
        self._last_probe_s = now
        for r in util.ranks:
            if r.state not in (SourceState.STALE, SourceState.MISSING):
                continue
            if is_gone(rank_actor_name(r.rank), self.namespace, self.report_interval_s):
                with self.lock:
                    self.state.mark_dead(r.rank)

    def _push_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.report_interval_s)
            self._wake.clear()
            try:
                self._push()
            except (RayError, ValueError, RuntimeError, OSError) as e:
                self.pushes_failed += 1
                print(f"kvfold node {self.node}: push failed: {type(e).__name__}: {e}")
            time.sleep(MIN_PUSH_GAP_S)

    def stop(self) -> None:
        """Stop pushing (after settling the pushes still in flight)."""
        self._stop.set()
        self._wake.set()
        time.sleep(MIN_PUSH_GAP_S)
        if self._inflight:
            ray.wait(self._inflight, num_returns=len(self._inflight), timeout=2.0)
        self._settle()

"""ClusterAggregator: one named actor. The Ray shell over ClusterState.

Node actors push node reports; readers call `view()` or `wait_for_version()`.
A view is pickled once per version and handed out as bytes, so a query costs
one actor call and no work when nothing changed. A ticker notices freshness
changes (a node going stale) even when no report arrives.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Iterable
from typing import Any

import psutil
import ray
from ray.exceptions import RayError
from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_put

from kvfold.admission.claims import Claim, ClaimDesk, ClaimNote
from kvfold.aggregator.capacity_delta import CapacitySender
from kvfold.aggregator.cluster_state import ClusterState
from kvfold.aggregator.index_calls_actor import IndexCalls
from kvfold.aggregator.receiver import ACCEPTED
from kvfold.aggregator.view_delta import ViewSender
from kvfold.blockindex.feed import IndexFeed
from kvfold.blockindex.index import BlockIndex
from kvfold.blockindex.liveness import Liveness
from kvfold.checks import check_int, is_int
from kvfold.errors import ReportError
from kvfold.naming import AGGREGATOR_NAME, node_actor_name, rack_actor_name
from kvfold.ray_actor import (
    BackgroundLoop,
    Every,
    gone_among,
    incarnation_of,
    silent,
)
from kvfold.stats import Window
from kvfold.tickets import check_controller_id
from kvfold.topology import Topology
from kvfold.view import ClusterView, SourceState

VERIFY_TIMEOUT_S = 2.0  # how long a node actor may take to confirm its incarnation
CARRY_KEY = b"kvfold:carried-counters"  # in Ray's internal KV, per kvfold namespace


class ClusterAggregator(IndexCalls):
    def __init__(
        self,
        rank_to_node: list[int],
        windows: list[Window] | None,
        *,
        namespace: str,
        report_interval_s: float,
        stale_after_s: float,
        dead_after_s: float,
        metrics_host: str = "127.0.0.1",
        metrics_port: int | None = None,
        ray_node_ids: list[str] | None = None,
        verify_sources: bool = True,
        nodes_per_rack: int = 0,
    ) -> None:
        self.topology = Topology.from_mapping(rank_to_node)
        # False only for the load harness (benchmarks/bench_scale.py), whose nodes and
        # ranks are not actors: new incarnations are then taken unasked, and silent
        # sources are left to the clock
        self.verify_sources = verify_sources
        check_int("nodes_per_rack", nodes_per_rack, 0)
        self.nodes_per_rack = nodes_per_rack  # above 0: racks keep the index (index_shards)
        self.namespace = namespace
        self.report_interval_s = report_interval_s
        self.state = ClusterState(
            self.topology,
            windows,
            stale_after_s,
            dead_after_s,
            version_base=time.time_ns() // 1000,  # keeps growing across restarts
        )
        self._carry_counters()
        self.cond = threading.Condition()
        self._bytes_version = -1
        self._bytes = b""
        self.sender = ViewSender()  # views as deltas, per reader (kvfold.aggregator.view_delta)
        self.capacity = CapacitySender()  # their capacity alone, for controllers
        self.claims = ClaimDesk()  # controllers' claims beyond their leases
        self._probe = Every(5 * report_interval_s)
        self.carry_error: str | None = None  # why counters could not be handed on last
        self.ray_node_ids = list(ray_node_ids or [])  # where each kvfold node's actor lives
        self.metrics_address: tuple[str, int] | None = None
        if metrics_port is not None:
            self._serve_metrics(metrics_host, metrics_port)
        # the cluster block index (kvfold.blockindex), fed by the ranks' and host tiers'
        # block events; controllers keep replicas of it (block_index_since)
        self.blocks = IndexFeed(BlockIndex(self.topology.as_list()))
        self.blocks_lock = threading.Lock()
        self.events_refused = 0
        self._asked: dict[tuple[str, int], tuple[Any, float]] = {}  # snapshots asked, when
        self.events_error: str | None = None
        # notices freshness changes (a node going stale) even when no report arrives
        self.loop = BackgroundLoop("kvfold aggregator ticker", report_interval_s / 2, self._tick)
        self.loop.start()
        self.resync = BackgroundLoop("kvfold block index resync", report_interval_s, self._resync)
        self.resync.start()

    # ------------------------------------------------------------ Prometheus

    def _serve_metrics(self, host: str, port: int) -> None:
        from kvfold.metrics import ViewCollector, serve

        def view() -> ClusterView:
            with self.cond:
                return self._refresh()

        def refused() -> dict[tuple[str, str], int]:
            with self.cond:
                self._hand_on()
                return self.state.refused_totals()

        def admission() -> dict[tuple[str, str], int]:
            with self.cond:
                self._hand_on()
                return self.state.admission_totals()

        _, bound_host, bound_port = serve(ViewCollector(view, refused, admission), host, port)
        self.metrics_address = (bound_host, bound_port)

    def metrics_url(self) -> str | None:
        if self.metrics_address is None:
            return None
        host, port = self.metrics_address
        return f"http://{host}:{port}/metrics"

    def report_admission(self, scheduler: str, counts: dict[str, int]) -> None:
        """A scheduler's cumulative decision counts, keyed 'outcome:reason'."""
        parsed: dict[str, int] = {}
        for key, value in list(counts.items())[:256]:
            outcome, _, reason = str(key).partition(":")
            if is_int(value) and value >= 0:
                parsed[f"{outcome[:32]}:{reason[:64]}"] = value
        with self.cond:
            self.state.report_admission(str(scheduler)[:128], parsed)

    def ping(self) -> int:
        return self.state.version

    def describe(self) -> dict[str, Any]:
        """What a driver needs to attach to this deployment (KVFold.attach)."""
        fresh = self.state.freshness
        return {
            "rank_to_node": self.topology.as_list(),
            "report_interval_s": self.report_interval_s,
            "stale_after_s": fresh.stale_after_s,
            "dead_after_s": fresh.dead_after_s,
            "ray_node_ids": list(self.ray_node_ids),
        }

    def index_shards(self) -> list[tuple[str, list[int]]]:
        """Who keeps the cluster block index, and of which nodes: each rack actor its
        rack's (launch(nodes_per_rack=K)), or this aggregator every node's."""
        nodes = list(range(self.topology.num_nodes))
        per = self.nodes_per_rack
        if not per:
            return [(AGGREGATOR_NAME, nodes)]
        racks = range(-(-len(nodes) // per))
        return [(rack_actor_name(k), nodes[k * per : (k + 1) * per]) for k in racks]

    @ray.method(concurrency_group="reports")
    def node_report(self, data: bytes) -> str:
        """A node's report: "accepted", or the reason it was refused (counted).
        One thread takes reports, in the order each node sent them."""
        return self._node_report(data)

    def _node_report(self, data: bytes) -> str:
        verdict = self.state.receive(data, time.monotonic, self._verify_node, self.cond)
        if verdict == ACCEPTED:
            # no fold here: the view is folded when someone reads it (waiters woken now
            # fold it once), so N reports a second cost N decodes, not N cluster folds
            with self.cond:
                self.cond.notify_all()
        return verdict

    @ray.method(concurrency_group="reports")
    def node_push(self, report: bytes, envelopes: list[bytes]) -> tuple[str, list[str]]:
        """A node's report and the block-event batches of its ranks and host tier since
        its last push, in one call (the node actor coalesces them): the report's verdict
        and each batch's. A lost push is a gap in each source's batches, and resyncs."""
        verdict = self._node_report(report)
        return verdict, self._ingest_all(envelopes)

    @ray.method(concurrency_group="reports")
    def rack_push(self, reports: list[bytes], batches: list[bytes]) -> int:
        """A rack's node pushes since its last (kvfold.aggregator.rack_actor), in the
        order they came: how many of the reports were accepted."""
        accepted = sum(self._node_report(r) == ACCEPTED for r in reports)
        self._ingest_all(batches)
        return accepted

    def _verify_node(self, node: int, incarnation: int) -> bool:
        """Ask the named node actor itself whether it is in that incarnation."""
        if not self.verify_sources:
            return True
        return (
            incarnation_of(node_actor_name(node), self.namespace, VERIFY_TIMEOUT_S) == incarnation
        )

    def _liveness(self, nodes: set[int]) -> Liveness:
        return self.liveness_of(nodes)

    def liveness_of(self, nodes: Iterable[int]) -> Liveness:
        """What an index shard (a rack actor) drops its sources by: the view's word on
        `nodes`, a few values per rank (kvfold.blockindex.liveness)."""
        with self.cond:
            return Liveness.of_view(self._refresh(), self.state.incarnations, nodes)

    def _refresh(self) -> ClusterView:
        """The view a reader may see: rebuilt if anything changed, its counters handed on
        first, waiters woken on a new version. Holds cond."""
        before = self.state.version
        view = self.state.view(time.monotonic(), time.time())
        self._hand_on()  # nothing to do unless a counter moved (or the last put failed)
        if view.version != before:
            self.cond.notify_all()
        return view

    def _hand_on(self) -> None:
        """Keep the counters in Ray's GCS before anyone reads them, when they changed: a
        restarted aggregator goes on from there, so it never publishes a counter below
        what this one published (kvfold.aggregator.counter_ledger). Holds cond."""
        carry = self.state.take_carry()
        if carry is None:
            return
        try:
            _internal_kv_put(CARRY_KEY, carry, overwrite=True, namespace=self.namespace)
        except (RayError, ConnectionError) as e:  # the GCS is away: try again next change
            self.state.ledger.carry_failed()
            self.carry_error = str(e)[:300]

    def _view_bytes(self) -> bytes:
        view = self._refresh()
        if view.version != self._bytes_version:
            self._bytes = pickle.dumps(view, protocol=pickle.HIGHEST_PROTOCOL)
            self._bytes_version = view.version
        return self._bytes

    def view(self) -> bytes:
        """The current ClusterView, pickled (our own frozen type, built here)."""
        with self.cond:
            return self._view_bytes()

    def _delta(self, position: tuple[bytes, int]) -> bytes | None:
        self.sender.update(self._refresh())
        epoch, version = position
        return self.sender.since((bytes(epoch), int(version)))

    def view_since(self, position: tuple[bytes, int]) -> bytes | None:
        """What a reader at `position` (the epoch and version of the view it holds) needs
        to hold the current view: the nodes that changed since, the whole view, or None
        when it is current (kvfold.aggregator.view_delta)."""
        with self.cond:
            return self._delta(position)

    def capacity_since(self, position: tuple[bytes, int], controller_id: str) -> bytes | None:
        """What a controller at `position` needs of the current view's capacity: the rows of
        the nodes whose capacity changed since, with its own tickets; None when it is
        current (kvfold.aggregator.capacity_delta)."""
        check_controller_id(controller_id)
        with self.cond:
            self.capacity.update(self._refresh())
            epoch, version = position
            return self.capacity.since((bytes(epoch), int(version)), controller_id)

    def exchange_claims(self, controller_id: str, note: ClaimNote) -> tuple[Claim, ...]:
        """A controller's note to the claim desk, answered with the board
        (kvfold.admission.claims). Bad input changes nothing."""
        check_controller_id(controller_id)
        with self.cond:
            return self.claims.exchange(controller_id, note, time.monotonic())

    def view_and_index_since(
        self, position: tuple[bytes, int], cursor: tuple[int, int]
    ) -> tuple[bytes | None, bytes]:
        """view_since(position) and block_index_since(cursor) in one call: a follower of
        both (the front door's door) pays one Ray call per refresh, not two."""
        return self.view_since(position), self.block_index_since(cursor)

    def version(self) -> int:
        with self.cond:
            return self._refresh().version

    def wait_for_version(
        self, version: int, timeout_s: float, position: tuple[bytes, int] | None = None
    ) -> bytes | None:
        """The first view newer than `version`, whole, or as a delta for a reader at
        `position` (then None also when that reader is current); None after `timeout_s`."""
        deadline = time.monotonic() + max(0.0, float(timeout_s))
        with self.cond:
            while self._refresh().version <= version:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.cond.wait(min(left, self.report_interval_s))
            return self._view_bytes() if position is None else self._delta(position)

    def cpu_seconds(self) -> float:
        """CPU time this process has used, user and system (for the load harness)."""
        t = psutil.Process().cpu_times()
        return float(t.user + t.system)

    def memory_rss_bytes(self) -> int:
        """Resident memory of this process (for soak tests and operators)."""
        return int(psutil.Process().memory_info().rss)

    def counts(self) -> dict[str, Any]:
        with self.cond:
            return {
                "received": self.state.num_accepted + sum(self.state.refused.values()),
                "accepted": self.state.num_accepted,
                "refused": dict(self.state.refused),
                "version": self.state.version,
            }

    def _tick(self) -> None:
        with self.cond:
            view = self._refresh()
        if self.verify_sources and self._probe.due(time.monotonic()):
            self._mark_gone_nodes(view)

    def _carry_counters(self) -> None:
        """A restarted aggregator goes on from the counters its predecessor handed on
        (kept in Ray's GCS, which outlives the actor; `kvfold up` of a new deployment
        clears them)."""
        data = _internal_kv_get(CARRY_KEY, namespace=self.namespace)
        if data:
            try:
                self.state.carry_counters(data)
            except (ValueError, TypeError, KeyError, ReportError) as e:  # never fatal
                print(f"kvfold aggregator: carried counters ignored ({e})")

    def _mark_gone_nodes(self, view: ClusterView) -> None:
        """Silent nodes whose machine Ray reports gone, or whose actor is gone, are dead."""
        quiet = silent(enumerate(view.node_states), (SourceState.STALE, SourceState.MISSING))
        if not quiet:
            return
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")} if self.ray_node_ids else set()
        machine_gone = [
            n for n in quiet if n < len(self.ray_node_ids) and self.ray_node_ids[n] not in alive
        ]
        names = {n: node_actor_name(n) for n in quiet if n not in machine_gone}
        gone = gone_among(names, self.namespace, self.report_interval_s)
        with self.cond:
            for node in machine_gone + gone:
                self.state.mark_dead(node)

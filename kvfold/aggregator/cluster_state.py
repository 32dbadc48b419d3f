"""ClusterState: what the cluster aggregator knows about the nodes. Pure; no Ray.

    receive(bytes, now_s) -> "accepted" | a refusal reason
    view(now_s) -> ClusterView        (rebuilt, with a new version, only when something changed)
    take_carry() -> bytes | None      the counters to hand on before publishing that view

The version grows with every accepted node report and every change of a
node's freshness. It starts from `version_base` (the aggregator passes the
wall clock in microseconds at start), so it keeps growing across restarts.

Every counter in the view (per node, per window, the host tiers', the cluster's) is
the CounterLedger's (kvfold.aggregator.counter_ledger): it goes on across rank,
node-actor and aggregator restarts, never backwards. A node the last aggregator knew
and this one has not heard from yet is MISSING with the counters it had.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import replace

from kvfold.aggregator.counter_ledger import CounterLedger, NodeCounters
from kvfold.aggregator.fold import fold_cluster, fold_node
from kvfold.aggregator.freshness import Verdict
from kvfold.aggregator.receiver import ACCEPTED, ReportReceiver
from kvfold.codec import NodeReport, decode_node_report
from kvfold.stats import IterationStats, Window, host_counters, with_host_counters
from kvfold.topology import Topology
from kvfold.view import ClusterView, NodeUtilization, SourceState


class ClusterState(ReportReceiver[NodeReport]):
    def __init__(
        self,
        topology: Topology,
        windows: Collection[Window] | None,
        stale_after_s: float,
        dead_after_s: float,
        version_base: int = 0,
    ) -> None:
        super().__init__(stale_after_s, dead_after_s)  # self.refused: node reports refused here
        self.topology = topology
        self.windows = None if windows is None else frozenset(windows)
        self.nodes: dict[int, NodeUtilization] = {}  # each with its ledger's counters
        self.incarnations: dict[int, int] = {}
        self.ledger = CounterLedger(topology, self.windows)
        self.version = version_base
        self._changed = True
        self._states: tuple[SourceState, ...] = ()
        self._view: ClusterView | None = None

    def _decode(self, data: bytes) -> NodeReport:
        return decode_node_report(data, self.topology, self.windows)

    def identity(self, report: NodeReport) -> tuple[int, int, int]:
        return report.node, report.incarnation, report.seq

    def refuse(self, reason: str) -> str:
        self.ledger.refuse(reason)
        return super().refuse(reason)

    def _fold(self, report: NodeReport, verdict: Verdict, now_s: float) -> str:
        if not verdict.current:  # late: a node report is a snapshot, a newer one is in
            return verdict.value
        util = report.util
        counts = NodeCounters(util.counters.windows, host_counters(util.host), report.refused)
        total = self.ledger.observe(report.node, report.incarnation, counts)
        self.nodes[report.node] = _with_counters(util, total)
        self.incarnations[report.node] = report.incarnation
        self._changed = True
        return ACCEPTED

    def report_admission(self, scheduler: str, counts: Mapping[str, int]) -> None:
        """A scheduler's cumulative decision counts ('outcome:reason' -> n)."""
        self.ledger.observe_scheduler(scheduler, counts)

    def take_carry(self) -> bytes | None:
        """The ledger to hand on, when it changed since it was last taken: the shell keeps
        it where the next aggregator finds it *before* publishing a view, so a restarted
        aggregator never publishes a counter below what this one published."""
        return self.ledger.take_carry()

    def carried_counters(self) -> bytes:
        """What the next aggregator needs so that counters go on (msgpack)."""
        return self.ledger.carried()

    def carry_counters(self, data: bytes) -> None:
        """Take a previous aggregator's counters (before any node report): each node it
        knew shows them, MISSING, until it reports to this one."""
        self.ledger.carry(data)
        for node, total in self.ledger.totals.items():
            if node not in self.nodes:
                self.nodes[node] = _with_counters(fold_node(self.topology, node, {}, None), total)
        self._changed = True

    def refused_totals(self) -> dict[tuple[str, str], int]:
        """Refused reports by (where, reason): 'aggregator' for node reports refused here
        (and by earlier aggregators), 'node' for rank reports refused at the nodes;
        cumulative, never backwards."""
        return self.ledger.refused()

    def admission_totals(self) -> dict[tuple[str, str], int]:
        """Every scheduler's decisions by (outcome, reason); cumulative, never backwards."""
        return self.ledger.decisions()

    def node_states(self, now_s: float) -> tuple[SourceState, ...]:
        return tuple(self.freshness.state(n, now_s) for n in range(self.topology.num_nodes))

    def view(self, now_s: float, unix_s: float = 0.0) -> ClusterView:
        """The current view; a new version only when a report or a freshness state changed."""
        states = self.node_states(now_s)
        if self._view is not None and not self._changed and states == self._states:
            return self._view
        self.version += 1
        self._changed = False
        self._states = states
        self._view = fold_cluster(
            self.topology,
            self.nodes,
            dict(enumerate(states)),
            version=self.version,
            built_at_s=now_s,
            built_at_unix_s=unix_s,
            node_last_report_s=self.freshness.last_seen(),
        )
        for n in self.nodes:  # keep the stamped views: the next fold copies only what changed
            self.nodes[n] = self._view.nodes[n]
        return self._view


def _with_counters(util: NodeUtilization, total: NodeCounters) -> NodeUtilization:
    """A node's own fold with the ledger's counters: every life's, not only this one's."""
    return replace(
        util,
        counters=IterationStats(dict(total.blocks)),
        host=with_host_counters(util.host, total.host),
    )

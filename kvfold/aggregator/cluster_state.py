"""ClusterState: what the cluster aggregator knows about the nodes. Pure; no Ray.

    receive(bytes, now_s) -> "accepted" | a refusal reason
    view(now_s) -> ClusterView        (rebuilt, with a new version, only when something changed)

The version grows with every accepted node report and every change of a
node's freshness. It starts from `version_base` (the aggregator passes the
wall clock in microseconds at start), so it keeps growing across restarts.
When a node actor restarts (new incarnation), the counters of its previous
life are kept in a base, so the cluster's counters never go backwards.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection

from kvfold.aggregator.fold import fold_cluster
from kvfold.aggregator.freshness import FreshnessTracker, Verdict
from kvfold.codec import NodeReport, decode_node_report
from kvfold.errors import ReportError
from kvfold.stats import IterationStats, Window, sum_deltas
from kvfold.topology import Topology
from kvfold.view import ClusterView, NodeUtilization, SourceState

ACCEPTED = "accepted"
NEW = Verdict.NEW_INCARNATION.value


class ClusterState:
    def __init__(
        self,
        topology: Topology,
        windows: Collection[Window] | None,
        stale_after_s: float,
        dead_after_s: float,
        version_base: int = 0,
    ) -> None:
        self.topology = topology
        self.windows = None if windows is None else frozenset(windows)
        self.freshness = FreshnessTracker(stale_after_s, dead_after_s)
        self.nodes: dict[int, NodeUtilization] = {}
        self.counters_base: dict[int, IterationStats] = {}
        self.refused: Counter[str] = Counter()  # node reports refused here
        self.node_refused: dict[int, dict[str, int]] = {}  # rank reports refused at each node
        self.node_refused_base: Counter[str] = Counter()  # from nodes' earlier incarnations
        self.num_accepted = 0
        self.version = version_base
        self._changed = True
        self._states: tuple[SourceState, ...] = ()
        self._view: ClusterView | None = None

    def receive(
        self, data: bytes, now_s: float, verify: Callable[[int, int], bool] | None = None
    ) -> str:
        """Take one node report: "accepted" or why it was refused (counted).
        verify(node, incarnation) is asked before a new incarnation is believed."""
        report, verdict = self.check(data)
        if report is None:
            return verdict
        if verdict == NEW and verify is not None and not verify(report.node, report.incarnation):
            return self.refuse("identity_mismatch")
        return self.apply(report, now_s)

    def refuse(self, reason: str) -> str:
        self.refused[reason] += 1
        return reason

    def check(self, data: bytes) -> tuple[NodeReport | None, str]:
        try:
            report = decode_node_report(data, self.topology, self.windows)
        except ReportError as e:
            return None, self.refuse(e.reason)
        return report, self.freshness.check(report.node, report.incarnation, report.seq).value

    def apply(self, report: NodeReport, now_s: float) -> str:
        verdict = self.freshness.observe(report.node, report.incarnation, report.seq, now_s)
        if not verdict.accepted:
            return self.refuse(verdict.value)
        if not verdict.current:  # late: a node report is a snapshot, a newer one is in
            self.num_accepted += 1
            return verdict.value
        old = self.nodes.get(report.node)
        if verdict is Verdict.NEW_INCARNATION and old is not None:
            base = self.counters_base.get(report.node)
            maps = [old.counters.windows] + ([base.windows] if base else [])
            self.counters_base[report.node] = IterationStats(sum_deltas(maps))
            self.node_refused_base.update(self.node_refused.get(report.node, {}))
        self.node_refused[report.node] = dict(report.refused)
        self.nodes[report.node] = report.util
        self.num_accepted += 1
        self._changed = True
        return ACCEPTED

    def refused_totals(self) -> dict[tuple[str, str], int]:
        """Refused reports by (where, reason): 'aggregator' for node reports refused here,
        'node' for rank reports refused at the nodes; cumulative, never backwards."""
        nodes: Counter[str] = Counter(self.node_refused_base)
        for counts in self.node_refused.values():
            nodes.update(counts)
        out = {("aggregator", r): c for r, c in self.refused.items()}
        out.update({("node", r): c for r, c in nodes.items()})
        return out

    def mark_dead(self, node: int) -> None:
        self.freshness.mark_dead(node)

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
            node_ages_s={n: self.freshness.age_s(n, now_s) for n in range(self.topology.num_nodes)},
            counters_base=self.counters_base,
        )
        return self._view

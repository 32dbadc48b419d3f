"""ClusterState: what the cluster aggregator knows about the nodes. Pure; no Ray.

    receive(bytes, now_s) -> "accepted" | a refusal reason
    view(now_s) -> ClusterView        (rebuilt, with a new version, only when something changed)

The version grows with every accepted node report and every change of a
node's freshness. It starts from `version_base` (the aggregator passes the
wall clock in microseconds at start), so it keeps growing across restarts.
When a node actor restarts (new incarnation), the counters of its previous
life are kept in a base, so the cluster's counters never go backwards.

`carried_counters()` / `carry_counters(bytes)` hand those counts to the next
aggregator (its Ray shell keeps them in Ray's GCS): each node's base and its last
counters with their incarnation. A node that reports again in that incarnation
supersedes its last counters; one in a new incarnation adds them to its base; one
never heard again (a removed node) keeps them. So a restarted aggregator's counters
go on from where the last one's stood (up to what changed since it last carried: its
shell carries every half report interval in which anything changed).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from typing import Any

import msgpack

from kvfold.aggregator.fold import fold_cluster
from kvfold.aggregator.freshness import Verdict
from kvfold.aggregator.receiver import ACCEPTED, ReportReceiver
from kvfold.codec import NodeReport, decode_node_report
from kvfold.codec.fields import delta_rows, deltas_field
from kvfold.stats import IterationStats, Window, sum_deltas
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
        self.nodes: dict[int, NodeUtilization] = {}
        self.counters_base: dict[int, IterationStats] = {}
        # a previous aggregator's last counters of each node, until the node reports again
        self.carried: dict[int, tuple[int, IterationStats]] = {}
        self.incarnations: dict[int, int] = {}
        self.node_refused: dict[int, dict[str, int]] = {}  # rank reports refused at each node
        self.node_refused_base: Counter[str] = Counter()  # from nodes' earlier incarnations
        self.version = version_base
        self._changed = True
        self._states: tuple[SourceState, ...] = ()
        self._view: ClusterView | None = None

    def _decode(self, data: bytes) -> NodeReport:
        return decode_node_report(data, self.topology, self.windows)

    def identity(self, report: NodeReport) -> tuple[int, int, int]:
        return report.node, report.incarnation, report.seq

    def _fold(self, report: NodeReport, verdict: Verdict, now_s: float) -> str:
        if not verdict.current:  # late: a node report is a snapshot, a newer one is in
            return verdict.value
        old = self.nodes.get(report.node)
        carried = self.carried.pop(report.node, None)
        if carried is not None and carried[0] != report.incarnation:
            self._add_base(report.node, carried[1])  # a life the last aggregator saw end
        if verdict is Verdict.NEW_INCARNATION and old is not None:
            base = self.counters_base.get(report.node)
            maps = [old.counters.windows] + ([base.windows] if base else [])
            self.counters_base[report.node] = IterationStats(sum_deltas(maps))
            self.node_refused_base.update(self.node_refused.get(report.node, {}))
        self.node_refused[report.node] = dict(report.refused)
        self.nodes[report.node] = report.util
        self.incarnations[report.node] = report.incarnation
        self._changed = True
        return ACCEPTED

    def _add_base(self, node: int, counts: IterationStats) -> None:
        base = self.counters_base.get(node)
        maps = [counts.windows] + ([base.windows] if base else [])
        self.counters_base[node] = IterationStats(sum_deltas(maps))

    def carried_counters(self) -> bytes:
        """What the next aggregator needs so that counters go on: per node, its base and
        its last counters with their incarnation (msgpack)."""
        nodes: dict[int, Any] = {}
        for node in set(self.counters_base) | set(self.nodes) | set(self.carried):
            base = self.counters_base.get(node)
            last: tuple[int, IterationStats] | None = self.carried.get(node)
            util = self.nodes.get(node)
            if util is not None and node in self.incarnations:
                last = (self.incarnations[node], util.counters)
            nodes[node] = [
                delta_rows(base.windows) if base else [],
                None if last is None else [last[0], delta_rows(last[1].windows)],
            ]
        out: bytes = msgpack.packb({"v": 1, "nodes": nodes}, use_bin_type=True)
        return out

    def carry_counters(self, data: bytes) -> None:
        """Take a previous aggregator's counters (before any node report)."""
        msg = msgpack.unpackb(data, raw=False, strict_map_key=False)
        if not isinstance(msg, dict) or msg.get("v") != 1:
            raise ValueError("carried counters: unknown format")
        bases: dict[int, IterationStats] = {}
        lasts: dict[int, tuple[int, IterationStats]] = {}
        for node, (base, last) in msg["nodes"].items():  # all of it read before any is used
            self.topology.check_node(node)
            if base:
                bases[node] = IterationStats(deltas_field(base, "base", self.windows))
            if last is not None:
                lasts[node] = (
                    int(last[0]),
                    IterationStats(deltas_field(last[1], "l", self.windows)),
                )
        for node, counts in bases.items():
            self._add_base(node, counts)
        self.carried.update(lasts)
        self._changed = True

    def _bases(self) -> dict[int, IterationStats]:
        if not self.carried:
            return self.counters_base
        out = dict(self.counters_base)
        for node, (_, counts) in self.carried.items():
            base = out.get(node)
            out[node] = IterationStats(
                sum_deltas([counts.windows] + ([base.windows] if base else []))
            )
        return out

    def refused_totals(self) -> dict[tuple[str, str], int]:
        """Refused reports by (where, reason): 'aggregator' for node reports refused here,
        'node' for rank reports refused at the nodes; cumulative, never backwards."""
        nodes: Counter[str] = Counter(self.node_refused_base)
        for counts in self.node_refused.values():
            nodes.update(counts)
        out = {("aggregator", r): c for r, c in self.refused.items()}
        out.update({("node", r): c for r, c in nodes.items()})
        return out

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
            counters_base=self._bases(),
        )
        for n in self.nodes:  # keep the stamped views: the next fold copies only what changed
            self.nodes[n] = self._view.nodes[n]
        return self._view

"""NodeState: what a node's host-KV actor knows about its ranks. Pure; no Ray.

    receive(bytes, now_s) -> "accepted" | a refusal reason   (decode, validate, dedupe)
    fold(now_s, host) -> NodeUtilization                    (fresh ranks only)
    round_complete(now_s) / start_round()                   (when the node pushes)

A node pushes once a round is in: every fresh rank has reported since its last push (or
at its interval, or at once for a report its rank marked urgent: kvfold.aggregator
.node_actor). Ranks report out of step; a push per rank report would make the node's one
call per interval R calls (docs/scale.md).

Refusals are counted by reason and change nothing. Each rank's counters are the
sum of every delta accepted from it, across its incarnations, so they never go
backwards when a rank restarts.
"""

from __future__ import annotations

from collections.abc import Collection

from kvfold.aggregator.fold import RankRecord, fold_node
from kvfold.aggregator.freshness import Verdict
from kvfold.aggregator.receiver import ACCEPTED, ReportReceiver
from kvfold.codec import decode_rank_report
from kvfold.stats import HostStats, IterationStats, RankReport, Window, sum_deltas
from kvfold.topology import Topology
from kvfold.view import NodeUtilization, SourceState


class NodeState(ReportReceiver[RankReport]):
    def __init__(
        self,
        topology: Topology,
        node: int,
        windows: Collection[Window] | None,
        stale_after_s: float,
        dead_after_s: float,
    ) -> None:
        topology.check_node(node)
        super().__init__(stale_after_s, dead_after_s)
        self.topology = topology
        self.node = node
        self.windows = None if windows is None else frozenset(windows)
        self.latest: dict[int, RankReport] = {}
        self.counters: dict[int, IterationStats] = {}
        self.reported: set[int] = set()  # ranks with a report in since the last push
        self.round_started_s = 0.0  # when the first of them came in

    def _decode(self, data: bytes) -> RankReport:
        return decode_rank_report(data, self.topology, self.node, self.windows)

    def identity(self, report: RankReport) -> tuple[int, int, int]:
        return report.rank, report.incarnation, report.seq

    def _fold(self, report: RankReport, verdict: Verdict, now_s: float) -> str:
        if verdict.current:
            self.latest[report.rank] = report
            if not self.reported:
                self.round_started_s = now_s
            self.reported.add(report.rank)
        old = self.counters.get(report.rank)
        self.counters[report.rank] = IterationStats(
            sum_deltas([old.windows, report.deltas]) if old else dict(report.deltas)
        )
        return ACCEPTED if verdict.current else verdict.value

    def round_complete(self, now_s: float) -> bool:
        """Every fresh rank has reported since the last push (and one at least has)."""
        if not self.reported:
            return False
        states = self.rank_states(now_s)
        return all(r in self.reported for r, s in states.items() if s is SourceState.FRESH)

    def round_due_s(self, wait_s: float) -> float | None:
        """When the open round must be pushed at the latest (monotonic s): `wait_s` after
        its first report; None when no report is waiting for a push."""
        return self.round_started_s + wait_s if self.reported else None

    def start_round(self) -> None:
        """A push is being folded: reports from now on count toward the next round."""
        self.reported.clear()

    def rank_states(self, now_s: float) -> dict[int, SourceState]:
        return {r: self.freshness.state(r, now_s) for r in self.topology.ranks_on(self.node)}

    def fold(self, now_s: float, host: HostStats | None) -> NodeUtilization:
        states = self.rank_states(now_s)
        records = {
            r: RankRecord(
                self.latest.get(r),
                states[r],
                self.counters.get(r),
                self.freshness.age_s(r, now_s),
            )
            for r in self.topology.ranks_on(self.node)
        }
        return fold_node(self.topology, self.node, records, host)

"""NodeState: what a node's host-KV actor knows about its ranks. Pure; no Ray.

    receive(bytes, now_s) -> "accepted" | a refusal reason   (decode, validate, dedupe)
    fold(now_s, host) -> NodeUtilization                    (fresh ranks only)

Refusals are counted by reason and change nothing. Each rank's counters are the
sum of every delta accepted from it, across its incarnations, so they never go
backwards when a rank restarts.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Collection

from kvfold.aggregator.fold import fold_node
from kvfold.aggregator.freshness import FreshnessTracker, Verdict
from kvfold.codec import decode_rank_report
from kvfold.errors import ReportError
from kvfold.stats import HostStats, IterationStats, RankReport, Window, sum_deltas
from kvfold.topology import Topology
from kvfold.view import NodeUtilization, SourceState

ACCEPTED = "accepted"
NEW = Verdict.NEW_INCARNATION.value
RECENT_IDS = 256  # recently added sequence ids kept per rank, at most
RECENT_IDS_S = 2.0  # and for at most this long
LATE = Verdict.LATE.value


class NodeState:
    def __init__(
        self,
        topology: Topology,
        node: int,
        windows: Collection[Window] | None,
        stale_after_s: float,
        dead_after_s: float,
    ) -> None:
        topology.check_node(node)
        self.topology = topology
        self.node = node
        self.windows = None if windows is None else frozenset(windows)
        self.freshness = FreshnessTracker(stale_after_s, dead_after_s)
        self.latest: dict[int, RankReport] = {}
        # sequence ids each rank added in the last RECENT_IDS_S, across reports: a scheduler that
        # reads the view less often than ranks report still sees the ids that settle its
        # reservations (bounded in time and count, so memory stays flat)
        self.recent_added: dict[int, deque[tuple[float, str | int]]] = {}
        self.counters: dict[int, IterationStats] = {}
        self.refused: Counter[str] = Counter()
        self.num_accepted = 0

    @property
    def num_received(self) -> int:
        """Every report that arrived: accepted or refused (none is silently lost)."""
        return self.num_accepted + sum(self.refused.values())

    def receive(
        self,
        data: bytes,
        now_s: float,
        verify: Callable[[int, int], bool] | None = None,
    ) -> str:
        """Take one rank report. Returns "accepted" or why it was dropped.

        verify(rank, incarnation), when given, is asked before a rank's report
        starts a new incarnation: False refuses it as `identity_mismatch` (a
        sender claiming to be a rank it is not)."""
        report, verdict = self.check(data)
        if report is None:
            return verdict
        if verdict == NEW and verify is not None and not verify(report.rank, report.incarnation):
            return self.refuse("identity_mismatch")
        return self.apply(report, now_s)

    def refuse(self, reason: str) -> str:
        self.refused[reason] += 1
        return reason

    def check(self, data: bytes) -> tuple[RankReport | None, str]:
        """Decode and classify without changing anything but refusal counts."""
        try:
            report = decode_rank_report(data, self.topology, self.node, self.windows)
        except ReportError as e:
            return None, self.refuse(e.reason)
        return report, self.freshness.check(report.rank, report.incarnation, report.seq).value

    def apply(self, report: RankReport, now_s: float) -> str:
        """Fold a decoded report in (re-checking its order: another may have come first)."""
        verdict = self.freshness.observe(report.rank, report.incarnation, report.seq, now_s)
        if not verdict.accepted:
            return self.refuse(verdict.value)
        if verdict.current:
            self.latest[report.rank] = report
        if report.added_seq_ids:
            recent = self.recent_added.setdefault(report.rank, deque(maxlen=RECENT_IDS))
            recent.extend((now_s, sid) for sid in report.added_seq_ids)
        old = self.counters.get(report.rank)
        self.counters[report.rank] = IterationStats(
            sum_deltas([old.windows, report.deltas]) if old else dict(report.deltas)
        )
        self.num_accepted += 1
        return ACCEPTED if verdict.current else verdict.value

    def mark_dead(self, rank: int) -> None:
        self.freshness.mark_dead(rank)

    def rank_states(self, now_s: float) -> dict[int, SourceState]:
        return {r: self.freshness.state(r, now_s) for r in self.topology.ranks_on(self.node)}

    def fold(self, now_s: float, host: HostStats | None) -> NodeUtilization:
        ranks = self.topology.ranks_on(self.node)
        return fold_node(
            self.topology,
            self.node,
            self.latest,
            host,
            self.rank_states(now_s),
            counters=self.counters,
            ages_s={r: self.freshness.age_s(r, now_s) for r in ranks},
            added_seq_ids=self._recent_ids(now_s),
        )

    def _recent_ids(self, now_s: float) -> dict[int, tuple[str | int, ...]]:
        out = {}
        for rank, recent in self.recent_added.items():
            while recent and recent[0][0] < now_s - RECENT_IDS_S:
                recent.popleft()
            out[rank] = tuple(sid for _, sid in recent)
        return out

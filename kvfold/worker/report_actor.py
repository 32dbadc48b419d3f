"""RankReporter: sends one rank's reports to its node's host-KV actor, over Ray, and
accounts for the answers.

    build    the rank's report for this interval, numbered, with the deltas of every
             report that certainly did not arrive carried into it
    push     send one report; wait up to `wait_s` for its answer, else leave it in flight
    settle   count the answers come by now (no waiting): a report the node answered is
             counted by verdict; one it never took (its actor died first) gives its
             deltas back to the next report

Past MAX_INFLIGHT_REPORTS unanswered the rank stops sending ("backlogged") and its
deltas accumulate. One report path runs at a time (`lock`): the rank's background
loop or a caller's `report_now`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

from ray.exceptions import RayError

from kvfold.codec import encode_rank_report
from kvfold.ray_actor import InFlight
from kvfold.stats import BlockDeltas, RankReport, Window, sum_deltas

MAX_INFLIGHT_REPORTS = 64

ReportMaker = Callable[[int, Mapping[Window, BlockDeltas]], RankReport]
"""(seq, deltas carried from reports that did not arrive) -> the rank's report, its
cache's interval committed into it (called under the rank's lock)."""


class RankReporter:
    def __init__(
        self, rank_lock: threading.RLock, node_handle: Callable[[], Any], make: ReportMaker
    ) -> None:
        self.rank_lock = rank_lock  # the rank's: its cache and `unreported` change under it
        self.node_handle = node_handle
        self.make = make
        self.seq = 0
        self.unreported: dict[Window, BlockDeltas] = {}
        self.sent = 0  # answered by the node (accepted or refused)
        self.failed = 0  # not answered: node down or timed out
        self.verdicts: dict[str, int] = {}
        self.inflight: InFlight[RankReport] = InFlight(MAX_INFLIGHT_REPORTS)
        self.lock = threading.Lock()  # one report path at a time

    def build(self) -> RankReport:
        with self.rank_lock:
            self.seq += 1
            report = self.make(self.seq, self.unreported)
            self.unreported = {}
        return report

    def restore(self, report: RankReport) -> None:
        """A report that certainly did not arrive: carry its deltas into the next one."""
        with self.rank_lock:
            self.unreported = sum_deltas([report.deltas, self.unreported])

    def settle(self) -> dict[Any, str]:
        """Account for reports whose answer has come since the last call (no waiting)."""

        def answered(verdict: str, _report: RankReport) -> None:
            self.sent += 1
            self.verdicts[verdict] = self.verdicts.get(verdict, 0) + 1

        def lost(_error: RayError, report: RankReport) -> None:
            self.restore(report)
            self.failed += 1

        answers = self.inflight.settle(answered, lost)
        return {r: a if isinstance(a, str) else "node_unavailable" for r, a in answers.items()}

    def push(self, wait_s: float, urgent: bool = False) -> str:
        """Send one report; wait up to `wait_s` for its answer, else leave it in flight.
        `urgent`: the node pushes it on at once, not with its other ranks' round."""
        self.settle()
        if len(self.inflight) >= MAX_INFLIGHT_REPORTS:
            return "backlogged"  # the node is not answering: deltas keep accumulating
        node = self.node_handle()
        report = self.build()
        if node is None:
            self.restore(report)
            self.failed += 1
            return "node_unavailable"
        ref = node.report.remote(encode_rank_report(report), urgent)
        self.inflight.add(ref, report)
        self.inflight.wait(wait_s, last_only=True)
        return self.settle().get(ref, "in_flight")

    def drain(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the reports in flight, and count their answers."""
        with self.lock:
            self.inflight.wait(timeout_s)
            self.settle()

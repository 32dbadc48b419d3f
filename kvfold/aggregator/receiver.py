"""ReportReceiver: the intake both NodeState (rank reports) and ClusterState (node
reports) share. Pure; no Ray.

    check(bytes) -> (report, verdict)   decode, validate, classify; counts refusals only
    apply(report, now_s) -> str         observe freshness again (another report may have
                                        come first), then fold it in (`_fold`)
    receive(...)                        check, verify a new incarnation, apply

Every report that arrives ends accepted (or late, folded) or refused with a
counted reason: `num_received == num_accepted + sum(refused)`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Generic, TypeVar

from kvfold.aggregator.freshness import FreshnessTracker, Verdict
from kvfold.errors import ReportError

ACCEPTED = "accepted"
NEW = Verdict.NEW_INCARNATION.value
LATE = Verdict.LATE.value

R = TypeVar("R")


class ReportReceiver(Generic[R]):
    def __init__(self, stale_after_s: float, dead_after_s: float) -> None:
        self.freshness = FreshnessTracker(stale_after_s, dead_after_s)
        self.refused: Counter[str] = Counter()
        self.num_accepted = 0

    # what a subclass says about its reports
    def _decode(self, data: bytes) -> R:
        raise NotImplementedError

    def identity(self, report: R) -> tuple[int, int, int]:
        """(source, incarnation, seq) of a decoded report."""
        raise NotImplementedError

    def _fold(self, report: R, verdict: Verdict, now_s: float) -> str:
        """Fold an accepted (or late) report in; return its verdict string."""
        raise NotImplementedError

    @property
    def num_received(self) -> int:
        """Every report that arrived: accepted or refused (none is silently lost)."""
        return self.num_accepted + sum(self.refused.values())

    def refuse(self, reason: str) -> str:
        self.refused[reason] += 1
        return reason

    def check(self, data: bytes) -> tuple[R | None, str]:
        """Decode and classify without changing anything but refusal counts."""
        try:
            report = self._decode(data)
        except ReportError as e:
            return None, self.refuse(e.reason)
        return report, self.freshness.check(*self.identity(report)).value

    def apply(self, report: R, now_s: float) -> str:
        verdict = self.freshness.observe(*self.identity(report), now_s)
        if not verdict.accepted:
            return self.refuse(verdict.value)
        self.num_accepted += 1
        return self._fold(report, verdict, now_s)

    def receive(
        self,
        data: bytes,
        now_s: float | Callable[[], float],
        verify: Callable[[int, int], bool] | None = None,
        lock: AbstractContextManager[object] | None = None,
    ) -> str:
        """Take one report: "accepted", "late" (counted, snapshot unused) or why it was refused.

        verify(source, incarnation), when given, is asked before a report that starts a new
        incarnation is believed: False refuses it as `identity_mismatch`. With a `lock`,
        state is only touched under it, and verify (which may wait on the network) runs
        outside it; `now_s` may then be a clock read when the report is applied.
        """
        guard = lock if lock is not None else nullcontext()
        with guard:
            report, verdict = self.check(data)
        if report is None:
            return verdict
        source, incarnation, _ = self.identity(report)
        if verdict == NEW and verify is not None and not verify(source, incarnation):
            with guard:
                return self.refuse("identity_mismatch")
        with guard:
            return self.apply(report, now_s() if callable(now_s) else now_s)

    def mark_dead(self, source: int) -> None:
        self.freshness.mark_dead(source)

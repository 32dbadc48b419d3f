"""Freshness of report sources (ranks at a node actor, nodes at the aggregator).

Time is the receiver's monotonic clock, passed in as `now_s`; a sender's clock
is never trusted. Each source reports (incarnation, seq):

    same incarnation, seq > last                   -> ACCEPTED
    same incarnation, a seq skipped over earlier   -> LATE          (overtaken in transit: its
                                                                    counts folded, its older
                                                                    snapshot not used)
    same incarnation, last-32 < seq <= last, seen  -> DUPLICATE     (dropped, counted)
    same incarnation, seq <= last-32               -> OUT_OF_ORDER  (dropped, counted)
    a retired incarnation          -> RETIRED       (late report of an old life: dropped)
    any other incarnation          -> NEW_INCARNATION (old state replaced)

A source is STALE when silent for `stale_after_s`, DEAD after `dead_after_s`
or once told (`mark_dead`), MISSING when never heard from.
"""

from __future__ import annotations

import enum
from collections import Counter, deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from kvfold.checks import check_positive
from kvfold.view import SourceState

RETIRED_KEPT = 16  # old incarnations remembered per source
LATE_WINDOW = 32  # how far behind a report may arrive and still have its counts folded


class Verdict(enum.Enum):
    ACCEPTED = "accepted"
    NEW_INCARNATION = "new_incarnation"
    LATE = "late"
    DUPLICATE = "duplicate"
    OUT_OF_ORDER = "out_of_order"
    RETIRED = "retired_incarnation"

    @property
    def accepted(self) -> bool:
        """Its counts are used (a LATE report's snapshot is not)."""
        return self in (Verdict.ACCEPTED, Verdict.NEW_INCARNATION, Verdict.LATE)

    @property
    def current(self) -> bool:
        """It is the newest word from the source: its snapshot replaces the last one."""
        return self in (Verdict.ACCEPTED, Verdict.NEW_INCARNATION)


@dataclass(slots=True)
class _Source:
    incarnation: int
    last_seq: int
    last_seen_s: float
    told_dead: bool = False
    retired: deque[int] = field(default_factory=lambda: deque(maxlen=RETIRED_KEPT))
    gaps: set[int] = field(default_factory=set)  # seqs skipped over, still welcome late


class FreshnessTracker:
    """Per-source incarnation, last sequence number and receive time."""

    def __init__(self, stale_after_s: float, dead_after_s: float) -> None:
        check_positive("stale_after_s", stale_after_s)
        check_positive("dead_after_s", dead_after_s)
        if dead_after_s < stale_after_s:
            raise ValueError(
                f"dead_after_s ({dead_after_s}) must be >= stale_after_s ({stale_after_s})"
            )
        self.stale_after_s = stale_after_s
        self.dead_after_s = dead_after_s
        self._sources: dict[Hashable, _Source] = {}
        self.dropped: Counter[str] = Counter()  # by Verdict value
        self.num_accepted = 0
        self.num_restarts = 0

    def check(self, source: Hashable, incarnation: int, seq: int) -> Verdict:
        """What `observe` would answer, without changing anything."""
        s = self._sources.get(source)
        if s is None:
            return Verdict.NEW_INCARNATION
        if incarnation != s.incarnation:
            return Verdict.RETIRED if incarnation in s.retired else Verdict.NEW_INCARNATION
        if s.told_dead:
            return Verdict.RETIRED
        if seq in s.gaps:
            return Verdict.LATE
        if seq <= s.last_seq:
            return Verdict.DUPLICATE if seq > s.last_seq - LATE_WINDOW else Verdict.OUT_OF_ORDER
        return Verdict.ACCEPTED

    def observe(self, source: Hashable, incarnation: int, seq: int, now_s: float) -> Verdict:
        """Record a report received at `now_s`; the verdict says whether to use it."""
        verdict = self.check(source, incarnation, seq)
        if not verdict.accepted:
            self.dropped[verdict.value] += 1
            return verdict
        self.num_accepted += 1
        s = self._sources.get(source)
        # the first report heard from an incarnation may have overtaken earlier ones
        first_gaps = set(range(max(1, seq - LATE_WINDOW + 1), seq))
        if s is None:
            self._sources[source] = _Source(incarnation, seq, now_s, gaps=first_gaps)
        elif verdict is Verdict.NEW_INCARNATION:
            s.retired.append(s.incarnation)
            s.incarnation, s.last_seq, s.last_seen_s, s.told_dead = incarnation, seq, now_s, False
            s.gaps = first_gaps
            self.num_restarts += 1
        elif verdict is Verdict.LATE:
            s.gaps.discard(seq)
            s.last_seen_s = now_s  # late, but alive
        else:
            floor = seq - LATE_WINDOW
            s.gaps = {g for g in s.gaps if g > floor}
            s.gaps.update(range(max(s.last_seq + 1, floor + 1), seq))  # may still arrive
            s.last_seq, s.last_seen_s = seq, now_s
        return verdict

    def mark_dead(self, source: Hashable) -> None:
        """Ray says the source's actor (or its machine) is dead: DEAD until a new incarnation
        reports. A source never heard from is recorded dead too, not left missing."""
        s = self._sources.get(source)
        if s is None:
            self._sources[source] = _Source(incarnation=-1, last_seq=0, last_seen_s=float("-inf"))
            s = self._sources[source]
        s.told_dead = True

    def state(self, source: Hashable, now_s: float) -> SourceState:
        s = self._sources.get(source)
        if s is None:
            return SourceState.MISSING
        if s.told_dead:
            return SourceState.DEAD
        age = now_s - s.last_seen_s
        if age >= self.dead_after_s:
            return SourceState.DEAD
        if age >= self.stale_after_s:
            return SourceState.STALE
        return SourceState.FRESH

    def last_seen(self) -> dict[Any, float]:
        """When each source was last heard from (receiver's monotonic clock)."""
        return {k: s.last_seen_s for k, s in self._sources.items()}

    def age_s(self, source: Hashable, now_s: float) -> float:
        s = self._sources.get(source)
        return 0.0 if s is None else max(0.0, now_s - s.last_seen_s)

    def incarnation(self, source: Hashable) -> int | None:
        s = self._sources.get(source)
        return None if s is None else s.incarnation

    def last_seq(self, source: Hashable) -> int | None:
        s = self._sources.get(source)
        return None if s is None else s.last_seq

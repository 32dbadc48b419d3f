"""PhaseClock: how long each step of a start took, for the launch to print."""

from __future__ import annotations

import time


class PhaseClock:
    """Seconds between marks, by the name of the phase each mark ends."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._last = time.monotonic()

    def mark(self, phase: str) -> None:
        now = time.monotonic()
        self.phases[phase] = now - self._last
        self._last = now

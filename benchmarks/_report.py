"""How every benchmark prints: the figure, its target, and the ratio."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_time_s(fn: Callable[[], object], repeats: int = 30, number: int = 1) -> float:
    """Median over `repeats` of the mean time of `number` calls, in seconds."""
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter() - t0) / number)
    return statistics.median(samples)


def percentile(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


def report(name: str, value: float, unit: str, target: float, lower_is_better: bool = True) -> bool:
    """Print one line: figure, target, ratio, verdict. Returns whether it met the target."""
    ratio = value / target if target else float("inf")
    ok = value <= target if lower_is_better else value >= target
    op = "<=" if lower_is_better else ">="
    print(
        f"{name:<58} {value:12.3f} {unit:<5} target {op} {target:g} {unit:<5} "
        f"ratio {ratio:5.2f}  {'OK' if ok else 'MISSED'}"
    )
    return ok


def info(name: str, value: float, unit: str) -> None:
    print(f"{name:<58} {value:12.3f} {unit}")

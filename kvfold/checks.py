"""Argument checks, written once. Each raises naming the argument, the value and what
is allowed (TypeError for the wrong kind, ValueError for a value out of range), and
returns the value so a check reads as an assignment. Python's bools are not numbers here.
"""

from __future__ import annotations

import math
from typing import TypeGuard


def is_int(value: object) -> TypeGuard[int]:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name: str, value: object, minimum: int | None = None) -> int:
    """An int (not a bool), at least `minimum` when given."""
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_index(name: str, value: object, stop: int) -> int:
    """An int in [0, stop)."""
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if not 0 <= value < stop:
        raise ValueError(f"{name} must be in [0, {stop}), got {value}")
    return value


def check_positive(name: str, value: object) -> float:
    """A finite number > 0 (int or float, not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return value

"""The argument checks: the wrong kind is a TypeError, a value out of range a ValueError,
each naming the argument and the value; bools are not numbers."""

from __future__ import annotations

import pytest

from kvfold.checks import check_bool, check_index, check_int, check_positive


def test_checks_name_the_argument_and_the_value() -> None:
    assert check_int("n", 3, 1) == 3 and check_index("i", 0, 1) == 0
    assert check_positive("t_s", 2) == 2.0 and check_bool("flag", False) is False
    with pytest.raises(TypeError, match=r"n must be an int, got True \(bool\)"):
        check_int("n", True)
    with pytest.raises(ValueError, match="n must be >= 1, got 0"):
        check_int("n", 0, 1)
    with pytest.raises(ValueError, match=r"i must be in \[0, 4\), got 4"):
        check_index("i", 4, 4)
    with pytest.raises(TypeError, match="t_s must be a number, got '1'"):
        check_positive("t_s", "1")
    for bad in (0, -1.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="t_s must be a finite number > 0"):
            check_positive("t_s", bad)
    with pytest.raises(TypeError, match="flag must be a bool, got 1"):
        check_bool("flag", 1)

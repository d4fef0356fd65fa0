"""Checks of numbers a user passes in, shared by the argument checks of the package (torch-free).

Python's bool is a subclass of int, so `isinstance(True, int)` holds; a count or a length given as True is a
mistake these checks refuse.
"""

from __future__ import annotations

import math


def is_int(value) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_finite_number(value) -> bool:
    """An int (not a bool) or a float, finite."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_lower_bound(lower_bound, *, name: str) -> float:
    """The one rule for a bounded gate's lower bound: a finite number < 0. Returns it as a float."""
    if isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float)):
        raise ValueError(f"{name}: lower_bound must be a finite number < 0, got {lower_bound!r}")
    if not math.isfinite(lower_bound) or lower_bound >= 0:
        raise ValueError(f"{name}: lower_bound must be a finite number < 0, got {lower_bound!r}")
    return float(lower_bound)

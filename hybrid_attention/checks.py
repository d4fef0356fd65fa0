"""Type checks of numbers a user passes in, shared by the argument checks of the package.

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

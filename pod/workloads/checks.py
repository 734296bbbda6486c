"""The one input check of ``pod.workloads``: numbers that must be integers or
lie in a range, with one message shape ("<what> must be ..., got <value>")."""

from __future__ import annotations

import math
import numbers

__all__ = ["check_int", "check_number"]


def check_int(value: object, what: str, minimum: int = 1) -> int:
    """``value`` as an int, if it is an integer (not a bool) >= ``minimum``.

    Raises:
        ValueError: "<what> must be a positive integer, got <value>" (minimum 1)
            or "<what> must be an integer >= <minimum>, got <value>".
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        need = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{what} must be {need}, got {value!r}")
    return int(value)


def check_number(value: object, what: str, *, low: float | None = None,
                 high: float | None = None, low_open: bool = False,
                 high_open: bool = False) -> float:
    """``value`` as a float, if it is a finite number (not a bool) in the range.

    Args:
        value: the value to check.
        what: how the message names it.
        low, high: bounds (None: unbounded).
        low_open, high_open: exclude the bound itself.

    Raises:
        ValueError: "<what> must be a number in [low, high), got <value>" (the
            range as given).
    """
    ok = (not isinstance(value, bool) and isinstance(value, numbers.Real)
          and math.isfinite(float(value))
          and (low is None or (value > low if low_open else value >= low))
          and (high is None or (value < high if high_open else value <= high)))
    if not ok:
        if low is not None and high is not None:
            need = f"a number in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        elif low is not None:
            need = f"a number {'>' if low_open else '>='} {low:g}"
        elif high is not None:
            need = f"a number {'<' if high_open else '<='} {high:g}"
        else:
            need = "a finite number"
        raise ValueError(f"{what} must be {need}, got {value!r}")
    return float(value)

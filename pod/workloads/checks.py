"""The input checks of ``pod.workloads``: numbers that must be integers or lie in
a range, with one message shape ("<what> must be ..., got <value>"); token ids
inside a vocabulary; and the error for a model that does not fit its data."""

from __future__ import annotations

import math
import numbers

import numpy as np

__all__ = ["check_int", "check_number", "check_token_ids", "short_repr", "DataMismatchError",
           "TokenIdError"]


class DataMismatchError(ValueError):
    """A model cannot take a dataset: its input shape, its classes or its labels
    per example differ from what the model takes and predicts."""


class TokenIdError(DataMismatchError):
    """Token ids outside an embedding's vocabulary.

    Attributes:
        vocabulary: the embedding's size V (ids must be in [0, V)).
        low, high: the smallest and largest id found.
    """

    def __init__(self, message: str, vocabulary: int, low: int, high: int) -> None:
        super().__init__(message)
        self.vocabulary, self.low, self.high = vocabulary, low, high


def check_token_ids(x: np.ndarray, vocabulary: int, what: str) -> np.ndarray:
    """``x`` (any shape) as int64 token ids, if every one is a whole number in
    [0, vocabulary).

    Raises:
        DataMismatchError: fractional values ("<what>: ... integer token ids").
        TokenIdError: an id outside [0, vocabulary), naming the range found.
    """
    if x.dtype.kind not in "iu" and not np.all(np.floor(x) == x):
        raise DataMismatchError(f"{what}: inputs must be integer token ids, got dtype {x.dtype} "
                                "with fractional values")
    ids = x.astype(np.int64, copy=False)
    if ids.size:
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocabulary:
            raise TokenIdError(f"{what}: token ids must be in [0, {vocabulary}) (the vocabulary), "
                               f"got range [{low}, {high}]", vocabulary, low, high)
    return ids


def short_repr(value: object, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters (a huge list given as a size is
    quoted by its start)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def check_int(value: object, what: str, minimum: int = 1, maximum: int | None = None) -> int:
    """``value`` as an int, if it is an integer (not a bool) >= ``minimum`` (and
    <= ``maximum`` when given).

    Raises:
        ValueError: "<what> must be a positive integer, got <value>" (minimum 1)
            or "<what> must be an integer >= <minimum>, got <value>"; "<what> must
            be at most <maximum>, got <value>".
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        need = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{what} must be {need}, got {short_repr(value)}")
    if maximum is not None and int(value) > maximum:
        raise ValueError(f"{what} must be at most {maximum:,}, got {int(value):,}")
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
    # numbers.Real defines < and <= only: "value > low" is written "not value <= low"
    # (the same for a finite value)
    ok = (not isinstance(value, bool) and isinstance(value, numbers.Real)
          and math.isfinite(float(value))
          and (low is None or (not value <= low if low_open else not value < low))
          and (high is None or (value < high if high_open else value <= high)))
    if not ok:
        if low is not None and high is not None:
            need = (f"a number in {'(' if low_open else '['}{low:g}, "
                    f"{high:g}{')' if high_open else ']'}")
        elif low is not None:
            need = f"a number {'>' if low_open else '>='} {low:g}"
        elif high is not None:
            need = f"a number {'<' if high_open else '<='} {high:g}"
        else:
            need = "a finite number"
        raise ValueError(f"{what} must be {need}, got {short_repr(value)}")
    assert isinstance(value, numbers.Real)  # ok says so
    return float(value)

"""Errors raised by the chip model.

Every error is a `ChipError`, so callers (the pod, the CLI) can catch the whole
family in one place and print a single clear line. Messages name the value that
was received and what is allowed.
"""

from __future__ import annotations

_GIB = float(2**30)


class ChipError(Exception):
    """Base class of every error raised by `chip`."""


class ChipSpecError(ChipError, ValueError):
    """A chip specification is invalid or unknown (e.g. an unknown preset name)."""


class PrecisionError(ChipError, ValueError):
    """A precision mode is unknown, or the chip's MXU cannot run it (int8 on v2 / v3)."""


class HBMOutOfMemoryError(ChipError):
    """An HBM allocation does not fit in what is left of the capacity.

    Attributes:
        tag: Name of the allocation that did not fit (e.g. "activations").
        requested_bytes: Size asked for, bytes.
        free_bytes: Bytes that were available for it, bytes.
        capacity_bytes: Total HBM capacity of the budget, bytes.
        name: Name of the HBM's owner (e.g. "chip0/core1"), or None.
    """

    def __init__(
        self,
        tag: str,
        requested_bytes: int,
        free_bytes: int,
        capacity_bytes: int,
        name: str | None = None,
    ) -> None:
        self.tag = tag
        self.requested_bytes = int(requested_bytes)
        self.free_bytes = int(free_bytes)
        self.capacity_bytes = int(capacity_bytes)
        self.name = name
        where = f" on {name}" if name else ""
        super().__init__(
            f"HBM out of memory{where}: {tag!r} needs "
            f"{self.requested_bytes / _GIB:.2f} GiB but only "
            f"{self.free_bytes / _GIB:.2f} GiB of "
            f"{self.capacity_bytes / _GIB:.2f} GiB is free"
        )

    def __reduce__(self):
        # Keep the error picklable (Ray sends exceptions between processes).
        return (
            type(self),
            (self.tag, self.requested_bytes, self.free_bytes, self.capacity_bytes, self.name),
        )

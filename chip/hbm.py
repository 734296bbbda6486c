"""The HBM budget of one TensorCore: capacity, named allocations, peak use.

Like SimPy's `Container`: a capacity, put (allocate) and get (free), and a
clear error when something does not fit. It holds no data, only sizes.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from types import MappingProxyType

from chip.errors import HBMOutOfMemoryError


def _nonneg_int(what: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{what} must be an integer >= 0, got {value!r}")
    return int(value)


class HBM:
    """HBM capacity budget with named allocations.

    Args:
        capacity_bytes: Capacity, bytes (int >= 0).
        name: Owner shown in error messages, e.g. "chip0/core1".

    Raises:
        ValueError: if capacity_bytes is not an int >= 0 (here), or an allocation
            size is negative or not an int (`allocate`).
        HBMOutOfMemoryError: from `allocate`, when the allocation does not fit.
        KeyError: from `free`, for a tag that is not allocated.
    """

    def __init__(self, capacity_bytes: int, name: str = "core0") -> None:
        self._capacity_bytes = _nonneg_int("capacity_bytes", capacity_bytes)
        self.name = name
        self._allocations: dict[str, int] = {}
        self._used_bytes = 0
        self._peak_bytes = 0

    def allocate(self, tag: str, nbytes: int) -> None:
        """Reserves `nbytes` under `tag`; an existing tag is replaced (resized).

        Args:
            tag: Name of the allocation, e.g. "params" or "activations".
            nbytes: Size, bytes (int >= 0).

        Raises:
            ValueError: if nbytes is negative or not an integer.
            HBMOutOfMemoryError: if it does not fit; the budget is then unchanged.
        """
        nbytes = _nonneg_int(f"HBM allocation {tag!r} size in bytes", nbytes)
        old = self._allocations.get(tag, 0)
        available = self._capacity_bytes - self._used_bytes + old
        if nbytes > available:
            raise HBMOutOfMemoryError(tag, nbytes, available, self._capacity_bytes, self.name)
        self._allocations[tag] = nbytes
        self._used_bytes += nbytes - old
        if self._used_bytes > self._peak_bytes:
            self._peak_bytes = self._used_bytes

    def free(self, tag: str) -> int:
        """Releases the allocation `tag`.

        Args:
            tag: Name given to `allocate`.

        Returns:
            The bytes released.

        Raises:
            KeyError: if `tag` is not allocated (the message lists the tags).
        """
        try:
            nbytes = self._allocations.pop(tag)
        except KeyError:
            raise KeyError(
                f"no HBM allocation {tag!r} on {self.name}; allocated: {sorted(self._allocations)}"
            ) from None
        self._used_bytes -= nbytes
        return nbytes

    def reset_peak(self) -> None:
        """Sets `peak_bytes` to the current `used_bytes` (e.g. at the start of a step)."""
        self._peak_bytes = self._used_bytes

    @property
    def capacity_bytes(self) -> int:
        """Capacity, bytes."""
        return self._capacity_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes currently allocated."""
        return self._used_bytes

    @property
    def free_bytes(self) -> int:
        """Bytes still available."""
        return self._capacity_bytes - self._used_bytes

    @property
    def peak_bytes(self) -> int:
        """Largest `used_bytes` seen since creation or the last `reset_peak`."""
        return self._peak_bytes

    @property
    def allocations(self) -> Mapping[str, int]:
        """Read-only view tag -> bytes of the current allocations."""
        return MappingProxyType(self._allocations)

    def __repr__(self) -> str:
        return (
            f"HBM(name={self.name!r}, used_bytes={self._used_bytes}, "
            f"capacity_bytes={self._capacity_bytes})"
        )

"""One direction of an inter-chip interconnect (ICI) link."""

from __future__ import annotations

import math
from dataclasses import dataclass

from interconnect.errors import LinkSpecError

__all__ = ["LinkSpec"]


@dataclass(frozen=True)
class LinkSpec:
    """Bandwidth and latency of one directed ICI link.

    A bidirectional physical link is two ``LinkSpec`` directions, each with
    this bandwidth; published "bidirectional" figures are twice this value.
    Typical values (``../shared/reference/tpu-specs.md``, [SB]): v4
    4.5e10 B/s, v5p 9e10 B/s one way per link; about 1 us per hop.

    Attributes:
        bandwidth_bytes_per_s: bytes per second one way, > 0 and finite.
        latency_s: seconds per hop a message pays on top of its transfer
            time, >= 0 and finite (default 1e-6, [SB]).

    Raises:
        LinkSpecError: a value that is not a finite number in its range; the
            message quotes it.
    """

    bandwidth_bytes_per_s: float
    latency_s: float = 1e-6

    def __post_init__(self) -> None:
        bandwidth = _as_float("bandwidth_bytes_per_s", self.bandwidth_bytes_per_s)
        latency = _as_float("latency_s", self.latency_s)
        if not bandwidth > 0:
            raise LinkSpecError(f"bandwidth_bytes_per_s {self.bandwidth_bytes_per_s!r} is not valid: must be > 0")
        if not latency >= 0:
            raise LinkSpecError(f"latency_s {self.latency_s!r} is not valid: must be >= 0")
        object.__setattr__(self, "bandwidth_bytes_per_s", bandwidth)
        object.__setattr__(self, "latency_s", latency)

    def transfer_seconds(self, nbytes: int, hops: int = 1) -> float:
        """Time of one message alone on an idle route: ``nbytes / W + latency_s x hops``.

        Args:
            nbytes: message size in bytes, >= 0.
            hops: links on the route, >= 0.

        Returns:
            Seconds (simulated time).
        """
        return nbytes / self.bandwidth_bytes_per_s + self.latency_s * hops


def _as_float(field: str, value: object) -> float:
    if isinstance(value, bool):
        raise LinkSpecError(f"{field} {value!r} is not valid: expected a number")
    try:
        result = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise LinkSpecError(f"{field} {value!r} is not valid: expected a number") from None
    if not math.isfinite(result):
        raise LinkSpecError(f"{field} {value!r} is not valid: expected a finite number")
    return result

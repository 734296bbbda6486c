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
    Typical values ([SB]): v4 4.5e10 B/s, v5p 9e10 B/s one way per link;
    about 1 us per hop.

    The defaults are the ideal link of the textbook: the nominal bandwidth,
    no fixed cost, every link of a chip driven at once. The textbook's
    multi-axis collectives ([SB] "multi-axis torus": ``V / (W_bidi x
    axes)``) drive every link of a chip together: a chip's DMA engines run
    several streams at once. :func:`interconnect.calibration.calibrated_link`
    fills the calibration fields with constants fitted to published
    measurements.

    Attributes:
        bandwidth_bytes_per_s: nominal bytes per second one way, > 0 and finite.
        latency_s: seconds per hop a message pays on top of its transfer
            time, >= 0 and finite (default 1e-6, [SB]).
        efficiency: achieved / nominal bandwidth of a link when its chip
            drives only that link, in (0, 1] (default 1.0: ideal).
        multi_link_exponent: how the achieved bandwidth falls when a chip
            drives ``k`` outgoing links in one phase: each runs at
            ``efficiency x min(k, multi_link_cap) ** -multi_link_exponent``
            of nominal; >= 0 (default 0.0: no loss).
        multi_link_cap: links beyond which the loss stops growing (the
            largest ``k`` the calibration data cover), >= 1 (default: no cap).
        collective_fixed_s: seconds every collective over 2 or more chips
            pays once, whatever its size (launch and synchronisation); >= 0
            (default 0.0).
        dma_streams: links a chip drives at once at the full achieved rate
            (its concurrent DMA streams); in a phase where a chip drives
            ``k > dma_streams`` links, each runs at ``dma_streams / k`` of
            that rate (the streams are shared); > 0 (default: no limit).
            ``1`` models a chip that drives one link at a time.

    Raises:
        LinkSpecError: a value that is not a finite number in its range; the
            message quotes it.
    """

    bandwidth_bytes_per_s: float
    latency_s: float = 1e-6
    efficiency: float = 1.0
    multi_link_exponent: float = 0.0
    collective_fixed_s: float = 0.0
    multi_link_cap: float = math.inf
    dma_streams: float = math.inf

    def __post_init__(self) -> None:
        bandwidth = _as_float("bandwidth_bytes_per_s", self.bandwidth_bytes_per_s)
        latency = _as_float("latency_s", self.latency_s)
        efficiency = _as_float("efficiency", self.efficiency)
        exponent = _as_float("multi_link_exponent", self.multi_link_exponent)
        fixed = _as_float("collective_fixed_s", self.collective_fixed_s)
        cap = self.multi_link_cap
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or math.isnan(cap) or cap < 1:
            raise LinkSpecError(f"multi_link_cap {cap!r} is not valid: must be a number >= 1")
        streams = self.dma_streams
        if isinstance(streams, bool) or not isinstance(streams, (int, float)) or not streams > 0:
            raise LinkSpecError(f"dma_streams {streams!r} is not valid: must be a number > 0 "
                                "(links a chip drives at once)")
        if not bandwidth > 0:
            raise LinkSpecError(f"bandwidth_bytes_per_s {self.bandwidth_bytes_per_s!r} is not "
                                "valid: must be > 0")
        if not latency >= 0:
            raise LinkSpecError(f"latency_s {self.latency_s!r} is not valid: must be >= 0")
        if not 0 < efficiency <= 1:
            raise LinkSpecError(f"efficiency {self.efficiency!r} is not valid: must be in (0, 1]")
        if not exponent >= 0:
            raise LinkSpecError(f"multi_link_exponent {self.multi_link_exponent!r} is not valid: "
                                "must be >= 0")
        if not fixed >= 0:
            raise LinkSpecError(f"collective_fixed_s {self.collective_fixed_s!r} is not valid: "
                                "must be >= 0")
        object.__setattr__(self, "bandwidth_bytes_per_s", bandwidth)
        object.__setattr__(self, "latency_s", latency)
        object.__setattr__(self, "efficiency", efficiency)
        object.__setattr__(self, "multi_link_exponent", exponent)
        object.__setattr__(self, "collective_fixed_s", fixed)
        object.__setattr__(self, "multi_link_cap", float(cap))
        object.__setattr__(self, "dma_streams", float(streams))

    def achieved_bandwidth_bytes_per_s(self, links_driven: int = 1) -> float:
        """Bytes per second one link achieves while its chip drives ``links_driven`` links.

        ``bandwidth_bytes_per_s x efficiency x min(k, multi_link_cap) ** -multi_link_exponent
        x min(1, dma_streams / k)`` for ``k = links_driven``.

        Args:
            links_driven: outgoing links of the chip carrying data at once, >= 1.

        Returns:
            Bytes per second, one way.
        """
        k = max(int(links_driven), 1)
        loss = min(k, self.multi_link_cap) ** -self.multi_link_exponent
        return self.bandwidth_bytes_per_s * self.efficiency * loss * min(1.0, self.dma_streams / k)

    def transfer_seconds(self, nbytes: int, hops: int = 1) -> float:
        """Time of one message alone on an idle route: ``nbytes / W + latency_s x hops``.

        ``W`` is the achieved bandwidth of a chip driving one link
        (``bandwidth_bytes_per_s x efficiency``); no fixed cost.

        Args:
            nbytes: message size in bytes, >= 0.
            hops: links on the route, >= 0.

        Returns:
            Seconds (simulated time).
        """
        return nbytes / self.achieved_bandwidth_bytes_per_s(1) + self.latency_s * hops


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

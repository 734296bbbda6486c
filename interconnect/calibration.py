"""Calibrated ICI constants: achieved link efficiency and the fixed cost of a collective.

The textbook link of :class:`~interconnect.link.LinkSpec` (nominal bandwidth,
1 us per hop, nothing else) misses two things the published measurements
show ([MARIN], [SB-prof], [SB-shard], [JS168]; the calibration set C6-C14):

- a link reaches about 96% of its nominal bandwidth alone (C11: "time =
  4.55 us + bytes / 86.3 GB/s" on 90 GB/s links), and less when its chip
  drives several links at once (C9: a 2x4 v5e allreduce);
- every collective pays a fixed few microseconds whatever its size (C7,
  C11-C14), beyond the 1 us per hop [SB].

The model (:mod:`interconnect.cost`): a phase's busiest link runs at
``W x efficiency x k ** -multi_link_exponent`` for a chip driving ``k``
links, and a collective over 2+ chips adds ``collective_fixed_s``. The
constants below are FITTED, not set by hand: ``python benchmarks/fidelity.py
--fit`` minimises the squared relative error of every collective row of the
calibration set at once (a grid over efficiency and exponent; per
generation the fixed cost that minimises the error given those, in closed
form), and prints them. Hop latency stays the textbook 1 us [SB]: the
one-hop rows cannot separate it from the fixed cost.

Fit (``benchmarks/fidelity.py --fit``; rows C6, C7, C9, C11-C14, and C8, C10
read as allreduces of the gathered buffer, see VALIDATION.md): 9 rows, 5
free constants (efficiency, exponent, 3 fixed costs); RMS relative error
0.36%, every row within 0.8%. The residuals and the reasoning are in
VALIDATION.md, "Collectives and the calibration set".
"""

from __future__ import annotations

from dataclasses import dataclass, field

from interconnect.errors import LinkSpecError
from interconnect.link import LinkSpec

__all__ = ["Calibration", "CALIBRATION", "calibrated_link"]


@dataclass(frozen=True)
class Calibration:
    """Fitted ICI constants.

    Attributes:
        efficiency: achieved / nominal bandwidth of one link driven alone, (0, 1].
        multi_link_exponent: achieved bandwidth falls as ``k ** -exponent``
            with the ``k`` links a chip drives at once, >= 0.
        multi_link_cap: the largest ``k`` the fitted rows drive; beyond it
            the loss is held (no data says how it grows).
        fixed_s_by_generation: fixed cost of one collective, seconds, per
            chip generation the data cover.
        default_fixed_s: fixed cost for generations without data (the mean
            of the fitted ones), seconds.
    """

    efficiency: float
    multi_link_exponent: float
    multi_link_cap: float = 2.0
    fixed_s_by_generation: dict[str, float] = field(default_factory=dict)
    default_fixed_s: float = 0.0

    def fixed_s(self, generation: str) -> float:
        """Fixed cost of a collective on ``generation`` (e.g. ``"v5p"``), seconds."""
        return self.fixed_s_by_generation.get(generation, self.default_fixed_s)


#: Fitted by ``benchmarks/fidelity.py --fit`` on the calibration set (see the module docstring).
CALIBRATION = Calibration(
    # joint fit; [MARIN] C11 alone gives 86.3 / 90 = 0.959, [SB-prof] C6 59.4 / 62 = 0.958
    efficiency=0.9625,
    # joint fit, set by [JS168] C8-C10 (v5e 2x4 mesh, chips driving 2 links: 2 ** -0.655 = 0.635)
    # and [SB-shard] C7 (a line of 4: 2 links). Every other row drives 1 link, and every 2-link
    # row is a v5e: the data cannot tell "2 links at once" from "v5e links" apart.
    multi_link_exponent=0.655,
    # no row drives more than 2 links: a 2-D / 3-D torus (4 / 6 links) keeps the 2-link value
    multi_link_cap=2.0,
    fixed_s_by_generation={
        "v5e": 1.86e-6,  # [SB-shard] C7 alone ("closer to 8us"): the host rows C8-C10 cannot see it
        "v5p": 3.9e-6,  # [MARIN] C11-C13 (intercept 4.55 us = fixed + one 1 us hop + bytes)
        "v6e": 1.29e-6,  # [MARIN] C14 alone (intercept 2.29 us = fixed + one 1 us hop)
    },
    default_fixed_s=2.35e-6,  # mean of the three; v2, v3, v4 have no small-message data
)


def calibrated_link(generation: str, bandwidth_bytes_per_s: float, latency_s: float = 1e-6,
                    calibration: Calibration = CALIBRATION) -> LinkSpec:
    """The link of a chip generation with the fitted efficiency and fixed cost.

    Args:
        generation: chip generation name, e.g. ``"v5e"`` (others get the
            default fixed cost).
        bandwidth_bytes_per_s: nominal one-way link bandwidth (the chip
            spec's, [SB]).
        latency_s: per-hop latency (default 1 us [SB]).
        calibration: the constants (default :data:`CALIBRATION`).

    Returns:
        A :class:`LinkSpec` with ``efficiency``, ``multi_link_exponent``,
        ``multi_link_cap`` and ``collective_fixed_s`` set.

    Raises:
        LinkSpecError: a bad bandwidth or latency, or a generation that is not a string.
    """
    if not isinstance(generation, str):
        raise LinkSpecError(f"generation {generation!r} is not valid: expected a name such as 'v5e'")
    return LinkSpec(bandwidth_bytes_per_s, latency_s, efficiency=calibration.efficiency,
                    multi_link_exponent=calibration.multi_link_exponent,
                    collective_fixed_s=calibration.fixed_s(generation),
                    multi_link_cap=calibration.multi_link_cap)

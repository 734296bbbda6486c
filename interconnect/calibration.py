"""Calibrated ICI constants: achieved link efficiency, DMA streams and the fixed cost of a
collective.

The textbook link of :class:`~interconnect.link.LinkSpec` (nominal bandwidth,
1 us per hop, nothing else) misses two things the published measurements
show ([MARIN], [SB-prof], [SB-shard], [JS168]; the calibration set C6-C14):

- a link reaches about 96% of its nominal bandwidth (C11: "time = 4.55 us +
  bytes / 86.3 GB/s" on 90 GB/s links);
- every collective pays a fixed few microseconds whatever its size (C7,
  C11-C14), beyond the 1 us per hop [SB].

The model (:mod:`interconnect.cost`): a phase's busiest link runs at
``W x efficiency x k ** -multi_link_exponent x min(1, dma_streams / k)`` for
a chip driving ``k`` links, and a collective over 2+ chips adds
``collective_fixed_s``. Every constant below is FITTED, not set by hand:
``python benchmarks/fidelity.py --fit`` minimises the squared relative error
of every collective row of the calibration set at once, each row costed as
XLA runs it (reduce-scatter, all-gather and allreduce over every torus axis of
the slice at once, both directions, lines where the slice has no wraparound:
the ``"torus"`` algorithm), on a grid over efficiency, exponent and DMA
streams, with the fixed cost per generation in closed form; and prints them.
Hop latency stays the textbook 1 us [SB]: the one-hop rows cannot separate it
from the fixed cost.

Fit (``benchmarks/fidelity.py --fit``; rows C6-C14, C8 and C10 as the
allreduces torch_xla runs them: ``xla_model.all_gather`` pads the buffer with
zeros and all-reduces it, ``_all_gather_using_all_reduce``; VALIDATION.md): 9
rows, 5 free constants (efficiency, exponent, 3 fixed costs) and the DMA
streams; RMS relative error 0.36%, every row within 0.8%. No multi-link loss:
the exponent fits to 0. DMA streams 3: a chip drives at most 3 links at once
at the full rate. C9's interior chips drive 3 (both directions of the 2x4
slice's line of 4, one of its pair) at the single-link rate; the fewest
streams that fit C8-C10 as well as unlimited ones is 3 (2 leaves them 4-5%
slow). So a chip of a 2-D torus with wraparound, 4 links, gets 3 links' worth
in a multi-axis collective, and one of a 3-D torus, 6 links, also 3: where
[SB]'s model has every link of a chip run at once, no published row shows a
chip drive a 4th link at the full rate. Before issue 23 the rows were read with
the fastest algorithm (``--fastest``: the bidirectional ring over the 2x4
slices' Hamiltonian cycle), which needs a loss of ``2 ** -0.655 = 0.635`` per
link at 2 links and none beyond (``multi_link_cap`` 2) to match C9: a loss
with no mechanism (the per-link rate of one link driven both ways is 96%,
C11) that stops growing where the data stop. VALIDATION.md section 5 has both
readings row by row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from interconnect.errors import LinkSpecError
from interconnect.link import LinkSpec

__all__ = ["Calibration", "CALIBRATION", "calibrated_link", "SLICE_STEP_JITTER"]


@dataclass(frozen=True)
class Calibration:
    """Fitted ICI constants.

    Attributes:
        efficiency: achieved / nominal bandwidth of one link driven alone, (0, 1].
        multi_link_exponent: achieved bandwidth falls as ``k ** -exponent``
            with the ``k`` links a chip drives at once, >= 0.
        multi_link_cap: the largest ``k`` the fitted rows drive; beyond it
            the loss is held (no data says how it grows).
        dma_streams: links a chip drives at once at the full rate
            (``LinkSpec.dma_streams``); beyond them the streams are shared.
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
    dma_streams: float = math.inf

    def fixed_s(self, generation: str) -> float:
        """Fixed cost of a collective on ``generation`` (e.g. ``"v5p"``), seconds."""
        return self.fixed_s_by_generation.get(generation, self.default_fixed_s)


#: Fitted by ``benchmarks/fidelity.py --fit`` on the calibration set (see the module docstring).
CALIBRATION = Calibration(
    # joint fit (rows C6-C14, benchmarks/fidelity.py --fit); [MARIN] C11 alone gives 86.3 / 90 =
    # 0.959, [SB-prof] C6 59.4 / 62 = 0.958, and [JS168] C8-C10 (chips driving 3 links at once)
    # agree at the same rate
    efficiency=0.9625,
    # joint fit (rows C6-C14, benchmarks/fidelity.py --fit): 0, no loss when a chip drives several
    # links ([JS168] C8-C10: up to 3 links per chip on the 2x4 v5e slice's lines, [SB-shard] C7: 2
    # on a line of 4). Fitted at 0.655 before issue 23, when the rows were read with the
    # bidirectional ring over a Hamiltonian cycle of the 2x4 slice (2 links), which XLA does not
    # run.
    multi_link_exponent=0.0,
    # the most links any fitted row drives per chip (C8-C10); with no loss it only documents them
    multi_link_cap=3.0,
    fixed_s_by_generation={
        # fit (benchmarks/fidelity.py --fit): [SB-shard] C7 alone ("closer to 8us"), the one
        # small-message v5e row: the host rows C8-C10 cannot see it. One row: not a check of it
        "v5e": 2.73e-6,
        # fit: [MARIN] C11-C13 (intercept 4.55 us = fixed + one 1 us hop + bytes)
        "v5p": 3.9e-6,
        # fit: [MARIN] C14 alone (intercept 2.29 us = fixed + one 1 us hop), the one v6e row. A
        # fixed cost shared by the generations would put C14 at +57% (2.6 us against 1.29)
        "v6e": 1.29e-6,
    },
    # fit: the mean of the three (C7, C11-C14); v2, v3, v4 have no small-message row
    default_fixed_s=2.64e-6,
    # joint fit: the fewest streams that fit the rows as well as unlimited ones ([JS168] C8-C10: the
    # 2x4 slice's interior chips drive 3 links at once at the single-link rate; with 2 streams they
    # come out 4-5% slow). Rows C6-C14: benchmarks/fidelity.py --fit. A chip drives at most 3 links
    # at once at the full rate; on a 2-D torus with wraparound (4 links) or a 3-D one (6) it shares
    # 3 links' worth ([SB]'s all-links-at-once is the upper bound, never measured; issue 29).
    dma_streams=3.0,
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
        ``multi_link_cap``, ``dma_streams`` and ``collective_fixed_s`` set.

    Raises:
        LinkSpecError: a bad bandwidth or latency, or a generation that is not a string.
    """
    if not isinstance(generation, str):
        raise LinkSpecError(f"generation {generation!r} is not valid: expected a name such as "
                            "'v5e'")
    return LinkSpec(bandwidth_bytes_per_s, latency_s, efficiency=calibration.efficiency,
                    multi_link_exponent=calibration.multi_link_exponent,
                    collective_fixed_s=calibration.fixed_s(generation),
                    multi_link_cap=calibration.multi_link_cap, dma_streams=calibration.dma_streams)


#: The spread of one slice's step (standard deviation as a fraction of the step) that
#: makes a multislice job wait for its slowest slice (``interconnect.dcn.slice_wait_seconds``).
#: Rows: M1 (2 x v5e-256 against T3), M2 (2 x v5p-128 against T1), M3 (8 x v4-128 against
#: T9) [MT-v5e][MT-v5p][MT-v4], fitted with the step clock's MXU constants on every
#: training row at once: ``python benchmarks/fidelity.py --fit-mxu`` (its "slice_jitter").
SLICE_STEP_JITTER = 0.0465

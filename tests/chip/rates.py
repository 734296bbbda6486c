"""The MXU's rate for one op from an idle start, written out independently of
``chip.spec`` for the tests' closed forms."""

from __future__ import annotations

import math


def fresh_op_cycles(spec, ideal_cycles: int) -> int:
    """MXU cycles of one op of ``ideal_cycles`` (efficiency 1) from an idle start: the
    rate falls from e0 to the sustained e1 with time constant tau, so an op of
    duration d = ideal / clock / e0 runs at the mean e1 + (e0 - e1) (tau / d)(1 - e^-d/tau)."""
    e0, tau = spec.mxu_efficiency, spec.mxu_burst_seconds
    e1 = e0 if spec.mxu_sustained_efficiency is None else spec.mxu_sustained_efficiency
    d = ideal_cycles / spec.clock_hz / e0
    mean = e0 if tau <= 0 or d <= 0 else e1 + (e0 - e1) * tau / d * (1 - math.exp(-d / tau))
    return math.ceil(ideal_cycles / mean)

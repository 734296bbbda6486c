"""The VPU: cost of elementwise and reduction work.

The VPU of a TensorCore is a (sublanes x lanes) = (8 x 128) grid [SB, JAX]
with 2 floating-point ALUs in each cell ("2048 floating point adders" per
v4 TensorCore [SB-tpus]): it completes lanes * sublanes * 2 element-ops per
cycle (a v5p chip: about 7e12 FLOP/s [SB-roof]). Transcendental
ops (exp, log, tanh, ...) cost `transcendental_cycles_per_element_op` times
as much (an assumption; see chip/spec.py).
"""

from __future__ import annotations

import math
import numbers

from chip.spec import TensorCoreSpec


def vpu_cycles(
    elements: int, ops_per_element: float, transcendental: bool, spec: TensorCoreSpec
) -> int:
    """Cycles for the VPU to apply `ops_per_element` ops to `elements` elements.

    cycles = ceil(elements * ops_per_element / (lanes * sublanes * ALUs per lane)), times
    spec.transcendental_cycles_per_element_op (rounded up) when transcendental.

    Args:
        elements: Number of elements processed, int >= 0.
        ops_per_element: Element-ops per element (e.g. 2 for a fused multiply-add
            counted as two ops), >= 0.
        transcendental: True for exp / log / tanh / ... work.
        spec: The TensorCore (lanes, sublanes, ALUs, transcendental factor).

    Returns:
        Cycles, int >= 0.

    Raises:
        ValueError: if elements is not an int >= 0 or ops_per_element is negative.
    """
    if isinstance(elements, bool) or not isinstance(elements, numbers.Integral) or elements < 0:
        raise ValueError(f"elements must be an integer >= 0, got {elements!r}")
    if (not isinstance(ops_per_element, numbers.Real) or not ops_per_element >= 0
            or not math.isfinite(ops_per_element)):
        raise ValueError(f"ops_per_element must be a finite number >= 0, got {ops_per_element!r}")
    cycles = math.ceil(int(elements) * ops_per_element / spec.vpu_elements_per_cycle)
    if transcendental:
        cycles = math.ceil(cycles * spec.transcendental_cycles_per_element_op)
    return cycles

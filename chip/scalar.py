"""The scalar unit: control overhead charged on every op a TensorCore runs.

The scalar unit fetches and issues the VLIW bundles that drive the MXUs and
the VPU (address arithmetic, loop control, DMA and sync flags). We model it as
a fixed number of cycles per op, `TensorCoreSpec.scalar_issue_cycles` (an
assumption: "a handful" of cycles; see chip/spec.py).
"""

from __future__ import annotations

import numbers

from chip.spec import TensorCoreSpec


def scalar_cycles(spec: TensorCoreSpec, ops: int = 1) -> int:
    """Cycles the scalar unit spends issuing `ops` ops.

    Args:
        spec: The TensorCore (its scalar_issue_cycles).
        ops: Number of ops issued, int >= 0.

    Returns:
        ops * spec.scalar_issue_cycles, int.

    Raises:
        ValueError: if ops is not an int >= 0.
    """
    if isinstance(ops, bool) or not isinstance(ops, numbers.Integral) or ops < 0:
        raise ValueError(f"ops must be an integer >= 0, got {ops!r}")
    return int(ops) * spec.scalar_issue_cycles

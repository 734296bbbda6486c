"""The MXU: cycle count of a GEMM on weight-stationary systolic arrays.

The functional product (bf16 x bf16 -> fp32) lives in `chip.numerics`.
"""

from __future__ import annotations

import numbers

from chip.spec import MXUSpec


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def mxu_gemm_cycles(m: int, k: int, n: int, mxu: MXUSpec, mxus: int = 1) -> int:
    """Cycles to compute (M x K) . (K x N) on weight-stationary R x C systolic arrays.

    The weights (K x N) are cut into ceil(K / R) * ceil(N / C) folds, one R x C
    tile each. Per fold the array:

    1. loads the weight tile: R cycles (one row of weights per cycle);
    2. streams the M activation rows in, skewed by one cycle per array row, and
       drains the partial sums out through the columns: M + R + C - 2 cycles
       (the last of M rows enters at cycle M - 1, takes R - 1 cycles to reach
       the bottom row and C - 1 more to leave the last column; plus one).

    So one fold costs 2R + C + M - 2 cycles. Partial folds (K or N not a
    multiple of R or C) pay for the whole array. The folds are spread over the
    `mxus` arrays of a TensorCore, which work in parallel:

        cycles = ceil(folds / mxus) * (2R + C + M - 2)

    Origin: for an n x n product on one n x n array this is 3n - 2 (the seed's
    unskewed count of stream and drain) plus n cycles of weight load; the
    dataflow is SCALE-Sim's weight-stationary ("ws") one. Accumulating folds
    over K is done in place and costs no extra cycles; loading the next fold's
    weights is not overlapped with streaming (a conservative model).

    Args:
        m: Rows of the activations (M), positive int.
        k: Contraction size (K), positive int.
        n: Columns of the weights (N), positive int.
        mxu: Shape of one array (R = mxu.rows, C = mxu.cols).
        mxus: Arrays working in parallel (MXUs per TensorCore), positive int.

    Returns:
        Total cycles, int.

    Raises:
        ValueError: if m, k, n or mxus is not a positive integer.
    """
    m = _positive_int("m", m)
    k = _positive_int("k", k)
    n = _positive_int("n", n)
    mxus = _positive_int("mxus", mxus)
    r, c = mxu.rows, mxu.cols
    folds = -(-k // r) * -(-n // c)
    rounds = -(-folds // mxus)
    return rounds * (2 * r + c + m - 2)

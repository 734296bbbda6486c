"""The MXU: cycle count of a GEMM on weight-stationary systolic arrays.

One function, `mxu_gemm_cycles`, costs every MXU op: a plain GEMM, a batched
matmul (`batch`) and a convolution lowered to a GEMM by im2col
(`conv2d_gemm_shape`). The functional products live in `chip.numerics`.

The default count agrees cycle for cycle with SCALE-Sim 3.0.0's
weight-stationary ("ws") dataflow (PyPI `scalesim`, a public cycle-level
systolic-array simulator); `benchmarks/scalesim_crosscheck.py` runs both on
18 shapes and VALIDATION.md holds the table.
"""

from __future__ import annotations

import numbers

from chip.spec import MXUSpec


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def mxu_folds(k: int, n: int, mxu: MXUSpec) -> int:
    """Weight tiles ("folds") of a (K x N) weight matrix on an R x C array.

    Args:
        k: Contraction size (K), positive int.
        n: Output columns (N), positive int.
        mxu: The array (R = rows, C = cols).

    Returns:
        ceil(K / R) * ceil(N / C).

    Raises:
        ValueError: if k or n is not a positive integer.
    """
    k = _positive_int("k", k)
    n = _positive_int("n", n)
    return -(-k // mxu.rows) * -(-n // mxu.cols)


def mxu_gemm_cycles(
    m: int,
    k: int,
    n: int,
    mxu: MXUSpec,
    mxus: int = 1,
    *,
    batch: int = 1,
    double_buffered: bool = False,
) -> int:
    """Cycles to compute (M x K) . (K x N) on weight-stationary R x C systolic arrays.

    The weights (K x N) are cut into ceil(K / R) * ceil(N / C) folds, one R x C
    tile each (a partial tile pays for the whole array). Per fold the array:

    1. loads the weight tile: R cycles (one row of weights per cycle);
    2. streams the M activation rows in, skewed by one cycle per array row,
       and drains the partial sums out through the columns: the last of the M
       rows enters at cycle M - 1, takes R - 1 cycles to reach the bottom row
       and C - 1 more to reach the last column: M + R + C - 2 cycles.

    So one fold takes 2R + C + M - 2 cycles. Folds accumulate over K in place
    (no extra cycles). The `mxus` arrays of a TensorCore work in parallel on
    different folds; a batched matmul with per-example weights brings
    `batch` times as many folds:

        rounds = ceil(batch * folds / mxus)
        cycles = rounds * (2R + C + M - 2) - 1                  (default)
        cycles = R + rounds * (R + C + M - 2) - 1               (double_buffered)

    The final - 1 is SCALE-Sim's convention: its total is the cycle in which
    the last output is written, counted from 0, i.e. one less than the number
    of cycles the pipeline is busy. With it, the default agrees with SCALE-Sim
    3.0.0 "ws" (bandwidth mode CALC, no stalls) cycle for cycle on every case
    of `benchmarks/scalesim_crosscheck.py` (VALIDATION.md). The seed's
    unskewed count for an n x n product on an n x n array is 3n - 2 (stream
    and drain); SCALE-Sim's is n (weight load) + 3n - 3.

    double_buffered models the TPU's second weight buffer: the next fold's
    weights shift in while the current fold streams (R <= M + R + C - 2
    always, so the load is fully hidden), leaving only the first fold's load
    exposed. Drain and the next fold's stream are still not overlapped.

    Args:
        m: Rows of the activations (M), positive int. For a batched matmul
            whose examples share one weight matrix, pass batch * M here
            (the weights stay in place) and leave batch = 1.
        k: Contraction size (K), positive int.
        n: Columns of the weights (N), positive int.
        mxu: Shape of one array (R = mxu.rows, C = mxu.cols).
        mxus: Arrays working in parallel (MXUs per TensorCore), positive int.
        batch: Independent GEMMs of this shape, each with its own weights
            (batched matmul), positive int.
        double_buffered: Hide every weight load but the first (see above).

    Returns:
        Total cycles, int.

    Raises:
        ValueError: if m, k, n, mxus or batch is not a positive integer.
    """
    m = _positive_int("m", m)
    mxus = _positive_int("mxus", mxus)
    batch = _positive_int("batch", batch)
    r, c = mxu.rows, mxu.cols
    rounds = -(-(batch * mxu_folds(k, n, mxu)) // mxus)
    if double_buffered:
        return r + rounds * (r + c + m - 2) - 1
    return rounds * (2 * r + c + m - 2) - 1


def conv2d_gemm_shape(
    batch: int,
    out_height: int,
    out_width: int,
    kernel_height: int,
    kernel_width: int,
    in_channels: int,
    out_channels: int,
) -> tuple[int, int, int]:
    """The GEMM a 2-D convolution becomes under im2col (as XLA lowers it to the MXU).

    Each output pixel's receptive field (KH x KW x C_in) becomes one row of the
    activation matrix; the kernel becomes a (KH*KW*C_in, C_out) weight matrix.

    Args:
        batch: Examples (B).
        out_height: Output rows (H_out), after stride and padding.
        out_width: Output columns (W_out).
        kernel_height: KH.
        kernel_width: KW.
        in_channels: C_in.
        out_channels: C_out.

    Returns:
        (M, K, N) = (B * H_out * W_out, KH * KW * C_in, C_out).

    Raises:
        ValueError: if any argument is not a positive integer.
    """
    dims = dict(batch=batch, out_height=out_height, out_width=out_width,
                kernel_height=kernel_height, kernel_width=kernel_width,
                in_channels=in_channels, out_channels=out_channels)
    d = {name: _positive_int(name, value) for name, value in dims.items()}
    return (d["batch"] * d["out_height"] * d["out_width"],
            d["kernel_height"] * d["kernel_width"] * d["in_channels"],
            d["out_channels"])

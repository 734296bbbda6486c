"""The MXU: cycle count of a GEMM on weight-stationary systolic arrays.

One function, `mxu_gemm_cycles`, costs every MXU op: a plain GEMM, a batched
matmul (`batch`) and a convolution lowered to a GEMM by im2col
(`conv2d_gemm_shape`). The functional products live in `chip.numerics`.

Two counts, chosen by name (`MXU_MODELS`):

- "pipelined" (the default): the MXU as the TPU runs it. Weights are
  double-buffered and fold follows fold without a gap: the op pays "an
  initial pipeline bubble ... After that initial bubble, new inputs and
  weights can be loaded in without an additional bubble" [SB-tpus]. Large
  GEMMs then run at the array's peak, as measured ones nearly do [PALLAS].
- "scalesim": SCALE-Sim 3.0.0's weight-stationary ("ws") dataflow (PyPI
  `scalesim`, a public cycle-level systolic-array simulator), which pays the
  weight load and the fill/drain on every fold. It agrees with SCALE-Sim
  cycle for cycle; `benchmarks/scalesim_crosscheck.py` runs both on 18 shapes
  and VALIDATION.md holds the table.
"""

from __future__ import annotations

import numbers

from chip.spec import MXUSpec

MXU_MODELS = ("pipelined", "scalesim")
"""Names of the MXU cycle counts (see the module docstring); the first is the default."""


def check_mxu_model(mxu_model: str) -> str:
    """Checks an MXU cycle-count name.

    Args:
        mxu_model: One of `MXU_MODELS`.

    Returns:
        The name.

    Raises:
        ValueError: for any other value; the message lists the choices.
    """
    if mxu_model not in MXU_MODELS:
        raise ValueError(f"unknown mxu_model {mxu_model!r}; choose one of "
                         f"{', '.join(repr(m) for m in MXU_MODELS)}")
    return mxu_model


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
    mxu_model: str = "pipelined",
) -> int:
    """Cycles to compute (M x K) . (K x N) on weight-stationary R x C systolic arrays.

    The weights (K x N) are cut into ceil(K / R) * ceil(N / C) folds, one R x C
    tile each (a partial tile pays for the whole array). The `mxus` arrays of
    a TensorCore work in parallel on different folds; a batched matmul with
    per-example weights brings `batch` times as many folds. Folds accumulate
    over K in place (no extra cycles). Each array runs

        rounds = ceil(batch * folds / mxus)

    folds one after another. One fold alone takes R cycles to load its
    weights (one row per cycle), then streams the M activation rows in,
    skewed by one cycle per array row; the last row enters at cycle M - 1,
    takes R - 1 cycles to reach the bottom row and C - 1 more to reach the
    last column: the fold's "bubble" is the load plus that fill and drain,

        one_fold = 2R + C + M - 2  cycles.

    mxu_model "pipelined" (default; the TPU [SB-tpus]): the next fold's
    weights shift in while the current fold streams (double-buffered), and
    its rows follow the current fold's last row at once, so the bubble is
    paid once per op. A weight load still takes R cycles, so a fold can
    start no sooner than R cycles after the previous one (at M < R the
    array waits for weights; an assumption, the rate of the hardware's
    weight path is not published):

        cycles = (rounds - 1) * max(M, R) + one_fold - 1
               = rounds * M + 2R + C - 2 - 1          when M >= R

    mxu_model "scalesim": every fold pays its own load, fill and drain
    (SCALE-Sim 3.0.0 "ws"):

        cycles = rounds * one_fold - 1
        cycles = R + rounds * (R + C + M - 2) - 1     (double_buffered)

    double_buffered (scalesim only) hides every weight load but the first
    and keeps the per-fold fill and drain; "pipelined" already double-buffers
    the weights, so there it changes nothing.

    The final - 1 is SCALE-Sim's convention: its total is the cycle in which
    the last output is written, counted from 0, i.e. one less than the number
    of cycles the pipeline is busy. With it, "scalesim" agrees with SCALE-Sim
    3.0.0 "ws" (bandwidth mode CALC, no stalls) cycle for cycle on every case
    of `benchmarks/scalesim_crosscheck.py` (VALIDATION.md), and both models
    agree on one fold. The seed's unskewed count for an n x n product on an
    n x n array is 3n - 2 (stream and drain); SCALE-Sim's is n (weight
    load) + 3n - 3.

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
        double_buffered: "scalesim" only: hide every weight load but the first.
        mxu_model: "pipelined" (default) or "scalesim" (`MXU_MODELS`).

    Returns:
        Total cycles, int. These are ideal pipeline cycles: the calibrated
        efficiencies (`TensorCoreSpec.mxu_efficiency` and the sustained budget) are
        applied by `TensorCore` and the step's clock, not here.

    Raises:
        ValueError: if m, k, n, mxus or batch is not a positive integer, or
            mxu_model is unknown.
    """
    m = _positive_int("m", m)
    mxus = _positive_int("mxus", mxus)
    batch = _positive_int("batch", batch)
    check_mxu_model(mxu_model)
    r, c = mxu.rows, mxu.cols
    rounds = -(-(batch * mxu_folds(k, n, mxu)) // mxus)
    one_fold = 2 * r + c + m - 2
    if mxu_model == "pipelined":
        return (rounds - 1) * max(m, r) + one_fold - 1
    if double_buffered:
        return r + rounds * (r + c + m - 2) - 1
    return rounds * one_fold - 1


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

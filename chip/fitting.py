"""The fits of ``chip.calibration``'s constants, and the published vs predicted report.

``chip.calibration`` holds the rows (C1-C5 as published, the training rows' reduced
form ``StepRow``) and the committed constants, which ``chip.spec``'s presets read;
this module fits them again and compares: :func:`fit_step_clock` (e0, tau, e1 per
generation and the slice jitter on the GEMM rows and the training steps at once;
``benchmarks/fidelity.py --fit-mxu``), :func:`fit_hbm_efficiency` (C5),
:func:`fit_mxu_efficiency` (the one-constant model before issue 23), and
:func:`report` (``python -m chip.fitting``; VALIDATION.md section 6). It imports the
chip's cost model, which ``chip.calibration`` must not (``chip.spec`` imports it).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from chip.calibration import (
    COPY_ROWS,
    GEMM_ROWS,
    HOST_DISPATCH_SECONDS,
    MXU_FIT_ROW_IDS,
    CopyRow,
    GemmRow,
    StepClockFit,
    StepRow,
)
from chip.core import TensorCore
from chip.spec import ChipSpec, get_chip_spec

__all__ = ["fit_step_clock", "fit_mxu_efficiency", "fit_hbm_efficiency", "predict_gemm_seconds",
           "predict_copy_seconds", "report"]


def _uncalibrated(spec: ChipSpec) -> ChipSpec:
    """The chip at its ideal rates: MXU and HBM efficiency 1, no sustained drop."""
    core = dataclasses.replace(spec.core, mxu_efficiency=1.0, hbm_efficiency=1.0,
                               mxu_sustained_efficiency=None, mxu_burst_seconds=0.0)
    return dataclasses.replace(spec, core=core)


def predict_gemm_seconds(row: GemmRow, spec: ChipSpec | None = None,
                         mxu_model: str = "pipelined") -> tuple[float, str]:
    """Predicted time of a GEMM row as published (device, plus dispatch if host-timed).

    Args:
        row: The row.
        spec: Chip to cost it on; None uses the row's preset.
        mxu_model: "pipelined" or "scalesim".

    Returns:
        (seconds, bound): the prediction comparable with row.published_s and
        whether the device part is compute- or memory-bound.
    """
    spec = spec or get_chip_spec(row.chip)
    record = TensorCore(spec.core, execute=False, mxu_model=mxu_model).account_matmul(
        row.m, row.k, row.n)
    dispatch = HOST_DISPATCH_SECONDS if row.timing == "host" else 0.0
    return record.seconds + dispatch, record.bound


def predict_copy_seconds(row: CopyRow, spec: ChipSpec | None = None) -> float:
    """Predicted device time of a copy row: a memory-bound VPU op of float32 elements."""
    spec = spec or get_chip_spec(row.chip)
    core = TensorCore(spec.core, execute=False)
    record = core.account_vector("copy", row.bytes_moved // 2 // 4, row.bytes_moved)
    assert record is not None  # not fused: account_vector returns the copy's record
    return record.seconds


def _least_squares_reciprocal(ideal_s: list[float], fixed_s: list[float],
                              published_s: list[float]) -> float:
    # Minimise sum ((ideal * x + fixed) / published - 1)^2 over x (= 1 / efficiency).
    a = [i / p for i, p in zip(ideal_s, published_s, strict=True)]
    b = [f / p for f, p in zip(fixed_s, published_s, strict=True)]
    x = sum(ai * (1.0 - bi) for ai, bi in zip(a, b, strict=True)) / sum(ai * ai for ai in a)
    return 1.0 / x


def fit_mxu_efficiency(row_ids: tuple[str, ...] = MXU_FIT_ROW_IDS) -> float:
    """Fits the sustained MXU efficiency on GEMM rows (see the module docstring).

    Args:
        row_ids: Ids of the GEMM rows to fit on; all must be compute-bound.

    Returns:
        The efficiency, a fraction.

    Raises:
        ValueError: if a row is unknown or memory-bound (its time says nothing
            about the MXU).
    """
    by_id = {r.row_id: r for r in GEMM_ROWS}
    ideal, fixed, published = [], [], []
    for rid in row_ids:
        if rid not in by_id:
            raise ValueError(f"unknown GEMM row {rid!r}; choose from {', '.join(by_id)}")
        row = by_id[rid]
        spec = _uncalibrated(get_chip_spec(row.chip))
        record = TensorCore(spec.core, execute=False).account_matmul(row.m, row.k, row.n)
        if record.bound != "compute":
            raise ValueError(f"row {rid} is memory-bound in the model; it cannot fit the MXU")
        ideal.append(record.compute_seconds)
        fixed.append(HOST_DISPATCH_SECONDS if row.timing == "host" else 0.0)
        published.append(row.published_s)
    return _least_squares_reciprocal(ideal, fixed, published)


def _gemm_fit_parts(row_ids: tuple[str, ...]) -> list[tuple[float, float, float]]:
    """(ideal MXU seconds at efficiency 1, fixed seconds, published) of GEMM rows."""
    by_id = {r.row_id: r for r in GEMM_ROWS}
    out = []
    for rid in row_ids:
        row = by_id[rid]
        spec = _uncalibrated(get_chip_spec(row.chip))
        record = TensorCore(spec.core, execute=False).account_matmul(row.m, row.k, row.n)
        out.append((record.compute_seconds, HOST_DISPATCH_SECONDS if row.timing == "host" else 0.0,
                    row.published_s))
    return out


def _step_sq(row: StepRow, e0: np.ndarray, e1: np.ndarray, jitter: float) -> np.ndarray:
    """Squared relative error of ``row`` over the grid ``e0`` (E0, 1) x ``e1`` (1, E1)."""
    work = row.mxu_seconds * row.e_ref
    step = np.maximum(row.step_seconds - row.mxu_seconds + work / e0, work / e1)
    return (step * (1.0 + jitter * row.slice_factor) / row.published_s - 1.0) ** 2


def _gemm_sq(gemms: list[tuple[float, float, float]], e0: np.ndarray, e1: np.ndarray,
             taus: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The GEMM rows' summed squared relative error over (e0, e1), minimised over tau,
    and the index of the best tau: a GEMM of ideal time t runs t / e(d) + dispatch,
    e(d) = e1 + (e0 - e1)(tau / d)(1 - exp(-d / tau)), d = t / e0."""
    best = np.full(np.broadcast_shapes(e0.shape, e1.shape), np.inf)
    arg = np.zeros(best.shape, dtype=np.int64)
    for k, tau in enumerate(taus):
        sq = np.zeros(best.shape)
        for ideal, fixed, published in gemms:
            x = ideal / e0 / tau
            mean = e1 + (e0 - e1) * (-np.expm1(-x)) / x
            sq = sq + ((ideal / mean + fixed) / published - 1.0) ** 2
        better = sq < best
        best[better], arg[better] = sq[better], k
    return best, arg


def _grid_fit(gemms, by_chip: dict[str, list[StepRow]], gemm_chip: str, e0s: np.ndarray,
              e1s: np.ndarray, taus: np.ndarray, jitters: np.ndarray
              ) -> tuple[float, float, float, float, dict[str, float]]:
    """One grid search: (sse, e0, tau, jitter, {chip: e1}) at the grid's best point."""
    e0, e1 = e0s[:, None], e1s[None, :]
    valid = e1 <= e0 + 1e-12                                       # e1 never above e0
    gemm_sq, gemm_tau = _gemm_sq(gemms, e0, e1, taus)
    total = np.zeros((len(e0s), len(jitters)))
    choice: dict[str, np.ndarray] = {}
    for chip, rows in by_chip.items():
        single = sum((_step_sq(r, e0, e1, 0.0) for r in rows if not r.slice_factor),
                     np.zeros(valid.shape))
        if chip == gemm_chip:
            single = single + gemm_sq
        multi = [r for r in rows if r.slice_factor]
        best = np.empty((len(e0s), len(jitters)))
        arg = np.empty((len(e0s), len(jitters)), dtype=np.int64)
        for j, jitter in enumerate(jitters if multi else jitters[:1]):
            sq = np.where(valid, single + sum((_step_sq(r, e0, e1, jitter) for r in multi),
                                              np.zeros(valid.shape)), np.inf)
            k = np.argmin(sq, axis=1)
            best[:, j], arg[:, j] = sq[np.arange(len(e0s)), k], k
        if not multi:
            best[:], arg[:] = best[:, :1], arg[:, :1]
        total += best
        choice[chip] = arg
    i, j = (int(x) for x in np.unravel_index(int(np.argmin(total)), total.shape))
    e1_by_chip = {chip: float(e1s[arg[i, j]]) for chip, arg in choice.items()}
    tau = float(taus[gemm_tau[i, choice[gemm_chip][i, j]]])
    return float(total[i, j]), float(e0s[i]), tau, float(jitters[j]), e1_by_chip


def fit_step_clock(steps: tuple[StepRow, ...], row_ids: tuple[str, ...] = MXU_FIT_ROW_IDS,
                   gemm_chip: str = "v5e") -> StepClockFit:
    """Fit e0, tau, each generation's e1 and the slice jitter on the GEMM rows and the
    training steps at once (the module docstring has the model).

    Least squares in relative error over every row: a GEMM of ideal time t (efficiency
    1) takes t / e(d) + dispatch at ``gemm_chip``'s e1; a training step takes
    ``StepRow.predicted(e0, e1, jitter)`` at its generation's e1. A grid search, then a
    finer one around its best point (e0 and e1 to 0.0005, the jitter to 0.0001, tau
    on a log grid): deterministic, and global over the coarse grid.

    Raises:
        ValueError: no training step of ``gemm_chip`` (its e1 would rest on the GEMMs).
    """
    gemms = _gemm_fit_parts(row_ids)
    by_chip: dict[str, list[StepRow]] = {}
    for row in steps:
        by_chip.setdefault(row.chip, []).append(row)
    if gemm_chip not in by_chip:
        raise ValueError(f"no training step of {gemm_chip} to fit its sustained efficiency")
    coarse = _grid_fit(gemms, by_chip, gemm_chip, np.arange(0.85, 1.0001, 0.002),
                       np.arange(0.40, 1.0001, 0.002), np.geomspace(0.01, 3.0, 41),
                       np.arange(0.0, 0.1501, 0.002))
    _, e0, tau, jitter, _ = coarse

    def around(x: float, half: float, step: float, lo: float, hi: float) -> np.ndarray:
        return np.arange(max(lo, x - half), min(hi, x + half) + step / 2, step)

    fine = _grid_fit(gemms, by_chip, gemm_chip, around(e0, 0.004, 0.0005, 0.5, 1.0),
                     np.arange(0.40, 1.0001, 0.0005), tau * np.geomspace(0.85, 1.0 / 0.85, 33),
                     around(jitter, 0.003, 0.0001, 0.0, 1.0))
    sse, e0, tau, jitter, e1 = fine
    n = len(gemms) + len(steps)
    return StepClockFit(round(e0, 4), float(f"{tau:.3g}"), {c: round(v, 4) for c, v in e1.items()},
                        round(jitter, 4), (sse / n) ** 0.5)


def fit_hbm_efficiency(rows: tuple[CopyRow, ...] = COPY_ROWS) -> float:
    """Fits the achieved HBM fraction on copy rows (least squares in relative error).

    Returns:
        The efficiency, a fraction.
    """
    ideal = [r.bytes_moved / get_chip_spec(r.chip).core.hbm_bandwidth_bytes_per_s for r in rows]
    return _least_squares_reciprocal(ideal, [0.0] * len(rows), [r.published_s for r in rows])


def report() -> str:
    """The fits and a Markdown table of published vs predicted rows, before and after.

    "before" is the model without this calibration: SCALE-Sim's per-fold MXU
    count and the spec HBM bandwidth (the GEMM rows are compute-bound, so the
    output bytes do not change them). "after" is the presets as shipped.
    """
    v5e = get_chip_spec("v5e").core
    lines = [f"MXU efficiency as shipped (v5e): a fresh op e0 {v5e.mxu_efficiency:.3f}, falling "
             f"with time constant {v5e.mxu_burst_seconds:.3g} s to the sustained "
             f"{v5e.sustained_mxu_efficiency:.3f}; fitted on {', '.join(MXU_FIT_ROW_IDS)} with the "
             "training steps (benchmarks/fidelity.py --fit-mxu)",
             f"(one constant fitted on {', '.join(MXU_FIT_ROW_IDS)} alone, the model before: "
             f"{fit_mxu_efficiency():.4f})",
             f"HBM efficiency fit on {', '.join(r.row_id for r in COPY_ROWS)} (v6e): "
             f"{fit_hbm_efficiency():.4f}", "",
             "| id | chip | operation | timing | published | before: predicted | error "
             "| after: predicted | error | after: bound |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---|"]

    def fmt(seconds: float) -> str:
        return f"{seconds * 1e3:.4g} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.4g} us"

    for row in GEMM_ROWS:
        before, _ = predict_gemm_seconds(row, _uncalibrated(get_chip_spec(row.chip)), "scalesim")
        after, bound = predict_gemm_seconds(row)
        lines.append(f"| {row.row_id} | {row.chip} | bf16 GEMM {row.m}x{row.k}x{row.n} | "
                     f"{row.timing} | {fmt(row.published_s)} | {fmt(before)} | "
                     f"{before / row.published_s - 1:+.1%} | {fmt(after)} | "
                     f"{after / row.published_s - 1:+.1%} | {bound} |")
    for copy_row in COPY_ROWS:
        before = predict_copy_seconds(copy_row, _uncalibrated(get_chip_spec(copy_row.chip)))
        after = predict_copy_seconds(copy_row)
        lines.append(f"| {copy_row.row_id} | {copy_row.chip} | "
                     f"copy {copy_row.bytes_moved // 2 // 2**20} MiB | "
                     f"device | {fmt(copy_row.published_s)} | {fmt(before)} | "
                     f"{before / copy_row.published_s - 1:+.1%} | {fmt(after)} | "
                     f"{after / copy_row.published_s - 1:+.1%} | memory |")
    lines.append(f"\nhost rows: predicted = device + {HOST_DISPATCH_SECONDS * 1e6:.0f} us dispatch")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())

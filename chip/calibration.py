"""Published single-chip measurements, the fit of the chip's calibrated constants, and
the constants themselves.

The rows are measured timings (not models) from public sources, each with
its id (C1-C5), as published:

- [PALLAS]: JAX docs, Pallas TPU matmul guide, cell "XLA matmul", one v5e,
  timed from Python around a jitted call ("host").
- [JS168]: AI-Hypercomputer/jetstream-pytorch pull request 168, on a
  v5litepod-8, host, mean of 5.
- [RECIPES]: AI-Hypercomputer/tpu-recipes microbenchmarks, v6e-1, device
  time from the trace.

"host" rows include the host's dispatch of the call, about 100 us (C3: a
1024^3 GEMM takes 119.4 us of which "device work ~15 us" [PALLAS]). Dispatch
is not a chip cost: the chip model leaves it out and the pod side models it;
here it is added to the predicted device time to compare with a host row.

The MXU's rate (issue 29). A fresh op runs at e0 (``MXU_FRESH_EFFICIENCY``) of
the pipelined count's ideal rate. Under sustained load the chip cannot keep
that up: its MXU work averaged over a time constant tau (``MXU_BURST_SECONDS``)
is held to the sustained rate e1 of its generation
(``MXU_SUSTAINED_EFFICIENCY``), as a power- or clock-limited chip is held to
its budget. A lone GEMM of duration d from an idle start so runs at the mean
``e1 + (e0 - e1)(tau / d)(1 - exp(-d / tau))`` (C1-C4); a training step,
seconds of work repeated step after step, runs every MXU-bound op at e0 and is
held to ``MXU work / e1`` on average (``pod.report.clock``): a step with
enough other work (vector ops, HBM-bound ops, host transfers, exposed
collectives) between its matmuls stays below the budget and is not slowed, a
step that is nothing but matmuls runs at e1. The fall is so a property of the
work (how MXU-bound the step is), with one figure per generation, not a rate
every op of a generation runs at: issue 29's v6e rows (T5 at 67% MXU-bound
runs at e0, T6-T8 at 90%+ are held to e1) told the two apart.

Fit (``python benchmarks/fidelity.py --fit-mxu``; :func:`fit_step_clock`):
least squares in relative error over the GEMM rows C1, C2, C4 and the
published training steps T1-T9, M1-M3 (training-steps.md) at once; e0 and tau
shared by every generation (only v5e has GEMM rows), e1 per generation with
training rows, and the multislice jitter
(``interconnect.calibration.SLICE_STEP_JITTER``) on M1-M3 with them. The HBM
efficiency is fitted on the copy row C5.

Run ``python -m chip.calibration`` to print the fits and the published vs
predicted table (before: SCALE-Sim's count, spec bandwidth; after: the
presets as shipped); VALIDATION.md holds its output.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # chip.spec imports the constants below: chip.core and chip.spec are
    from chip.spec import ChipSpec  # imported where they are used, never at import time

__all__ = ["HOST_DISPATCH_SECONDS", "MXU_FRESH_EFFICIENCY", "MXU_BURST_SECONDS",
           "MXU_SUSTAINED_EFFICIENCY", "HBM_EFFICIENCY", "GemmRow", "CopyRow", "GEMM_ROWS",
           "COPY_ROWS", "MXU_FIT_ROW_IDS", "StepRow", "StepClockFit", "fit_step_clock",
           "fit_mxu_efficiency", "fit_hbm_efficiency", "predict_gemm_seconds",
           "predict_copy_seconds", "report"]

HOST_DISPATCH_SECONDS = 100e-6
"""Host dispatch per jitted call, seconds (C3 [PALLAS]); added to "host" rows only."""

# ------------------------------------------------------------------ the fitted constants
# Each is fitted, never set by hand: the comment names its rows (ids of measurements.md
# and training-steps.md) and `python benchmarks/fidelity.py --fit-mxu` prints the fit;
# tests/chip/test_calibration.py refits them and fails when one drifts. chip.spec's
# presets read them.

#: e0, a fresh op's MXU efficiency, every generation. Rows: C1, C2, C4 [PALLAS][JS168]
#: and every training row T1-T9, M1-M3 (the steps that stay below their budget, T5,
#: T6, T9, run at it); only v5e has GEMM rows, the other generations share it.
#: Fit: benchmarks/fidelity.py --fit-mxu.
MXU_FRESH_EFFICIENCY = 0.952

#: tau, the time constant of the fall from e0 to e1, seconds, every generation.
#: Rows: C1, C2, C4 (how far C4, 438 ms, has fallen and C1, 6 ms, has not).
#: Fit: benchmarks/fidelity.py --fit-mxu.
MXU_BURST_SECONDS = 0.188

#: e1, the MXU's sustained rate (fraction of the ideal pipelined rate) per generation.
#: Fit: benchmarks/fidelity.py --fit-mxu, each from its generation's rows:
#: v4: T9, M3 [MT-v4]; v5e: C1, C2, C4 with T3, T4, M1 [MT-v5e]; v5p: T1, T2, M2 [MT-v5p];
#: v6e: T5, T6, T7, T8 [TR-v6e][TR4][TR2][TR24]. v2 and v3 have no rows: they carry
#: v4's over (the oldest generation with rows), stated in chip.spec.
MXU_SUSTAINED_EFFICIENCY = {"v4": 0.6765, "v5e": 0.714, "v5p": 0.762, "v6e": 0.614}

#: Achieved HBM fraction of the spec bandwidth, every generation. Row: C5 [RECIPES]
#: (a.copy() of 32 MiB on v6e, 1359.6 GB/s of 1638e9): the only HBM measurement, so
#: C5 matches by construction and is no check. Fit: python -m chip.calibration.
HBM_EFFICIENCY = 0.8300


@dataclass(frozen=True)
class GemmRow:
    """One published single-chip bf16 GEMM (M x K) . (K x N).

    Attributes:
        row_id: Id in the calibration set, e.g. "C1".
        chip: Chip preset name.
        m, k, n: GEMM dimensions.
        published_s: The published time, seconds.
        timing: "host" (includes dispatch) or "device".
        source: Source key.
    """

    row_id: str
    chip: str
    m: int
    k: int
    n: int
    published_s: float
    timing: str
    source: str


@dataclass(frozen=True)
class CopyRow:
    """One published HBM copy: reads and writes `bytes_moved / 2` bytes each.

    Attributes:
        row_id: Id in the calibration set, e.g. "C5".
        chip: Chip preset name.
        bytes_moved: Bytes read plus bytes written.
        published_s: The published (device) time, seconds.
        source: Source key.
    """

    row_id: str
    chip: str
    bytes_moved: int
    published_s: float
    source: str


GEMM_ROWS = (
    GemmRow("C1", "v5e", 8192, 8192, 8192, 0.006047147869830951, "host", "[PALLAS]"),
    GemmRow("C2", "v5e", 4096, 4096, 4096, 0.0008272899803705514, "host", "[PALLAS]"),
    GemmRow("C3", "v5e", 1024, 1024, 1024, 0.00011943008983507753, "host", "[PALLAS]"),
    GemmRow("C4", "v5e", 32768, 32768, 32768, 438.17e-3, "host", "[JS168]"),
)
COPY_ROWS = (
    # a.copy() of 32 MiB: reads 32 MiB and writes 32 MiB, 0.049359414 ms median.
    CopyRow("C5", "v6e", 2 * 32 * 2**20, 0.049359414e-3, "[RECIPES]"),
)
MXU_FIT_ROW_IDS = ("C1", "C2", "C4")
"""GEMM rows the MXU efficiency is fitted on (C3 is dispatch-dominated)."""


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
    from chip.core import TensorCore
    from chip.spec import get_chip_spec

    spec = spec or get_chip_spec(row.chip)
    record = TensorCore(spec.core, execute=False, mxu_model=mxu_model).account_matmul(
        row.m, row.k, row.n)
    dispatch = HOST_DISPATCH_SECONDS if row.timing == "host" else 0.0
    return record.seconds + dispatch, record.bound


def predict_copy_seconds(row: CopyRow, spec: ChipSpec | None = None) -> float:
    """Predicted device time of a copy row: a memory-bound VPU op of float32 elements."""
    from chip.core import TensorCore
    from chip.spec import get_chip_spec

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
    from chip.core import TensorCore
    from chip.spec import get_chip_spec

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


@dataclass(frozen=True)
class StepRow:
    """A published training step, reduced to what the step clock's fit needs.

    Costed once by the timing-only pod at a fresh-op efficiency ``e_ref``, one
    slice's step before the sustained budget and the slices' wait takes
    ``step_seconds``, of which ``mxu_seconds`` are MXU-bound op records. At
    other constants (e0, e1, jitter) the step is (:meth:`predicted`)::

        max(step - mxu + W / e0,  W / e1) x (1 + jitter x slice_factor)

    with ``W = mxu x e_ref`` the MXU work in ideal seconds: the step runs its
    matmuls at e0 unless that puts the MXU's average over the step above its
    sustained rate e1 (then the step is the MXU work at e1, what
    ``pod.report.clock`` does), and a job of several slices waits for the slowest
    (``interconnect.dcn.slice_wait_seconds``). The rest of the step (its other
    records, exposed collectives and host transfers) does not move with e0.
    ``benchmarks/fidelity.py --fit-mxu`` measures the rows.

    Attributes:
        row_id: T1-T9, M1-M3 (training-steps.md).
        chip: chip generation.
        step_seconds, mxu_seconds: the step and its MXU-bound part at ``e_ref``
            (one slice, no budget, no wait for other slices).
        e_ref: the fresh-op efficiency they were costed at.
        published_s: the published step (the row's MaxText FLOPs / its TFLOP/s).
        slice_factor: the expected maximum of as many standard normals as the
            job has slices (``interconnect.dcn.expected_max_standard_normal``; 0 for
            one slice).
    """

    row_id: str
    chip: str
    step_seconds: float
    mxu_seconds: float
    e_ref: float
    published_s: float
    slice_factor: float = 0.0

    def predicted(self, e0: float, e1: float, jitter: float = 0.0) -> float:
        """The step at fresh-op efficiency ``e0``, sustained rate ``e1`` and slice
        jitter ``jitter`` (a fraction of the step), seconds."""
        work = self.mxu_seconds * self.e_ref
        free = self.step_seconds - self.mxu_seconds + work / e0
        return max(free, work / e1) * (1.0 + jitter * self.slice_factor)


@dataclass(frozen=True)
class StepClockFit:
    """The step clock's constants fitted on GEMM rows and training steps together.

    Attributes:
        efficiency: e0, a fresh op's MXU efficiency (``MXU_FRESH_EFFICIENCY``).
        burst_seconds: tau, the time constant of the fall (``MXU_BURST_SECONDS``).
        sustained: generation -> e1 (``MXU_SUSTAINED_EFFICIENCY``), for every
            generation with training rows.
        slice_jitter: the spread of one slice's step, a fraction of it
            (``interconnect.calibration.SLICE_STEP_JITTER``); 0 without
            multislice rows.
        rms_error: root-mean-square relative error over every row fitted.
    """

    efficiency: float
    burst_seconds: float
    sustained: dict[str, float]
    slice_jitter: float
    rms_error: float


def _gemm_fit_parts(row_ids: tuple[str, ...]) -> list[tuple[float, float, float]]:
    """(ideal MXU seconds at efficiency 1, fixed seconds, published) of GEMM rows."""
    from chip.core import TensorCore
    from chip.spec import get_chip_spec

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
    from chip.spec import get_chip_spec

    ideal = [r.bytes_moved / get_chip_spec(r.chip).core.hbm_bandwidth_bytes_per_s for r in rows]
    return _least_squares_reciprocal(ideal, [0.0] * len(rows), [r.published_s for r in rows])


def report() -> str:
    """The fits and a Markdown table of published vs predicted rows, before and after.

    "before" is the model without this calibration: SCALE-Sim's per-fold MXU
    count and the spec HBM bandwidth (the GEMM rows are compute-bound, so the
    output bytes do not change them). "after" is the presets as shipped.
    """
    from chip.spec import get_chip_spec

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

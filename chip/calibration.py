"""Published single-chip measurements and the fit of the chip's calibrated constants.

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

Two constants of `chip.spec` are fitted on these rows (one per effect, each
on the generation that has rows, carried over to the others):

- `TensorCoreSpec.mxu_efficiency`: least squares in relative error of
  (predicted device time + dispatch) against the host-timed v5e GEMMs C1,
  C2, C4. The model is t = t_ideal / e + dispatch, with t_ideal the
  "pipelined" MXU time at efficiency 1, so x = 1 / e solves a one-variable
  linear least-squares problem in closed form. C3 is left out: its device
  time is small beside dispatch, so it says little about e.
- `TensorCoreSpec.hbm_efficiency`: the same fit of t = bytes / (bandwidth *
  e) on the v6e copy C5; with one row it is bytes / (bandwidth * t).

Run `python -m chip.calibration` to print the fits and the published vs
predicted table (before: SCALE-Sim's count, spec bandwidth; after: the
presets as shipped); VALIDATION.md holds its output.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from chip.core import TensorCore
from chip.spec import ChipSpec, get_chip_spec

HOST_DISPATCH_SECONDS = 100e-6
"""Host dispatch per jitted call, seconds (C3 [PALLAS]); added to "host" rows only."""


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


@dataclass(frozen=True)
class StepRow:
    """A published training step, reduced to what the MXU fit needs.

    A step costed at a reference sustained efficiency ``e_ref`` takes
    ``step_seconds``, of which ``mxu_seconds`` are MXU-bound records; at another
    sustained efficiency e it takes ``step_seconds + mxu_seconds (e_ref / e - 1)``
    (the rest of the step does not move: its collectives are hidden behind the
    compute). ``benchmarks/fidelity.py --fit-mxu`` measures these with the
    timing-only pod.

    Attributes:
        row_id: T1-T5, M1-M2 (training-steps.md).
        chip: chip generation.
        step_seconds, mxu_seconds: the step and its MXU-bound part at ``e_ref``.
        e_ref: the sustained efficiency they were costed at.
        published_s: the published step (the row's MaxText FLOPs / its TFLOP/s).
    """

    row_id: str
    chip: str
    step_seconds: float
    mxu_seconds: float
    e_ref: float
    published_s: float

    def predicted(self, e: float) -> float:
        """The step at sustained efficiency ``e``, seconds."""
        return self.step_seconds + self.mxu_seconds * (self.e_ref / e - 1.0)


@dataclass(frozen=True)
class MxuFit:
    """The MXU's efficiencies fitted on GEMM rows and training steps together.

    Attributes:
        efficiency: e0, a fresh op's (``TensorCoreSpec.mxu_efficiency``, v5e).
        burst_seconds: tau, the time constant of the fall (``mxu_burst_seconds``).
        sustained: generation -> e1, its sustained efficiency
            (``mxu_sustained_efficiency``) for the generations with training rows.
        rms_error: root-mean-square relative error over every row fitted.
    """

    efficiency: float
    burst_seconds: float
    sustained: dict[str, float]
    rms_error: float


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


def fit_mxu_sustained(steps: tuple[StepRow, ...], row_ids: tuple[str, ...] = MXU_FIT_ROW_IDS,
                      gemm_chip: str = "v5e") -> MxuFit:
    """Fit e0, tau and each generation's e1 on the GEMM rows and the training steps at once.

    A GEMM of ideal time t (efficiency 1) takes t / e(d) + dispatch with e(d)
    the mean efficiency over its duration d = t / e0 from an idle start
    (``TensorCoreSpec.mxu_efficiency_over``); a training step takes
    ``StepRow.predicted(e1)`` of its generation. Least squares in relative error
    over every row, by grid search (e0 and e1 to 0.001, tau on a log grid);
    ``gemm_chip``'s e1 is shared by its GEMM and step rows, every other
    generation's e1 is fitted on its steps alone (they have no GEMM rows).

    Raises:
        ValueError: no training step of ``gemm_chip``.
    """
    import numpy as np

    gemms = _gemm_fit_parts(row_ids)
    by_chip: dict[str, list[StepRow]] = {}
    for row in steps:
        by_chip.setdefault(row.chip, []).append(row)
    if gemm_chip not in by_chip:
        raise ValueError(f"no training step of {gemm_chip} to fit its sustained efficiency")
    e1s = np.arange(0.500, 1.0005, 0.001)

    def step_sq(rows: list[StepRow], e1: np.ndarray) -> np.ndarray:
        return sum((((r.step_seconds - r.mxu_seconds + r.mxu_seconds * r.e_ref / e1)
                     / r.published_s - 1.0) ** 2 for r in rows), np.zeros_like(e1))

    best: tuple[float, float, float, float] | None = None
    for tau in np.geomspace(1e-3, 10.0, 121):
        for e0 in np.arange(0.850, 1.0005, 0.001):
            e1 = e1s[e1s <= e0 + 1e-12]
            sq = step_sq(by_chip[gemm_chip], e1)
            for ideal, fixed, published in gemms:
                d = ideal / e0
                x = d / tau
                mean = e1 + (e0 - e1) * (-np.expm1(-x)) / x
                sq = sq + ((ideal / mean + fixed) / published - 1.0) ** 2
            k = int(np.argmin(sq))
            if best is None or sq[k] < best[0]:
                best = (float(sq[k]), float(e0), float(tau), float(e1[k]))
    assert best is not None  # the first (tau, e0) sets it
    total, e0, tau, e1_gemm = best
    sustained = {gemm_chip: round(e1_gemm, 3)}
    for chip, rows in by_chip.items():
        if chip != gemm_chip:
            e1 = e1s[e1s <= e0 + 1e-12]
            sq = step_sq(rows, e1)
            k = int(np.argmin(sq))
            sustained[chip], total = round(float(e1[k]), 3), total + float(sq[k])
    n = len(gemms) + len(steps)
    return MxuFit(round(e0, 3), float(f"{tau:.3g}"), sustained, (total / n) ** 0.5)


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

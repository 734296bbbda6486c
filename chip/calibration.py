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
every op of a generation runs at: issue 29's v6e rows told the two apart (T5,
67% MXU-bound at e0, is held 3% beyond its step at e0; T6-T8, 84-94%, 24-41%):
one rate for every op held them out to 20%, the budget to 13%.

Fit (``python benchmarks/fidelity.py --fit-mxu``; ``chip.fitting.fit_step_clock``):
least squares in relative error over the GEMM rows C1, C2, C4 and the
published training steps T1-T9, M1-M3 (training-steps.md) at once; e0 and tau
shared by every generation (only v5e has GEMM rows), e1 per generation with
training rows, and the multislice jitter
(``interconnect.calibration.SLICE_STEP_JITTER``) on M1-M3 with them. The HBM
efficiency is fitted on the copy row C5.

``chip.fitting`` fits them again (``python -m chip.fitting`` prints the fits and the
published vs predicted table: before, SCALE-Sim's count and the spec bandwidth;
after, the presets as shipped; VALIDATION.md holds its output). This module holds
the rows and the constants only: ``chip.spec`` imports it, so it imports nothing of
the chip's.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["HOST_DISPATCH_SECONDS", "MXU_FRESH_EFFICIENCY", "MXU_BURST_SECONDS",
           "MXU_SUSTAINED_EFFICIENCY", "HBM_EFFICIENCY", "GemmRow", "CopyRow", "GEMM_ROWS",
           "COPY_ROWS", "MXU_FIT_ROW_IDS", "StepRow", "StepClockFit"]

HOST_DISPATCH_SECONDS = 100e-6
"""Host dispatch per jitted call, seconds (C3 [PALLAS]); added to "host" rows only."""

# ------------------------------------------------------------------ the fitted constants
# Each is fitted, never set by hand: the comment names its rows (ids of measurements.md
# and training-steps.md) and `python benchmarks/fidelity.py --fit-mxu` prints the fit;
# tests/chip/test_calibration.py refits them and fails when one drifts. chip.spec's
# presets read them.

#: e0, a fresh op's MXU efficiency, every generation. Rows: C1, C2, C4 [PALLAS][JS168],
#: fitted with every training row T1-T9, M1-M3 (a step below its budget would run at e0;
#: today every row is held by its budget, T5 only just); only v5e has GEMM rows, the
#: other generations share it. Fit: benchmarks/fidelity.py --fit-mxu.
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
MXU_SUSTAINED_EFFICIENCY = {"v4": 0.6765, "v5e": 0.714, "v5p": 0.762, "v6e": 0.6095}

#: Achieved HBM fraction of the spec bandwidth, every generation. Row: C5 [RECIPES]
#: (a.copy() of 32 MiB on v6e, 1359.6 GB/s of 1638e9): the only HBM measurement, so
#: C5 matches by construction and is no check. Fit: chip.fitting.fit_hbm_efficiency.
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

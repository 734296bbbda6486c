"""Fidelity: the emulator's predictions beside every published TPU measurement it covers.

For each row of the calibration set (rows C1-C14, S1-S2 of the project's
measurement notes; sources [PALLAS], [JS168], [RECIPES], [SB-prof],
[SB-shard], [MARIN], [GC-v5e], [GC-v6e]) it prints the id, source, setup, the
equivalent emulator command, the published time, the predicted time and the
signed error, then the mean absolute error and the worst row.

- GEMM rows C1-C4 and the HBM row C5 are costed by the ``chip`` package's
  public API (``TensorCore.account_matmul`` / ``account_vector``).
- Collective rows C6-C14 are costed by ``interconnect.collective_cost`` on
  the calibrated link (``interconnect.calibrated_link``) as XLA runs them:
  reduce-scatter, all-gather and allreduce with the ``"torus"`` algorithm
  (every torus axis of the slice at once, both directions; lines where the
  slice has no wraparound [SB] sharding.md), ppermute directly. With
  ``--fastest`` the fastest of the ring, bidirectional-ring and torus
  algorithms instead, as ``tpu-pod collective`` picks without
  ``--algorithm`` (the reading of the calibration before issue 23).
- Rows timed from the host ("host") include Python dispatch: the prediction
  adds :data:`HOST_DISPATCH_SECONDS` once per call (C3: 119.4 us measured for about
  15 us of device work).
- C8 and C10 are costed as the allreduces torch_xla runs for the benchmark's
  ``all_gather`` (``xla_model._all_gather_using_all_reduce``); ``--as-all-gather``
  costs the native all-gather instead.
- S1-S2 are specifications ("All-reduce bandwidth per Pod"), not
  measurements: shown against the emulator's total one-way link bandwidth,
  kept out of the error statistics.
- Training rows T1-T9, M1-M3 (training-steps.md) are costed timing-only from
  their scenarios at their published batch and remat (the HBM plan admits every
  one). ``--fit-mxu`` fits the step clock's constants on the GEMM rows
  and every training row at once (``chip.fitting.fit_step_clock``), and
  with ``--held-out`` predicts each row by a fit without it.

Usage::

    python benchmarks/fidelity.py              # the table
    python benchmarks/fidelity.py --markdown   # the table for VALIDATION.md
    python benchmarks/fidelity.py --json       # machine-readable rows
    python benchmarks/fidelity.py --fit        # fit the ICI constants on the collective rows
    python benchmarks/fidelity.py --readings   # the collective rows under both readings
    python benchmarks/fidelity.py --fastest    # collectives by the fastest algorithm, not XLA's
    python benchmarks/fidelity.py --training   # only the whole training steps T1-T9, M1-M3
    python benchmarks/fidelity.py --fit-mxu --held-out   # the step clock's fit, each row held
                                                         # out (--json: the held_out map)
    python benchmarks/fidelity.py --baseline DIR   # collective rows with another interconnect/
                                                   # (e.g. an old commit's, exported to DIR), ideal link
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

sys.path.insert(0, ROOT)
from chip import get_chip_spec  # noqa: E402
from chip.calibration import HOST_DISPATCH_SECONDS  # noqa: E402  (one home: the chip's calibration)

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30

# nominal one-way ICI link bandwidths [SB]: the chip presets' own figures
LINK_BYTES_PER_S = {g: get_chip_spec(g).ici_link_bandwidth_bytes_per_s for g in ("v2", "v5e", "v5p", "v6e")}
HOP_LATENCY_S = 1e-6  # [SB]

#: The algorithm XLA runs a reduce-scatter, all-gather or allreduce with on a TPU slice:
#: every torus axis at once, both directions ([SB] sharding.md, "multi-axis torus").
XLA_ALGORITHM = "torus"

#: DMA streams tried by ``--fit`` (links a chip drives at once at the full rate).
FIT_DMA_STREAMS = (1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0)

#: Generations whose fixed cost the data constrain: each has a row of a few microseconds
#: (C7; C12-C13; C14). Others (v2: only C6, 1.13 ms) get the mean of these.
FIXED_COST_GENERATIONS = ("v5e", "v5p", "v6e")


@dataclass(frozen=True)
class Collective:
    """One collective row: what runs where.

    Attributes:
        generation: chip generation, e.g. "v5e".
        shape: torus shape.
        wraparound: per axis (small slices have none [SB]).
        op: interconnect op name.
        size_bytes: the buffer (all-gather: the gathered output), as ``--sizes``.
        itemsize: bytes per element of the published dtype.
        axis: ppermute axis.
    """

    generation: str
    shape: tuple[int, ...]
    wraparound: bool
    op: str
    size_bytes: int
    itemsize: int = 2
    axis: int = 0


@dataclass(frozen=True)
class Row:
    """One line of the table (seconds are simulated or published, never wall-clock here)."""

    id: str
    source: str
    setup: str
    command: str
    published_s: float
    timing: str  # "device" or "host"
    kind: str  # "gemm", "hbm", "collective", "spec"
    collective: Collective | None = None
    note: str = ""


def _cli_op(op: str) -> str:
    return op.replace("_", "-")


def _collective_row(rid, source, setup, published_s, timing, c: Collective, note="") -> Row:
    shape = "x".join(map(str, c.shape))
    size = _size_text(c.size_bytes)
    algorithm = "" if c.op == "ppermute" else f" --algorithm {XLA_ALGORITHM}"
    command = (f"tpu-pod collective --chip {c.generation} --topology {shape} --op {_cli_op(c.op)} "
               f"--sizes {size}{algorithm}")
    return Row(rid, source, setup, command, published_s, timing, "collective", c, note)


def _size_text(nbytes: int) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def rows() -> list[Row]:
    """The calibration set as the model covers it."""
    gemm = "tpu-pod matmul --chip v5e --m {0} --k {0} --n {0}"
    out = [
        Row("C1", "[PALLAS]", "v5e matmul 8192^3 bf16", gemm.format(8192), 6.047e-3, "host", "gemm"),
        Row("C2", "[PALLAS]", "v5e matmul 4096^3 bf16", gemm.format(4096), 0.827e-3, "host", "gemm"),
        Row("C3", "[PALLAS]", "v5e matmul 1024^3 bf16", gemm.format(1024), 119.4e-6, "host", "gemm"),
        Row("C4", "[JS168]", "v5e matmul 32768^3 bf16", gemm.format(32768), 438.17e-3, "host", "gemm"),
        Row("C5", "[RECIPES]", "v6e a.copy() 32 MiB", "python -c 'TensorCore(get_chip_spec(\"v6e\").core)"
            ".account_vector(\"copy\", 8 << 20, 64 << 20)'", 49.36e-6, "device", "hbm"),
        _collective_row("C6", "[SB-prof]", "v2, 2 devices, reduce-scatter bf16[8,1024,8192]", 1.13e-3, "device",
                        Collective("v2", (2,), False, "reduce_scatter", 8 * 1024 * 8192 * 2)),
        _collective_row("C7", "[SB-shard]", "v5e axis of 4 (no wrap), all-gather 128 KiB", 8e-6, "device",
                        Collective("v5e", (4,), False, "all_gather", 128 * KIB)),
        _collective_row("C8", "[JS168]", "v5e 2x4, all_gather bf16 2 GiB gathered (torch_xla: allreduce)",
                        68.3381e-3, "host", Collective("v5e", (2, 4), False, "allreduce", 2 * GIB)),
        _collective_row("C9", "[JS168]", "v5e 2x4, int8 psum 128 MiB per chip", 4.34715e-3, "host",
                        Collective("v5e", (2, 4), False, "allreduce", 128 * MIB, itemsize=1)),
        _collective_row("C10", "[JS168]", "v5e 2x4, int8 all_gather 1 GiB gathered (torch_xla: allreduce)",
                        34.4571e-3, "host",
                        Collective("v5e", (2, 4), False, "allreduce", GIB, itemsize=1)),
        _collective_row("C11", "[MARIN]", "v5p-8 (2x2x1), ppermute one hop, 64 MiB", 781.98e-6, "device",
                        Collective("v5p", (2, 2, 1), False, "ppermute", 64 * MIB)),
        _collective_row("C12", "[MARIN]", "v5p-8 (2x2x1), ppermute one hop, 1 MiB", 16.94e-6, "device",
                        Collective("v5p", (2, 2, 1), False, "ppermute", MIB)),
        _collective_row("C13", "[MARIN]", "v5p-8, ppermute one hop, 1-16 KiB: 4.5-5.5 us (mid, at 8 KiB)",
                        5.0e-6, "device", Collective("v5p", (2, 2, 1), False, "ppermute", 8 * KIB)),
        _collective_row("C14", "[MARIN]", "v6e-8 (2x4), ppermute fit intercept (2 bytes)", 2.29e-6, "device",
                        Collective("v6e", (2, 4), False, "ppermute", 2)),
        Row("S1", "[GC-v5e]", "v5e pod 16x16, 'All-reduce bandwidth per Pod' 51.2 TB/s (spec)",
            "emulator: chips x links x one-way link bandwidth", 51.2e12, "spec", "spec",
            Collective("v5e", (16, 16), True, "allreduce", 0)),
        Row("S2", "[GC-v6e]", "v6e pod 16x16, 'All-reduce bandwidth per Pod' 102.4 TB/s (spec)",
            "emulator: chips x links x one-way link bandwidth", 102.4e12, "spec", "spec",
            Collective("v6e", (16, 16), True, "allreduce", 0)),
    ]
    return out


# ---------------------------------------------------------------------------- predictions


def _import_interconnect(path: str | None):
    if path:
        sys.path.insert(0, path)
    else:
        sys.path.insert(0, ROOT)
    import interconnect  # noqa: PLC0415

    return interconnect


def _ppermute_schedule(ic, torus, num_elements: int, itemsize: int, axis: int):
    """A one-phase ppermute built from plain Transfers (for interconnects without the op)."""
    ranks = np.arange(torus.num_chips).reshape(torus.shape)
    sources = np.roll(ranks, 1, axis=axis).reshape(-1)
    phase = tuple(ic.Transfer(int(s), int(d), 0, num_elements * itemsize, False)
                  for s, d in zip(sources.tolist(), ranks.reshape(-1).tolist()) if s != d)
    return ic.Schedule("ppermute", torus.num_chips, num_elements, itemsize, ((0, num_elements),), (phase,))


def collective_seconds(ic, c: Collective, link, fastest: bool = False) -> tuple[float, str]:
    """(simulated seconds, algorithm) of a collective row: XLA's algorithm, or with
    ``fastest`` the fastest one as the CLI picks it without ``--algorithm``."""
    torus = ic.Torus(c.shape, c.wraparound)
    num_elements = c.size_bytes // c.itemsize
    if c.op == "ppermute":
        if "ppermute" in getattr(ic, "OPS", ()):
            return ic.collective_cost("ppermute", torus, num_elements, link, itemsize=c.itemsize,
                                      axis=c.axis).seconds, "direct"
        return ic.schedule_cost(_ppermute_schedule(ic, torus, num_elements, c.itemsize, c.axis), torus,
                                link).seconds, "direct"
    best = None
    for algorithm in ic.ALGORITHMS[c.op]:
        if (c.op, algorithm) not in ic.FAST_PATHS or (not fastest and algorithm != XLA_ALGORITHM):
            continue
        seconds = ic.collective_cost(c.op, torus, num_elements, link, algorithm=algorithm,
                                     itemsize=c.itemsize).seconds
        if best is None or seconds < best[0]:
            best = (seconds, algorithm)
    return best


def gemm_seconds(n: int) -> float:
    sys.path.insert(0, ROOT)
    from chip import TensorCore, get_chip_spec  # noqa: PLC0415

    return TensorCore(get_chip_spec("v5e").core, numerics=False).account_matmul(n, n, n).seconds


def copy_seconds() -> float:
    sys.path.insert(0, ROOT)
    from chip import TensorCore, get_chip_spec  # noqa: PLC0415

    core = TensorCore(get_chip_spec("v6e").core, numerics=False)
    return core.account_vector("copy", (32 * MIB) // 4, 64 * MIB).seconds  # float32 elements; read + write


@dataclass(frozen=True)
class Result:
    id: str
    source: str
    setup: str
    command: str
    published_s: float
    predicted_s: float
    error_pct: float
    timing: str
    in_stats: bool
    algorithm: str = ""
    note: str = ""


def predict(row: Row, ic, link_for: Callable[[str], object], fastest: bool = False) -> tuple[float, str]:
    host = HOST_DISPATCH_SECONDS if row.timing == "host" else 0.0
    if row.kind == "gemm":
        n = {"C1": 8192, "C2": 4096, "C3": 1024, "C4": 32768}[row.id]
        return gemm_seconds(n) + host, "mxu"
    if row.kind == "hbm":
        return copy_seconds(), "hbm"
    if row.kind == "spec":
        torus = ic.Torus(row.collective.shape, row.collective.wraparound)
        return len(torus.links()) * LINK_BYTES_PER_S[row.collective.generation], "links"
    seconds, algorithm = collective_seconds(ic, row.collective, link_for(row.collective.generation), fastest)
    return seconds + host, algorithm


NOTES = {
    "C4": "fitted with the training steps: a GEMM's MXU rate falls from e0 towards the sustained e1 "
          "with time constant tau (chip.calibration): 81.7% of peak over 438 ms",
    "C5": "fitted on this row (the only HBM measurement): hbm_efficiency 0.83, not a check",
    "C8": "jetstream-pytorch runs on torch_xla, whose xla_model.all_gather (pin_layout=True, no "
          "output) is _all_gather_using_all_reduce: the buffer padded with zeros to the gathered size "
          "and all-reduced (torch_xla 2.9.0); costed so. C10 / C9 = 7.9, the ratio of those allreduces "
          "(8), where all-gathers would give 4. As the native all-gather (--as-all-gather): -50%",
    "C10": "as C8",
    "S1": "a specification: matches 256 chips x 4 links x 50 GB/s; [SB] gives 45 GB/s per link",
    "S2": "a specification: matches 256 chips x 4 links x 100 GB/s; [SB] gives 90 GB/s per link",
}


def run(ic, link_for, *, collective_only: bool = False, as_all_gather: bool = False,
        fastest: bool = False) -> list[Result]:
    out = []
    for row in rows():
        if collective_only and row.kind != "collective":
            continue
        if as_all_gather and row.id in ("C8", "C10"):
            c = row.collective
            row = Row(row.id, row.source, row.setup + " [read as the native all-gather]",
                      row.command.replace("--op allreduce", "--op all-gather"), row.published_s,
                      row.timing, row.kind, Collective(c.generation, c.shape, c.wraparound,
                                                       "all_gather", c.size_bytes, c.itemsize),
                      row.note)
        if fastest and row.kind == "collective":
            row = Row(row.id, row.source, row.setup, row.command.replace(f" --algorithm {XLA_ALGORITHM}", ""),
                      row.published_s, row.timing, row.kind, row.collective, row.note)
        predicted, algorithm = predict(row, ic, link_for, fastest)
        error = (predicted - row.published_s) / row.published_s * 100
        out.append(Result(row.id, row.source, row.setup, row.command, row.published_s, predicted, error,
                          row.timing, row.kind != "spec", algorithm, NOTES.get(row.id, "")))
    return out


# ------------------------------------------------------------------------------------- fit


def fit(ic, fastest: bool = False) -> dict:
    """Least squares of the relative error over the collective rows (C8, C10 the allreduces they ran as).

    Per row the cost splits into parts measured with three ideal-link runs:
    latency ``L`` (hops x 1 us), and per phase the bandwidth seconds ``b_p`` at
    the nominal bandwidth and the links ``k_p`` one chip drives. With
    efficiency ``e``, exponent ``g`` and ``S`` DMA streams the row costs
    ``L + sum_p b_p k_p^g / min(1, S / k_p) / e + fixed(generation) + host``.
    A grid over (``e``, ``g``, ``S``); for each, the fixed cost per generation
    minimising the squared relative error is a weighted mean (clipped at 0).
    Ties keep the smallest ``g`` and ``S``: the ``S`` printed is the fewest
    streams the rows allow, a lower bound when it equals the most links any
    row drives (``multi_link_cap``).
    """
    parts = _fit_parts(ic, fastest)
    pub = np.array([row.published_s for row, *_ in parts])
    generations = [g for g in FIXED_COST_GENERATIONS if any(gg == g for _, gg, *_ in parts)]
    efficiencies = np.arange(0.50, 1.0001, 0.0025)                                  # (E,)
    best = None
    for streams in FIT_DMA_STREAMS:
        for g in np.arange(0.0, 1.0001, 0.005):
            bandwidth = np.array([float((b * k ** g / np.minimum(1.0, streams / k)).sum())
                                  for _, _, b, k, _, _ in parts])
            fixed_cost = np.array([lat + host for *_, lat, host in parts])
            base = fixed_cost[None, :] + bandwidth[None, :] / efficiencies[:, None]   # (E, rows)
            fixed = {}
            for gen in generations:
                sel = np.array([gg == gen for _, gg, *_ in parts])
                weights = 1 / pub[sel] ** 2
                fixed[gen] = np.maximum(((pub[sel] - base[:, sel]) * weights).sum(axis=1) / weights.sum(), 0.0)
            default = np.mean(list(fixed.values()), axis=0)
            pred = base + np.stack([fixed.get(gg, default) for _, gg, *_ in parts], axis=1)
            sse = (((pred - pub) / pub) ** 2).sum(axis=1)                           # (E,)
            i = int(np.argmin(sse))
            if best is None or sse[i] < best[0] - 1e-15:
                best = (float(sse[i]), float(efficiencies[i]), float(g), streams,
                        {k: float(v[i]) for k, v in fixed.items()}, pred[i])
    sse, e, g, streams, fixed, pred = best
    return {
        "multi_link_cap": int(max(float(k.max()) for _, _, _, k, _, _ in parts)),
        "efficiency": round(e, 4), "multi_link_exponent": round(g, 4), "dma_streams": streams,
        "fixed_s_by_generation": {k: float(f"{v:.3g}") for k, v in fixed.items()},
        "default_fixed_s": float(f"{np.mean(list(fixed.values())):.3g}"),
        "rms_relative_error": math.sqrt(sse / len(parts)),
        "rows": {row.id: round(float((p - q) / q * 100), 2) for (row, *_), p, q in zip(parts, pred, pub)},
    }


def _fit_parts(ic, fastest: bool) -> list[tuple]:
    """Per collective row: (row, generation, b (P,), k (P,), latency, host) for :func:`fit`."""
    parts = []
    for row in rows():
        if row.kind != "collective":
            continue
        c = row.collective
        w = LINK_BYTES_PER_S[c.generation]
        algorithm_cost = {}
        for name, link in (("bw", ic.LinkSpec(w, 0.0)), ("k", ic.LinkSpec(w, 0.0, multi_link_exponent=1.0)),
                           ("lat", ic.LinkSpec(1e30, HOP_LATENCY_S))):
            algorithm_cost[name] = _phase_seconds(ic, c, link, fastest)
        b = np.array(algorithm_cost["bw"])
        k = np.where(b > 0, np.array(algorithm_cost["k"]) / np.where(b > 0, b, 1), 1.0)
        latency = float(sum(algorithm_cost["lat"]))
        parts.append((row, c.generation, b, np.rint(k), latency, HOST_DISPATCH_SECONDS if row.timing == "host" else 0.0))
    return parts


def _phase_seconds(ic, c: Collective, link, fastest: bool = False) -> list[float]:
    """Per-phase seconds of the row's collective (the algorithm the calibrated run picks)."""
    torus = ic.Torus(c.shape, c.wraparound)
    num_elements = c.size_bytes // c.itemsize
    if c.op == "ppermute":
        return list(ic.collective_cost("ppermute", torus, num_elements, link, itemsize=c.itemsize,
                                       axis=c.axis).phase_seconds)
    calibrated = ic.calibrated_link(c.generation, LINK_BYTES_PER_S[c.generation], HOP_LATENCY_S)
    _, algorithm = collective_seconds(ic, c, calibrated, fastest)
    return list(ic.collective_cost(c.op, torus, num_elements, link, algorithm=algorithm,
                                   itemsize=c.itemsize).phase_seconds)


# --------------------------------------------------------------- the two readings (issue 29)

#: 2-D tori the readings part on most: a full v5e / v6e pod (wraparound, 4 links a chip) and a
#: v6e-16 (4x4, no wraparound). No published measurement of them is in the calibration set.
READING_EXAMPLES = (("v5e", (16, 16), True), ("v6e", (16, 16), True), ("v6e", (4, 4), False))


def reading_links(ic) -> dict:
    """The two readings' calibrated links, each fitted on the collective rows (:func:`fit`):
    "A" XLA's algorithm (every torus axis at once, both directions; the committed
    ``interconnect.calibration``), "B" the fastest algorithm with the multi-link loss it
    needs (``fit(fastest=True)``), and "A, streams unlimited" (issue 23's constants: the
    same fit with the DMA streams never binding)."""
    b = fit(ic, fastest=True)
    cal_b = ic.calibration.Calibration(
        efficiency=b["efficiency"], multi_link_exponent=b["multi_link_exponent"],
        multi_link_cap=float(b["multi_link_cap"]), fixed_s_by_generation=b["fixed_s_by_generation"],
        default_fixed_s=b["default_fixed_s"], dma_streams=math.inf)
    cal_a = ic.calibration.CALIBRATION
    unlimited = dataclasses.replace(cal_a, dma_streams=math.inf)

    def link(cal):
        return lambda g: ic.calibrated_link(g, LINK_BYTES_PER_S[g], HOP_LATENCY_S, calibration=cal)

    return {"A": (link(cal_a), False), "B": (link(cal_b), True),
            "A, streams unlimited": (link(unlimited), False)}


def print_readings(ic, markdown: bool) -> None:
    """Every collective row under both readings, and the 2-D tori where they part."""
    links = reading_links(ic)
    header = ("id", "setup", "published", *(f"{name}: predicted, error" for name in links))
    lines = []
    for row in rows():
        if row.kind != "collective":
            continue
        cells = []
        for link_for, fastest in links.values():
            seconds, algorithm = collective_seconds(ic, row.collective,
                                                    link_for(row.collective.generation), fastest)
            seconds += HOST_DISPATCH_SECONDS if row.timing == "host" else 0.0
            cells.append(f"{_one_seconds(seconds)} {algorithm}, "
                         f"{(seconds / row.published_s - 1) * 100:+.1f}%")
        lines.append((row.id, row.setup, _one_seconds(row.published_s), *cells))
    for generation, shape, wraps in READING_EXAMPLES:
        c = Collective(generation, shape, wraps, "allreduce", 256 * MIB)
        cells = []
        for link_for, fastest in links.values():
            seconds, algorithm = collective_seconds(ic, c, link_for(generation), fastest)
            cells.append(f"{_one_seconds(seconds)} {algorithm}")
        wrap = "wraparound" if wraps else "no wraparound"
        lines.append(("-", f"{generation} {'x'.join(map(str, shape))} ({wrap}), allreduce 256 MiB bf16",
                      "(none)", *cells))
    _print_rows(header, lines, markdown)


# ----------------------------------------------------------------------------------- output


def summary(results: list[Result]) -> tuple[float, Result]:
    stats = [r for r in results if r.in_stats]
    mae = sum(abs(r.error_pct) for r in stats) / len(stats)
    worst = max(stats, key=lambda r: abs(r.error_pct))
    return mae, worst


def _fmt_seconds(row: Result) -> tuple[str, str]:
    if row.timing == "spec":
        return f"{row.published_s / 1e12:.1f} TB/s", f"{row.predicted_s / 1e12:.1f} TB/s"

    return _one_seconds(row.published_s), _one_seconds(row.predicted_s)


def _one_seconds(s: float) -> str:
    return f"{s * 1e3:.4g} ms" if s >= 1e-3 else f"{s * 1e6:.4g} us"


def print_table(results: list[Result], markdown: bool) -> None:
    header = ("id", "source", "setup", "emulator command", "timing", "published", "predicted", "error")
    lines = []
    for r in results:
        pub, pred = _fmt_seconds(r)
        err = f"{r.error_pct:+.1f}%" + ("" if r.in_stats else " (spec)")
        lines.append((r.id, r.source, r.setup, f"`{r.command}`" if markdown else r.command, r.timing, pub, pred,
                      err))
    mae, worst = summary(results)
    if markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "|".join("---" for _ in header) + "|")
        for line in lines:
            print("| " + " | ".join(line) + " |")
        print()
        print(f"Mean absolute error {mae:.1f}% over {sum(r.in_stats for r in results)} rows "
              f"(S1-S2 excluded); worst row {worst.id} {worst.error_pct:+.1f}%.")
        return
    widths = [max(len(str(x)) for x in col) for col in zip(header, *lines)]
    for line in [header, *lines]:
        print("  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip())
    print(f"\nmean absolute error {mae:.1f}% over {sum(r.in_stats for r in results)} rows (S1-S2 excluded); "
          f"worst row {worst.id} {worst.error_pct:+.1f}%")
    for r in results:
        if r.note:
            print(f"  {r.id}: {r.note}")


# ------------------------------------------------------------------------ training steps


@dataclass(frozen=True)
class TrainingRow:
    """One published whole training step (../shared/reference/training-steps.md).

    Attributes:
        id: T1-T9 (one slice), M1-M3 (multislice).
        source: the source key of training-steps.md.
        scenario: the scenario file under scenarios/ that writes the row's
            configuration (model, slice, mesh, batch, remat) out.
        published_tflops: TFLOP/s per device as MaxText printed it.
        formula: MaxText's formula of the row's source (:func:`training_flops`):
            "2023" (attention not halved, the v5e table's), "2023-halved" (halved,
            the v5p table's), "2025" (``maxtext_utils``, dense and MoE: T5-T8),
            "2023-04" (April 2023's 6 N T B, no attention term: T9, M3).
    """

    id: str
    source: str
    scenario: str
    published_tflops: float
    formula: str


TRAINING_ROWS = (
    TrainingRow("T1", "MT-v5p", "scenarios/maxtext-t1-32b-v5p-128.yaml", 328.0, "2023-halved"),
    TrainingRow("T2", "MT-v5p", "scenarios/maxtext-t2-512b-v5p-1024.yaml", 294.0, "2023-halved"),
    TrainingRow("T3", "MT-v5e", "scenarios/maxtext-t3-16b-v5e-256.yaml", 120.0, "2023"),
    TrainingRow("T4", "MT-v5e", "scenarios/maxtext-t4-128b-v5e-256.yaml", 110.0, "2023"),
    TrainingRow("T5", "TR-v6e", "scenarios/maxtext-t5-llama3.1-8b-v6e-256.yaml", 417.397, "2025"),
    TrainingRow("T6", "TR4", "scenarios/maxtext-t6-llama3.1-70b-v6e-64.yaml", 422.091, "2025"),
    TrainingRow("T7", "TR2", "scenarios/maxtext-t7-llama2-70b-v6e-256.yaml", 402.274, "2025"),
    TrainingRow("T8", "TR24", "scenarios/maxtext-t8-mixtral-8x7b-v6e-256.yaml", 323.173, "2025"),
    TrainingRow("T9", "MT-v4", "scenarios/maxtext-t9-22b-v4-128.yaml", 156.0, "2023-04"),
    TrainingRow("M1", "MT-v5e", "scenarios/maxtext-m1-16b-2x-v5e-256.yaml", 117.0, "2023"),
    TrainingRow("M2", "MT-v5p", "scenarios/maxtext-m2-32b-2x-v5p-128.yaml", 319.0, "2023-halved"),
    TrainingRow("M3", "MT-v4", "scenarios/maxtext-m3-22b-8x-v4-128.yaml", 146.0, "2023-04"),
)


@dataclass(frozen=True)
class TrainingResult:
    """A training row beside its prediction (TFLOP/s per device by the row's formula)."""

    id: str
    source: str
    scenario: str
    published_tflops: float
    predicted_tflops: float
    error_pct: float
    step_seconds: float
    compute_seconds: float
    exposed_seconds: dict
    hbm_gib: float
    bound: str
    setup: str = ""


def training_flops(plan, formula: str) -> float:
    """FLOPs per device of one step by MaxText's formula ``formula`` (``TrainingRow``)."""
    from pod.workloads.transformer import maxtext_tflops_2023, maxtext_tflops_2025

    cfg, batch = plan.model.config, plan.global_batch / plan.mesh.size
    if formula == "2025":
        return maxtext_tflops_2025(cfg, 1) * batch
    if formula == "2023-04":  # train.py at 281e04bf3: 6 N T B, N the parameter pytree
        return 6.0 * cfg.param_count() * cfg.sequence_length * batch
    return maxtext_tflops_2023(cfg, 1, causal_halving=formula == "2023-halved") * batch


def _row_plan(row: TrainingRow):
    """A training row's plan, timing-only, from its scenario."""
    from pod.config.plan import build_plan
    from pod.config.scenario import load_scenario

    return build_plan(load_scenario(os.path.join(ROOT, row.scenario)), timing_only=True)


def training_results(rows=TRAINING_ROWS) -> list[TrainingResult]:
    """Each training row's step, costed timing-only (``pod.runtime.timing.TimingPod``)."""
    from pod.report.bounds import step_bounds
    from pod.runtime.timing import TimingPod

    out = []
    for row in rows:
        plan = _row_plan(row)
        stats = TimingPod(plan).step(1)
        tflops = training_flops(plan, row.formula) / stats.step_seconds / 1e12
        bounds = step_bounds(stats, plan.collective_costs_at(1), plan.topology.torus)
        out.append(TrainingResult(
            row.id, row.source, row.scenario, row.published_tflops, tflops,
            (tflops - row.published_tflops) / row.published_tflops * 100, stats.step_seconds,
            stats.compute_seconds, {a: round(s, 4) for a, s in stats.axis_exposed_seconds.items()},
            plan.memory["total"] / 2**30, f"{bounds.label} {bounds.fraction:.0%}",
            _setup(plan)))
    return out


def _setup(plan) -> str:
    """A training row's configuration as the clock reads it: slice, parameters, mesh,
    sequences per device x tokens, remat."""
    cfg = plan.model.config
    mesh = ", ".join(f"{axis}: {size}" for axis, size in plan.mesh.sizes.items())
    return (f"{plan.topology.name}, {cfg.param_count() / 1e9:.1f}B, {{{mesh}}}, "
            f"{plan.global_batch // plan.mesh.size} x {cfg.sequence_length}, remat {cfg.remat}")


def step_rows(rows=TRAINING_ROWS) -> tuple:
    """The training rows as ``chip.calibration.StepRow`` (timing-only): each one slice's
    step before the sustained MXU budget and the wait for other slices, at the presets'
    fresh-op efficiency, its MXU-bound seconds and its slices' expected maximum."""
    from chip.calibration import StepRow
    from interconnect.dcn import expected_max_standard_normal
    from pod.report.clock import device_clocks
    from pod.runtime.timing import TimingPod

    out = []
    for row in rows:
        plan = _row_plan(row)
        pod = TimingPod(plan)
        pod.step(1)
        clocks = device_clocks(pod.last_reports, plan.collective_costs_at(1).seconds,
                               overlap=pod.context.overlap)
        i = max(range(len(clocks)), key=lambda k: clocks[k].step_seconds)
        report = pod.last_reports[i]
        mxu = sum(s for s, b in zip(report.record_seconds, report.record_bounds, strict=True)
                  if b == "mxu")
        published = training_flops(plan, row.formula) / (row.published_tflops * 1e12)
        out.append(StepRow(row.id, plan.topology.chip.name, clocks[i].step_seconds, mxu,
                           pod.device.core.spec.mxu_efficiency, published,
                           expected_max_standard_normal(plan.topology.slices)))
    return tuple(out)


def fit_training(held_out: bool = False) -> dict:
    """The step clock's fit (``chip.fitting.fit_step_clock``) on the GEMM rows and every
    training row, each row's error at the fit, and with ``held_out`` each row's error under a
    fit on every other row (leave-one-out). Errors are of TFLOP/s, as the table's."""
    from chip.fitting import fit_step_clock

    rows = step_rows()
    result = fit_step_clock(rows)

    def error(row, fit) -> float:
        predicted = row.predicted(fit.efficiency, fit.sustained[row.chip], fit.slice_jitter)
        return (row.published_s / predicted - 1) * 100

    out: dict = {"fit": asdict(result), "rows": [asdict(r) for r in rows],
                 "error_pct": {r.row_id: error(r, result) for r in rows}}
    if held_out:
        out["held_out"] = {}
        for row in rows:
            other = fit_step_clock(tuple(r for r in rows if r is not row))
            out["held_out"][row.row_id] = {"fit": asdict(other), "error_pct": error(row, other)}
    return out


def print_fit(out: dict, markdown: bool = False) -> None:
    """The fit's constants and each row's error (and held-out error), as a table."""
    fit = out["fit"]
    print(f"e0 {fit['efficiency']}, tau {fit['burst_seconds']} s, e1 "
          + ", ".join(f"{c} {v}" for c, v in sorted(fit["sustained"].items()))
          + f", slice jitter {fit['slice_jitter']}; RMS {fit['rms_error'] * 100:.2f}%\n")
    held = out.get("held_out", {})
    header = ("id", "chip", "published step s", "error", "held out")
    lines = [(r["row_id"], r["chip"], f"{r['published_s']:.3f}",
              f"{out['error_pct'][r['row_id']]:+.1f}%",
              f"{held[r['row_id']]['error_pct']:+.1f}%" if held else "-") for r in out["rows"]]
    _print_rows(header, lines, markdown)
    errors = [abs(e) for e in out["error_pct"].values()]
    print(f"\nmean absolute error {sum(errors) / len(errors):.1f}%, worst {max(errors):.1f}%")
    if held:
        loo = [abs(h["error_pct"]) for h in held.values()]
        print(f"held out one at a time: mean {sum(loo) / len(loo):.1f}%, worst {max(loo):.1f}%")


def _print_rows(header, lines, markdown: bool) -> None:
    if markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "|".join("---" for _ in header) + "|")
        for line in lines:
            print("| " + " | ".join(line) + " |")
        return
    widths = [max(len(str(x)) for x in col) for col in zip(header, *lines)]
    for line in [header, *lines]:
        print("  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip())


def print_training(results: list[TrainingResult], markdown: bool) -> None:
    header = ("id", "source", "scenario", "published TFLOP/s/device", "predicted", "error",
              "step s", "compute s", "exposed s by axis", "HBM GiB / device", "bound")
    lines = [(r.id, r.source, r.scenario, f"{r.published_tflops:.1f}", f"{r.predicted_tflops:.1f}",
              f"{r.error_pct:+.1f}%", f"{r.step_seconds:.3f}", f"{r.compute_seconds:.3f}",
              ", ".join(f"{a} {s:.3f}" for a, s in r.exposed_seconds.items()) or "-",
              f"{r.hbm_gib:.1f}", r.bound)
             for r in results]
    _print_rows(header, lines, markdown)
    if markdown:
        print()
    mae = sum(abs(r.error_pct) for r in results) / max(1, len(results))
    worst = max(results, key=lambda r: abs(r.error_pct))
    print(f"mean absolute error {mae:.1f}% over {len(results)} rows; worst row {worst.id} "
          f"{worst.error_pct:+.1f}%")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    parser.add_argument("--fit", action="store_true", help="fit efficiency, exponent and fixed costs")
    parser.add_argument("--readings", action="store_true",
                        help="every collective row under both readings (XLA's algorithm with its "
                             "DMA streams; the fastest algorithm with a multi-link loss)")
    parser.add_argument("--fastest", action="store_true",
                        help="cost collectives by the fastest algorithm (as the CLI without --algorithm), "
                             "not by XLA's (the torus algorithm)")
    parser.add_argument("--as-all-gather", action="store_true",
                        help="cost C8 and C10 as the native all-gather their command names, not as "
                             "the allreduce of the zero-padded buffer torch_xla runs")
    parser.add_argument("--fit-mxu", action="store_true",
                        help="fit the step clock's constants (fresh e0, time constant, sustained "
                             "e1 per generation, slice jitter) on the GEMM rows and the training "
                             "steps together")
    parser.add_argument("--held-out", action="store_true",
                        help="with --fit-mxu: each training row's error under a fit on every "
                             "other row")
    parser.add_argument("--training", action="store_true",
                        help="only the whole training steps T1-T9, M1-M3 (timing-only runs of "
                             "their scenarios; a few seconds each)")
    parser.add_argument("--single-op", action="store_true",
                        help="only the single-op rows C1-C14, S1-S2")
    parser.add_argument("--baseline", metavar="DIR",
                        help="collective rows only, with the interconnect package found in DIR and the "
                             "ideal (uncalibrated) link")
    args = parser.parse_args(argv)
    ic = _import_interconnect(args.baseline)
    if args.fit_mxu:
        out = fit_training(held_out=args.held_out)
        if args.json:
            print(json.dumps(out, indent=2))
        else:
            print_fit(out, args.markdown)
        return 0
    if args.fit:
        print(json.dumps(fit(ic, args.fastest), indent=2))
        return 0
    if args.readings:
        print_readings(ic, args.markdown)
        return 0
    if args.baseline:
        def link_for(generation: str):
            return ic.LinkSpec(LINK_BYTES_PER_S[generation], HOP_LATENCY_S)
    else:
        def link_for(generation: str):
            return ic.calibrated_link(generation, LINK_BYTES_PER_S[generation], HOP_LATENCY_S)
    results = [] if args.training else run(ic, link_for, collective_only=bool(args.baseline),
                                            as_all_gather=args.as_all_gather, fastest=args.fastest)
    training = ([] if args.single_op or args.baseline else training_results())
    if args.json:
        out = {"training_rows": [asdict(r) for r in training]}
        if results:
            mae, worst = summary(results)
            out.update(rows=[asdict(r) for r in results], mean_abs_error_pct=mae,
                       worst={"id": worst.id, "error_pct": worst.error_pct})
        print(json.dumps(out, indent=2))
        return 0
    if results:
        print_table(results, args.markdown)
    if training:
        print()
        print_training(training, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())

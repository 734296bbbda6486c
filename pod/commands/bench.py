"""Benchmarks: one GEMM on one TensorCore, and the seed's benchmark scenarios.

- `matmul_report`: what ``tpu-pod matmul`` prints: cycles, simulated
  seconds, TFLOP/s and MXU utilisation of one (M x K) . (K x N) on one
  TensorCore of a chip preset, in a precision mode.
- `run_benchmark`: a scenario with a ``benchmark:`` section (instead of
  ``model`` / ``training``), as ``tpu-pod run`` runs it. One Ray actor per
  chip (`BenchmarkChipActor`, a thin shell around `chip.Chip`) runs the work
  on every TensorCore; then this host's own numpy FLOP/s on the same kind of
  work is measured, and both are printed the way the seed notebook did
  ("CPU TFlops: ..." / "TPU speedup over CPU: ...x TFlops: ...").

Two kinds, from the seed material:

- ``matmul`` (the 2018 Colab TPU benchmark): on each TensorCore two random
  N x N float32 matrices, ``x <- x . y`` repeated ``iterations`` times;
  FLOPs = cores x iterations x 2 N^3. ``y`` is scaled by 1/sqrt(N) so ``x``
  stays finite over many iterations; ``y`` is rounded to bf16 once and reused
  (the same weights every iteration).
- ``matrix_add`` (the lecture's first benchmark): on each TensorCore
  ``c = a + b`` on N x N float32 matrices, ``iterations`` times, on the VPU;
  FLOPs = cores x iterations x N^2. HBM-bound on every TPU.

``functional: false`` (the default at full size) costs the ops without
computing them (`TensorCore.account_matmul` / `account_vector`): a v2-8 at
N = 4096 and 100 iterations would otherwise be 11 PFLOP of numpy work.
Simulated figures come from the cost models; CPU figures are wall-clock
measurements of this host.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from chip import TensorCore, check_precision, get_chip_spec
from pod.config.bench import check_benchmark
from pod.config.scenario import Scenario
from pod.errors import ScenarioError
from pod.report.files import check_writable, write_json
from pod.runtime.bench import benchmark_inputs, run_benchmark_chips

__all__ = ["matmul_report", "cpu_flops_per_s", "run_benchmark", "format_report"]


def matmul_report(chip: str, m: int, k: int, n: int, *, precision: str = "bf16",
                  double_buffered: bool = False, mxu_model: str = "pipelined") -> dict[str, Any]:
    """Cost of one (M x K) . (K x N) GEMM on one TensorCore of a chip preset.

    Args:
        chip: Chip preset name ("v2", ..., "v6e").
        m, k, n: GEMM dimensions, positive ints.
        precision: "bf16", "fp32" or "int8".
        double_buffered: Double-buffered MXU weights (matters only with
            mxu_model "scalesim"; the pipelined MXU always double-buffers).
        mxu_model: "pipelined" (the hardware: one bubble per op) or "scalesim"
            (SCALE-Sim's per-fold count).

    Returns:
        A JSON-serialisable dict: chip, m, k, n, precision, mxu_model, cycles
        (mxu_cycles of the array plus issue_cycles of the scalar unit),
        simulated_seconds (max of compute and HBM time),
        compute_seconds, memory_seconds, bound, flops, hbm_bytes, tflops
        (useful FLOPs / simulated seconds / 1e12), mxu_utilization (MXU cell
        work done / cell-cycles available in the simulated time; 1.0 = every
        MAC of every MXU busy every cycle; fp32's six passes count as work,
        int8 counts int8 MACs against the int8 rate), and the rate against its
        own peak: tflops / peak_tflops (bf16 peak of one core) for bf16 and
        fp32, tops / peak_tops (integer ops, the int8 peak) for int8.

    Raises:
        ChipSpecError: unknown chip. PrecisionError: unknown precision or int8
        on v2 / v3. ValueError: a non-positive dimension.
    """
    spec = get_chip_spec(chip)
    for label, v in (("m", m), ("k", k), ("n", n)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ScenarioError(f"--{label}: must be a positive integer, got {v!r}")
    check_precision(precision, spec.core, spec.name)
    core = TensorCore(spec.core, precision=precision, double_buffered=double_buffered,
                      mxu_model=mxu_model)
    rec = core.account_matmul(m, k, n)
    c = spec.core
    passes = 6 if precision == "fp32" else 1
    rate = c.int8_macs_per_bf16_mac if precision == "int8" else 1.0
    cell_cycles = rec.seconds * c.clock_hz * c.mxus_per_core * c.mxu.rows * c.mxu.cols
    rate_key, peak = (("tops", c.peak_bf16_flops_per_s * rate) if precision == "int8"
                      else ("tflops", c.peak_bf16_flops_per_s))
    return {
        "chip": spec.name, "m": m, "k": k, "n": n, "precision": precision,
        "mxu_model": mxu_model, "double_buffered": double_buffered,
        "cycles": rec.cycles, "mxu_cycles": rec.mxu_cycles, "issue_cycles": rec.issue_cycles,
        "simulated_seconds": rec.seconds,
        "compute_seconds": rec.compute_seconds,
        "memory_seconds": rec.memory_seconds,
        "bound": rec.bound,
        "flops": rec.flops,
        "hbm_bytes": rec.hbm_bytes,
        rate_key: rec.flops / rec.seconds / 1e12,
        "mxu_utilization": m * k * n * passes / rate / cell_cycles,
        f"peak_{rate_key}": peak / 1e12,
    }


def cpu_flops_per_s(kind: str, n: int, iterations: int, seed: int = 0) -> tuple[float, float]:
    """This host's numpy FLOP/s on the benchmark's kind of work (wall clock).

    matmul: x <- x . y in float32, 2 n^3 FLOPs per iteration; matrix_add:
    c = a + b in float32, n^2 FLOPs per iteration. numpy uses as many BLAS
    threads as it is allowed.

    Returns:
        (FLOP/s, wall seconds).
    """
    a, b = benchmark_inputs(kind, n, seed, 0, 0)
    if kind == "matmul":
        x = a @ b  # warm up BLAS
        t0 = time.perf_counter()
        for _ in range(iterations):
            x = x @ b
        wall = time.perf_counter() - t0
        return 2.0 * n**3 * iterations / wall, wall
    c = np.empty_like(a)
    np.add(a, b, out=c)
    t0 = time.perf_counter()
    for _ in range(iterations):
        np.add(a, b, out=c)
    wall = time.perf_counter() - t0
    return float(n) ** 2 * iterations / wall, wall


def run_benchmark(scenario: Scenario, *, output_dir: Path | None = None,
                  functional: bool | None = None, echo=print) -> dict[str, Any]:
    """Run a benchmark scenario over chip actors and print the seed's report.

    Args:
        scenario: A scenario with a ``benchmark`` section.
        output_dir: Where ``summary.json`` goes (None: not written).
        functional: Override ``benchmark.functional``.
        echo: Line printer.

    Returns:
        The summary dict (also written to summary.json): simulated_seconds
        (the slowest core), simulated_tflops, cpu_tflops, speedup, flops, ...

    Raises:
        ScenarioError, PrecisionError, HBMOutOfMemoryError: from `check_benchmark`.
        ClusterError: Ray could not start.
    """
    plan = check_benchmark(scenario)
    b = plan.benchmark
    functional = b.functional if functional is None else functional
    if functional:  # a pod this machine cannot hold: one line, before any actor (as runs)
        from pod.runtime.admission import admit

        admit(plan)
    t0 = time.perf_counter()
    per_chip = run_benchmark_chips(plan, functional)
    wall = time.perf_counter() - t0
    cores = [c for chip in per_chip for c in chip]
    sim_seconds = max(c["seconds"] for c in cores)  # cores run in parallel
    flops = sum(c["flops"] for c in cores)
    cpu_flops, cpu_wall = cpu_flops_per_s(b.kind, b.cpu_n, b.cpu_iterations, b.seed)
    tflops = flops / sim_seconds / 1e12
    summary = {
        "scenario": scenario.name, "kind": b.kind, "chip": plan.topology.chip.name,
        "slice": plan.topology.slice_name, "chips": plan.topology.chips,
        "cores": plan.topology.tensorcores,
        "n": b.n, "iterations": b.iterations, "precision": b.precision,
        "functional": bool(functional), "flops": flops,
        "simulated_seconds": sim_seconds, "simulated_tflops": tflops,
        "bound": cores[0]["bound"],
        "peak_tflops": plan.topology.peak_bf16_flops_per_s / 1e12,
        "cpu_n": b.cpu_n, "cpu_iterations": b.cpu_iterations,
        "cpu_tflops": cpu_flops / 1e12, "cpu_wall_seconds": cpu_wall,
        "speedup": tflops * 1e12 / cpu_flops,
        "emulation_wall_seconds": wall,
        "per_core": cores,
    }
    for line in format_report(summary):
        echo(line)
    if output_dir is not None:
        check_writable(output_dir)
        write_json(Path(output_dir) / "summary.json", summary)
    return summary


def format_report(summary: dict[str, Any]) -> list[str]:
    """The report lines, in the seed notebook's words."""
    what = ("x <- x . y" if summary["kind"] == "matmul" else "c = a + b")
    mode = "functional + timing" if summary["functional"] else "timing only"
    return [
        f"{summary['scenario']}: {summary['kind']} {what}, N={summary['n']}, "
        f"{summary['iterations']} iterations on each of {summary['cores']} TensorCores "
        f"({summary['slice'] or summary['chip']}, {summary['precision']}, {mode})",
        f"simulated: {summary['simulated_seconds']:.6f} s for {summary['flops']:.4g} FLOP "
        f"({summary['bound']}-bound; pod peak {summary['peak_tflops']:,.1f} TFLOP/s bf16)",
        f"CPU TFlops: {summary['cpu_tflops']:.4f}   (wall, this host, numpy, "
        f"N={summary['cpu_n']} x {summary['cpu_iterations']})",
        f"TPU speedup over CPU: {summary['speedup']:,.0f}x TFlops: "
        f"{summary['simulated_tflops']:,.3f}   (TPU simulated)",
    ]

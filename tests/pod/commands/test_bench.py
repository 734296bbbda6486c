"""pod.commands.bench: `tpu-pod matmul`, and the seed benchmark scenarios over chip actors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from chip import PrecisionError
from pod.commands.bench import matmul_report
from pod.config.bench import check_benchmark
from pod.runtime.bench import BenchmarkChipActor, benchmark_inputs
from pod.config.scenario import load_scenario

ROOT = Path(__file__).resolve().parents[3]


def bf16(x):
    """Independent bf16 rounding (ml_dtypes directly, not chip.to_bf16)."""
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def tpu_pod(*args):
    return subprocess.run([sys.executable, "-m", "pod", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ))


def test_matmul_report_v2_4096_closed_form():
    import math

    from chip import get_chip_spec

    # the hardware's pipelined MXU: 32 x 32 folds of M = 4096 rows back to back and one
    # fill / drain bubble (2R + C - 2) per op, plus 8 scalar issue cycles. One op from an
    # idle start runs at the mean efficiency over its duration d: the rate falls from e0
    # to the sustained e1 with time constant tau, mean e1 + (e0 - e1) (tau / d)(1 - e^-d/tau)
    pipelined = matmul_report("v2", 4096, 4096, 4096)
    core = get_chip_spec("v2").core
    ideal = 1024 * 4096 + 2 * 128 + 128 - 2 - 1
    e0, e1, tau = core.mxu_efficiency, core.sustained_mxu_efficiency, core.mxu_burst_seconds
    d = ideal / core.clock_hz / e0
    efficiency = e1 + (e0 - e1) * tau / d * (1 - math.exp(-d / tau))
    assert e1 < efficiency < e0
    mxu = math.ceil(ideal / efficiency)
    assert (pipelined["mxu_cycles"], pipelined["issue_cycles"]) == (mxu, 8)
    assert pipelined["cycles"] == mxu + 8 and pipelined["mxu_model"] == "pipelined"
    r = matmul_report("v2", 4096, 4096, 4096, mxu_model="scalesim")
    # SCALE-Sim: 32 x 32 folds of (2*128 + 128 + 4096 - 2) cycles, less one (its
    # convention), plus 8 scalar issue cycles; 700 MHz.
    cycles = 1024 * (2 * 128 + 128 + 4096 - 2) - 1 + 8
    assert r["cycles"] == cycles
    # one bubble per op instead of one per fold: the ideal pipelined count is lower
    # (the fitted efficiency applies to the pipelined mode only)
    assert 1024 * 4096 + 2 * 128 + 128 - 3 < cycles - 8
    assert r["simulated_seconds"] == pytest.approx(cycles / 700e6)
    assert r["bound"] == "compute"
    assert r["tflops"] == pytest.approx(2 * 4096**3 / (cycles / 700e6) / 1e12)
    assert r["mxu_utilization"] == pytest.approx(4096**3 / (cycles * 128 * 128))
    assert 0.9 < r["mxu_utilization"] < 1.0
    fp32 = matmul_report("v2", 4096, 4096, 4096, precision="fp32", mxu_model="scalesim")
    assert fp32["cycles"] == pytest.approx(6 * r["cycles"], rel=1e-3)
    assert fp32["mxu_utilization"] == pytest.approx(r["mxu_utilization"], rel=1e-3)
    with pytest.raises(PrecisionError, match="TPU v2"):
        matmul_report("v2", 8, 8, 8, precision="int8")


@pytest.mark.slow  # several seconds: the slow tier (make test stays under 3 minutes)
def test_cli_matmul_json_and_errors():
    out = tpu_pod("matmul", "--chip", "v2", "--m", "4096", "--k", "4096", "--n", "4096", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert {"cycles", "simulated_seconds", "tflops", "mxu_utilization"} <= set(report)
    assert report == json.loads(json.dumps(matmul_report("v2", 4096, 4096, 4096)))
    text = tpu_pod("matmul", "--chip", "v4", "--m", "512", "--k", "512", "--n", "512")
    assert text.returncode == 0 and "MXU utilisation" in text.stdout and "TFLOP/s" in text.stdout
    for args, needle in ((("--chip", "v3", "--precision", "int8"), "TPU v3 does not have"),
                         (("--chip", "v9"), "unknown chip 'v9'"),
                         (("--precision", "fp8"), "unknown precision 'fp8'")):
        bad = tpu_pod("matmul", *args)
        assert bad.returncode == 2 and "Traceback" not in bad.stderr
        lines = bad.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], bad.stderr


def test_functional_matmul_on_one_chip_matches_numpy_reference():
    actor = BenchmarkChipActor("v2", chip_id=1, limit_threads=False)
    n, iterations = 48, 5
    out = actor.run("matmul", n, iterations, True, seed=3)
    assert [c["core"] for c in out] == [0, 1]
    for core, entry in enumerate(out):
        x, y = benchmark_inputs("matmul", n, 3, 1, core)
        yr = bf16(y)
        for _ in range(iterations):
            x = bf16(x) @ yr
        assert entry["finite"]
        assert entry["checksum"] == pytest.approx(float(x.astype(np.float64).sum()), rel=1e-4)
        assert entry["flops"] == iterations * 2 * n**3


def test_timing_only_costs_what_functional_costs():
    actor = BenchmarkChipActor("v2", chip_id=0, limit_threads=False)
    for kind in ("matmul", "matrix_add"):
        f = actor.run(kind, 40, 3, True, seed=0)
        t = actor.run(kind, 40, 3, False, seed=0)
        assert [c["seconds"] for c in f] == [c["seconds"] for c in t]
        assert [c["flops"] for c in f] == [c["flops"] for c in t]


def test_full_size_seed_scenarios_plan():
    mm = check_benchmark(load_scenario(ROOT / "scenarios/seed-matmul-v2-8.yaml"))
    assert (mm.topology.chips, mm.topology.tensorcores) == (4, 8)
    assert mm.flops == 8 * 100 * 2 * 4096**3  # the FLOP count
    add = check_benchmark(load_scenario(ROOT / "scenarios/seed-matrix-add.yaml"))
    assert add.flops == 8 * 100 * 4096**2


@pytest.mark.slow
def test_seed_matmul_runs_functionally_at_reduced_size_over_chip_actors(ray_cluster, tmp_path):
    from pod.commands.bench import run_benchmark

    scenario = load_scenario(ROOT / "scenarios/seed-matmul-v2-8.yaml").with_overrides(
        benchmark__n=32, benchmark__iterations=3, benchmark__functional=True,
        benchmark__cpu_n=64, benchmark__cpu_iterations=2)
    lines = []
    summary = run_benchmark(scenario, output_dir=tmp_path, echo=lines.append)
    assert summary["cores"] == 8 and len(summary["per_core"]) == 8
    assert all(c["finite"] for c in summary["per_core"])
    # 8 cores x 3 iterations x 2 N^3, and the slowest core's simulated time.
    assert summary["flops"] == 8 * 3 * 2 * 32**3
    assert summary["simulated_tflops"] == pytest.approx(
        summary["flops"] / summary["simulated_seconds"] / 1e12)
    assert any(line.startswith("CPU TFlops: ") for line in lines)
    assert any(line.startswith("TPU speedup over CPU: ") and "x TFlops: " in line for line in lines)
    assert json.loads((tmp_path / "summary.json").read_text())["speedup"] == summary["speedup"]
    add = load_scenario(ROOT / "scenarios/seed-matrix-add.yaml").with_overrides(
        benchmark__n=64, benchmark__iterations=2, benchmark__functional=True,
        benchmark__cpu_n=64, benchmark__cpu_iterations=2)
    s2 = run_benchmark(add, echo=lambda _: None)
    assert s2["bound"] == "memory" and s2["flops"] == 8 * 2 * 64**2

"""Monitoring a demo run (issue 33 item 7): the monitor's hint runs as printed, a run
shorter than a scrape interval reads right on the dashboard (per-step figures from two
counters, the last value kept: ``last_over_time``), a gauge of zero reads zero (not
6.2e-15), and the simulated-time histograms have buckets where the steps are (a constant
0.0720 ms step read 0.075 / 0.0995 ms at p50 / p99 in 1-2.5-5 decade buckets)."""

from __future__ import annotations

import importlib.util
import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from pod.cli import cli
from pod.commands.monitor import demo_command
from pod.report.metrics import PodMetrics, simulated_buckets
from pod.report.stats import StepStats
from tests.pod.report.test_monitoring import (
    _free_port,
    _query,
    _start_monitor,
    _stop_monitor,
    fake_stats,
)

ROOT = Path(__file__).resolve().parents[3]
DASHBOARD = ROOT / "monitoring" / "grafana" / "tpu-pod-dashboard.json"


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus' ``histogram_quantile`` (promql/quantile.go) over cumulative
    (upper edge, count) pairs, +Inf last: linear within the bucket the rank falls in,
    the first bucket's lower edge 0."""
    total = buckets[-1][1]
    rank = q * total
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if upper == float("inf"):
                return lower
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    raise AssertionError("unreachable")


def _buckets(metrics: PodMetrics, name: str) -> list[tuple[float, float]]:
    family = next(f for f in metrics.registry.collect() if f.name == name)
    return [(float(s.labels["le"]), s.value) for s in family.samples
            if s.name.endswith("_bucket")]


def test_a_constant_step_reads_its_time_at_every_quantile():
    """The quick start's steps are all 0.0720 ms (simulated): p50 and p99 read it."""
    metrics = PodMetrics(scenario="s", generation="v2", slice_name="v2-8", topology="2x2")
    stats = fake_stats()
    for step in range(200):
        metrics.observe(fake_stats(step))
    for name, value in (("tpu_pod_simulated_step_seconds", stats.step_seconds),
                        ("tpu_pod_simulated_collective_seconds", stats.collective_seconds)):
        buckets = _buckets(metrics, name)
        for q in (0.5, 0.9, 0.99):
            assert histogram_quantile(q, buckets) == pytest.approx(value, rel=1e-6), (name, q)


def test_buckets_follow_the_run_and_keep_the_decades_beyond():
    edges = simulated_buckets(7.2e-5)
    fine = [b for b in edges if 3.6e-5 <= b <= 1.44e-4]
    assert len(fine) >= 64 and max(b / a for a, b in zip(fine, fine[1:])) < 1.022 + 1e-9
    assert 1e-7 in edges and 10.0 in edges and edges == tuple(sorted(set(edges)))
    assert simulated_buckets(0.0)[0] == 1e-7  # no first time: the decades alone


def test_a_gauge_of_zero_overlap_reads_zero():
    """All of 0.1 + 0.2 s of collectives exposed, summed in another order (0.3): nothing
    hidden, exactly."""
    stats = StepStats(step=0, loss=1.0, global_batch=8, infeed_seconds=0.0,
                      compute_seconds=1.0, collective_seconds=0.1 + 0.2, update_seconds=0.0,
                      model_flops=1, peak_flops_per_s=1.0, wall_seconds=1.0,
                      exposed_collective_seconds=0.3)
    assert 0.1 + 0.2 != 0.3 and stats.overlap_fraction == 0.0
    metrics = PodMetrics(scenario="s", generation="v2", slice_name="v2-8", topology="2x2")
    metrics.observe(stats)
    assert metrics.registry.get_sample_value("tpu_pod_collective_overlap_ratio") == 0.0
    half = StepStats(**{**stats.__dict__, "exposed_collective_seconds": 0.15})
    assert half.overlap_fraction == pytest.approx(0.5)


def test_the_monitors_hint_runs_as_printed(tmp_path, monkeypatch):
    """``tpu-pod run quickstart.yaml --hold`` failed in a checkout ("cannot read the
    scenario file"): the hint names a file that is there, from where it is printed."""
    for cwd in (ROOT, tmp_path):
        command = shlex.split(demo_command(cwd))
        assert command[:2] == ["tpu-pod", "run"] and command[-1] == "--hold"
        path = Path(command[2])
        assert (path if path.is_absolute() else cwd / path).is_file(), (cwd, command)
        monkeypatch.chdir(cwd)
        out = CliRunner().invoke(cli, ["validate", command[2]])
        assert out.exit_code == 0, out.output
    assert demo_command(ROOT) == "tpu-pod run scenarios/quickstart.yaml --hold"


def _dashboard():
    spec = importlib.util.spec_from_file_location(
        "make_dashboard", ROOT / "monitoring" / "grafana" / "make_dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_dashboard()


def test_simulated_panels_need_no_rate_and_keep_the_last_value():
    for panel in _dashboard()["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            assert "last_over_time(" in expr, panel["title"]
            if "rate(" in expr:  # only figures per wall second take a rate
                assert "WALL" in panel["title"], panel["title"]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("prometheus") is None,
                    reason="prometheus not installed (Debian package 'prometheus')")
def test_a_run_shorter_than_a_scrape_reads_right_on_the_dashboard(tmp_path):
    """The quick start's demo: 5 s scrapes, a run of a few steps that ends between two
    of them and holds its endpoint (the hint's --hold, here 7 s); after it has gone, the
    per-axis panel reads the summary's seconds per step, the quantiles its step time."""
    exporter, server = _free_port(), _free_port()
    monitor, _ = _start_monitor("--port", str(server), "--target", f"127.0.0.1:{exporter}")
    try:
        deadline = time.monotonic() + 30
        while not _query(server, "up"):  # the target discovered (down: no run yet)
            assert time.monotonic() < deadline, "Prometheus never tried its target"
            time.sleep(0.5)
        run = subprocess.run(
            [sys.executable, "-m", "pod", "run", str(ROOT / "scenarios/quickstart.yaml"),
             "--steps", "12", "--metrics-port", str(exporter), "--output-dir",
             str(tmp_path / "out"), "--log-every", "0", "--hold-seconds", "7", "--in-process"],
            cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        summary = json.loads((tmp_path / "out" / "summary.json").read_text())
        deadline = time.monotonic() + 20
        while not _query(server, "last_over_time(tpu_pod_steps_total[10m])"):
            assert time.monotonic() < deadline, "no scrape of the run"
            time.sleep(0.5)
        panels = {p["title"]: p for p in json.loads(DASHBOARD.read_text())["panels"]}

        def value(title: str, index: int = 0) -> float:
            expr = panels[title]["targets"][index]["expr"]
            expr = expr.replace("$scenario", ".*").replace("$instance", ".*")
            (sample,) = _query(server, expr)
            return float(sample["value"][1])

        steps = summary["steps"]
        axis = summary["collectives_by_axis"]["data"]
        # the counters' ratio is the mean over every step; the summary's, over the steps
        # after the first (they are equal here: every step costs the same)
        assert value("Collectives per mesh axis: simulated seconds per step (run mean)") == \
            pytest.approx(axis["simulated_seconds"], rel=1e-9)
        assert value("Steps and examples") == steps
        step_quantiles = "Step time quantiles over the run (simulated)"
        for index in (0, 1):  # p50, p99
            assert value(step_quantiles, index) == pytest.approx(
                summary["simulated_step_seconds"], rel=1e-5)
        assert value("Collectives hidden behind compute (simulated)") == pytest.approx(
            summary["overlap_fraction"], abs=1e-12)
    finally:
        _stop_monitor(monitor)

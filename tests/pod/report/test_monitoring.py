"""Monitoring: metric names, the monitoring/ files, epoch lines, and a real Prometheus
(every run in this process: ``--in-process`` / ``backend="local"``, no Ray)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pod.errors import MetricsError
from pod.report.metrics import METRIC_NAMES, PodMetrics
from pod.report.stats import StepStats

ROOT = Path(__file__).resolve().parents[3]
MONITORING = ROOT / "monitoring"
METRIC_RE = re.compile(r"\btpu_pod_[a-z0-9_]+")


def fake_stats(step=0) -> StepStats:
    """A v2 step: devices 0 and 1 are chip 0's two TensorCores."""
    return StepStats(step=step, loss=1.5, global_batch=64, infeed_seconds=1e-6,
                     compute_seconds=4e-5, collective_seconds=1.1e-5,
                     update_seconds=5e-6, model_flops=10**9, peak_flops_per_s=1.8e14,
                     wall_seconds=0.05, tokens_per_example=16, maxtext_flops_per_device=2e9,
                     exposed_collective_seconds=4e-6, exposed_infeed_seconds=0.0,
                     hbm_used_bytes={0: 100, 1: 150}, hbm_peak_bytes={0: 200, 1: 250},
                     hbm_capacity_bytes=8 * 2**30, ici_link_bytes={"0->1": 1000},
                     device_mxu_flops={0: 5 * 10**8, 1: 4 * 10**8},
                     device_peak_flops_per_s=2.3e13, ici_link_bandwidth_bytes_per_s=6.2e10,
                     chip_compute_seconds={0: 4e-5},
                     axis_collective_bytes={"data": 4000, "fsdp": 800},
                     axis_collective_seconds={"data": 1e-5, "fsdp": 1e-6},
                     axis_exposed_seconds={"data": 3e-6, "fsdp": 1e-6})


def _metrics() -> PodMetrics:
    return PodMetrics(scenario="s", generation="v2", slice_name="v2-8", topology="2x2",
                      links=["0->1", "1->0"], chips=1, devices_per_chip=2)


def _samples(metrics: PodMetrics) -> dict[tuple[str, tuple], float]:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def exported_samples(moe: bool = True, multislice: bool = True) -> set[str]:
    """The series a run exports after a step (of a mixture of experts, whose routers'
    gauges a dense model leaves out; on two slices, whose DCN counters one slice
    leaves out) and an evaluation."""
    from dataclasses import replace

    from pod.report.stats import ExpertLoad

    metrics = _metrics()
    stats = fake_stats()
    if moe:  # 2 layers, 4 experts
        stats = replace(stats, expert_load=ExpertLoad(((5, 3, 0, 8), (4, 4, 4, 4)),
                                                      ((4, 3, 0, 4), (4, 4, 4, 4))))
    if multislice:  # the data axis across 2 slices: 6 of its 10 us on the DCN
        stats = replace(stats, axis_dcn_seconds={"data": 6e-6}, axis_dcn_bytes={"data": 2000})
    metrics.observe(stats)
    metrics.set_accuracy(0.5)
    return {name for name, _ in _samples(metrics)}


def test_a_dense_model_exports_no_router_series():
    assert not {n for n in exported_samples(moe=False) if n.startswith("tpu_pod_expert_")}


def test_one_slice_exports_no_dcn_series():
    assert not {n for n in exported_samples(multislice=False) if n.startswith("tpu_pod_dcn_")}
    assert {"tpu_pod_dcn_collective_seconds_total",
            "tpu_pod_dcn_transferred_bytes_total"} <= exported_samples()


def test_metric_names_follow_prometheus_conventions():
    samples = exported_samples()
    families = {re.sub(r"_(bucket|sum|count|created)$", "", s) for s in samples}
    assert all(name.startswith("tpu_pod_") for name in samples)
    for name in METRIC_NAMES:
        assert name in samples or f"{name}_bucket" in samples, name
    counters = {"tpu_pod_steps_total", "tpu_pod_examples_total",
                "tpu_pod_ici_transferred_bytes_total", "tpu_pod_collective_seconds_total",
                "tpu_pod_collective_exposed_seconds_total", "tpu_pod_collective_bytes_total"}
    assert counters <= samples
    # every documented name is exported and every exported family is documented
    # (a counter's _created sample names its family without _total)
    documented = set(METRIC_NAMES) | counters
    created = {c.removesuffix("_total") for c in documented if c.endswith("_total")}
    assert families - created <= documented
    readme = (ROOT / "docs" / "monitoring.md").read_text()
    for name in METRIC_NAMES:
        assert f"`{name}`" in readme, f"{name} missing from docs/monitoring.md's metric table"


def test_utilisation_metrics_follow_their_formulas():
    stats = fake_stats()
    step = stats.step_seconds
    assert step == pytest.approx(4e-5 + 4e-6 + 5e-6)           # infeed and 7 us of ICI hidden
    assert stats.mxu_utilization() == {0: pytest.approx(5e8 / (2.3e13 * step)),
                                       1: pytest.approx(4e8 / (2.3e13 * step))}
    assert stats.ici_link_utilization()["0->1"] == pytest.approx(1000 / (6.2e10 * step))
    assert stats.overlap_fraction == pytest.approx(1 - 4 / 11)
    assert stats.tokens_per_second == pytest.approx(16 * 64 / step)


def test_every_device_and_mesh_axis_is_exported_under_its_labels():
    """A device id becomes (chip, core): v2 device 1 is chip 0's core 1; the per-axis
    counters add up over steps; the step's parts and the overlap follow the stats."""
    metrics = _metrics()
    stats = fake_stats()
    metrics.observe(stats)
    metrics.observe(fake_stats(1))
    got = _samples(metrics)
    for device, used, peak in ((0, 100, 200), (1, 150, 250)):
        labels = (("chip", "0"), ("core", str(device)))
        assert got[("tpu_pod_hbm_used_bytes", labels)] == used
        assert got[("tpu_pod_hbm_peak_bytes", labels)] == peak
        assert got[("tpu_pod_mxu_utilization_ratio", labels)] == pytest.approx(
            stats.mxu_utilization()[device])
    for axis in ("data", "fsdp"):
        labels = (("axis", axis),)
        assert got[("tpu_pod_collective_seconds_total", labels)] == pytest.approx(
            2 * stats.axis_collective_seconds[axis])
        assert got[("tpu_pod_collective_exposed_seconds_total", labels)] == pytest.approx(
            2 * stats.axis_exposed_seconds[axis])
        assert got[("tpu_pod_collective_bytes_total", labels)] == 2 * stats.axis_collective_bytes[
            axis]
    assert ("tpu_pod_collective_seconds_total", (("axis", "tensor"),)) not in got
    assert got[("tpu_pod_collective_overlap_ratio", ())] == pytest.approx(1 - 4 / 11)
    assert got[("tpu_pod_simulated_tokens_per_second", ())] == pytest.approx(
        stats.tokens_per_second)
    parts = {dict(labels)["part"]: v for (name, labels), v in got.items()
             if name == "tpu_pod_simulated_step_part_seconds"}
    assert parts == pytest.approx({"infeed": 1e-6, "compute": 4e-5, "collective": 1.1e-5,
                                   "exposed_infeed": 0.0, "exposed_collective": 4e-6,
                                   "dispatch": 0.0, "update": 5e-6, "pipeline_bubble": 0.0,
                                   "host_offload": 0.0, "exposed_host_offload": 0.0})
    assert got[("tpu_pod_simulated_collective_seconds_sum", ())] == pytest.approx(2 * 1.1e-5)
    assert got[("tpu_pod_simulated_chip_compute_seconds", (("chip", "0"),))] == 4e-5


def test_port_in_use_is_one_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        metrics = PodMetrics(scenario="s", generation="v2", slice_name="v2-8", topology="2x2")
        with pytest.raises(MetricsError, match=f"port {port} on 127.0.0.1 is already in use"):
            metrics.serve(port)


def test_port_in_use_through_the_cli(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "pod", "run", "scenarios/quickstart.yaml",
                              "--steps", "1", "--metrics-port", str(port), "--output-dir",
                              str(tmp_path), "--in-process"], cwd=ROOT, capture_output=True,
                             text=True, timeout=120)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().count("\n") == 0 and "already in use" in out.stderr


def test_grafana_dashboard_is_valid_and_queries_exported_metrics():
    dash = json.loads((MONITORING / "grafana" / "tpu-pod-dashboard.json").read_text())
    samples = exported_samples()
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 30
    variables = {v["name"] for v in dash["templating"]["list"]}
    ids, used = set(), set()
    for panel in dash["panels"]:
        assert panel["id"] not in ids
        ids.add(panel["id"])
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"])
        assert panel["datasource"]["uid"].strip("${}") in variables
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)) and refs
        for target in panel["targets"]:
            names = METRIC_RE.findall(target["expr"])
            assert names, target["expr"]
            for name in names:
                assert name in samples, f"{panel['title']}: {name} is not exported"
            used.update(names)
    # the dashboard shows what the issue asks for
    for needed in ("tpu_pod_simulated_examples_per_second", "tpu_pod_mfu_ratio",
                   "tpu_pod_simulated_step_part_seconds", "tpu_pod_hbm_used_bytes",
                   "tpu_pod_ici_transferred_bytes_total",
                   "tpu_pod_simulated_collective_seconds_bucket", "tpu_pod_collective_seconds_total", "tpu_pod_collective_exposed_seconds_total",
                   "tpu_pod_collective_overlap_ratio"):
        assert needed in used, needed
    # the files under monitoring/ name only metrics that exist (none of the old names)
    for path in MONITORING.rglob("*"):
        if path.suffix in (".yml", ".yaml", ".json", ".py"):
            for name in METRIC_RE.findall(path.read_text()):
                base = re.sub(r"_(sum|count|bucket)$", "", name)
                assert base in set(METRIC_NAMES) | {"tpu_pod_"}, f"{path.name}: {name}"


promtool = shutil.which("promtool")


@pytest.mark.skipif(promtool is None, reason="promtool not installed (Debian package "
                    "'prometheus'; .ci/run installs it)")
def test_prometheus_config_and_alert_rules_check_and_pass_their_unit_tests():
    for args in (["check", "config", "prometheus.yml"], ["check", "rules", "alerts.yml"],
                 ["test", "rules", "alerts_test.yml"]):
        out = subprocess.run([promtool, *args], cwd=MONITORING, capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr
    rules = (MONITORING / "alerts.yml").read_text()
    for name in METRIC_RE.findall(rules):
        assert re.sub(r"_(sum|count|bucket)$", "", name) in set(METRIC_NAMES), name


prometheus = shutil.which("prometheus")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _query(port: int, expr: str) -> list:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as resp:
        body = json.loads(resp.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def _start_monitor(*args: str) -> tuple[subprocess.Popen, list[str]]:
    """``tpu-pod monitor ARGS``; returns it and its first lines, once it prints the URL."""
    proc = subprocess.Popen([sys.executable, "-m", "pod", "monitor", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("Start a run"):
            return proc, lines
    proc.wait(timeout=30)
    pytest.fail(f"tpu-pod monitor ended: {''.join(lines)} {proc.stderr.read()}")


def _stop_monitor(proc: subprocess.Popen) -> tuple[int, str]:
    """Ctrl-C, as a terminal sends it; returns the exit status and the rest of stdout."""
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=40)
    return proc.returncode, rest


@pytest.mark.slow  # several seconds: the slow tier (make test stays under 3 minutes)
@pytest.mark.skipif(prometheus is None, reason="prometheus not installed (Debian package "
                    "'prometheus'; .ci/run installs it)")
def test_tpu_pod_monitor_scrapes_a_training_run_and_the_dashboard_queries_answer(tmp_path):
    exporter, server = _free_port(), _free_port()
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text(
        "name: prom\npod: {slice: v2-8}\n"
        "model: {name: mlp, options: {hidden: [16], dropout: false}}\n"
        "training: {global_batch: 64, steps: 400, optimizer: {name: sgd, learning_rate: 0.05}}\n")
    monitor, lines = _start_monitor("--port", str(server), "--target", f"127.0.0.1:{exporter}",
                                    "--scrape-interval", "1")
    try:
        assert lines[0].startswith(f"Prometheus on http://127.0.0.1:{server} scraping "
                                   f"127.0.0.1:{exporter} every 1s"), lines
        workdir = Path(re.search(r"data and log in (\S+) ", lines[1]).group(1))
        assert workdir.is_dir() and (workdir / "tsdb").is_dir()
        # the shipped alert rules are loaded
        with urllib.request.urlopen(f"http://127.0.0.1:{server}/api/v1/rules", timeout=5) as resp:
            groups = json.loads(resp.read())["data"]["groups"]
        assert {r["name"] for g in groups for r in g["rules"]} >= {"TpuPodLowMFU",
                                                                   "TpuPodIciLinkIdle"}
        # the run holds its endpoint 30 s after training; query while it does
        # (once the target goes away, Prometheus marks its series stale)
        run = subprocess.Popen(
            [sys.executable, "-m", "pod", "run", str(scenario), "--metrics-port", str(exporter),
             "--output-dir", str(tmp_path / "out"), "--log-every", "0", "--hold-seconds", "30",
             "--in-process"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for line in run.stdout:
            if line.startswith("Holding the metrics endpoint"):
                break
        else:
            pytest.fail(f"the run ended without holding: {run.stderr.read()[-2000:]}")
        # scrapes of the final values at 1 s: wait (bounded, within the 30 s hold) until
        # Prometheus holds three samples of the run, so that every [1m] window of the
        # dashboard has two to rate even on a loaded host, where scrapes arrive late
        deadline = time.monotonic() + 20
        while True:
            samples = _query(server, "count_over_time(tpu_pod_steps_total[1m])")
            if samples and float(samples[0]["value"][1]) >= 3:
                break
            assert time.monotonic() < deadline, f"fewer than 3 scrapes in 20 s: {samples}"
            time.sleep(0.5)
        summary = json.loads((tmp_path / "out" / "summary.json").read_text())
        # a loaded host scrapes late: the samples above may all be from during training;
        # wait (bounded, within the hold) for one of the final values
        while float(_query(server, "tpu_pod_steps_total")[0]["value"][1]) < summary["steps"]:
            assert time.monotonic() < deadline + 10, "no scrape of the final values"
            time.sleep(0.5)

        eps = _query(server, "tpu_pod_simulated_examples_per_second")
        assert len(eps) == 1
        assert float(eps[0]["value"][1]) == pytest.approx(
            summary["simulated_examples_per_second"], rel=1e-9)
        count = _query(server, "tpu_pod_simulated_step_seconds_count")
        assert float(count[0]["value"][1]) == summary["steps"]
        buckets = _query(server, "tpu_pod_simulated_step_seconds_bucket")
        assert len(buckets) > 5 and max(float(b["value"][1]) for b in buckets) == summary["steps"]
        series = _query(server, "tpu_pod_ici_transferred_bytes_total[2m]")
        busy = [s for s in series if float(s["values"][-1][1]) > 0]
        assert busy, "no ICI bytes arrived"
        for s in busy:  # a counter never falls (the in-process run may finish within
            values = [float(v) for _, v in s["values"]]  # one scrape: no rise is required)
            assert values == sorted(values), s["metric"]
        total = sum(float(s["values"][-1][1]) for s in series)
        assert total == summary["ici_bytes_per_step"] * summary["steps"]
        (info,) = _query(server, "tpu_pod_info")
        assert info["metric"]["scenario"] == "prom" and info["metric"]["generation"] == "v2"

        # every dashboard query answers for this run (All selected), and for its
        # scenario and instance; another scenario's name selects nothing
        dash = json.loads((MONITORING / "grafana" / "tpu-pod-dashboard.json").read_text())
        instance = f"127.0.0.1:{exporter}"
        for panel in dash["panels"]:
            for target in panel["targets"]:
                for chosen, other in ((".*", ".*"), ("prom", instance)):
                    expr = target["expr"].replace("$scenario", chosen).replace("$instance", other)
                    assert _query(server, expr), f"{panel['title']}: {expr} returned nothing"
                expr = target["expr"].replace("$scenario", "another").replace("$instance", ".*")
                assert not _query(server, expr), f"{panel['title']}: {expr}"
    finally:
        if "run" in locals():
            run.terminate()
            run.wait(timeout=30)
        code, rest = _stop_monitor(monitor)
    assert code == 0 and "Prometheus stopped (exit status 0)" in rest, rest
    assert not workdir.exists()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{server}/-/ready", timeout=2)


@pytest.mark.skipif(prometheus is None, reason="prometheus not installed (Debian package "
                    "'prometheus'; .ci/run installs it)")
def test_tpu_pod_monitor_stops_on_sigterm_and_reports_a_busy_port(tmp_path):
    server = _free_port()
    monitor, _ = _start_monitor("--port", str(server))
    try:
        second = subprocess.run([sys.executable, "-m", "pod", "monitor", "--port", str(server)],
                                cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert second.returncode == 2 and second.stderr.count("\n") == 1, second.stderr
        assert f"port {server} on 127.0.0.1 is already in use" in second.stderr
    finally:
        monitor.terminate()
        rest, _ = monitor.communicate(timeout=40)
    assert monitor.returncode == 0 and "Prometheus stopped" in rest


def test_tpu_pod_monitor_without_prometheus_is_one_line_naming_the_binary(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pod", "monitor"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, env={**os.environ, "PATH": str(tmp_path)})
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "'prometheus' binary is not on PATH" in out.stderr
    assert "apt-get install prometheus" in out.stderr


def test_monitor_config_is_the_shipped_one_with_the_options_applied(tmp_path):
    from pod.commands.monitor import MonitorOptions, default_config, render_config

    shipped = default_config()
    assert shipped.read_bytes() == (MONITORING / "prometheus.yml").read_bytes()
    plain = render_config(MonitorOptions(config=shipped))
    assert plain["scrape_configs"][0]["static_configs"][0]["targets"] == ["127.0.0.1:9188"]
    assert [Path(p) for p in plain["rule_files"]] == [(MONITORING / "alerts.yml").resolve()]
    config = render_config(MonitorOptions(config=shipped, targets=("127.0.0.1:9200", "h:9201"),
                                          scrape_interval_s=0.5))
    assert config["scrape_configs"][0]["static_configs"] == [
        {"targets": ["127.0.0.1:9200", "h:9201"]}]
    assert config["global"]["scrape_interval"] == config["global"]["evaluation_interval"] == "500ms"
    for bad in ({"targets": ("9188",)}, {"targets": ("host:port",)}, {"port": 0}):
        with pytest.raises(ValueError):
            MonitorOptions(config=shipped, **bad)
    if promtool is not None:
        path = tmp_path / "prometheus.yml"
        path.write_text(yaml.safe_dump(config))
        out = subprocess.run([promtool, "check", "config", str(path)], capture_output=True,
                             text=True)
        assert out.returncode == 0, out.stdout + out.stderr


def _epoch_scenario(steps: int, **extra):
    """digits' 1,437 training examples at global batch 512: 2 steps per epoch;
    evaluated after every 4th step and the last."""
    from pod.config.scenario import parse_scenario

    return parse_scenario({
        "name": "epochs", "pod": {"slice": "v2-8"},
        "model": {"name": "mlp", "options": {"hidden": [32], "dropout": False}},
        "data": {"name": "digits"},
        "training": {"global_batch": 512, "steps": steps, "eval_every_steps": 4,
                     "optimizer": {"name": "adam", "learning_rate": 0.01}},
        "metrics": {"port": 0}, **extra})


def _epoch_lines(text: str) -> list[dict[str, str]]:
    """Each 'Epoch e/n - k steps - loss: L - ...' line as {field: value}."""
    out = []
    for line in text.splitlines():
        if "Epoch " in line:
            parts = line[line.index("Epoch "):].split(" - ")
            fields = dict(p.split(": ", 1) for p in parts if ": " in p)
            fields["wall"] = fields.get("wall", parts[-1].split()[0])
            out.append({"epoch": parts[0].split()[1], "steps": parts[1].split()[0], **fields})
    return out


def _check_keras_habits(out, log: str) -> None:
    """Epoch lines: the epoch's mean loss, test figures only where evaluated; steps.csv:
    steps from 1, test figures on the evaluated rows, equal to the lines'."""
    import csv

    rows = list(csv.DictReader((out / "steps.csv").open()))
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in rows if r["test_loss"]] == ["4", "5"]
    epochs = _epoch_lines(log)[-3:]  # a recovered run prints the recomputed epoch again
    # (epoch number, steps in it); a first run of 4 steps before a resume says 1/2, 2/2
    assert [(e["epoch"].split("/")[0], e["steps"]) for e in epochs] == [("1", "2"), ("2", "2"),
                                                                         ("3", "1")]
    assert epochs[-1]["epoch"] == "3/3"
    for e, steps in zip(epochs, ([1, 2], [3, 4], [5])):
        mean = sum(float(rows[s - 1]["loss"]) for s in steps) / len(steps)
        assert e["loss"] == f"{mean:.4f}"             # the epoch's mean, not its last step's
        evaluated = rows[steps[-1] - 1]
        if evaluated["test_loss"]:
            assert e["test_loss"] == f"{float(evaluated['test_loss']):.4f}"
            assert e["test_accuracy"] == f"{float(evaluated['test_accuracy']):.4f}"
        else:
            assert "test_loss" not in e and "test_accuracy" not in e


def test_keras_habits_epoch_mean_loss_eval_every_steps_and_steps_csv(tmp_path):
    import io

    from rich.console import Console

    from pod.config.plan import build_plan
    from pod.commands.train import run_training

    plan = build_plan(_epoch_scenario(5))
    assert plan.steps_per_epoch == 2
    log = io.StringIO()
    summary = run_training(plan, output_dir=tmp_path, metrics_port=0, log_every=0,
                           console=Console(file=log, force_terminal=True, width=200),
                           backend="local")
    text = log.getvalue()
    _check_keras_habits(tmp_path, text)
    assert f"test_accuracy: {summary['test_accuracy']:.4f}" in text
    assert "ETA" in text and "training" in text  # the progress bar, drawn on a terminal


def test_epoch_lines_after_a_resume_or_a_recovery_do_not_merge_two_epochs(tmp_path):
    """The checkpoint after step 4 closes epoch 2; the run resumed from it (or restored
    to it after chip 1 dies in step 5) prints epoch 3 as its one step."""
    import io

    from rich.console import Console

    from pod.config.plan import build_plan
    from pod.commands.train import run_training

    def run(out, steps, **kw):
        log = io.StringIO()
        run_training(build_plan(_epoch_scenario(steps, checkpoint={"every_steps": 2})),
                     output_dir=out, metrics_port=0, log_every=0,
                     console=Console(file=log, width=200), backend="local", **kw)
        return log.getvalue()

    first = run(tmp_path / "resumed", 4)
    _check_keras_habits(tmp_path / "resumed", first + run(
        tmp_path / "resumed", 5, resume_dir=tmp_path / "resumed" / "checkpoints"))
    log = io.StringIO()
    sc = _epoch_scenario(5, checkpoint={"every_steps": 2},
                         faults=[{"kind": "kill_chip", "chip": 1, "step": 5}])
    summary = run_training(build_plan(sc), output_dir=tmp_path / "recovered", metrics_port=0,
                           log_every=0, console=Console(file=log, width=200), backend="local")
    assert summary["faults"][0]["restored_from_step"] == 4
    _check_keras_habits(tmp_path / "recovered", log.getvalue())


def test_a_link_that_stops_carrying_traffic_reads_zero_utilization():
    """A link that fails (routed around from some step on) carries nothing: its gauge
    must fall to 0, not keep the last step's value."""
    import dataclasses

    metrics = _metrics()

    def utilization() -> dict[str, float]:
        text = generate_latest(metrics.registry).decode()
        return {s.labels["link"]: s.value for fam in text_string_to_metric_families(text)
                for s in fam.samples if s.name == "tpu_pod_ici_link_utilization_ratio"}

    both = dataclasses.replace(fake_stats(), ici_link_bytes={"0->1": 1000, "1->0": 500})
    metrics.observe(both)
    assert utilization()["1->0"] > 0
    metrics.observe(dataclasses.replace(fake_stats(1), ici_link_bytes={"0->1": 1500}))
    assert utilization()["1->0"] == 0.0
    assert utilization()["0->1"] == pytest.approx(both.ici_link_utilization()["0->1"] * 1.5)

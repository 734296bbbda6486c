"""Sharded runs in sharded words (issue 25, item 8): validate and describe say mesh and
per device; tokens/s in the progress line, the summary and Prometheus; the gauges of the
last step absent before the first step (so TpuPodLowMFU cannot fire during start-up);
a test accuracy that was not evaluated is null, an empty cell and an absent metric,
never 0.0."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from click.testing import CliRunner
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import pod
from pod.cli import cli
from pod.commands.train import Run
from pod.report.console import progress_line, summary_rows
from pod.report.metrics import PodMetrics
from pod.report.stats import StepStats

ROOT = Path(__file__).resolve().parents[3]
SHARDED = ROOT / "scenarios/transformer-sharded.yaml"
#: the gauges of the last step, which read 0 before there was one
STEP_GAUGES = ("tpu_pod_mfu_ratio", "tpu_pod_loss", "tpu_pod_simulated_examples_per_second",
               "tpu_pod_simulated_flops_per_second", "tpu_pod_collective_overlap_ratio",
               "tpu_pod_emulation_slowdown_ratio", "tpu_pod_emulation_rate_ratio",
               "tpu_pod_mxu_utilization_ratio", "tpu_pod_simulated_chip_compute_seconds",
               "tpu_pod_ici_link_utilization_ratio", "tpu_pod_test_accuracy_ratio")


def _samples(metrics: PodMetrics) -> dict[str, list]:
    text = generate_latest(metrics.registry).decode()
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def _metrics() -> PodMetrics:
    return PodMetrics(scenario="s", generation="v5e", slice_name="v5e-8", topology="2x4",
                      links=["0->1", "1->0"], chips=2, devices_per_chip=1)


def _stats(tokens: int = 0) -> StepStats:
    return StepStats(step=0, loss=2.5, global_batch=32, infeed_seconds=1e-6,
                     compute_seconds=5e-5, collective_seconds=2e-5, update_seconds=2e-6,
                     model_flops=10**9, peak_flops_per_s=1.5e15, wall_seconds=0.02,
                     tokens_per_example=tokens, exposed_collective_seconds=1e-5,
                     device_mxu_flops={0: 4 * 10**8, 1: 4 * 10**8},
                     device_peak_flops_per_s=1.9e14, chip_compute_seconds={0: 5e-5, 1: 5e-5},
                     ici_link_bytes={"0->1": 1000}, ici_link_bandwidth_bytes_per_s=4.5e10)


def test_the_gauges_of_the_last_step_are_absent_before_the_first_step():
    metrics = _metrics()
    before = _samples(metrics)
    assert not set(STEP_GAUGES) & set(before), sorted(set(STEP_GAUGES) & set(before))
    # TpuPodLowMFU is `tpu_pod_mfu_ratio < 0.25`: with no sample it has nothing to fire on
    assert "tpu_pod_mfu_ratio" not in before
    assert {"tpu_pod_info", "tpu_pod_steps_total"} <= set(before)  # what is true already
    metrics.observe(_stats())
    after = _samples(metrics)
    assert set(STEP_GAUGES) - {"tpu_pod_test_accuracy_ratio"} <= set(after)
    assert {s.labels["link"] for s in after["tpu_pod_ici_link_utilization_ratio"]} == \
        {"0->1", "1->0"}  # every link, the idle one at 0
    metrics.observe(_stats())  # a second step registers nothing twice
    assert len(_samples(metrics)["tpu_pod_mfu_ratio"]) == 1


def test_tokens_per_second_is_a_metric_of_sequence_models():
    metrics = _metrics()
    metrics.observe(_stats(tokens=128))
    (sample,) = _samples(metrics)["tpu_pod_simulated_tokens_per_second"]
    assert sample.value == _stats(tokens=128).tokens_per_second == \
        128 * _stats().examples_per_second
    images = _metrics()
    images.observe(_stats())
    assert "tpu_pod_simulated_tokens_per_second" not in _samples(images)


def test_tokens_per_second_in_the_progress_line_and_the_summary():
    line = progress_line(_stats(tokens=128), 10)
    assert f"sim {_stats(tokens=128).tokens_per_second:,.0f} tokens/s" in line
    assert "tokens/s" not in progress_line(_stats(), 10)


def test_a_test_accuracy_is_recorded_only_when_evaluated():
    metrics = _metrics()
    metrics.set_accuracy(float("nan"))  # no test example evaluated
    metrics.set_accuracy(None)
    assert "tpu_pod_test_accuracy_ratio" not in _samples(metrics)
    metrics.set_accuracy(0.75)
    metrics.set_accuracy(float("nan"))  # keeps the last evaluated value
    assert _samples(metrics)["tpu_pod_test_accuracy_ratio"][0].value == 0.75


def test_not_evaluated_is_null_in_the_summary_empty_in_steps_csv_and_absent(tmp_path):
    scenario = {"name": "words", "pod": {"slice": "v5e-8", "mesh": {"data": 2, "fsdp": 2,
                                                                    "tensor": 2}},
                "model": {"name": "transformer",
                          "options": {"embed_dim": 32, "heads": 2, "layers": 1}},
                "data": {"name": "text", "options": {"sequence_length": 16}},
                "training": {"global_batch": 8, "steps": 3, "eval_every_steps": 0},
                "metrics": {"port": 0}}
    plan = pod.build_plan(pod.load(scenario))
    seen: list[set[str]] = []
    the_run = Run(plan, output_dir=tmp_path, metrics_port=0, log_every=0,
                  on_step=lambda stats: seen.append(set(_samples(the_run.metrics))),
                  keep_history=True, backend="local")
    summary = the_run.run()
    assert "tpu_pod_test_accuracy_ratio" not in seen[0] and "tpu_pod_mfu_ratio" in seen[0]
    assert "tpu_pod_simulated_tokens_per_second" in seen[0]
    assert "tpu_pod_test_accuracy_ratio" in seen[-1]  # evaluated after the last step
    with (tmp_path / "steps.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["test_accuracy"] for r in rows[:-1]] == ["", ""] and rows[-1]["test_accuracy"]
    assert the_run.history[0].test_accuracy is None
    assert 0.0 <= summary["test_accuracy"] <= 1.0
    assert [s.row()["test_accuracy"] for s in the_run.history][:2] == [None, None]
    # the summary's throughput row names tokens/s, as its progress line did
    (throughput,) = [v for k, v, _ in summary_rows(summary) if k == "throughput"]
    assert throughput.endswith(f"{summary['simulated_tokens_per_second']:,.0f} tokens/s")


def test_validate_says_mesh_and_per_device():
    out = CliRunner().invoke(cli, ["validate", str(SHARDED)])
    assert out.exit_code == 0, out.output
    line = out.output.strip()
    assert "mesh {data: 2, fsdp: 2, tensor: 2} (8 devices)" in line
    assert "global batch 32 = 8 per device" in line
    assert "per core" not in line and "allreduce" not in line  # no data axis over the slice


def test_describe_json_of_a_mesh_has_its_axes_not_an_allreduce():
    out = CliRunner().invoke(cli, ["describe", str(SHARDED), "--json"])
    assert out.exit_code == 0, out.output[-2000:]
    data = json.loads(out.output)
    assert data["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2}
    assert data["collective_algorithms"] == {"data": "torus", "fsdp": "torus", "tensor": "torus"}
    assert "per_device_batch" in data
    step = data["step"]
    assert set(step["exposed_by_axis"]) == {"data", "fsdp", "tensor"}
    assert step["exposed_collective_seconds"] > 0 and step["simulated_tokens_per_second"] > 0
    assert math.isclose(sum(step["exposed_by_axis"].values()),
                        step["exposed_collective_seconds"], rel_tol=1e-9)

"""One figures record (issue 31 item 1): every output formats the MFU, HFU, tokens/s and
overlap fraction of one ``StepStats`` (or of its mean over a run's steps); none computes
them again. For each chip generation, each output's figures equal the step's, to the
digits the output prints.

The step is a timing-only step of a small transformer (remat full, so HFU > MFU) on a
``{data: 2, fsdp: N}`` mesh of an 8-core slice of each generation (v2 / v3 have a device
per TensorCore: the MFU denominator of these is where wrong pod peaks hid)."""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from rich.console import Console

from pod import api
from pod.cli import cli
from pod.commands.plan import Planner
from pod.commands.plan_search import Candidate
from pod.commands.plan_source import model_source
from pod.commands.sweep import step_row
from pod.commands.train import Run
from pod.config.plan import build_plan
from pod.config.scenario import parse_scenario
from pod.config.slices import resolve_pod
from pod.report.console import summary_table
from pod.report.files import summarize
from pod.report.stats import mean_step
from pod.runtime.timing import TimingPod

GENERATIONS = ("v2", "v3", "v4", "v5e", "v5p", "v6e")
FIGURES = ("mfu", "hfu", "tokens_per_second", "overlap_fraction")


def scenario_data(generation: str) -> dict:
    """A transformer on ``<generation>-8`` over {data: 2, fsdp: devices / 2}."""
    pod = resolve_pod(slice_name=f"{generation}-8")
    devices = pod.tensorcores if pod.chip.tensorcores > 1 and generation in ("v2", "v3") \
        else pod.chips
    return {
        "name": f"figures-{generation}",
        "pod": {"slice": f"{generation}-8", "mesh": {"data": 2, "fsdp": devices // 2}},
        "model": {"name": "transformer",
                  "options": {"embed_dim": 512, "heads": 8, "head_dim": 64, "mlp_dim": 2048,
                              "layers": 2, "remat": "full"}},
        "data": {"name": "synthetic_text",
                 "options": {"vocabulary": 64, "sequence_length": 256, "num_examples": 128}},
        "training": {"global_batch": 8 * devices, "steps": 3, "optimizer": {"name": "adamw"}},
        "metrics": {"port": 0}}


class Figures:
    """The reference, StepStats' own properties of the timing-only steps, and the outputs of
    a ``Run`` of those steps (timing-only, report.html on): summary.json, steps.csv,
    report.html, its console and its Prometheus registry."""

    def __init__(self, generation: str, out: Path) -> None:
        self.data = scenario_data(generation)
        self.plan = build_plan(parse_scenario(self.data, source="<test>"), timing_only=True)
        pod = TimingPod(self.plan)
        self.steps = [pod.step(s) for s in range(self.plan.steps)]
        self.stats = mean_step(self.steps)
        self.want = {"mfu": self.stats.mfu, "hfu": self.stats.hfu,
                     "tokens_per_second": self.stats.tokens_per_second,
                     "overlap_fraction": self.stats.overlap_fraction}
        self.out = out
        buffer = io.StringIO()
        self.run = Run(self.plan, output_dir=out, backend="timing", report=True,
                       metrics_port=0, console=Console(file=buffer, width=200))
        self.summary = self.run.run()
        self.console = buffer.getvalue()


@pytest.fixture(scope="module", params=GENERATIONS)
def figures(request, tmp_path_factory) -> Figures:
    f = Figures(request.param, tmp_path_factory.mktemp(request.param))
    assert 0.05 < f.want["mfu"] < f.want["hfu"] < 1, "remat full: HFU above MFU"
    assert 0.1 < f.want["overlap_fraction"] < 0.9 and f.want["overlap_fraction"] != 0.5
    assert f.want["tokens_per_second"] > 0
    return f


def _close(got: dict[str, float], want: dict[str, float], rel: float = 1e-9) -> None:
    for name, value in got.items():
        assert value == pytest.approx(want[name], rel=rel), name


def _text(renderable) -> str:
    buffer = io.StringIO()
    Console(file=buffer, width=200).print(renderable)
    return buffer.getvalue()


def _percent(text: str, pattern: str) -> float:
    match = re.search(pattern, text)
    assert match, pattern
    return float(match.group(1)) / 100


def _count(text: str, pattern: str) -> float:
    match = re.search(pattern, text)
    assert match, pattern
    return float(match.group(1).replace(",", ""))


def test_summary_json(figures):
    summary = json.loads((figures.out / "summary.json").read_text())
    assert summary == json.loads(json.dumps(figures.summary))
    _close({"mfu": summary["mfu"], "hfu": summary["hfu"],
            "tokens_per_second": summary["simulated_tokens_per_second"],
            "overlap_fraction": summary["overlap_fraction"]}, figures.want)


def test_console_summary_and_progress_lines(figures):
    text, want = figures.console, figures.want
    assert _percent(text, r"MFU[\s│]+([\d.]+)%") == pytest.approx(want["mfu"], abs=5e-5)
    assert _count(text, r"([\d,]+) tokens/s\s*│") == pytest.approx(want["tokens_per_second"],
                                                                  abs=0.5)
    assert _percent(text, r"\((\d+)% hidden\)") == pytest.approx(want["overlap_fraction"],
                                                                  abs=5e-3)
    lines = [line for line in text.splitlines() if line.startswith("step ")]
    assert len(lines) == figures.plan.steps
    assert _count(lines[-1], r"sim ([\d,]+) tokens/s") == pytest.approx(
        figures.steps[-1].tokens_per_second, abs=0.5)


def test_steps_csv(figures):
    with (figures.out / "steps.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(figures.steps)
    for row, stats in zip(rows, figures.steps, strict=True):
        _close({"mfu": float(row["mfu"]), "hfu": float(row["hfu"]),
                "tokens_per_second": float(row["simulated_tokens_per_second"]),
                "overlap_fraction": float(row["overlap_fraction"])},
               {"mfu": stats.mfu, "hfu": stats.hfu,
                "tokens_per_second": stats.tokens_per_second,
                "overlap_fraction": stats.overlap_fraction})


def test_sweep_row(figures):
    row = step_row(figures.plan, figures.steps[1:], 1.0)
    _close({"mfu": row["mfu"], "hfu": row["hfu"],
            "tokens_per_second": row["simulated_tokens_per_second"],
            "overlap_fraction": row["overlap_fraction"]}, figures.want)


def test_plan_row(figures, tmp_path):
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(figures.data))
    plan = figures.plan
    planner = Planner(model_source(str(path), slice_name=plan.topology.name))
    row = planner.cost(Candidate(1, plan.topology.name, dict(plan.mesh.sizes), "full",
                                 plan.global_batch, plan.per_device_batch))
    assert row["status"] == "ok", row["reason"]
    _close({"mfu": row["mfu"], "hfu": row["hfu"],
            "tokens_per_second": row["simulated_tokens_per_second"]}, figures.want)


def test_prometheus(figures):
    value = figures.run.metrics.registry.get_sample_value
    last = figures.steps[-1]  # the gauges of the last step
    _close({"mfu": value("tpu_pod_mfu_ratio"),
            "tokens_per_second": value("tpu_pod_simulated_tokens_per_second"),
            "overlap_fraction": value("tpu_pod_collective_overlap_ratio")},
           {"mfu": last.mfu, "tokens_per_second": last.tokens_per_second,
            "overlap_fraction": last.overlap_fraction})
    assert value("tpu_pod_loss") is None  # timing-only: no loss, not a made-up 0


def test_report_html(figures):
    page = (figures.out / "report.html").read_text()
    want = figures.want
    assert _percent(page, r"MFU</td><td[^>]*>([\d.]+)%") == pytest.approx(want["mfu"], abs=5e-5)
    assert _count(page, r"([\d,]+) tokens/s") == pytest.approx(want["tokens_per_second"],
                                                               abs=0.5)
    assert _percent(page, r"\((\d+)% hidden\)") == pytest.approx(want["overlap_fraction"],
                                                                  abs=5e-3)


def test_describe_and_run_json(figures, tmp_path):
    """``tpu-pod describe --json``'s step (one timing-only step) and ``run --timing-only
    --json``'s summary (the mean of the steps after the first)."""
    path = tmp_path / "figures.yaml"
    path.write_text(yaml.safe_dump(figures.data))
    out = CliRunner().invoke(cli, ["describe", str(path), "--json"])
    assert out.exit_code == 0, out.output[-2000:]
    step = json.loads(out.output)["step"]
    _close({"mfu": step["mfu"], "hfu": step["hfu"],
            "tokens_per_second": step["simulated_tokens_per_second"]}, figures.want)
    assert api.describe(path).step.mfu == pytest.approx(figures.want["mfu"], rel=1e-9)
    out = CliRunner().invoke(
        cli, ["run", str(path), "--timing-only", "--json", "--output-dir", str(tmp_path / "run")])
    assert out.exit_code == 0, out.output[-2000:]
    summary = json.loads(out.stdout)
    _close({"mfu": summary["mfu"], "hfu": summary["hfu"],
            "tokens_per_second": summary["simulated_tokens_per_second"],
            "overlap_fraction": summary["overlap_fraction"]}, figures.want)


@pytest.mark.parametrize("mesh, allreduce, want", [
    ({"fsdp": 8}, "auto", {"fsdp": "torus"}),           # was a placeholder "ring"
    ({"data": 8}, "ring", {"data": "ring"}),             # the pod's own algorithm
    ({"data": 8}, "auto", {"data": "torus"}),
    ({"data": 2, "fsdp": 4}, "ring", {"data": "torus", "fsdp": "torus"}),  # group collectives
])
def test_the_algorithm_of_each_axis_is_the_cost_tables(mesh, allreduce, want):
    """summary.json, the sweep's row and the run's header name the algorithm each mesh axis
    runs (``MeshCollectiveCosts.algorithm_of``), not the pod's whole-slice choice."""
    data = scenario_data("v5e")
    data["pod"] = {**data["pod"], "mesh": mesh, "allreduce": allreduce}
    data["training"]["global_batch"] = 64
    plan = build_plan(parse_scenario(data, source="<test>"), timing_only=True)
    assert plan.collective_costs.algorithms() == want
    steps = [TimingPod(plan).step(0)]
    summary = summarize(plan, steps, None, None, 1.0, 0.0)
    assert summary["collective_algorithms"] == want
    assert summary["allreduce_algorithm"] == want.get("data")
    row = step_row(plan, steps, 1.0)
    assert row["allreduce_algorithm"] == want.get("data", "")
    assert row["collective_algorithms"] == (f"allreduce {want['data']}" if list(want) == ["data"]
                                            else ", ".join(f"{a} {n}" for a, n in want.items()))
    assert "ring" not in _text(summary_table(summary)) or "ring" in want.values()

"""Notebooks (issue 33 item 10): a plan, a description, a run's result and a sweep's or a
plan's rows show as one short line when they are a cell's last value (``pod.validate``'s
plan printed 6,582 characters); ``pod.sweep`` shows its progress; ``pod.plan`` takes the
command's option names (``slice=``, ``per_device_batch=``), the earlier ones warned."""

from __future__ import annotations

import io
import sys
import warnings
from pathlib import Path

import pytest
from rich.console import Console

import pod
import pod.api
from pod.api import Rows
from pod.commands.train import Run
from pod.config.plan import TrainingPlan
from pod.runtime.base import PodBase
from pod.runtime.timing import TimingPod
from tests.pod.report.test_one_figures_record import scenario_data

ROOT = Path(__file__).resolve().parents[2]
SHORT = 300  # characters: one line a cell shows whole


def _one_short_line(value) -> str:
    text = repr(value)
    assert "\n" not in text and len(text) < SHORT, text
    return text


def test_a_plan_and_a_description_are_one_line():
    plan = pod.validate(ROOT / "scenarios/quickstart.yaml")
    text = _one_short_line(plan)
    assert text.startswith("<TrainingPlan quickstart: v2-8 (4 chips), cnn (")
    assert "{data: 8}" in text
    bench = pod.validate(ROOT / "scenarios/seed-matmul-v2-8.yaml")
    assert _one_short_line(bench).startswith("<BenchmarkPlan seed-matmul-v2-8: matmul N=4,096")
    desc = pod.describe(ROOT / "scenarios/transformer-sharded.yaml")
    text = _one_short_line(desc)
    assert "ms (simulated), MFU" in text and desc.step is not None and desc.bounds is not None
    assert desc.step.mfu == pytest.approx(float(text.split("MFU ")[1].rstrip("%>")) / 100,
                                          abs=5e-4)


def test_a_timing_only_run_result_is_one_line(tmp_path):
    result = pod.run(scenario_data("v5e"), timing_only=True, quiet=True)
    text = _one_short_line(result)
    assert text.startswith("<RunResult figures-v5e: 3 steps on v5e-8;")
    assert "loss" not in text  # a timing-only run computes none
    assert result.summary["initial_loss"] is None and len(result.history) == 3


def test_sweep_rows_are_one_line_and_a_table_and_show_progress(tmp_path, capsys, monkeypatch):
    import pod.commands.sweep
    from tests.pod.commands.test_sweep_rows import sweep_scenario

    monkeypatch.setattr(pod.commands.sweep, "plot", lambda *a: [])  # rows, not plots, here
    monkeypatch.setattr(pod.api, "make_console",  # a terminal (a pipe shows no progress)
                        lambda: Console(file=sys.stdout, force_terminal=True, width=100))

    scenario = sweep_scenario().with_overrides(sweep__remat=["none"], sweep__per_device_batch=[1])
    rows = pod.sweep(scenario, output_dir=tmp_path)
    assert isinstance(rows, list) and isinstance(rows, Rows) and len(rows) == 2
    assert _one_short_line(rows) == "<sweep layouts: 2 rows, 2 ok, 0 not; a list of dicts: " \
                                    "pd.DataFrame(rows), rows[0]>"
    html = rows._repr_html_()
    assert html.count("<tr>") == 3 and "simulated_tokens_per_second" in html
    out = capsys.readouterr().out
    assert "sweep layouts: 2/2 points (0 failed)" in out


def test_plan_takes_the_commands_names_and_warns_on_the_old_ones(tmp_path):
    tiny = str(ROOT / "scenarios/transformer-tiny.yaml")
    rows = pod.plan(tiny, slice="v5e-8", remat="none", per_device_batch=1, mesh_axes="data")
    assert isinstance(rows, Rows) and _one_short_line(rows).startswith("<plan ")
    with pytest.warns(DeprecationWarning, match="slices= is deprecated; use slice="):
        old = pod.plan(tiny, slices="v5e-8", remat="none", per_device_batch=1, mesh_axes="data")
    with pytest.warns(DeprecationWarning, match="per_device_batches= is deprecated"):
        pod.plan(tiny, slice="v5e-8", remat="none", per_device_batches=[1], mesh_axes="data")
    assert [r["mesh"] for r in old] == [r["mesh"] for r in rows]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(pod.ScenarioError, match="^slices: give slice= .* not both"):
            pod.plan(tiny, slice="v5e-8", slices="v5e-8")


def test_the_timing_pod_is_a_pod_base_back_end(tmp_path):
    """One Run drives the timing-only pod as it does the others (abstract hooks, not
    NotImplementedError): a PodBase cannot be made, a back-end missing a hook neither."""
    plan = pod.validate(scenario_data("v4"))
    assert isinstance(plan, TrainingPlan)
    assert issubclass(TimingPod, PodBase)
    with pytest.raises(TypeError, match="abstract"):
        PodBase(plan)  # type: ignore[abstract]

    class Half(PodBase):
        def _step_devices(self, step, xs, ys, trace):
            return []

    with pytest.raises(TypeError, match="abstract"):
        Half(plan)  # type: ignore[abstract]
    log = io.StringIO()
    run = Run(plan, output_dir=tmp_path, backend="timing", keep_history=True,
              console=Console(file=log, width=120))
    summary = run.run()
    steps = [TimingPod(plan).step(s) for s in range(plan.steps)]
    assert [s.step_seconds for s in run.history] == [s.step_seconds for s in steps]
    assert summary["replicas_identical"] is None and summary["test_accuracy"] is None
    assert "not checked (timing-only)" in log.getvalue()
    with_checkpoints = pod.load(scenario_data("v4"), overrides=["checkpoint.every_steps=1"])
    with pytest.raises(pod.ScenarioError, match="^checkpoint: a timing-only run holds no"):
        Run(pod.validate(with_checkpoints), output_dir=tmp_path / "c", backend="timing")

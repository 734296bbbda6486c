"""The Python API in a notebook (issue 25, item 6): the model summary as text when rich
thinks it draws into a cell, plots that leave the kernel's backend alone and show once,
one updating progress line instead of a line per step. No Ray: ``in_process`` runs.
(The README's examples in a real kernel: ``test_readme_notebook.py``.)"""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

import pod
from pod.commands.train import Run
from pod.report.stats import StepStats

ROOT = Path(__file__).resolve().parents[2]
SMALL = {"name": "nb-test", "pod": {"slice": "v2-8"},
         "model": {"name": "mlp", "options": {"hidden": [16]}},
         "data": {"name": "digits"}, "training": {"global_batch": 64, "steps": 6},
         "metrics": {"port": 0}}


@pytest.fixture
def jupyter(monkeypatch):
    """rich believes it runs in a Jupyter kernel; what it and the run display is
    recorded instead of drawn: (kind, data) for each display and each update."""
    import IPython.display
    import rich.console

    shown: list[tuple[str, object]] = []

    class Handle:
        def update(self, obj, **_kw):
            shown.append(("update", obj))

    def display(*objs, display_id=None, **_kw):
        shown.extend(("display", obj) for obj in objs)
        return Handle() if display_id else None

    monkeypatch.setattr(rich.console, "_is_jupyter", lambda: True)
    monkeypatch.setattr(IPython.display, "display", display)
    return shown


def test_describe_gives_the_model_summary_as_text_in_a_notebook(jupyter):
    text = pod.describe(ROOT / "scenarios/quickstart.yaml").model_summary
    assert "Model: cnn" in text and "total" in text
    assert not any(kind == "display" for kind, _ in jupyter)  # nothing drawn into the cell


def _history(n: int = 4) -> tuple[StepStats, ...]:
    return tuple(StepStats(step=i, loss=2.0 - 0.1 * i, global_batch=64, infeed_seconds=1e-6,
                           compute_seconds=5e-5, collective_seconds=1e-5, update_seconds=7e-6,
                           model_flops=10**9, peak_flops_per_s=1e15, wall_seconds=0.01)
                 for i in range(n))


def test_plot_draws_without_pyplot_and_keeps_the_backend(tmp_path):
    """``result.plot("run.png")`` once switched the process to Agg (a notebook then showed
    no figure) and drew through pyplot (a fresh kernel showed it twice)."""
    code = f"""
import sys, matplotlib
from pod.api import RunResult
from tests.pod.test_notebook_api import _history
before = matplotlib.get_backend()
fig = RunResult(summary={{}}, history=_history()).plot({str(tmp_path / 'run.png')!r})
print(before, matplotlib.get_backend(), 'matplotlib.pyplot' in sys.modules,
      type(fig).__name__, len(fig.axes))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, env={"MPLBACKEND": "svg", "PATH": "/usr/bin:/bin",
                                        "HOME": str(tmp_path)}, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["svg", "svg", "False", "Figure", "2"]
    assert (tmp_path / "run.png").read_bytes()[:4] == b"\x89PNG"


def test_a_notebook_run_shows_one_updating_progress_line(jupyter):
    result = pod.run(SMALL, in_process=True)
    lines = [obj for kind, obj in jupyter
             if isinstance(obj, dict) and str(obj.get("text/plain", "")).startswith("step ")]
    assert len(lines) >= 1
    first = next(i for i, (kind, obj) in enumerate(jupyter) if obj is lines[0])
    assert jupyter[first][0] == "display"  # one display, then updates of it
    assert all(kind == "update" for kind, obj in jupyter[first + 1:] if obj in lines)
    assert lines[-1]["text/plain"].startswith("step 6/6")
    assert len(result.history) == 6


@pytest.mark.slow  # several seconds: the slow tier (make test stays under 3 minutes)
def test_asked_for_off_a_terminal_the_progress_line_is_rewritten_in_place():
    buffer = io.StringIO()
    plan = pod.build_plan(pod.load(SMALL))
    Run(plan, output_dir=None, metrics_port=0, console=Console(file=buffer, width=160),
        progress="line").run()
    text = buffer.getvalue()
    steps = text[text.index("\rstep "):text.index("\n", text.index("\rstep "))]
    assert steps.count("\r") >= 1 and "step 6/6" in steps.split("\r")[-1]
    assert text.count("step 6/6") == 1  # one line, not one per step


def test_status_line_throttles_and_always_shows_the_last_text():
    from pod.report.console import StatusLine

    buffer = io.StringIO()
    status = StatusLine(Console(file=buffer), updates_per_second=1e-9)  # one draw, then none
    for i in range(100):
        status.update(f"step {i}")
    status.close()
    assert buffer.getvalue() == "\rstep 0\rstep 99\n"


def test_a_bad_progress_mode_is_one_line():
    with pytest.raises(pod.ScenarioError, match="progress: 'bar' is not a progress mode"):
        pod.run(SMALL, in_process=True, progress="bar")


def test_tpu_pod_run_progress_line_rewrites_one_line(tmp_path):
    from click.testing import CliRunner

    from pod.cli import cli

    path = tmp_path / "s.yaml"
    path.write_text("name: cli-line\npod: {slice: v2-8}\nmodel: {name: mlp, options: "
                    "{hidden: [16]}}\ntraining: {global_batch: 64, steps: 4}\n"
                    "metrics: {port: 0}\n")
    out = CliRunner().invoke(cli, ["run", str(path), "--in-process", "--progress", "line",
                                   "--output-dir", str(tmp_path / "out")])
    assert out.exit_code == 0, out.output[-2000:]
    line = next(row for row in out.output.split("\n") if row.startswith("\rstep "))
    assert line.split("\r")[-1].startswith("step 4/4") and out.output.count("step 4/4") == 1

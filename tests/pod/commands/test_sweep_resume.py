"""Probe 2 of issue 26: a sweep stopped by SIGTERM or Ctrl-C kept none of its finished
points (33 of 42 done, no results.csv) and a rerun redid every one. Now each row is
on disk as its point finishes, a stopped sweep exits 143 / 130 keeping them, and a
rerun runs only the points not done. Timing mode: no Ray."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import textwrap

import pytest

from pod.commands import sweep as sweep_module
from pod.commands.sweep import is_missing, run_sweep
from pod.commands.sweep_journal import JOURNAL_NAME
from pod.config.scenario import parse_scenario
from pod.errors import DirectoryInUseError, RunInterrupted
from pod.safe_io import lock_directories

SWEEP = {
    "name": "resume-test",
    "pod": {"chip": "v4", "chips": 1},
    "model": {"name": "mlp", "options": {"hidden": [16], "dropout": False}},
    "data": {"name": "digits"},
    "training": {"global_batch": 64, "steps": 2},
    "metrics": {"port": 0},
    "sweep": {"scaling": "weak", "per_core_batch": 8, "chips": [1, 2, 4, 8],
              "allreduce": ["ring", "torus"], "steps": 2},
}
_TIMING = ("wall_seconds", "wall_seconds_per_step")


def _counting(monkeypatch, stop_at: int | None = None, signum: int = 15) -> list[int]:
    """Count the points really run; raise RunInterrupted when point ``stop_at`` starts."""
    ran: list[int] = []
    original = sweep_module._run_point

    def run_point(point, *args):
        if point.index == stop_at:
            raise RunInterrupted(signum)
        ran.append(point.index)
        return original(point, *args)

    monkeypatch.setattr(sweep_module, "_run_point", run_point)
    return ran


def _csv(path):
    with path.open() as f:
        return list(csv.DictReader(f))


def _same(a, b):
    """Rows equal but for wall time; a figure that does not apply (NaN) equals NaN."""
    def kept(row):
        return {k: None if is_missing(v) else v for k, v in row.items() if k not in _TIMING}
    return kept(a) == kept(b)


def test_a_stopped_sweep_keeps_its_finished_points_and_a_rerun_does_only_the_rest(
        tmp_path, monkeypatch):
    scenario = parse_scenario(SWEEP)
    ran = _counting(monkeypatch, stop_at=5)
    with pytest.raises(RunInterrupted) as err:
        run_sweep(scenario, tmp_path / "out")
    assert err.value.exit_code == 143
    assert "5 of 8 points kept in" in str(err.value) and "results.csv" in str(err.value)
    assert ran == [0, 1, 2, 3, 4]
    assert [r["point"] for r in _csv(tmp_path / "out" / "results.csv")] == ["1", "2", "3", "4", "5"]
    monkeypatch.undo()

    ran = _counting(monkeypatch)
    told = []
    rows = run_sweep(scenario, tmp_path / "out", on_resume=lambda n, path: told.append(n))
    assert told == [5] and ran == [5, 6, 7]
    monkeypatch.undo()
    whole = run_sweep(scenario, tmp_path / "whole")
    assert len(rows) == 8 and all(_same(a, b) for a, b in zip(rows, whole))
    assert len(_csv(tmp_path / "out" / "results.csv")) == 8


@pytest.mark.slow  # several seconds: the slow tier (make test stays under 3 minutes)
def test_another_scenario_or_fresh_runs_every_point(tmp_path, monkeypatch):
    run_sweep(parse_scenario(SWEEP), tmp_path)
    ran = _counting(monkeypatch)
    run_sweep(parse_scenario({**SWEEP, "training": {"global_batch": 64, "steps": 2,
                                                    "seed": 7}}), tmp_path)
    assert ran == list(range(8))
    ran.clear()
    run_sweep(parse_scenario({**SWEEP, "training": {"global_batch": 64, "steps": 2,
                                                    "seed": 7}}), tmp_path, fresh=True)
    assert ran == list(range(8))
    ran.clear()
    run_sweep(parse_scenario({**SWEEP, "training": {"global_batch": 64, "steps": 2,
                                                    "seed": 7}}), tmp_path, mode="timing")
    assert ran == []


@pytest.mark.slow  # several seconds: the slow tier (make test stays under 3 minutes)
def test_a_journal_line_cut_short_by_a_crash_runs_that_point_again(tmp_path, monkeypatch):
    run_sweep(parse_scenario(SWEEP), tmp_path)
    journal = tmp_path / JOURNAL_NAME
    lines = journal.read_text().splitlines(keepends=True)
    assert len(lines) == 9 and json.loads(lines[0])["format"].startswith("tpu-pod-sweep")
    journal.write_text("".join(lines[:-1]) + lines[-1][:40])  # kill -9 mid-append
    ran = _counting(monkeypatch)
    run_sweep(parse_scenario(SWEEP), tmp_path)
    assert ran == [7]


def test_a_sweep_into_a_held_directory_is_refused(tmp_path):
    with lock_directories(tmp_path, command="tpu-pod run other.yaml"):
        with pytest.raises(DirectoryInUseError, match="'tpu-pod run other.yaml'"):
            run_sweep(parse_scenario(SWEEP), tmp_path)


@pytest.mark.parametrize("signum, code", [(15, 143), (2, 130)])
def test_sigterm_or_ctrl_c_during_a_sweep_exits_143_or_130_with_the_rows_on_disk(
        tmp_path, signum, code):
    """A real signal to a real `tpu-pod sweep` (sent by the process itself when its
    fourth point starts, so the test does not depend on timing)."""
    path = tmp_path / "s.yaml"
    path.write_text(json.dumps(SWEEP))
    script = textwrap.dedent(f"""
        import os, time
        from pod.commands import sweep
        original = sweep._run_point
        def run_point(point, *args):
            if point.index == 3:
                os.kill(os.getpid(), {signum})
                time.sleep(60)
            return original(point, *args)
        sweep._run_point = run_point
        from pod.cli import main
        main(["sweep", {str(path)!r}, "--output-dir", {str(tmp_path / 'out')!r}])
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == code, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("interrupted by SIG") and "3 of 8 points kept" in last
    assert "Traceback" not in proc.stderr
    assert len(_csv(tmp_path / "out" / "results.csv")) == 3

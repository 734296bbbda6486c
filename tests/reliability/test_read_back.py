"""Issue 34, item 1: the files the tool wrote and reads back (steps.csv, the sweep
journal, checkpoints) read defensively, each damaged row named in one line, the damaged
tail dropped and rewritten from the checkpoint; and a failed command changes no earlier
result. The fast tier checks the readers; the slow tier the CLI end to end."""

from __future__ import annotations

import csv
import errno
import json
import os
import socket
import tracemalloc

import pytest

from pod.report import files
from pod.report.files import StepsCsv
from pod.safe_io import read_regular
from tests.reliability.harness import bounded_cli, one_line_error, snapshot, succeeded


def _rows(n: int) -> list[dict]:
    return [{"step": i, "loss": 1.0 / i, "synthetic_data": False} for i in range(1, n + 1)]


def _written(path, n: int) -> None:
    with StepsCsv(path) as steps:
        for row in _rows(n):
            steps.write(row)


def _line(index: int, edit):
    """An edit of one line of steps.csv (0: the header)."""
    def apply(text: str) -> str:
        lines = text.split("\r\n")
        lines[index] = edit(lines[index])
        return "\r\n".join(lines)
    return apply


DAMAGE = {  # how a steps.csv is damaged -> (the edit, the line named, the steps kept)
    "header": (_line(0, lambda line: line.replace("step,", "stp,", 1)), 1, 0),
    "short row": (_line(3, lambda line: line.split(",")[0]), 4, 2),
    "binary": (_line(4, lambda line: "\udcff\udcfe" + line), 5, 3),
    "NUL tail": (lambda text: text + "\x00" * 300, 8, 6),
    "half a row": (lambda text: text + "7,0.14", 8, 6),
}


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_damaged_steps_csv_is_named_in_one_line_and_its_tail_dropped(tmp_path, kind):
    """``--resume`` tracebacks of the audit: KeyError 'step' (a damaged header),
    ValueError (a short row, a NUL-filled tail), UnicodeDecodeError (binary)."""
    path = tmp_path / "steps.csv"
    _written(path, 6)
    edit, line, kept = DAMAGE[kind]
    path.write_bytes(edit(path.read_bytes().decode()).encode("utf-8", errors="surrogateescape"))
    warnings: list[str] = []
    with StepsCsv(path, keep_below=6, warn=warnings.append) as steps:
        steps.write({"step": kept + 1, "loss": 0.5, "synthetic_data": False})
    assert len(warnings) == 1 and warnings[0].startswith(f"warning: steps.csv line {line}: ")
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, kept + 2))
    assert path.read_bytes().endswith(b"\r\n")


def test_a_full_disk_mid_row_leaves_whole_rows(tmp_path, monkeypatch):
    """steps.csv ended in half a row (cut at 4,096 bytes) after the disk filled."""
    path = tmp_path / "steps.csv"
    _written(path, 3)
    real_write = os.write

    def half_then_full(fd, data):
        if len(data) > 10:
            real_write(fd, data[:10])
            return 10
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with StepsCsv(path, keep_below=3) as steps:
        monkeypatch.setattr(files.os, "write", half_then_full)
        with pytest.raises(files.OutputError, match="No space left on device"):
            steps.write({"step": 4, "loss": 0.25, "synthetic_data": False})
        monkeypatch.undo()
    assert path.read_bytes().endswith(b"3,0.3333333333333333,False\r\n")


def test_the_reader_allocates_the_file_not_its_limit(tmp_path):
    """The safe reader allocated its whole limit (f.read(limit + 1)): a 1 MB checkpoint
    under a 4 GiB address-space limit was a MemoryError."""
    path = tmp_path / "small"
    path.write_bytes(b"x" * 100_000)
    tracemalloc.start()
    assert read_regular(path, 4 << 30) == b"x" * 100_000
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1 << 20


def test_a_damaged_journal_row_is_named_and_its_point_runs_again(tmp_path):
    """A sweep resumed over a journal whose row has no status was a KeyError."""
    from pod.commands.sweep import COLUMNS, TEXT_COLUMNS, empty_row
    from pod.commands.sweep_journal import SweepJournal

    class Scenario:  # what the journal digests of a scenario
        @staticmethod
        def model_dump(mode: str) -> dict:
            return {"name": "probe"}

    scenario = Scenario()
    journal = SweepJournal(tmp_path, scenario, "timing", COLUMNS, text_columns=TEXT_COLUMNS)
    row = {**empty_row(), "status": "ok", "point": 1}
    for i in range(4):
        journal.record({"i": i}, {**row, "point": i + 1})
    lines = journal.path.read_text().splitlines()
    entry = json.loads(lines[2])
    del entry["row"]["status"]
    lines[2] = json.dumps(entry)
    lines[3] = lines[3].replace('"point": 3', '"point": "three"')
    journal.path.write_text("\n".join(lines) + "\n" + lines[4][:30])
    again = SweepJournal(tmp_path, scenario, "timing", COLUMNS, text_columns=TEXT_COLUMNS)
    assert again.damage == [
        "sweep-journal.jsonl line 3: the row has no 'status'; that point runs again",
        "sweep-journal.jsonl line 4: point is 'three', not a number; that point runs again",
        "sweep-journal.jsonl line 6: not a whole JSON line (cut short by a crash?); that point "
        "runs again"]
    assert again.done({"i": 0}) is not None and again.done({"i": 1}) is None


# -- the CLI end to end (slow: a run of the tiny transformer in this process's devices) --

def _copy(run, tmp_path):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(run, out, symlinks=True)
    return out


def _resume(corpus, out, *extra):
    return bounded_cli(["run", str(corpus / "tiny.yaml"), "--in-process", "--resume",
                        str(out / "checkpoints"), "--output-dir", str(out), "--log-every",
                        "0", *extra], out)


@pytest.mark.slow
@pytest.mark.parametrize("kind", DAMAGE)
def test_resume_over_a_damaged_steps_csv_names_it_and_rewrites_the_tail(corpus, finished_run,
                                                                        tmp_path, kind):
    out = _copy(finished_run, tmp_path)
    edit, _, _ = DAMAGE[kind]
    steps = out / "steps.csv"
    steps.write_bytes(edit(steps.read_bytes().decode()).encode("utf-8", errors="surrogateescape"))
    result = _resume(corpus, out, "--steps", "6")
    succeeded(result)
    assert "warning: steps.csv line " in result.out
    with steps.open(newline="") as f:
        numbers = [int(r["step"]) for r in csv.DictReader(f)]
    assert numbers[-2:] == [5, 6] and numbers == sorted(set(numbers))


@pytest.mark.slow
def test_a_failed_resume_leaves_the_finished_runs_files_as_they_were(corpus, finished_run,
                                                                     tmp_path):
    """A failed --resume rewrote a completed summary.json to completed: false."""
    out = _copy(finished_run, tmp_path)
    before = snapshot(out)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        result = _resume(corpus, out, "--steps", "6", "--metrics-port",
                         str(taken.getsockname()[1]))
    one_line_error(result, "metrics.port", "already in use")
    assert snapshot(out) == before


@pytest.mark.slow
def test_a_sweep_resumed_over_a_damaged_journal_reruns_that_point(corpus, tmp_path):
    out = tmp_path / "sweep"
    succeeded(bounded_cli(["sweep", str(corpus / "sweep.yaml"), "--output-dir", str(out)],
                          tmp_path))
    journal = out / "sweep-journal.jsonl"
    lines = journal.read_text().splitlines()
    entry = json.loads(lines[2])
    del entry["row"]["status"]
    journal.write_text("\n".join([*lines[:2], json.dumps(entry), *lines[3:]]) + "\n")
    again = bounded_cli(["sweep", str(corpus / "sweep.yaml"), "--output-dir", str(out)],
                        tmp_path)
    succeeded(again)
    assert "sweep-journal.jsonl line 3: the row has no 'status'; that point runs again" in \
        again.out
    with (out / "results.csv").open() as f:
        assert [r["status"] for r in csv.DictReader(f)] == ["ok"] * 3


@pytest.mark.slow
def test_a_plan_that_fails_leaves_an_earlier_plans_files_as_they_were(corpus, tmp_path):
    out = tmp_path / "plan"
    tiny = str(corpus / "tiny.yaml")
    succeeded(bounded_cli(["plan", tiny, "--slice", "v5e-8", "--remat", "none",
                           "--per-device-batch", "1", "--mesh-axes", "data", "--output-dir",
                           str(out)], tmp_path))
    before = snapshot(out)
    assert {p.name for p in out.iterdir()} >= {"results.csv", "layouts.png", "best.yaml"}
    one_line_error(bounded_cli(["plan", tiny, "--slice", "v5e-8", "--remat", "none",
                                "--per-device-batch", "1", "--mesh-axes", "tensor",
                                "--output-dir", str(out)], tmp_path), "no layout of")
    assert snapshot(out) == before

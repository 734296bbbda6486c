"""Results and checkpoints written safely: atomic rewrites of steps.csv and
summary.json, directories checked before the first step, and a file system
that refuses (ENOSPC, EROFS, EACCES) reported as one line naming the path. No Ray."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from pod.errors import OutputError, USER_ERRORS
from pod.report import files
from pod.report.files import StepsCsv, check_writable, write_json
from pod.state.checkpoint import Checkpoint, save_checkpoint


def refuse(code: int):
    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code))
    return fail


def rows(n):
    """steps.csv rows of steps 1..n (numbered from 1, as a run writes them)."""
    return [{"step": i, "loss": 1.0 / i} for i in range(1, n + 1)]


def test_truncating_steps_csv_is_atomic_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    path = tmp_path / "steps.csv"
    with StepsCsv(path) as csv_file:
        for row in rows(5):
            csv_file.write(row)
    before = path.read_text()
    monkeypatch.setattr(files.os, "fsync", refuse(errno.ENOSPC))
    with pytest.raises(OutputError, match=r"steps\.csv: cannot write \(No space left on device\)"):
        with StepsCsv(path, keep_below=3) as resumed:  # cut back at its first row
            resumed.write({"step": 4, "loss": 0.5})
    assert path.read_text() == before                       # the old rows, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["steps.csv"]
    monkeypatch.undo()
    with StepsCsv(path, keep_below=3) as csv_file:   # 3 steps done: rows 1..3 kept
        csv_file.write({"step": 4, "loss": 0.5})
    assert [line.split(",")[0] for line in path.read_text().splitlines()] == ["step", "1", "2", "3", "4"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["steps.csv"]


def test_summary_json_on_a_full_disk_is_one_line(tmp_path, monkeypatch):
    write_json(tmp_path / "summary.json", {"steps": 1})
    monkeypatch.setattr(files.os, "fsync", refuse(errno.ENOSPC))
    with pytest.raises(OutputError) as err:
        write_json(tmp_path / "summary.json", {"steps": 2})
    assert str(err.value) == f"{tmp_path / 'summary.json'}: cannot write (No space left on device)"
    assert isinstance(err.value, USER_ERRORS) and err.value.path == str(tmp_path / "summary.json")
    monkeypatch.undo()
    assert '"steps": 1' in (tmp_path / "summary.json").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_result_files_keep_the_usual_mode(tmp_path):
    write_json(tmp_path / "summary.json", {})
    umask = os.umask(0o022)
    os.umask(umask)
    assert (tmp_path / "summary.json").stat().st_mode & 0o777 == 0o666 & ~umask


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EACCES])
def test_check_writable_names_the_directory(tmp_path, monkeypatch, code):
    monkeypatch.setattr(files.os, "write", refuse(code))
    with pytest.raises(OutputError, match=rf"^{tmp_path / 'out'}: cannot write \({os.strerror(code)}\)$"):
        check_writable(tmp_path / "out", None)
    monkeypatch.undo()
    check_writable(tmp_path / "out", tmp_path / "ck")
    assert (tmp_path / "ck").is_dir() and not any((tmp_path / "out").iterdir())


def test_check_writable_under_a_file_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match="file/out: cannot write"):
        check_writable(tmp_path / "file" / "out")


def test_a_checkpoint_on_a_read_only_file_system_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "fsync", refuse(errno.EROFS))
    ck = Checkpoint(step=1, scenario={}, params={"w": np.zeros(2, np.float32)})
    with pytest.raises(OutputError, match=r"ckpt\.msgpack: cannot write \(Read-only file system\)"):
        save_checkpoint(tmp_path / "ckpt.msgpack", ck)
    assert list(tmp_path.iterdir()) == []


def _refuse_mkdir(code: int):
    def fail(path, *args, **kwargs):
        raise OSError(code, os.strerror(code), os.fspath(path))
    return fail


def test_a_run_whose_output_or_trace_directory_cannot_be_created_is_one_line(tmp_path,
                                                                           monkeypatch):
    """A missing output directory on a read-only file system was a mkdir traceback;
    a trace's directory was found unwritable only after the last step."""
    from pod.commands.train import Run
    from pod.config.plan import build_plan
    from pod.config.scenario import parse_scenario

    plan = build_plan(parse_scenario({"name": "w", "pod": {"slice": "v2-8"},
                                      "model": {"name": "mlp"},
                                      "training": {"global_batch": 64, "steps": 1},
                                      "metrics": {"port": 0}}))
    monkeypatch.setattr(os, "mkdir", _refuse_mkdir(errno.EROFS))
    with pytest.raises(OutputError, match=rf"^{tmp_path / 'out'}: cannot write \(Read-only file "
                                          r"system\)$"):
        Run(plan, output_dir=tmp_path / "out")
    monkeypatch.undo()
    monkeypatch.setattr(files.os, "write", refuse(errno.EROFS))
    (tmp_path / "traces").mkdir()
    with pytest.raises(OutputError, match=rf"^{tmp_path / 'traces'}: cannot write"):
        Run(plan, output_dir=None, trace_path=tmp_path / "traces" / "t.json")


def test_a_trace_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    from pod.report.trace import write_trace

    monkeypatch.setattr(files.os, "fsync", refuse(errno.ENOSPC))
    with pytest.raises(OutputError, match=r"t\.json: cannot write \(No space left on device\)"):
        write_trace(tmp_path / "t.json", [{"ph": "M"}], {"clock": "simulated microseconds"})
    assert list(tmp_path.iterdir()) == []

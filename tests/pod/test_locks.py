"""Probe 1 of issue 26: two runs into one output directory both exited 0, summary.json
from one, steps.csv and the newest checkpoint from the other. A run (and a sweep)
now holds an exclusive lock on its output and checkpoint directories; a second one
is refused with one line naming the holder; a dead holder's lock is taken over.
No Ray: the lock is taken before any actor."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from pod.errors import USER_ERRORS, DirectoryInUseError
from pod.safe_io import LOCK_NAME, DirectoryLock, lock_directories

_HOLD = textwrap.dedent("""
    import sys
    from pod.safe_io import lock_directories
    locks = lock_directories(sys.argv[1], command="tpu-pod run first.yaml")
    print("held", flush=True)
    sys.stdin.read()
""")


def _holder(directory):
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(directory)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_lock_is_refused_with_the_holders_pid_command_and_start(tmp_path):
    proc = _holder(tmp_path / "out")
    try:
        with pytest.raises(DirectoryInUseError) as err:
            lock_directories(tmp_path / "out", command="tpu-pod run second.yaml")
        text = str(err.value)
        assert isinstance(err.value, USER_ERRORS) and "\n" not in text
        assert text.startswith(f"{tmp_path / 'out'}: in use by another tpu-pod command (pid "
                               f"{proc.pid} on ")
        assert "'tpu-pod run first.yaml', since 20" in text and "--output-dir" in text
    finally:
        proc.kill()
        proc.wait()


def test_a_dead_holders_lock_is_taken_over(tmp_path):
    proc = _holder(tmp_path / "out")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert str(proc.pid) in (tmp_path / "out" / LOCK_NAME).read_text()  # its note is left
    with lock_directories(tmp_path / "out", command="tpu-pod run second.yaml"):
        note = (tmp_path / "out" / LOCK_NAME).read_text()
        assert f'"pid": {os.getpid()}' in note and "second.yaml" in note
    assert (tmp_path / "out" / LOCK_NAME).read_text() == ""  # released: no holder


def test_a_refusal_releases_the_locks_already_taken(tmp_path):
    held = DirectoryLock(tmp_path / "ck", "tpu-pod run a.yaml").acquire()
    with pytest.raises(DirectoryInUseError):
        lock_directories(tmp_path / "out", tmp_path / "ck")
    lock_directories(tmp_path / "out").release()  # not left held by the refused call
    held.release()


def test_a_link_planted_as_the_lock_file_is_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("data")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / LOCK_NAME).symlink_to(victim)
    with pytest.raises(Exception, match="cannot write"):
        lock_directories(tmp_path / "out")
    assert victim.read_text() == "data"


def _plan(checkpoint_dir=None):
    from pod.config.plan import build_plan
    from pod.config.scenario import parse_scenario

    spec = {"name": "lock", "pod": {"slice": "v2-8"}, "model": {"name": "mlp"},
            "training": {"global_batch": 64, "steps": 2}, "metrics": {"port": 0}}
    if checkpoint_dir is not None:
        spec["checkpoint"] = {"every_steps": 1, "dir": str(checkpoint_dir)}
    return build_plan(parse_scenario(spec))


def test_two_runs_into_one_output_directory_the_second_is_refused(tmp_path):
    from pod.commands.train import Run

    first = Run(_plan(), output_dir=tmp_path / "out")
    with pytest.raises(DirectoryInUseError, match=rf"^{tmp_path / 'out'}: in use by another"):
        Run(_plan(), output_dir=tmp_path / "out")
    first.locks.release()
    Run(_plan(), output_dir=tmp_path / "out").locks.release()  # free again


def test_two_runs_sharing_a_checkpoint_directory_the_second_is_refused(tmp_path):
    from pod.commands.train import Run

    first = Run(_plan(tmp_path / "ck"), output_dir=tmp_path / "a")
    with pytest.raises(DirectoryInUseError, match=rf"^{tmp_path / 'ck'}: in use by another"):
        Run(_plan(tmp_path / "ck"), output_dir=tmp_path / "b")
    first.locks.release()


def test_the_cli_refuses_a_run_into_a_held_directory_in_one_line(tmp_path):
    scenario = tmp_path / "s.yaml"
    scenario.write_text("name: lock\npod: {slice: v2-8}\nmodel: {name: mlp}\n"
                        "training: {global_batch: 64, steps: 2}\nmetrics: {port: 0}\n")
    proc = _holder(tmp_path / "out")
    try:
        run = subprocess.run([sys.executable, "-m", "pod", "run", str(scenario), "--output-dir",
                              str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    finally:
        proc.kill()
        proc.wait()
    assert run.returncode == 2, run.stderr
    assert run.stderr.count("\n") == 1 and "Traceback" not in run.stderr
    assert f"in use by another tpu-pod command (pid {proc.pid}" in run.stderr
    assert not (tmp_path / "out" / "summary.json").exists()

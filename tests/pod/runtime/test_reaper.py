"""The reaper of a local cluster (pod/runtime/reaper.py), on stand-in processes: no Ray."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from pod.runtime.reaper import reap

REAPER = Path(__file__).resolve().parents[3] / "pod" / "runtime" / "reaper.py"


def _sleeper(**kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], **kwargs)


def _gone(proc: subprocess.Popen, seconds: float = 10.0) -> bool:
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return False
    return True


def test_without_done_the_groups_the_marked_processes_and_the_directory_go(tmp_path):
    leader = _sleeper(process_group=0)                              # a daemon, leads its group
    member = _sleeper(process_group=leader.pid)                     # an agent in its group
    marker = f"TPU_POD_REAPER_TEST={tmp_path}"
    worker = _sleeper(start_new_session=True, env={**os.environ, "TPU_POD_REAPER_TEST": str(tmp_path)})
    bystander = _sleeper(start_new_session=True)                    # not the cluster's
    (tmp_path / "session" / "logs").mkdir(parents=True)
    try:
        assert reap([f"group {leader.pid}\n", f"env {marker}\n", f"dir {tmp_path / 'session'}\n"])
        assert all(_gone(p) for p in (leader, member, worker))
        assert not (tmp_path / "session").exists()
        assert bystander.poll() is None
    finally:
        for p in (leader, member, worker, bystander):
            p.kill()
            p.wait()


def test_done_leaves_everything_alone(tmp_path):
    leader = _sleeper(start_new_session=True)
    (tmp_path / "session").mkdir()
    try:
        assert not reap([f"group {leader.pid}\n", f"dir {tmp_path / 'session'}\n", "done\n"])
        assert leader.poll() is None and (tmp_path / "session").exists()
    finally:
        leader.kill()
        leader.wait()


def test_the_reaper_acts_when_its_writer_dies(tmp_path):
    """As the cluster runs it: a process of the standard library only, its stdin a pipe
    from the driver; the driver's death (the pipe's end) is the signal."""
    leader = _sleeper(start_new_session=True)
    (tmp_path / "session").mkdir()
    reaper = subprocess.Popen([sys.executable, "-I", "-S", str(REAPER)], stdin=subprocess.PIPE,
                              text=True, start_new_session=True)
    try:
        reaper.stdin.write(f"group {leader.pid}\ndir {tmp_path / 'session'}\n")
        reaper.stdin.flush()
        time.sleep(0.2)
        assert leader.poll() is None                                # the driver still runs
        reaper.stdin.close()                                        # it died
        assert _gone(reaper) and _gone(leader) and not (tmp_path / "session").exists()
    finally:
        for p in (leader, reaper):
            p.kill()
            p.wait()

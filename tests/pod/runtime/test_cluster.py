"""The local Ray cluster the emulator starts: token authentication with a token of
its own, its own session directory, its daemons outside the driver's process group;
joining an address where nothing answers fails within seconds."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pod.runtime.cluster import CONNECT_TIMEOUT_S, _remove_stale_dirs, cluster_temp_dir

ROOT = Path(__file__).resolve().parents[3]
SCENARIO = ("name: {name}\npod: {{slice: v2-8}}\nmodel: {{name: mlp, options: {{hidden: [16]}}}}\n"
            "training: {{global_batch: 64, steps: {steps}, optimizer: {{name: adam}}}}\n"
            "metrics: {{port: 0}}\n")


def _env(**changes: str | None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for key, value in changes.items():
        env.pop(key, None) if value is None else env.__setitem__(key, value)
    return env


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("address", ["127.0.0.1:{port}", "ray://127.0.0.1:{port}"])
def test_joining_an_address_where_nothing_answers_fails_within_the_bound(tmp_path, address):
    address = address.format(port=_closed_port())
    path = tmp_path / "join.yaml"
    path.write_text(SCENARIO.format(name="join", steps=1))
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "pod", "run", str(path), "--output-dir",
                          str(tmp_path / "out")], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120, env=_env(RAY_ADDRESS=address))
    elapsed = time.monotonic() - t0
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-2000:]
    # the address came from the environment: the line names RAY_ADDRESS, not ray.address
    expected = f"error: RAY_ADDRESS: no Ray cluster answers at {address!r} ("
    assert lines[0].startswith(expected), lines
    seconds = float(lines[0].split("after ")[1].split(" s)")[0])
    assert seconds <= CONNECT_TIMEOUT_S + 1 <= 15 + 1
    assert elapsed < 90  # python start-up and imports on a busy machine, not Ray's minutes


@pytest.mark.slow
def test_a_process_without_the_token_cannot_join(ray_cluster):
    """Another local process (here with Ray's auth off, or Ray's default token) is refused."""
    code = (f"import ray; ray.init(address={ray_cluster!r}); "
            "print('JOINED', ray.get(ray.remote(lambda: 1).remote()))")
    for changes in ({"RAY_AUTH_MODE": "disabled", "RAY_AUTH_TOKEN_PATH": None},
                    {"RAY_AUTH_MODE": None, "RAY_AUTH_TOKEN_PATH": None}):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=180, env=_env(RAY_ADDRESS=None, **changes))
        assert out.returncode != 0 and "JOINED" not in out.stdout, out.stdout[-500:]


@pytest.mark.slow
def test_the_local_cluster_has_its_own_directory_and_process_group(ray_cluster):
    import ray

    assert os.environ["RAY_AUTH_MODE"] == "token"
    token = Path(os.environ["RAY_AUTH_TOKEN_PATH"])
    assert token.parent == cluster_temp_dir() and (token.stat().st_mode & 0o077) == 0
    session = Path(ray._private.worker.global_worker.node.get_session_dir_path())
    assert session.parent == cluster_temp_dir()
    daemons = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            ppid, pgrp = stat[stat.rindex(")") + 2:].split()[1:3]
            if int(ppid) == os.getpid() and name in ("gcs_server", "raylet"):
                daemons[name] = int(pgrp)
    assert set(daemons) == {"gcs_server", "raylet"}, daemons
    assert os.getpgrp() not in daemons.values()


def test_stale_session_directories_of_the_emulator_are_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = cluster_temp_dir(dead.pid)
    stale.parent.mkdir(mode=0o700, exist_ok=True)
    (stale / "session_x").mkdir(parents=True)
    alive = cluster_temp_dir(os.getppid())
    alive.mkdir(exist_ok=True)
    try:
        _remove_stale_dirs()
        assert not stale.exists() and alive.exists()
    finally:
        if not any(alive.iterdir()):
            alive.rmdir()


@pytest.mark.slow
def test_sigterm_to_the_whole_process_group_still_ends_gracefully(tmp_path):
    """What ``timeout`` and service managers do: the run's own local cluster survives
    until the driver has written its final checkpoint and partial summary."""
    path = tmp_path / "group.yaml"
    path.write_text(SCENARIO.format(name="group", steps=5000)
                    + "checkpoint: {every_steps: 1000, dir: ck}\n")
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "pod", "run", str(path), "--output-dir",
                             str(out), "--log-every", "0"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=_env(RAY_ADDRESS=None))
    try:
        deadline = time.monotonic() + 300
        rows = out / "steps.csv"
        while time.monotonic() < deadline and (not rows.exists()
                                               or rows.read_text().count("\n") < 4):
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            time.sleep(0.2)
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
        stopped = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, stderr[-2000:]
    assert stopped < 45, stopped  # not Ray's 60 s hang
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] is False and summary["stopped_by"] == "signal SIGTERM"
    assert (tmp_path / "ck" / f"ckpt-{summary['steps']:08d}.msgpack").exists()
    assert not cluster_temp_dir(proc.pid).exists()


def _children_groups(pid: int) -> set[int]:
    """The process groups of ``pid``'s children (Ray's daemons lead one each)."""
    groups = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid, pgrp = stat[stat.rindex(")") + 2:].split()[1:3]
            if int(ppid) == pid:
                groups.add(int(pgrp))
    return groups


def _cluster_processes(driver: int) -> set[int]:
    """Every process of the local cluster ``driver`` started: the members of its
    daemons' groups (the raylet's agents included) and the processes whose environment
    holds the cluster's token path (its workers)."""
    marker = f"RAY_AUTH_TOKEN_PATH={cluster_temp_dir(driver) / 'auth_token'}".encode()
    groups = _children_groups(driver)
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == driver:
            continue
        try:
            stat = (entry / "stat").read_text()
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2:].split()[2]) in groups or marker in environ.split(b"\0"):
            found.add(int(entry.name))
    return found


def _alive_of(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.add(pid)
    return alive


def _start_run(tmp_path: Path, name: str) -> tuple[subprocess.Popen, Path]:
    path = tmp_path / f"{name}.yaml"
    path.write_text(SCENARIO.format(name=name, steps=5000))
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "pod", "run", str(path), "--output-dir",
                             str(out), "--log-every", "0"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=_env(RAY_ADDRESS=None))
    return proc, out


@pytest.mark.slow
def test_a_sigkilled_driver_leaves_no_ray_process_and_no_session(tmp_path):
    """``kill -9`` of a run: Ray's GCS and raylet die with it (Ray's fate-sharing), the
    raylet's agents used to linger about 60 s and the session directory for good; the
    run's reaper (pod/runtime/reaper.py) ends them all and removes the directory."""
    proc, out = _start_run(tmp_path, "killed")
    try:
        deadline = time.monotonic() + 300
        rows = out / "steps.csv"
        while time.monotonic() < deadline and (not rows.exists()
                                               or rows.read_text().count("\n") < 3):
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            time.sleep(0.2)
        cluster = _cluster_processes(proc.pid)
        names = {Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
                 for p in cluster if Path(f"/proc/{p}").exists()}
        assert any("ray::" in n for n in names) and len(cluster) >= 6, names
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
        deadline = time.monotonic() + 30  # Ray's agents alone took 60-70 s here
        while _alive_of(cluster) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _alive_of(cluster), _alive_of(cluster)
        while cluster_temp_dir(proc.pid).exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not cluster_temp_dir(proc.pid).exists()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.slow
def test_sigterm_while_ray_starts_ends_with_143_a_partial_summary_and_nothing_left(tmp_path):
    """A SIGTERM during ``ray.init`` (whose own handler exited with status 15, no line,
    no summary): the run's handler is kept, and the run stops at its first step
    boundary like any interrupted run, or as soon as Ray is up (``Pod.start``'s check)."""
    proc, out = _start_run(tmp_path, "early")
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not _children_groups(proc.pid):
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)  # Ray's first daemon is up: ray.init is running
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "step 1/" not in stdout  # stopped once Ray was up, before or after the actors
    assert proc.returncode == 143, (proc.returncode, stderr[-2000:])
    assert [line for line in stderr.splitlines() if line.strip()] == ["interrupted by SIGTERM"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] is False and summary["stopped_by"] == "signal SIGTERM"
    assert summary["steps"] == 0
    assert not cluster_temp_dir(proc.pid).exists()


def test_an_exception_inside_an_actor_reaches_the_user_as_its_type_and_message():
    """Not Ray's first line (``ray::ChipActor.compute() (pid=..., repr=...)``)."""
    import ray

    from pod.errors import ClusterError, ScenarioError
    from pod.runtime.pod import _chip_error

    inner = ValueError("embedding: token ids must be in [0, 100) (the vocabulary), got range "
                       "[236, 14860]\nsecond line")
    err = _chip_error(ray.exceptions.RayTaskError("ChipActor.compute", "Traceback ...", inner))
    assert isinstance(err, ClusterError)
    assert str(err) == ("a chip actor failed: ValueError: embedding: token ids must be in "
                        "[0, 100) (the vocabulary), got range [236, 14860]")
    user = ScenarioError("training.global_batch: ...")
    assert _chip_error(ray.exceptions.RayTaskError("ChipActor.compute", "", user)) is user

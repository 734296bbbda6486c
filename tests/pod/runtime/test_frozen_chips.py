"""A frozen chip and a signalled driver (issue 34, item 0), on Ray (slow tier).

A chip actor whose process is stopped (SIGSTOP: a frozen host, a paused VM) kept its
sockets open, so Ray counted it alive and its peers waited for its chunks: the run
waited past 400 s, and SIGTERM / SIGINT to the driver were ignored (the driver sat in
one blocking ``ray.get``). Now the driver's heartbeat declares the chip failed within
its timeout and the run recovers from the checkpoint as from a killed chip (the same
bits as a run without the fault), or ends with one line; and a signal stops the run
within about a second whatever the chips do, its partial summary written first.

The bounds asserted here are loose (tens of seconds, against hangs of minutes before):
the machine's load moves wall times by a factor of several."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from pod.config.plan import build_plan
from pod.runtime.heartbeat import HEARTBEAT_TIMEOUT_S
from tests.pod.runtime.test_faults import (  # noqa: F401 - ray_fault_free is a fixture
    CKPT,
    _descendants,
    _run_until,
    final_params,
    ray_fault_free,
    scenario,
)

pytestmark = pytest.mark.slow


def _stop(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)


def _release(pids) -> None:
    """Let go of the processes a test stopped, if Ray has not killed them yet."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _chip_pid(run, rank: int) -> int:
    import ray

    return ray.get(run.pod.actors[rank].__ray_call__.remote(lambda chip: os.getpid()))


def test_a_frozen_chip_is_declared_failed_and_recovered_bit_identical(
        ray_fault_free, tmp_path):  # noqa: F811 - the fixture imported above
    """Chip 2's process stopped after step 3: step 4 never ends on its own. The heartbeat
    declares chip 2 failed, every chip gets a new actor, the step-2 checkpoint is
    restored, and the run ends with the fault-free Ray run's bits."""
    import io

    from rich.console import Console

    from pod.commands.train import Run

    reference, ref_summary = ray_fault_free
    stopped: list[int] = []
    holder: dict = {}

    def on_step(stats) -> None:
        if stats.step == 2 and not stopped:  # step 3 done: freeze chip 2 before step 4
            stopped.append(_chip_pid(holder["run"], 2))
            _stop(stopped[0])

    log = io.StringIO()
    out = tmp_path / "frozen"
    run = holder["run"] = Run(build_plan(scenario(checkpoint=CKPT)), output_dir=out,
                              console=Console(file=log, width=300), on_step=on_step,
                              backend="ray")
    try:
        summary = run.run()
    finally:
        _release(stopped)
    text = log.getvalue()
    (event,) = summary["faults"]
    assert summary["completed"] is True and summary["replicas_identical"] is True
    assert event["unresponsive_chips"] == [2] and event["dead_chips"] == []
    assert event["recovered"] is True and event["step"] == 4 and event["restored_from_step"] == 2
    assert event["detection_wall_seconds"] >= HEARTBEAT_TIMEOUT_S  # the heartbeat's, not Ray's
    assert event["detection_wall_seconds"] < 120  # was: never
    assert (f"fault: a chip actor stopped answering (not injected): chip actor(s) 2 answered no "
            f"heartbeat for {HEARTBEAT_TIMEOUT_S:g} s") in text
    assert final_params(out) == final_params(reference)
    assert summary["final_loss"] == ref_summary["final_loss"]


def _long_run(tmp_path: Path, checkpoint: bool) -> tuple[Path, Path]:
    path = tmp_path / "long.yaml"
    path.write_text(
        "name: long\npod: {slice: v2-8}\nmodel: {name: mlp, options: {hidden: [32]}}\n"
        "training: {global_batch: 64, steps: 5000, optimizer: {name: adam}}\nmetrics: {port: 0}\n"
        + ("checkpoint: {every_steps: 3, keep: 2}\n" if checkpoint else ""))
    return path, tmp_path / "out"


def _freeze_a_chip(proc: subprocess.Popen) -> int:
    """SIGSTOP one chip actor's process of the run (a process of the run's own cluster
    whose title Ray set to the actor's class)."""

    def title(pid: int) -> str:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            return ""

    chips = sorted(pid for pid in _descendants(proc.pid) if title(pid).startswith("ray::ChipActor"))
    assert chips, {pid: title(pid) for pid in _descendants(proc.pid)}
    _stop(chips[0])
    return chips[0]


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}


def test_a_frozen_chip_without_checkpoints_ends_the_run_with_one_line(tmp_path):
    path, out = _long_run(tmp_path, checkpoint=False)
    proc = _run_until(path, out, 5, _env())
    stopped = [_freeze_a_chip(proc)]
    try:
        _, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
        _release(stopped)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, stderr[-3000:]
    assert lines[0].startswith("error: chip actor(s) ")
    assert " stopped answering at step " in lines[0]
    assert "the scenario has no checkpoint: block to restore from" in lines[0]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] is False and summary["steps"] >= 4
    assert summary["faults"][0]["recovered"] is False


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_a_run_whose_chip_is_frozen(tmp_path, signum):
    """The driver waits for a step that a stopped chip never ends: the signal still
    stops the run at once (its grace of a second), the partial summary written before
    the pod is shut down, the last periodic checkpoint left to resume from."""
    path, out = _long_run(tmp_path, checkpoint=True)
    proc = _run_until(path, out, 5, _env())
    stopped = [_freeze_a_chip(proc)]
    try:
        time.sleep(1.0)  # the driver is inside the step the stopped chip never ends
        t0 = time.monotonic()
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=300)
        took = time.monotonic() - t0
    finally:
        proc.kill()
        _release(stopped)
    name = signal.Signals(signum).name
    assert proc.returncode == 128 + signum, stderr[-3000:]
    assert [line for line in stderr.splitlines() if line.strip()] == [f"interrupted by {name}"]
    assert took < 30, took  # measured about 3 s (1 s of grace, 1.5 s to stop Ray); was: never
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] is False and summary["stopped_by"] == f"signal {name}"
    assert list((out / "checkpoints").glob("*.msgpack"))  # resumable

"""Injected faults: killed chips and hosts recovered bit-identically, stragglers, link faults,
no-checkpoint stops, and SIGTERM to the CLI.

In this process (``LocalPod`` emulates a chip kill: its next step fails as a dead
actor's does) for the run's recovery logic; on Ray (slow tier) a real actor kill,
a link cut mid-collective (the ICI transport), and the local Ray a run started
shut down after SIGTERM."""

from __future__ import annotations

import csv
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from pod.state.checkpoint import checkpoint_path, load_checkpoint
from pod.errors import ScenarioError
from pod.config.plan import build_plan
from tests.pod.state.test_checkpoint import run
from tests.pod.state.test_checkpoint import scenario as checkpoint_scenario

ROOT = Path(__file__).resolve().parents[3]
CKPT = {"every_steps": 2, "keep": 5}


def scenario(steps=6, checkpoint=None, faults=(), **options):
    """The checkpoint tests' scenario (v2-8: 4 chips of one TPU host, 2x2 torus)."""
    return checkpoint_scenario(steps, checkpoint, faults, name="fault-test", **options)


def final_params(out: Path, step: int = 6) -> dict[str, bytes]:
    ck = load_checkpoint(checkpoint_path(out / "checkpoints", step))
    return {k: v.tobytes() for k, v in {**ck.params, **ck.optimizer_state}.items()}


def test_fault_entries_are_checked_by_the_plan_before_any_actor():

    with pytest.raises(ScenarioError, match=r"faults\.0\.chip: 4 is not a chip of this pod "
                                            r"\(ranks 0\.\.3\)"):
        build_plan(scenario(faults=[{"kind": "kill_chip", "chip": 4, "step": 2}]))
    with pytest.raises(ScenarioError, match=r"faults\.0\.host: 1 is not a host"):
        build_plan(scenario(faults=[{"kind": "kill_host", "host": 1, "step": 2}]))
    with pytest.raises(ScenarioError, match="factor does not belong to kill_chip"):
        scenario(faults=[{"kind": "kill_chip", "chip": 1, "factor": 2.0}])


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory):
    out = tmp_path_factory.mktemp("fault-free")
    summary, _ = run(out, scenario(checkpoint=CKPT))
    return out, summary


def _check_recovered(summary, log, tmp_path, fault, recomputed):
    (event,) = summary["faults"]
    chips = [fault["chip"]] if "chip" in fault else [0, 1, 2, 3]
    assert summary["completed"] is True and summary["replicas_identical"] is True
    assert event["dead_chips"] == chips and event["recovered"] is True
    assert event["step"] == fault["step"] and event["steps_recomputed"] == recomputed
    assert summary["steps_recomputed"] == recomputed
    assert 0 <= event["detection_wall_seconds"] < 30
    assert event["restored_from_step"] == fault["step"] - 1 - recomputed
    assert "fault: " + fault["kind"] in log
    rows = list(csv.DictReader((tmp_path / "steps.csv").open()))
    assert [int(r["step"]) for r in rows] == list(range(1, 7))  # one row per step, no duplicates


@pytest.mark.parametrize("fault, recomputed", [
    ({"kind": "kill_chip", "chip": 2, "step": 4}, 1),   # checkpoint after step 2; step 3 redone
    ({"kind": "kill_host", "host": 0, "step": 5}, 0),   # every chip; checkpoint after step 4
    ({"kind": "kill_chip", "chip": 1, "step": 2}, 1),   # before any checkpoint: the initial state
])
def test_a_killed_chip_is_replaced_and_training_ends_bit_identical(fault_free, tmp_path, fault,
                                                                   recomputed):
    reference, ref_summary = fault_free
    summary, log = run(tmp_path, scenario(checkpoint=CKPT, faults=[fault]))
    assert final_params(tmp_path) == final_params(reference)
    assert summary["final_loss"] == ref_summary["final_loss"]
    _check_recovered(summary, log, tmp_path, fault, recomputed)


@pytest.fixture(scope="module")
def ray_fault_free(ray_cluster, tmp_path_factory):
    """The fault-free run on Ray chip actors (the reference of the Ray fault tests: a
    ring of 8 sums in its own order, so not LocalPod's bits)."""
    out = tmp_path_factory.mktemp("ray-fault-free")
    summary, _ = run(out, scenario(checkpoint=CKPT), backend="ray")
    return out, summary


@pytest.mark.slow
def test_a_chip_actor_killed_on_ray_is_replaced_and_training_ends_bit_identical(ray_fault_free,
                                                                                tmp_path):
    """The same on Ray: ``ray.kill`` of chip 2's actor during step 4, a new actor for
    every chip, the step-2 checkpoint restored; the end is the fault-free Ray run's
    bits."""
    reference, ref_summary = ray_fault_free
    fault = {"kind": "kill_chip", "chip": 2, "step": 4}
    summary, log = run(tmp_path / "killed", scenario(checkpoint=CKPT, faults=[fault]),
                       backend="ray")
    assert final_params(tmp_path / "killed") == final_params(reference)
    assert summary["final_loss"] == ref_summary["final_loss"]
    _check_recovered(summary, log, tmp_path / "killed", fault, 1)
    assert summary["faults"][0]["detection_wall_seconds"] > 0


def _cut_the_next_collective(chip) -> None:
    """Runs inside chip 0's actor (``__ray_call__``): in its device 0's next collective,
    the second chunk it sends stops half-way and the link closes, as when a link fails
    mid-send."""
    import struct

    port, sent = chip._port(chip.devices[0].device), []
    send = port._send

    def cut(address, chunk, payload):
        if not sent:
            sent.append(address)
            return send(address, chunk, payload)
        port._send = send  # once
        sock = port._links.pop(address, None) or port._link(address)
        run_id, phase, seq = chunk  # the wire header <QIIIQ (pod.runtime.ici), inline
        sock.sendall(struct.pack("<QIIIQ", run_id, phase, port.rank, seq, len(payload)))
        sock.sendall(payload[:len(payload) // 2])
        sock.close()
        raise ConnectionError("the link fails mid-chunk (test)")

    port._send = cut


def _run_with_a_cut_link(tmp_path, checkpoint):
    """The fault tests' scenario, with chip 0's link cut in step 4's collective."""
    import io

    import ray
    from rich.console import Console

    from pod.commands.train import Run

    holder: dict = {}

    def on_step(stats):
        if stats.step == 2 and "cut" not in holder:  # step 3 done: step 4's collective breaks
            holder["cut"] = True
            ray.get(holder["run"].pod.actors[0].__ray_call__.remote(_cut_the_next_collective))

    log = io.StringIO()
    run = Run(build_plan(scenario(checkpoint=checkpoint)), output_dir=tmp_path,
              console=Console(file=log, width=200), on_step=on_step, backend="ray")
    holder["run"] = run
    return run, log


@pytest.mark.slow
def test_a_link_cut_mid_collective_recovers_bit_identical_and_never_applies_a_partial_sum(
        ray_fault_free, tmp_path):
    reference, ref_summary = ray_fault_free
    run_, log = _run_with_a_cut_link(tmp_path / "cut", CKPT)
    summary = run_.run()
    # no chip applied the partial sum: recovery from the step-2 checkpoint redoes step 3
    # and 4, and the result is the fault-free run's, bit for bit
    assert final_params(tmp_path / "cut") == final_params(reference)
    assert summary["final_loss"] == ref_summary["final_loss"]
    (event,) = summary["faults"]
    assert event["dead_chips"] == [] and event["recovered"] is True
    assert event["step"] == 4 and event["restored_from_step"] == 2
    assert event["fault"].startswith("ICI link failure: chip ")
    assert "failed while sending" in event["error"] or "closed mid-chunk" in event["error"]
    assert "an ICI link failed mid-collective" in log.getvalue()


@pytest.mark.slow
def test_a_link_cut_mid_collective_without_checkpoints_stops_with_one_line(ray_cluster, tmp_path):
    from pod.errors import IciError

    run, _ = _run_with_a_cut_link(tmp_path, None)
    with pytest.raises(IciError, match=r"^chip \d: phase \d+: the link "):
        run.run()
    partial = json.loads((tmp_path / "summary.json").read_text())
    assert partial["completed"] is False and partial["steps"] == 3


def test_without_checkpoints_a_killed_chip_stops_the_run_and_keeps_the_partial_results(tmp_path):
    from pod.errors import ChipFailureError

    from pod.commands.train import run_training

    log = io.StringIO()
    with pytest.raises(ChipFailureError, match=r"chip actor\(s\) 3 died at step 3 .*no checkpoint"):
        run_training(build_plan(scenario(faults=[{"kind": "kill_chip", "chip": 3, "step": 3}])),
                     output_dir=tmp_path, console=Console(file=log, width=200), backend="local")
    # the error is printed once, by the CLI (error: ...): the run's own lines do not repeat it
    # nor name its class
    assert "no checkpoint" not in log.getvalue() and "ChipFailureError" not in log.getvalue()
    assert "Stopped after 2 of 6 steps; wrote " in log.getvalue(), log.getvalue()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["completed"] is False and summary["steps"] == 2
    assert summary["faults"][0]["recovered"] is False
    assert "ChipFailureError" in summary["stopped_by"]
    assert len(list(csv.DictReader((tmp_path / "steps.csv").open()))) == 2


def test_a_straggler_shows_in_its_metrics_the_step_time_and_the_trace(tmp_path):
    seen = []
    summary, _ = run(tmp_path, scenario(steps=3, faults=[
        {"kind": "slow_chip", "chip": 1, "factor": 3.0, "step": 2}]),
        on_step=seen.append, trace_path=tmp_path / "trace.json", trace_steps=[0, 2])
    first, _, third = seen
    base = first.chip_compute_seconds[0]
    assert first.chip_compute_seconds == pytest.approx({r: base for r in range(4)})
    assert third.chip_compute_seconds[1] == pytest.approx(3 * third.chip_compute_seconds[0])
    assert third.compute_seconds == third.chip_compute_seconds[1]      # everyone waits for it
    assert third.step_seconds - first.step_seconds == pytest.approx(2 * base, rel=1e-6)
    # the trace shows the slowest device: in step 3 one of chip 1's two TensorCores, its
    # forward and backward ops 3x as long as step 1's, its update as long
    assert third.traced_device // 2 == 1
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    end_of_first = first.step_seconds * 1e6
    steps = [e for e in events if e.get("ph") == "X" and e.get("cat") == "step"]
    assert [e["args"]["slowest_device"] for e in steps] == [first.traced_device,
                                                            third.traced_device]

    def busy(late):
        return sum(e["dur"] for e in events if e.get("ph") == "X" and e.get("cat") == "op"
                   and (e["ts"] >= end_of_first) == late)

    assert busy(False) == pytest.approx((base + first.update_seconds) * 1e6, rel=1e-6)
    assert busy(True) == pytest.approx((3 * base + first.update_seconds) * 1e6, rel=1e-6)
    assert third.update_seconds == first.update_seconds


def test_the_straggler_gauge_is_exported():
    from prometheus_client import generate_latest

    from pod.report.metrics import PodMetrics
    from pod.report.stats import StepStats

    m = PodMetrics(scenario="s", generation="v2", slice_name="v2-8", topology="2x2", links=[],
                   chips=2, devices_per_chip=1)
    m.observe(StepStats(step=0, loss=1.0, global_batch=8, infeed_seconds=0, compute_seconds=3e-6,
                        collective_seconds=0, update_seconds=0, model_flops=0,
                        peak_flops_per_s=1.0, wall_seconds=0.1,
                        chip_compute_seconds={0: 1e-6, 1: 3e-6}))
    text = generate_latest(m.registry).decode()
    assert 'tpu_pod_simulated_chip_compute_seconds{chip="1"} 3e-06' in text


def test_link_faults_change_the_allreduce_cost_from_their_step_not_the_result(tmp_path):
    """A link slowed from step 2 and another failed from step 3: each step's gradient
    allreduce costs what ``interconnect.collective_cost`` gives the plan's algorithm
    over the torus with those faults (after the on-chip add of the chip's two
    TensorCores), no byte crosses the failed link, and the losses are the clean run's."""
    from interconnect import LinkFaults, calibrated_link, collective_cost

    seen = []
    faults = [{"kind": "slow_link", "link": "0->1", "slowdown": 4.0, "step": 2},
              {"kind": "fail_link", "link": "1->3", "step": 3}]
    run(tmp_path, scenario(steps=3, faults=faults), on_step=seen.append)
    plan = build_plan(scenario(steps=3))
    spec = plan.topology.chip
    link = plan.ici.link  # the calibrated link the plan costs with
    assert link == calibrated_link(spec.name, spec.ici_link_bandwidth_bytes_per_s,
                                   spec.ici_latency_s)
    on_chip = 3 * 4 * plan.num_params / spec.core.hbm_bandwidth_bytes_per_s
    algorithm = plan.ici.algorithm
    expected = [collective_cost("allreduce", plan.topology.torus, plan.num_params, link,
                                algorithm=algorithm, faults=f).seconds + on_chip
                for f in (LinkFaults(), LinkFaults({(0, 1): 4.0}),
                          LinkFaults({(0, 1): 4.0}, frozenset({(1, 3)})))]
    # the mesh costs the buffer in bf16-sized elements: its chunks round differently
    assert [s.collective_seconds for s in seen] == pytest.approx(expected, rel=1e-4)
    assert [s.axis_collective_seconds["data"] for s in seen] == \
        [s.collective_seconds for s in seen]
    assert seen[0].collective_seconds < seen[1].collective_seconds <= seen[2].collective_seconds
    assert seen[2].ici_link_bytes.get("1->3", 0) == 0 < seen[1].ici_link_bytes["1->3"]
    # the gradient bytes do not depend on the links: same loss as a run without faults
    clean = []
    run(tmp_path / "clean", scenario(steps=3), on_step=clean.append)
    assert [s.loss for s in seen] == [s.loss for s in clean]


def _terminate(proc: subprocess.Popen) -> str:
    """Send SIGTERM, wait for the run to stop (kill it if it does not); return its stderr."""
    try:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return stderr


def _run_until(scenario: Path, out: Path, rows: int, env: dict,
               *options: str) -> subprocess.Popen:
    """Start ``tpu-pod run`` and return once steps.csv holds ``rows`` lines (or fail)."""
    proc = subprocess.Popen([sys.executable, "-m", "pod", "run", str(scenario), "--output-dir",
                             str(out), "--log-every", "0", *options], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 180
    path = out / "steps.csv"
    while time.monotonic() < deadline and (not path.exists()
                                           or path.read_text().count("\n") < rows):
        if proc.poll() is not None:
            pytest.fail(proc.communicate()[1][-2000:])
        time.sleep(0.2)
    return proc


def test_sigterm_writes_a_checkpoint_and_the_partial_summary_and_exits_143(tmp_path):
    path = tmp_path / "long.yaml"
    path.write_text(
        "name: long\npod: {slice: v2-8}\nmodel: {name: mlp, options: {hidden: [32]}}\n"
        "training: {global_batch: 64, steps: 5000, optimizer: {name: adam}}\n"
        "metrics: {port: 0}\ncheckpoint: {every_steps: 7, dir: ck, keep: 2}\n")
    out = tmp_path / "out"
    proc = _run_until(path, out, 10, dict(os.environ), "--in-process")
    stderr = _terminate(proc)
    assert proc.returncode == 143, stderr[-2000:]
    assert "interrupted by SIGTERM" in stderr and "Traceback" not in stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] is False and summary["stopped_by"] == "signal SIGTERM"
    done = summary["steps"]
    assert 9 <= done < 5000
    assert len(list(csv.DictReader((out / "steps.csv").open()))) == done
    ck = load_checkpoint(checkpoint_path(tmp_path / "ck", done))     # the final checkpoint
    assert ck.step == done and ck.run_state["totals"]["steps"] == done


def _processes() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, name, state) of every process, from /proc."""
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
            out[int(entry.name)] = (int(ppid), name, state)
    return out


def _descendants(pid: int) -> dict[int, str]:
    procs = _processes()
    found, frontier = {}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, (ppid, name, _) in procs.items():
            if ppid == parent and child not in found:
                found[child] = name
                frontier.append(child)
    return found


@pytest.mark.slow
def test_sigterm_without_a_cluster_shuts_down_the_local_ray_it_started(tmp_path):
    """No RAY_ADDRESS: the run starts its own Ray; after SIGTERM none of its processes remain."""
    path = tmp_path / "own.yaml"
    path.write_text(
        "name: own\npod: {slice: v2-8}\nmodel: {name: mlp, options: {hidden: [16]}}\n"
        "training: {global_batch: 64, steps: 5000, optimizer: {name: adam}}\nmetrics: {port: 0}\n")
    out = tmp_path / "out"
    proc = _run_until(path, out, 5, {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"})
    try:
        started = _descendants(proc.pid)
        assert any(n in ("raylet", "gcs_server") for n in started.values()), started
    except BaseException:
        proc.kill()
        raise
    stderr = _terminate(proc)
    assert proc.returncode == 143, stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] is False and summary["steps"] >= 4

    def alive() -> dict[int, str]:
        procs = _processes()
        return {pid: name for pid, name in started.items()
                if pid in procs and procs[pid][2] != "Z" and procs[pid][1] == name}

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and alive():
        time.sleep(0.5)
    assert not alive(), alive()


def test_a_nonfinite_loss_stops_the_run_unless_the_scenario_says_to_continue(tmp_path):
    """NaN or infinity in the loss ends the run with one line (exit 2 through the CLI)
    before the step is recorded; ``training.continue_on_nonfinite_loss`` keeps going."""
    import dataclasses
    import io

    from rich.console import Console

    from pod.commands.train import Run
    from pod.errors import NonFiniteLossError
    from pod.report.stats import StepStats

    bad = StepStats(step=3, loss=float("nan"), global_batch=64, infeed_seconds=0.0,
                    compute_seconds=1e-5, collective_seconds=1e-6,
                    update_seconds=1e-6, model_flops=1, peak_flops_per_s=1e12, wall_seconds=0.1)
    console = Console(file=io.StringIO())
    run = Run(build_plan(scenario()), output_dir=tmp_path / "a", console=console)
    with pytest.raises(NonFiniteLossError, match=r"^training: the loss of step 4 is nan; stopping"):
        run.record(bad, console)
    assert run.totals.steps == 0 and run.step_index == 0   # not recorded
    with pytest.raises(NonFiniteLossError, match="is inf"):
        run.record(dataclasses.replace(bad, loss=float("inf")), console)
    keep_going = scenario().with_overrides(training__continue_on_nonfinite_loss=True)
    going = Run(build_plan(keep_going), output_dir=tmp_path / "b", console=console,
                metrics_port=0)
    going.start_metrics()
    try:
        with going.rows:  # steps.csv open, as during a run
            going.record(bad, console)
    finally:
        going.metrics.close()
    assert going.totals.steps == 1 and going.step_index == 1

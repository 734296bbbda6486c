"""Probe 3 of issue 26: 1,024 functional chips were accepted and the run started actor
processes (about 55 MB each) until the machine ran out of memory. Admission now
refuses a pod the machine cannot hold before any actor starts, with one line saying
how many chips fit. No Ray (the check runs before ``ray.init``)."""

from __future__ import annotations

import pytest

from pod.config.plan import build_plan
from pod.config.scenario import parse_scenario
from pod.errors import USER_ERRORS, ScenarioError
from pod.runtime import admission as module
from pod.runtime.admission import (ACTOR_BASE_BYTES, RAY_RESERVE_BYTES, admission, admit,
                                   available_memory_bytes)

GIB = 2 ** 30


def _plan(chips: int, **extra):
    return build_plan(parse_scenario({
        "name": "admit", "pod": {"chip": "v4", "chips": chips},
        "model": {"name": "mlp", "options": {"hidden": [16]}},
        "data": {"name": "synthetic", "options": {"num_examples": 4096, "shape": [8]}},
        "training": {"global_batch": 2 * chips, "steps": 1}, "metrics": {"port": 0}, **extra}))


def test_the_machines_memory_is_read():
    available = available_memory_bytes()
    assert available is not None and 0 < available < 1 << 50


def test_a_pod_that_fits_is_admitted_and_one_that_does_not_is_one_line():
    plan = _plan(64)
    found = admission(plan, available_bytes=24 * GIB, cpus=2)
    assert found.actors == 64 and found.actor_bytes >= ACTOR_BASE_BYTES and found.fits
    admit(plan, available_bytes=24 * GIB, cpus=2)
    small = RAY_RESERVE_BYTES + 10 * found.actor_bytes + found.actor_bytes // 2
    with pytest.raises(ScenarioError) as err:
        admit(plan, available_bytes=small, cpus=2)
    text = str(err.value)
    assert isinstance(err.value, USER_ERRORS) and "\n" not in text
    assert text.startswith("pod: 64 functional chips (64 actor processes) need ")
    assert "at most 10 chips fit here" in text and "Timing-only mode (sweep.mode: timing" in text


def test_a_thousand_chips_on_this_machines_figures_are_refused():
    """The probe's pod on a 24 GiB machine: about 60 MiB per actor, 1,024 actors."""
    plan = _plan(1024)
    with pytest.raises(ScenarioError, match=r"at most (3[0-9]{2}) chips fit here"):
        admit(plan, available_bytes=23 * GIB, cpus=2)


def test_cpus_bound_the_chip_actors():
    """A chip actor asks Ray for 0.001 CPU (ACTOR_CPUS): 2,048 chips on 2 CPUs would wait
    for CPUs forever; 2,000 fit."""
    from types import SimpleNamespace

    plan = SimpleNamespace(mesh=SimpleNamespace(devices_per_chip=1, size=2048),
                           memory={"total": 1 << 20}, topology=SimpleNamespace(chips=2048),
                           scenario=SimpleNamespace(ray=SimpleNamespace(address=None)))
    found = admission(plan, available_bytes=1 << 50, cpus=2)
    assert found.actors == 2048 and found.actors_that_fit == 2000 and not found.fits
    with pytest.raises(ScenarioError, match=r"need 2.048 CPUs of Ray's but this machine has 2; "
                                            r"at most 2,000 chips fit"):
        admit(plan, available_bytes=1 << 50, cpus=2)


def test_a_joined_cluster_is_not_checked_here(monkeypatch):
    plan = _plan(64)
    admit(plan, address="10.0.0.1:6379", available_bytes=0, cpus=2)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    admit(plan, available_bytes=0, cpus=2)


def test_a_joined_cluster_is_checked_once_joined_against_what_ray_says_is_free():
    """``admit_joined`` (``Pod.start`` calls it after joining, before any actor): the
    cluster's free "memory" and "CPU" resources, no reserve for Ray's daemons (they run)."""
    from pod.errors import ClusterError
    from pod.runtime.admission import admit_joined

    plan = _plan(64)
    found = admission(plan, available_bytes=1 << 50, cpus=2)
    admit_joined(plan, "10.0.0.1:6379", {"memory": 64 * found.actor_bytes, "CPU": 2.0})
    admit_joined(plan, "10.0.0.1:6379", {"CPU": 2.0})  # no memory figure: nothing to check
    with pytest.raises(ClusterError) as err:
        admit_joined(plan, "10.0.0.1:6379", {"memory": 40 * found.actor_bytes + 1, "CPU": 2.0})
    line = str(err.value)
    assert line.startswith("ray.address: the cluster at '10.0.0.1:6379': 64 functional chips "
                           "(64 actor processes) need ") and "\n" not in line
    assert "at most 40 chips fit there" in line and "Timing-only mode" in line
    with pytest.raises(ClusterError, match=r"0.064 CPUs of Ray's but the cluster has free 0.05; "
                                           r"at most 50 chips fit there"):
        admit_joined(plan, "10.0.0.1:6379", {"memory": 1 << 50, "CPU": 0.05})


def test_a_run_is_refused_before_any_actor_starts_and_changes_no_earlier_result(tmp_path,
                                                                                monkeypatch):
    from pod.commands.train import Run
    from pod.runtime.pod import Pod
    from pod.safe_io import lock_directories

    def no_actor(*args, **kwargs):
        raise AssertionError("an actor was started")

    monkeypatch.setattr(Pod, "start", no_actor)
    monkeypatch.setattr(module, "available_memory_bytes",
                        lambda: RAY_RESERVE_BYTES + 3 * (ACTOR_BASE_BYTES + (1 << 20)))
    out = tmp_path / "out"
    out.mkdir()
    (out / "steps.csv").write_text("an earlier run's rows\n")
    with pytest.raises(ScenarioError, match=r"^pod: 8 functional chips .* at most 3 chips fit"):
        Run(_plan(8), output_dir=out, log_every=0).run()
    assert (out / "steps.csv").read_text() == "an earlier run's rows\n"
    assert not (out / "layers.csv").exists() and not (out / "summary.json").exists()
    lock_directories(out).release()  # the refused run let go of its lock

"""The tpu-pod command line, run as a user runs it (subprocesses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.pod.config.test_scenario import REFUSED_BY_THE_HBM_PLAN
from tests.pod.runtime.test_speed import PINNED_SECONDS

ROOT = Path(__file__).resolve().parents[3]


def tpu_pod(*args: str, env: dict | None = None, timeout: float = 300):
    return subprocess.run([sys.executable, "-m", "pod", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def test_help_lists_the_commands():
    out = tpu_pod("--help")
    assert out.returncode == 0
    for command in ("run", "validate", "describe", "export", "init", "monitor"):
        assert command in out.stdout
    assert "..." not in out.stdout.split("Commands:")[1]  # no short_help is cut


def test_describe_v2_8():
    out = tpu_pod("describe", "v2-8")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    # derived from the clock (2 x 16384 MACs x 0.7 GHz x 8 cores) beside Google's 180e12 [SEED]
    assert "4 chips, 8 TensorCores, 184 TFLOP/s bf16 (Google: 180 TFLOP/s), 64 GiB HBM" in text


@pytest.mark.slow  # several seconds: the slow tier (make test stays under 3 minutes)
def test_validate_every_scenario():
    """Every shipped scenario validates, but the published runs the HBM plan refuses today
    (``REFUSED_BY_THE_HBM_PLAN``), which validate refuses in one line each."""
    every = sorted((ROOT / "scenarios").glob("*.yaml"))
    paths = [str(p) for p in every if p.name not in REFUSED_BY_THE_HBM_PLAN]
    for refused in sorted(set(p.name for p in every) & REFUSED_BY_THE_HBM_PLAN):
        out = tpu_pod("validate", str(ROOT / "scenarios" / refused))
        assert out.returncode == 2 and "does not fit" in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1
    out = tpu_pod("validate", *paths)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count(": ok (") == len(paths)
    # both kinds are shipped and validated: training scenarios and seed benchmarks
    assert ": ok (benchmark matmul, v2-8, 4 chips, 8 TensorCores, N=4,096" in out.stdout
    assert ": ok (benchmark matrix_add" in out.stdout
    assert out.stdout.count("global batch") == len(paths) - out.stdout.count("(benchmark ")


@pytest.mark.parametrize("content, needle", [
    ("name: x\npod: {slice: v2-8}\nmodel: {name: cnn}\ntraining: {global_batch: 100, steps: 1}\n",
     "global batch 100 does not split over data x fsdp = 8 devices"),
    ("name: x\npod: {slice: v2-8}\nmodel: {name: cnn}\ntraining: {global_batch: 64, steps: 1}\n"
     "extra: 1\n", "extra: unknown key"),
    ("name: x\npod: [\n", "invalid YAML"),
    ("name: x\npod: {slice: v2-8}\nmodel: {name: mlp, options: {hidden: [60000, 60000, 60000]}}\n"
     "training: {global_batch: 64, steps: 1}\n", "needs 120.8 GiB per device"),
])
def test_user_errors_are_one_line_without_traceback(tmp_path, content, needle):
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    for command in ("validate", "run"):
        out = tpu_pod(command, str(path))
        assert out.returncode == 2
        assert "Traceback" not in out.stderr
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], out.stderr


@pytest.mark.parametrize("backend", [
    pytest.param("--in-process", id="in-process"),
    pytest.param("ray", id="ray", marks=pytest.mark.slow),
])
def test_quickstart_runs_end_to_end(tmp_path, request, backend):
    """``tpu-pod run`` of the quick start as a user runs it: on chip actors (joining the
    test session's cluster) and with ``--in-process``; the same simulated figures."""
    if backend == "ray":
        options, env = (), {"RAY_ADDRESS": request.getfixturevalue("ray_cluster")}
    else:
        options, env = (backend,), {}
    out = tpu_pod("run", "scenarios/quickstart.yaml", "--steps", "3", "--metrics-port", "0",
                  "--output-dir", str(tmp_path), *options, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "step 3/3" in out.stdout
    where = "4 chips in this process" if options else "4 chip actors (8 devices) ready in"
    assert where in out.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["chips"] == 4 and summary["cores"] == 8
    assert summary["devices"] == 8 and summary["mesh"] == {"data": 8}
    assert summary["replicas_identical"] is True
    assert summary["generation"] == "v2" and summary["dataset"] == "digits"
    # pinned in tests/pod/runtime/test_speed.py: the same simulated step on every back-end
    assert summary["simulated_step_seconds"] == pytest.approx(PINNED_SECONDS["step_seconds"],
                                                              rel=1e-12)


@pytest.mark.parametrize("args, needle", [
    (["run", "scenarios/quickstart.yaml", "--steps", "0"], "'--steps': 0 is not in the range"),
    (["matmul", "--m", "0"], "'--m': 0 is not in the range"),
    (["frobnicate"], "No such command 'frobnicate'"),
    (["run"], "Missing argument 'SCENARIO'"),
])
def test_bad_options_are_one_line_too(args, needle):
    out = tpu_pod(*args)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], out.stderr
    assert "--help" in lines[0]


def test_describe_scenario_shows_the_hbm_plan_even_when_it_does_not_fit():
    ok = tpu_pod("describe", "scenarios/quickstart.yaml")
    assert ok.returncode == 0, ok.stderr
    for item in ("params", "grads", "optimizer_state", "activations", "workspace", "capacity"):
        assert item in ok.stdout
    bad = tpu_pod("describe", "tests/pod/config/bad_scenarios/model_too_big_for_hbm.yaml")
    assert bad.returncode == 2
    assert "DOES NOT FIT" in bad.stdout and "optimizer_state" in bad.stdout
    assert len(bad.stderr.strip().splitlines()) == 1 and "does not fit" in bad.stderr


@pytest.mark.slow  # several seconds: the slow tier (make test stays under 3 minutes)
def test_resume_through_the_cli(tmp_path):
    scenario = tmp_path / "ck.yaml"
    scenario.write_text(
        "name: ck\npod: {slice: v2-8}\nmodel: {name: mlp, options: {hidden: [16]}}\n"
        "training: {global_batch: 64, steps: 6, optimizer: {name: adam}}\nmetrics: {port: 0}\n"
        "checkpoint: {every_steps: 2, dir: ck, keep: 2}\n")
    first = tpu_pod("run", str(scenario), "--steps", "4", "--output-dir", str(tmp_path / "a"),
                    "--log-every", "0", "--in-process")
    assert first.returncode == 0, first.stderr[-2000:]
    again = tpu_pod("run", str(scenario), "--output-dir", str(tmp_path / "a"), "--in-process")
    assert again.returncode == 2 and "--resume" in again.stderr  # never overwrites a run
    resumed = tpu_pod("run", str(scenario), "--resume", str(tmp_path / "ck"), "--output-dir",
                      str(tmp_path / "a"), "--log-every", "0", "--in-process")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "Resuming from" in resumed.stdout and "step 4 of 6" in resumed.stdout
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["completed"] is True


def test_validate_checks_every_file_and_reports_each(tmp_path):
    """A bad file does not stop the others: each is reported, then exit 2."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\npod: {slice: v2-8}\nmodel: {name: cnn}\n"
                   "training: {global_batch: 100, steps: 1}\n")
    good = ROOT / "scenarios" / "quickstart.yaml"
    out = tpu_pod("validate", str(bad), str(good), str(bad))
    assert out.returncode == 2
    assert out.stderr.count(f"error: {bad}: training.global_batch: global batch 100") == 2
    assert f"{good}: ok (" in out.stdout
    out = tpu_pod("validate", "--json", str(bad), str(good))
    rows = json.loads(out.stdout)
    assert out.returncode == 2 and [r["ok"] for r in rows] == [False, True]
    assert rows[0]["error"].startswith(f"{bad}: training.global_batch")
    assert rows[1]["collective_algorithms"] == {"data": "torus"}
    assert rows[1]["per_device_batch"] == 32
    assert (rows[1]["mesh"], rows[1]["devices"]) == ({"data": 8}, 8)


@pytest.mark.slow  # several seconds: the slow tier (make test stays under 3 minutes)
def test_describe_json_for_a_slice_and_a_scenario():
    out = tpu_pod("describe", "v4-32", "--json")
    pod = json.loads(out.stdout)
    assert (pod["chips"], pod["tensorcores"], pod["generation"]) == (16, 32, "v4")
    out = tpu_pod("describe", "scenarios/quickstart.yaml", "--json")
    doc = json.loads(out.stdout)
    assert doc["memory"]["total"] == sum(v for k, v in doc["memory"].items() if k != "total")
    assert doc["parameters"] == 44_138  # the seed CNN (README's model table)
    # the layers' simulated seconds are the model summary's: one per layer plus the loss
    assert "conv1" in doc["layers"] and "loss" in doc["layers"]
    text = tpu_pod("describe", "scenarios/quickstart.yaml").stdout
    assert "Model: cnn" in text and "HBM plan per device (pod.mesh {data: 8}" in text


@pytest.mark.slow  # several seconds: the slow tier (make test stays under 3 minutes)
def test_run_and_sweep_json_print_one_document(tmp_path):
    scenario = tmp_path / "s.yaml"
    scenario.write_text("name: s\npod: {slice: v2-8}\nmodel: {name: mlp, options: {hidden: [8]}}\n"
                        "training: {global_batch: 64, steps: 2}\nmetrics: {port: 0}\n")
    out = tpu_pod("run", str(scenario), "--json", "--in-process", "--output-dir",
                  str(tmp_path / "out"))
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary == json.loads((tmp_path / "out" / "summary.json").read_text())
    assert "step 2/2" in out.stderr
    # the shipped weak-scaling sweep, its first two pod sizes (its 22 points take a minute)
    text = (ROOT / "scenarios" / "scaling-v4-weak.yaml").read_text()
    chips = "chips: [4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]"
    assert chips in text
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(text.replace(chips, "chips: [4, 8]"))
    out = tpu_pod("sweep", str(sweep), "--json", "--output-dir", str(tmp_path / "sweep"))
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert len(rows) == 4  # 2 pod sizes x ring, torus
    assert len(rows) == len((tmp_path / "sweep" / "results.csv").read_text().splitlines()) - 1


def test_options_that_cannot_act_are_errors(tmp_path):
    out = tpu_pod("run", "scenarios/quickstart.yaml", "--trace-steps", "2")
    assert out.returncode == 2 and "--trace-steps" in out.stderr and "--trace FILE" in out.stderr
    out = tpu_pod("run", "scenarios/seed-matmul-v2-8.yaml", "--trace", str(tmp_path / "t.json"))
    assert out.returncode == 2 and "--trace" in out.stderr
    out = tpu_pod("run", "scenarios/scaling-v4-weak.yaml", "--steps", "1")
    assert out.returncode == 2 and "tpu-pod sweep" in out.stderr

"""Capturing a user's JAX step (``pod.frontends``, ``pod.jax``, ``tpu-pod run-jax``): the CPU
path end to end in this process, one line for a step that does not trace or a mesh that does
not divide the slice; the TPU path (libtpu) and the command line in the slow tier."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pod.errors import CaptureError

pytest.importorskip("jax", reason="the jax extra is not installed (pip install -e '.[jax]')")

DATA = Path(__file__).resolve().parents[2] / "data" / "jax"
STEP = DATA / "tiny_step.py"
TPU = importlib.util.find_spec("libtpu") is not None


def _user_module():
    spec = importlib.util.spec_from_file_location("tiny_step", STEP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def cpu_estimate(tmp_path_factory):
    """The tiny step captured over 8 fake CPU devices and costed (once)."""
    import pod.jax

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TPU_POD_CACHE", str(tmp_path_factory.mktemp("cache")))
        user = _user_module()
        yield pod.jax.estimate(user.step, user.step_args, mesh=user.MESH, slice="v5e-8",
                               path="cpu"), user


def test_cpu_capture_end_to_end(cpu_estimate, tmp_path):
    estimate, _ = cpu_estimate
    assert estimate.approximate and estimate.summary["costed_from"] == (
        "approximate (CPU-compiled HLO)")
    # the MXU work by hand, per device: forward x @ w of (128 x 512) . (512 x 256), backward
    # the weight gradient (512 x 128) . (128 x 256)
    assert estimate.step.flops_per_device == 2 * (2 * 128 * 512 * 256)
    assert estimate.step_seconds > 0 and estimate.memory.fits
    assert set(estimate.step.lanes) <= {"data", "model", "data+model"}
    paths = estimate.write(tmp_path)
    layers = paths[1].read_text()
    assert "tiny_step.py:" in layers and "dot_general" in layers


def test_the_capture_is_cached(cpu_estimate):
    import pod.jax

    _, user = cpu_estimate
    again = pod.jax.estimate(user.step, user.step_args, mesh=user.MESH, slice="v5e-8",
                             path="cpu")
    assert again.summary["cached"] and again.step_seconds == cpu_estimate[0].step_seconds


def test_a_step_that_does_not_trace_is_one_line(cpu_estimate):
    import pod.jax

    _, user = cpu_estimate
    with pytest.raises(CaptureError, match=r"^broken does not trace with these arguments: "
                                           r"TypeError: .*") as err:
        pod.jax.estimate(user.broken, user.broken_args, mesh=user.MESH, slice="v5e-8",
                         path="cpu")
    assert "\n" not in str(err.value)


def test_a_mesh_that_does_not_divide_the_slice_is_one_line(cpu_estimate):
    import pod.jax

    _, user = cpu_estimate
    with pytest.raises(CaptureError, match=r"mesh \{data: 2, model: 2\} has 4 devices but "
                                           r"v5e-8 has 8"):
        pod.jax.estimate(user.step, user.step_args, mesh={"data": 2, "model": 2},
                         slice="v5e-8", path="cpu")


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pod", *args], capture_output=True, text=True,
                          timeout=900, env={**os.environ, **(env or {})})


@pytest.mark.slow
def test_run_jax_command(tmp_path):
    out = tmp_path / "out"
    done = _cli("run-jax", f"{STEP}:step", "--slice", "v5e-8", "--path", "cpu", "--output-dir",
                str(out), "--json", env={"TPU_POD_CACHE": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["costed_from"] == "approximate (CPU-compiled HLO)"
    assert (out / "trace.json.gz").exists()
    bad = _cli("run-jax", f"{STEP}:nothing", "--slice", "v5e-8")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert "defines no function 'nothing'" in bad.stderr


@pytest.mark.slow
@pytest.mark.skipif(not TPU, reason="libtpu is not installed (pip install -e '.[tpu-compile]'); "
                                    "the TPU path compiles with it")
def test_tpu_capture(tmp_path):
    """Compiled for the v5e-8 itself with no TPU: XLA's buffer assignment comes with it, and
    the MXU work is the CPU path's."""
    done = _cli("run-jax", f"{STEP}:step", "--slice", "v5e-8", "--path", "tpu", "--output-dir",
                str(tmp_path / "out"), "--json", env={"TPU_POD_CACHE": str(tmp_path / "c")})
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["costed_from"] == "TPU-compiled HLO" and data["capture"]["platform"] == "tpu"
    assert data["memory"]["xla_platform"] == "tpu" and data["memory"]["xla"]["peak_bytes"] > 0
    assert data["mxu_flops_per_device"] == 2 * (2 * 128 * 512 * 256)


@pytest.mark.slow
def test_the_readme_example_runs_in_one_command(tmp_path):
    """docs/jax.md's model of the reader's own, the README's one command (CPU path)."""
    example = Path(__file__).resolve().parents[3] / "docs" / "examples" / "my_model.py"
    done = _cli("run-jax", f"{example}:train_step", "--slice", "v5e-8", "--path", "cpu",
                "--output-dir", str(tmp_path / "out"), "--json",
                env={"TPU_POD_CACHE": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["simulated_step_seconds"] > 0 and data["memory"]["fits"]
    assert set(data["collectives_by_lane"]) & {"fsdp", "tensor"}

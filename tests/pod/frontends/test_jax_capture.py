"""Capturing a user's JAX step (``pod.frontends``, ``pod.jax``, ``tpu-pod run-jax``): the CPU
path end to end in a process of its own (about 4 s; jax's threads stay out of this process,
which forks others), one line for a step that does not trace or a mesh that does not divide
the slice; the TPU path (libtpu) and the command line in the slow tier."""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("jax") is None:
    pytest.skip("the jax extra is not installed (pip install -e '.[jax]')",
                allow_module_level=True)

DATA = Path(__file__).resolve().parents[2] / "data" / "jax"
STEP = DATA / "tiny_step.py"
TPU = importlib.util.find_spec("libtpu") is not None

#: Runs in a process of its own: jax starts threads, and the test process forks others.
CAPTURE = """
import importlib.util, json, sys
import pod.jax
from pod.errors import CaptureError
spec = importlib.util.spec_from_file_location("tiny_step", sys.argv[1])
user = importlib.util.module_from_spec(spec)
spec.loader.exec_module(user)
est = pod.jax.estimate(user.step, user.step_args, mesh=user.MESH, slice="v5e-8", path="cpu")
paths = est.write(sys.argv[2])
again = pod.jax.estimate(user.step, user.step_args, mesh=user.MESH, slice="v5e-8", path="cpu")
errors = []
for fn, args, mesh in ((user.broken, user.broken_args, user.MESH),
                       (user.step, user.step_args, {"data": 2, "model": 2})):
    try:
        pod.jax.estimate(fn, args, mesh=mesh, slice="v5e-8", path="cpu")
    except CaptureError as err:
        errors.append(str(err))
print(json.dumps({"summary": est.summary, "lanes": list(est.step.lanes),
                  "flops": est.step.flops_per_device, "fits": est.memory.fits,
                  "approximate": est.approximate, "layers": paths[1].read_text(),
                  "again_cached": again.summary["cached"],
                  "again_seconds": again.step_seconds, "errors": errors}))
"""


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    """The tiny step captured over 8 fake CPU devices and costed, in a fresh process: its
    estimate, the same again (from the cache), and two mistakes."""
    tmp = tmp_path_factory.mktemp("capture")
    done = subprocess.run([sys.executable, "-c", CAPTURE, str(STEP), str(tmp / "out")],
                          capture_output=True, text=True, timeout=900,
                          env={**os.environ, "TPU_POD_CACHE": str(tmp / "cache")})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_cpu_capture_end_to_end(captured):
    assert captured["approximate"] and captured["summary"]["costed_from"] == (
        "approximate (CPU-compiled HLO)")
    # the MXU work by hand, per device: forward x @ w of (128 x 512) . (512 x 256), backward
    # the weight gradient (512 x 128) . (128 x 256)
    assert captured["flops"] == 2 * (2 * 128 * 512 * 256)
    assert captured["summary"]["simulated_step_seconds"] > 0 and captured["fits"]
    assert set(captured["lanes"]) <= {"data", "model", "data+model"}
    assert "tiny_step.py:" in captured["layers"] and "dot_general" in captured["layers"]
    # the chain of the user's functions from the jitted step to its matmul (tiny_step.py:
    # step differentiates its inner loss, which does x @ w)
    rows = list(csv.DictReader(io.StringIO(captured["layers"])))
    dots = [r for r in rows if r["op_name"].endswith("dot_general")]
    assert dots and all(r["call_chain"] == "step > step.<locals>.loss" for r in dots), dots
    assert all(re.fullmatch(r"tiny_step\.py:\d+ \(step\.<locals>\.loss\)", r["source"])
               for r in dots), dots


def test_the_capture_is_cached(captured):
    assert captured["again_cached"]
    assert captured["again_seconds"] == captured["summary"]["simulated_step_seconds"]


def test_a_step_that_does_not_trace_is_one_line(captured):
    error = captured["errors"][0]
    assert error.startswith("broken does not trace with these arguments: TypeError: ")
    assert "\n" not in error


def test_a_mesh_that_does_not_divide_the_slice_is_one_line(captured):
    assert "mesh {data: 2, model: 2} has 4 devices but v5e-8 has 8" in captured["errors"][1]


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

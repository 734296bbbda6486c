"""Every size a command takes and every file it reads keeps memory bounded by a
documented cap, and the caps themselves are reachable: each case runs the real CLI
in a subprocess under an address-space limit (``resource.setrlimit(RLIMIT_AS)``), so
a cap that is missing shows as a MemoryError or a kill, not as a slow test. No Ray.

Caps (``pod/workloads/files.py``, ``pod/config/scenario.py``, ``pod/cli.py``):
``MAX_DATA_FILE_BYTES`` (1 GiB), ``MAX_DATASET_VALUES`` (2**28 values before the
float conversion), ``MAX_TEXT_FILE_BYTES`` (64 MiB), synthetic data 2**26 values,
``MAX_SCENARIO_BYTES``, ``--length`` 100,000, ``--trace-steps`` 1,000.
"""

from __future__ import annotations

import os
import resource
import struct
import subprocess
import sys
from pathlib import Path

import pytest

GIB = 1 << 30


def _cli(args, cwd: Path, limit_bytes: int) -> subprocess.CompletedProcess:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))

    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "pod", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600, preexec_fn=limit)


def _one_line(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "MemoryError" not in proc.stderr
    for needle in needles:
        assert needle in proc.stderr, proc.stderr


def _scenario(tmp_path: Path, data: str, model: str = "mlp", batch: int = 64) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(f"name: caps\npod: {{slice: v2-8}}\nmodel: {{name: {model}}}\n"
                    f"data: {data}\ntraining: {{global_batch: {batch}, steps: 1}}\n"
                    "metrics: {port: 0}\n")
    return path


def _sparse(path: Path, header: bytes, size: int) -> None:
    with path.open("wb") as f:
        f.write(header)
        f.truncate(size)


@pytest.mark.slow  # several seconds: the slow tier (make test stays under 3 minutes)
def test_synthetic_data_at_its_cap_validates_under_1_5_gib(tmp_path):
    """2**26 values (the synthetic cap) is reachable: built and checked in 1.5 GiB."""
    s = _scenario(tmp_path, "{name: synthetic, options: {num_examples: 1048576, shape: [64]}}")
    proc = _cli(["validate", str(s)], tmp_path, 3 * GIB // 2)
    assert proc.returncode == 0, proc.stderr[-2000:]
    over = _scenario(tmp_path, "{name: synthetic, options: {num_examples: 1048577, shape: [64]}}")
    _one_line(_cli(["validate", str(over)], tmp_path, 3 * GIB // 2), "more than the 67,108,864")


def test_mnist_images_past_the_value_cap_are_refused_before_conversion(tmp_path):
    """A 268 MB IDX file (2**28 + pixels): read, then refused before the float32 copy
    (1 GiB) and its scaled copy (another 1 GiB) that used to exhaust 1.5 GiB."""
    n = (1 << 28) // 784 + 1
    mnist = tmp_path / "mnist"
    mnist.mkdir()
    _sparse(mnist / "train-images-idx3-ubyte", struct.pack(">BBBBIII", 0, 0, 8, 3, n, 28, 28),
            16 + n * 784)
    _sparse(mnist / "train-labels-idx1-ubyte", struct.pack(">BBBBI", 0, 0, 8, 1, n), 8 + n)
    _sparse(mnist / "t10k-images-idx3-ubyte", struct.pack(">BBBBIII", 0, 0, 8, 3, 10, 28, 28),
            16 + 10 * 784)
    _sparse(mnist / "t10k-labels-idx1-ubyte", struct.pack(">BBBBI", 0, 0, 8, 1, 10), 18)
    s = _scenario(tmp_path, f"{{name: mnist, path: {mnist}}}")
    _one_line(_cli(["validate", str(s)], tmp_path, 3 * GIB // 2), "data.path:",
              "MNIST train images holds 268,436,112 values, more than the 268,435,456")


def test_a_text_file_past_its_cap_is_refused_before_reading(tmp_path):
    """A 1 GiB text file (sparse: no disk used) in a 1 GiB address space."""
    _sparse(tmp_path / "big.txt", b"hello ", GIB)
    s = _scenario(tmp_path, f"{{name: text, path: {tmp_path / 'big.txt'}}}", model="char_lstm")
    _one_line(_cli(["validate", str(s)], tmp_path, GIB), "data.path:",
              "is larger than the 67,108,864 bytes a text file may have")


def test_a_data_file_past_the_file_cap_is_refused_before_reading(tmp_path):
    npz = tmp_path / "imdb.npz"
    _sparse(npz, b"PK\x03\x04", GIB + 1)
    s = _scenario(tmp_path, f"{{name: imdb, path: {npz}}}", model="lstm_classifier")
    _one_line(_cli(["validate", str(s)], tmp_path, GIB), "data.path:",
              "1,073,741,825 bytes is larger than the 1,073,741,824 bytes")


@pytest.mark.parametrize("kind", ["dev_zero", "fifo", "huge"])
def test_a_scenario_that_is_a_device_a_fifo_or_huge_is_one_line(tmp_path, kind):
    """Probe: a FIFO as the scenario blocked forever."""
    path = {"dev_zero": Path("/dev/zero"), "fifo": tmp_path / "f.yaml",
            "huge": tmp_path / "h.yaml"}[kind]
    if kind == "fifo":
        os.mkfifo(path)
    if kind == "huge":
        _sparse(path, b"name: x\n", GIB)
    proc = _cli(["validate", str(path)], tmp_path, GIB)
    _one_line(proc, {"dev_zero": "is a device; scenarios must be regular files",
                     "fifo": "is a FIFO; scenarios must be regular files",
                     "huge": "the scenario file is larger than"}[kind])


def test_size_arguments_have_caps(tmp_path):
    s = _scenario(tmp_path, "{name: digits}")
    steps = ",".join(str(i) for i in range(1, 1002))
    _one_line(_cli(["run", str(s), "--steps", "2000", "--trace", str(tmp_path / "t.json"),
                    "--trace-steps", steps], tmp_path, 2 * GIB),
              "--trace-steps", "at most 1,000 steps can be traced")
    proc = _cli(["generate", str(tmp_path), "--length", "1000000000"], tmp_path, GIB)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "1000000000 is not in the range 1<=x<=100000" in proc.stderr

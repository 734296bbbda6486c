"""The mutation test of scenarios (``test_mutations.py``), extended to what else a user
hands the tool: the CLI's arguments, data files and checkpoints (issue 26, item 7).

- CLI: hypothesis builds a command line of ``validate``, ``describe``, ``matmul``,
  ``collective``, ``generate`` or ``export`` with hostile option values and paths (a
  FIFO, ``/dev/zero``, a directory, a corrupt file, ``..``, NUL, huge numbers) and runs
  ``pod.cli.main`` in this process: exit 0, or exit 2 with one line on stderr; never a
  traceback; bounded CPU.
- Data: .npz archives for imdb and mnist with arrays of hostile dtypes, shapes and
  values, and IDX files with flipped or cut bytes: the loader returns a dataset whose
  labels are in range, or raises one ``ValueError``; nothing else.
- Checkpoints: a valid checkpoint's bytes flipped or cut, and its body's fields replaced
  by hostile values under a correct checksum (so the parser, not the checksum, meets
  them): ``load_checkpoint`` returns or raises ``CheckpointError``; nothing else.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import struct
import time
import traceback
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pod.errors import CheckpointError
from pod.state.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from pod.workloads import load_dataset

ROOT = Path(__file__).resolve().parents[3]
CPU_SECONDS = 10.0

NUMBERS = ["-1", "0", "1", "3", "4096", "2147483648", "9223372036854775808", "1e30", "nan",
           "inf", "-inf", "0.5", "", " ", "x", "1,2", "1KiB:1GiB", "1:0", "8GiB", "1TiB:1PiB"]
WORDS = ["", "v2", "v4", "v9", "bf16", "fp32", "int8", "fp8", "ring", "torus", "no-such",
         "2x2", "4x4x4", "0x4", "8", "..", "nul\x00byte", "é✓", "x" * 3000, "-h"]


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    """Hostile paths: missing, a FIFO, a device, a directory, garbage, a valid scenario."""
    work = tmp_path_factory.mktemp("cli-mutations")
    fifo = work / "fifo.msgpack"
    os.mkfifo(fifo)
    (work / "garbage.msgpack").write_bytes(os.urandom(300))
    (work / "dir").mkdir()
    scenario = work / "quick.yaml"
    scenario.write_text((ROOT / "scenarios" / "quickstart.yaml").read_text())
    return {"missing": str(work / "missing.yaml"), "fifo": str(fifo), "zero": "/dev/zero",
            "dir": str(work / "dir"), "garbage": str(work / "garbage.msgpack"),
            "scenario": str(scenario), "dots": "..", "nul": "a\x00b", "out": str(work / "o.st")}


@st.composite
def command_lines(draw, paths: dict[str, str]) -> list[str]:
    word, number = st.sampled_from(WORDS), st.sampled_from(NUMBERS)
    path = st.sampled_from(sorted(paths.values()))
    command = draw(st.sampled_from(["validate", "describe", "matmul", "collective", "generate",
                                    "export"]))
    options = {
        "validate": [("--json", None)],
        "describe": [("--json", None), ("--detail", None)],
        "matmul": [("--chip", word), ("--m", number), ("--k", number), ("--n", number),
                   ("--precision", word), ("--mxu-model", word), ("--json", None)],
        "collective": [("--chip", word), ("--topology", word), ("--op", word),
                       ("--algorithm", word), ("--sizes", number), ("--json", None)],
        "generate": [("--length", number), ("--prompt", word), ("--temperature", number),
                     ("--seed", number)],
        "export": [("--output", path), ("--format", word), ("--optimizer-state", None)],
    }[command]
    args = [command]
    if command in ("validate", "generate", "export"):
        args.append(draw(path))
    elif command == "describe":
        args.append(draw(st.one_of(path, word)))
    for name, values in draw(st.lists(st.sampled_from(options), max_size=4)):
        args.append(name)
        if values is not None:
            args.append(draw(values))
    return args


def _main(args: list[str]) -> tuple[Any, str, str, float]:
    from pod.cli import main

    out, err = io.StringIO(), io.StringIO()
    code: Any = None
    cpu = time.process_time()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(args)
        except SystemExit as exit_:
            code = exit_.code
        except BaseException:  # noqa: BLE001 - a traceback is what this test looks for
            err.write(traceback.format_exc())
    return code, out.getvalue(), err.getvalue(), time.process_time() - cpu


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_hostile_command_line_is_ok_or_one_line(paths, data):
    args = data.draw(command_lines(paths))
    code, stdout, stderr, cpu = _main(args)
    what = " ".join(repr(a)[:60] for a in args)
    assert "Traceback" not in stderr + stdout, f"{what}: traceback:\n{stderr[-3000:]}"
    assert cpu < CPU_SECONDS, f"{what}: {cpu:.1f} s of CPU"
    if code in (0, None):
        return
    if args[0] == "validate" and "--json" in args and not stderr.strip():
        assert code == 2 and json.loads(stdout)[0]["ok"] is False  # the error is in the JSON
        return
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, f"{what}: exit {code}, stderr:\n{stderr[-3000:]}"
    assert len(lines[0]) < 1500, f"{what}: a {len(lines[0])}-character line"


# ---- data loaders -------------------------------------------------------------------

DTYPES = ["uint8", "int8", "int32", "int64", "float32", "float64", "bool", "complex64"]


@st.composite
def arrays(draw) -> np.ndarray:
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=0, max_size=3)))
    values = draw(st.sampled_from([0, 1, -1, 2, 0.5, 1.5, 255, -(2**31), 2**40, math.nan]))
    with np.errstate(all="ignore"):
        return np.full(shape, values).astype(dtype)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(["imdb", "mnist"]), data=st.data())
def test_a_hostile_npz_loads_in_range_or_is_one_value_error(tmp_path, name, data):
    keys = ["x_train", "y_train", "x_test", "y_test"]
    drop = data.draw(st.sets(st.sampled_from(keys), max_size=1))
    members = {k: data.draw(arrays()) for k in keys if k not in drop}
    path = tmp_path / f"{name}.npz"
    np.savez(path, **members)
    try:
        ds = load_dataset(name, path=path, **({"num_words": 50, "maxlen": 4}
                                               if name == "imdb" else {}))
    except ValueError as err:
        assert "\n" not in str(err) and str(err)
        return
    for y in (ds.y_train, ds.y_test):
        assert y.dtype.kind in "iu" and (y.size == 0 or 0 <= y.min() <= y.max() < ds.num_classes)
    if name == "imdb":
        for x in (ds.x_train, ds.x_test):
            assert x.size == 0 or 0 <= x.min() <= x.max() < 50


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_damaged_idx_file_is_one_value_error(tmp_path, data):
    from pod.workloads.files import read_idx

    raw = bytearray(struct.pack(">BBBBIII", 0, 0, 8, 3, 2, 3, 3) + bytes(range(18)))
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    path = tmp_path / "x-idx3-ubyte"
    path.write_bytes(bytes(raw[:cut]))
    try:
        read_idx(path)
    except ValueError as err:
        assert "\n" not in str(err)


# ---- checkpoints --------------------------------------------------------------------

HOSTILE_VALUES: list[Any] = [None, -1, 2**64 - 1, 1.5, math.nan, "", "x" * 1000, b"\x00" * 8, [],
                             {}, [1, [2, [3]]], {"w": 1}, {"w": {"dtype": "float32",
                                                              "shape": [2**40], "data": b""}},
                             {"w": {"dtype": "object", "shape": [1], "data": b"x"}},
                             {"w": {"dtype": "<f4", "shape": [-1], "data": b"\x00" * 4}}]
FIELDS = ["step", "scenario", "params", "model_state", "optimizer_state", "replica_model_state",
          "rng", "data_position", "digests", "run_state", "extra"]


@pytest.fixture(scope="module")
def checkpoint_bytes(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("ck") / "ckpt-00000001.msgpack"
    save_checkpoint(path, Checkpoint(step=1, scenario={"name": "x"},
                                     params={"w": np.arange(6, dtype=np.float32).reshape(2, 3)},
                                     optimizer_state={"w/m": np.zeros((2, 3), np.float32)}))
    return path.read_bytes()


def _load(tmp_path: Path, raw: bytes) -> None:
    path = tmp_path / "ckpt-00000001.msgpack"
    path.write_bytes(raw)
    try:
        load_checkpoint(path)
    except CheckpointError as err:
        assert "\n" not in str(err)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_damaged_checkpoint_loads_or_is_one_checkpoint_error(tmp_path, checkpoint_bytes, data):
    raw = bytearray(checkpoint_bytes)
    for _ in range(data.draw(st.integers(0, 3))):
        raw[data.draw(st.integers(0, len(raw) - 1))] ^= data.draw(st.integers(1, 255))
    _load(tmp_path, bytes(raw[:data.draw(st.integers(0, len(raw)))]))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(FIELDS), value=st.sampled_from(HOSTILE_VALUES))
def test_a_hostile_body_under_a_good_checksum_is_one_checkpoint_error(tmp_path, checkpoint_bytes,
                                                                      field, value):
    outer = msgpack.unpackb(checkpoint_bytes, raw=False)
    body = msgpack.unpackb(outer["body"], raw=False)
    body[field] = value
    packed = msgpack.packb(body, use_bin_type=True)
    outer.update(body=packed, sha256=hashlib.sha256(packed).hexdigest())
    _load(tmp_path, msgpack.packb(outer, use_bin_type=True))

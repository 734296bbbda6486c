"""`tpu-pod export CHECKPOINT --format safetensors`: the file safetensors' own loader
reads back holds the checkpoint's arrays bit for bit, under their names; and the
format itself is what the safetensors spec says (an 8-byte header length, a JSON
header of dtypes, shapes and offsets), checked by hand with struct and json."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from pod.state.checkpoint import Checkpoint, checkpoint_path, save_checkpoint
from tests.pod.commands.test_cli import tpu_pod


def _checkpoint(directory, step):
    rng = np.random.default_rng(step)
    ck = Checkpoint(step=step, scenario={"name": "exp", "model": {"name": "mlp"}},
                    params={"dense1/kernel": rng.standard_normal((8, 4), dtype=np.float32),
                            "dense1/bias": rng.standard_normal(4, dtype=np.float32)},
                    model_state={"bn1/moving_mean": np.full(4, 0.25, np.float32)},
                    optimizer_state={"dense1/kernel/m": np.ones((8, 4), np.float32)})
    save_checkpoint(checkpoint_path(directory, step), ck)
    return ck


def test_export_safetensors_round_trips_through_safetensors_load_file(tmp_path):
    from safetensors import safe_open
    from safetensors.numpy import load_file

    folder = tmp_path / "checkpoints"
    _checkpoint(folder, 2)
    newest = _checkpoint(folder, 4)
    out = tpu_pod("export", str(folder), "--format", "safetensors")
    assert out.returncode == 0, out.stderr
    path = folder / "ckpt-00000004.safetensors"   # the newest checkpoint of the directory
    assert str(path) in out.stdout and "3 tensors" in out.stdout
    loaded = load_file(path)
    assert set(loaded) == {"dense1/kernel", "dense1/bias", "bn1/moving_mean"}
    for name, array in {**newest.params, **newest.model_state}.items():
        assert loaded[name].dtype == array.dtype and loaded[name].tobytes() == array.tobytes()
    with safe_open(str(path), framework="np") as f:
        assert f.metadata() == {"format": "np", "step": "4", "scenario": "exp", "model": "mlp"}

    # the layout by hand (the safetensors spec): u64 header size, JSON header, raw bytes
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + size])
    entry = header["dense1/kernel"]
    assert entry["dtype"] == "F32" and entry["shape"] == [8, 4]
    begin, end = entry["data_offsets"]
    body = raw[8 + size:]
    np.testing.assert_array_equal(np.frombuffer(body[begin:end], "<f4").reshape(8, 4),
                                  newest.params["dense1/kernel"])

    mine = tmp_path / "w.safetensors"
    out = tpu_pod("export", str(checkpoint_path(folder, 2)), "--output", str(mine),
                  "--optimizer-state")
    assert out.returncode == 0, out.stderr
    assert "optimizer/dense1/kernel/m" in load_file(mine)


@pytest.mark.parametrize("args, needle", [
    (["--format", "onnx"], "'onnx' is not 'safetensors'"),
    ([], "no valid checkpoint"),
])
def test_export_errors_are_one_line(tmp_path, args, needle):
    out = tpu_pod("export", str(tmp_path), *args)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and needle in out.stderr, out.stderr

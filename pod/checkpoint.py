"""Checkpoints in msgpack: no pickle, so a checkpoint from a stranger cannot run code.

A minimal first version (issue 8, for ``tpu-pod generate``); issue 7 extends
it (periodic checkpoints, resume, random generator states, keeping the last K).

File layout: one msgpack map ``{"format": "tpu-pod-checkpoint", "version": 1,
"sha256": <hex digest of body>, "body": <bytes>}``; ``body`` is itself a
msgpack map::

    step            int, optimizer steps done
    scenario        the scenario as plain data (``Scenario.model_dump()``)
    params          {name: array}   the trainable parameters
    model_state     {name: array}   non-trainable state (BatchNorm running averages)
    optimizer_state {name: array}
    extra           plain data (e.g. a text model's vocabulary)

and every array is ``{"dtype": "float32", "shape": [..], "data": <raw bytes,
C order, little-endian>}``; only numeric and boolean dtypes are accepted.
Writing goes to a temporary file in the same directory, is flushed to disk,
then renamed over the target (atomic on POSIX), so a reader never sees half
a checkpoint. Reading verifies the checksum first.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from pod.errors import EmulatorError

__all__ = ["Checkpoint", "CheckpointError", "save_checkpoint", "load_checkpoint", "FORMAT", "VERSION"]

FORMAT = "tpu-pod-checkpoint"
VERSION = 1
_KINDS = "biuf"  # bool, signed / unsigned integers, floats


class CheckpointError(EmulatorError, ValueError):
    """A checkpoint is missing, truncated, corrupted or of an unknown format."""


@dataclass(frozen=True)
class Checkpoint:
    """The training state a checkpoint holds (arrays are read-only copies).

    Attributes:
        step: optimizer steps done.
        scenario: the scenario as plain data (``Scenario.model_dump()``).
        params: trainable parameters, name -> array.
        model_state: non-trainable state, name -> array.
        optimizer_state: optimizer slots, name -> array.
        extra: other plain data (str, numbers, lists, dicts).
    """

    step: int
    scenario: dict[str, Any]
    params: dict[str, np.ndarray]
    model_state: dict[str, np.ndarray] = field(default_factory=dict)
    optimizer_state: dict[str, np.ndarray] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


def _pack_array(name: str, a: np.ndarray) -> dict[str, Any]:
    a = np.asarray(a)
    if a.dtype.kind not in _KINDS:
        raise CheckpointError(f"{name}: dtype {a.dtype} cannot go in a checkpoint "
                              "(numbers and booleans only)")
    a = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))
    return {"dtype": a.dtype.name, "shape": list(a.shape), "data": a.tobytes()}


def _unpack_array(source: str, name: str, d: Any) -> np.ndarray:
    try:
        dtype = np.dtype(d["dtype"]).newbyteorder("<")
        shape = tuple(int(v) for v in d["shape"])
        data = d["data"]
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{source}: array {name!r} is malformed ({err})") from None
    if dtype.kind not in _KINDS or not isinstance(data, bytes):
        raise CheckpointError(f"{source}: array {name!r} has dtype {d['dtype']!r}; "
                              "numbers and booleans only")
    if len(data) != int(np.prod(shape)) * dtype.itemsize:
        raise CheckpointError(f"{source}: array {name!r} of shape {shape} and dtype {dtype} "
                              f"needs {int(np.prod(shape)) * dtype.itemsize} bytes, has {len(data)}")
    out = np.frombuffer(data, dtype).reshape(shape).astype(dtype.newbyteorder("="))
    out.flags.writeable = False
    return out


def save_checkpoint(path: str | Path, checkpoint: Checkpoint) -> Path:
    """Writes ``checkpoint`` to ``path`` atomically (temp file + rename).

    Args:
        path: the checkpoint file; its directory is created if needed.
        checkpoint: what to write.

    Returns:
        The path written.

    Raises:
        CheckpointError: an array of a dtype that cannot be stored.
        OSError: the file cannot be written.
    """
    path = Path(path)
    body = msgpack.packb({
        "step": int(checkpoint.step),
        "scenario": checkpoint.scenario,
        "params": {k: _pack_array(k, v) for k, v in checkpoint.params.items()},
        "model_state": {k: _pack_array(k, v) for k, v in checkpoint.model_state.items()},
        "optimizer_state": {k: _pack_array(k, v) for k, v in checkpoint.optimizer_state.items()},
        "extra": checkpoint.extra,
    }, use_bin_type=True)
    blob = msgpack.packb({"format": FORMAT, "version": VERSION,
                          "sha256": hashlib.sha256(body).hexdigest(), "body": body},
                         use_bin_type=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Reads and verifies a checkpoint.

    Raises:
        CheckpointError: missing file, not a checkpoint, unknown version, a
            checksum that does not match (truncated or corrupted), or a
            malformed array; one line naming the file.
    """
    path = Path(path)
    source = str(path)
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise CheckpointError(f"{source}: cannot read the checkpoint ({err.strerror})") from None
    try:
        outer = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except (msgpack.UnpackException, ValueError) as err:
        raise CheckpointError(f"{source}: not a checkpoint, or truncated ({err})") from None
    if not isinstance(outer, dict) or outer.get("format") != FORMAT:
        raise CheckpointError(f"{source}: not a {FORMAT} file")
    if outer.get("version") != VERSION:
        raise CheckpointError(f"{source}: checkpoint version {outer.get('version')!r}; "
                              f"this emulator reads version {VERSION}")
    body = outer.get("body")
    if not isinstance(body, bytes) or hashlib.sha256(body).hexdigest() != outer.get("sha256"):
        raise CheckpointError(f"{source}: checksum mismatch: the checkpoint is corrupted")
    content = msgpack.unpackb(body, raw=False)
    arrays = {kind: {k: _unpack_array(source, k, v) for k, v in content.get(kind, {}).items()}
              for kind in ("params", "model_state", "optimizer_state")}
    return Checkpoint(step=int(content["step"]), scenario=content["scenario"],
                      extra=content.get("extra") or {}, **arrays)


def pod_checkpoint(pod, plan, step: int) -> Checkpoint:
    """The training state of a running ``pod.coordinator.Pod``: chip 0, core 0's
    parameters and optimizer state (every replica holds the same), the mean of
    the replicas' model state, and what ``tpu-pod generate`` needs in ``extra``."""
    model, data = plan.model, plan.dataset
    extra = {"model": model.name, "input_shape": list(model.input_shape),
             "num_classes": model.num_classes, "dataset": data.name,
             "vocabulary": data.vocabulary}
    state = pod.model_state_mean() if model.state_shapes else {}
    return Checkpoint(step=int(step), scenario=plan.scenario.model_dump(mode="json"),
                      params=pod.params(), model_state=state,
                      optimizer_state=pod.optimizer_state(), extra=extra)

"""Checkpoints in msgpack: no pickle, so a checkpoint from a stranger cannot run code.

The complete training state of a run (issue 7): a run with ``checkpoint:
{every_steps: N, dir: D, keep: K}`` writes ``D/ckpt-<step>.msgpack`` after
every N-th step and at the end, keeps the newest K, and ``tpu-pod run
--resume D`` continues from the newest one whose checksum holds (a corrupted
or truncated one is skipped with a warning naming it).

File layout: one msgpack map ``{"format": "tpu-pod-checkpoint", "version": 2,
"sha256": <hex digest of body>, "body": <bytes>}``; ``body`` is itself a
msgpack map::

    step            int, optimizer steps done (the next step to run, zero-based)
    scenario        the scenario as plain data (``Scenario.model_dump()``)
    params          {name: array}   the trainable parameters (every replica's:
                                    they are bit-identical, checked when saving)
    model_state     {name: array}   non-trainable state (BatchNorm running
                                    averages), the mean over the replicas
    optimizer_state {name: array}   (every replica's, checked identical too)
    replica_model_state [[{name: array}]]  [chip][device]: each replica's own model
                                    state (they differ: each sees its own shards)
    rng             plain data: the random generators. None carries state from
                    step to step: dropout masks of (step, chip, core) come from
                    ``default_rng([seed, step, chip, core])``, the data order of
                    an epoch from ``default_rng([seed, epoch]).permutation(N)``,
                    initial parameters from ``seed``; so the seed and the step
                    are the whole generator state, and both are stored.
    data_position   plain data: epoch, batch index in the epoch, train examples,
                    global batch (checked on resume)
    digests         sha256 of the parameters and of the optimizer state
    run_state       plain data the run needs to continue its summary exactly
                    (running sums, faults already injected)
    extra           plain data (e.g. a text model's vocabulary)

Version 1 files (parameters, model state, optimizer state, step, scenario,
extra) are still read.

and every array is ``{"dtype": "float32", "shape": [..], "data": <raw bytes,
C order, little-endian>}``; only numeric and boolean dtypes are accepted.
Writing goes to a temporary file in the same directory, is flushed to disk,
then renamed over the target (atomic on POSIX), so a reader never sees half
a checkpoint. Reading verifies the checksum first.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from pod.errors import CheckpointError
from pod.safe_io import read_regular, write_atomic

__all__ = ["Checkpoint", "save_checkpoint", "load_checkpoint", "FORMAT", "VERSION",
           "checkpoint_path", "list_checkpoints", "latest_checkpoint", "prune_checkpoints",
           "params_digest", "newest_valid_checkpoint", "mean_replica_state"]

FORMAT = "tpu-pod-checkpoint"
VERSION = 2
_READABLE_VERSIONS = (1, 2)
#: Largest checkpoint file read, in bytes (a checkpoint is read whole: a file named
#: like one that is larger, or ``/dev/zero``, is one line instead of filling memory).
#: The emulator's largest shipped model checkpoints in tens of megabytes.
MAX_CHECKPOINT_BYTES = 4 << 30
_NAME_RE = re.compile(r"^ckpt-(\d{8,})\.msgpack$")
_KINDS = "biuf"  # bool, signed / unsigned integers, floats


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
        replica_model_state: per [chip][device of the chip], that replica's model state.
        rng: how every random generator is derived, and its seed.
        data_position: epoch, index (batch in the epoch), num_examples,
            global_batch.
        digests: ``params`` and ``optimizer_state`` SHA-256 (``params_digest``).
        run_state: what the run needs to continue its summary and fault list.
    """

    step: int
    scenario: dict[str, Any]
    params: dict[str, np.ndarray]
    model_state: dict[str, np.ndarray] = field(default_factory=dict)
    optimizer_state: dict[str, np.ndarray] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    replica_model_state: list[list[dict[str, np.ndarray]]] = field(default_factory=list)
    rng: dict[str, Any] = field(default_factory=dict)
    data_position: dict[str, Any] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)
    run_state: dict[str, Any] = field(default_factory=dict)


def params_digest(arrays: dict[str, np.ndarray]) -> str:
    """SHA-256 over the arrays' raw bytes in dict order (``ChipActor.digests`` does the same)."""
    h = hashlib.sha256()
    for v in arrays.values():
        h.update(np.ascontiguousarray(v).tobytes())
    return h.hexdigest()


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
    # math.prod of Python ints: a declared shape whose product overflows int64 (np.prod
    # wraps it to 0) cannot pass for an empty array
    need = math.prod(shape) * dtype.itemsize if all(v >= 0 for v in shape) else -1
    if len(data) != need:
        raise CheckpointError(f"{source}: array {name!r} of shape {shape} and dtype {dtype} "
                              f"needs {need:,} bytes, has {len(data):,}")
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
        OutputError: the file cannot be written (no space, read-only file
            system, no permission); one line naming it.
    """
    path = Path(path)
    body = msgpack.packb({
        "step": int(checkpoint.step),
        "scenario": checkpoint.scenario,
        "params": {k: _pack_array(k, v) for k, v in checkpoint.params.items()},
        "model_state": {k: _pack_array(k, v) for k, v in checkpoint.model_state.items()},
        "optimizer_state": {k: _pack_array(k, v) for k, v in checkpoint.optimizer_state.items()},
        "replica_model_state": [[{k: _pack_array(k, v) for k, v in core.items()} for core in chip]
                                for chip in checkpoint.replica_model_state],
        "rng": checkpoint.rng,
        "data_position": checkpoint.data_position,
        "digests": checkpoint.digests,
        "run_state": checkpoint.run_state,
        "extra": checkpoint.extra,
    }, use_bin_type=True)
    blob = msgpack.packb({"format": FORMAT, "version": VERSION,
                          "sha256": hashlib.sha256(body).hexdigest(), "body": body},
                         use_bin_type=True)
    write_atomic(path, lambda f: f.write(blob), binary=True, make_parents=True)
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
        raw = read_regular(path, MAX_CHECKPOINT_BYTES, "checkpoints")
    except ValueError as err:
        raise CheckpointError(str(err)) from None
    try:
        outer = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except (msgpack.UnpackException, ValueError) as err:
        raise CheckpointError(f"{source}: not a checkpoint, or truncated ({err})") from None
    if not isinstance(outer, dict) or outer.get("format") != FORMAT:
        raise CheckpointError(f"{source}: not a {FORMAT} file")
    if outer.get("version") not in _READABLE_VERSIONS:
        raise CheckpointError(f"{source}: checkpoint version {outer.get('version')!r}; "
                              f"this emulator reads versions {_READABLE_VERSIONS}")
    body = outer.get("body")
    if not isinstance(body, bytes) or hashlib.sha256(body).hexdigest() != outer.get("sha256"):
        raise CheckpointError(f"{source}: checksum mismatch: the checkpoint is corrupted")
    try:
        content = msgpack.unpackb(body, raw=False)
        arrays = {kind: {k: _unpack_array(source, k, v) for k, v in content.get(kind, {}).items()}
                  for kind in ("params", "model_state", "optimizer_state")}
        replicas = [[{k: _unpack_array(source, k, v) for k, v in core.items()} for core in chip]
                    for chip in content.get("replica_model_state") or []]
        return Checkpoint(step=int(content["step"]), scenario=content["scenario"],
                          extra=content.get("extra") or {}, replica_model_state=replicas,
                          rng=content.get("rng") or {},
                          data_position=content.get("data_position") or {},
                          digests=content.get("digests") or {},
                          run_state=content.get("run_state") or {}, **arrays)
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, msgpack.UnpackException) as err:
        raise CheckpointError(f"{source}: malformed checkpoint body ({err})") from None


def checkpoint_path(directory: str | Path, step: int) -> Path:
    """``directory/ckpt-<step, 8 digits>.msgpack``: names sort in step order."""
    return Path(directory) / f"ckpt-{int(step):08d}.msgpack"


def list_checkpoints(directory: str | Path) -> list[tuple[int, Path]]:
    """The ``ckpt-<step>.msgpack`` files of a directory as (step, path), newest first.

    Only names are read (no file is opened); a missing directory has none.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir()
             if p.is_file() and (m := _NAME_RE.match(p.name))]
    return sorted(found, reverse=True)


def newest_valid_checkpoint(directory: str | Path, warn: Callable[[str], None] | None = None
                            ) -> tuple[Path, Checkpoint] | None:
    """Like ``latest_checkpoint``, with the file it came from: (path, checkpoint) or None."""
    for _, path in list_checkpoints(directory):
        try:
            return path, load_checkpoint(path)
        except CheckpointError as err:
            if warn is not None:
                warn(f"warning: skipping checkpoint {path}: {err}")
    return None


def latest_checkpoint(directory: str | Path,
                      warn: Callable[[str], None] | None = None) -> Checkpoint | None:
    """The newest checkpoint of ``directory`` that reads back whole.

    A file that fails its checksum (truncated, corrupted) or is not a
    checkpoint is skipped, and ``warn`` is called with one line naming it;
    the one before it is tried next. Nothing is deleted.

    Args:
        directory: a checkpoint directory (``checkpoint.dir``).
        warn: called once per skipped file (default: ignore).

    Returns:
        The checkpoint, or None when the directory has no valid one.
    """
    found = newest_valid_checkpoint(directory, warn)
    return found[1] if found else None


def prune_checkpoints(directory: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoint files (by step in the name).

    Args:
        directory: the checkpoint directory.
        keep: how many to keep, >= 1.

    Returns:
        The files removed.

    Raises:
        ValueError: keep < 1 (the newest is never removed).
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    removed = []
    for _, path in list_checkpoints(directory)[keep:]:
        path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def mean_replica_state(replicas: list[list[dict[str, np.ndarray]]] | list[dict[str, np.ndarray]],
                       names: Any) -> dict[str, np.ndarray]:
    """The mean over every replica of the model state (BatchNorm running averages),
    float32, averaged in float64: what evaluation and checkpoints use, as Keras
    reads a sync-on-read MEAN variable outside the replicas.

    Args:
        replicas: per replica (or per [chip][core]) a {name: array} dict.
        names: the state's names (``Model.state_shapes``).
    """
    flat = [s for group in replicas for s in (group if isinstance(group, list) else [group])]
    # np.asarray: an array as annotated (np.mean's stub also allows a scalar)
    return {k: np.asarray(np.mean([s[k] for s in flat], axis=0,
                                  dtype=np.float64).astype(np.float32))
            for k in names}

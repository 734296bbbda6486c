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
    replica_model_state [[{name: array}]]  [chip][core]: each replica's own model
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
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import msgpack
import numpy as np

from pod.errors import EmulatorError

__all__ = ["Checkpoint", "CheckpointError", "save_checkpoint", "load_checkpoint", "FORMAT",
           "VERSION", "checkpoint_path", "list_checkpoints", "latest_checkpoint",
           "prune_checkpoints", "pod_checkpoint", "initial_checkpoint", "params_digest",
           "newest_valid_checkpoint", "check_compatible", "resume_checkpoint", "RunCheckpoints"]

FORMAT = "tpu-pod-checkpoint"
VERSION = 2
_READABLE_VERSIONS = (1, 2)
_NAME_RE = re.compile(r"^ckpt-(\d{8,})\.msgpack$")
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
        replica_model_state: per [chip][core], that replica's model state.
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


def _rng_and_position(plan, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
    seed = plan.scenario.training.seed
    n = int(plan.dataset.x_train.shape[0])
    per_epoch = n // plan.global_batch
    epoch, index = divmod(int(step), per_epoch)
    rng = {"seed": int(seed), "bit_generator": "PCG64 (numpy default_rng)",
           "dropout": "default_rng([seed, step, chip, core]) per step and TensorCore",
           "data_order": "default_rng([seed, epoch]).permutation(num_examples) per epoch",
           "init": "model.init_params(seed)",
           "carried_state": "none: every generator is derived from (seed, step)"}
    position = {"epoch": epoch, "index": index, "num_examples": n,
                "global_batch": int(plan.global_batch), "steps_per_epoch": per_epoch}
    return rng, position


def _extra(plan) -> dict[str, Any]:
    model, data = plan.model, plan.dataset
    return {"model": model.name, "input_shape": list(model.input_shape),
            "num_classes": model.num_classes, "dataset": data.name,
            "vocabulary": data.vocabulary}


def initial_checkpoint(plan) -> Checkpoint:
    """The state every replica starts from (step 0), built in the driver from the seed.

    Used to restore a pod that loses a chip before its first checkpoint.
    """
    from pod.workloads import build_optimizer

    training = plan.scenario.training
    params = plan.model.init_params(training.seed)
    opt = build_optimizer(training.optimizer.name, **training.optimizer.options())
    opt_state = opt.init(params)
    replicas = [[plan.model.init_state() for _ in range(plan.pod.chip.tensorcores)]
                for _ in range(plan.pod.chips)]
    rng, position = _rng_and_position(plan, 0)
    return Checkpoint(step=0, scenario=plan.scenario.model_dump(mode="json"), params=params,
                      model_state=plan.model.init_state(), optimizer_state=opt_state,
                      extra=_extra(plan), replica_model_state=replicas, rng=rng,
                      data_position=position,
                      digests={"params": params_digest(params),
                               "optimizer_state": params_digest(opt_state)})


def pod_checkpoint(pod, plan, step: int, run_state: dict[str, Any] | None = None) -> Checkpoint:
    """The complete training state of a running ``pod.coordinator.Pod`` after ``step`` steps.

    Every replica's parameters and optimizer state are hashed in its actor and
    compared: one copy (chip 0, core 0) is stored only because they are
    bit-identical. Each replica's model state is stored (they differ), and
    their mean as ``model_state`` (what evaluation and ``tpu-pod generate`` use).

    Args:
        pod: a started ``Pod``.
        plan: its training plan.
        step: optimizer steps done.
        run_state: plain data for the run (summary sums, faults done).

    Raises:
        CheckpointError: the replicas differ (a checkpoint of one of them would
            silently drop the others); names the first differing chip and core.
    """
    snap = pod.snapshot()
    first = snap["digests"][0][0]
    for chip, per_core in enumerate(snap["digests"]):
        for core, digest in enumerate(per_core):
            if digest != first:
                raise CheckpointError(f"step {step}: chip {chip} core {core} differs from chip 0 "
                                      f"core 0 ({digest[0][:12]} != {first[0][:12]}); replicas are not "
                                      "bit-identical, refusing to checkpoint one of them")
    replicas = snap["model_state"]
    names = list(plan.model.state_shapes)
    flat = [s for chip in replicas for s in chip]
    mean = {k: np.mean([s[k] for s in flat], axis=0, dtype=np.float64).astype(np.float32)
            for k in names}
    rng, position = _rng_and_position(plan, step)
    return Checkpoint(step=int(step), scenario=plan.scenario.model_dump(mode="json"),
                      params=snap["params"], model_state=mean,
                      optimizer_state=snap["optimizer_state"], extra=_extra(plan),
                      replica_model_state=replicas, rng=rng, data_position=position,
                      digests={"params": first[0], "optimizer_state": first[1]},
                      run_state=dict(run_state or {}))


#: scenario keys that may differ between a checkpoint and the run that resumes it
_RESUMABLE_CHANGES = {"training": ("steps", "epochs", "eval_every_steps"), "data": ("path",)}


def check_compatible(checkpoint: Checkpoint, plan, source: str = "checkpoint") -> None:
    """Refuse to continue a run from a checkpoint of a different one.

    The pod, model, data and training (except the length and evaluation
    interval, and where the data file lives) must be those of the
    checkpoint's scenario; so must the data order (train examples, batch).

    Raises:
        CheckpointError: one line naming the first differing key and both values.
    """
    mine = plan.scenario.model_dump(mode="json")
    theirs = checkpoint.scenario or {}
    for section in ("pod", "model", "data", "training"):
        skip = _RESUMABLE_CHANGES.get(section, ())
        a = {k: v for k, v in (mine.get(section) or {}).items() if k not in skip}
        b = {k: v for k, v in (theirs.get(section) or {}).items() if k not in skip}
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                raise CheckpointError(f"{source}: {section}.{key} is {b.get(key)!r} in the checkpoint "
                                      f"but {a.get(key)!r} in the scenario; a checkpoint continues "
                                      "only the run it came from")
    position = checkpoint.data_position
    n = int(plan.dataset.x_train.shape[0])
    if position and position.get("num_examples") != n:
        raise CheckpointError(f"{source}: the checkpoint's data order is over "
                              f"{position.get('num_examples')} train examples, this data set has {n}")


def resume_checkpoint(directory: str | Path, plan,
                      warn: Callable[[str], None] | None = None) -> tuple[Path, Checkpoint]:
    """The checkpoint ``tpu-pod run --resume DIR`` continues from.

    Args:
        directory: the checkpoint directory.
        plan: the run's plan (checked against the checkpoint).
        warn: called for every newer checkpoint skipped as corrupted.

    Returns:
        (path, checkpoint) of the newest valid one.

    Raises:
        CheckpointError: not a directory, no valid checkpoint in it, a checkpoint
            of another scenario, or one past the run's last step.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"--resume: {directory} is not a directory")
    found = newest_valid_checkpoint(directory, warn)
    if found is None:
        raise CheckpointError(f"--resume: no valid checkpoint (ckpt-<step>.msgpack) in {directory}")
    path, checkpoint = found
    check_compatible(checkpoint, plan, source=f"--resume {path}")
    if checkpoint.step > plan.steps:
        raise CheckpointError(f"--resume {path}: the checkpoint is at step {checkpoint.step}, past "
                              f"training.steps {plan.steps}")
    return path, checkpoint


class RunCheckpoints:
    """The checkpoints of one run, per the scenario's ``checkpoint:`` block.

    Args:
        plan: the run's plan (``plan.scenario.checkpoint`` must be set).
        output_dir: the run's output directory (default home of the checkpoints).
        resume_dir: the directory ``--resume`` continues from, if any.

    Raises:
        CheckpointError: the directory already holds checkpoints of an earlier
            run that this run does not continue (they would be mixed with, and
            pruned in favour of, the new ones; nothing is overwritten silently).
    """

    def __init__(self, plan, output_dir: Path, resume_dir: Path | None = None) -> None:
        config = plan.scenario.checkpoint
        self.dir = Path(config.dir) if config.dir else Path(output_dir) / "checkpoints"
        self.every_steps, self.keep = config.every_steps, config.keep
        self.written: list[Path] = []
        self.last_step: int | None = None
        self.wall_seconds = 0.0
        existing = list_checkpoints(self.dir)
        same = resume_dir is not None and Path(resume_dir).resolve() == self.dir.resolve()
        if existing and not same:
            raise CheckpointError(
                f"checkpoint.dir: {self.dir} already holds {len(existing)} checkpoint(s) of an earlier "
                f"run (newest: step {existing[0][0]}); continue it with --resume {self.dir}, or move "
                "them away or choose another dir (they are never overwritten by a new run)")

    def due(self, steps_done: int, total_steps: int) -> bool:
        """True after every ``every_steps``-th step and after the last one."""
        return steps_done % self.every_steps == 0 or steps_done == total_steps

    def save(self, pod, plan, step: int, run_state: dict[str, Any]) -> Path:
        """Write the pod's state after ``step`` steps, then keep the newest ``keep``."""
        import time

        t0 = time.perf_counter()
        path = save_checkpoint(checkpoint_path(self.dir, step),
                               pod_checkpoint(pod, plan, step, run_state))
        self.written.append(path)
        self.last_step = step
        prune_checkpoints(self.dir, self.keep)
        self.wall_seconds += time.perf_counter() - t0
        return path

    def restore_point(self, plan, fallback: Checkpoint | None = None,
                      warn: Callable[[str], None] | None = None) -> Checkpoint:
        """What a pod that lost chips goes back to: the newest valid checkpoint this
        run wrote (a corrupted one is skipped with a warning), else ``fallback``
        (the checkpoint it resumed from), else the initial state."""
        for path in reversed(self.written):
            if not path.exists():
                continue
            try:
                return load_checkpoint(path)
            except CheckpointError as err:
                if warn is not None:
                    warn(f"warning: skipping checkpoint {path}: {err}")
        return fallback if fallback is not None else initial_checkpoint(plan)

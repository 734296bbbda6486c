"""Checkpoints of a run: what a pod's state becomes on disk, when it is written,
what a resumed or recovering run goes back to, and the checks that a
checkpoint continues only the run it came from. The file format itself is
``pod.state.checkpoint``."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pod.errors import CheckpointError
from pod.state.checkpoint import (
    Checkpoint,
    checkpoint_path,
    list_checkpoints,
    load_checkpoint,
    newest_valid_checkpoint,
    params_digest,
    prune_checkpoints,
    save_checkpoint,
)
from pod.state.checks import check_state

__all__ = ["checkpoint_dir", "initial_checkpoint", "pod_checkpoint", "check_compatible",
           "check_state", "resume_checkpoint", "RunCheckpoints"]


def _rng_and_position(plan, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
    seed = plan.training.seed
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

    training = plan.training
    params = plan.model.init_params(training.seed)
    opt = build_optimizer(training.optimizer.name, **training.optimizer.options())
    opt_state = opt.init(params)
    replicas = [[plan.model.init_state() for _ in range(plan.mesh.devices_per_chip)]
                for _ in range(plan.topology.chips)]
    rng, position = _rng_and_position(plan, 0)
    return Checkpoint(step=0, scenario=plan.scenario.model_dump(mode="json"), params=params,
                      model_state=plan.model.init_state(), optimizer_state=opt_state,
                      extra=_extra(plan), replica_model_state=replicas, rng=rng,
                      data_position=position,
                      digests={"params": params_digest(params),
                               "optimizer_state": params_digest(opt_state)})


def pod_checkpoint(pod, plan, step: int, run_state: dict[str, Any] | None = None) -> Checkpoint:
    """The complete training state of a running pod after ``step`` steps.

    The pod (``pod.runtime.base.PodBase.checkpoint_state``) hashes every device's
    state where it lives and compares the data replicas: the model is assembled
    from data replica 0's shards only because the others are bit-identical.
    Each device's model state is stored (they differ), and their mean as
    ``model_state`` (what evaluation and ``tpu-pod generate`` use).

    Args:
        pod: a started pod (``Pod``, ``LocalPod``).
        plan: its training plan.
        step: optimizer steps done.
        run_state: plain data for the run (summary sums, faults done).

    Raises:
        CheckpointError: the replicas differ (a checkpoint of one of them would
            silently drop the others); names the first differing device.
    """
    state = pod.checkpoint_state()
    rng, position = _rng_and_position(plan, step)
    return Checkpoint(step=int(step), scenario=plan.scenario.model_dump(mode="json"),
                      params=state["params"], model_state=state["model_state"],
                      optimizer_state=state["optimizer_state"], extra=_extra(plan),
                      replica_model_state=state["replica_model_state"], rng=rng,
                      data_position=position, digests=state["digests"],
                      run_state=dict(run_state or {}))


#: scenario keys that may differ between a checkpoint and the run that resumes it
_RESUMABLE_CHANGES = {"training": ("steps", "epochs", "eval_every_steps"), "data": ("path",)}
#: pod keys compared as the plan resolves them (``resolve_pod``), not as written
_RESOLVED_POD_KEYS = ("slice", "chip", "chips", "topology", "wraparound")


def _resolved_pod(pod: Any) -> dict[str, Any]:
    """The pod's shape as ``resolve_pod`` decides it: slice name, chip, count,
    torus shape and wraparound, whatever the scenario wrote out or left to defaults."""
    return {"slice": pod.slice_name or None, "chip": pod.chip.name, "chips": pod.chips,
            "topology": pod.torus.name, "wraparound": list(pod.torus.wraparound)}


def _their_pod(section: Any, source: str) -> dict[str, Any]:
    """The checkpoint's ``pod`` section resolved like the plan's."""
    from pod.config.scenario import PodConfig
    from pod.config.slices import resolve_pod

    try:
        cfg = PodConfig.model_validate(section)
        return _resolved_pod(resolve_pod(slice_name=cfg.slice, chip=cfg.chip, chips=cfg.chips,
                                         topology=cfg.topology, wraparound=cfg.wraparound))
    except ValueError as err:  # pydantic's ValidationError and ScenarioError are ValueErrors
        first = (str(err).splitlines() or [""])[0]
        raise CheckpointError(f"{source}: the checkpoint's pod is not a valid pod ({first[:120]})"
                              ) from None


def _layers(model: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(type(layer).__name__, dict(vars(layer))) for layer in model.layers]


def _same_model(theirs: Any, plan) -> bool:
    """True when the checkpoint's model section builds the plan's model (same layers,
    same settings): options written out at their defaults are no difference."""
    from pod.workloads import build_model

    if not isinstance(theirs, dict) or theirs.get("name") != plan.model.name:
        return False
    try:
        model = build_model(theirs["name"], input_shape=plan.model.input_shape,
                            num_classes=plan.model.num_classes, **(theirs.get("options") or {}))
    except (TypeError, ValueError, KeyError):
        return False
    return _layers(model) == _layers(plan.model) and model.loss == plan.model.loss


def _show(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _default(scenario: Any, section: str, key: str) -> Any:
    """The default of field ``key`` of the scenario's ``section`` (a marker if none)."""
    model = getattr(scenario, section, None)
    field = type(model).model_fields.get(key) if model is not None else None
    if field is None or field.is_required():
        return _NO_DEFAULT
    default = field.get_default(call_default_factory=True)
    return default.model_dump(mode="json") if hasattr(default, "model_dump") else default


_NO_DEFAULT = object()


def check_compatible(checkpoint: Checkpoint, plan, source: str = "checkpoint") -> None:
    """Refuse to continue a run from a checkpoint of a different one.

    The pod is compared as the plan resolves it (slice, chip, chip count,
    topology, wraparound; a default written out is no difference), and its
    allreduce and links as written; the model by name and by the layers its
    options build; data and training as written (except the length and
    evaluation interval, and where the data file lives). The data order
    (train examples) must be the checkpoint's too.

    Raises:
        CheckpointError: one line naming the first differing key and both values.
    """
    mine = plan.scenario.model_dump(mode="json")
    theirs = checkpoint.scenario if isinstance(checkpoint.scenario, dict) else {}

    def differ(key: str, a: Any, b: Any) -> CheckpointError:
        return CheckpointError(f"{source}: {key} is {_show(b)} in the checkpoint but {_show(a)} "
                               "in the scenario; a checkpoint continues only the run it came from")

    their_pod = theirs.get("pod") if isinstance(theirs.get("pod"), dict) else {}
    a, b = _resolved_pod(plan.topology), _their_pod(their_pod, source)
    for key in _RESOLVED_POD_KEYS:
        if a[key] != b[key]:
            raise differ(f"pod.{key}", a[key], b[key])
    for section in ("pod", "model", "data", "training"):
        skip = _RESUMABLE_CHANGES.get(section, ())
        if section == "pod":
            skip = _RESOLVED_POD_KEYS
        given = theirs.get(section)
        got = given if isinstance(given, dict) else {}
        if section == "model" and _same_model(got, plan):
            continue
        a = {k: v for k, v in (mine.get(section) or {}).items() if k not in skip}
        b = {k: v for k, v in got.items() if k not in skip}
        for key in sorted(set(a) | set(b), key=lambda k: (k != "name", k)):
            if key not in got and a.get(key) == _default(plan.scenario, section, key):
                continue  # a field added since the checkpoint was written, at its default
            if a.get(key) != b.get(key):
                raise differ(f"{section}.{key}", a.get(key), b.get(key))
    position = checkpoint.data_position
    n = int(plan.dataset.x_train.shape[0])
    if position and position.get("num_examples") != n:
        raise CheckpointError(f"{source}: the checkpoint's data order is over "
                              f"{position.get('num_examples')} train examples, "
                              f"this data set has {n}")


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
            of another scenario, one past the run's last step, or a state tree
            that does not fit the plan (``check_state``: names, shapes, dtypes,
            finite values, run state, digests).
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"--resume: {directory} is not a directory")
    found = newest_valid_checkpoint(directory, warn)
    if found is None:
        raise CheckpointError(f"--resume: no valid checkpoint (ckpt-<step>.msgpack) in {directory}")
    path, checkpoint = found
    source = f"--resume {path}"
    check_compatible(checkpoint, plan, source=source)
    if isinstance(checkpoint.step, int) and checkpoint.step > plan.steps:
        raise CheckpointError(f"{source}: the checkpoint is at step {checkpoint.step}, past "
                              f"training.steps {plan.steps}")
    check_state(checkpoint, plan, source=source)
    return path, checkpoint


def checkpoint_dir(plan, output_dir: Path | None) -> Path | None:
    """Where a run of ``plan`` keeps its checkpoints: ``checkpoint.dir``, else
    ``<output_dir>/checkpoints``; None without a ``checkpoint:`` block (or without
    either directory)."""
    config = plan.scenario.checkpoint
    if config is None:
        return None
    if config.dir:
        return Path(config.dir)
    return Path(output_dir) / "checkpoints" if output_dir is not None else None


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

    def __init__(self, plan, output_dir: Path | None, resume_dir: Path | None = None) -> None:
        config = plan.scenario.checkpoint
        directory = checkpoint_dir(plan, output_dir)
        # a checkpoint block: its dir, or beside an output directory (Run refuses neither)
        assert directory is not None
        self.dir = directory
        self.every_steps, self.keep = config.every_steps, config.keep
        # the newest ``keep`` paths (the others are pruned): a long run keeps O(1) memory
        self.written: collections.deque[Path] = collections.deque(maxlen=self.keep)
        self.count = 0  # checkpoints written by this run
        self.last_step: int | None = None
        self.wall_seconds = 0.0
        existing = list_checkpoints(self.dir)
        same = resume_dir is not None and Path(resume_dir).resolve() == self.dir.resolve()
        if existing and not same:
            raise CheckpointError(
                f"checkpoint.dir: {self.dir} already holds {len(existing)} checkpoint(s) of an "
                f"earlier run (newest: step {existing[0][0]}); continue it with --resume "
                f"{self.dir}, or move "
                "them away or choose another dir (they are never overwritten by a new run)")

    def due(self, steps_done: int, total_steps: int) -> bool:
        """True after every ``every_steps``-th step and after the last one."""
        return steps_done % self.every_steps == 0 or steps_done == total_steps

    def save(self, pod, plan, step: int, run_state: dict[str, Any]) -> Path:
        """Write the pod's state after ``step`` steps, then keep the newest ``keep``."""
        t0 = time.perf_counter()
        path = save_checkpoint(checkpoint_path(self.dir, step),
                               pod_checkpoint(pod, plan, step, run_state))
        self.written.append(path)
        self.count += 1
        self.last_step = step
        prune_checkpoints(self.dir, self.keep)
        self.wall_seconds += time.perf_counter() - t0
        return path

    def restore_point(self, plan, fallback: Checkpoint | None = None,
                      warn: Callable[[str], None] | None = None) -> Checkpoint:
        """What a pod that lost chips goes back to: the newest valid checkpoint this
        run wrote (a corrupted one is skipped with a warning), else ``fallback``
        (the checkpoint it resumed from), else the initial state. A checkpoint whose
        state does not fit the plan (``check_state``) is skipped like a corrupted one."""
        for path in reversed(self.written):
            if not path.exists():
                continue
            try:
                point = load_checkpoint(path)
                check_state(point, plan, source=str(path))
                return point
            except CheckpointError as err:
                if warn is not None:
                    warn(f"warning: skipping checkpoint {path}: {err}")
        return fallback if fallback is not None else initial_checkpoint(plan)

"""Checkpoints of a run: what a pod's state becomes on disk, when it is written,
what a resumed or recovering run goes back to, and the checks that a
checkpoint continues only the run it came from. The file format itself is
``pod.state.checkpoint``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from pod.errors import CheckpointError
from pod.state.checkpoint import (Checkpoint, checkpoint_path, list_checkpoints, load_checkpoint,
                                  mean_replica_state, newest_valid_checkpoint, params_digest,
                                  prune_checkpoints, save_checkpoint)

__all__ = ["initial_checkpoint", "pod_checkpoint", "check_compatible", "resume_checkpoint",
           "RunCheckpoints"]


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
    """The complete training state of a running ``pod.runtime.coordinator.Pod`` after ``step`` steps.

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
    snaps = pod.snapshot()
    first = snaps[0].digests[0]
    for chip, per_core in enumerate(s.digests for s in snaps):
        for core, digest in enumerate(per_core):
            if digest != first:
                raise CheckpointError(f"step {step}: chip {chip} core {core} differs from chip 0 "
                                      f"core 0 ({digest[0][:12]} != {first[0][:12]}); replicas are not "
                                      "bit-identical, refusing to checkpoint one of them")
    replicas = [list(s.model_state) for s in snaps]
    mean = mean_replica_state(replicas, plan.model.state_shapes)
    rng, position = _rng_and_position(plan, step)
    return Checkpoint(step=int(step), scenario=plan.scenario.model_dump(mode="json"),
                      params=snaps[0].params, model_state=mean,
                      optimizer_state=snaps[0].optimizer_state, extra=_extra(plan),
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

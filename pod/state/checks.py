"""Check a checkpoint's whole state tree against the plan that will continue it.

Orbax restores against a target structure: every array must have the name,
shape and dtype the model and optimizer expect, or the restore fails naming
the array. ``check_state`` does the same for a ``Checkpoint`` before any chip
actor is touched:

- ``params``: exactly the names of ``plan.model.param_shapes``, those shapes,
  float32, finite;
- ``optimizer_state``: exactly the names and shapes the optimizer's ``init``
  gives for those parameters (``<param>/<slot>``), float32, finite;
- ``model_state`` and every replica's model state: the names and shapes of
  ``plan.model.state_shapes``, float32, finite; one replica per device, per
  chip ([chip][device of the chip]);
- ``step``: an integer in ``[0, plan.steps]``;
- ``run_state``: a mapping whose ``totals`` are step totals of ``step`` steps,
  whose ``faults_done`` are indices into the scenario's faults, whose
  ``simulated_clock`` is a finite, non-negative number of seconds and whose
  ``axis_totals`` (runs before the one runtime) are per mesh axis finite sums >= 0;
- ``digests``: the stored SHA-256 of the parameters and of the optimizer
  state match the arrays (``params_digest``, in the stored order).

Every failure is one ``CheckpointError`` line naming the array or field, what
it holds and what was expected.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from pod.errors import CheckpointError
from pod.state.checkpoint import Checkpoint, params_digest

__all__ = ["check_state", "check_params", "expected_optimizer_shapes"]

#: Every array of the training state is float32 (``Model.init_params``,
#: ``Optimizer.init``, ``Model.init_state``).
_DTYPE = np.dtype(np.float32)


def _names(names: Any, limit: int = 4) -> str:
    """Up to ``limit`` names, quoted, for a one-line message."""
    names = sorted(names)
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def expected_optimizer_shapes(plan: Any) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the optimizer state ``plan``'s optimizer builds.

    The structure comes from the optimizer's own ``init``, called one
    parameter at a time on a 0-d stand-in (no memory for big models); each
    slot has its parameter's shape.

    Args:
        plan: a ``TrainingPlan``.

    Returns:
        ``{"<param>/<slot>": shape}`` in the order ``init`` produces.
    """
    from pod.workloads import build_optimizer

    training = plan.training
    optimizer = build_optimizer(training.optimizer.name, **training.optimizer.options())
    stand_in = np.zeros((), _DTYPE)
    shapes: dict[str, tuple[int, ...]] = {}
    for name, shape in plan.model.param_shapes.items():
        for slot in optimizer.init({name: stand_in}):
            shapes[slot] = tuple(shape)
    return shapes


def _check_tree(source: str, kind: str, arrays: Any, expected: dict[str, tuple[int, ...]]) -> None:
    """Names, shapes, dtype and finiteness of one {name: array} tree."""
    if not isinstance(arrays, dict):
        raise CheckpointError(f"{source}: {kind} is a {type(arrays).__name__}, expected a "
                              "mapping of name to array")
    missing = expected.keys() - arrays.keys()
    if missing:
        raise CheckpointError(f"{source}: {kind} lacks {_names(missing)} of the plan's "
                              f"{len(expected)} array(s)")
    unexpected = arrays.keys() - expected.keys()
    if unexpected:
        raise CheckpointError(f"{source}: {kind} has {_names(unexpected)}, which the plan's "
                              f"model does not have")
    for name, shape in expected.items():
        array = arrays[name]
        where = f"{source}: {kind}[{name!r}]"
        if tuple(np.shape(array)) != tuple(shape):
            raise CheckpointError(f"{where} has shape {tuple(np.shape(array))}, expected "
                                  f"{tuple(shape)}")
        dtype = np.asarray(array).dtype
        if dtype != _DTYPE:
            raise CheckpointError(f"{where} has dtype {dtype}, expected {_DTYPE}")
        finite = np.isfinite(array)
        if not finite.all():
            bad = np.asarray(array)[~finite]
            raise CheckpointError(f"{where} holds {bad.size} non-finite value(s) (first: "
                                  f"{bad.flat[0]}), expected finite numbers")


def _check_step(source: str, step: Any, steps: int) -> int:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
        raise CheckpointError(f"{source}: step is {step!r}, expected an integer")
    if not 0 <= int(step) <= steps:
        raise CheckpointError(f"{source}: step is {int(step)}, expected 0 to training.steps "
                              f"({steps})")
    return int(step)


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def _check_axis_totals(source: str, axis_totals: Any) -> None:
    """``run_state['axis_totals']``: mesh axis -> {bytes, seconds, exposed_seconds} >= 0."""
    from pod.config.mesh import AXIS_NAMES

    keys = {"bytes", "seconds", "exposed_seconds"}
    ok = isinstance(axis_totals, dict) and all(
        axis in AXIS_NAMES and isinstance(t, dict) and set(t) == keys
        and all(_is_number(v) and v >= 0 for v in t.values())
        for axis, t in axis_totals.items())
    if not ok:
        raise CheckpointError(f"{source}: run_state['axis_totals'] is {str(axis_totals)[:80]}, "
                              f"expected per mesh axis ({', '.join(AXIS_NAMES)}) the sums "
                              f"{', '.join(sorted(keys))}, finite and >= 0")


def _check_run_state(source: str, run_state: Any, step: int, num_faults: int) -> None:
    """``run_state``: totals of ``step`` steps, fault indices, a finite clock."""
    from pod.report.stats import StepTotals

    if not isinstance(run_state, dict):
        raise CheckpointError(f"{source}: run_state is a {type(run_state).__name__}, expected a "
                              "mapping (totals, faults_done, simulated_clock)")
    unknown = set(run_state) - {"totals", "faults_done", "simulated_clock", "axis_totals"}
    if unknown:
        raise CheckpointError(f"{source}: run_state has unknown key(s) {_names(unknown)}; "
                              "expected totals, faults_done, simulated_clock, axis_totals")
    _check_axis_totals(source, run_state.get("axis_totals", {}))
    clock = run_state.get("simulated_clock", 0.0)
    if not _is_number(clock) or clock < 0:
        raise CheckpointError(f"{source}: run_state['simulated_clock'] is {clock!r}, expected "
                              "finite seconds >= 0")
    done = run_state.get("faults_done", [])
    if not isinstance(done, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_faults for i in done):
        raise CheckpointError(f"{source}: run_state['faults_done'] is {str(done)[:80]}, expected "
                              f"indices of the scenario's {num_faults} fault(s)")
    totals = run_state.get("totals")
    if totals in (None, {}):
        return
    fields = {f.name: f for f in dataclasses.fields(StepTotals)}
    if not isinstance(totals, dict) or set(totals) - set(fields):
        keys = (_names(set(totals) - set(fields)) if isinstance(totals, dict)
                else type(totals).__name__)
        raise CheckpointError(f"{source}: run_state['totals'] has {keys}, expected the keys "
                              f"{', '.join(fields)}")
    for key, value in totals.items():
        if key in ("first", "sums", "run"):  # run: the run's figures (StepTotals.run)
            ok = isinstance(value, dict) and all(isinstance(k, str) and _is_number(v)
                                                 for k, v in value.items())
        elif key in ("initial_loss", "final_loss"):
            ok = value is None or _is_number(value)
        elif key in ("expert_routed", "expert_kept"):  # per expert, a mixture of experts
            ok = isinstance(value, list) and all(_is_number(v) and v >= 0 for v in value)
        else:
            ok = _is_number(value) and value >= 0
        if not ok:
            raise CheckpointError(f"{source}: run_state['totals'][{key!r}] is {str(value)[:80]}, "
                                  "expected finite numbers")
    if totals.get("steps", 0) != step:
        raise CheckpointError(f"{source}: run_state['totals']['steps'] is {totals.get('steps')!r}, "
                              f"expected the checkpoint's step ({step})")


def _check_digests(source: str, checkpoint: Checkpoint) -> None:
    digests = checkpoint.digests
    if not isinstance(digests, dict):
        raise CheckpointError(f"{source}: digests is a {type(digests).__name__}, "
                              "expected a mapping")
    for kind, arrays in (("params", checkpoint.params),
                         ("optimizer_state", checkpoint.optimizer_state)):
        stored = digests.get(kind)
        if stored is None:
            continue  # version 1 files carry no digests
        actual = params_digest(arrays)
        if stored != actual:
            raise CheckpointError(f"{source}: {kind} has SHA-256 {actual[:12]}..., the "
                                  f"checkpoint's digest says {str(stored)[:12]}...; the arrays "
                                  "are not the ones that were saved")


def check_params(checkpoint: Checkpoint, model: Any, source: str = "checkpoint") -> None:
    """Refuse a checkpoint whose parameters are not ``model``'s (names, shapes, float32,
    finite): what ``tpu-pod generate`` runs them through.

    Raises:
        CheckpointError: one line naming the first array that does not fit.
    """
    _check_tree(source, "params", checkpoint.params,
                {k: tuple(v) for k, v in model.param_shapes.items()})


def check_state(checkpoint: Checkpoint, plan: Any, source: str = "checkpoint") -> None:
    """Refuse a checkpoint whose state tree does not fit ``plan``, as Orbax would.

    Runs in the driver, before any chip actor is touched; the scenario itself
    is compared by ``check_compatible``.

    Args:
        checkpoint: a loaded (checksum-verified) checkpoint.
        plan: the ``TrainingPlan`` that will continue it.
        source: what to name in messages (e.g. ``--resume <path>``).

    Raises:
        CheckpointError: one line naming the first array or field that does
            not fit and what was expected.
    """
    step = _check_step(source, checkpoint.step, plan.steps)
    model = plan.model
    _check_tree(source, "params", checkpoint.params,
                {k: tuple(v) for k, v in model.param_shapes.items()})
    _check_tree(source, "optimizer_state", checkpoint.optimizer_state,
                expected_optimizer_shapes(plan))
    state_shapes = {k: tuple(v) for k, v in model.state_shapes.items()}
    _check_tree(source, "model_state", checkpoint.model_state, state_shapes)
    replicas = checkpoint.replica_model_state
    if replicas:
        chips, cores = plan.topology.chips, plan.mesh.devices_per_chip
        if not isinstance(replicas, list) or len(replicas) != chips or any(
                not isinstance(c, list) or len(c) != cores for c in replicas):
            layout = ([len(c) if isinstance(c, list) else "?" for c in replicas]
                      if isinstance(replicas, list) else type(replicas).__name__)
            raise CheckpointError(f"{source}: replica_model_state has per-chip devices "
                                  f"{str(layout)[:60]}, expected {chips} chips x {cores} "
                                  "devices")
        for chip, per_core in enumerate(replicas):
            for core, state in enumerate(per_core):
                _check_tree(source, f"replica_model_state[{chip}][{core}]", state, state_shapes)
    _check_run_state(source, checkpoint.run_state, step, len(plan.scenario.faults))
    _check_digests(source, checkpoint)

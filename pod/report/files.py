"""The files a run writes: ``summary.json`` (``summarize``, ``reliability``),
``steps.csv`` (``StepsCsv``), both written so that a reader never sees half a
file (``write_json``: a temporary file, flushed, then renamed)."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any, Sequence

from pod.report.stats import StepStats, StepTotals, mfu

__all__ = ["summarize", "reliability", "StepsCsv", "write_json"]


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as indented JSON to ``path`` atomically (temp file + rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        f.write(json.dumps(data, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def summarize(plan: Any, steps: StepTotals | Sequence[StepStats],
              evaluation: Any | None, replicas_identical: bool | None,
              wall_seconds: float, startup_wall_seconds: float) -> dict[str, Any]:
    """The run's summary (the content of summary.json).

    Simulated figures are means over the steps after the first (the first
    step is kept out as a real TPU's first step, which compiles, would be).
    With a single step, that step is used.

    Args:
        plan: the training plan.
        steps: the running totals of the steps (``StepTotals``), or every
            step's statistics in order.
        evaluation: an object with the test ``loss`` and ``accuracy`` (None:
            not evaluated, a partial run).
        replicas_identical: the result of the bit-identity check (None: not
            checked).
        wall_seconds: wall time of the whole training loop.
        startup_wall_seconds: wall time to start the actors.

    Returns:
        A JSON-serialisable dict. Without a single step done, the simulated
        figures are None.
    """
    if not isinstance(steps, StepTotals):
        totals = StepTotals()
        for s in steps:
            totals.add(s)
        steps = totals
    totals = steps
    pod = plan.pod
    if totals.steps == 0:
        return _identity(plan, 0) | {"wall_seconds": wall_seconds,
                                      "startup_wall_seconds": startup_wall_seconds}
    mean = totals.mean
    step_seconds = mean("step_seconds")
    flops = mean("model_flops")
    return _identity(plan, totals.steps) | {
        "initial_loss": totals.initial_loss,
        "final_loss": totals.final_loss,
        "test_loss": evaluation.loss if evaluation is not None else None,
        "test_accuracy": evaluation.accuracy if evaluation is not None else None,
        "simulated_step_seconds": step_seconds,
        "simulated_examples_per_second": plan.global_batch / step_seconds,
        "simulated_tflops": flops / step_seconds / 1e12,
        "mfu": mfu(flops, step_seconds, pod.peak_bf16_flops_per_s),
        "infeed_seconds": mean("infeed_seconds"),
        "compute_seconds": mean("compute_seconds"),
        "allreduce_seconds": mean("allreduce_seconds"),
        "exposed_allreduce_seconds": mean("exposed_allreduce_seconds"),
        "exposed_infeed_seconds": mean("exposed_infeed_seconds"),
        "dispatch_seconds": mean("dispatch_seconds"),
        "serial_step_seconds": mean("serial_step_seconds"),
        "overlap_fraction": (1.0 - mean("exposed_allreduce_seconds") / mean("allreduce_seconds")
                             if mean("allreduce_seconds") > 0 else 0.0),
        "ici_seconds": mean("ici_seconds"),
        "update_seconds": mean("update_seconds"),
        "ici_bytes_per_step": totals.ici_bytes_per_step,
        "peak_bf16_flops_per_s": pod.peak_bf16_flops_per_s,
        "wall_seconds": wall_seconds,
        "wall_step_seconds": mean("wall_seconds"),
        "startup_wall_seconds": startup_wall_seconds,
        "emulation_slowdown": mean("wall_seconds") / step_seconds,
        "hbm_peak_bytes": totals.hbm_peak_bytes,
        "hbm_capacity_bytes": totals.hbm_capacity_bytes,
        "replicas_identical": None if replicas_identical is None else bool(replicas_identical),
    }


def _identity(plan: Any, steps: int) -> dict[str, Any]:
    """The summary's first keys: what ran."""
    pod = plan.pod
    return {
        "scenario": plan.scenario.name,
        "generation": pod.chip.name,
        "slice": pod.slice_name,
        "topology": pod.torus.name,
        "wraparound": list(pod.torus.wraparound),
        "chips": pod.chips,
        "cores": pod.tensorcores,
        "model": plan.model.name,
        "parameters": plan.num_params,
        "dataset": plan.dataset.name,
        "synthetic_data": bool(plan.dataset.synthetic),
        "precision": plan.scenario.training.precision,
        "allreduce_algorithm": plan.ici.algorithm,
        "overlap": bool(plan.scenario.training.overlap),
        "host_dispatch": plan.scenario.training.host_dispatch,
        "steps": steps,
        "global_batch": plan.global_batch,
        "per_core_batch": plan.per_core_batch,
    }


def reliability(events: list[dict[str, Any]], checkpoints: Any | None, resumed: Any | None,
                completed: bool) -> dict[str, Any]:
    """summary.json's reliability fields: faults, recomputation, checkpoints."""
    return {
        "completed": completed,
        "resumed_from_step": resumed.step if resumed is not None else None,
        "faults": events,
        "steps_recomputed": int(sum(e.get("steps_recomputed", 0) for e in events)),
        "checkpoint_dir": str(checkpoints.dir) if checkpoints else None,
        "checkpoints_written": len(checkpoints.written) if checkpoints else 0,
        "checkpoint_wall_seconds": checkpoints.wall_seconds if checkpoints else 0.0,
    }


class StepsCsv:
    """steps.csv, one row per step done, written as the run goes.

    Args:
        path: the file.
        keep_below: resuming: keep the existing rows of steps below this
            (zero-based) and append; None: start a new file.
    """

    def __init__(self, path: Path, keep_below: int | None = None) -> None:
        self.path = path
        self._keep_below = keep_below
        self._file: Any = None
        self._writer: csv.DictWriter | None = None

    def __enter__(self) -> "StepsCsv":
        if self._keep_below is None or not self.path.exists():
            self._file = self.path.open("w", newline="")
        else:
            self.truncate(self._keep_below, reopen=False)
            self._file = self.path.open("a", newline="")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def write(self, row: dict[str, Any]) -> None:
        """Append one step's row (the header first, in a new file)."""
        if self._writer is None:
            self._writer = csv.DictWriter(self._file, fieldnames=list(row))
            if self._file.tell() == 0:
                self._writer.writeheader()
        self._writer.writerow(row)
        self._file.flush()

    def truncate(self, below: int, reopen: bool = True) -> None:
        """Drop the rows of steps >= ``below`` (zero-based): they will be recomputed."""
        if self._file is not None:
            self._file.close()
        with self.path.open(newline="") as f:
            reader = csv.DictReader(f)
            fields = reader.fieldnames
            kept = [r for r in reader if int(r["step"]) < below]
        tmp = self.path.with_name(self.path.name + ".tmp")
        with tmp.open("w", newline="") as f:
            if fields:
                writer = csv.DictWriter(f, fieldnames=fields)
                writer.writeheader()
                writer.writerows(kept)
        tmp.replace(self.path)
        self._writer = None
        if reopen:
            self._file = self.path.open("a", newline="")

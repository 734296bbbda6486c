"""The files a run writes: ``summary.json`` (``summarize``, ``reliability``),
``steps.csv`` (``StepsCsv``), written so that a reader never sees half a file
(``write_json`` and every rewrite of steps.csv go through ``pod.safe_io.write_atomic``:
a fresh temporary file in the same directory, flushed to disk, then renamed over
the target; re-exported here).

A file system that refuses (no space, read-only, no permission) ends the run
with one line naming the path (``OutputError``); ``check_writable`` finds it
before the first step.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from pod.errors import OutputError
from pod.report.stats import StepStats, StepTotals
from pod.safe_io import output_errors, read_csv_rows, write_atomic

__all__ = ["summarize", "reliability", "StepsCsv", "steps_rows", "MAX_STEPS_CSV_BYTES",
           "write_json", "write_atomic", "write_csv",
           "check_writable", "output_errors", "evaluated_figure"]


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as indented JSON to ``path`` atomically (temp file + rename).

    Raises:
        OutputError: the file system refused; one line naming the path.
    """
    text = json.dumps(data, indent=2) + "\n"
    write_atomic(Path(path), lambda f: f.write(text))


def check_writable(*directories: Path | str | None) -> None:
    """Check that results can be written before the first step: each directory is
    created if needed, and a small file is written, flushed to disk and removed in it.

    Args:
        directories: the output directory, the checkpoint directory, ...
            (None entries are skipped).

    Raises:
        OutputError: a directory cannot be created or written (read-only file
            system, no permission, no space left); one line naming it.
    """
    for directory in directories:
        if directory is None:
            continue
        directory = Path(directory)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".write-check.", dir=directory)
            try:
                os.write(fd, b"\0" * 4096)
                os.fsync(fd)
            finally:
                os.close(fd)
                os.unlink(probe)
        except OSError as err:  # named: the directory, not the probe file in it
            where = err.filename if err.filename and ".write-check." not in str(err.filename) \
                else directory
            raise OutputError(where, err.strerror or str(err)) from None


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
    totals = steps if isinstance(steps, StepTotals) else StepTotals.of(steps)
    if totals.steps == 0:
        return _identity(plan, 0) | {"wall_seconds": wall_seconds,
                                      "startup_wall_seconds": startup_wall_seconds}
    stats = totals.mean_stats()
    return _identity(plan, totals.steps) | {
        "initial_loss": _finite(totals.initial_loss),  # None: not computed (timing-only)
        "final_loss": _finite(totals.final_loss),
        "test_loss": evaluated_figure(evaluation, "loss"),
        "test_accuracy": evaluated_figure(evaluation, "accuracy"),
        "simulated_step_seconds": stats.step_seconds,
        "simulated_examples_per_second": stats.examples_per_second,
        "simulated_tokens_per_second": stats.tokens_per_second,
        "simulated_tflops": stats.tflops,
        "mfu": stats.mfu,
        **({"maxtext_tflops_per_device": stats.maxtext_tflops_per_device,
            "maxtext_2023_tflops_per_device": stats.maxtext_2023_tflops_per_device}
           if stats.maxtext_flops_per_device else {}),
        "hfu": stats.hfu,
        **_step_parts(stats),
        "collectives_by_axis": {
            axis: {"bytes_per_step": stats.axis_collective_bytes.get(axis, 0),
                   "simulated_seconds": stats.axis_collective_seconds.get(axis, 0.0),
                   "exposed_simulated_seconds": stats.axis_exposed_seconds.get(axis, 0.0),
                   **_dcn_split(plan, axis, stats)}
            for axis in plan.mesh.axis_names},
        "ici_bytes_per_step": totals.ici_bytes_per_step,
        "dcn_bytes_per_step": sum(stats.axis_dcn_bytes.values()),
        "peak_bf16_flops_per_s": stats.peak_flops_per_s,
        "wall_seconds": wall_seconds,
        "wall_step_seconds": stats.wall_seconds,
        "startup_wall_seconds": startup_wall_seconds,
        "emulation_slowdown": stats.emulation_slowdown,
        "hbm_peak_bytes": totals.hbm_peak_bytes,
        "hbm_capacity_bytes": totals.hbm_capacity_bytes,
        "replicas_identical": None if replicas_identical is None else bool(replicas_identical),
    } | _moe(plan, totals)


def _dcn_split(plan: Any, axis: str, stats: StepStats) -> dict[str, Any]:
    """An axis's part across slices in ``collectives_by_axis`` (multislice: an axis with a
    ``pod.dcn_mesh`` factor): the slices it spans, the DCN seconds within its
    ``simulated_seconds`` and the bytes a device sends across the DCN per step."""
    slices = plan.mesh.dcn_sizes.get(axis, 1)
    if slices == 1:
        return {}
    return {"dcn_slices": slices, "dcn_simulated_seconds": stats.axis_dcn_seconds.get(axis, 0.0),
            "dcn_bytes_per_step": stats.axis_dcn_bytes.get(axis, 0)}


def _moe(plan: Any, totals: StepTotals) -> dict[str, Any]:
    """summary.json's ``moe`` (a mixture-of-experts model; nothing for a dense one): the
    routing options and the routers' load per expert, means per step over every step
    with routing (summed over the MoE layers; none timing-only)."""
    config = getattr(plan.model, "config", None)
    if config is None or not getattr(config, "experts", 0):
        return {}
    n = totals.expert_steps
    routed, kept = sum(totals.expert_routed), sum(totals.expert_kept)
    return {"moe": {
        "experts": config.experts, "experts_per_token": config.experts_per_token,
        "capacity_factor": config.capacity_factor,
        "aux_loss_weight": config.moe_aux_loss_weight,
        "steps_routed": n,
        "tokens_per_expert_per_step": [v / n for v in totals.expert_routed] if n else None,
        "kept_per_expert_per_step": [v / n for v in totals.expert_kept] if n else None,
        "load_max_over_mean": totals.expert_max_over_mean_sum / n if n else None,
        "dropped_fraction": 1.0 - kept / routed if routed else None,
    }}


def _step_parts(stats: StepStats) -> dict[str, float]:
    """The summary's parts of a step (the mean step's, seconds) and the shares derived
    from them (overlap, pipeline bubble)."""
    return {
        "infeed_seconds": stats.infeed_seconds,
        "compute_seconds": stats.compute_seconds,
        "collective_seconds": stats.collective_seconds,
        "exposed_collective_seconds": stats.exposed_collective_seconds,
        "exposed_infeed_seconds": stats.exposed_infeed_seconds,
        "dispatch_seconds": stats.dispatch_seconds,
        "serial_step_seconds": stats.serial_step_seconds,
        "overlap_fraction": stats.overlap_fraction,
        "update_seconds": stats.update_seconds,
        "host_offload_seconds": stats.host_offload_seconds,
        "exposed_host_offload_seconds": stats.exposed_host_offload_seconds,
        "pipeline_bubble_seconds": stats.pipeline_bubble_seconds,
        "pipeline_bubble_fraction": stats.pipeline_bubble_fraction,
    }


def _finite(value: float | None) -> float | None:
    """A figure for summary.json: None where there is none (NaN: JSON has no NaN)."""
    return None if value is None or value != value else float(value)


def evaluated_figure(evaluation: Any | None, name: str) -> float | None:
    """A test figure ("loss", "accuracy"), None when not evaluated or when no example
    was (NaN): summary.json's null, steps.csv's empty cell, an absent metric."""
    return _finite(getattr(evaluation, name, None) if evaluation is not None else None)


def _identity(plan: Any, steps: int) -> dict[str, Any]:
    """The summary's first keys: what ran."""
    pod = plan.topology
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
        "precision": plan.training.precision,
        "mesh": dict(plan.mesh.sizes),
        "slices": plan.mesh.slices,
        "dcn_mesh": plan.mesh.dcn_sizes,
        "devices": plan.mesh.size,
        "devices_per_chip": plan.mesh.devices_per_chip,
        **_algorithms(plan),
        "overlap": bool(plan.training.overlap),
        "host_dispatch": plan.training.host_dispatch,
        "steps": steps,
        "global_batch": plan.global_batch,
        "per_device_batch": plan.per_device_batch,
        **_pipeline(plan),
    }


def _algorithms(plan: Any) -> dict[str, Any]:
    """The collective algorithm of each mesh axis, from the plan's cost table
    (``MeshCollectiveCosts.algorithms``), and the data axis's allreduce's on its own
    (``allreduce_algorithm``; None without a data axis)."""
    algorithms = plan.collective_costs.algorithms()
    return {"allreduce_algorithm": algorithms.get("data"), "collective_algorithms": algorithms}


def _pipeline(plan: Any) -> dict[str, Any]:
    """The pipeline's figures (a mesh with a stage axis): stages, microbatches, schedule,
    repeats; nothing without one."""
    from pod.config.pipeline import pipeline_microbatches

    stages = plan.mesh.axis_size("stage")
    if stages == 1:
        return {}
    training = plan.training
    return {"pipeline": {"stages": stages,
                         "microbatches": pipeline_microbatches(training, plan.mesh),
                         "schedule": training.pipeline_schedule,
                         "repeats": training.pipeline_repeats}}


def reliability(events: list[dict[str, Any]], checkpoints: Any | None, resumed: Any | None,
                completed: bool) -> dict[str, Any]:
    """summary.json's reliability fields: faults, recomputation, checkpoints."""
    return {
        "completed": completed,
        "resumed_from_step": resumed.step if resumed is not None else None,
        "faults": events,
        "steps_recomputed": int(sum(e.get("steps_recomputed", 0) for e in events)),
        "checkpoint_dir": str(checkpoints.dir) if checkpoints else None,
        "checkpoints_written": checkpoints.count if checkpoints else 0,
        "checkpoint_wall_seconds": checkpoints.wall_seconds if checkpoints else 0.0,
    }


#: Largest steps.csv read back (a row is about 1 KB: 64 GiB is 64 million steps); reading
#: stops at the first damaged line, so a file of NUL bytes is refused at its first line.
MAX_STEPS_CSV_BYTES = 1 << 36


def _check_step_row(previous: list[int]) -> Callable[[dict[str, str]], None]:
    """The check of a steps.csv row: ``step`` the whole number after the row before's
    (1 first), every other field a number, ``True`` / ``False`` or empty."""
    def check(row: dict[str, str]) -> None:
        step = row["step"].strip()
        if not step.isdigit() or int(step) != previous[0] + 1:
            raise ValueError(f"step is {row['step'][:20]!r}, expected {previous[0] + 1} (the "
                             "row before's step + 1)")
        for key, value in row.items():
            if value not in ("", "True", "False"):
                try:
                    float(value)
                except ValueError:
                    raise ValueError(f"{key} is {value[:20]!r}, not a number") from None
        previous[0] += 1
    return check


def steps_rows(path: Path, on_damage: Callable[[str], None] | None = None
               ) -> Iterator[tuple[int, dict[str, str]]]:
    """The rows of a steps.csv, read back defensively (``pod.safe_io.read_csv_rows``):
    (line, row) of every row before the first damaged line, which is named once
    through ``on_damage`` (``steps.csv line 14: has 3 fields, the header 50``).

    Raises:
        ValueError: not a regular file or past ``MAX_STEPS_CSV_BYTES`` (one line).
    """
    return read_csv_rows(path, MAX_STEPS_CSV_BYTES, "steps files", required=("step",),
                         check_row=_check_step_row([0]), on_damage=on_damage)


class StepsCsv:
    """steps.csv, one row per step done, written as the run goes; ``step`` counts
    from 1, and ``test_loss`` / ``test_accuracy`` are filled where the run evaluated.

    Args:
        path: the file.
        keep_below: resuming: keep the existing rows of the first ``keep_below``
            steps (steps done at the checkpoint) and append; None: start a new file.
        warn: called with one line per damaged steps.csv found when rows are kept.
    """

    def __init__(self, path: Path, keep_below: int | None = None,
                 warn: Callable[[str], None] | None = None) -> None:
        self.path = path
        self._keep_below = keep_below
        self._warn = warn
        self._file: Any = None

    def __enter__(self) -> StepsCsv:
        # the file is made (or, resuming, cut back to the checkpoint) at the first row: a
        # run that fails before its first step leaves an earlier run's steps.csv as it was
        return self

    @property
    def started(self) -> bool:
        """This run has written to the file (a first row, or the kept rows of a resume)."""
        return self._file is not None

    def __exit__(self, *exc: Any) -> None:
        if self._file is not None:
            with output_errors(self.path):
                self._file.close()
            self._file = None

    def write(self, row: dict[str, Any]) -> None:
        """Append one step's row (the header first, in a new file). The row goes to the
        file in one ``write`` call, so a full disk leaves whole rows or none of this one
        (the bytes that did go are cut back).

        Raises:
            OutputError: the file system refused; one line naming the path.
        """
        with output_errors(self.path):
            if self._file is None and self._keep_below is not None and self.path.exists():
                self.truncate(self._keep_below)  # resuming: the rows before the checkpoint
            if self._file is None:  # the first row of a new file
                write_atomic(self.path, lambda f: None)
                self._file = _append(self.path)
            text = io.StringIO()
            writer = csv.DictWriter(text, fieldnames=list(row))
            if os.fstat(self._file.fileno()).st_size == 0:
                writer.writeheader()
            writer.writerow(row)
            _append_whole(self._file, text.getvalue())

    def truncate(self, below: int, reopen: bool = True) -> None:
        """Keep the rows of the first ``below`` steps (steps numbered from 1), drop the
        rest: they will be recomputed. A damaged row (a crash's or a full disk's tail,
        or worse) is named in one warning line and dropped with every row after it.

        The file is rewritten atomically (``write_atomic``): a crash leaves the
        old rows or the new ones, never a half-written file.
        """
        with output_errors(self.path):
            if self._file is not None:
                self._file.close()
                self._file = None
            if not self.path.exists():  # no row written yet: nothing to keep
                return
            damage: list[str] = []
            kept = [0]

            def rewrite(f: Any) -> None:
                writer = csv.writer(f)
                for _, row in steps_rows(self.path, damage.append):
                    if not kept[0]:
                        writer.writerow(list(row))  # the header
                    if int(row["step"]) > below:
                        break
                    writer.writerow(row.values())
                    kept[0] = int(row["step"])

            try:
                write_atomic(self.path, rewrite, newline="")
            except ValueError as err:  # not a regular file, or past its cap: begun anew
                damage.append(str(err))
                write_atomic(self.path, lambda f: None)
            for line in damage:
                lost = (f"; steps {kept[0] + 1}-{below} before the checkpoint are not in it"
                        if kept[0] < below else "")
                self._say(f"warning: {line}: dropped it and the rows after it (steps.csv now "
                          f"keeps steps 1-{kept[0]}{lost})" if kept[0] else
                          f"warning: {line}: steps.csv begun anew{lost}")
            if reopen:
                self._file = _append(self.path)

    def _say(self, text: str) -> None:
        if self._warn is not None:
            self._warn(text)


def _append_whole(f: Any, text: str) -> None:
    """Append ``text`` to a file opened by ``_append`` in one write: if the file system
    refuses part of it (no space), the part that went is cut off again, so the file
    ends in a whole row."""
    f.flush()
    start = os.lseek(f.fileno(), 0, os.SEEK_END)
    data = text.encode("utf-8")
    try:
        done = 0
        while done < len(data):
            done += os.write(f.fileno(), data[done:])
    except OSError:
        with contextlib.suppress(OSError):
            os.ftruncate(f.fileno(), start)
        raise


def _append(path: Path) -> Any:
    """``path`` opened to append text, refusing to follow a link planted there."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
    return os.fdopen(fd, "a", newline="", encoding="utf-8")


def write_csv(path: Path, rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> None:
    """Write rows as CSV with these columns, atomically (``layers.csv``).

    Raises:
        OutputError: the file system refused; one line naming the path.
    """
    def fill(f: Any) -> None:
        writer = csv.DictWriter(f, fieldnames=list(columns))
        writer.writeheader()
        writer.writerows(rows)

    write_atomic(Path(path), fill, newline="")

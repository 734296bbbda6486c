"""Scaling experiments: one scenario at every point of its ``sweep:`` block.

Each point is the scenario with some values replaced (pod, allreduce
algorithm, global or per-core batch, precision). In ``timing`` mode (the
default) a point is costed by ``pod.runtime.timing.TimingPod`` (one representative
chip, no actors), so a sweep reaches full pods; in ``functional`` mode it is
trained on chip actors for ``steps`` steps. A point that fails (for example
a batch that does not fit in HBM, or does not split over the cores) is
recorded with its error and the sweep goes on.

Finished points are never lost: each point's row is on disk as it finishes
(``sweep-journal.jsonl``, and results.csv rewritten with the rows so far); a
sweep stopped by SIGTERM or Ctrl-C exits 143 / 130 keeping them, and run again
into the same directory (same scenario and mode) it runs only the points not
done (``--fresh`` runs them all). The output directory is locked while a sweep
writes it.

Outputs, in the output directory: ``results.csv`` (a row per point),
``results.md`` (the same as a Markdown table), ``throughput.png`` (examples/s
against the quantity the sweep varies: chips, else the batch, ...),
``efficiency.png`` (scaling efficiency against chips, when they vary) and
``breakdown.png`` (the simulated step's critical path of every point, stacked
by part, one panel per series).

Scaling efficiency of a point = its examples/s per chip divided by that of
the smallest-chip point of its series (same chip generation, algorithm,
precision and batch). It is 1 for perfect weak or strong scaling.

Every row says what bounds its step (``pod.report.bounds``): the share of
the simulated critical path that is MXU, VPU or HBM work, ICI bandwidth
(with the torus axes of the busiest links), latency (per-hop, fixed
per-collective and per-op issue costs) or the host (dispatch, exposed
infeed); ``bounds.png`` stacks those shares per point and results.csv has
them per row.
"""

from __future__ import annotations

import csv
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from statistics import fmean
from typing import Any

from pod.commands.interrupt import RaiseOnSignals
from pod.commands.sweep_journal import SweepJournal, point_key
from pod.config.mesh import build_mesh, format_axes
from pod.config.plan import build_plan, training_sections
from pod.config.scenario import Scenario, SweepConfig
from pod.config.slices import resolve_pod
from pod.errors import USER_ERRORS, HBMPlanError, RunInterrupted, ScenarioError
from pod.report.bounds import BOUND_CATEGORIES, StepBounds, step_bounds
from pod.report.console import algorithms_text
from pod.report.files import check_writable, write_atomic
from pod.report.stats import AXIS_ORDER, MAXTEXT_FORMULAS, StepStats, mean_step
from pod.safe_io import lock_directories

__all__ = ["SweepPoint", "sweep_points", "run_sweep", "COLUMNS", "TEXT_COLUMNS", "empty_row",
           "is_missing", "csv_row", "json_row", "sweep_kind", "step_row", "plot_layouts", "ms_text",
           "point_line"]

COLUMNS = (
    "point", "status", "error", "model", "dataset", "synthetic_data", "generation", "slice",
    "chips", "cores", "topology", "allreduce_algorithm", "collective_algorithms", "precision",
    "global_batch", "per_device_batch", "simulated_step_seconds", "infeed_seconds",
    "compute_seconds", "collective_seconds", "exposed_collective_seconds", "update_seconds",
    "serial_step_seconds", "overlap_fraction", "simulated_epoch_seconds",
    "simulated_examples_per_second",
    "simulated_tflops", "maxtext_tflops_per_device", "maxtext_tflops_formula",
    "maxtext_2023_tflops_per_device", "mfu", "communication_fraction",
    "scaling_efficiency",
    "bound", "bound_fraction", "ici_axes",
    *(f"{c}_bound_seconds" for c in BOUND_CATEGORIES),
    "wall_seconds", "wall_seconds_per_step",
) + (
    # layouts (sweep.mesh / remat / per_device_batch): the parameters, tokens,
    # exposed and total collective seconds per mesh axis, one device's HBM plan
    "mesh", *AXIS_ORDER, "remat", "fits",
    "hbm_per_device_bytes", "simulated_tokens_per_second", "hfu",
    # pipelines (a stage axis; sweep.microbatches): the microbatches, the bubble's
    # seconds and its share of the forward and backward passes
    "microbatches", "pipeline_bubble_seconds", "pipeline_bubble_fraction",
    *(f"exposed_{a}_seconds" for a in AXIS_ORDER),
    *(f"collective_{a}_seconds" for a in AXIS_ORDER),
    # multislice (pod.slices; sweep.num_slices): the slices, the axes across them, and
    # the DCN part of the collective seconds (every axis's, summed)
    "slices", "dcn_mesh", "dcn_collective_seconds",
)

#: The mesh axes of the per-axis columns.
_AXES = AXIS_ORDER

#: Columns of text (or true / false); every other column is a number, NaN when a point has
#: none (a failed point, a column of another kind of sweep): ``pd.DataFrame(rows)["mfu"].max()``
#: works on any sweep. results.csv writes a missing value as an empty field.
TEXT_COLUMNS = frozenset({"status", "error", "model", "dataset", "synthetic_data", "generation",
                          "slice", "topology", "allreduce_algorithm", "collective_algorithms",
                          "maxtext_tflops_formula", "precision", "bound",
                          "ici_axes", "mesh", "remat", "fits", "dcn_mesh"})


def empty_row() -> dict[str, Any]:
    """A row before its point runs: "" for the text columns, NaN for the numbers."""
    return {key: "" if key in TEXT_COLUMNS else math.nan for key in COLUMNS}


def is_missing(value: Any) -> bool:
    """Whether a row value is missing: None, "" or NaN."""
    return value is None or value == "" or (isinstance(value, float) and math.isnan(value))


def csv_row(row: dict[str, Any]) -> dict[str, Any]:
    """The row as results.csv writes it: a missing number is an empty field."""
    return {k: "" if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()}


def json_row(row: dict[str, Any]) -> dict[str, Any]:
    """The row as ``--json`` prints it: a missing number is null (JSON has no NaN)."""
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()}


#: Where a point's batch value (per core, per device or global, as the sweep sets it) sits
#: in ``SweepPoint.series``.
_SERIES_BATCH = 3


@dataclass(frozen=True)
class SweepPoint:
    """One point of a sweep: its label, the values it sets, its scenario (or error)."""

    index: int
    values: dict[str, Any]
    scenario: Scenario | None
    error: str = ""
    series: tuple = field(default=())


def _sweep_of(scenario: Scenario) -> SweepConfig:
    """The scenario's ``sweep:`` block.

    Raises:
        ScenarioError: not a training scenario with a sweep block.
    """
    if scenario.sweep is None or scenario.training is None:
        raise ScenarioError(f"{scenario.name}: a sweep needs a training scenario with a "
                            "sweep: block")
    return scenario.sweep


def _pods(scenario: Scenario) -> list[dict[str, Any]]:
    sweep = _sweep_of(scenario)
    if sweep.slices:
        return [{"pod__slice": s, "pod__chip": None, "pod__chips": None, "pod__topology": None}
                for s in sweep.slices]
    chip = scenario.pod.chip
    if (sweep.chips or sweep.topologies) and not chip:
        if not scenario.pod.slice:
            raise ScenarioError("sweep: chips and topologies need pod.chip")
        chip = resolve_pod(slice_name=scenario.pod.slice).chip.name
    if sweep.chips:
        return [{"pod__slice": None, "pod__chip": chip, "pod__chips": n, "pod__topology": None}
                for n in sweep.chips]
    if sweep.topologies:
        return [{"pod__slice": None, "pod__chip": chip, "pod__chips": None, "pod__topology": t}
                for t in sweep.topologies]
    return [{}]


def sweep_points(scenario: Scenario) -> list[SweepPoint]:
    """Expand a scenario's ``sweep:`` block into its points (cartesian product).

    Args:
        scenario: a training scenario with a ``sweep`` block.

    Returns:
        The points in order: pods vary slowest, then algorithm, batch, precision.
        A point whose values make an invalid scenario carries the error.

    Raises:
        ScenarioError: the scenario has no sweep block or no training section.
    """
    sweep = _sweep_of(scenario)
    training = training_sections(scenario)[1]
    algorithms = sweep.allreduce or (scenario.pod.allreduce,)
    batches: tuple[int, ...]
    if sweep.per_device_batch:
        batches = sweep.per_device_batch
    elif sweep.scaling == "weak":  # a batch value is examples per TensorCore
        assert sweep.per_core_batch is not None  # SweepConfig: weak scaling needs one of the two
        batches = sweep.per_core_batch
    else:
        batches = sweep.global_batch or (training.global_batch,)
    precisions = sweep.precision or (training.precision,)
    meshes = sweep.mesh or (scenario.pod.mesh,)
    remats = sweep.remat or (None,)
    micros = sweep.microbatches or (None,)
    counts: tuple[int | None, ...] = sweep.num_slices or (None,)
    points: list[SweepPoint] = []
    base = {"training__steps": sweep.steps, "metrics__port": 0, "sweep": None}
    seen: set[str] = set()
    pipelined = bool(sweep.microbatches or training.microbatches
                     or training.pipeline_schedule != "gpipe" or training.pipeline_repeats != 1
                     or training.pipeline_fsdp_ag_once)
    for pod, count, mesh, remat, algorithm, per_point, precision, micro in itertools.product(
            _pods(scenario), counts, meshes, remats, algorithms, batches, precisions, micros):
        if sweep.microbatches and (mesh or {}).get("stage", 1) == 1:
            key = repr((pod, count, mesh, remat, algorithm, per_point, precision))
            if key in seen:  # a mesh without stages runs once, whatever the microbatches
                continue
            seen.add(key)
        i = len(points)
        batch = per_point
        values = {**pod, "pod__allreduce": algorithm, "training__precision": precision}
        if count is not None:
            values.update(pod__slices=count, pod__dcn_mesh=_dcn_mesh(scenario, count))
        if sweep.mesh:
            values["pod__mesh"] = mesh
        if sweep.mesh and (mesh or {}).get("stage", 1) == 1:  # no stages: no pipeline
            if pipelined:
                values.update(training__microbatches=None, training__pipeline_schedule="gpipe",
                              training__pipeline_repeats=1,
                              training__pipeline_fsdp_ag_once=False)
        elif micro is not None:
            values["training__microbatches"] = micro
        if remat is not None:
            values["model__options"] = {**(scenario.model.options if scenario.model else {}),
                                        "remat": remat}
        try:
            if sweep.per_device_batch:  # x data x fsdp of the point's mesh
                batch = per_point * _batch_shards(scenario.with_overrides(**base, **values))
            elif sweep.scaling == "weak":
                cores = _resolve(scenario.with_overrides(**base, **values).pod).tensorcores
                batch = batch * cores  # per_core_batch x TensorCores
            values["training__global_batch"] = batch
            point = scenario.with_overrides(**base, **values)
            error = ""
        except USER_ERRORS as err:
            point, error = None, str(err)
        series = (_generation(pod, scenario), algorithm, precision, per_point,
                  format_axes(mesh) if sweep.mesh and mesh is not None else "", remat or "",
                  micro or "")  # _SERIES_BATCH: per_point
        points.append(SweepPoint(i, values, point, error, series))
    return points


def _batch_shards(scenario: Scenario) -> int:
    """The devices that split the batch: data x fsdp x expert of the scenario's mesh
    (every slice's)."""
    shape = scenario.pod
    return build_mesh(shape.mesh, _resolve(shape), shape.dcn_mesh).batch_shards


def _resolve(shape: Any) -> Any:
    """The ``Topology`` of a scenario's ``pod`` block, its slices included."""
    return resolve_pod(slice_name=shape.slice, chip=shape.chip, chips=shape.chips,
                       topology=shape.topology, slices=shape.slices)


def _dcn_mesh(scenario: Scenario, slices: int) -> dict[str, int] | None:
    """``pod.dcn_mesh`` of a ``sweep.num_slices`` point of ``slices`` slices: the
    scenario's one axis across slices (``data`` without ``pod.dcn_mesh``) that long;
    None for one slice.

    Raises:
        ScenarioError: the scenario's ``pod.dcn_mesh`` splits the slices over several
            axes (which of them would grow is not said).
    """
    given = {a: n for a, n in (scenario.pod.dcn_mesh or {}).items() if n > 1}
    if len(given) > 1:
        raise ScenarioError(f"sweep.num_slices: pod.dcn_mesh {format_axes(given)} splits the "
                            "slices over several axes; give pod.dcn_mesh one axis (e.g. "
                            "{data: 2}) to sweep the number of slices")
    if slices == 1:
        return None
    return {next(iter(given), "data"): slices}


def _generation(pod: dict[str, Any], scenario: Scenario) -> str:
    """The chip generation of a point's pod values (its series splits by it)."""
    if pod.get("pod__slice"):
        return resolve_pod(slice_name=pod["pod__slice"]).chip.name
    return pod.get("pod__chip") or scenario.pod.chip or ""


def _mean_bounds(plan, stats) -> StepBounds:
    """The steps' bounds, seconds averaged (``pod.report.bounds``)."""
    each = [step_bounds(s, plan.collective_costs_at(s.step), plan.topology.torus) for s in stats]
    seconds = {c: fmean(b.seconds[c] for b in each) for c in BOUND_CATEGORIES}
    return StepBounds(seconds, each[-1].ici_axes)


def _run_point(point: SweepPoint, mode: str, epoch_examples: int | None) -> dict[str, Any]:
    """Cost or train one point; returns its row (without scaling efficiency).

    The epoch time is the step time x the full global batches in an epoch of
    ``epoch_examples`` (default: the train split), as with drop_remainder.
    """
    t0 = time.perf_counter()
    assert point.scenario is not None  # the caller runs the points that have one
    plan = build_plan(point.scenario, timing_only=(mode == "timing"))
    if mode == "timing":
        from pod.runtime.timing import TimingPod  # no Ray in timing-only mode

        timing = TimingPod(plan)
        stats = [timing.step(s) for s in range(plan.steps)]
    else:
        from pod.runtime.admission import admit
        from pod.runtime.pod import Pod

        admit(plan)  # before any actor: the point's row says how many chips fit
        with Pod(plan) as pod:
            stats = [pod.step(s) for s in range(plan.steps)]
    return step_row(plan, stats, time.perf_counter() - t0, epoch_examples)


def step_row(plan, steps: list, wall: float, epoch_examples: int | None = None) -> dict[str, Any]:
    """A point's row from its plan and its steps (``StepStats``; their mean step,
    ``mean_step``: the steps after the first), ``wall`` seconds of emulation (``tpu-pod
    plan`` costs its points through it too). Every figure is the mean step's property."""
    mean = mean_step(steps)
    timed = steps[1:] or steps
    epoch = epoch_examples or plan.dataset.x_train.shape[0]
    bounds = _mean_bounds(plan, timed)
    return {
        "model": plan.model.name, "bound": bounds.label, "bound_fraction": bounds.fraction,
        "ici_axes": bounds.ici_axes,
        **{f"{c}_bound_seconds": bounds.seconds[c] for c in BOUND_CATEGORIES},
        "simulated_epoch_seconds": mean.step_seconds * max(1, epoch // plan.global_batch),
        "status": "ok", "error": "", "dataset": plan.dataset.name,
        "synthetic_data": bool(plan.dataset.synthetic),
        "generation": plan.topology.chip.name, "chips": plan.topology.chips,
        "cores": plan.topology.tensorcores, "topology": plan.topology.torus.name,
        "slice": plan.topology.slice_name or plan.topology.name,
        "allreduce_algorithm": plan.collective_costs.algorithms().get("data", ""),
        "collective_algorithms": algorithms_text(plan.collective_costs.algorithms()),
        "precision": plan.training.precision, "global_batch": plan.global_batch,
        "simulated_step_seconds": mean.step_seconds,
        "infeed_seconds": mean.infeed_seconds,
        "compute_seconds": mean.compute_seconds,
        "collective_seconds": mean.collective_seconds,
        "exposed_collective_seconds": mean.exposed_collective_seconds,
        "serial_step_seconds": mean.serial_step_seconds,
        "overlap_fraction": mean.overlap_fraction,
        "update_seconds": mean.update_seconds,
        "simulated_examples_per_second": mean.examples_per_second,
        "simulated_tflops": mean.tflops,
        "maxtext_tflops_per_device": mean.maxtext_tflops_per_device or math.nan,
        "maxtext_2023_tflops_per_device": mean.maxtext_2023_tflops_per_device or math.nan,
        "maxtext_tflops_formula": (MAXTEXT_FORMULAS["maxtext_tflops_per_device"]
                                   if mean.maxtext_flops_per_device else ""),
        "mfu": mean.mfu,
        "communication_fraction": mean.communication_fraction,
        "wall_seconds": wall,
        "wall_seconds_per_step": mean.wall_seconds,
        **_layout_columns(plan, mean),
        **_pipeline_columns(plan, mean),
        "slices": plan.mesh.slices,
        "dcn_mesh": format_axes(plan.mesh.dcn_sizes) if plan.mesh.slices > 1 else "",
        "dcn_collective_seconds": sum(mean.axis_dcn_seconds.values()),
    }


def _pipeline_columns(plan, mean: StepStats) -> dict[str, Any]:
    """A pipeline's microbatches and bubble (NaN without a stage axis)."""
    from pod.config.pipeline import pipeline_microbatches

    if plan.mesh.axis_size("stage") == 1:
        return {}
    return {"microbatches": pipeline_microbatches(plan.training, plan.mesh),
            "pipeline_bubble_seconds": mean.pipeline_bubble_seconds,
            "pipeline_bubble_fraction": mean.pipeline_bubble_fraction}


def _layout_columns(plan, mean: StepStats) -> dict[str, Any]:
    """The mesh, remat, per-device batch, HBM, tokens/s and per-axis columns of a point."""
    mesh = plan.mesh
    options = plan.scenario.model.options if plan.scenario.model else {}
    row = {"mesh": format_axes(mesh.sizes), "remat": options.get("remat", ""),
           "fits": True, "hbm_per_device_bytes": int(plan.memory["total"]),
           "simulated_tokens_per_second": mean.tokens_per_second or math.nan,
           "hfu": mean.hfu, "per_device_batch": plan.per_device_batch}
    for axis in _AXES:
        row[axis] = mesh.axis_size(axis)
        row[f"exposed_{axis}_seconds"] = mean.axis_exposed_seconds.get(axis, 0.0)
        row[f"collective_{axis}_seconds"] = mean.axis_collective_seconds.get(axis, 0.0)
    return row


def _efficiency(rows: list[dict[str, Any]], points: list[SweepPoint]) -> None:
    best: dict[tuple, dict[str, Any]] = {}
    for row, point in zip(rows, points, strict=False):
        if row["status"] != "ok":
            continue
        ref = best.get(point.series)
        if ref is None or row["chips"] < ref["chips"]:
            best[point.series] = row
    for row, point in zip(rows, points, strict=False):
        ref = best.get(point.series)
        if row["status"] == "ok" and ref is not None:
            row["scaling_efficiency"] = ((row["simulated_examples_per_second"] / row["chips"])
                                         / (ref["simulated_examples_per_second"] / ref["chips"]))


def run_sweep(scenario: Scenario, output_dir: Path, *, mode: str | None = None,
              on_point: Callable[[dict[str, Any]], None] | None = None, fresh: bool = False,
              on_resume: Callable[[int, Path], None] | None = None,
              warn: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Run every point of a sweep and write results.csv, results.md and the plots.

    The output directory is locked for the sweep (``pod.safe_io.lock_directories``).
    Each point's row is on disk as soon as it finishes: appended to
    ``sweep-journal.jsonl`` (``SweepJournal``) and results.csv rewritten whole
    with the rows so far. Run again into the same directory, the sweep reuses the
    rows of the points already done (same scenario and mode) and runs the rest.
    SIGINT / SIGTERM stop it at once with ``RunInterrupted`` (exit 130 / 143),
    the finished rows kept.

    Args:
        scenario: a training scenario with a ``sweep`` block.
        output_dir: where the files go (created).
        mode: "timing" or "functional" (default: the sweep block's).
        on_point: called with each finished row (progress), reused ones included.
        fresh: run every point again, ignoring the rows of an earlier run.
        on_resume: called with the number of reused rows and the journal, if any.
        warn: called with one line per damaged row of the journal (that point runs again).

    Returns:
        The rows, one per point, with the keys of ``COLUMNS``.

    Raises:
        ScenarioError: the scenario is not a sweep.
        DirectoryInUseError: another run or sweep holds ``output_dir``.
        RunInterrupted: SIGINT / SIGTERM (after keeping the finished rows).
    """
    points = sweep_points(scenario)
    mode = mode or _sweep_of(scenario).mode
    with lock_directories(output_dir), RaiseOnSignals():
        check_writable(output_dir)  # before the first point, not after the last
        journal = SweepJournal(output_dir, scenario, mode, COLUMNS, fresh=fresh,
                               text_columns=TEXT_COLUMNS)
        for line in journal.damage:
            if warn is not None:
                warn(f"warning: {line}")
        if journal.rows and on_resume is not None:
            on_resume(sum(point_key(p.values) in journal.rows for p in points), journal.path)
        rows: list[dict[str, Any]] = []
        try:
            for point in points:
                row = journal.done(point.values)
                if row is None:
                    row = _point_row(scenario, point, mode)
                    journal.record(point.values, row)
                rows.append(row)
                _write_results_csv(output_dir, rows, points)
                if on_point:
                    on_point(row)
        except RunInterrupted as err:
            raise RunInterrupted(err.signum, f"{err}; {len(rows)} of {len(points)} points kept "
                                 f"in {output_dir / 'results.csv'} (run the sweep again to do "
                                 "the rest)") from None
        _efficiency(rows, points)
        _write_results_csv(output_dir, rows, points)
        table = markdown_table(scenario, rows, mode)
        write_atomic(output_dir / "results.md", lambda f: f.write(table))
        plot(scenario, rows, output_dir)
    return rows


def _point_row(scenario: Scenario, point: SweepPoint, mode: str) -> dict[str, Any]:
    """Run one point; its row (a failed point's row carries its error)."""
    row = empty_row()
    row.update(point=point.index + 1, **_labels(point))
    sweep = _sweep_of(scenario)
    if sweep.per_device_batch:
        row["per_device_batch"] = point.series[_SERIES_BATCH]  # the point's, even if it fails
    if point.error:
        row.update(status="failed", error=point.error)
        return row
    try:
        row.update(_run_point(point, mode, sweep.epoch_examples))
    except HBMPlanError as err:  # the layout does not fit: say why and how much
        row.update(status="failed", error=str(err), fits=False,
                   hbm_per_device_bytes=(err.memory_plan or {}).get("total", math.nan))
    except USER_ERRORS as err:
        row.update(status="failed", error=str(err))
    return row


def _write_results_csv(output_dir: Path, rows: list[dict[str, Any]],
                       points: list[SweepPoint]) -> None:
    """results.csv with the rows so far (scaling efficiency among them), whole or not
    at all (``write_atomic``)."""
    rows = [dict(r) for r in rows]
    _efficiency(rows, points[:len(rows)])

    def write_rows(f) -> None:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(map(csv_row, rows))

    write_atomic(output_dir / "results.csv", write_rows, newline="")


def _save_png(fig: Any, path: Path) -> None:
    """Write a figure as PNG whole or not at all (``pod.safe_io.write_atomic``): a full
    disk is one ``OutputError`` line, never a truncated PNG."""
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=110, bbox_inches="tight"),
                 binary=True)


def _labels(point: SweepPoint) -> dict[str, Any]:
    """A point's own values (mesh, remat, precision, batch, pod), known before it runs, so
    that a failed point's row says what it was."""
    v = point.values
    mesh = v.get("pod__mesh")
    layout = {"mesh": format_axes(mesh), **{a: mesh.get(a, 1) for a in _AXES}} if mesh else {}
    if "model__options" in v:
        layout["remat"] = v["model__options"].get("remat", "")
    if v.get("training__microbatches") is not None:
        layout["microbatches"] = v["training__microbatches"]
    if v.get("pod__slices") is not None:
        layout["slices"] = v["pod__slices"]
    return {**layout, "precision": v.get("training__precision", ""),
            "global_batch": v.get("training__global_batch", math.nan), **_pod_labels(point)}


def _pod_labels(point: SweepPoint) -> dict[str, Any]:
    """The chips, cores, torus, generation and slice of a point's pod (its values as far
    as they go when the pod does not resolve)."""
    v = point.values
    source = point.scenario.pod if point.scenario is not None else None
    name = v.get("pod__slice") or (source.slice if source else None)
    try:
        pod = _resolve(source) if source is not None else resolve_pod(slice_name=name)
    except USER_ERRORS:
        return {"chips": v.get("pod__chips") or math.nan, "topology": v.get("pod__topology") or "",
                "generation": point.series[0] if point.series else "", "slice": name or ""}
    return {"chips": pod.chips, "cores": pod.tensorcores, "topology": pod.torus.name,
            "generation": pod.chip.name, "slice": pod.slice_name or pod.name}


def _cell(value: Any, spec: str = "") -> str:
    """A row value in a Markdown cell (formatted by ``spec``): empty when missing."""
    return "" if is_missing(value) else format(value, spec)


def _distinct(values) -> int:
    """How many different values (every missing one counts as one)."""
    return len({None if is_missing(v) else v for v in values})


def sweep_kind(scenario: Scenario) -> str:
    """What a sweep is, for titles: "strong scaling" / "weak scaling" when its pods differ;
    "one point"; else what it varies ("a sweep of mesh, remat and per-device batch")."""
    sweep = _sweep_of(scenario)
    if len(_pods(scenario)) > 1:
        return f"{sweep.scaling} scaling"
    if sweep.num_slices and len(sweep.num_slices) > 1:
        return f"{sweep.scaling} scaling over slices"
    varied = [label for label, values in (
        ("mesh", sweep.mesh), ("remat", sweep.remat), ("per-device batch", sweep.per_device_batch),
        ("microbatches", sweep.microbatches),
        ("global batch", sweep.global_batch), ("per-core batch", sweep.per_core_batch),
        ("precision", sweep.precision), ("allreduce", sweep.allreduce))
        if values and len(values) > 1]
    if not varied:
        return "one point"
    return "a sweep of " + (", ".join(varied[:-1]) + " and " + varied[-1] if len(varied) > 1
                            else varied[0])


def ms_text(seconds: Any) -> str:
    """Simulated seconds as milliseconds with four significant digits or so: ``5,897``,
    ``26.70``, ``0.0720``; "" when missing."""
    if is_missing(seconds):
        return ""
    ms = float(seconds) * 1e3
    return (f"{ms:,.0f}" if ms >= 1000 else f"{ms:.1f}" if ms >= 100 else f"{ms:.2f}"
            if ms >= 1 else f"{ms:.4f}")


def point_line(row: dict[str, Any], total: int) -> str:
    """A sweep point's progress line (``tpu-pod sweep``): where it ran, its collectives'
    algorithms, its simulated step, rate (tokens/s for a language model), MFU, MaxText's
    TFLOP/s per device (its formula said) and, for a sharded layout, the layout and its
    HBM per device."""
    if row["status"] != "ok":
        return f"point {row['point']}/{total}: failed: {row['error']}"
    tokens = not is_missing(row.get("simulated_tokens_per_second"))
    rate = (f"{row['simulated_tokens_per_second']:,.0f} tokens/s" if tokens else
            f"{row['simulated_examples_per_second']:,.0f} examples/s")
    tflops = ("" if is_missing(row.get("maxtext_tflops_per_device")) else
              f", {row['maxtext_tflops_per_device']:,.1f} TFLOP/s/device (MaxText, attention "
              "not halved)")
    line = (f"point {row['point']}/{total}: {row['slice'] or row['generation']} "
            f"{row['chips']:,} chips {row['topology']} {row['collective_algorithms'] or '-'} "
            f"batch {row['global_batch']:,}: sim {ms_text(row['simulated_step_seconds'])} "
            f"ms/step, {rate}, MFU {row['mfu']:.2%}{tflops}")
    if not is_missing(row.get("per_device_batch")):  # a sharded layout
        line += (f"; {row['mesh']} remat {row['remat'] or 'none'} {row['per_device_batch']}/device"
                 f", HBM {row['hbm_per_device_bytes'] / 2**30:,.2f} GiB/device")
    return f"{line} (wall {row['wall_seconds']:.2f} s)"


def _rate_column(rows: list[dict[str, Any]]) -> tuple[str, str]:
    """(row key, header) of a sweep's throughput: tokens/s for language models."""
    tokens = any(not is_missing(r.get("simulated_tokens_per_second")) for r in rows
                 if r["status"] == "ok")
    return (("simulated_tokens_per_second", "tokens/s") if tokens
            else ("simulated_examples_per_second", "examples/s"))


def _main_columns(rows: list[dict[str, Any]]
                  ) -> list[tuple[str, str, Callable[[dict[str, Any]], str]]]:
    """results.md's first table for this kind of sweep: (header, alignment, cell of an ok
    row). The epoch only with real data (a synthetic epoch is the data's size, not a
    user's), scaling efficiency only when the chips vary (it is 1 by definition
    otherwise), the rate in tokens/s for a language model."""
    ok = [r for r in rows if r["status"] == "ok"]
    rate_key, rate = _rate_column(rows)
    synthetic = any(r.get("synthetic_data") is True for r in ok)
    chips_vary = _distinct(r["chips"] for r in ok) > 1
    columns: list[tuple[str, str, Callable[[dict[str, Any]], str]]] = [
        ("step ms", "---:", lambda r: ms_text(r["simulated_step_seconds"])),
        ("compute ms", "---:", lambda r: ms_text(r["compute_seconds"])),
        ("collectives ms", "---:", lambda r: ms_text(r["collective_seconds"])),
        *([("epoch s", "---:", lambda r: f"{r['simulated_epoch_seconds']:,.2f}")]
          if not synthetic else []),
        (rate, "---:", lambda r: f"{r[rate_key]:,.0f}"),
        _tflops_column(ok),
        ("MFU", "---:", lambda r: f"{r['mfu']:.1%}"),
        ("comm %", "---:", lambda r: f"{r['communication_fraction']:.1%}"),
        *([("efficiency", "---:", lambda r: _cell(r["scaling_efficiency"], ".2f"))]
          if chips_vary else []),
        ("bound", "---", lambda r: f"{r['bound']} {r['bound_fraction']:.0%}"),
        ("wall s", "---:", lambda r: f"{r['wall_seconds']:.2f}")]
    return columns


def _tflops_column(ok: list[dict[str, Any]]
                   ) -> tuple[str, str, Callable[[dict[str, Any]], str]]:
    """results.md's TFLOP/s: per device as MaxText prints it where the model has MaxText's
    formula (a transformer: the figure a MaxText user compares, not the pod's 159,211),
    else the pod's simulated model TFLOP/s, said so."""
    if ok and all(not is_missing(r.get("maxtext_tflops_per_device")) for r in ok):
        return ("TFLOP/s / device (MaxText)", "---:",
                lambda r: f"{r['maxtext_tflops_per_device']:,.1f}")
    return ("TFLOP/s (pod)", "---:", lambda r: f"{r['simulated_tflops']:,.2f}")


def markdown_table(scenario: Scenario, rows: list[dict[str, Any]], mode: str) -> str:
    """The results as a Markdown table (simulated figures; wall seconds last), with the
    columns that mean something for this kind of sweep (``_main_columns``)."""
    synthetic = any(r.get("synthetic_data") is True for r in rows)
    data = f"data: {scenario.data.name}" + (" (SYNTHETIC: the data only set shapes)" if synthetic
                                           else "")
    columns = _main_columns(rows)
    head = ["#", "chip", "chips", "cores", "topology", "collectives", "global batch",
            *(c[0] for c in columns), "status"]
    align = ["---", "---", "---:", "---:", "---", "---", "---:", *(c[1] for c in columns), "---"]
    lines = [f"# Sweep: {scenario.name} ({sweep_kind(scenario)}, {mode} mode)", "",
             f"Simulated figures unless marked wall; model "
             f"{training_sections(scenario)[0].name}, {data}.", "",
             "| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
    for r in rows:
        where = [str(r["point"]), str(r["generation"]), _cell(r["chips"]), _cell(r.get("cores")),
                 str(r["topology"]), str(r.get("collective_algorithms") or
                                         r.get("allreduce_algorithm") or ""),
                 _cell(r["global_batch"])]
        if r["status"] == "ok":
            cells = [cell(r) for _, _, cell in columns] + ["ok"]
        else:
            error = str(r["error"]).replace("|", "/")
            cells = [""] * len(columns) + [f"failed: {error}"]
        lines.append("| " + " | ".join(where + cells) + " |")
    return "\n".join(lines) + "\n" + _layout_table(rows) + _slices_table(rows)


def _layout_table(rows: list[dict[str, Any]]) -> str:
    """The sharded columns as a second table (rows with a layout only)."""
    rows = [r for r in rows if r.get("mesh") and r.get("mesh") != f"{{data: {r.get('data')}}}"
            or r.get("fits") is False]
    if not rows:
        return ""
    out = ["", "Sharded layouts (simulated; exposed = collective time the compute waited for):",
           "", "| # | chips | mesh | remat | batch / device | microbatches | step ms | tokens/s | "
           f"MFU | bubble | exposed {' / '.join(_AXES)} ms | HBM GiB / device | status |",
           "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---|---:|---|"]
    for r in rows:
        hbm_bytes: Any = r.get("hbm_per_device_bytes")  # a number unless missing
        hbm = "" if is_missing(hbm_bytes) else f"{hbm_bytes / 2**30:.1f}"
        if r["status"] == "ok":
            exposed = " / ".join(f"{1e3 * r[f'exposed_{a}_seconds']:.1f}" for a in _AXES)
            out.append(f"| {r['point']} | {r['chips']} | {r['mesh']} | {r['remat']} | "
                       f"{r['per_device_batch']} | {_cell(r.get('microbatches'))} | "
                       f"{ms_text(r['simulated_step_seconds'])} | "
                       f"{_cell(r['simulated_tokens_per_second'], ',.0f')} | {r['mfu']:.1%} | "
                       f"{_cell(r.get('pipeline_bubble_fraction'), '.0%')} | {exposed} | "
                       f"{hbm} | ok |")
        else:
            why = str(r["error"]).replace("|", "/")
            out.append(f"| {r['point']} | {_cell(r['chips'])} | {r['mesh']} | "
                       f"{r.get('remat', '')} | "
                       f"{_cell(r['per_device_batch'])} | {_cell(r.get('microbatches'))} | | | | | "
                       f"| {hbm} | {'does not fit' if r.get('fits') is False else 'failed'}"
                       f": {why} |")
    return "\n".join(out) + "\n"


def _slices_table(rows: list[dict[str, Any]]) -> str:
    """The slices, the axes across them and the DCN seconds as a third table (a sweep
    with a point of several slices only)."""
    if not any(not is_missing(r.get("slices")) and r.get("slices", 1) > 1 for r in rows):
        return ""
    out = ["", "Slices joined by the data-centre network (simulated; the DCN seconds are part "
           "of the collectives, hidden or not):", "",
           "| # | slices | chips | DCN mesh | step s | tokens/s | MFU | DCN s | exposed "
           "collectives s | status |", "|---|---:|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if r["status"] == "ok":
            out.append(f"| {r['point']} | {r['slices']} | {r['chips']:,} | "
                       f"{r['dcn_mesh'] or '-'} | "
                       f"{r['simulated_step_seconds']:.4f} | "
                       f"{_cell(r['simulated_tokens_per_second'], ',.0f')} | {r['mfu']:.2%} | "
                       f"{r['dcn_collective_seconds']:.4f} | "
                       f"{r['exposed_collective_seconds']:.4f} | ok |")
        else:
            why = str(r["error"]).replace("|", "/")
            out.append(f"| {r['point']} | {_cell(r.get('slices'))} | {_cell(r['chips'])} | | | | "
                       f"| | | failed: {why} |")
    return "\n".join(out) + "\n"


#: a colour per bound category (``pod.report.bounds.BOUND_CATEGORIES``) in bounds.png
BOUND_COLOURS = {"mxu": "tab:green", "vpu": "tab:olive", "hbm": "tab:orange", "ici": "tab:red",
                 "latency": "tab:purple", "host": "tab:grey", "bubble": "tab:brown"}


def _series(scenario: Scenario, ok: list[dict[str, Any]],
            x_key: str) -> dict[str, list[dict[str, Any]]]:
    """Rows grouped by what else the sweep varies, each sorted along the x axis; a
    label names each such quantity in full (the algorithm alone when nothing else)."""
    # a point without the quantity (no data axis: no allreduce algorithm) is no other series
    varying = [(k, label) for k, label in _dimensions(scenario)
               if k != x_key and _distinct(r[k] for r in ok if r[k] not in ("", None)) > 1]
    series: dict[str, list[dict[str, Any]]] = {}
    # nothing else varies: one series, named by its algorithms if every point has the same
    # (a point without a data axis names fewer axes; it is not another series)
    algorithms = {str(r["collective_algorithms"] or "") for r in ok}
    algorithms.discard("")
    alone = algorithms.pop() if len(algorithms) == 1 else "every point"
    shared = []  # points without a varying quantity (1 chip: no allreduce): in every series
    for r in ok:
        if any(r[k] in ("", None) for k, _ in varying):
            shared.append(r)
            continue
        parts = [f"{label} {r[k]:,}" if isinstance(r[k], int) else str(r[k])
                 for k, label in varying]
        series.setdefault(", ".join(parts) or alone, []).append(r)
    for rs in series.values() if series else [series.setdefault(alone, [])]:
        rs.extend(shared)
    for rs in series.values():
        rs.sort(key=lambda r: (r[x_key] if isinstance(r[x_key], (int, float)) else 0))
    return series


def _horizontal(labels: list[str]) -> bool:
    """Whether bars with these labels lie (labels on the y axis, read across): a label
    longer than a number or a short name, or more bars than fit side by side."""
    return len(labels) > 12 or max((len(label) for label in labels), default=0) > 9


def _bar_figure(plt: Any, labels: list[str], panels: int = 1) -> tuple[Any, Any]:
    """A figure for ``panels`` panels of a stacked bar per label, sized so that every label
    reads at its default size: a row of 0.3 inch per bar when they lie, 0.6 inch of width
    per bar when they stand."""
    if _horizontal(labels):
        return plt.subplots(panels, 1, squeeze=False,
                            figsize=(9, panels * (0.3 * len(labels) + 1.4) + 0.6))
    # a label of n characters is about 0.09 n inch wide at the default 10 points
    per_bar = max(0.6, 0.1 * max((len(label) for label in labels), default=1) + 0.15)
    return plt.subplots(panels, 1, squeeze=False,
                        figsize=(max(7.0, per_bar * len(labels) + 1.5), 3.2 * panels + 0.6))


def _stacked_bars(ax: Any, labels: list[str],
                  parts: list[tuple[str, list[float], str | None]]) -> list[float]:
    """A stacked bar per label, in order (top to bottom when they lie: ``_horizontal``);
    ``parts`` is [(legend label, a value per bar, colour or None)], a part of no value
    anywhere left out of the legend. Returns the bars' ends."""
    ends = [0.0] * len(labels)
    lie = _horizontal(labels)
    for label, values, colour in parts:
        shown = label if any(values) else None
        if lie:
            ax.barh(range(len(labels)), values, left=ends, label=shown, color=colour)
        else:
            ax.bar(range(len(labels)), values, bottom=ends, label=shown, color=colour)
        ends = [e + v for e, v in zip(ends, values, strict=True)]
    if lie:
        ax.set_yticks(range(len(labels)), labels, fontsize=8)
        ax.set_ylim(len(labels) - 0.5, -0.5)  # the first on top, no empty rows
    else:
        ax.set_xticks(range(len(labels)), labels)
    return ends


def _legend_beside(ax: Any) -> None:
    """The legend right of the axes, where it hides no bar and no label."""
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def _stacked(plt, ok, parts, labels_of, title, output_dir, name) -> Path:
    """A stacked bar per point: ``parts`` is [(row key, legend label, colour)]."""
    labels = [labels_of(r) for r in ok]
    fig, axes = _bar_figure(plt, labels)
    ax = axes[0, 0]
    _stacked_bars(ax, labels, [(label, [r[key] * 1e3 for r in ok], colour)
                               for key, label, colour in parts])
    unit = "simulated step time (ms)"
    (ax.set_xlabel if _horizontal(labels) else ax.set_ylabel)(unit)
    ax.set_title(title, fontsize=10)
    _legend_beside(ax)
    fig.tight_layout()
    _save_png(fig, output_dir / name)
    plt.close(fig)
    return output_dir / name


def _dimensions(scenario: Scenario) -> list[tuple[str, str]]:
    """What a sweep's points may vary, as (row key, axis label), in the order the plots
    prefer for their x axis. The batch is the one the sweep sets (examples per
    TensorCore in weak scaling, the global batch in strong); the other follows."""
    sweep = _sweep_of(scenario)
    batch = (("per_device_batch", "examples per device") if sweep.scaling == "weak"
             else ("global_batch", "global batch"))
    layout = [(key, label) for key, label, varied in (
        ("mesh", "mesh", sweep.mesh), ("remat", "remat", sweep.remat),
        ("per_device_batch", "per-device batch", sweep.per_device_batch),
        ("microbatches", "microbatches", sweep.microbatches)) if varied]
    return [("chips", "chips"), batch, ("precision", "precision"),
            ("allreduce_algorithm", "allreduce"), ("generation", "chip"), *layout]


def _x_axis(scenario: Scenario, ok: list[dict[str, Any]]) -> tuple[str, str]:
    """The quantity the sweep varies (the plots' x axis): chips if they vary, else the
    batch, else the precision or the algorithm; (row key, axis label)."""
    for key, label in _dimensions(scenario):
        if _distinct(r[key] for r in ok) > 1:
            return key, label
    return "chips", "chips"


def _tick_label(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) else str(value)


def _along_x(ax: Any, xs: list[Any], numeric: bool, label: str) -> None:
    """The x axis: log2 with a tick at every value (chip counts as labels), or categories."""
    if numeric:
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [_tick_label(v) for v in xs])
        ax.minorticks_off()
        # two values closer than a factor 2 (50,944 beside 32,768): their labels would touch
        if any(b < 2 * a for a, b in zip(xs, xs[1:], strict=False)):
            ax.tick_params(axis="x", labelrotation=90)
    ax.set_xlabel(label)


def _bubble(row: dict[str, Any]) -> float:
    """A row's pipeline bubble seconds (0 without a pipeline)."""
    value: Any = row.get("pipeline_bubble_seconds")  # a number unless missing
    return 0.0 if is_missing(value) else float(value)


def _breakdown(plt: Any, scenario: Scenario, series: dict[str, list[dict[str, Any]]],
               x_key: str, x_label: str, output_dir: Path) -> Path:
    """breakdown.png: per series a panel of stacked bars, the critical path's parts (bars
    that lie, labels across, where the labels are layouts)."""
    parts = (("compute", lambda r: r["compute_seconds"]),
             ("collectives, exposed", lambda r: r["exposed_collective_seconds"]),
             ("pipeline bubble", _bubble),
             ("update", lambda r: r["update_seconds"]),
             ("infeed and dispatch, exposed", lambda r: max(0.0, r["simulated_step_seconds"]
                                                            - r["compute_seconds"]
                                                            - r["exposed_collective_seconds"]
                                                            - _bubble(r)
                                                            - r["update_seconds"])))
    longest = max(series.values(), key=len)
    fig, axes = _bar_figure(plt, [_tick_label(r[x_key]) for r in longest], len(series))
    for ax, (label, rs) in zip(axes[:, 0], series.items(), strict=True):
        labels = [_tick_label(r[x_key]) for r in rs]
        _stacked_bars(ax, labels, [(part, [value(r) * 1e3 for r in rs], None)
                                   for part, value in parts])
        lie = _horizontal(labels)
        (ax.set_ylabel if lie else ax.set_xlabel)(x_label)
        (ax.set_xlabel if lie else ax.set_ylabel)("simulated ms per step")
        ax.set_title(label, fontsize=10)
    _legend_beside(axes[0, 0])
    fig.suptitle(f"{scenario.name}: simulated step time, critical path")
    fig.tight_layout()
    _save_png(fig, output_dir / "breakdown.png")
    plt.close(fig)
    return output_dir / "breakdown.png"


def plot(scenario: Scenario, rows: list[dict[str, Any]], output_dir: Path) -> list[Path]:
    """The sweep's plots (PNG), against the quantity it varies (``_x_axis``).

    ``throughput.png``: examples/s (log), a line per series; a layout sweep on one
    pod (``sweep.mesh`` / ``remat`` / ``per_device_batch``) draws a bar per layout
    instead (tokens/s, the best starred, what does not fit said), not a one-point
    series each. ``efficiency.png``: scaling efficiency, only when the chips vary
    (at one pod size it is 1 by definition). ``breakdown.png``: the simulated
    step's critical path (compute, exposed allreduce, update, the rest) stacked
    per point, one panel per series with its own scale, so a small pod's compute
    stays visible beside a large pod's allreduce (a layout sweep: one panel);
    ``bounds.png``: the critical path by what bounds it; transformer sweeps add
    ``tokens.png`` (chips vary) or ``layouts.png``. Titles say what the sweep is
    (``sweep_kind``): "strong scaling" only when the pods differ.

    Returns:
        The files written (none when no point succeeded).
    """
    from pod.report import figures as plt  # pyplot's subplots without pyplot's state

    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return []
    chips_vary = _distinct(r["chips"] for r in ok) > 1
    synthetic = " - synthetic data" if any(r.get("synthetic_data") is True for r in ok) else ""
    title = f"{scenario.name}: {sweep_kind(scenario)} (simulated){synthetic}"
    if not chips_vary and _is_layout_sweep(scenario):
        ok = [{**r, "layout": _layout_label(r)} for r in ok]
        x_key, x_label, series = "layout", "layout", {"every layout that ran": ok}
        written = [_plot_layout_throughput(plt, title, rows, output_dir)]
    else:
        x_key, x_label = _x_axis(scenario, ok)
        series = _series(scenario, ok, x_key)
        written = [_line_plot(plt, ok, series, x_key, x_label, title, output_dir,
                              ("throughput.png", "simulated_examples_per_second",
                               "examples/s (simulated)"))]
    if chips_vary and x_key == "chips":
        written.append(_line_plot(plt, ok, series, x_key, x_label, title, output_dir,
                                  ("efficiency.png", "scaling_efficiency", "scaling efficiency")))
    else:
        (output_dir / "efficiency.png").unlink(missing_ok=True)  # an earlier sweep's
    written.append(_breakdown(plt, scenario, series, x_key, x_label, output_dir))
    # a bar per point, in series order; named by its series too when there are several
    ordered = [(name, r) for name, rs in series.items() for r in rs]
    points = [r for _, r in ordered]
    names = [_tick_label(r[x_key]) + (f" ({name})" if len(series) > 1 else "")
             for name, r in ordered]
    written.append(_stacked(
        plt, points, [(f"{c}_bound_seconds", c, BOUND_COLOURS[c]) for c in BOUND_CATEGORIES],
        lambda r: names[next(i for i, p in enumerate(points) if p is r)],
        f"{scenario.name}: the critical path by what bounds it (simulated)", output_dir,
        "bounds.png"))
    if any(not is_missing(r["simulated_tokens_per_second"]) for r in ok):
        if chips_vary:
            written.append(_plot_tokens(plt, scenario, series, output_dir))
        else:
            written.append(_plot_layouts(plt, scenario, rows, output_dir))
    return written


def _is_layout_sweep(scenario: Scenario) -> bool:
    """Whether the sweep varies sharded layouts (mesh, remat or the per-device batch)."""
    sweep = _sweep_of(scenario)
    return bool(sweep.mesh or sweep.remat or sweep.per_device_batch or sweep.microbatches)


def _layout_label(row: dict[str, Any]) -> str:
    """``{fsdp: 16, tensor: 4} minimal b=4``: a layout's mesh, remat and batch per device."""
    batch = "" if is_missing(row.get("per_device_batch")) else f" b={row['per_device_batch']}"
    micro = "" if is_missing(row.get("microbatches")) else f" M={row['microbatches']}"
    return f"{row['mesh']} {row['remat'] or 'none'}{batch}{micro}"


def _line_plot(plt, ok: list[dict[str, Any]], series: dict[str, list[dict[str, Any]]],
               x_key: str, x_label: str, title: str, output_dir: Path,
               what: tuple[str, str, str]) -> Path:
    """A line per series of ``what`` = (file name, row key, y label) along the x axis."""
    name, key, ylabel = what
    numeric = all(isinstance(r[x_key], (int, float)) for r in ok)
    xs = sorted({r[x_key] for r in ok}, key=lambda v: v if numeric else str(v))
    position = (lambda v: v) if numeric else (lambda v: xs.index(v))  # noqa: E731
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, rs in series.items():
        ax.plot([position(r[x_key]) for r in rs], [r[key] for r in rs], marker="o", label=label)
    if key == "scaling_efficiency":
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        top = max(1.0, max(r[key] for r in ok))
        ax.set_ylim(0, 1.1 * top)  # points at 1.0 (perfect scaling) stay whole
    elif max(r[key] for r in ok) > 10 * min(r[key] for r in ok):
        ax.set_yscale("log")  # more than a decade: log; within one, log shows no ticks
    _along_x(ax, xs, numeric, x_label)
    if not numeric:
        ax.set_xticks(range(len(xs)), [_tick_label(v) for v in xs])
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    # efficiency starts at 1 and falls to the right: the lower left is where no line runs
    ax.legend(fontsize=8, loc="lower left" if key == "scaling_efficiency" else "best")
    fig.tight_layout()
    _save_png(fig, output_dir / name)
    plt.close(fig)
    return output_dir / name


def _plot_layout_throughput(plt, title: str, rows: list[dict[str, Any]], output_dir: Path) -> Path:
    """throughput.png of a layout sweep: a bar per layout, in the sweep's order, of its
    tokens/s (examples/s for models without tokens), the best starred; a layout that
    does not fit or fails is an empty bar saying so."""
    tokens = any(not is_missing(r["simulated_tokens_per_second"]) for r in rows
                 if r["status"] == "ok")
    key = "simulated_tokens_per_second" if tokens else "simulated_examples_per_second"
    values = [r[key] if r["status"] == "ok" else 0.0 for r in rows]
    fig, ax = plt.subplots(figsize=(9, 0.3 * len(rows) + 1.4))
    ax.barh(range(len(rows)), values, color="tab:blue")
    best = max(range(len(rows)), key=lambda i: values[i])
    ax.barh([best], [values[best]], color="tab:green", label="most " + key.split("_")[1] + "/s")
    for i, r in enumerate(rows):
        note = (f"  {values[i]:,.0f}" if r["status"] == "ok" else
                "  does not fit" if r.get("fits") is False else "  failed")
        ax.text(values[i], i, note, va="center", fontsize=7)
    ax.set_yticks(range(len(rows)), [_layout_label(r) for r in rows], fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -0.5)  # the first layout on top, no empty rows
    ax.set_xlim(0, max(values) * 1.25 or 1.0)
    ax.set_xlabel(("tokens" if tokens else "examples") + "/s (simulated)")
    ax.set_title(title, fontsize=10)
    _legend_beside(ax)
    fig.tight_layout()
    _save_png(fig, output_dir / "throughput.png")
    plt.close(fig)
    return output_dir / "throughput.png"


def _plot_tokens(plt, scenario: Scenario, series: dict, output_dir: Path) -> Path:
    """tokens/s and MFU against chips (against slices in a ``sweep.num_slices`` sweep), a
    line per series (transformer sweeps)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    lines: dict[str, list[dict[str, Any]]] = {}  # the mesh's resolved sizes grow with the chips
    weak = _sweep_of(scenario).scaling == "weak"
    for r in (r for rs in series.values() for r in rs):
        batch = (f"{r['per_device_batch']} per device" if weak
                 else f"global batch {r['global_batch']}")
        lines.setdefault(f"remat {r['remat'] or 'none'}, {batch}", []).append(r)
    counts = scenario.sweep.num_slices if scenario.sweep is not None else None
    x_key, x_label = ("slices", "slices (joined by the DCN)") if counts else ("chips", "chips")
    for label, rs in lines.items():
        rs = sorted(rs, key=lambda r: r[x_key])
        xs = [r[x_key] for r in rs]
        left.plot(xs, [r["simulated_tokens_per_second"] for r in rs], marker="o", label=label)
        right.plot(xs, [100 * r["mfu"] for r in rs], marker="o", label=label)
    for ax, ylabel in ((left, "tokens/s (simulated)"), (right, "MFU % (simulated)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel(x_label)
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    left.set_yscale("log")
    top = max((100 * r["mfu"] for rs in lines.values() for r in rs), default=1.0)
    right.set_ylim(0, 1.15 * top)   # a flat line at the top stays visible
    # the chip (slice) counts as ticks, as numbers, not powers of two
    ticks = sorted(counts) if counts else sorted({r[x_key] for rs in lines.values() for r in rs})
    for ax in (left, right):
        ax.set_xticks(ticks, [_tick_label(k) for k in ticks])
        ax.minorticks_off()
    right.legend(fontsize=7)
    fig.suptitle(f"{scenario.name}: {sweep_kind(scenario)} (simulated)")
    fig.tight_layout()
    _save_png(fig, output_dir / "tokens.png")
    plt.close(fig)
    return output_dir / "tokens.png"


def plot_layouts(rows: list[dict[str, Any]], output_dir: Path, title: str) -> Path:
    """layouts.png of ``rows`` (``_plot_layouts``) under ``title`` (``tpu-pod plan``'s)."""
    from pod.report import figures as plt  # pyplot's subplots without pyplot's state

    return _plot_layouts(plt, None, rows, output_dir, title=title)


def _plot_layouts(plt, scenario: Scenario | None, rows: list[dict[str, Any]], output_dir: Path,
                  title: str = "") -> Path:
    """One bar per layout: compute, update, the pipeline bubble and exposed collective
    seconds per mesh axis (simulated), layouts that do not fit in HBM shown empty with
    their need; the layout that fits with the most tokens (examples) per second marked
    with a star; MFU and HBM per device beside each bar."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    labels, stacks, notes = [], [], []
    for r in rows:
        labels.append(_layout_label(r))
        if r["status"] == "ok":
            stacks.append([r["compute_seconds"], r["update_seconds"], _bubble(r),
                           *(r[f"exposed_{a}_seconds"] for a in _AXES)])
            hbm, mfu = r["hbm_per_device_bytes"], r["mfu"]
            memory = f"{hbm / 2**30:.0f} GiB" if hbm >= 2**30 else f"{hbm / 2**20:.1f} MiB"
            notes.append(f"MFU {mfu:.0%}, {memory}" if mfu >= 0.1 else f"MFU {mfu:.1%}, {memory}")
        else:
            stacks.append([0.0] * (3 + len(_AXES)))
            need = r.get("hbm_per_device_bytes")
            notes.append(f"does not fit ({need / 2**30:.0f} GiB)" if r.get("fits") is False and need
                         else "failed: " + str(r["error"])[:40])
    fig, ax = plt.subplots(figsize=(9, 0.3 * len(rows) + 1.4))
    left = [0.0] * len(rows)
    parts = ("compute", "update", "pipeline bubble", *(f"exposed {a}" for a in _AXES))
    for k, part in enumerate(parts):
        widths = [st[k] for st in stacks]
        ax.barh(range(len(rows)), widths, left=left, label=part if any(widths) else None)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ok = [i for i, r in enumerate(rows) if r["status"] == "ok"]
    # the most tokens (examples) per second: layouts differ in their global batch
    best = max(ok, key=lambda i: rows[i]["simulated_examples_per_second"]) if ok else -1
    for i, note in enumerate(notes):  # beside the bar's end, past the star on the best
        ax.annotate(note, (left[i], i), xytext=(10 if i == best else 4, 0),
                    textcoords="offset points", va="center", fontsize=7)
    if ok:
        ax.plot([left[best]], [best], marker="*", markersize=14, color="gold",
                markeredgecolor="black", label="most tokens/s that fits")
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -0.5)  # the first layout on top, no empty rows
    longest = max(left + [1e-9])
    unit, scale = (("s", 1.0) if longest >= 1 else ("ms", 1e3) if longest >= 1e-3
                   else ("us", 1e6))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x * scale:g}"))
    ax.xaxis.set_major_locator(MaxNLocator(nbins=6))
    ax.set_xlabel(f"simulated step time ({unit})")
    ax.set_xlim(0, longest * 1.45)
    where = rows[ok[0]] if ok else rows[0]
    name = scenario.name if scenario is not None else ""
    ax.set_title(title or f"{name}: layouts on {where['chips']} {where['generation']} chips "
                 "(simulated)", fontsize=10)
    _legend_beside(ax)
    fig.tight_layout()
    _save_png(fig, output_dir / "layouts.png")
    plt.close(fig)
    return output_dir / "layouts.png"

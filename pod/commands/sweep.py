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
from pod.report.files import check_writable, write_atomic
from pod.report.stats import AXIS_ORDER, mfu, pipeline_bubble_fraction
from pod.safe_io import lock_directories

__all__ = ["SweepPoint", "sweep_points", "run_sweep", "COLUMNS", "TEXT_COLUMNS", "empty_row",
           "is_missing", "csv_row", "json_row", "sweep_kind", "step_row", "plot_layouts"]

COLUMNS = (
    "point", "status", "error", "model", "dataset", "synthetic_data", "generation", "slice",
    "chips", "cores", "topology", "allreduce_algorithm", "precision",
    "global_batch", "per_device_batch", "simulated_step_seconds", "infeed_seconds",
    "compute_seconds", "collective_seconds", "exposed_collective_seconds", "update_seconds",
    "serial_step_seconds", "overlap_fraction", "simulated_epoch_seconds",
    "simulated_examples_per_second",
    "simulated_tflops", "maxtext_tflops_per_device", "mfu", "communication_fraction",
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
                          "slice", "topology", "allreduce_algorithm", "precision", "bound",
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
    return step_row(plan, stats[1:] or stats, time.perf_counter() - t0, epoch_examples)


def step_row(plan, timed: list, wall: float, epoch_examples: int | None = None) -> dict[str, Any]:
    """A point's row from its plan and its timed steps (``StepStats``, averaged), ``wall``
    seconds of emulation (``tpu-pod plan`` costs its points through it too)."""
    step = fmean(s.step_seconds for s in timed)
    mean = lambda f: fmean(f(s) for s in timed)  # noqa: E731 - short local helper
    flops = mean(lambda s: s.model_flops)
    collective = mean(lambda s: s.collective_seconds)
    exposed = mean(lambda s: s.exposed_collective_seconds)
    epoch = epoch_examples or plan.dataset.x_train.shape[0]
    bounds = _mean_bounds(plan, timed)
    return {
        "model": plan.model.name, "bound": bounds.label, "bound_fraction": bounds.fraction,
        "ici_axes": bounds.ici_axes,
        **{f"{c}_bound_seconds": bounds.seconds[c] for c in BOUND_CATEGORIES},
        "simulated_epoch_seconds": step * max(1, epoch // plan.global_batch),
        "status": "ok", "error": "", "dataset": plan.dataset.name,
        "synthetic_data": bool(plan.dataset.synthetic),
        "generation": plan.topology.chip.name, "chips": plan.topology.chips,
        "cores": plan.topology.tensorcores, "topology": plan.topology.torus.name,
        "allreduce_algorithm": plan.ici.algorithm,
        "precision": plan.training.precision, "global_batch": plan.global_batch,
        "simulated_step_seconds": step,
        "infeed_seconds": mean(lambda s: s.infeed_seconds),
        "compute_seconds": mean(lambda s: s.compute_seconds),
        "collective_seconds": collective,
        "exposed_collective_seconds": exposed,
        "serial_step_seconds": mean(lambda s: s.serial_step_seconds),
        "overlap_fraction": (min(1.0, max(0.0, 1.0 - exposed / collective)) if collective > 0
                             else 0.0),
        "update_seconds": mean(lambda s: s.update_seconds),
        "simulated_examples_per_second": plan.global_batch / step,
        "simulated_tflops": flops / step / 1e12,
        "maxtext_tflops_per_device": (fmean(s.maxtext_flops_per_device for s in timed) / step / 1e12
                                      or math.nan),
        "mfu": mfu(flops, step, plan.topology.peak_bf16_flops_per_s),
        "communication_fraction": exposed / step,
        "wall_seconds": wall,
        "wall_seconds_per_step": mean(lambda s: s.wall_seconds),
        **_layout_columns(plan, timed, step),
        **_pipeline_columns(plan, timed),
        "slices": plan.mesh.slices,
        "dcn_mesh": format_axes(plan.mesh.dcn_sizes) if plan.mesh.slices > 1 else "",
        "dcn_collective_seconds": mean(lambda s: sum(s.axis_dcn_seconds.values())),
    }


def _pipeline_columns(plan, timed: list) -> dict[str, Any]:
    """A pipeline's microbatches and bubble (NaN without a stage axis)."""
    from pod.config.pipeline import pipeline_microbatches

    if plan.mesh.axis_size("stage") == 1:
        return {}
    bubble = fmean(s.pipeline_bubble_seconds for s in timed)
    return {"microbatches": pipeline_microbatches(plan.training, plan.mesh),
            "pipeline_bubble_seconds": bubble,
            "pipeline_bubble_fraction": pipeline_bubble_fraction(
                bubble, fmean(s.compute_seconds for s in timed))}


def _layout_columns(plan, timed: list, step: float) -> dict[str, Any]:
    """The mesh, remat, per-device batch, HBM, tokens/s and per-axis columns of a point."""
    mesh = plan.mesh
    options = plan.scenario.model.options if plan.scenario.model else {}
    tokens = int(plan.dataset.x_train[0].size) if plan.scenario.model.name == "transformer" else 0
    hardware = fmean(s.hardware_flops or s.model_flops for s in timed)
    row = {"mesh": format_axes(mesh.sizes), "remat": options.get("remat", ""),
           "fits": True, "hbm_per_device_bytes": int(plan.memory["total"]),
           "simulated_tokens_per_second": plan.global_batch * tokens / step if tokens else math.nan,
           "hfu": mfu(hardware, step, plan.topology.peak_bf16_flops_per_s),
           "per_device_batch": plan.per_device_batch}
    for axis in _AXES:
        row[axis] = mesh.axis_size(axis)
        row[f"exposed_{axis}_seconds"] = fmean(s.axis_exposed_seconds.get(axis, 0.0) for s in timed)
        row[f"collective_{axis}_seconds"] = fmean(s.axis_collective_seconds.get(axis, 0.0)
                                                  for s in timed)
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
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=110), binary=True)


def _labels(point: SweepPoint) -> dict[str, Any]:
    """A point's own values (mesh, remat, algorithm, precision, batch, pod), known before it
    runs, so that a failed point's row says what it was."""
    v = point.values
    mesh = v.get("pod__mesh")
    layout = {"mesh": format_axes(mesh), **{a: mesh.get(a, 1) for a in _AXES}} if mesh else {}
    if "model__options" in v:
        layout["remat"] = v["model__options"].get("remat", "")
    if v.get("training__microbatches") is not None:
        layout["microbatches"] = v["training__microbatches"]
    if v.get("pod__slices") is not None:
        layout["slices"] = v["pod__slices"]
    return {**layout, "allreduce_algorithm": v.get("pod__allreduce", ""),
            "precision": v.get("training__precision", ""),
            "global_batch": v.get("training__global_batch", math.nan),
            "chips": v.get("pod__chips") or _chips(point), "topology": v.get("pod__topology") or "",
            "generation": v.get("pod__slice") or v.get("pod__chip") or "",
            "slice": v.get("pod__slice") or ""}


def _chips(point: SweepPoint) -> float | int:
    """The chips of a point's pod (NaN if its pod does not resolve)."""
    source = point.scenario.pod if point.scenario is not None else None
    name = point.values.get("pod__slice") or (source.slice if source else None)
    try:
        if source is not None:
            return _resolve(source).chips
        return resolve_pod(slice_name=name).chips if name else math.nan
    except USER_ERRORS:
        return math.nan


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


def markdown_table(scenario: Scenario, rows: list[dict[str, Any]], mode: str) -> str:
    """The results as a Markdown table (simulated figures; wall seconds last)."""
    synthetic = any(r.get("synthetic_data") is True for r in rows)
    data = f"data: {scenario.data.name}" + (" (SYNTHETIC: the data only set shapes)" if synthetic
                                           else "")
    head = (f"# Sweep: {scenario.name} ({sweep_kind(scenario)}, {mode} mode)\n\n"
            f"Simulated figures unless marked wall; model {training_sections(scenario)[0].name}, "
            f"{data}.\n\n"
            "| # | chip | chips | cores | topology | allreduce | global batch | step ms | "
            "compute ms | collectives ms | epoch s | examples/s | TFLOP/s | MFU | comm % | "
            "efficiency | bound | wall s | status |\n"
            "|---|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|\n")
    lines = []
    for r in rows:
        if r["status"] == "ok":
            lines.append(
                f"| {r['point']} | {r['generation']} | {r['chips']} | {r['cores']} | "
                f"{r['topology']} | {r['allreduce_algorithm']} | {r['global_batch']} | "
                f"{r['simulated_step_seconds'] * 1e3:.4f} | "
                f"{r['compute_seconds'] * 1e3:.4f} | {r['collective_seconds'] * 1e3:.4f} | "
                f"{r['simulated_epoch_seconds']:.4f} | {r['simulated_examples_per_second']:,.0f} | "
                f"{r['simulated_tflops']:.2f} | {r['mfu']:.1%} | "
                f"{r['communication_fraction']:.1%} | {_cell(r['scaling_efficiency'], '.2f')} | "
                f"{r['bound']} {r['bound_fraction']:.0%} | {r['wall_seconds']:.2f} | ok |")
        else:
            error = str(r["error"]).replace("|", "/")
            lines.append(f"| {r['point']} | {r['generation']} | {_cell(r['chips'])} | | "
                         f"{r['topology']} | {r['allreduce_algorithm']} | "
                         f"{_cell(r['global_batch'])} | | | | | | | | | | | | "
                         f"failed: {error} |")
    return head + "\n".join(lines) + "\n" + _layout_table(rows) + _slices_table(rows)


def _layout_table(rows: list[dict[str, Any]]) -> str:
    """The sharded columns as a second table (rows with a layout only)."""
    rows = [r for r in rows if r.get("mesh") and r.get("mesh") != f"{{data: {r.get('data')}}}"
            or r.get("fits") is False]
    if not rows:
        return ""
    out = ["", "Sharded layouts (simulated; exposed = collective time the compute waited for):",
           "", "| # | chips | mesh | remat | batch / device | microbatches | step s | tokens/s | "
           f"MFU | bubble | exposed {' / '.join(_AXES)} ms | HBM GiB / device | status |",
           "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---|---:|---|"]
    for r in rows:
        hbm_bytes: Any = r.get("hbm_per_device_bytes")  # a number unless missing
        hbm = "" if is_missing(hbm_bytes) else f"{hbm_bytes / 2**30:.1f}"
        if r["status"] == "ok":
            exposed = " / ".join(f"{1e3 * r[f'exposed_{a}_seconds']:.1f}" for a in _AXES)
            out.append(f"| {r['point']} | {r['chips']} | {r['mesh']} | {r['remat']} | "
                       f"{r['per_device_batch']} | {_cell(r.get('microbatches'))} | "
                       f"{r['simulated_step_seconds']:.3f} | "
                       f"{r['simulated_tokens_per_second']:,.0f} | {r['mfu']:.1%} | "
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
    varying = [(k, label) for k, label in _dimensions(scenario)
               if k != x_key and _distinct(r[k] for r in ok) > 1]
    series: dict[str, list[dict[str, Any]]] = {}
    for r in ok:
        parts = [f"{label} {r[k]:,}" if isinstance(r[k], int) else str(r[k])
                 for k, label in varying]
        series.setdefault(", ".join(parts) or str(r["allreduce_algorithm"]), []).append(r)
    for rs in series.values():
        rs.sort(key=lambda r: (r[x_key] if isinstance(r[x_key], (int, float)) else 0))
    return series


def _stacked(plt, ok, parts, labels_of, title, output_dir, name) -> Path:
    """A stacked bar per point: ``parts`` is [(row key, legend label, colour)]."""
    fig, ax = plt.subplots(figsize=(max(7, 0.35 * len(ok)), 4.5))
    bottom = [0.0] * len(ok)
    for key, label, colour in parts:
        values = [r[key] * 1e3 for r in ok]
        ax.bar(range(len(ok)), values, bottom=bottom, label=label, color=colour)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xticks(range(len(ok)), [labels_of(r) for r in ok], fontsize=6)
    ax.set_ylabel("simulated step time (ms)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
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
    ax.set_xlabel(label)


def _bubble(row: dict[str, Any]) -> float:
    """A row's pipeline bubble seconds (0 without a pipeline)."""
    value: Any = row.get("pipeline_bubble_seconds")  # a number unless missing
    return 0.0 if is_missing(value) else float(value)


def _breakdown(plt: Any, scenario: Scenario, series: dict[str, list[dict[str, Any]]],
               x_key: str, x_label: str, output_dir: Path) -> Path:
    """breakdown.png: per series a panel of stacked bars, the critical path's parts."""
    parts = (("compute", lambda r: r["compute_seconds"]),
             ("collectives, exposed", lambda r: r["exposed_collective_seconds"]),
             ("pipeline bubble", _bubble),
             ("update", lambda r: r["update_seconds"]),
             ("infeed and dispatch, exposed", lambda r: max(0.0, r["simulated_step_seconds"]
                                                            - r["compute_seconds"]
                                                            - r["exposed_collective_seconds"]
                                                            - _bubble(r)
                                                            - r["update_seconds"])))
    # a layout's tick label stands on end (up to ~40 characters): room below each panel
    panel_inches = 5.0 if x_key == "layout" else 3.0
    fig, axes = plt.subplots(len(series), 1, squeeze=False,
                             figsize=(max(7, 0.6 * max(len(rs) for rs in series.values())),
                                      panel_inches * len(series)))
    for ax, (label, rs) in zip(axes[:, 0], series.items(), strict=True):
        bottom = [0.0] * len(rs)
        for part, value in parts:
            values = [value(r) * 1e3 for r in rs]
            ax.bar(range(len(rs)), values, bottom=bottom, label=part)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        ax.set_xticks(range(len(rs)), [_tick_label(r[x_key]) for r in rs],
                      rotation=90 if x_key == "layout" else 0,
                      fontsize=7 if x_key == "layout" else None)
        ax.set_xlabel(x_label)
        ax.set_ylabel("simulated ms per step")
        ax.set_title(label, fontsize=10)
    axes[0, 0].legend(fontsize=8)
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
    written.append(_stacked(
        plt, ok, [(f"{c}_bound_seconds", c, BOUND_COLOURS[c]) for c in BOUND_CATEGORIES],
        lambda r: _tick_label(r[x_key]), f"{scenario.name}: the critical path by what bounds "
        "it (simulated)", output_dir, "bounds.png"))
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
        ax.set_ylim(bottom=0)
    elif max(r[key] for r in ok) > 10 * min(r[key] for r in ok):
        ax.set_yscale("log")  # more than a decade: log; within one, log shows no ticks
    _along_x(ax, xs, numeric, x_label)
    if not numeric:
        ax.set_xticks(range(len(xs)), [_tick_label(v) for v in xs])
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
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
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(rows) + 1.6))
    ax.barh(range(len(rows)), values, color="tab:blue")
    best = max(range(len(rows)), key=lambda i: values[i])
    ax.barh([best], [values[best]], color="tab:green", label="most " + key.split("_")[1] + "/s")
    for i, r in enumerate(rows):
        note = (f"  {values[i]:,.0f}" if r["status"] == "ok" else
                "  does not fit" if r.get("fits") is False else "  failed")
        ax.text(values[i], i, note, va="center", fontsize=7)
    ax.set_yticks(range(len(rows)), [_layout_label(r) for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, max(values) * 1.25 or 1.0)
    ax.set_xlabel(("tokens" if tokens else "examples") + "/s (simulated)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
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
    if counts:   # the slice counts as ticks, not powers of two
        for ax in (left, right):
            ax.set_xticks(list(counts), [str(k) for k in counts])
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
    labels, stacks, notes = [], [], []
    for r in rows:
        labels.append(_layout_label(r))
        if r["status"] == "ok":
            stacks.append([r["compute_seconds"], r["update_seconds"], _bubble(r),
                           *(r[f"exposed_{a}_seconds"] for a in _AXES)])
            notes.append(f"MFU {r['mfu']:.0%}, {r['hbm_per_device_bytes'] / 2**30:.0f} GiB")
        else:
            stacks.append([0.0] * (3 + len(_AXES)))
            need = r.get("hbm_per_device_bytes")
            notes.append(f"does not fit ({need / 2**30:.0f} GiB)" if r.get("fits") is False and need
                         else "failed: " + str(r["error"])[:40])
    fig, ax = plt.subplots(figsize=(10, 0.42 * len(rows) + 1.8))
    left = [0.0] * len(rows)
    parts = ("compute", "update", "pipeline bubble", *(f"exposed {a}" for a in _AXES))
    for k, part in enumerate(parts):
        widths = [st[k] for st in stacks]
        ax.barh(range(len(rows)), widths, left=left, label=part)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    for i, note in enumerate(notes):
        ax.text(left[i], i, "  " + note, va="center", fontsize=7)
    ok = [i for i, r in enumerate(rows) if r["status"] == "ok"]
    if ok:  # the most tokens (examples) per second: layouts differ in their global batch
        best = max(ok, key=lambda i: rows[i]["simulated_examples_per_second"])
        ax.plot([left[best]], [best], marker="*", markersize=14, color="gold",
                markeredgecolor="black", label="most tokens/s that fits")
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("simulated step time (s)")
    ax.set_xlim(0, max(left + [1e-9]) * 1.45)
    where = rows[ok[0]] if ok else rows[0]
    name = scenario.name if scenario is not None else ""
    ax.set_title(title or f"{name}: layouts on {where['chips']} {where['generation']} chips "
                 "(simulated)")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    _save_png(fig, output_dir / "layouts.png")
    plt.close(fig)
    return output_dir / "layouts.png"

"""Scaling experiments: one scenario at every point of its ``sweep:`` block.

Each point is the scenario with some values replaced (pod, allreduce
algorithm, global or per-core batch, precision). In ``timing`` mode (the
default) a point is costed by ``pod.runtime.timing.TimingPod`` (one representative
chip, no actors), so a sweep reaches full pods; in ``functional`` mode it is
trained on chip actors for ``steps`` steps. A point that fails (for example
a batch that does not fit in HBM, or does not split over the cores) is
recorded with its error and the sweep goes on.

Outputs, in the output directory: ``results.csv`` (a row per point),
``results.md`` (the same as a Markdown table), ``throughput.png`` (examples/s
against the quantity the sweep varies: chips, else the batch, ...),
``efficiency.png`` (scaling efficiency against chips, when they vary) and
``breakdown.png`` (the simulated step's critical path of every point, stacked
by part, one panel per series).

Scaling efficiency of a point = its examples/s per chip divided by that of
the smallest-chip point of its series (same algorithm, precision and, for
strong scaling, global batch). It is 1 for perfect weak or strong scaling.
"""

from __future__ import annotations

import csv
import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import fmean
from typing import Any, Callable

from pod.errors import USER_ERRORS, ScenarioError
from pod.config.plan import build_plan
from pod.report.stats import mfu
from pod.config.scenario import Scenario
from pod.config.slices import resolve_pod

__all__ = ["SweepPoint", "sweep_points", "run_sweep", "COLUMNS"]

COLUMNS = (
    "point", "status", "error", "dataset", "synthetic_data", "generation", "chips", "cores",
    "topology", "allreduce_algorithm", "precision",
    "global_batch", "per_core_batch", "simulated_step_seconds", "infeed_seconds",
    "compute_seconds", "allreduce_seconds", "exposed_allreduce_seconds", "update_seconds",
    "serial_step_seconds", "overlap_fraction", "simulated_epoch_seconds",
    "simulated_examples_per_second",
    "simulated_tflops", "mfu", "communication_fraction", "scaling_efficiency", "wall_seconds",
    "wall_seconds_per_step",
)


@dataclass(frozen=True)
class SweepPoint:
    """One point of a sweep: its label, the values it sets, its scenario (or error)."""

    index: int
    values: dict[str, Any]
    scenario: Scenario | None
    error: str = ""
    series: tuple = field(default=())


def _pods(scenario: Scenario) -> list[dict[str, Any]]:
    sweep = scenario.sweep
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
    sweep = scenario.sweep
    if sweep is None or scenario.training is None:
        raise ScenarioError(f"{scenario.name}: a sweep needs a training scenario with a sweep: block")
    algorithms = sweep.allreduce or (scenario.pod.allreduce,)
    if sweep.scaling == "weak":  # a batch value is examples per TensorCore
        batches = sweep.per_core_batch
    else:
        batches = sweep.global_batch or (scenario.training.global_batch,)
    precisions = sweep.precision or (scenario.training.precision,)
    points = []
    base = {"training__steps": sweep.steps, "metrics__port": 0, "sweep": None}
    for i, (pod, algorithm, per_point, precision) in enumerate(
            itertools.product(_pods(scenario), algorithms, batches, precisions)):
        batch = per_point
        values = {**pod, "pod__allreduce": algorithm, "training__precision": precision}
        try:
            if sweep.scaling == "weak":
                shape = scenario.with_overrides(**base, **values).pod
                cores = resolve_pod(slice_name=shape.slice, chip=shape.chip, chips=shape.chips,
                                    topology=shape.topology).tensorcores
                batch = batch * cores  # per_core_batch x TensorCores
            values["training__global_batch"] = batch
            point = scenario.with_overrides(**base, **values)
            error = ""
        except USER_ERRORS as err:
            point, error = None, str(err)
        series = (algorithm, precision, per_point)
        points.append(SweepPoint(i, values, point, error, series))
    return points


def _run_point(point: SweepPoint, mode: str, epoch_examples: int | None) -> dict[str, Any]:
    """Cost or train one point; returns its row (without scaling efficiency).

    The epoch time is the step time x the full global batches in an epoch of
    ``epoch_examples`` (default: the train split), as with drop_remainder.
    """
    from pod.runtime.timing import TimingPod

    t0 = time.perf_counter()
    plan = build_plan(point.scenario, timing_only=(mode == "timing"))
    if mode == "timing":
        pod = TimingPod(plan)
        stats = [pod.step(s) for s in range(plan.steps)]
    else:
        from pod.runtime.coordinator import Pod

        with Pod(plan) as pod:
            stats = [pod.step(s) for s in range(plan.steps)]
    wall = time.perf_counter() - t0
    timed = stats[1:] or stats
    step = fmean(s.step_seconds for s in timed)
    mean = lambda f: fmean(f(s) for s in timed)  # noqa: E731 - short local helper
    flops = mean(lambda s: s.model_flops)
    allreduce = mean(lambda s: s.allreduce_seconds)
    exposed = mean(lambda s: s.exposed_allreduce_seconds)
    epoch = epoch_examples or plan.dataset.x_train.shape[0]
    return {
        "simulated_epoch_seconds": step * max(1, epoch // plan.global_batch),
        "status": "ok", "error": "", "dataset": plan.dataset.name,
        "synthetic_data": bool(plan.dataset.synthetic),
        "generation": plan.pod.chip.name, "chips": plan.pod.chips,
        "cores": plan.pod.tensorcores, "topology": plan.pod.torus.name, "allreduce_algorithm": plan.ici.algorithm,
        "precision": plan.scenario.training.precision, "global_batch": plan.global_batch,
        "per_core_batch": plan.per_core_batch, "simulated_step_seconds": step,
        "infeed_seconds": mean(lambda s: s.infeed_seconds),
        "compute_seconds": mean(lambda s: s.compute_seconds),
        "allreduce_seconds": allreduce,
        "exposed_allreduce_seconds": exposed,
        "serial_step_seconds": mean(lambda s: s.serial_step_seconds),
        "overlap_fraction": min(1.0, max(0.0, 1.0 - exposed / allreduce)) if allreduce > 0 else 0.0,
        "update_seconds": mean(lambda s: s.update_seconds),
        "simulated_examples_per_second": plan.global_batch / step,
        "simulated_tflops": flops / step / 1e12,
        "mfu": mfu(flops, step, plan.pod.peak_bf16_flops_per_s),
        "communication_fraction": exposed / step,
        "wall_seconds": wall,
        "wall_seconds_per_step": mean(lambda s: s.wall_seconds),
    }


def _efficiency(rows: list[dict[str, Any]], points: list[SweepPoint]) -> None:
    best: dict[tuple, dict[str, Any]] = {}
    for row, point in zip(rows, points):
        if row["status"] != "ok":
            continue
        ref = best.get(point.series)
        if ref is None or row["chips"] < ref["chips"]:
            best[point.series] = row
    for row, point in zip(rows, points):
        ref = best.get(point.series)
        if row["status"] == "ok" and ref is not None:
            row["scaling_efficiency"] = ((row["simulated_examples_per_second"] / row["chips"])
                                         / (ref["simulated_examples_per_second"] / ref["chips"]))


def run_sweep(scenario: Scenario, output_dir: Path, *, mode: str | None = None,
              on_point: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Run every point of a sweep and write results.csv, results.md and the plots.

    Args:
        scenario: a training scenario with a ``sweep`` block.
        output_dir: where the files go (created).
        mode: "timing" or "functional" (default: the sweep block's).
        on_point: called with each finished row (progress).

    Returns:
        The rows, one per point, with the keys of ``COLUMNS``.

    Raises:
        ScenarioError: the scenario is not a sweep.
    """
    points = sweep_points(scenario)
    mode = mode or scenario.sweep.mode
    rows = []
    for point in points:
        row = {key: "" for key in COLUMNS}
        row.update(point=point.index + 1, **_labels(point))
        if point.error:
            row.update(status="failed", error=point.error)
        else:
            try:
                row.update(_run_point(point, mode, scenario.sweep.epoch_examples))
            except USER_ERRORS as err:
                row.update(status="failed", error=str(err))
        rows.append(row)
        if on_point:
            on_point(row)
    _efficiency(rows, points)
    output_dir.mkdir(parents=True, exist_ok=True)
    with (output_dir / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    (output_dir / "results.md").write_text(markdown_table(scenario, rows, mode))
    plot(scenario, rows, output_dir)
    return rows


def _labels(point: SweepPoint) -> dict[str, Any]:
    v = point.values
    return {"allreduce_algorithm": v.get("pod__allreduce", ""), "precision": v.get("training__precision", ""),
            "global_batch": v.get("training__global_batch", ""),
            "chips": v.get("pod__chips") or "", "topology": v.get("pod__topology") or "",
            "generation": v.get("pod__slice") or v.get("pod__chip") or ""}


def markdown_table(scenario: Scenario, rows: list[dict[str, Any]], mode: str) -> str:
    """The results as a Markdown table (simulated figures; wall seconds last)."""
    synthetic = any(r.get("synthetic_data") is True for r in rows)
    data = f"data: {scenario.data.name}" + (" (SYNTHETIC: the data only set shapes)" if synthetic
                                           else "")
    head = (f"# Sweep: {scenario.name} ({scenario.sweep.scaling} scaling, {mode} mode)\n\n"
            f"Simulated figures unless marked wall; model {scenario.model.name}, {data}.\n\n"
            "| # | chip | chips | cores | topology | allreduce | global batch | step ms | "
            "compute ms | allreduce ms | epoch s | examples/s | TFLOP/s | MFU | comm % | "
            "efficiency | wall s | status |\n"
            "|---|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n")
    lines = []
    for r in rows:
        if r["status"] == "ok":
            lines.append(
                f"| {r['point']} | {r['generation']} | {r['chips']} | {r['cores']} | {r['topology']} | "
                f"{r['allreduce_algorithm']} | {r['global_batch']} | {r['simulated_step_seconds'] * 1e3:.4f} | "
                f"{r['compute_seconds'] * 1e3:.4f} | {r['allreduce_seconds'] * 1e3:.4f} | "
                f"{r['simulated_epoch_seconds']:.4f} | {r['simulated_examples_per_second']:,.0f} | {r['simulated_tflops']:.2f} | {r['mfu']:.1%} | "
                f"{r['communication_fraction']:.1%} | {r['scaling_efficiency']:.2f} | "
                f"{r['wall_seconds']:.2f} | ok |")
        else:
            error = str(r["error"]).replace("|", "/")
            lines.append(f"| {r['point']} | {r['generation']} | {r['chips']} | | {r['topology']} | "
                         f"{r['allreduce_algorithm']} | {r['global_batch']} | | | | | | | | | | | "
                         f"failed: {error} |")
    return head + "\n".join(lines) + "\n"


def _dimensions(scenario: Scenario) -> list[tuple[str, str]]:
    """What a sweep's points may vary, as (row key, axis label), in the order the plots
    prefer for their x axis. The batch is the one the sweep sets (examples per
    TensorCore in weak scaling, the global batch in strong); the other follows."""
    batch = (("per_core_batch", "examples per TensorCore") if scenario.sweep.scaling == "weak"
             else ("global_batch", "global batch"))
    return [("chips", "chips"), batch, ("precision", "precision"),
            ("allreduce_algorithm", "allreduce")]


def _x_axis(scenario: Scenario, ok: list[dict[str, Any]]) -> tuple[str, str]:
    """The quantity the sweep varies (the plots' x axis): chips if they vary, else the
    batch, else the precision or the algorithm; (row key, axis label)."""
    for key, label in _dimensions(scenario):
        if len({r[key] for r in ok}) > 1:
            return key, label
    return "chips", "chips"


def _series(scenario: Scenario, ok: list[dict[str, Any]],
            x_key: str) -> dict[str, list[dict[str, Any]]]:
    """Rows grouped by what else the sweep varies, each sorted along the x axis; a
    label names each such quantity in full (the algorithm alone when nothing else)."""
    varying = [(k, label) for k, label in _dimensions(scenario)
               if k != x_key and len({r[k] for r in ok}) > 1]
    series: dict[str, list[dict[str, Any]]] = {}
    for r in ok:
        parts = [f"{label} {r[k]:,}" if isinstance(r[k], int) else str(r[k])
                 for k, label in varying]
        series.setdefault(", ".join(parts) or str(r["allreduce_algorithm"]), []).append(r)
    for rs in series.values():
        rs.sort(key=lambda r: (r[x_key] if isinstance(r[x_key], (int, float)) else 0))
    return series


def _tick_label(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) else str(value)


def _along_x(ax: Any, xs: list[Any], numeric: bool, label: str) -> None:
    """The x axis: log2 with a tick at every value (chip counts as labels), or categories."""
    if numeric:
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [_tick_label(v) for v in xs])
        ax.minorticks_off()
    ax.set_xlabel(label)


def plot(scenario: Scenario, rows: list[dict[str, Any]], output_dir: Path) -> list[Path]:
    """The sweep's plots (PNG), against the quantity it varies (``_x_axis``).

    ``throughput.png``: examples/s (log); ``efficiency.png``: scaling efficiency,
    only when the chips vary (at one pod size it is 1 by definition);
    ``breakdown.png``: the simulated step's critical path (compute, exposed
    allreduce, update, the rest) stacked per point, one panel per series with
    its own scale, so a small pod's compute stays visible beside a large
    pod's allreduce.

    Returns:
        The files written (none when no point succeeded).
    """
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise ScenarioError("sweep: the plots need matplotlib: pip install "
                            "'tpu-pod-emulator[plots]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return []
    x_key, x_label = _x_axis(scenario, ok)
    numeric = all(isinstance(r[x_key], (int, float)) for r in ok)
    series = _series(scenario, ok, x_key)
    xs = sorted({r[x_key] for r in ok}, key=lambda v: v if numeric else str(v))
    synthetic = " - synthetic data" if any(r.get("synthetic_data") is True for r in ok) else ""
    title = f"{scenario.name}: {scenario.sweep.scaling} scaling (simulated){synthetic}"
    position = (lambda v: v) if numeric else (lambda v: xs.index(v))  # noqa: E731
    written = []
    plots = [("throughput.png", "simulated_examples_per_second", "examples/s (simulated)")]
    if x_key == "chips":
        plots.append(("efficiency.png", "scaling_efficiency", "scaling efficiency"))
    else:
        (output_dir / "efficiency.png").unlink(missing_ok=True)  # an earlier sweep's
    for name, key, ylabel in plots:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label, rs in series.items():
            ax.plot([position(r[x_key]) for r in rs], [r[key] for r in rs], marker="o",
                    label=label)
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
        fig.savefig(output_dir / name, dpi=110)
        plt.close(fig)
        written.append(output_dir / name)
    written.append(_breakdown(plt, scenario, series, x_key, x_label, output_dir))
    return written


def _breakdown(plt: Any, scenario: Scenario, series: dict[str, list[dict[str, Any]]],
               x_key: str, x_label: str, output_dir: Path) -> Path:
    """breakdown.png: per series a panel of stacked bars, the critical path's parts."""
    parts = (("compute", lambda r: r["compute_seconds"]),
             ("allreduce, exposed", lambda r: r["exposed_allreduce_seconds"]),
             ("update", lambda r: r["update_seconds"]),
             ("infeed and dispatch, exposed", lambda r: max(0.0, r["simulated_step_seconds"]
                                                            - r["compute_seconds"]
                                                            - r["exposed_allreduce_seconds"]
                                                            - r["update_seconds"])))
    fig, axes = plt.subplots(len(series), 1, squeeze=False,
                             figsize=(max(7, 0.6 * max(len(rs) for rs in series.values())),
                                      3 * len(series)))
    for ax, (label, rs) in zip(axes[:, 0], series.items()):
        bottom = [0.0] * len(rs)
        for part, value in parts:
            values = [value(r) * 1e3 for r in rs]
            ax.bar(range(len(rs)), values, bottom=bottom, label=part)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_xticks(range(len(rs)), [_tick_label(r[x_key]) for r in rs])
        ax.set_xlabel(x_label)
        ax.set_ylabel("simulated ms per step")
        ax.set_title(label, fontsize=10)
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(f"{scenario.name}: simulated step time, critical path")
    fig.tight_layout()
    fig.savefig(output_dir / "breakdown.png", dpi=110)
    plt.close(fig)
    return output_dir / "breakdown.png"

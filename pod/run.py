"""``run_training``: one scenario from start to summary, as ``tpu-pod run`` does it.

Prints a progress line per step (simulated and wall figures side by side),
evaluates on the test split, checks that every replica is bit-identical,
prints a summary table and writes ``summary.json`` and ``steps.csv`` to the
output directory. Prometheus is served for the length of the run.
"""

from __future__ import annotations

import csv
import json
import math
import time
from contextlib import contextmanager
from pathlib import Path
from statistics import fmean
from typing import Any, Callable, Sequence

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)
from rich.table import Table

from pod.checkpoint import pod_checkpoint, save_checkpoint
from pod.coordinator import Pod
from pod.metrics import PodMetrics
from pod.plan import TrainingPlan
from pod.stats import StepStats
from pod.trace import metadata_events, step_events, write_trace
from pod.workloads.summary import model_summary_table

__all__ = ["run_training", "summarize"]


@contextmanager
def _closing(pod: Pod):
    try:
        yield pod
    finally:
        pod.shutdown()


def summarize(plan: TrainingPlan, steps: list[StepStats], evaluation: dict[str, float],
              replicas_identical: bool, wall_seconds: float, startup_wall_seconds: float
              ) -> dict[str, Any]:
    """The run's summary (the content of summary.json).

    Simulated figures are means over the steps after the first (the first
    step is kept out as a real TPU's first step, which compiles, would be).
    With a single step, that step is used.

    Args:
        plan: the training plan.
        steps: every step's statistics, in order.
        evaluation: test ``loss`` and ``accuracy``.
        replicas_identical: the result of the bit-identity check.
        wall_seconds: wall time of the whole training loop.
        startup_wall_seconds: wall time to start the actors.

    Returns:
        A JSON-serialisable dict.
    """
    timed = steps[1:] or steps
    pod = plan.pod
    mean = lambda f: fmean(f(s) for s in timed)  # noqa: E731 - short local helper
    step_seconds = mean(lambda s: s.step_seconds)
    flops = mean(lambda s: s.model_flops)
    return {
        "scenario": plan.scenario.name,
        "chip": pod.chip.name,
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
        "steps": len(steps),
        "global_batch": plan.global_batch,
        "per_core_batch": plan.per_core_batch,
        "initial_loss": steps[0].loss,
        "final_loss": steps[-1].loss,
        "test_loss": evaluation["loss"],
        "test_accuracy": evaluation["accuracy"],
        "simulated_step_seconds": step_seconds,
        "simulated_examples_per_second": plan.global_batch / step_seconds,
        "simulated_tflops": flops / step_seconds / 1e12,
        "mfu": flops / step_seconds / pod.peak_bf16_flops_per_s,
        "infeed_seconds": mean(lambda s: s.infeed_seconds),
        "compute_seconds": mean(lambda s: s.compute_seconds),
        "allreduce_seconds": mean(lambda s: s.allreduce_seconds),
        "ici_seconds": mean(lambda s: s.ici_seconds),
        "update_seconds": mean(lambda s: s.update_seconds),
        "ici_bytes_per_step": int(sum(steps[-1].ici_link_bytes.values())),
        "peak_bf16_flops_per_s": pod.peak_bf16_flops_per_s,
        "wall_seconds": wall_seconds,
        "wall_step_seconds": mean(lambda s: s.wall_seconds),
        "startup_wall_seconds": startup_wall_seconds,
        "emulation_slowdown": mean(lambda s: s.wall_seconds) / step_seconds,
        "hbm_peak_bytes": max(max(s.hbm_peak_bytes.values()) for s in steps),
        "hbm_capacity_bytes": steps[-1].hbm_capacity_bytes,
        "replicas_identical": bool(replicas_identical),
    }


def _progress_line(stats: StepStats, total: int) -> str:
    width = len(str(total))
    return (f"step {stats.step + 1:>{width}}/{total}  loss {stats.loss:.4f}  "
            f"sim {stats.step_seconds * 1e3:.4f} ms/step  "
            f"sim {stats.examples_per_second:,.0f} examples/s  "
            f"wall {stats.wall_seconds * 1e3:.1f} ms/step")


def _summary_table(summary: dict[str, Any]) -> Table:
    table = Table(title=f"{summary['scenario']}: {summary['slice'] or summary['chip']} "
                        f"({summary['chips']} chips, {summary['cores']} TensorCores, "
                        f"{summary['topology']})", show_header=True)
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("clock")
    rows = [
        ("steps x global batch", f"{summary['steps']} x {summary['global_batch']}", ""),
        ("loss first -> last", f"{summary['initial_loss']:.4f} -> {summary['final_loss']:.4f}", ""),
        ("test accuracy", f"{summary['test_accuracy']:.1%}", ""),
        ("step time", f"{summary['simulated_step_seconds'] * 1e3:.4f} ms", "simulated"),
        ("  infeed", f"{summary['infeed_seconds'] * 1e3:.4f} ms", "simulated"),
        ("  compute (fwd+bwd)", f"{summary['compute_seconds'] * 1e3:.4f} ms", "simulated"),
        ("  allreduce", f"{summary['allreduce_seconds'] * 1e3:.4f} ms", "simulated"),
        ("  update", f"{summary['update_seconds'] * 1e3:.4f} ms", "simulated"),
        ("throughput", f"{summary['simulated_examples_per_second']:,.0f} examples/s", "simulated"),
        ("model TFLOP/s", f"{summary['simulated_tflops']:.3f}", "simulated"),
        ("MFU", f"{summary['mfu']:.2%}", "simulated"),
        ("HBM peak per core", f"{summary['hbm_peak_bytes'] / 2**20:.2f} MiB of "
                              f"{summary['hbm_capacity_bytes'] / 2**30:.0f} GiB", ""),
        ("ICI bytes per step", f"{summary['ici_bytes_per_step']:,}", ""),
        ("step time", f"{summary['wall_step_seconds'] * 1e3:.1f} ms", "wall"),
        ("emulation slowdown", f"{summary['emulation_slowdown']:,.0f}x", "wall/simulated"),
        ("replicas bit-identical", "yes" if summary["replicas_identical"] else "NO", ""),
    ]
    for row in rows:
        table.add_row(*row)
    return table


def run_training(plan: TrainingPlan, *, output_dir: Path, metrics_port: int | None = None,
                 console: Console | None = None, log_every: int = 1,
                 on_step: Callable[[StepStats], None] | None = None,
                 trace_path: Path | None = None, trace_steps: Sequence[int] | None = None,
                 hold_seconds: float = 0.0) -> dict[str, Any]:
    """Train the plan on an emulated pod and write the results.

    Args:
        plan: the checked plan.
        output_dir: where summary.json and steps.csv go (created).
        metrics_port: Prometheus port (None: the scenario's; 0: off).
        console: where progress goes (default: stdout).
        log_every: print a progress line every this many steps (0: none).
        on_step: called with each step's statistics (tests, dashboards).
        trace_path: write a Chrome trace of ``trace_steps`` here.
        trace_steps: zero-based steps to trace (default: the last step).
        hold_seconds: keep the metrics endpoint up this long after the run
            (``math.inf``: until Ctrl-C), so a last scrape sees final values.

    Returns:
        The summary dict, also written to ``output_dir / "summary.json"``.

    Raises:
        MetricsError, ClusterError, HBMOutOfMemoryError: with one-line messages.
    """
    console = console or Console()
    scenario = plan.scenario
    output_dir.mkdir(parents=True, exist_ok=True)
    port = scenario.metrics.port if metrics_port is None else metrics_port
    metrics = PodMetrics(scenario=scenario.name, chip=plan.pod.chip.name,
                         slice_name=plan.pod.name, topology=plan.pod.torus.name,
                         links=[f"{a}->{b}" for a, b in plan.pod.torus.links()],
                         chips=plan.pod.chips, cores=plan.pod.chip.tensorcores)
    metrics.serve(port, scenario.metrics.host)
    data_label = f"{plan.dataset.name}{' (synthetic)' if plan.dataset.synthetic else ''}"
    console.print(f"[bold]{scenario.name}[/]: {plan.pod.name}, {plan.pod.chips} chips x "
                  f"{plan.pod.chip.tensorcores} TensorCores on a {plan.pod.torus.name} torus; "
                  f"{plan.model.name} ({plan.num_params:,} parameters) on {data_label}; "
                  f"global batch {plan.global_batch} = {plan.per_core_batch} per core; "
                  f"{plan.steps} steps")
    console.print(model_summary_table(plan.model, plan.pod.chip.core, plan.per_core_batch,
                                      chip_name=plan.pod.chip.name))
    if metrics.port:
        console.print(f"Prometheus metrics: http://{scenario.metrics.host}:{metrics.port}/metrics")
    traced = set(trace_steps) if trace_steps is not None else {plan.steps - 1}
    trace_events: list[dict[str, Any]] = []
    steps: list[StepStats] = []
    rows_path = output_dir / "steps.csv"
    try:
        pod = Pod(plan)
        with _closing(pod), rows_path.open("w", newline="") as rows_file:
            pod_start_seconds = pod.start()
            console.print(f"{plan.pod.chips} chip actors ready in {pod_start_seconds:.1f} s (wall)")
            if trace_path is not None:
                trace_events.extend(metadata_events(plan.pod.chips, plan.pod.chip.tensorcores,
                                                    plan.pod.torus))
            writer: csv.DictWriter | None = None
            eval_every = scenario.training.eval_every_steps
            per_epoch = plan.steps_per_epoch
            epochs = -(-plan.steps // per_epoch)
            simulated_clock = 0.0
            epoch_wall = time.perf_counter()
            t0 = time.perf_counter()
            with _progress(console, plan.steps) as progress:
                task = progress.add_task("training", total=plan.steps)
                out = progress.console
                for step in range(plan.steps):
                    trace_this = trace_path is not None and step in traced
                    stats = pod.step(step, trace=trace_this)
                    if trace_this:
                        trace_events.extend(step_events(stats, pod.last_trace, pod.schedule,
                                                        plan.pod.torus, pod.ici_cost.phase_seconds,
                                                        start_s=simulated_clock))
                    simulated_clock += stats.step_seconds
                    steps.append(stats)
                    metrics.observe(stats)
                    row = stats.row()
                    if writer is None:
                        writer = csv.DictWriter(rows_file, fieldnames=list(row))
                        writer.writeheader()
                    writer.writerow(row)
                    if on_step:
                        on_step(stats)
                    progress.advance(task)
                    if log_every and ((step + 1) % log_every == 0 or step + 1 == plan.steps):
                        out.print(_progress_line(stats, plan.steps), highlight=False,
                                  soft_wrap=True)
                    last = step + 1 == plan.steps
                    if (step + 1) % per_epoch == 0 and not last and epochs > 1:
                        ev = pod.evaluate()
                        metrics.set_accuracy(ev["accuracy"])
                        out.print(_epoch_line(steps[-per_epoch:], ev, (step + 1) // per_epoch,
                                              epochs, time.perf_counter() - epoch_wall),
                                  highlight=False, soft_wrap=True)
                        epoch_wall = time.perf_counter()
                    elif eval_every and (step + 1) % eval_every == 0 and not last:
                        ev = pod.evaluate()
                        metrics.set_accuracy(ev["accuracy"])
                        out.print(f"  test loss {ev['loss']:.4f}  "
                                  f"test accuracy {ev['accuracy']:.1%}", highlight=False)
            wall = time.perf_counter() - t0
            evaluation = pod.evaluate()
            metrics.set_accuracy(evaluation["accuracy"])
            identical = pod.replicas_identical()
            save_checkpoint(output_dir / "checkpoint.msgpack", pod_checkpoint(pod, plan, plan.steps))
        summary = summarize(plan, steps, evaluation, identical, wall, pod_start_seconds)
        (output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        console.print(_summary_table(summary))
        written = [output_dir / "summary.json", rows_path]
        if trace_path is not None:
            write_trace(trace_path, trace_events,
                        {"scenario": scenario.name, "clock": "simulated microseconds",
                         "traced_steps": sorted(s + 1 for s in traced if s < plan.steps)})
            written.append(trace_path)
        console.print("Wrote " + ", ".join(str(p) for p in written))
        if metrics.port and hold_seconds > 0:
            _hold(console, metrics.port, hold_seconds)
    finally:
        metrics.close()
    return summary


def _epoch_line(stats: list[StepStats], evaluation: dict[str, float], epoch: int, epochs: int,
                wall_seconds: float) -> str:
    """A Keras-style epoch line: loss, val loss / accuracy, simulated ms/step, wall."""
    sim_ms = fmean(s.step_seconds for s in stats) * 1e3
    return (f"Epoch {epoch}/{epochs} - {len(stats)} steps - loss: {stats[-1].loss:.4f} - "
            f"val_loss: {evaluation['loss']:.4f} - val_accuracy: {evaluation['accuracy']:.4f} - "
            f"{sim_ms:.4f} ms/step (simulated) - {wall_seconds:.1f} s (wall)")


def _progress(console: Console, total: int) -> Progress:
    """A progress bar with ETA (wall clock); lines printed through it stay above it."""
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("steps"), TimeElapsedColumn(), TextColumn("ETA"),
                    TimeRemainingColumn(), console=console, transient=True,
                    disable=not console.is_terminal)


def _hold(console: Console, port: int, seconds: float) -> None:
    """Keep serving metrics after the run for ``seconds`` (inf: until Ctrl-C)."""
    label = "until Ctrl-C" if math.isinf(seconds) else f"for {seconds:g} s"
    console.print(f"Holding the metrics endpoint on port {port} {label}")
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
    except KeyboardInterrupt:
        pass

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
from typing import Any, Callable, Sequence

from rich.console import Console

from pod.console import make_console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)
from rich.table import Table

from pod.checkpoint import Checkpoint, RunCheckpoints, resume_checkpoint
from pod.coordinator import Pod
from pod.errors import ClusterError
from pod.faults import ChipFailureError, InterruptGuard, RunInterrupted
from pod.metrics import PodMetrics
from pod.plan import TrainingPlan
from pod.stats import StepStats, StepTotals
from pod.trace import metadata_events, step_events, write_trace
from pod.workloads.summary import model_summary_table

__all__ = ["run_training", "summarize"]


@contextmanager
def _closing(pod: Pod):
    try:
        yield pod
    finally:
        pod.shutdown()


def summarize(plan: TrainingPlan, steps: StepTotals | Sequence[StepStats],
              evaluation: dict[str, float] | None, replicas_identical: bool | None,
              wall_seconds: float, startup_wall_seconds: float) -> dict[str, Any]:
    """The run's summary (the content of summary.json).

    Simulated figures are means over the steps after the first (the first
    step is kept out as a real TPU's first step, which compiles, would be).
    With a single step, that step is used.

    Args:
        plan: the training plan.
        steps: the running totals of the steps (``StepTotals``), or every
            step's statistics in order.
        evaluation: test ``loss`` and ``accuracy`` (None: not evaluated, a
            partial run).
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
    evaluation = evaluation or {"loss": None, "accuracy": None}
    return _identity(plan, totals.steps) | {
        "initial_loss": totals.initial_loss,
        "final_loss": totals.final_loss,
        "test_loss": evaluation["loss"],
        "test_accuracy": evaluation["accuracy"],
        "simulated_step_seconds": step_seconds,
        "simulated_examples_per_second": plan.global_batch / step_seconds,
        "simulated_tflops": flops / step_seconds / 1e12,
        "mfu": flops / step_seconds / pod.peak_bf16_flops_per_s,
        "infeed_seconds": mean("infeed_seconds"),
        "compute_seconds": mean("compute_seconds"),
        "allreduce_seconds": mean("allreduce_seconds"),
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


def _identity(plan: TrainingPlan, steps: int) -> dict[str, Any]:
    """The summary's first keys: what ran."""
    pod = plan.pod
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
        "steps": steps,
        "global_batch": plan.global_batch,
        "per_core_batch": plan.per_core_batch,
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
                 hold_seconds: float = 0.0, resume_dir: Path | None = None) -> dict[str, Any]:
    """Train the plan on an emulated pod and write the results.

    With a ``checkpoint:`` block in the scenario, the complete training state
    is written every ``every_steps`` steps and at the end (``pod.checkpoint``);
    a chip actor that dies (a ``faults:`` kill, or a real failure) is replaced
    and the pod restored from the newest checkpoint, and training continues.
    SIGINT / SIGTERM stop the run at the next step boundary: a final
    checkpoint (if configured), the partial summary.json and steps.csv are
    written, the actors (and a local Ray cluster this run started) are shut
    down, and ``RunInterrupted`` is raised.

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
        resume_dir: continue from the newest valid checkpoint in this
            directory (``tpu-pod run --resume``); steps.csv keeps its rows
            before the checkpoint's step.

    Returns:
        The summary dict, also written to ``output_dir / "summary.json"``.

    Raises:
        MetricsError, ClusterError, HBMOutOfMemoryError: with one-line messages.
        CheckpointError: no valid checkpoint to resume, or one of another run.
        ChipFailureError: chips died and there is no checkpoint to restore
            (the partial summary is written first).
        RunInterrupted: SIGINT / SIGTERM (after writing what the run has).
    """
    console = console or make_console()
    scenario = plan.scenario
    output_dir.mkdir(parents=True, exist_ok=True)
    warn = lambda text: console.print(text, style="yellow", highlight=False)  # noqa: E731
    resumed: Checkpoint | None = None
    if resume_dir is not None:
        resumed_path, resumed = resume_checkpoint(resume_dir, plan, warn=warn)
    checkpoints = RunCheckpoints(plan, output_dir, resume_dir) if scenario.checkpoint else None
    port = scenario.metrics.port if metrics_port is None else metrics_port
    metrics = PodMetrics(scenario=scenario.name, chip=plan.pod.chip.name,
                         slice_name=plan.pod.name, topology=plan.pod.torus.name,
                         links=[f"{a}->{b}" for a, b in plan.pod.torus.links()],
                         chips=plan.pod.chips, cores=plan.pod.chip.tensorcores,
                         dataset=plan.dataset.name, synthetic=plan.dataset.synthetic)
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
    core_spec = plan.pod.chip.core
    scalar_issue = core_spec.scalar_issue_cycles / core_spec.clock_hz  # seconds per op
    trace_events: list[dict[str, Any]] = []
    # O(1) memory per step: running sums, not a list of every step (a long run stays flat)
    totals = StepTotals()
    faults_done: list[int] = []
    fault_events: list[dict[str, Any]] = []
    simulated_clock = 0.0
    step = 0
    if resumed is not None:
        step = resumed.step
        totals = StepTotals.from_dict(resumed.run_state.get("totals"))
        faults_done = list(resumed.run_state.get("faults_done", []))
        simulated_clock = float(resumed.run_state.get("simulated_clock", 0.0))
        console.print(f"Resuming from {resumed_path} (step {step} of {plan.steps})")

    def run_state() -> dict[str, Any]:
        return {"totals": totals.to_dict(), "faults_done": list(faults_done),
                "simulated_clock": simulated_clock}

    rows = _Rows(output_dir / "steps.csv", keep_below=step if resumed is not None else None)
    guard = InterruptGuard()
    pod_start_seconds = wall = 0.0
    evaluation: dict[str, float] | None = None
    identical: bool | None = None
    t0 = time.perf_counter()
    try:
        pod = Pod(plan)
        with guard, _closing(pod), rows:
            pod_start_seconds = pod.start()
            guard.arm()  # after ray.init, which installs a SIGTERM handler of its own
            console.print(f"{plan.pod.chips} chip actors ready in {pod_start_seconds:.1f} s (wall)")
            if resumed is not None:
                pod.restore(resumed)
            if trace_path is not None:
                trace_events.extend(metadata_events(plan.pod.chips, plan.pod.chip.tensorcores,
                                                    plan.pod.torus))
            eval_every = scenario.training.eval_every_steps
            per_epoch = plan.steps_per_epoch
            epochs = -(-plan.steps // per_epoch)
            epoch_wall = time.perf_counter()
            t0 = time.perf_counter()
            with _progress(console, plan.steps) as progress:
                task = progress.add_task("training", total=plan.steps, completed=step)
                out = progress.console
                while step < plan.steps:
                    if guard.signum is not None:  # stop between steps, with a consistent state
                        if checkpoints is not None and checkpoints.last_step != step and step:
                            path = checkpoints.save(pod, plan, step, run_state())
                            out.print(f"Interrupted: wrote {path}", highlight=False)
                        guard.check()
                    pod.apply_faults(step)
                    kills = [f for f in pod.fault_plan.kills_at(step) if f.index not in faults_done]
                    trace_this = trace_path is not None and step in traced
                    t_step = time.perf_counter()
                    try:
                        if kills:
                            faults_done.extend(f.index for f in kills)
                            pod.kill_chips(sorted({r for f in kills for r in f.chips}))
                        stats = pod.step(step, trace=trace_this)
                    except ClusterError as err:
                        detected = time.perf_counter() - t_step
                        dead, hung = pod.failed_chips()
                        if not dead:
                            raise
                        event = {"fault": "; ".join(f.describe() for f in kills)
                                 or "a chip actor died (not injected)",
                                 "step": step + 1, "dead_chips": dead, "hung_chips": hung,
                                 "error": str(err), "detection_wall_seconds": detected}
                        fault_events.append(event)
                        out.print(f"fault: {event['fault']}: chip actor(s) {dead} died"
                                  + (f", {hung} stuck waiting for them" if hung else "")
                                  + f"; detected after {detected:.3f} s (wall)", style="red",
                                  highlight=False)
                        if checkpoints is None:
                            event["recovered"] = False
                            raise ChipFailureError(
                                f"chip actor(s) {', '.join(map(str, dead))} died at step {step + 1} "
                                f"({event['fault']}) and the scenario has no checkpoint: block to "
                                f"restore from (add checkpoint: {{every_steps: N}} to survive it); "
                                f"the partial results are in {output_dir}") from None
                        t_recover = time.perf_counter()
                        point = checkpoints.restore_point(plan, resumed, warn=warn)
                        # every chip gets a new actor: survivors hold ICI links to the dead
                        # chips (pod/ici.py) and may be stuck in the failed collective; a real
                        # slice restarts as a unit from its checkpoint too
                        replacing = list(range(plan.pod.chips))
                        replaced = pod.replace_chips(replacing)
                        pod.restore(point)
                        totals = StepTotals.from_dict(point.run_state.get("totals"))
                        simulated_clock = float(point.run_state.get("simulated_clock", 0.0))
                        rows.truncate(point.step)
                        event.update(recovered=True, replaced_chips=replacing,
                                     restored_from_step=point.step,
                                     steps_recomputed=step - point.step,
                                     replace_wall_seconds=replaced,
                                     recovery_wall_seconds=time.perf_counter() - t_recover)
                        out.print(f"  new actors for chips {replacing}, restored step {point.step}, "
                                  f"recomputing {step - point.step} step(s)", highlight=False)
                        step = point.step
                        progress.update(task, completed=step)
                        continue
                    if trace_this:
                        trace_events.extend(step_events(stats, pod.last_trace, pod.schedule,
                                                        plan.pod.torus, pod.ici_cost.phase_seconds,
                                                        start_s=simulated_clock,
                                                        scalar_issue_seconds=scalar_issue))
                    simulated_clock += stats.step_seconds
                    totals.add(stats)
                    metrics.observe(stats)
                    rows.write({**stats.row(), "synthetic_data": plan.dataset.synthetic})
                    if on_step:
                        on_step(stats)
                    progress.advance(task)
                    step += 1
                    if log_every and (step % log_every == 0 or step == plan.steps):
                        out.print(_progress_line(stats, plan.steps), highlight=False,
                                  soft_wrap=True)
                    if checkpoints is not None and checkpoints.due(step, plan.steps):
                        checkpoints.save(pod, plan, step, run_state())
                    last = step == plan.steps
                    if step % per_epoch == 0 and not last and epochs > 1:
                        ev = pod.evaluate()
                        metrics.set_accuracy(ev["accuracy"])
                        out.print(_epoch_line(totals, ev, step // per_epoch, epochs,
                                              time.perf_counter() - epoch_wall),
                                  highlight=False, soft_wrap=True)
                        epoch_wall = time.perf_counter()
                    elif eval_every and step % eval_every == 0 and not last:
                        ev = pod.evaluate()
                        metrics.set_accuracy(ev["accuracy"])
                        out.print(f"  test loss {ev['loss']:.4f}  "
                                  f"test accuracy {ev['accuracy']:.1%}", highlight=False)
            wall = time.perf_counter() - t0
            guard.check()  # a signal during the last step: its checkpoint is written, stop here
            evaluation = pod.evaluate()
            metrics.set_accuracy(evaluation["accuracy"])
            if epochs > 1 and totals.epoch_steps:  # the last (possibly partial) epoch
                console.print(_epoch_line(totals, evaluation, epochs, epochs,
                                          time.perf_counter() - epoch_wall),
                              highlight=False, soft_wrap=True)
            identical = pod.replicas_identical()
        summary = summarize(plan, totals, evaluation, identical, wall, pod_start_seconds)
        summary |= _reliability(fault_events, checkpoints, resumed, completed=True)
        (output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        console.print(_summary_table(summary))
        written = [output_dir / "summary.json", rows.path]
        if checkpoints is not None:
            written.append(checkpoints.dir)
        if trace_path is not None:
            write_trace(trace_path, trace_events,
                        {"scenario": scenario.name, "clock": "simulated microseconds",
                         "dataset": plan.dataset.name, "synthetic_data": plan.dataset.synthetic,
                         "traced_steps": sorted(s + 1 for s in traced if s < plan.steps)})
            written.append(trace_path)
        console.print("Wrote " + ", ".join(str(p) for p in written))
        if metrics.port and hold_seconds > 0:
            _hold(console, metrics.port, hold_seconds)
    except BaseException as err:
        # never lose what was done: the partial summary (steps.csv is already on disk)
        if isinstance(err, RunInterrupted):
            stopped = f"signal {_signal_name(err.signum)}"
        else:
            stopped = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"
        if totals.steps or fault_events or isinstance(err, RunInterrupted):
            partial = summarize(plan, totals, evaluation, identical,
                                wall or time.perf_counter() - t0, pod_start_seconds)
            partial |= _reliability(fault_events, checkpoints, resumed, completed=False)
            partial["stopped_by"] = stopped
            (output_dir / "summary.json").write_text(json.dumps(partial, indent=2) + "\n")
            console.print(f"Stopped by {stopped} after {totals.steps} of {plan.steps} steps; wrote "
                          f"{output_dir / 'summary.json'} (partial), {rows.path}"
                          + (f", checkpoints in {checkpoints.dir}" if checkpoints else ""),
                          highlight=False)
        raise
    finally:
        metrics.close()
    return summary


def _signal_name(signum: int) -> str:
    import signal

    return signal.Signals(signum).name


def _reliability(events: list[dict[str, Any]], checkpoints: RunCheckpoints | None,
                 resumed: Checkpoint | None, completed: bool) -> dict[str, Any]:
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


class _Rows:
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

    def __enter__(self) -> "_Rows":
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


def _epoch_line(totals: StepTotals, evaluation: dict[str, float], epoch: int, epochs: int,
                wall_seconds: float) -> str:
    """A Keras-style epoch line: loss, test loss / accuracy, simulated ms/step, wall
    (starts the next epoch's sums in ``totals``)."""
    steps = totals.epoch_steps
    sim_ms = totals.end_epoch() * 1e3
    return (f"Epoch {epoch}/{epochs} - {steps} steps - loss: {totals.final_loss:.4f} - "
            f"test_loss: {evaluation['loss']:.4f} - test_accuracy: {evaluation['accuracy']:.4f} - "
            f"{sim_ms:.4f} ms/step (simulated) - {wall_seconds:.1f} s (wall)")


def _progress(console: Console, total: int) -> Progress:
    """A progress bar with ETA (wall clock); lines printed through it stay above it."""
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("steps, elapsed"), TimeElapsedColumn(), TextColumn("ETA"),
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

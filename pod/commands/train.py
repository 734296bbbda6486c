"""``tpu-pod run``: one training scenario from start to summary, as a ``Run``.

A ``Run`` owns what one run of a plan needs: the pod, the checkpoints, the
metrics, steps.csv and the running totals. Its methods are the parts of the
loop: ``step`` (one step and what it reports), ``recover`` (a chip died:
new actors, back to the last checkpoint), ``checkpoint`` (the schedule),
``end_of_epoch`` (evaluation and the Keras-style line), ``finish`` (summary,
files) and ``stop`` (the partial summary after an interruption or a failure).
``run_training`` builds one and runs it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console

from pod.commands.interrupt import InterruptGuard
from pod.config.mesh import format_axes
from pod.config.plan import TrainingPlan
from pod.config.scenario import is_loopback
from pod.config.sharding import device_chip_spec
from pod.errors import (
    ChipFailureError,
    ChipUnresponsiveError,
    ClusterError,
    IciError,
    NonFiniteLossError,
    OutputError,
    RunInterrupted,
    ScenarioError,
)
from pod.report.console import (
    PROGRESS_MODES,
    StatusLine,
    algorithms_text,
    epoch_line,
    evaluation_text,
    hold,
    make_console,
    print_table,
    progress_bar,
    progress_line,
    summary_table,
)
from pod.report.files import (
    StepsCsv,
    check_writable,
    evaluated_figure,
    reliability,
    summarize,
    write_csv,
    write_json,
)
from pod.report.html import read_steps, write_report
from pod.report.metrics import PodMetrics
from pod.report.model_summary import LAYER_COLUMNS, layer_rows, plan_model_tables
from pod.report.stats import StepStats, StepTotals
from pod.report.trace import metadata_events, step_events, write_trace
from pod.runtime.admission import admit
from pod.safe_io import lock_directories
from pod.state.checkpoint import Checkpoint
from pod.state.resume import RunCheckpoints, checkpoint_dir, resume_checkpoint

__all__ = ["Run", "run_training", "RESULT_FILES", "BACKENDS"]

#: Wall seconds the final checkpoint after a SIGINT / SIGTERM may take (taken at a step
#: boundary, from chips that just ended a step; a frozen chip still fails it within its
#: heartbeat's timeout): past it the run stops with the checkpoint before.
FINAL_CHECKPOINT_GRACE_S = 10.0

#: What a run writes in its output directory (a rerun that replaces them says so).
RESULT_FILES = ("summary.json", "steps.csv", "layers.csv", "report.html")

#: The pods a ``Run`` drives (``Run``'s ``backend``).
BACKENDS = ("ray", "local", "timing")


def _check_timing_only(plan: TrainingPlan) -> None:
    """A timing-only run has no values: no checkpoint to write, no chip to kill.

    Raises:
        ScenarioError: the scenario asks for either (one line naming the field).
    """
    if plan.scenario.checkpoint is not None:
        raise ScenarioError("checkpoint: a timing-only run holds no parameters to "
                            "checkpoint; remove the checkpoint block or run functionally")
    kills = [f for f in plan.faults.faults if f.kind.startswith("kill_")]
    if kills:
        raise ScenarioError(f"faults: {kills[0].describe()}: a timing-only run has no chip "
                            "actor to kill; run functionally (without --timing-only)")


class Run:
    """One training run of a plan on an emulated pod.

    With a ``checkpoint:`` block in the scenario, the complete training state
    is written every ``every_steps`` steps and at the end; a chip actor that
    dies (a ``faults:`` kill, or a real failure) is replaced and the pod
    restored from the newest checkpoint, and training continues. SIGINT /
    SIGTERM stop the run at the next step boundary: a final checkpoint (if
    configured), the partial summary.json and steps.csv are written, the
    actors (and a local Ray cluster this run started) are shut down, and
    ``RunInterrupted`` is raised.

    Args:
        plan: the checked plan.
        output_dir: where summary.json and steps.csv go (created); None writes
            no files (the Python API's default; checkpoints then need their
            own ``checkpoint.dir``).
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
        keep_history: keep every step's ``StepStats`` in ``history`` (the
            Python API; a CLI run keeps only running sums).
        report: also write ``report.html`` in ``output_dir`` at the end
            (``pod.report.html``).
        backend: "ray" (chip actors, the ICI transport: ``pod.runtime.pod.Pod``),
            "local" (every device in this process: ``pod.runtime.local.LocalPod``;
            the same program and clock, no Ray) or "timing" (one representative device
            per pipeline stage, shapes only: ``pod.runtime.timing.TimingPod``; the same
            simulated clock for a pod of any size, no loss, no test figures).
        progress: "steps" (a progress line every ``log_every`` steps, the Keras-style
            epoch lines) or "line" (one line that each step replaces:
            ``pod.report.console.StatusLine``; a notebook's default in ``pod.run``).
        wide: print every table whole, wider than the console if need be (``--wide``).

    Raises:
        CheckpointError: no valid checkpoint to resume, or one of another run.
        DirectoryInUseError: another live run or sweep holds the output or the
            checkpoint directory (``pod.safe_io.lock_directories``; held from
            here to the end of ``run``).
        ScenarioError: ``output_dir`` is None and the checkpoints have no ``dir``; a
            timing-only run with checkpoints or chip kills (nothing to save or kill).
    """

    def __init__(self, plan: TrainingPlan, *, output_dir: Path | None,
                 metrics_port: int | None = None,
                 console: Console | None = None, log_every: int = 1,
                 on_step: Callable[[StepStats], None] | None = None,
                 trace_path: Path | None = None, trace_steps: Sequence[int] | None = None,
                 hold_seconds: float = 0.0, resume_dir: Path | None = None,
                 keep_history: bool = False, report: bool = False, backend: str = "ray",
                 progress: str = "steps", wide: bool = False) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend {backend!r} is unknown; allowed: {', '.join(BACKENDS)}")
        if backend == "timing":
            _check_timing_only(plan)
        if progress not in PROGRESS_MODES:
            raise ValueError(f"progress {progress!r} is unknown; allowed: "
                             f"{', '.join(PROGRESS_MODES)}")
        self.progress = progress
        self.wide = wide
        self.status: StatusLine | None = None
        self.plan = plan
        self.backend = backend
        self.report = report
        self.output_dir = Path(output_dir) if output_dir is not None else None
        self.console = console or make_console()
        self.log_every = log_every
        self.on_step = on_step
        self.trace_path = trace_path
        self.traced = set(trace_steps) if trace_steps is not None else {plan.steps - 1}
        self.hold_seconds = hold_seconds
        self.history: list[StepStats] | None = [] if keep_history else None
        self.locks = lock_directories(self.output_dir, checkpoint_dir(plan, self.output_dir))
        if self.output_dir is not None:
            if resume_dir is None:
                self._warn_overwrite(self.output_dir)
            check_writable(self.output_dir)  # created; a read-only file system is one line
        elif plan.scenario.checkpoint is not None and plan.scenario.checkpoint.dir is None:
            raise ScenarioError("checkpoint.dir: a run that writes no files (no output "
                                "directory) needs the checkpoints' own dir")
        self.resumed_path: Path | None = None
        self.resumed: Checkpoint | None = None
        if resume_dir is not None:
            self.resumed_path, self.resumed = resume_checkpoint(resume_dir, plan, warn=self.warn)
        scenario = plan.scenario
        self.checkpoints = (RunCheckpoints(plan, self.output_dir, resume_dir)
                            if scenario.checkpoint else None)
        # found unwritable before the first step, not at the first checkpoint
        check_writable(self.output_dir, self.checkpoints.dir if self.checkpoints else None,
                       trace_path.parent if trace_path is not None else None)
        self.metrics_port = scenario.metrics.port if metrics_port is None else metrics_port
        self.metrics: PodMetrics | None = None
        self.pod: Any = None
        self.trace_events: list[dict[str, Any]] = []
        # O(1) memory per step: running sums, not a list of every step (a long run stays flat)
        self.totals = StepTotals()
        self.faults_done: list[int] = []
        self.fault_events: list[dict[str, Any]] = []
        self.simulated_clock = 0.0
        self.step_index = 0  # steps done; the next step to run, zero-based
        if self.resumed is not None:
            self._load_run_state(self.resumed, faults_done=True)
        self.rows: StepsCsv | _NoFiles = (
            StepsCsv(self.output_dir / "steps.csv",
                     keep_below=self.step_index if self.resumed is not None else None,
                     warn=self.warn)
            if self.output_dir is not None else _NoFiles())
        self.guard = InterruptGuard()
        self.startup_wall_seconds = 0.0
        self.wall_seconds = 0.0
        self.evaluation: Any = None
        self._evaluated_at: int | None = None  # the step of the last evaluation
        self.identical: bool | None = None
        self.partial_summary: dict[str, Any] | None = None
        self._stopped = False  # ``stop`` ran
        self._t0 = time.perf_counter()
        self._epoch_wall = time.perf_counter()

    # -- small helpers -------------------------------------------------------------

    def _warn_overwrite(self, directory: Path) -> None:
        """Say so when this run replaces an earlier run's results in ``directory``."""
        writes = RESULT_FILES if self.report else RESULT_FILES[:-1]
        earlier = [name for name in writes if (directory / name).exists()]
        if earlier:
            self.warn(f"{directory} holds an earlier run's {', '.join(earlier)}: this run "
                      f"replaces them (--output-dir DIR keeps both)")

    def warn(self, text: str) -> None:
        """Print a warning line (yellow)."""
        self.console.print(text, style="yellow", highlight=False)

    def run_state(self) -> dict[str, Any]:
        """What a checkpoint carries for the run itself: sums, faults done, the clock."""
        return {"totals": self.totals.to_dict(), "faults_done": list(self.faults_done),
                "simulated_clock": self.simulated_clock}

    def _load_run_state(self, point: Checkpoint, faults_done: bool = False) -> None:
        """Continue from a checkpoint's step, sums and clock (and, resuming, its list of
        faults already injected; a recovering run keeps its own, so a kill is not
        injected twice)."""
        self.step_index = point.step
        self.totals = StepTotals.from_dict(point.run_state.get("totals"))
        self.simulated_clock = float(point.run_state.get("simulated_clock", 0.0))
        if faults_done:
            self.faults_done = list(point.run_state.get("faults_done", []))

    def layer_rows(self) -> list[dict[str, Any]]:
        """layers.csv's rows: per layer, shapes, FLOPs, HBM bytes, simulated seconds."""
        plan = self.plan
        return layer_rows(plan.model, device_chip_spec(plan.topology.chip).core,
                          plan.per_device_batch, mxu_model=plan.scenario.pod.mxu_model)

    @property
    def epochs(self) -> int:
        """Epochs the run spans (the last may be partial)."""
        return -(-self.plan.steps // self.plan.steps_per_epoch)

    # -- the run -------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Train to the last step and write the results.

        Returns:
            The summary dict, also written to ``output_dir / "summary.json"``.

        Raises:
            MetricsError, ClusterError, HBMOutOfMemoryError: one-line messages.
            ChipFailureError: chips died and there is no checkpoint to restore
                (the partial summary is written first).
            RunInterrupted: SIGINT / SIGTERM (after writing what the run has).
        """
        try:  # the locks are let go whatever fails, from here on
            if self.backend == "ray":  # a pod this machine cannot hold: one line, before any file
                admit(self.plan)
            self.start_metrics()
            self.pod = self._make_pod()
            with self.guard, self.rows:
                try:
                    self.start_pod()
                    self.train()
                    self.final_evaluation()
                except BaseException as err:
                    self.stop(err)  # the summary first: stopping the pod may take seconds
                    raise
                finally:
                    self.pod.shutdown()
            return self.finish()
        except BaseException as err:
            if not self._stopped:
                self.stop(err)
            raise
        finally:
            if self.metrics is not None:
                self.metrics.close()
            self.locks.release()

    def _make_pod(self) -> Any:
        """The pod this run trains on (``backend``): chip actors on Ray, every device in
        this process, or one representative per stage timing only; the same program and
        clock each way."""
        if self.backend == "local":
            from pod.runtime.local import LocalPod
            return LocalPod(self.plan)
        if self.backend == "timing":
            from pod.runtime.timing import TimingPod
            return TimingPod(self.plan)
        from pod.runtime.pod import Pod
        return Pod(self.plan)

    def start_metrics(self) -> None:
        """Serve Prometheus and print the run's header and model summary."""
        plan, scenario = self.plan, self.plan.scenario
        self.metrics = PodMetrics(
            scenario=scenario.name, generation=plan.topology.chip.name,
            slice_name=plan.topology.name, topology=plan.topology.torus.name,
            links=[f"{a}->{b}" for a, b in plan.topology.torus.links()],
            chips=plan.topology.chips, devices_per_chip=plan.mesh.devices_per_chip,
            dataset=plan.dataset.name,
            synthetic=plan.dataset.synthetic)
        self.metrics.serve(self.metrics_port, scenario.metrics.host)
        data_label = f"{plan.dataset.name}{' (synthetic)' if plan.dataset.synthetic else ''}"
        mesh = plan.mesh
        split = (f"{plan.per_device_batch:,} per device; {plan.steps:,} steps; mesh "
                 f"{mesh.label} ({mesh.size} devices)"
                 + (f"; {named}" if (named := algorithms_text(
                     plan.collective_costs.algorithms())) else ""))
        self.console.print(
            f"[bold]{scenario.name}[/]: {plan.topology.name}, {plan.topology.chips} chips x "
            f"{plan.topology.chip.tensorcores} TensorCores on a {plan.topology.torus.name} torus; "
            f"{plan.model.name} ({plan.num_params:,} parameters) on {data_label}; global batch "
            f"{plan.global_batch:,} = {split}")
        for table in plan_model_tables(plan):
            print_table(self.console, table, wide=self.wide)
        if self.metrics.port:
            self.console.print(f"Prometheus metrics: http://{scenario.metrics.host}:"
                               f"{self.metrics.port}/metrics")
            if scenario.metrics.expose and not is_loopback(scenario.metrics.host):
                self.warn(f"warning: metrics.expose: serving metrics on {scenario.metrics.host}, "
                          "beyond loopback: anyone who can reach this machine can read them")
        if self.resumed is not None:
            self.console.print(f"Resuming from {self.resumed_path} (step {self.step_index} of "
                               f"{plan.steps})")

    def start_pod(self) -> None:
        """Start the chip actors (and restore a resumed checkpoint)."""
        plan = self.plan
        # the pod's waits look at the guard: a signal stops the run within STOP_GRACE_S
        self.startup_wall_seconds = self.pod.start(check=self.guard.overdue)
        self.guard.arm()  # after ray.init, which installs a SIGTERM handler of its own
        if self.output_dir is not None:  # once the pod is up: a failed start-up keeps the old one
            write_csv(self.output_dir / "layers.csv", self.layer_rows(), LAYER_COLUMNS)
        where = "chip actors" if self.backend == "ray" else "chips in this process"
        devices = (f" ({plan.mesh.size} devices)" if plan.mesh.size != plan.topology.chips else "")
        self.console.print(f"{plan.topology.chips} {where}{devices} ready in "
                           f"{self.startup_wall_seconds:.1f} s (wall)")
        if self.resumed is not None:
            self.pod.restore(self.resumed)
        if self.trace_path is not None:
            self.trace_events.extend(metadata_events(f"pod.mesh {format_axes(plan.mesh.sizes)}",
                                                     list(plan.mesh.sizes),
                                                     plan.mesh.axis_size("stage")))

    def train(self) -> None:
        """Step until the last step, recovering from chip failures."""
        plan = self.plan
        self._t0 = self._epoch_wall = time.perf_counter()
        self.status = StatusLine(self.console) if self.progress == "line" else None
        with progress_bar(self.console, plan.steps, disable=self.status is not None) as progress:
            task = progress.add_task("training", total=plan.steps, completed=self.step_index)
            out = progress.console
            try:
                while self.step_index < plan.steps:
                    self.stop_if_signalled(out)
                    if self.step(out):
                        progress.advance(task)
                    else:
                        progress.update(task, completed=self.step_index)
            finally:
                if self.status is not None:
                    self.status.close()
        self.wall_seconds = time.perf_counter() - self._t0
        self.guard.check()  # a signal during the last step: its checkpoint is written, stop here

    def stop_if_signalled(self, out: Console) -> None:
        """Between steps: after SIGINT / SIGTERM, checkpoint and raise ``RunInterrupted``."""
        if self.guard.signum is None:
            return
        cp, step = self.checkpoints, self.step_index
        if cp is not None and cp.last_step != step and step:
            self.guard.renew(FINAL_CHECKPOINT_GRACE_S)  # the chips just answered a step
            path = cp.save(self.pod, self.plan, step, self.run_state())
            out.print(f"Interrupted: wrote {path}", highlight=False)
        self.guard.check()

    def step(self, out: Console) -> bool:
        """Run the next step and report it.

        Returns:
            True if the step was done; False if chips failed and the run went
            back to a checkpoint (``recover``).
        """
        step = self.step_index
        trace_this = self.trace_path is not None and step in self.traced
        stats = self.faulted_step(out, trace_this)
        if stats is None:
            return False
        if trace_this:
            rows = next((r.trace for r in self.pod.last_reports
                         if r.device == stats.traced_device), ())
            self.trace_events.extend(step_events(stats, list(self.plan.mesh.sizes),
                                                 self.simulated_clock, rows))
        self.record(stats, out)
        self.checkpoint()
        self.end_of_epoch(out)
        return True

    def faulted_step(self, out: Console, trace: bool = False) -> StepStats | None:
        """The pod's next step with the plan's faults in force (stragglers, links) and
        its kills injected; None when chips failed and the run went back to a
        checkpoint (``recover``)."""
        plan, pod, step = self.plan, self.pod, self.step_index
        pod.apply_faults(step)
        kills = [f for f in plan.faults.kills_at(step) if f.index not in self.faults_done]
        t_step = time.perf_counter()
        try:
            if kills:
                self.faults_done.extend(f.index for f in kills)
                pod.kill_chips(sorted({r for f in kills for r in f.chips}))
            return pod.step(step, trace=trace)
        except ClusterError as err:
            self.recover(err, kills, time.perf_counter() - t_step, out)
            return None

    def record(self, stats: StepStats, out: Console) -> None:
        """Add a done step to the totals, metrics, steps.csv and the console.

        Raises:
            NonFiniteLossError: the step's loss is NaN or infinite (unless
                ``training.continue_on_nonfinite_loss``); the step is not recorded,
                so the last checkpoint and steps.csv hold only finite steps.
        """
        if not math.isfinite(stats.loss) and getattr(self.pod, "computes", True) and \
                not self.plan.training.continue_on_nonfinite_loss:
            raise NonFiniteLossError(
                f"training: the loss of step {stats.step + 1} is {stats.loss}; stopping (the "
                f"checkpoints of the steps before are kept; lower training.optimizer."
                f"learning_rate, or set training.continue_on_nonfinite_loss: true)")
        if self.step_index % self.plan.steps_per_epoch == 0:
            self.totals.start_epoch()  # by step number: a resumed run never merges two epochs
        self.simulated_clock += stats.step_seconds
        self.totals.add(stats)
        assert self.metrics is not None  # run() starts the metrics before the first step
        self.metrics.observe(stats)
        self.step_index += 1
        evaluation = self.evaluate_if_due()
        if evaluation is not None:
            stats = replace(stats, test_loss=evaluated_figure(evaluation, "loss"),
                            test_accuracy=evaluated_figure(evaluation, "accuracy"))
        self.rows.write({**stats.row(), "synthetic_data": self.plan.dataset.synthetic})
        if self.history is not None:
            self.history.append(stats)
        if self.on_step:
            self.on_step(stats)
        step, total = self.step_index, self.plan.steps
        if self.status is not None:
            self.status.update(progress_line(stats, total))
        elif self.log_every and (step % self.log_every == 0 or step == total):
            out.print(progress_line(stats, total), highlight=False, soft_wrap=True)

    def evaluate_if_due(self) -> Any:
        """Evaluate on the test split after every ``eval_every_steps``-th step and after
        the last; returns the evaluation (None when not due)."""
        step, every = self.step_index, self.plan.training.eval_every_steps
        if step != self.plan.steps and not (every and step % every == 0):
            return None
        self.evaluation = self.pod.evaluate()
        assert self.metrics is not None  # run() starts the metrics before the first step
        self.metrics.set_accuracy(self.evaluation.accuracy)
        self._evaluated_at = step
        return self.evaluation

    def recover(self, err: ClusterError, kills: list[Any], detected: float, out: Console) -> None:
        """Chips or links failed during a step: report it, start new actors for every
        chip and go back to the newest checkpoint (or stop if there is none).

        A dead chip actor, or an ``IciError`` (a chip-to-chip link that failed
        mid-collective: no chip applied a partial sum, but the step is lost),
        is recovered the same way.

        Raises:
            ClusterError: ``err`` itself when it is neither (not a chip failure).
            ChipFailureError: chips died and the scenario has no checkpoint block.
            IciError: a link failed and the scenario has no checkpoint block.
        """
        plan, step = self.plan, self.step_index
        if isinstance(err, ChipUnresponsiveError):  # known already: asking them would hang
            frozen, (dead, hung) = err.ranks, ([], [])
        else:
            frozen, (dead, hung) = [], self.pod.failed_chips()
        link_failure = isinstance(err, IciError)
        if not dead and not frozen and not link_failure:
            raise err
        what = (f"chip actor(s) {dead} died" if dead else str(err) if frozen else
                "an ICI link failed mid-collective")
        event = {"fault": "; ".join(f.describe() for f in kills)
                 or ("a chip actor died (not injected)" if dead else
                     "a chip actor stopped answering (not injected)" if frozen else
                     f"ICI link failure: {err}"),
                 "step": step + 1, "dead_chips": dead, "hung_chips": hung, "error": str(err),
                 "detection_wall_seconds": detected}
        if frozen:
            event["unresponsive_chips"] = frozen
        self.fault_events.append(event)
        if self.status is not None:
            self.status.close()  # the fault's lines below the progress line, not in it
        out.print(f"fault: {event['fault']}: {what}"
                  + (f", {hung} stuck waiting for them" if hung else "")
                  + f"; detected after {detected:.3f} s (wall)", style="red", highlight=False)
        if self.checkpoints is None:
            event["recovered"] = False
            if link_failure and not dead:
                raise err
            failed = (f"chip actor(s) {', '.join(map(str, dead))} died" if dead else
                      f"chip actor(s) {', '.join(map(str, frozen))} stopped answering")
            raise ChipFailureError(
                f"{failed} at step {step + 1} "
                f"({event['fault']}) and the scenario has no checkpoint: block to restore from "
                f"(add checkpoint: {{every_steps: N}} to survive it); the partial results are "
                f"in {self.output_dir}") from None
        t_recover = time.perf_counter()
        point = self.checkpoints.restore_point(plan, self.resumed, warn=self.warn)
        # every chip gets a new actor: survivors hold ICI links to the dead chips
        # (pod/runtime/ici.py) and may be stuck in the failed collective; a real slice
        # restarts as a unit from its checkpoint too
        replacing = list(range(plan.topology.chips))
        replaced = self.pod.replace_chips(replacing)
        self.pod.restore(point)
        self._load_run_state(point)
        self.rows.truncate(point.step)
        if self.history is not None:
            del self.history[point.step - (self.resumed.step if self.resumed else 0):]
        event.update(recovered=True, replaced_chips=replacing, restored_from_step=point.step,
                     steps_recomputed=step - point.step, replace_wall_seconds=replaced,
                     recovery_wall_seconds=time.perf_counter() - t_recover)
        out.print(f"  new actors for chips {replacing}, restored step {point.step}, "
                  f"recomputing {step - point.step} step(s)", highlight=False)

    def checkpoint(self) -> None:
        """Write a checkpoint if one is due after the step just done."""
        cp = self.checkpoints
        if cp is not None and cp.due(self.step_index, self.plan.steps):
            cp.save(self.pod, self.plan, self.step_index, self.run_state())

    def end_of_epoch(self, out: Console) -> None:
        """After an epoch's last step, the Keras-style epoch line (with the test figures
        if the run evaluated after this step); after another evaluated step, its line."""
        step, plan = self.step_index, self.plan
        evaluated = self.evaluation if self._evaluated_at == step else None
        if self.status is not None:
            return  # one line only: the epochs' figures are in steps.csv and the summary
        if self.epochs > 1 and (step % plan.steps_per_epoch == 0 or step == plan.steps):
            out.print(epoch_line(self.totals, evaluated, -(-step // plan.steps_per_epoch),
                                 self.epochs, time.perf_counter() - self._epoch_wall),
                      highlight=False, soft_wrap=True)
            self._epoch_wall = time.perf_counter()
        elif evaluated is not None and step != plan.steps:
            out.print(f"  {evaluation_text(evaluated)}", highlight=False)

    def final_evaluation(self) -> None:
        """Compare the replicas (the last step's evaluation is ``evaluate_if_due``'s;
        a run resumed at its last step evaluates here)."""
        if self.evaluation is None or self._evaluated_at != self.step_index:
            self.evaluation = self.pod.evaluate()
            assert self.metrics is not None  # run() starts the metrics before the pod
            self.metrics.set_accuracy(self.evaluation.accuracy)
        self.identical = self.pod.replicas_identical()

    # -- the end -------------------------------------------------------------------

    def finish(self) -> dict[str, Any]:
        """Write summary.json (and the trace), print the summary table; hold the
        metrics endpoint if asked."""
        plan = self.plan
        summary = self.summary(self.wall_seconds, completed=True)
        print_table(self.console, summary_table(summary), wide=self.wide)
        written = []
        if self.output_dir is not None:
            assert isinstance(self.rows, StepsCsv)  # an output directory gets steps.csv
            write_json(self.output_dir / "summary.json", summary)
            written += [self.output_dir / "summary.json", self.rows.path,
                        self.output_dir / "layers.csv"]
            if self.report:
                written.append(write_report(
                    self.output_dir / "report.html", summary, read_steps(self.rows.path),
                    self.layer_rows(), plan.memory, plan.topology.chip.core.hbm_bytes))
        if self.checkpoints is not None:
            written.append(self.checkpoints.dir)
        if self.trace_path is not None:
            write_trace(self.trace_path, self.trace_events,
                        {"scenario": plan.scenario.name, "clock": "simulated microseconds",
                         "dataset": plan.dataset.name, "synthetic_data": plan.dataset.synthetic,
                         "traced_steps": sorted(s + 1 for s in self.traced if s < plan.steps)})
            written.append(self.trace_path)
        if written:
            self.console.print("Wrote " + ", ".join(str(p) for p in written))
        assert self.metrics is not None  # run() starts the metrics before the pod
        if self.metrics.port and self.hold_seconds > 0:
            hold(self.console, self.metrics.port, self.hold_seconds)
        return summary

    def summary(self, wall_seconds: float, *, completed: bool) -> dict[str, Any]:
        """What summary.json holds (``summarize`` and ``reliability``)."""
        summary = summarize(self.plan, self.totals, self.evaluation, self.identical,
                            wall_seconds, self.startup_wall_seconds)
        return summary | reliability(self.fault_events, self.checkpoints, self.resumed,
                                     completed=completed)

    def stop(self, err: BaseException) -> None:
        """Never lose what was done: write the partial summary (steps.csv is on disk)."""
        self._stopped = True
        if isinstance(err, RunInterrupted):
            import signal

            stopped = f"signal {signal.Signals(err.signum).name}"
        else:
            stopped = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"
        if not (self.totals.steps or self.fault_events or isinstance(err, RunInterrupted)):
            return
        resumed_at = self.resumed.step if self.resumed is not None else 0
        if (self.step_index == resumed_at and not self.fault_events and self.output_dir
                is not None and (self.output_dir / "summary.json").exists()):
            return  # a resume that failed before its first step: the earlier summary stands
        partial = self.summary(self.wall_seconds or time.perf_counter() - self._t0,
                               completed=False)
        partial["stopped_by"] = stopped
        self.partial_summary = partial
        wrote = ""
        if self.output_dir is not None:
            try:
                write_json(self.output_dir / "summary.json", partial)
                wrote = f"; wrote {self.output_dir / 'summary.json'} (partial)"
            except OutputError:  # a full disk: the error that stopped the run is the one line
                wrote = "; summary.json could not be written"
            wrote += f", {self.rows.path}" if self.rows.started else ""
        # an error is printed once, by whoever catches it (the CLI's one line): not here
        by = f" by {stopped}" if isinstance(err, RunInterrupted) else ""
        self.console.print(f"Stopped{by} after {self.totals.steps} of {self.plan.steps} "
                           f"steps{wrote}"
                           + (f", checkpoints in {self.checkpoints.dir}" if self.checkpoints
                              else ""),
                           highlight=False)


class _NoFiles:
    """steps.csv's stand-in for a run that writes no files."""

    path = None
    started = False

    def __enter__(self) -> _NoFiles:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def write(self, row: dict[str, Any]) -> None:
        pass

    def truncate(self, below: int) -> None:
        pass


def run_training(plan: TrainingPlan, **options: Any) -> dict[str, Any]:
    """Train the plan on an emulated pod and write the results (``Run(plan, ...).run()``).

    Args:
        plan: the checked plan.
        **options: ``Run``'s keyword arguments (``output_dir`` is required).

    Returns:
        The summary dict, also written to ``output_dir / "summary.json"``.
    """
    return Run(plan, **options).run()

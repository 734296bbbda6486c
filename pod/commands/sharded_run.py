"""``tpu-pod run`` of a plan whose ``pod.mesh`` has fsdp or tensor axes: a ``Run``
on a ``pod.runtime.sharded_pod.ShardedTrainingPod``.

The loop, the progress and epoch lines, steps.csv, the Prometheus metrics and
summary.json are ``Run``'s; a sharded run adds per mesh axis the collective
bytes, simulated seconds and exposed seconds (summed over the steps) to the
summary (``collectives_by_axis``) and to the metrics
(``tpu_pod_collective_seconds_total{axis}`` and friends). Checkpoints hold the
whole model assembled from the shards (so ``tpu-pod generate`` reads them,
and ``--resume`` shards them onto the devices again).

``--trace`` lays out the traced steps on a lane of steps, the compute of the
step's slowest device with its waits, and a lane per mesh axis with that
device's collectives (``pod.report.trace.sharded_step_events``).

Faults (``Run.faulted_step``, ``Run.recover``): ``slow_chip`` slows every
device of the chip from its step, ``slow_link`` / ``fail_link`` (and
``pod.links``) change the collectives' costs from theirs
(``ShardedTrainingPod.apply_faults``); ``kill_chip`` / ``kill_host`` kill the
chips' device actors mid-step, and the run replaces every device actor,
shards the newest checkpoint onto them and recomputes the steps since, as a
data-parallel run does. The test accuracy is not
computed (the sharded program's evaluation gives the loss).
"""

from __future__ import annotations

from typing import Any

from rich.console import Console

from pod.commands.train import Run
from pod.config.mesh import format_axes
from pod.report.trace import sharded_metadata_events, sharded_step_events

__all__ = ["ShardedRun"]


class ShardedRun(Run):
    """A ``Run`` of a sharded plan (``Run``'s arguments; ``--resume`` re-shards the
    checkpoint's whole model onto the devices, ``ShardedTrainingPod.restore``)."""

    def __init__(self, plan, **options: Any) -> None:
        self.axis_totals: dict[str, dict[str, float]] = {}  # a resumed run: the checkpoint's
        super().__init__(plan, **options)

    def run_state(self) -> dict[str, Any]:
        """``Run.run_state`` and the per-axis collective sums (a resumed run's summary
        counts every step)."""
        return super().run_state() | {"axis_totals": self.axis_totals}

    def _load_run_state(self, point: Any, faults_done: bool = False) -> None:
        super()._load_run_state(point, faults_done)
        saved = point.run_state.get("axis_totals")
        self.axis_totals = ({str(a): dict(t) for a, t in saved.items()}
                            if isinstance(saved, dict) else {})

    def _make_pod(self) -> Any:
        from pod.runtime.sharded_pod import ShardedTrainingPod

        return ShardedTrainingPod(self.plan)

    def start_pod(self) -> None:
        """Start the device actors."""
        self.startup_wall_seconds = self.pod.start()
        self.guard.arm()
        self.console.print(f"{self.plan.mesh.size} device actors ready (pod.mesh "
                           f"{self.plan.mesh.sizes}) in {self.startup_wall_seconds:.1f} s (wall)")
        if self.resumed is not None:
            self.pod.restore(self.resumed)
        if self.trace_path is not None:
            self.trace_events.extend(sharded_metadata_events(
                f"pod.mesh {format_axes(self.plan.mesh.sizes)}", list(self.plan.mesh.sizes)))

    def step(self, out: Console) -> bool:
        """Run the next sharded step and report it (``Run.faulted_step``: the faults in
        force, kills injected and recovered from); False when the run went back to a
        checkpoint."""
        stats = self.faulted_step(out)
        if stats is None:
            return False
        if self.trace_path is not None and self.step_index in self.traced:
            self.trace_events.extend(sharded_step_events(stats, list(self.plan.mesh.sizes),
                                                         self.simulated_clock))
        for axis, nbytes in stats.axis_collective_bytes.items():
            t = self.axis_totals.setdefault(axis, {"bytes": 0, "seconds": 0.0,
                                                   "exposed_seconds": 0.0})
            t["bytes"] += int(nbytes)
            t["seconds"] += float(stats.axis_collective_seconds.get(axis, 0.0))
            t["exposed_seconds"] += float(stats.axis_exposed_seconds.get(axis, 0.0))
        self.record(stats, out)
        self.metrics.observe_axes(stats)
        self.checkpoint()
        self.end_of_epoch(out)
        return True

    def end_of_epoch(self, out: Console) -> None:
        """The test loss every ``eval_every_steps`` and at the end of an epoch."""
        step, plan = self.step_index, self.plan
        eval_every = plan.scenario.training.eval_every_steps
        if step == plan.steps or not ((eval_every and step % eval_every == 0)
                                      or (step % plan.steps_per_epoch == 0 and self.epochs > 1)):
            return
        ev = self.pod.evaluate()
        out.print(f"  step {step}: test loss {ev.loss:.4f} (sharded evaluation)", highlight=False)

    def final_evaluation(self) -> None:
        """The final test loss; whether the data replicas agree bit for bit."""
        self.evaluation = self.pod.evaluate()
        self.console.print(f"test loss {self.evaluation.loss:.4f} (sharded evaluation)",
                           highlight=False)
        self.identical = self.pod.replicas_identical()

    def summary(self, wall_seconds: float, *, completed: bool) -> dict[str, Any]:
        """``Run.summary`` with the mesh, the devices per chip and the per-axis
        collectives (summed over the steps); no test accuracy (the sharded
        evaluation gives the loss)."""
        summary = super().summary(wall_seconds, completed=completed)
        summary["test_accuracy"] = None
        summary["mesh"] = dict(self.plan.mesh.sizes)
        summary["devices_per_chip"] = self.plan.mesh.devices_per_chip
        summary["collectives_by_axis"] = {
            axis: {"bytes": int(t["bytes"]), "simulated_seconds": t["seconds"],
                   "exposed_simulated_seconds": t["exposed_seconds"]}
            for axis, t in self.axis_totals.items()}
        return summary

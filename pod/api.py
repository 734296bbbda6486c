"""The Python API, for notebooks and scripts: ``pod.run``, ``pod.validate``,
``pod.describe``, ``pod.sweep``, ``pod.plan``.

A scenario is given as a path to a YAML file, a YAML string, a dict (the
same keys as the file) or a ``Scenario``. Nothing is printed with
``quiet=True`` and nothing is written without ``output_dir``. Example::

    import pod
    result = pod.run("scenarios/quickstart.yaml", steps=20, quiet=True)
    result.summary["test_accuracy"], len(result.history)
    result.to_pandas()      # one row per step (needs pandas)
    result.plot()           # loss and the simulated step-time breakdown (needs matplotlib)

A custom model built from ``pod.workloads`` layers trains in place of the
scenario's named one::

    from pod.workloads import Dense, Flatten, Model, ReLU
    mine = Model("my-mlp", [Flatten("flat"), Dense(32, "hidden"), ReLU("relu"),
                            Dense(10, "logits")], input_shape=(8, 8, 1), num_classes=10)
    result = pod.run("scenarios/quickstart.yaml", model=mine, steps=20, quiet=True)
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from pod.config.bench import BenchmarkPlan, check_benchmark
from pod.config.overrides import load_with_overrides, scenario_with_overrides, text_with_overrides
from pod.config.plan import TrainingPlan, build_plan, is_timing_sweep
from pod.config.presets import is_preset_name
from pod.config.scenario import Scenario, parse_scenario
from pod.errors import ScenarioError
from pod.report.console import PROGRESS_MODES, make_console
from pod.report.model_summary import plan_model_tables
from pod.report.stats import StepStats
from pod.workloads.model import Model

__all__ = ["RunResult", "Description", "Cluster", "load", "run", "validate", "describe", "sweep",
           "plan", "start_cluster", "stop_cluster"]


#: What ``overrides=`` takes: ``["training.steps=10", "pod.mesh.fsdp=8"]`` (values read as
#: YAML, as on the command line) or ``{"training.steps": 10}`` (values as given).
Overrides = Sequence[str] | Mapping[str, Any] | None


def load(scenario: str | Path | Mapping[str, Any] | Scenario, *,
         overrides: Overrides = None) -> Scenario:
    """A ``Scenario`` from a path, a YAML string, a dict or a ``Scenario``.

    A string is a path when it names an existing file or ends in ``.yaml`` /
    ``.yml``; a model preset's name (``"llama3.1-8b"``: the preset on the smallest v5p
    slice that holds it, as ``tpu-pod describe llama3.1-8b``); otherwise it is YAML text
    (relative paths in it are relative to the working directory).

    Args:
        scenario: the scenario.
        overrides: dotted keys set before the scenario is checked, as ``tpu-pod run
            s.yaml training.steps=10`` does (``pod.config.overrides``):
            ``["training.steps=10", "pod.mesh={data: 2, fsdp: 4}"]`` or
            ``{"training.steps": 10}``.

    Raises:
        ScenarioError: unreadable file, bad YAML, a malformed override or an invalid
            field (one line; the override that set it named).
    """
    if isinstance(scenario, (Scenario, Mapping)):
        if not overrides:
            return scenario if isinstance(scenario, Scenario) else parse_scenario(
                dict(scenario), source="<dict>")
        return scenario_with_overrides(scenario, overrides,
                                       source="<scenario>" if isinstance(scenario, Scenario)
                                       else "<dict>")
    if isinstance(scenario, Path):
        return load_with_overrides(scenario, overrides)
    if isinstance(scenario, str):
        one_line = "\n" not in scenario.strip()
        if one_line and (scenario.strip().endswith((".yaml", ".yml")) or _is_file(scenario)):
            return load_with_overrides(scenario, overrides)
        if one_line and is_preset_name(scenario):
            from pod.commands.preset_scenario import preset_scenario

            return preset_scenario(scenario.strip(), overrides)
        return text_with_overrides(scenario, overrides, source="<yaml>")
    raise ScenarioError(f"scenario: expected a path, YAML text, a dict or a Scenario, got "
                        f"{type(scenario).__name__}")


def _is_file(text: str) -> bool:
    """Whether ``text`` names an existing file (False where the OS refuses the name, e.g.
    too long)."""
    try:
        return Path(text).is_file()
    except OSError:
        return False


def validate(scenario: str | Path | Mapping[str, Any] | Scenario, *,
             sharded_ok: bool = False, overrides: Overrides = None) -> TrainingPlan | BenchmarkPlan:
    """Check a scenario as ``tpu-pod validate`` does and return its plan.

    Returns:
        The ``TrainingPlan`` (pod, batch split, HBM plan, allreduce algorithm
        and its cost, fault plan), or a ``BenchmarkPlan`` for a benchmark.

    Raises:
        ScenarioError, ShardingError, HBMPlanError, ChipError,
        InterconnectError: what ``tpu-pod run`` would reject, as one line
        (``sharded_ok``: a mesh with fsdp / tensor axes is planned, not refused;
        a timing-only sweep plans it too, as ``tpu-pod sweep`` costs it).
        ``overrides``: as ``load``.
    """
    spec = load(scenario, overrides=overrides)
    if spec.benchmark is not None:
        return check_benchmark(spec)
    timing_sweep = is_timing_sweep(spec)
    return build_plan(spec, sharded_ok=sharded_ok or timing_sweep, timing_only=timing_sweep)


@dataclass(frozen=True)
class Description:
    """What ``describe`` returns.

    Attributes:
        plan: the checked plan (``plan.topology``: chip, torus, peak FLOP/s, HBM).
        memory: the HBM plan per device, bytes per item and total.
        model_summary: the Keras-style per-layer table as text (empty for a
            benchmark).
    """

    plan: TrainingPlan | BenchmarkPlan
    memory: dict[str, int]
    model_summary: str


def describe(scenario: str | Path | Mapping[str, Any] | Scenario, *,
             detail: bool = False, overrides: Overrides = None) -> Description:
    """The pod, the HBM plan and the model summary of a scenario, as values;
    ``detail`` adds the per-part table (``layer_detail_table``) to the summary text;
    ``overrides`` as ``load``."""
    plan = validate(scenario, sharded_ok=True, overrides=overrides)
    text = ""
    if isinstance(plan, TrainingPlan):
        buffer = io.StringIO()
        # a plain file console: in Jupyter rich would draw into the cell and leave the
        # buffer empty
        console = Console(file=buffer, width=160, force_jupyter=False, force_terminal=False)
        for table in plan_model_tables(plan, detail=detail):
            console.print(table)
        text = buffer.getvalue()
    return Description(plan=plan, memory=dict(plan.memory), model_summary=text)


@dataclass(frozen=True)
class RunResult:
    """What ``run`` returns.

    Attributes:
        summary: the run's summary (the content of summary.json).
        history: one ``StepStats`` per step done, in order (simulated parts,
            loss, wall seconds, HBM, ICI bytes).
        output_dir: where the files went (None: none written).
    """

    summary: dict[str, Any]
    history: tuple[StepStats, ...]
    output_dir: Path | None = None

    def to_pandas(self) -> Any:
        """The history as a pandas DataFrame, one row per step (pandas required).

        Raises:
            ImportError: pandas is not installed (one line saying so).
        """
        try:
            import pandas as pd
        except ImportError:
            raise ImportError("RunResult.to_pandas needs pandas: pip install pandas") from None
        return pd.DataFrame([{**s.row(), "step": s.step + 1} for s in self.history])

    def plot(self, path: str | Path | None = None) -> Any:
        """Loss per step and the simulated step-time breakdown (matplotlib).

        Drawn without pyplot (``pod.report.figures``): the backend is left as it is,
        and in a notebook the figure shows once, as the cell's value.

        Args:
            path: also save the figure there (PNG, SVG, ...).

        Returns:
            The matplotlib Figure.
        """
        from pod.report import figures

        figures.show_in_notebook()
        steps = [s.step + 1 for s in self.history]
        fig, (left, right) = figures.subplots(1, 2, figsize=(11, 4))
        left.plot(steps, [s.loss for s in self.history])
        left.set(xlabel="step", ylabel="training loss", title="loss")
        parts = {"infeed": [s.infeed_seconds for s in self.history],
                 "compute": [s.compute_seconds for s in self.history],
                 "collectives, exposed": [s.exposed_collective_seconds for s in self.history],
                 "update": [s.update_seconds for s in self.history]}
        right.stackplot(steps, *[[v * 1e3 for v in vals] for vals in parts.values()],
                        labels=list(parts))
        right.set(xlabel="step", ylabel="simulated ms", title="step time (simulated)")
        right.legend(loc="upper right")
        fig.tight_layout()
        if path is not None:  # whole or not at all, like every file the tool writes
            from pod.safe_io import write_atomic

            fmt = Path(path).suffix.lstrip(".").lower() or "png"
            write_atomic(Path(path), lambda f: fig.savefig(f, format=fmt), binary=True)
        return fig


def run(scenario: str | Path | Mapping[str, Any] | Scenario, *, steps: int | None = None,
        output_dir: str | Path | None = None, quiet: bool = False,
        metrics_port: int | None = None, report: bool = False,
        model: Model | None = None, overrides: Overrides = None,
        in_process: bool = False, progress: str | None = None) -> RunResult:
    """Train a scenario on an emulated pod (unless ``in_process``, on Ray: the cluster of
    ``start_cluster`` if one is up, else a local one started and stopped for this run).

    Args:
        scenario: a path, YAML text, a dict or a ``Scenario``.
        model: a custom model built from ``pod.workloads`` layers (a ``Model``) to
            train instead of the scenario's ``model`` block (which must still be
            valid; its name is not used). Data parallel only; its checkpoints are
            written, but ``tpu-pod run --resume`` / ``generate`` / ``export``
            rebuild models by name and do not load them.
        steps: override ``training.steps``.
        output_dir: write summary.json, steps.csv and layers.csv there; None writes
            nothing.
        quiet: print nothing.
        metrics_port: serve Prometheus metrics on this port of 127.0.0.1 for the
            length of the run (None or 0: no endpoint, whatever the scenario says;
            a notebook rarely wants one).
        report: also write report.html in ``output_dir`` (summary, model, loss and
            step-time plots, HBM plan).
        overrides: dotted keys set before the scenario is checked, as ``load``
            (``["training.steps=10", "pod.mesh.fsdp=8"]``).
        in_process: run every device in this process (threads, ``LocalPod``) instead
            of Ray chip actors: the same program and simulated clock, no ICI transport
            and no Ray start-up (seconds instead of tens of seconds).
        progress: "line" (one progress line that each step replaces: the default in a
            notebook) or "steps" (a line per step and per epoch: the default elsewhere).

    Returns:
        The summary and the per-step history.

    Raises:
        ScenarioError and the other user errors: one line, before any actor
        starts. ClusterError: Ray could not start, or a chip failed for good.
        RunInterrupted: Ctrl-C (after writing what the run had).
    """
    from pod.commands.runs import make_run  # Ray is imported only when a run starts

    spec = load(scenario, overrides=overrides)
    if spec.benchmark is not None:
        raise ScenarioError("scenario: a benchmark scenario has no training run; use "
                            "`tpu-pod run` for it")
    if steps is not None:
        spec = spec.with_overrides(training__steps=steps)
    if report and output_dir is None:
        raise ScenarioError("report: report.html needs an output_dir to be written to")
    if progress not in (None, *PROGRESS_MODES):
        raise ScenarioError(f"progress: {progress!r} is not a progress mode; allowed: "
                            f"{', '.join(PROGRESS_MODES)}")
    plan = build_plan(spec, model=model)
    console = Console(quiet=True) if quiet else make_console()
    the_run = make_run(plan, output_dir=Path(output_dir) if output_dir is not None else None,
                       metrics_port=metrics_port or 0, console=console, keep_history=True,
                       report=report, backend="local" if in_process else "ray",
                       progress=progress or ("line" if console.is_jupyter else "steps"))
    summary = the_run.run()
    return RunResult(summary=summary, history=tuple(the_run.history or ()),
                     output_dir=the_run.output_dir)


class Cluster:
    """The Ray cluster ``start_cluster`` started or joined; ``stop()`` (or the end of a
    ``with`` block) stops it if it was started here. Runs in between use it.

    Attributes:
        started: True if ``start_cluster`` started this local cluster (False: it
            joined one, or Ray was already up in this process).
        address: the cluster's address (its GCS).
    """

    def __init__(self, started: bool, address: str) -> None:
        self.started = started
        self.address = address

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop the cluster if ``start_cluster`` started it (else only forget it)."""
        global _CLUSTER
        if _CLUSTER is self:
            _CLUSTER = None
        if self.started:
            from pod.runtime.cluster import shutdown_ray

            shutdown_ray()
            self.started = False

    def __repr__(self) -> str:
        return f"Cluster(address={self.address!r}, started={self.started})"


#: The cluster ``start_cluster`` keeps warm (None: each run starts and stops its own).
_CLUSTER: Cluster | None = None


def start_cluster(*, address: str | None = None, num_cpus: int | None = None,
                  dashboard: bool = False) -> Cluster:
    """Start a local Ray cluster (or join ``address``) and keep it for every later
    ``pod.run`` in this process, instead of a cluster started and stopped per run
    (10-17 s each on a small machine). In a notebook, call it once and
    ``pod.stop_cluster()`` at the end (or leave it: it stops when the kernel does); in a
    script, ``with pod.start_cluster(): ...``. Calling it again returns the same cluster.

    Args:
        address: join this cluster ("host:port"); None: ``RAY_ADDRESS``, else a local
            cluster on 127.0.0.1 with a token of this process
            (``pod.runtime.cluster``).
        num_cpus: CPUs a local cluster advertises (default: the machine's).
        dashboard: keep Ray's dashboard on 127.0.0.1:8265 (needs ``ray[default]``).

    Returns:
        The ``Cluster`` (a context manager that stops it).

    Raises:
        ClusterError: Ray could not start, or the address not joined (one line).
    """
    global _CLUSTER
    if _CLUSTER is not None:
        return _CLUSTER
    import atexit

    from pod.runtime.cluster import ensure_ray, gcs_address

    started = ensure_ray(address, num_cpus=num_cpus, dashboard=dashboard)
    _CLUSTER = Cluster(started, gcs_address())
    atexit.register(stop_cluster)
    return _CLUSTER


def stop_cluster() -> None:
    """Stop the cluster of ``start_cluster`` (nothing if there is none)."""
    if _CLUSTER is not None:
        _CLUSTER.stop()


def sweep(scenario: str | Path | Mapping[str, Any] | Scenario, *,
          output_dir: str | Path | None = None, mode: str | None = None,
          overrides: Overrides = None) -> list[dict[str, Any]]:
    """Run a sweep scenario (``sweep:`` block) and return its rows (results.csv's rows).

    Args:
        scenario: a sweep scenario.
        output_dir: where results.csv, results.md and the plots go (default:
            runs/<name>-sweep, as the CLI).
        mode: "timing" or "functional" (default: the scenario's).
        overrides: dotted keys set before the scenario is checked, as ``load``.
    """
    from pod.commands.sweep import run_sweep

    spec = load(scenario, overrides=overrides)
    if spec.sweep is None:
        raise ScenarioError("sweep: no sweep: block in this scenario")
    out = Path(output_dir) if output_dir is not None else Path("runs") / f"{spec.name}-sweep"
    return run_sweep(spec, out, mode=mode)


def plan(model: str | Path, *, slices: str | Sequence[str] = (), chips: int | None = None,
         tokens_per_step: int | str | None = None, global_batch: int | str | None = None,
         per_device_batches: Sequence[int] = (), seq_len: int | None = None,
         remat: Sequence[str] = (), mesh_axes: Sequence[str] = (),
         token_budget: int | str | None = None, files: Sequence[str | Path] = (),
         overrides: Overrides = None, output_dir: str | Path | None = None,
         num_slices: int | Sequence[int] = (), capacity_factors: float | Sequence[float] = (),
         exhaustive: bool = False, jobs: int | None = None,
         progress: bool = True) -> list[dict[str, Any]]:
    """Which layout trains ``model`` fastest (``tpu-pod plan``): every mesh, remat policy
    and batch, planned, costed timing-only and ranked by simulated tokens/s.

    Args:
        model: a preset's name (``"llama2-7b"``), a scenario file, or MaxText's base.yml
            (``files``: its model.yml).
        slices: a slice (``"v5e-256"``) or several; with ``chips``, generations.
        chips: every generation's slice of this many chips.
        tokens_per_step, global_batch: the batch (``4194304``, ``"4Mi"``; sequences for
            ``global_batch``); neither: ``per_device_batches`` (default 1, 2, 4, 8).
        seq_len: tokens per sequence (default: the model's).
        remat, mesh_axes: what to search (default: every policy, every axis the runtime
            runs).
        token_budget: rank by the simulated time to train on this many tokens.
        num_slices: numbers of identical slices joined by the DCN (``2`` or ``(1, 2, 4)``),
            data parallel across them (``pod.slices``, ``pod.dcn_mesh: {data: K}``);
            default 1.
        overrides: keys of the model's scenario (MaxText keys for MaxText configs; MaxText's
            layout keys, ``ici_fsdp_parallelism``, ``per_device_batch_size``, ..., with any
            model: ``tpu-pod plan --help``).
        output_dir: write results.csv, layouts.png and best.yaml there (None: nothing).
        capacity_factors: a mixture of experts' capacity factors to try (0: dropless).
        exhaustive: cost every point that plans (else the points whose compute alone is
            slower than the 30 best are not costed: their ``status`` is "pruned").
        jobs: processes that cost points (None: one per core).
        progress: a progress bar on a terminal, or in a notebook (with ipywidgets).

    Returns:
        One row per point (``pod.commands.plan.PLAN_COLUMNS``): the costed ones ranked
        (``rank`` 1 is the best), then those dropped with their ``reason``; a missing
        number is NaN, so ``pd.DataFrame(rows)`` works.

    Raises:
        ScenarioError and the other user errors: one line.
    """
    from pod.commands.plan import PlanRequest, run_plan
    from pod.commands.plan_report import plan_progress

    request = PlanRequest(model=str(model), files=tuple(str(f) for f in files),
                          slices=(slices,) if isinstance(slices, str) else tuple(slices),
                          chips=chips, tokens_per_step=tokens_per_step,
                          global_batch=global_batch,
                          per_device_batches=tuple(per_device_batches), seq_len=seq_len,
                          remat=(remat,) if isinstance(remat, str) else tuple(remat),
                          mesh_axes=(mesh_axes,) if isinstance(mesh_axes, str)
                          else tuple(mesh_axes),
                          token_budget=token_budget, overrides=overrides or (),
                          num_slices=(num_slices,) if isinstance(num_slices, int | str)
                          else tuple(num_slices),
                          capacity_factors=(capacity_factors,)
                          if isinstance(capacity_factors, int | float | str)
                          else tuple(capacity_factors),
                          exhaustive=exhaustive, workers=jobs)
    out = Path(output_dir) if output_dir is not None else None
    if not progress:
        return run_plan(request, output_dir=out).rows
    with plan_progress() as on_point:
        return run_plan(request, output_dir=out, on_point=on_point).rows

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

import contextlib
import io
import warnings
from collections.abc import Callable, Mapping, Sequence
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
from pod.report.bounds import StepBounds
from pod.report.console import PROGRESS_MODES, StatusLine, make_console
from pod.report.model_summary import plan_model_tables
from pod.report.stats import StepStats
from pod.workloads.model import Model

__all__ = ["RunResult", "Description", "Cluster", "Rows", "PlanRows", "load", "run", "validate",
           "describe", "sweep", "plan", "plan_facts", "start_cluster", "stop_cluster"]


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


def plan_facts(plan: TrainingPlan | BenchmarkPlan) -> dict[str, Any]:
    """What a checked plan decided, as plain data (``tpu-pod validate --json``'s record):
    the pod, the model and data, the mesh and batch split, the collective algorithm of
    each mesh axis, one device's HBM; a benchmark's kind, size and precision."""
    pod = plan.topology
    where = {"slice": pod.name, "chips": pod.chips, "cores": pod.tensorcores}
    if isinstance(plan, BenchmarkPlan):
        b = plan.benchmark
        return {"kind": "benchmark", "benchmark": b.kind, **where, "n": b.n,
                "iterations": b.iterations, "precision": b.precision}
    return {"kind": "sweep" if plan.scenario.sweep else "training", **where,
            "model": plan.model.name, "parameters": plan.num_params,
            "dataset": plan.dataset.name, "global_batch": plan.global_batch,
            "per_device_batch": plan.per_device_batch, "mesh": dict(plan.mesh.sizes),
            "devices": plan.mesh.size, "steps": plan.steps,
            "collective_algorithms": plan.collective_costs.algorithms(),
            "hbm_bytes_per_device": plan.memory["total"]}


@dataclass(frozen=True)
class Description:
    """What ``describe`` returns.

    Attributes:
        plan: the checked plan (``plan.topology``: chip, torus, peak FLOP/s, HBM).
        memory: the HBM plan per device, bytes per item and total.
        step: one timing-only step of the plan (``TimingPod``; simulated figures:
            ``step.step_seconds``, ``step.mfu``, ...); None for a benchmark, or a
            model whose program does not run on the mesh (a plan ``describe`` makes
            anyway).
        bounds: what bounds that step (``pod.report.bounds.step_bounds``), or None.
        detail: ``model_summary`` holds the per-part table too.
    """

    plan: TrainingPlan | BenchmarkPlan
    memory: dict[str, int]
    step: StepStats | None = None
    bounds: StepBounds | None = None
    detail: bool = False

    @property
    def model_summary(self) -> str:
        """The Keras-style per-layer table as text (empty for a benchmark; with
        ``detail``, the per-part table too: ``layer_detail_table``)."""
        if not isinstance(self.plan, TrainingPlan):
            return ""
        buffer = io.StringIO()
        # a plain file console: in Jupyter rich would draw into the cell and leave the
        # buffer empty
        console = Console(file=buffer, width=160, force_jupyter=False, force_terminal=False)
        for table in plan_model_tables(self.plan, detail=self.detail):
            console.print(table)
        return buffer.getvalue()

    def __repr__(self) -> str:
        """One line (a notebook cell's value): the plan and the step's figures."""
        step = ("" if self.step is None else
                f"; one step {self.step.step_seconds * 1e3:,.3f} ms (simulated), MFU "
                f"{self.step.mfu:.1%}")
        return f"<Description of {self.plan!r}{step}>"


def describe(scenario: str | Path | Mapping[str, Any] | Scenario, *,
             detail: bool = False, overrides: Overrides = None) -> Description:
    """The pod, the HBM plan, the model summary and one timing-only step of a scenario, as
    values (``tpu-pod describe``); ``detail`` adds the per-part table
    (``layer_detail_table``) to the summary text; ``overrides`` as ``load``.

    Raises:
        ScenarioError and the other user errors, as ``validate`` (any mesh is planned).
    """
    plan = validate(scenario, sharded_ok=True, overrides=overrides)
    if not isinstance(plan, TrainingPlan):
        return Description(plan=plan, memory=dict(plan.memory), detail=detail)
    step, bounds = _timing_step(plan)
    return Description(plan=plan, memory=dict(plan.memory), step=step, bounds=bounds,
                       detail=detail)


def _timing_step(plan: TrainingPlan) -> tuple[StepStats | None, StepBounds | None]:
    """One timing-only step of the plan and its bounds; (None, None) when the model's
    program does not run on the plan's mesh."""
    from pod.report.bounds import step_bounds
    from pod.runtime.timing import TimingPod

    try:
        plan.check_runnable()
    except ScenarioError:
        return None, None
    stats = TimingPod(plan).step(0)
    return stats, step_bounds(stats, plan.collective_costs, plan.topology.torus)


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

    def __repr__(self) -> str:
        """One line (a notebook cell's value): what ran and its headline figures."""
        s = self.summary
        if not s.get("steps"):
            return f"<RunResult {s.get('scenario')}: no step done>"
        rate = (f"{s['simulated_tokens_per_second']:,.0f} tokens/s"
                if s.get("simulated_tokens_per_second") else
                f"{s['simulated_examples_per_second']:,.0f} examples/s")
        loss = (f", loss {s['initial_loss']:.4f} -> {s['final_loss']:.4f}"
                if s.get("final_loss") is not None else "")
        accuracy = (f", test accuracy {s['test_accuracy']:.4f}"
                    if s.get("test_accuracy") is not None else "")
        where = f", files in {self.output_dir}" if self.output_dir is not None else ""
        return (f"<RunResult {s['scenario']}: {s['steps']:,} steps on {s['slice']}{loss}"
                f"{accuracy}; {s['simulated_step_seconds'] * 1e3:,.4f} ms/step, {rate}, MFU "
                f"{s['mfu']:.2%} (simulated){where}; .summary, .history, .to_pandas()>")

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
        from matplotlib.ticker import MaxNLocator

        steps = [s.step + 1 for s in self.history]
        fig, (left, right) = figures.subplots(1, 2, figsize=(11, 4))
        losses = [s.loss for s in self.history]
        if any(loss == loss for loss in losses):  # NaN: a timing-only run computes none
            left.plot(steps, losses)
        else:
            left.text(0.5, 0.5, "no loss: a timing-only run\ncomputes shapes, not values",
                      ha="center", va="center", transform=left.transAxes)
            left.set_xlim(min(steps, default=1), max(steps, default=1) + 1e-9)
        left.set(xlabel="step", ylabel="training loss", title="loss")
        # the critical path's parts, which add up to the step: what overlaps is not stacked
        h = self.history
        parts = {"infeed, exposed": [s.exposed_infeed_seconds for s in h],
                 "dispatch": [s.dispatch_seconds for s in h],
                 "compute": [s.compute_seconds for s in h],
                 "collectives, exposed": [s.exposed_collective_seconds for s in h],
                 "host offload, exposed": [s.exposed_host_offload_seconds for s in h],
                 "pipeline bubble": [s.pipeline_bubble_seconds for s in h],
                 "update": [s.update_seconds for s in h]}
        parts = {name: values for name, values in parts.items() if any(values)}
        right.stackplot(steps, *[[v * 1e3 for v in vals] for vals in parts.values()],
                        labels=list(parts))
        right.set(xlabel="step", ylabel="simulated ms", title="step time (simulated)")
        right.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
        for ax in (left, right):
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole
        fig.tight_layout()
        if path is not None:  # whole or not at all, like every file the tool writes
            from pod.safe_io import write_atomic

            fmt = Path(path).suffix.lstrip(".").lower() or "png"
            write_atomic(Path(path), lambda f: fig.savefig(f, format=fmt, bbox_inches="tight"),
                         binary=True)
        return fig


def run(scenario: str | Path | Mapping[str, Any] | Scenario, *, steps: int | None = None,
        output_dir: str | Path | None = None, quiet: bool = False,
        metrics_port: int | None = None, report: bool = False,
        model: Model | None = None, overrides: Overrides = None,
        in_process: bool = False, timing_only: bool = False,
        progress: str | None = None) -> RunResult:
    """Train a scenario on an emulated pod (unless ``in_process`` or ``timing_only``, on
    Ray: the cluster of ``start_cluster`` if one is up, else a local one started and
    stopped for this run).

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
        timing_only: only account time (``TimingPod``: one representative device per
            pipeline stage, shapes only, in this process): the same simulated figures
            for a pod of any size in seconds, but no loss, no test figures and no
            checkpoints (``tpu-pod run --timing-only``).
        progress: "line" (one progress line that each step replaces: the default in a
            notebook) or "steps" (a line per step and per epoch: the default elsewhere).

    Returns:
        The summary and the per-step history.

    Raises:
        ScenarioError and the other user errors: one line, before any actor
        starts. ClusterError: Ray could not start, or a chip failed for good.
        RunInterrupted: Ctrl-C (after writing what the run had).
    """
    from pod.commands.train import Run  # Ray is imported only when a run starts

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
    if in_process and timing_only:
        raise ScenarioError("timing_only: a timing-only run is in this process already; give "
                            "in_process or timing_only, not both")
    plan = build_plan(spec, model=model, timing_only=timing_only)
    console = Console(quiet=True) if quiet else make_console()
    the_run = Run(plan, output_dir=Path(output_dir) if output_dir is not None else None,
                  metrics_port=metrics_port or 0, console=console, keep_history=True,
                  report=report, backend=backend_of(in_process, timing_only),
                  progress=progress or ("line" if console.is_jupyter else "steps"))
    summary = the_run.run()
    return RunResult(summary=summary, history=tuple(the_run.history or ()),
                     output_dir=the_run.output_dir)


def backend_of(in_process: bool, timing_only: bool) -> str:
    """``Run``'s back-end for the options of ``run`` (and ``tpu-pod run``'s flags)."""
    return "timing" if timing_only else "local" if in_process else "ray"


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


class Rows(list):
    """Rows of results, one dict per point (``sweep``'s, ``plan``'s): a list, so
    ``pd.DataFrame(rows)`` works, that a notebook shows in one line (``repr``) or as a
    short table (``_repr_html_``: the first ``HTML_ROWS`` rows' key columns).

    Args:
        rows: the rows.
        title: what they are ("sweep quickstart", "plan llama2-7b").
        columns: the key columns the table shows (those the rows have).
    """

    HTML_ROWS = 20

    def __init__(self, rows: Sequence[dict[str, Any]], title: str,
                 columns: Sequence[str] = ()) -> None:
        super().__init__(rows)
        self.title = title
        self.columns = tuple(columns)

    def __repr__(self) -> str:
        ok = sum(r.get("status") == "ok" for r in self)
        return (f"<{self.title}: {len(self)} rows, {ok} ok, {len(self) - ok} not; a list of "
                "dicts: pd.DataFrame(rows), rows[0]>")

    def _repr_html_(self) -> str:
        import html

        columns = [c for c in self.columns if any(c in r for r in self)]
        head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(_cell_text(r.get(c)))}</td>"
                                        for c in columns) + "</tr>"
                       for r in self[:self.HTML_ROWS])
        more = (f"<p>... {len(self) - self.HTML_ROWS} more rows</p>"
                if len(self) > self.HTML_ROWS else "")
        return (f"<p>{html.escape(repr(self))}</p><table><thead><tr>{head}</tr></thead>"
                f"<tbody>{body}</tbody></table>{more}")


def _cell_text(value: Any) -> str:
    """A row value in a notebook table: numbers to 4 significant digits, missing empty."""
    if value is None or value == "" or (isinstance(value, float) and value != value):
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


#: the columns a notebook shows of a sweep's rows (``Rows``)
SWEEP_COLUMNS = ("point", "status", "slice", "chips", "mesh", "remat", "global_batch",
                 "simulated_step_seconds", "simulated_tokens_per_second",
                 "simulated_examples_per_second", "mfu", "bound", "error")


def sweep(scenario: str | Path | Mapping[str, Any] | Scenario, *,
          output_dir: str | Path | None = None, mode: str | None = None,
          overrides: Overrides = None, fresh: bool = False, quiet: bool = False,
          on_point: Callable[[dict[str, Any]], None] | None = None,
          on_resume: Callable[[int, Path], None] | None = None,
          warn: Callable[[str], None] | None = None) -> Rows:
    """Run a sweep scenario (``sweep:`` block) and return its rows (results.csv's rows), as
    ``tpu-pod sweep`` does.

    Args:
        scenario: a sweep scenario.
        output_dir: where results.csv, results.md and the plots go (default:
            runs/<name>-sweep, as the CLI).
        mode: "timing" or "functional" (default: the scenario's).
        overrides: dotted keys set before the scenario is checked, as ``load``.
        fresh: run every point again, ignoring the points an earlier, stopped run of the
            same sweep finished in ``output_dir``.
        quiet: no progress line (by default, on a terminal or in a notebook, one line
            replaced as each point finishes: ``pod.report.console.StatusLine``).
        on_point: called with each finished row (reused ones included).
        on_resume: called with the number of rows reused from an earlier run and its
            journal.
        warn: called with one line per damaged row of an earlier run's journal (that
            point runs again).

    Returns:
        The rows (``Rows``: a list of dicts, keys ``pod.commands.sweep.COLUMNS``).

    Raises:
        ScenarioError and the other user errors: one line. RunInterrupted: Ctrl-C or
        SIGTERM (the finished rows kept on disk).
    """
    from pod.commands.sweep import run_sweep, sweep_points

    spec = load(scenario, overrides=overrides)
    if spec.sweep is None:
        raise ScenarioError("sweep: no sweep: block in this scenario")
    out = Path(output_dir) if output_dir is not None else Path("runs") / f"{spec.name}-sweep"
    total = len(sweep_points(spec))
    done = {"ok": 0, "failed": 0}
    console = make_console()
    # a line replaced in place on a terminal or in a notebook; nothing in a log or a pipe
    shown = not quiet and (console.is_terminal or console.is_jupyter)
    status = StatusLine(console if shown else Console(quiet=True))

    def point(row: dict[str, Any]) -> None:
        done["ok" if row["status"] == "ok" else "failed"] += 1
        status.update(f"sweep {spec.name}: {done['ok'] + done['failed']}/{total} points "
                      f"({done['failed']} failed)")
        if on_point is not None:
            on_point(row)

    with status:
        rows = run_sweep(spec, out, mode=mode, on_point=point, fresh=fresh, on_resume=on_resume,
                         warn=warn)
    return Rows(rows, f"sweep {spec.name}", SWEEP_COLUMNS)


def plan(model: str | Path, *, slice: str | Sequence[str] = (),  # noqa: A002 - --slice
         chips: int | None = None,
         tokens_per_step: int | str | None = None, global_batch: int | str | None = None,
         per_device_batch: int | Sequence[int] = (), seq_len: int | None = None,
         remat: str | Sequence[str] = (), mesh_axes: str | Sequence[str] = (),
         token_budget: int | str | None = None, files: Sequence[str | Path] = (),
         overrides: Overrides = None, output_dir: str | Path | None = None,
         num_slices: int | Sequence[int] = (), capacity_factor: float | Sequence[float] = (),
         top: int = 10, exhaustive: bool = False, jobs: int | None = None,
         progress: bool = True, default_output: bool = False,
         on_point: Callable[[dict[str, Any], int], None] | None = None,
         slices: str | Sequence[str] | None = None,
         per_device_batches: Sequence[int] | None = None) -> PlanRows:
    """Which layout trains ``model`` fastest (``tpu-pod plan``): every mesh, remat policy
    and batch, planned, costed timing-only and ranked by simulated tokens/s. The keywords
    are the command's options (``slice=`` is ``--slice``, ``per_device_batch=`` is
    ``--per-device-batch``, ``capacity_factor=`` is ``--capacity-factor``); a value of an
    option that takes several is one or a sequence (``remat="full"`` or ``("full",
    "minimal")``).

    Args:
        model: a preset's name (``"llama2-7b"``), a scenario file, or MaxText's base.yml
            (``files``: its model.yml).
        slice: a slice (``"v5e-256"``) or several; with ``chips``, generations.
        chips: every generation's slice of this many chips.
        tokens_per_step, global_batch: the batch (``4194304``, ``"4Mi"``; sequences for
            ``global_batch``); neither: ``per_device_batch``, one or several tried on
            every mesh (default 1, 2, 4, 8).
        seq_len: tokens per sequence (default: the model's).
        remat, mesh_axes: what to search (default: ``DEFAULT_REMATS`` of
            ``pod.commands.plan_search`` ("all": every policy), every axis the runtime
            runs).
        token_budget: rank by the simulated time to train on this many tokens.
        num_slices: numbers of identical slices joined by the DCN (``2`` or ``(1, 2, 4)``),
            data parallel across them (``pod.slices``, ``pod.dcn_mesh: {data: K}``);
            default 1.
        overrides: keys of the model's scenario (MaxText keys for MaxText configs; MaxText's
            layout keys, ``ici_fsdp_parallelism``, ``per_device_batch_size``, ..., with any
            model: ``tpu-pod plan --help``).
        output_dir: write results.csv, layouts.png and best.yaml there (None: nothing, or
            with ``default_output`` in ``runs/plan-<model>-<slice>``, as the command).
        capacity_factor: a mixture of experts' capacity factors to try (0: dropless;
            default: the model's, and 1.25 too for a dropless one).
        top: the best points costed whatever their bound (at least 30; the table's).
        exhaustive: cost every point that plans (else the points whose compute alone is
            slower than the 30 best are not costed: their ``status`` is "pruned").
        jobs: processes that cost points (None: one per core).
        progress: a progress bar on a terminal, or in a notebook (with ipywidgets).
        on_point: called with each point's row and the number of points (the command's
            own progress; ``progress=False`` then).
        slices, per_device_batches: the earlier names of ``slice`` and
            ``per_device_batch`` (deprecated: a ``DeprecationWarning``).

    Returns:
        One row per point (``pod.commands.plan.PLAN_COLUMNS``): the costed ones ranked
        (``rank`` 1 is the best), then the pruned, dropped and failed ones with their
        ``reason``; a missing number is NaN, so ``pd.DataFrame(rows)`` works. Its
        ``result`` is the whole ``PlanResult`` (what was searched, the files written).

    Raises:
        ScenarioError and the other user errors: one line.
    """
    from pod.commands.plan import PlanRequest

    slice = _renamed("slices", slices, "slice", slice)
    per_device_batch = _renamed("per_device_batches", per_device_batches, "per_device_batch",
                                per_device_batch)
    request = PlanRequest(model=str(model), files=tuple(str(f) for f in files),
                          slices=_several(slice), chips=chips, tokens_per_step=tokens_per_step,
                          global_batch=global_batch,
                          per_device_batches=_several(per_device_batch), seq_len=seq_len,
                          remat=_several(remat), mesh_axes=_several(mesh_axes),
                          token_budget=token_budget, overrides=overrides or (),
                          num_slices=_several(num_slices),
                          capacity_factors=_several(capacity_factor), top=top,
                          exhaustive=exhaustive, workers=jobs)
    return PlanRows(_run_plan(request, Path(output_dir) if output_dir is not None else None,
                              default_output, progress, on_point))


def _run_plan(request: Any, output_dir: Path | None, default_output: bool, progress: bool,
              on_point: Callable[[dict[str, Any], int], None] | None) -> Any:
    """``run_plan`` with a progress bar (``progress``: ``plan_progress``) and the caller's
    ``on_point``; the ``PlanResult``."""
    from pod.commands.plan import run_plan
    from pod.commands.plan_report import plan_progress

    with plan_progress() if progress else contextlib.nullcontext(None) as shown:
        def both(row: dict[str, Any], total: int) -> None:
            if shown is not None:
                shown(row, total)
            if on_point is not None:
                on_point(row, total)

        return run_plan(request, output_dir=output_dir, on_point=both,
                        default_output=default_output)


def _several(value: Any) -> tuple[Any, ...]:
    """An option that takes several values given one (``"full"``, ``2``) or several."""
    if value is None:
        return ()
    return (value,) if isinstance(value, str | int | float) else tuple(value)


#: the columns a notebook shows of a plan's rows (``Rows``)
PLAN_ROW_COLUMNS = ("rank", "status", "slice", "mesh", "remat", "per_device_batch",
                    "global_batch", "simulated_step_seconds", "simulated_tokens_per_second",
                    "simulated_examples_per_second", "mfu", "hbm_per_device_bytes", "bound",
                    "reason")


class PlanRows(Rows):
    """A plan's rows (``plan``): ``Rows`` with the ``PlanResult`` they come from.

    Args:
        result: the finished plan (``pod.commands.plan.PlanResult``).

    Attributes:
        result: the plan: what was searched, ``output_dir`` (where its files went, None:
            nowhere), ``summary()``; the command's table and lines are made from it.
    """

    def __init__(self, result: Any) -> None:
        super().__init__(result.rows, f"plan {result.name}", PLAN_ROW_COLUMNS)
        self.result = result


def _renamed(old: str, old_value: Any, new: str, new_value: Any) -> Any:
    """A keyword's value given by its earlier name (a ``DeprecationWarning``), or its own.

    Raises:
        ScenarioError: both names given.
    """
    if old_value is None:
        return new_value
    if new_value not in ((), None):
        raise ScenarioError(f"{old}: give {new}= (its new name) or {old}=, not both")
    warnings.warn(f"{old}= is deprecated; use {new}= (the name of the command's option)",
                  DeprecationWarning, stacklevel=3)
    return old_value

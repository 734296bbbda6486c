"""``tpu-pod``: the command line (``python -m pod`` does the same).

Commands: ``run`` a scenario, ``validate`` scenarios, ``describe`` a chip, a
slice or a scenario. A user mistake ends in one line on stderr naming the
field, the value and what is allowed, and exit status 2; never a traceback.
"""

from __future__ import annotations

import errno
import functools
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from chip import MXU_MODELS, PRECISIONS, PRESETS, get_chip_spec
from pod import api
from pod.commands.bench import matmul_report
from pod.commands.plan_search import DEFAULT_REMATS
from pod.config.mesh import device_hbm_bytes, devices_per_chip, format_axes
from pod.config.overrides import (
    Override,
    as_overrides,
    blame,
    load_with_overrides,
    looks_like_override,
)
from pod.config.plan import TrainingPlan, build_plan
from pod.config.presets import is_preset_name
from pod.config.scenario import Scenario
from pod.config.sharding import device_chip_spec
from pod.config.slices import resolve_pod
from pod.errors import (
    USER_ERRORS,
    HBMPlanError,
    OutputError,
    RunInterrupted,
    ScenarioError,
    one_line,
)
from pod.report.console import algorithms_text, make_console, print_table, titled_table
from pod.report.describe import memory_table, pod_json, pod_table, step_line, step_record
from pod.report.model_summary import layer_costs, plan_model_tables
from pod.workloads.transformer import MAX_TRANSFORMER_OPTION

__all__ = ["cli", "main"]

EXIT_USER_ERROR = 2
#: What a file system refuses a write with: no space (ENOSPC, EDQUOT), a file past a
#: limit (EFBIG), read-only (EROFS), no permission (EACCES, EPERM).
_FILE_SYSTEM_REFUSALS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS,
                                   errno.EACCES, errno.EPERM})
#: Most steps one --trace holds (each keeps its events in memory until the trace is written).
MAX_TRACED_STEPS = 1_000


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="tpu-pod-emulator")
def cli() -> None:
    """Emulate a TPU pod: chips that really compute, a simulated ICI, and
    training on a device mesh (data, stage, fsdp, expert, tensor) with Prometheus metrics.

    Figures are either SIMULATED (what the TPU pod would take, from the cost
    models) or WALL (what the emulation took on this machine).
    """


#: The help of the KEY=VALUE arguments of every command that takes a scenario.
OVERRIDES_HELP = ("KEY=VALUE arguments after the scenario override its keys before it is checked "
                  "(dotted keys, YAML values): training.steps=10 pod.mesh.fsdp=8 "
                  "'pod.mesh={data: 2, fsdp: 4}'.")


#: ``--wide``: every table whole, every column, wider than the terminal if need be (piped
#: output always is); without it a table too wide for the terminal leaves columns out.
WIDE = click.option("--wide", is_flag=True,
                    help="Print every table whole, every column (wider than the terminal if "
                         "need be; piped output always is).")


@cli.command(short_help="Train a scenario on an emulated pod (or run its benchmark).",
             epilog=OVERRIDES_HELP)
@click.argument("scenario", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("overrides", nargs=-1, metavar="[KEY=VALUE]...")
@click.option("--steps", type=click.IntRange(min=1), help="Override training.steps.")
@click.option("--output-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Where summary.json and steps.csv go [default: runs/<scenario name>].")
@click.option("--metrics-port", type=click.IntRange(0, 65535),
              help="Prometheus port on 127.0.0.1 (0 disables) [default: the scenario's].")
@click.option("--log-every", type=click.IntRange(min=0), default=1, show_default=True,
              help="Print a progress line every N steps (0: none).")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Write a Chrome trace (Perfetto, chrome://tracing) of the simulated timeline.")
@click.option("--trace-steps", default=None,
              help="Steps to trace, 1-based: e.g. 2 or 1,5,10 or last (at most 1,000) "
                   "[default: last].")
@click.option("--hold", is_flag=True,
              help="Keep the metrics endpoint up after the run, until Ctrl-C.")
@click.option("--hold-seconds", type=click.FloatRange(min=0), default=0.0,
              help="Keep the metrics endpoint up this many seconds after the run.")
@click.option("--resume", "resume_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Continue from the newest valid checkpoint in this directory.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the summary as one JSON document on stdout (progress goes to stderr).")
@click.option("--report", is_flag=True,
              help="Also write report.html: summary, model, loss and step-time plots, HBM plan.")
@click.option("--ray-dashboard", is_flag=True,
              help="Keep Ray's dashboard on (127.0.0.1:8265) for a local cluster; needs "
                   "'ray[default]'.")
@click.option("--progress", type=click.Choice(["steps", "line"]), default="steps",
              show_default=True,
              help="steps: a line per step (--log-every) and per epoch; line: one line that "
                   "each step rewrites (for logs and notebooks).")
@click.option("--in-process", is_flag=True,
              help="Run every device in this process (threads) instead of Ray chip actors: the "
                   "same program and simulated clock, no ICI transport, no Ray start-up.")
@click.option("--timing-only", is_flag=True,
              help="Only account time: one device per pipeline stage, shapes only, in this "
                   "process; the same simulated figures for a pod of any size, no loss.")
@WIDE
def run(scenario: Path, overrides: tuple[str, ...], steps: int | None, output_dir: Path | None,
        metrics_port: int | None, log_every: int, trace_path: Path | None,
        trace_steps: str | None, hold: bool, hold_seconds: float, resume_dir: Path | None,
        as_json: bool, report: bool, ray_dashboard: bool, progress: str,
        in_process: bool, timing_only: bool, wide: bool) -> None:
    """Train SCENARIO (a YAML file) on an emulated pod, or run its benchmark."""
    items = as_overrides(overrides)
    spec = _load(scenario, items)
    if trace_steps is not None and trace_path is None:
        raise click.BadParameter("needs --trace FILE to write the steps to",
                                 param_hint="--trace-steps")
    if spec.sweep is not None:
        raise ScenarioError(f"{scenario}: sweep: this is a sweep scenario; run it with "
                            f"`tpu-pod sweep {scenario}`")
    console = make_console(sys.stderr) if as_json else None
    if spec.benchmark is not None:
        from pod.commands.bench import run_benchmark  # Ray is imported only when a run starts

        if trace_path is not None:
            raise click.BadParameter("a benchmark scenario has no training timeline to trace",
                                     param_hint="--trace")
        echo = (lambda line: click.echo(line, err=True)) if as_json else click.echo
        summary = run_benchmark(spec, output_dir=output_dir or Path("runs") / spec.name, echo=echo)
    else:
        from pod.commands.train import Run  # Ray is imported only when a run starts

        if steps is not None:
            spec = spec.with_overrides(training__steps=steps)
        if ray_dashboard:
            spec = spec.with_overrides(ray__dashboard=True)
        if in_process and timing_only:
            raise click.UsageError("--in-process and --timing-only: a timing-only run is in "
                                   "this process already; give one")
        plan = _checked(functools.partial(build_plan, timing_only=timing_only), spec, scenario,
                        items)
        summary = Run(plan, output_dir=output_dir or Path("runs") / spec.name,
                      metrics_port=metrics_port, log_every=log_every, trace_path=trace_path,
                      trace_steps=_parse_steps(trace_steps or "last", plan.steps),
                      hold_seconds=math.inf if hold else hold_seconds, resume_dir=resume_dir,
                      console=console, report=report, wide=wide,
                      backend=api.backend_of(in_process, timing_only), progress=progress).run()
    if as_json:
        click.echo(json.dumps(summary, indent=2))


def _load(target: str | Path, overrides: tuple[Override, ...] = ()) -> Scenario:
    """A scenario file, or a preset's name (``llama3.1-8b``: ``describe_scenario``), with
    the command line's overrides."""
    text = str(target)
    if not Path(text).exists() and not text.endswith((".yaml", ".yml")) and is_preset_name(text):
        from pod.commands.preset_scenario import preset_scenario

        return preset_scenario(text, overrides)
    return load_with_overrides(target, overrides)


def _checked(check, spec, path, overrides: tuple[Override, ...] = ()):
    """``check(spec)`` (build_plan, check_benchmark); a user error in it gets the scenario
    file in front, as ``load_scenario``'s do: ``<file>: <field>: ...`` (a ScenarioError,
    or the error itself when it already names the file), and the overrides that set
    its field at the end."""
    try:
        return check(spec)
    except USER_ERRORS as err:
        text = str(err)
        if text.startswith(f"{path}: ") and not overrides:
            raise
        text = text if text.startswith(f"{path}: ") else f"{path}: {text}"
        raise ScenarioError(blame(text, overrides)) from err


def _parse_steps(text: str, total: int) -> list[int]:
    """'last' | '3' | '1,5,10' (1-based) -> zero-based step indices; BadParameter if bad."""
    if text.strip().lower() == "last":
        return [total - 1]
    try:
        steps = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a list of step numbers such as 1,5,10 or "
                                 f"'last'", param_hint="--trace-steps") from None
    if len(steps) > MAX_TRACED_STEPS:  # each traced step keeps its events in memory
        raise click.BadParameter(f"at most {MAX_TRACED_STEPS:,} steps can be traced, got "
                                 f"{len(steps):,}", param_hint="--trace-steps")
    bad = [s for s in steps if not 1 <= s <= total]
    if bad or not steps:
        raise click.BadParameter(f"steps must be between 1 and {total}, got {text!r}",
                                 param_hint="--trace-steps")
    return [s - 1 for s in steps]


def _validate_one(path: str | Path, overrides: tuple[Override, ...] = ()) -> dict[str, Any]:
    """Check one scenario file (``pod.validate``); its JSON record (``ok``, and what was
    checked: ``pod.api.plan_facts``)."""
    plan = _checked(api.validate, _load(path, overrides), path, overrides)
    return {"path": str(path), "ok": True, **api.plan_facts(plan)}


def _ok_line(row: dict[str, Any]) -> str:
    if row["kind"] == "benchmark":
        return (f"{row['path']}: ok (benchmark {row['benchmark']}, {row['slice']}, "
                f"{row['chips']:,} chips, {row['cores']:,} TensorCores, N={row['n']:,}, "
                f"{row['iterations']:,} iterations, "
                f"{row['precision']})")
    mesh = "{" + ", ".join(f"{a}: {n}" for a, n in row["mesh"].items()) + "}"
    named = algorithms_text(row["collective_algorithms"])
    allreduce = f", {named}" if named else ""
    return (f"{row['path']}: ok ({row['slice']}, {row['chips']:,} chips, "
            f"{row['cores']:,} TensorCores, "
            f"{row['model']} on {row['dataset']}, mesh {mesh} ({row['devices']:,} devices), "
            f"global batch {row['global_batch']:,} = {row['per_device_batch']:,} per device, "
            f"{row['steps']:,} steps{allreduce})")


@cli.command(short_help="Check scenario files without running them.", epilog=OVERRIDES_HELP)
@click.argument("arguments", nargs=-1, required=True, metavar="SCENARIO... [KEY=VALUE]...")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON list: per file ok, or its error.")
def validate(arguments: tuple[str, ...], as_json: bool) -> None:
    """Check SCENARIOS without running them: everything `run` would check (pod, batch
    split, HBM fit, links, faults). Every file is checked and reported; the exit
    status is 2 if any failed. KEY=VALUE arguments apply to every file."""
    scenarios = [a for a in arguments if not looks_like_override(a)]
    items = as_overrides([a for a in arguments if looks_like_override(a)])
    if not scenarios:
        raise click.UsageError("give at least one scenario file", ctx=click.get_current_context())
    rows, failed = [], 0
    for path in scenarios:
        try:
            row = _validate_one(path, items)
        except USER_ERRORS as err:
            failed += 1
            text = str(err) if str(err).startswith(f"{path}: ") else f"{path}: {err}"
            row = {"path": str(path), "ok": False, "error": text}
            if not as_json:
                click.echo(f"error: {one_line(text)}", err=True)
        else:
            if not as_json:
                click.echo(_ok_line(row))
        rows.append(row)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
    if failed:
        sys.exit(EXIT_USER_ERROR)


@cli.command(short_help="Describe a chip, a slice or a scenario (pod, model, HBM plan).",
             epilog=OVERRIDES_HELP)
@click.argument("target")
@click.argument("overrides", nargs=-1, metavar="[KEY=VALUE]...")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
@click.option("--detail", is_flag=True,
              help="Scenario: also a row per part of every layer (each conv, norm, add of a "
                   "ResNet or transformer block) with its MXU utilisation and bound.")
@WIDE
def describe(target: str, overrides: tuple[str, ...], as_json: bool, detail: bool,
             wide: bool) -> None:
    """Describe a chip (v4), a slice (v2-8), a scenario file or a model preset
    (llama3.1-8b: on the smallest v5p slice and layout that holds it; KEY=VALUE to change
    it): its pod, the model summary, the HBM plan per device and one timing-only step
    (what bounds it)."""
    console = make_console()
    items = as_overrides(overrides)
    try:
        is_file = Path(target).is_file()
    except OSError:  # a name too long for a path is a chip or slice name that is unknown
        is_file = False
    if target.endswith((".yaml", ".yml")) or is_file or is_preset_name(target):
        _describe_scenario(console, target, as_json, detail, items, wide)
        return
    if items:
        raise click.UsageError(f"KEY=VALUE overrides belong to a scenario or a preset; {target!r} "
                               f"is a chip or a slice", ctx=click.get_current_context())
    if target.lower() in PRESETS:
        pod = resolve_pod(chip=get_chip_spec(target).name, chips=1)
    elif re.match(r"^v\d", target.strip().lower()):
        pod = resolve_pod(slice_name=target)
    else:
        from pod.config.presets import closest_preset, preset_names

        close = closest_preset(target)
        hint = f"did you mean {close}? " if close else ""
        raise ScenarioError(f"{target}: not a chip, a slice, a scenario file or a model "
                            f"preset; {hint}chips: {', '.join(PRESETS)}; slices: e.g. v5p-128; "
                            f"presets: {', '.join(preset_names())}")
    if as_json:
        click.echo(json.dumps(pod_json(pod), indent=2))
        return
    print_table(console, pod_table(pod), wide=wide)


def _describe_scenario(console: Console, target: str, as_json: bool, detail: bool = False,
                       overrides: tuple[Override, ...] = (), wide: bool = False) -> None:
    show = functools.partial(print_table, console, wide=wide)
    spec = _load(target, overrides)
    try:
        desc = _checked(functools.partial(api.describe, detail=detail), spec, target, overrides)
    except USER_ERRORS as err:
        hbm = err if isinstance(err, HBMPlanError) else err.__cause__
        if isinstance(hbm, HBMPlanError) and not as_json:  # the plan that does not fit first
            show(memory_table(f"HBM plan per device: DOES NOT FIT "
                               f"({hbm.capacity_bytes / 2**30:.2f} GiB per device)",
                               hbm.memory_plan, hbm.capacity_bytes))
        raise
    plan = desc.plan
    if not isinstance(plan, TrainingPlan):  # a benchmark: its pod and arrays
        if as_json:
            click.echo(json.dumps({"pod": pod_json(plan.topology), "memory": desc.memory},
                                  indent=2))
            return
        show(pod_table(plan.topology))
        show(memory_table(f"HBM plan per TensorCore (benchmark {plan.benchmark.kind}, "
                           f"N={plan.benchmark.n})", desc.memory,
                           plan.topology.chip.core.hbm_bytes))
        return
    step = step_record(desc.step, desc.bounds)
    if as_json:
        core = device_chip_spec(plan.topology.chip).core
        layers = layer_costs(plan.model, core, plan.per_device_batch,
                             mxu_model=plan.scenario.pod.mxu_model, detail=detail)
        click.echo(json.dumps({"pod": pod_json(plan.topology), **api.plan_facts(plan),
                               "memory": desc.memory, "step": step, "layers": layers},
                              indent=2))
        return
    show(pod_table(plan.topology))
    for table in plan_model_tables(plan, detail=detail):
        show(table)
    memory = plan.device_memory
    show(memory_table(f"HBM plan per device (pod.mesh {plan.mesh.label}; global batch "
                       f"{plan.global_batch:,} = {plan.per_device_batch} per device"
                       + (f"; at its {memory.peak}" if memory and memory.peak else "")
                       + (f"; FSDP prefetch {memory.prefetch_layers}"
                          if memory and memory.prefetch_layer_bytes else "") + ")",
                       dict(memory.rows()) if memory else desc.memory,
                       device_hbm_bytes(plan.topology.chip)))
    if step is not None:
        console.print(step_line(step), highlight=False)


@cli.command(short_help="Sample text from a char_lstm or transformer checkpoint.")
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option("--length", type=click.IntRange(min=1, max=100_000), default=300,
              show_default=True, help="Characters to generate (at most 100,000).")
@click.option("--prompt", default="", help="Text to start from (characters the model knows).")
@click.option("--temperature", type=click.FloatRange(min=0, min_open=True), default=0.8,
              show_default=True, help="Sampling temperature (lower: more conservative).")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="Seed of the sampling's random draws: the same seed, checkpoint, prompt and "
                   "temperature give the same text.")
def generate(checkpoint: Path, length: int, prompt: str, temperature: float, seed: int) -> None:
    """Sample text from a char_lstm or transformer CHECKPOINT: a checkpoint file, or a checkpoint
    directory (runs/<name>/checkpoints: its newest valid checkpoint)."""
    from chip import TensorCore
    from pod.commands.generate import checkpoint_model, sample_text
    from pod.state.export import read_checkpoint

    ckpt = read_checkpoint(checkpoint, warn=lambda text: click.echo(text, err=True))
    model, vocabulary, chip = checkpoint_model(ckpt, str(checkpoint))
    core = TensorCore(get_chip_spec(chip).core, numerics=True)
    try:
        text = sample_text(core, model, dict(ckpt.params), vocabulary, prompt=prompt,
                           length=length, temperature=temperature, seed=seed)
    except ValueError as err:
        raise click.UsageError(str(err)) from None
    click.echo(prompt + text)


@cli.command("export", short_help="Write a checkpoint's trained parameters as safetensors.")
@click.argument("checkpoint", type=click.Path(exists=True, path_type=Path))
@click.option("--format", "fmt", type=click.Choice(["safetensors"]), default="safetensors",
              show_default=True, help="Output format.")
@click.option("--output", type=click.Path(dir_okay=False, path_type=Path),
              help="File to write [default: <checkpoint dir>/ckpt-<step>.safetensors].")
@click.option("--optimizer-state", is_flag=True,
              help="Also write the optimizer's slots (as optimizer/<name>).")
def export_command(checkpoint: Path, fmt: str, output: Path | None, optimizer_state: bool) -> None:
    """Write the trained parameters (and model state) of CHECKPOINT, a checkpoint file or
    directory (its newest valid checkpoint), in FORMAT; safetensors.numpy.load_file reads
    it back with the checkpoint's names."""
    from pod.state.export import export_safetensors, read_checkpoint

    ckpt = read_checkpoint(checkpoint, warn=lambda text: click.echo(text, err=True))
    folder = checkpoint if checkpoint.is_dir() else checkpoint.parent
    output = output or folder / f"ckpt-{ckpt.step:08d}.{fmt}"
    shapes = export_safetensors(ckpt, output, optimizer_state=optimizer_state)
    count = sum(math.prod(shape) for shape in shapes.values())
    click.echo(f"Wrote {output}: {len(shapes):,} tensors, {count:,} values (step {ckpt.step:,})")


def _element_type(value: str) -> str:
    """A precision / element type by the project's name (``fp32``): another usual name
    (``f32``, ``float32``, ``bfloat16``) becomes it; the command checks the name."""
    from pod.commands.collective_bench import DTYPE_ALIASES

    return DTYPE_ALIASES.get(value.strip().lower(), value.strip())


@cli.command(short_help="Cost of one GEMM on one TensorCore: cycles, time, TFLOP/s, MXU use.")
@click.option("--chip", "chip_name", default="v2", show_default=True,
              help="Chip preset: " + " ".join(PRESETS) + ".")
@click.option("--m", type=click.IntRange(min=1), default=4096, show_default=True,
              help="Rows of A (M).")
@click.option("--k", type=click.IntRange(min=1), default=4096, show_default=True,
              help="Columns of A = rows of B (K).")
@click.option("--n", type=click.IntRange(min=1), default=4096, show_default=True,
              help="Columns of B (N).")
@click.option("--precision", "--dtype", default="bf16", show_default=True,
              callback=lambda ctx, param, value: _element_type(value),
              help="MXU precision: " + " | ".join(PRECISIONS) + " (f32: fp32).")
@click.option("--mxu-model", type=click.Choice(list(MXU_MODELS)), default=MXU_MODELS[0],
              show_default=True, help="pipelined: weights double-buffered, one pipeline bubble "
                                      "per op (the hardware); scalesim: SCALE-Sim's per-fold "
                                      "count.")
@click.option("--double-buffered", is_flag=True,
              help="Double-buffered MXU weights in --mxu-model scalesim.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def matmul(chip_name: str, m: int, k: int, n: int, precision: str, mxu_model: str,
           double_buffered: bool, as_json: bool) -> None:
    """Cost of one (M x K) . (K x N) GEMM on ONE TensorCore (simulated)."""
    report = matmul_report(chip_name, m, k, n, precision=precision,
                           double_buffered=double_buffered, mxu_model=mxu_model)
    if as_json:
        click.echo(json.dumps(report))
        return
    click.echo(f"{report['chip']} TensorCore, ({m:,} x {k:,}) . ({k:,} x {n:,}), {precision}, "
               f"{mxu_model} MXU{', double-buffered weights' if double_buffered else ''} "
               f"(simulated)")
    click.echo(f"cycles             {report['cycles']:,}  (MXU {report['mxu_cycles']:,} + "
               f"scalar issue {report['issue_cycles']:,})")
    click.echo(f"simulated seconds  {report['simulated_seconds']:.6e}  ({report['bound']}-bound)")
    if precision == "int8":
        click.echo(f"TOP/s              {report['tops']:,.2f}  (core peak int8 "
                   f"{report['peak_tops']:,.2f})")
    else:
        click.echo(f"TFLOP/s            {report['tflops']:,.2f}  (core peak bf16 "
                   f"{report['peak_tflops']:,.2f})")
    click.echo(f"MXU utilisation    {report['mxu_utilization']:.1%}")


@cli.command(short_help="Simulated collective benchmark over the ICI, like nccl-tests.")
@click.option("--slice", "slice_name", help="A slice, as scenarios name them: v4-128, v5e-256, ...")
@click.option("--chip", help="Chip preset (with --topology): v2 v3 v4 v5e v5p v6e.")
@click.option("--topology", help="Torus shape (with --chip): 8, 4x4 or 4x4x4.")
@click.option("--op", default="allreduce", show_default=True,
              type=click.Choice(["allreduce", "reduce-scatter", "all-gather", "all-to-all",
                                 "broadcast", "ppermute"]))
@click.option("--algorithm", default=None,
              help="Algorithm, or several comma-separated (a row each per size; e.g. ring,torus) "
                   "[default: the fastest at each size].")
@click.option("--dtype", "--precision", default="fp32", show_default=True,
              callback=lambda ctx, param, value: _element_type(value),
              help="Element type: bf16 | fp32 | int8, as training.precision names them (f32: "
                   "fp32); it sets the element count of each size.")
@click.option("--sizes", default="1KiB:1GiB", show_default=True,
              help="Whole-buffer bytes: one size or MIN:MAX doubling (e.g. 1KiB:1GiB).")
@click.option("--wraparound/--no-wraparound", default=None,
              help="Wraparound links on every axis [default: the chip generation's rules].")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of rows.")
@WIDE
def collective(slice_name: str | None, chip: str | None, topology: str | None, op: str,
               algorithm: str | None, dtype: str, sizes: str, wraparound: bool | None,
               as_json: bool, wide: bool) -> None:
    """Simulated collective benchmark over the ICI, read like nccl-tests; ends with its
    '# Avg bus bandwidth' line."""
    from pod.commands.collective_bench import (
        avg_bus_bandwidth,
        format_size,
        parse_sizes,
        run_collective_bench,
        summary_line,
    )

    given = [a.strip() for a in algorithm.split(",") if a.strip()] if algorithm else None
    spec, torus, rows = run_collective_bench(chip, topology, op, parse_sizes(sizes),
                                             algorithm=given, wraparound=wraparound,
                                             dtype=dtype, slice_name=slice_name)
    if as_json:
        click.echo(json.dumps([row.as_dict() for row in rows], indent=1))
        return
    wrap = "/".join("y" if w else "n" for w in torus.wraparound)
    how = "given" if given else "fastest per size"
    where = f"{slice_name} = " if slice_name else ""
    console = make_console()
    table = titled_table(f"{op} on {where}{spec.name} {torus.name} ({torus.num_chips} chips, "
                         f"wraparound {wrap}), {dtype}; algorithm "
                         f"{', '.join(dict.fromkeys(r.algorithm for r in rows))} ({how}); "
                         f"simulated time")
    for column in ("size", "count", "algorithm", "time (us)", "algbw (GB/s)", "busbw (GB/s)",
                   "busiest link"):
        table.add_column(column, justify="left" if column == "algorithm" else "right")
    for row in rows:
        table.add_row(format_size(row.requested_bytes) + (" *" if row.cut else ""),
                      f"{row.count:,}", row.algorithm,
                      f"{row.simulated_seconds * 1e6:,.2f}", f"{row.algbw_bytes_per_s / 1e9:,.2f}",
                      f"{row.busbw_bytes_per_s / 1e9:,.2f}", f"{row.busiest_link_utilization:.0%}")
    print_table(console, table, drop=("busiest link", "count", "algbw (GB/s)"), wide=wide)
    for row in dict((r.requested_bytes, r) for r in rows if r.cut).values():
        console.print(f"* {format_size(row.requested_bytes)}: {row.cut}", highlight=False,
                      soft_wrap=True)
    if rows and rows[-1].local_reduce_seconds:
        console.print(f"Before the ICI each chip adds its {spec.tensorcores} TensorCores' buffers "
                      f"at HBM bandwidth: {rows[-1].local_reduce_seconds * 1e6:,.2f} us at the "
                      f"largest size "
                      f"(local_reduce_seconds in --json; not in the time column).")
    for label, busbw in avg_bus_bandwidth(
            rows, by_algorithm=given is not None and len(given) > 1).items():
        click.echo(summary_line(busbw, label))


@cli.command("import-maxtext", short_help="Write a scenario from MaxText configs (base, model, "
                                          "key=value).")
@click.argument("arguments", nargs=-1, required=True, metavar="BASE.yml [MODEL.yml] [KEY=VALUE]...")
@click.option("--slice", "slice_name", help="Target slice, e.g. v5p-128 [default: the config's "
                                            "compile_topology].")
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the scenario here [default: print it on stdout].")
@click.option("--name", help="The scenario's name [default: <model>-<slice>].")
@click.option("--all-warnings", is_flag=True,
              help="Also name, one line each, the keys with no effect on the simulated step.")
def import_maxtext_command(arguments: tuple[str, ...], slice_name: str | None,
                           output: Path | None, name: str | None, all_warnings: bool) -> None:
    """Write a timing-only scenario from MaxText configs: BASE.yml, then MODEL.yml over it,
    then KEY=VALUE overrides (MaxText's precedence). Every key that is not mapped is named,
    one line each: an error if it changes the step and is not modelled, a warning if the
    step is approximated or the model file / command line sets it."""
    import shlex

    from pod.commands.import_maxtext import import_maxtext, scenario_yaml

    files = [a for a in arguments if "=" not in a or Path(a).exists()]
    keys = [a for a in arguments if a not in files]
    result = import_maxtext(files, keys, slice_name=slice_name, name=name)
    for note in result.notes:
        if note.level != "ignored" or all_warnings:
            click.echo(f"{'warning' if note.level != 'error' else 'error'}: {note.text}", err=True)
    errors = result.of("error")
    if errors:
        raise ScenarioError(f"{len(errors)} MaxText key{'s' if len(errors) > 1 else ''} above "
                            f"change the step and are not modelled; no scenario written")
    ignored = len(result.of("ignored"))
    if ignored and not all_warnings:
        click.echo(f"note: {ignored} keys of {files[0]} do not change the simulated step and are "
                   f"not mapped; the scenario's last lines name each (--all-warnings prints them)",
                   err=True)
    command = shlex.join(["tpu-pod", "import-maxtext", *arguments,
                          *(["--slice", slice_name] if slice_name else [])])
    text = scenario_yaml(result, command)
    plan = _check_imported(text, output)  # before a byte is written: a refusal writes nothing
    if output is None:
        click.echo(text, nl=False)
        return
    from pod.safe_io import write_atomic

    write_atomic(output, lambda f: f.write(text))
    click.echo(f"Wrote {output}: ok ({plan.topology.name}, "
               f"mesh {format_axes(plan.mesh.sizes)}, "
               f"{plan.num_params:,} parameters, global batch {plan.global_batch:,}); cost "
               f"a step with: tpu-pod sweep {output}", err=True)


def _check_imported(text: str, output: Path | None) -> Any:
    """Plan the scenario to write as ``validate`` does: one line if it does not plan;
    the plan."""
    from pod.config.scenario import scenario_from_text

    where = str(output) if output is not None else "<stdout>"
    spec = scenario_from_text(text, source=where)
    return _checked(functools.partial(build_plan, timing_only=True, sharded_ok=True), spec, where)


@cli.command(short_help="Run a scaling experiment (a scenario's sweep: block).",
             epilog=OVERRIDES_HELP)
@click.argument("scenario", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("overrides", nargs=-1, metavar="[KEY=VALUE]...")
@click.option("--output-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Where results.csv, results.md and the plots go [default: runs/<name>-sweep].")
@click.option("--mode", type=click.Choice(["timing", "functional"]),
              help="timing: cost one representative chip (any pod size); functional: train "
                   "on chip actors [default: the sweep block's].")
@click.option("--json", "as_json", is_flag=True,
              help="Print the rows as one JSON list on stdout (progress goes to stderr).")
@click.option("--fresh", is_flag=True,
              help="Run every point again, ignoring the points an earlier, stopped run of the "
                   "same sweep finished in this output directory.")
def sweep(scenario: Path, overrides: tuple[str, ...], output_dir: Path | None, mode: str | None,
          as_json: bool, fresh: bool) -> None:
    """Run the scaling experiment in SCENARIO's sweep: block.

    Each finished point is kept on disk as it finishes (sweep-journal.jsonl and
    results.csv in the output directory): a sweep stopped by Ctrl-C or SIGTERM
    and run again into the same directory, with the same scenario and mode, runs
    only the points it had not finished (--fresh runs them all)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    from pod.commands.sweep import json_row, point_line, sweep_kind, sweep_points

    spec = _load(scenario, as_overrides(overrides))
    if spec.sweep is None:
        raise ScenarioError(f"{scenario}: sweep: no sweep: block in this scenario")
    out_dir = output_dir or Path("runs") / f"{spec.name}-sweep"
    console = make_console(sys.stderr) if as_json else make_console()
    total = len(sweep_points(spec))
    kind = sweep_kind(spec)
    console.print(f"[bold]{spec.name}[/]: " + (kind if total == 1 and kind == "one point" else
                                               f"{total:,} points, {kind}")
                  + f", {mode or spec.sweep.mode} mode")
    with Progress("[bold]sweep", BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task("sweep", total=total)

        def report(row: dict) -> None:
            progress.advance(task)
            progress.console.print(point_line(row, total), highlight=False, soft_wrap=True)

        def resumed(done: int, journal: Path) -> None:
            progress.console.print(f"Resuming: {done} of {total} points already done "
                                   f"({journal}, same scenario and mode); --fresh runs them "
                                   "again", highlight=False, soft_wrap=True)

        rows = api.sweep(spec, output_dir=out_dir, mode=mode, on_point=report, fresh=fresh,
                         on_resume=resumed, quiet=True, warn=lambda line: progress.console.print(
                             line, style="yellow", highlight=False, soft_wrap=True))
    failed = sum(r["status"] != "ok" for r in rows)
    plots = ", ".join(sorted(p.name for p in out_dir.glob("*.png")))
    ok = len(rows) - failed
    console.print(f"{ok:,} point{'' if ok == 1 else 's'} ok, {failed:,} failed. "
                  f"Wrote {out_dir}/results.csv, "
                  f"results.md{', ' + plots if plots else ''}", soft_wrap=True)
    if as_json:
        click.echo(json.dumps([json_row(r) for r in rows], indent=2, default=str))
    if rows and failed == len(rows):
        raise ScenarioError(f"{scenario}: sweep: every point failed; the first: {rows[0]['error']}")


PLAN_OVERRIDES_HELP = (
    "KEY=VALUE arguments after MODEL override the model's keys (dotted keys, YAML values): "
    "scenario keys for a preset or a scenario file (model.options.layers=16 "
    "training.precision=fp32), MaxText's keys for MaxText configs (base_emb_dim=1024 "
    "vocab_size=32000). MaxText's layout keys work with any MODEL: ici_fsdp_parallelism=64 "
    "fixes that mesh axis (-1: searched), per_device_batch_size=2, remat_policy=full, "
    "num_slices=2 (or dcn_data_parallelism=2), compile_topology=v5e-256; and with a preset "
    "or a scenario capacity_factor=1.25 and max_target_length=4096.")


@cli.command("plan", short_help="Which layout? Search meshes, remat and batches of a model.",
             epilog=PLAN_OVERRIDES_HELP)
@click.argument("arguments", nargs=-1, required=True,
                metavar="MODEL [MODEL.yml] [KEY=VALUE]...")
@click.option("--slice", "slices", multiple=True,
              help="A slice to plan for (v5e-256); repeat it to compare slices. With --chips: a "
                   "generation (v5e).")
@click.option("--chips", type=click.IntRange(min=1),
              help="Every generation's slice of this many chips (those of --slice GEN).")
@click.option("--tokens-per-step", help="Tokens per step over the pod: 4194304, 4Mi, 4M.")
@click.option("--global-batch", help="Sequences (examples) per step, instead of the tokens.")
@click.option("--per-device-batch", help="Without either: per-device batches to try on every "
                                         "mesh [default: 1,2,4,8].")
@click.option("--seq-len",
              type=click.IntRange(min=1, max=MAX_TRANSFORMER_OPTION["sequence_length"]),
              help="Tokens per sequence [default: the model's; a preset's context, at most 8192].")
@click.option("--num-slices", "num_slices", multiple=True,
              help="Numbers of identical slices joined by the DCN to try, data parallel across "
                   "them, e.g. 1,2,4 [default: 1].")
@click.option("--remat", help="Remat policies to try (MaxText's names), e.g. "
                              "full,minimal_offloaded; all: every one [default: "
                              f"{', '.join(DEFAULT_REMATS)}].")
@click.option("--mesh-axes", help="Mesh axes to search, e.g. fsdp,tensor [default: every axis "
                                  "the runtime runs].")
@click.option("--token-budget", help="Rank by the simulated time to train on this many tokens "
                                     "(1T, 2e12) instead of tokens/s.")
@click.option("--capacity-factor", "capacity_factor",
              help="A mixture of experts' capacity factors to try (MaxText's capacity_factor; "
                   "0: dropless), e.g. 0,1.25 [default: the model's, and 1.25 too for a "
                   "dropless one, which an expert axis needs].")
@click.option("--top", type=click.IntRange(min=1), default=10, show_default=True,
              help="Points in the table.")
@click.option("--exhaustive", is_flag=True,
              help="Cost every point that plans (else a point whose compute alone is slower "
                   "than the 30 best, or the table's, is not costed: results.csv says so).")
@click.option("--jobs", type=click.IntRange(min=1),
              help="Processes that cost points [default: one per core].")
@click.option("--output-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Where results.csv, layouts.png and best.yaml go "
                   "[default: runs/plan-<model>-<slice>].")
@click.option("--json", "as_json", is_flag=True,
              help="Print the plan as one JSON document (every point) on stdout.")
@WIDE
def plan_command(arguments: tuple[str, ...], slices: tuple[str, ...], chips: int | None,
                 tokens_per_step: str | None, global_batch: str | None,
                 per_device_batch: str | None, seq_len: int | None,
                 num_slices: tuple[str, ...], remat: str | None,
                 mesh_axes: str | None, token_budget: str | None, capacity_factor: str | None,
                 top: int, exhaustive: bool, jobs: int | None, output_dir: Path | None,
                 as_json: bool, wide: bool) -> None:
    """Which layout trains MODEL fastest? MODEL is a preset (llama2-7b, maxtext-2023-s1, ...),
    a scenario file, or MaxText's base.yml [model.yml]. Every mesh of each slice's devices,
    remat policy and batch is planned; what does not fit is dropped with the reason; the rest
    is costed by one timing-only step each (simulated) and ranked by tokens/s."""
    from pod.commands.plan_report import (
        family_lines,
        family_title,
        plan_json,
        plan_progress,
        plan_table,
        search_line,
    )

    models = [a for a in arguments if not looks_like_override(a)]
    if not models:
        raise click.UsageError("give the MODEL: a preset, a scenario or MaxText's base.yml",
                               ctx=click.get_current_context())
    split = lambda text: tuple(p.strip() for p in text.split(",") if p.strip()) if text else ()  # noqa: E731
    console = make_console(sys.stderr) if as_json else make_console()
    with plan_progress(console) as on_point:
        result = api.plan(models[0], files=models[1:], slice=slices, chips=chips,
                          tokens_per_step=tokens_per_step, global_batch=global_batch,
                          per_device_batch=split(per_device_batch), seq_len=seq_len,
                          remat=split(remat), mesh_axes=split(mesh_axes),
                          token_budget=token_budget,
                          overrides=[a for a in arguments if looks_like_override(a)],
                          num_slices=[n for text in num_slices for n in split(text)],
                          capacity_factor=split(capacity_factor), top=top,
                          exhaustive=exhaustive, jobs=jobs, output_dir=output_dir,
                          default_output=True, progress=False, on_point=on_point).result
    if as_json:
        click.echo(json.dumps(plan_json(result), indent=2))
        return
    console.print(search_line(result), highlight=False, soft_wrap=True)
    if result.ranked:
        print_table(console, plan_table(result, top), drop=PLAN_DROP, wrap=("mesh", "bound"),
                    wide=wide)
    families = family_lines(result)
    if families:
        console.print(family_title(result), highlight=False)
        for line in families:
            console.print(line, highlight=False, soft_wrap=True)
    out_dir = result.output_dir
    files = ", ".join(n for n in ("results.csv", "layouts.png", "best.yaml")
                      if out_dir is not None and (out_dir / n).exists())
    wrote = f" Wrote {out_dir}/: {files}" if files else ""
    console.print(f"{result.summary()}.{wrote}", highlight=False, soft_wrap=True)
    if not result.ranked:
        raise ScenarioError(f"plan: no layout of {result.name} runs; the first point's reason: "
                            f"{result.rows[0]['reason']}")


#: The plan table's columns a narrow terminal leaves out, the first first: the rank, the
#: layout, the step, MFU and the rate (or the time to the budget) stay.
PLAN_DROP = ("compute", "update", "bound", "dcn", "stage", "expert", "tensor", "fsdp", "data",
             "bubble", "experts", "HBM/dev", "slices", "batch", "slice")


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``tpu-pod`` console script."""
    nul = next((a for a in (sys.argv[1:] if argv is None else argv) if "\x00" in a), None)
    if nul is not None:  # click's path checks would raise ValueError: embedded null byte
        click.echo(f"error: the argument {nul[:60]!r} holds a NUL byte; no file name or value "
                   "can (see 'tpu-pod --help')", err=True)
        sys.exit(EXIT_USER_ERROR)
    try:
        code = cli.main(args=argv, prog_name="tpu-pod", standalone_mode=False)
    except click.UsageError as err:  # a bad option or argument: one line, like every user error
        where = err.ctx.command_path if err.ctx is not None else "tpu-pod"
        message = one_line(err.format_message())  # a huge value quoted is cut to fit
        click.echo(f"error: {message} (see '{where} --help')", err=True)
        sys.exit(err.exit_code)
    except click.ClickException as err:
        err.show()
        sys.exit(err.exit_code)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except USER_ERRORS as err:
        click.echo(f"error: {one_line(err)}", err=True)
        sys.exit(EXIT_USER_ERROR)
    except OSError as err:
        if err.errno not in _FILE_SYSTEM_REFUSALS:
            raise
        # a refusal no command turned into its one line yet: still one line, never a traceback
        where = err.filename if err.filename else "a file"
        reason = err.strerror or str(err)
        text = (OutputError(where, reason) if err.errno not in (errno.EACCES, errno.EPERM)
                else f"{where}: {reason}")  # a permission: reading or writing
        click.echo(f"error: {one_line(text)}", err=True)
        sys.exit(EXIT_USER_ERROR)
    except RunInterrupted as err:  # the run wrote its checkpoint and partial summary first
        click.echo(str(err), err=True)
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


_HLO_COMMON = [
    click.option("--slice", "slice_name", required=True,
                 help="The slice, e.g. v5p-128, v5e-256 (Google's names; tpu-pod describe "
                      "lists them)."),
    click.option("--num-slices", type=click.IntRange(min=1), default=1, show_default=True,
                 help="Identical slices joined by the data-centre network (multislice)."),
    click.option("--output-dir", type=click.Path(file_okay=False, path_type=Path),
                 help="Where summary.json, layers.csv, collectives.csv and trace.json.gz go "
                      "[default: runs/<name>-<slice>]."),
    click.option("--idle-start", is_flag=True,
                 help="Cost each MXU op from an idle start, as a benchmarked single op (the "
                      "calibration rows C1-C4), not a training step's steady state."),
    click.option("--json", "as_json", is_flag=True,
                 help="Print summary.json on stdout (the tables go to stderr)."),
]


def _hlo_options(function):
    for option in reversed(_HLO_COMMON):
        function = option(function)
    return function


def _show_estimate(estimate, output_dir: Path, as_json: bool) -> None:
    """Print an HLO step's tables (stderr with --json) and write its files."""
    from pod.hlo.report import ops_table

    console = make_console(sys.stderr) if as_json else make_console()
    console.print(estimate.table())
    console.print(ops_table(estimate.step))
    for note in estimate.step.notes:
        console.print(f"note: {note}", highlight=False, soft_wrap=True)
    if not estimate.memory.fits:
        console.print(f"[bold red]{estimate.memory.verdict()}[/]", highlight=False)
    paths = estimate.write(output_dir)
    console.print(f"Wrote {', '.join(str(p) for p in paths)} (open the trace in "
                  "https://ui.perfetto.dev)", highlight=False, soft_wrap=True)
    if as_json:
        click.echo(json.dumps(estimate.summary, indent=2))


@cli.command("run-jax", short_help="Cost your own JAX step on a slice: the HLO XLA compiles "
                                   "for it, op by op.")
@click.argument("target", metavar="FILE.py:FUNCTION")
@_hlo_options
@click.option("--mesh", "mesh_text", metavar="AXIS=SIZE,...",
              help="The device mesh, e.g. fsdp=16,tensor=4 [default: the file's MESH dict, "
                   "else data=<devices>].")
@click.option("--args", "args_name", metavar="NAME",
              help="The args factory in FILE: NAME(mesh) returns the step's arguments "
                   "(jax.ShapeDtypeStructs or arrays, sharded over the mesh) "
                   "[default: FUNCTION_args].")
@click.option("--path", type=click.Choice(["auto", "tpu", "cpu"]), default="auto",
              show_default=True,
              help="tpu: compile for the slice with libtpu (no TPU needed; the faithful "
                   "answer); cpu: compile over fake CPU devices (approximate); auto: tpu when "
                   "libtpu is installed.")
@click.option("--no-cache", is_flag=True,
              help="Compile again even if ~/.cache/tpu-pod/hlo holds this step.")
@click.option("--libtpu-args", default="", metavar="FLAGS",
              help="XLA's TPU flags for the compile, as LIBTPU_INIT_ARGS on a TPU VM (e.g. "
                   "MaxText's --xla_tpu_enable_async_collective_fusion=true ...); the tpu path "
                   "only [default: $LIBTPU_INIT_ARGS].")
def run_jax_command(target: str, slice_name: str, num_slices: int, output_dir: Path | None,
                    idle_start: bool, as_json: bool, mesh_text: str | None,
                    args_name: str | None, path: str, no_cache: bool, libtpu_args: str) -> None:
    """Compile FUNCTION of FILE.py for the slice and cost its HLO on the emulated pod:
    every op on the chip model, every collective on its device groups over the ICI,
    async collectives overlapped as XLA scheduled them. Figures are SIMULATED."""
    import pod.jax
    from pod.commands.hlo import default_output_dir, load_step, parse_mesh

    topology = pod.jax.topology_of(slice_name, num_slices)
    step, factory, file_mesh, name = load_step(target, args_name)
    devices = topology.chips * devices_per_chip(topology.chip)
    mesh = parse_mesh(mesh_text) if mesh_text else (file_mesh or {"data": devices})
    console = make_console(sys.stderr)
    with console.status(f"{name}: starting", spinner="dots") as status:
        estimate = pod.jax.estimate(step, factory, mesh=mesh, slice=slice_name,
                                    num_slices=num_slices, path=path, sustained=not idle_start,
                                    cache=not no_cache, libtpu_args=libtpu_args or (
                                        os.environ.get("LIBTPU_INIT_ARGS", "")
                                        if path != "cpu" else ""),
                                    progress=lambda text: status.update(f"{name}: {text}"))
    _show_estimate(estimate, output_dir or default_output_dir(name, topology.name.replace(
        " ", "")), as_json)


@cli.command("cost-hlo", short_help="Cost an XLA HLO module (a dump) on a slice, op by op.")
@click.argument("module", metavar="MODULE.txt", type=click.Path(dir_okay=False, exists=True,
                                                                 path_type=Path))
@_hlo_options
@click.option("--mesh", "mesh_text", metavar="AXIS=SIZE,...",
              help="The mesh the module was sharded over, to name the collectives' lanes "
                   "(optional).")
@click.option("--compiled-for", type=click.Choice(["auto", "tpu", "cpu"]), default="auto",
              show_default=True,
              help="tpu: cost the schedule as XLA made it; cpu: approximate (the project's "
                   "fusion and overlap rules); auto: tpu when the module carries TPU layouts "
                   "or cost estimates.")
def cost_hlo_command(module: Path, slice_name: str, num_slices: int, output_dir: Path | None,
                     idle_start: bool, as_json: bool, mesh_text: str | None,
                     compiled_for: str) -> None:
    """Cost MODULE.txt (an --xla_dump_to file, MaxText's dump_hlo, a PyTorch/XLA dump, or
    compiled.as_text(); .gz too) on the slice. Its device ids are taken in the TPU's
    device order. Figures are SIMULATED."""
    import pod.jax
    from pod.commands.hlo import default_output_dir, parse_mesh

    estimate = pod.jax.cost_hlo(module, slice=slice_name, num_slices=num_slices,
                                mesh=parse_mesh(mesh_text) if mesh_text else None,
                                compiled_for=compiled_for, sustained=not idle_start)
    stem = module.name.removesuffix(".gz").removesuffix(".txt")
    _show_estimate(estimate, output_dir or default_output_dir(
        stem, pod.jax.topology_of(slice_name, num_slices).name.replace(" ", "")), as_json)


@cli.command("init", short_help="Copy the shipped scenarios and monitoring files into a folder.")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--force", is_flag=True,
              help="Replace files there that differ from the shipped ones.")
def init_command(directory: Path, force: bool) -> None:
    """Copy the shipped scenarios and monitoring files into DIRECTORY."""
    from pod.commands.init import init_directory, next_steps

    try:
        result = init_directory(directory, overwrite=force)
    except (FileExistsError, NotADirectoryError) as err:
        raise click.UsageError(str(err)) from None
    scenarios = sum(p.parent == directory for p in result.written + result.unchanged)
    click.echo(f"{directory}: {scenarios} scenarios and "
               f"{len(result.written) + len(result.unchanged) - scenarios} monitoring files "
               f"({len(result.written)} written, {len(result.unchanged)} already up to date)")
    for line in next_steps(directory):
        click.echo(line)


@cli.command("monitor", short_help="Run a local Prometheus scraping a run, until Ctrl-C.")
@click.option("--config", "config_path",
              type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="Prometheus configuration [default: the shipped monitoring/prometheus.yml].")
@click.option("--port", type=click.IntRange(1, 65535), default=9090, show_default=True,
              help="Prometheus web port on 127.0.0.1.")
@click.option("--target", "targets", multiple=True, metavar="HOST:PORT",
              help="Metrics endpoint to scrape, repeatable [default: the configuration's, "
                   "127.0.0.1:9188].")
@click.option("--scrape-interval", type=click.FloatRange(min=0.001), metavar="SECONDS",
              help="Scrape and rule-evaluation interval [default: the configuration's, 5 s].")
def monitor_command(config_path: Path | None, port: int, targets: tuple[str, ...],
                    scrape_interval: float | None) -> None:
    """Run a local Prometheus (the 'prometheus' binary) scraping a run, until Ctrl-C."""
    from pod.commands.monitor import MonitorOptions, default_config, monitor, targets_of

    try:
        options = MonitorOptions(config=config_path or default_config(), port=port,
                                 targets=targets_of(targets), scrape_interval_s=scrape_interval)
    except ValueError as err:
        raise click.UsageError(str(err)) from None
    monitor(options, echo=click.echo)

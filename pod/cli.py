"""``tpu-pod``: the command line (``python -m pod`` does the same).

Commands: ``run`` a scenario, ``validate`` scenarios, ``describe`` a chip, a
slice or a scenario. A user mistake ends in one line on stderr naming the
field, the value and what is allowed, and exit status 2; never a traceback.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from chip import PRESETS, get_chip_spec
from pod.errors import USER_ERRORS
from pod.plan import build_plan
from pod.scenario import load_scenario
from pod.slices import resolve_pod

__all__ = ["cli", "main"]

EXIT_USER_ERROR = 2


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="tpu-pod-emulator")
def cli() -> None:
    """Emulate a TPU pod: chips that really compute, a simulated ICI, and
    data-parallel training with Prometheus metrics.

    Figures are either SIMULATED (what the TPU pod would take, from the cost
    models) or WALL (what the emulation took on this machine).
    """


@cli.command()
@click.argument("scenario", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--steps", type=click.IntRange(min=1), help="Override training.steps.")
@click.option("--output-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Where summary.json and steps.csv go [default: runs/<scenario name>].")
@click.option("--metrics-port", type=click.IntRange(0, 65535),
              help="Prometheus port on 127.0.0.1 (0 disables) [default: the scenario's].")
@click.option("--log-every", type=click.IntRange(min=0), default=1, show_default=True,
              help="Print a progress line every N steps (0: none).")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Write a Chrome trace (Perfetto, chrome://tracing) of the simulated timeline.")
@click.option("--trace-steps", default="last", show_default=True,
              help="Steps to trace, 1-based: e.g. 2 or 1,5,10 or last.")
@click.option("--hold", is_flag=True, help="Keep the metrics endpoint up after the run, until Ctrl-C.")
@click.option("--hold-seconds", type=click.FloatRange(min=0), default=0.0,
              help="Keep the metrics endpoint up this many seconds after the run.")
def run(scenario: Path, steps: int | None, output_dir: Path | None, metrics_port: int | None,
        log_every: int, trace_path: Path | None, trace_steps: str, hold: bool,
        hold_seconds: float) -> None:
    """Train SCENARIO (a YAML file) on an emulated pod."""
    from pod.run import run_training  # Ray is imported only when a run starts

    spec = load_scenario(scenario)
    if steps is not None:
        spec = spec.with_overrides(training__steps=steps)
    plan = build_plan(spec)
    run_training(plan, output_dir=output_dir or Path("runs") / spec.name,
                 metrics_port=metrics_port, log_every=log_every, trace_path=trace_path,
                 trace_steps=_parse_steps(trace_steps, plan.steps),
                 hold_seconds=math.inf if hold else hold_seconds)


def _parse_steps(text: str, total: int) -> list[int]:
    """'last' | '3' | '1,5,10' (1-based) -> zero-based step indices; BadParameter if bad."""
    if text.strip().lower() == "last":
        return [total - 1]
    try:
        steps = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a list of step numbers such as 1,5,10 or "
                                 f"'last'", param_hint="--trace-steps") from None
    bad = [s for s in steps if not 1 <= s <= total]
    if bad or not steps:
        raise click.BadParameter(f"steps must be between 1 and {total}, got {text!r}",
                                 param_hint="--trace-steps")
    return [s - 1 for s in steps]


@cli.command()
@click.argument("scenarios", nargs=-1, required=True,
                type=click.Path(dir_okay=False, path_type=Path))
def validate(scenarios: tuple[Path, ...]) -> None:
    """Check SCENARIOS without running them (pod, batch split, HBM fit)."""
    for path in scenarios:
        plan = build_plan(load_scenario(path))
        click.echo(f"{path}: ok ({plan.pod.name}, {plan.pod.chips} chips, {plan.pod.tensorcores} "
                   f"TensorCores, {plan.model.name} on {plan.dataset.name}, global batch "
                   f"{plan.global_batch} = {plan.per_core_batch} per core, {plan.steps} steps)")


@cli.command()
@click.argument("target")
def describe(target: str) -> None:
    """Describe a chip (v4), a slice (v2-8) or a scenario file (its memory plan)."""
    console = Console()
    if target.endswith((".yaml", ".yml")) or Path(target).is_file():
        plan = build_plan(load_scenario(target))
        _describe_pod(console, plan.pod)
        table = Table(title=f"HBM plan per TensorCore (global batch {plan.global_batch} = "
                            f"{plan.per_core_batch} per core)")
        table.add_column("item")
        table.add_column("bytes", justify="right")
        table.add_column("MiB", justify="right")
        for item, nbytes in plan.memory.items():
            table.add_row(item, f"{nbytes:,}", f"{nbytes / 2**20:.3f}")
        cap = plan.pod.chip.core.hbm_bytes
        table.add_row("capacity", f"{cap:,}", f"{cap / 2**20:.0f}")
        console.print(table)
        return
    if target.lower() in PRESETS:
        spec = get_chip_spec(target)
        _describe_pod(console, resolve_pod(chip=spec.name, chips=1))
        return
    _describe_pod(console, resolve_pod(slice_name=target))


def _describe_pod(console: Console, pod) -> None:
    chip = pod.chip
    core = chip.core
    published = ""
    if chip.published_peak_bf16_flops_per_s:
        published = (f" (Google: {pod.chips * chip.published_peak_bf16_flops_per_s / 1e12:,.0f}"
                     f" TFLOP/s)")
    table = Table(title=f"{pod.name}: {pod.chips} chips, {pod.tensorcores} TensorCores, "
                        f"{pod.peak_bf16_flops_per_s / 1e12:,.0f} TFLOP/s bf16{published}, "
                        f"{pod.hbm_bytes / 2**30:,.0f} GiB HBM")
    table.add_column("figure")
    table.add_column("per chip", justify="right")
    table.add_column("pod", justify="right")
    table.add_row("TensorCores", f"{chip.tensorcores}", f"{pod.tensorcores}")
    table.add_row("MXUs per core", f"{core.mxus_per_core} x {core.mxu.rows}x{core.mxu.cols}", "")
    table.add_row("clock", f"{core.clock_hz / 1e6:,.0f} MHz", "")
    table.add_row("peak bf16", f"{chip.peak_bf16_flops_per_s / 1e12:,.1f} TFLOP/s",
                  f"{pod.peak_bf16_flops_per_s / 1e12:,.1f} TFLOP/s")
    table.add_row("HBM", f"{chip.hbm_bytes / 2**30:,.1f} GiB", f"{pod.hbm_bytes / 2**30:,.1f} GiB")
    table.add_row("HBM bandwidth", f"{chip.hbm_bandwidth_bytes_per_s / 1e9:,.0f} GB/s", "")
    table.add_row("ICI", f"{chip.ici_links} links x {chip.ici_link_bandwidth_bytes_per_s / 1e9:,.0f}"
                         f" GB/s one way", f"{pod.torus.name} "
                         f"(wraparound {'/'.join('y' if w else 'n' for w in pod.torus.wraparound)})")
    console.print(table)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``tpu-pod`` console script."""
    try:
        code = cli.main(args=argv, prog_name="tpu-pod", standalone_mode=False)
    except click.ClickException as err:
        err.show()
        sys.exit(err.exit_code)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except USER_ERRORS as err:
        click.echo(f"error: {err}", err=True)
        sys.exit(EXIT_USER_ERROR)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)

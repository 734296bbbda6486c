"""The console every command prints through (rich), and what a run prints:
the progress line, the Keras-style epoch line, the progress bar, the summary
table."""

from __future__ import annotations

import math
import time
from typing import IO, Any

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)
from rich.table import Table

from pod.report.stats import StepStats, StepTotals

__all__ = ["make_console", "PIPE_WIDTH", "titled_table", "progress_line", "epoch_line",
           "progress_bar", "summary_table", "hold"]

#: Columns when output is not a terminal (a file, a pipe, CI): rich would use 80
#: and cut table cells such as layer and algorithm names.
PIPE_WIDTH = 160


def make_console(file: IO[str] | None = None) -> Console:
    """A rich console: the terminal's width, or ``PIPE_WIDTH`` columns when piped."""
    console = Console(file=file)
    if not console.is_terminal:
        console = Console(file=file, width=PIPE_WIDTH)
    return console


def titled_table(title: str, **options: Any) -> Table:
    """A rich Table at least as wide as its title, so the title never wraps mid-phrase."""
    return Table(title=title, min_width=len(title), **options)


def progress_line(stats: StepStats, total: int) -> str:
    width = len(str(total))
    return (f"step {stats.step + 1:>{width}}/{total}  loss {stats.loss:.4f}  "
            f"sim {stats.step_seconds * 1e3:.4f} ms/step  "
            f"sim {stats.examples_per_second:,.0f} examples/s  "
            f"wall {stats.wall_seconds * 1e3:.1f} ms/step")


def summary_table(summary: dict[str, Any]) -> Table:
    table = titled_table(f"{summary['scenario']}: {summary['slice'] or summary['generation']} "
                         f"({summary['chips']:,} chips, {summary['cores']:,} TensorCores, "
                         f"{summary['topology']})", show_header=True)
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("clock")
    rows = [
        ("steps x global batch", f"{summary['steps']} x {summary['global_batch']}", ""),
        ("loss first -> last", f"{summary['initial_loss']:.4f} -> {summary['final_loss']:.4f}", ""),
        ("allreduce algorithm", f"{summary['allreduce_algorithm']}", ""),
        ("test accuracy", f"{summary['test_accuracy']:.1%}", ""),
        ("step time (critical path)", f"{summary['simulated_step_seconds'] * 1e3:.4f} ms",
         "simulated"),
        ("  without overlap (sum)", f"{summary['serial_step_seconds'] * 1e3:.4f} ms", "simulated"),
        ("  infeed, exposed", f"{summary['exposed_infeed_seconds'] * 1e3:.4f} ms of "
                              f"{summary['infeed_seconds'] * 1e3:.4f}", "simulated"),
        ("  compute (fwd+bwd)", f"{summary['compute_seconds'] * 1e3:.4f} ms", "simulated"),
        ("  allreduce, exposed", f"{summary['exposed_allreduce_seconds'] * 1e3:.4f} ms of "
                                 f"{summary['allreduce_seconds'] * 1e3:.4f} "
                                 f"({summary['overlap_fraction']:.0%} hidden)", "simulated"),
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


def epoch_line(totals: StepTotals, evaluation: Any, epoch: int, epochs: int,
                wall_seconds: float) -> str:
    """A Keras-style epoch line: loss, test loss / accuracy, simulated ms/step, wall
    (starts the next epoch's sums in ``totals``)."""
    steps = totals.epoch_steps
    sim_ms = totals.end_epoch() * 1e3
    return (f"Epoch {epoch}/{epochs} - {steps} steps - loss: {totals.final_loss:.4f} - "
            f"test_loss: {evaluation.loss:.4f} - test_accuracy: {evaluation.accuracy:.4f} - "
            f"{sim_ms:.4f} ms/step (simulated) - {wall_seconds:.1f} s (wall)")


def progress_bar(console: Console, total: int) -> Progress:
    """A progress bar with ETA (wall clock); lines printed through it stay above it."""
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("steps, elapsed"), TimeElapsedColumn(), TextColumn("ETA"),
                    TimeRemainingColumn(), console=console, transient=True,
                    disable=not console.is_terminal)


def hold(console: Console, port: int, seconds: float) -> None:
    """Keep serving metrics after the run for ``seconds`` (inf: until Ctrl-C)."""
    label = "until Ctrl-C" if math.isinf(seconds) else f"for {seconds:g} s"
    console.print(f"Holding the metrics endpoint on port {port} {label}")
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
    except KeyboardInterrupt:
        pass

"""The console every command prints through (rich), and what a run prints:
the progress line, the Keras-style epoch line, the progress bar, the summary
table."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any

from rich.console import Console
from rich.measure import Measurement
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from pod.report.stats import StepStats, StepTotals

__all__ = ["make_console", "PIPE_WIDTH", "titled_table", "progress_line", "epoch_line",
           "algorithms_text", "print_table", "natural_width",
           "accuracy_text", "evaluation_text",
           "progress_bar", "summary_table", "hold", "StatusLine", "PROGRESS_MODES"]

#: How a run reports its steps: "steps", a line per step (``log_every``); "line", one
#: line that each step replaces (a notebook's default: ``StatusLine``).
PROGRESS_MODES = ("steps", "line")

#: Columns when output is not a terminal (a file, a pipe, CI): rich would use 80
#: and cut table cells such as layer and algorithm names.
PIPE_WIDTH = 160


def make_console(file: IO[str] | None = None) -> Console:
    """A rich console: the terminal's width, or ``PIPE_WIDTH`` columns when piped."""
    console = Console(file=file)
    if not console.is_terminal:
        console = Console(file=file, width=PIPE_WIDTH)
    return console


def natural_width(console: Console, renderable: Any) -> int:
    """Columns a table (any renderable) takes with no cell wrapped or cut."""
    return Measurement.get(console, console.options.update(width=10**6), renderable).maximum


def print_table(console: Console, table: Any, *, drop: Sequence[str] = (),
                wrap: Sequence[str] = (), wide: bool = False) -> list[str]:
    """Print a table so that every cell reads whole.

    Piped output (not a terminal) and ``wide`` (``--wide``) print every column at its
    natural width, wider than the console if need be. On a terminal too narrow for
    it, the columns named in ``drop`` (by header) go, in that order, until the rest
    fits; the columns named in ``wrap`` may then wrap their words (a mesh over
    lines) rather than be cut; a dim line says what was left out and that ``--wide``
    shows it. A table of two forms (``model_summary.FitWidth``) picks its own.

    Args:
        console: where it goes.
        table: a rich ``Table`` (its columns are removed in place) or a renderable.
        drop: headers of the columns that may go, the first first.
        wrap: headers of the columns whose words may wrap.
        wide: print it whole whatever the width.

    Returns:
        The headers of the columns left out.
    """
    natural = natural_width(console, table)
    if wide or not console.is_terminal:
        width = console.width  # rich renders no wider than the console: widen it for this
        console.width = max(width, natural)
        try:
            console.print(table, crop=False)
        finally:
            console.width = width
        return []
    left_out: list[str] = []
    columns = getattr(table, "columns", [])
    for header in drop:
        if natural <= console.width:
            break
        index = next((i for i, c in enumerate(columns) if str(c.header) == header), None)
        if index is not None:
            del columns[index]
            left_out.append(header)
            natural = natural_width(console, table)
    for column in columns:
        if str(column.header) in wrap:
            column.no_wrap = False
            column.overflow = "fold"
    console.print(table)
    if left_out:
        console.print(f"({', '.join(left_out)} left out to fit {console.width} columns; "
                      "--wide shows every column)", style="dim", highlight=False)
    return left_out


def titled_table(title: str, **options: Any) -> Table:
    """A rich Table at least as wide as its title, so the title never wraps mid-phrase."""
    return Table(title=title, min_width=len(title), **options)


def algorithms_text(algorithms: Mapping[str, str]) -> str:
    """The collective algorithm of each mesh axis as a line says it
    (``MeshCollectiveCosts.algorithms``): ``allreduce torus`` on a mesh of a data axis
    only, else ``fsdp torus, data torus``; "" on a mesh with no collective."""
    if list(algorithms) == ["data"]:
        return f"allreduce {algorithms['data']}"
    return ", ".join(f"{axis} {name}" for axis, name in algorithms.items())


def progress_line(stats: StepStats, total: int) -> str:
    width = len(f"{total:,}")
    rate = (f"sim {stats.tokens_per_second:,.0f} tokens/s" if stats.tokens_per_example else
            f"sim {stats.examples_per_second:,.0f} examples/s")
    loss = f"loss {stats.loss:.4f}  " if math.isfinite(stats.loss) else ""  # NaN: timing-only
    return (f"step {stats.step + 1:>{width},}/{total:,}  {loss}"
            f"sim {stats.step_seconds * 1e3:.4f} ms/step  {rate}  "
            f"wall {stats.wall_seconds * 1e3:.1f} ms/step")


def summary_table(summary: dict[str, Any]) -> Table:
    """The end-of-run table of ``summary_rows``."""
    slices = summary.get("slices", 1)
    where = summary['slice'] or summary['generation']
    where = f"{slices} x {where}" if slices > 1 else where
    table = titled_table(f"{summary['scenario']}: {where} "
                         f"({summary['chips']:,} chips, {summary['cores']:,} TensorCores, "
                         f"{summary['topology']})", show_header=True)
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("clock")
    for row in summary_rows(summary):
        table.add_row(*row)
    return table


def summary_rows(summary: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(figure, value, clock) rows of the end-of-run summary (the console's table and
    report.html's) from summary.json's figures: the same rows for every mesh (its
    collectives per mesh axis, per step; HBM per device)."""
    tokens = summary.get("simulated_tokens_per_second") or 0.0
    rows = [
        ("steps x global batch", f"{summary['steps']:,} x {summary['global_batch']:,}", ""),
        _loss_row(summary),
        _mesh_row(summary),
        _test_row(summary),
        ("step time (critical path)", f"{summary['simulated_step_seconds'] * 1e3:.4f} ms",
         "simulated"),
        ("  without overlap (sum)", f"{summary['serial_step_seconds'] * 1e3:.4f} ms", "simulated"),
        ("  infeed, exposed", f"{summary['exposed_infeed_seconds'] * 1e3:.4f} ms of "
                              f"{summary['infeed_seconds'] * 1e3:.4f}", "simulated"),
        ("  compute (fwd+bwd)", f"{summary['compute_seconds'] * 1e3:.4f} ms", "simulated"),
        ("  collectives, exposed",
         f"{summary['exposed_collective_seconds'] * 1e3:.4f} ms of "
         f"{summary['collective_seconds'] * 1e3:.4f} "
         f"({summary['overlap_fraction']:.0%} hidden)", "simulated"),
        *_axis_rows(summary),
        *([("  host offload, exposed",
            f"{summary['exposed_host_offload_seconds'] * 1e3:.4f} ms of "
            f"{summary['host_offload_seconds'] * 1e3:.4f}", "simulated")]
          if summary.get("host_offload_seconds") else []),
        *_bubble_rows(summary),
        ("  update", f"{summary['update_seconds'] * 1e3:.4f} ms", "simulated"),
        ("throughput", f"{summary['simulated_examples_per_second']:,.0f} examples/s"
                       + (f", {tokens:,.0f} tokens/s" if tokens else ""), "simulated"),
        ("model TFLOP/s", f"{summary['simulated_tflops']:.3f}", "simulated"),
        *([("TFLOP/s per device (MaxText)",
            f"{summary['maxtext_tflops_per_device']:.1f} (attention not halved); "
            f"{summary['maxtext_2023_tflops_per_device']:.1f} (2023: causal attention halved)",
            "simulated")]
          if summary.get("maxtext_tflops_per_device") else []),
        ("MFU", f"{summary['mfu']:.2%}", "simulated"),
        ("HBM peak per device", f"{summary['hbm_peak_bytes'] / 2**20:.2f} MiB of "
                                f"{summary['hbm_capacity_bytes'] / 2**30:.0f} GiB", ""),
        ("ICI bytes per step", f"{summary['ici_bytes_per_step']:,}", ""),
        *([("DCN bytes per step per device", f"{int(summary['dcn_bytes_per_step']):,}", "")]
          if summary.get("dcn_bytes_per_step") else []),
        ("step time", f"{summary['wall_step_seconds'] * 1e3:.1f} ms", "wall"),
        ("emulation slowdown", f"{summary['emulation_slowdown']:,.0f}x", "wall/simulated"),
        ("replicas bit-identical", {True: "yes", False: "NO"}.get(
            summary["replicas_identical"], "not checked (timing-only)"), ""),
    ]
    return rows


def _loss_row(summary: dict[str, Any]) -> tuple[str, str, str]:
    first, last = summary.get("initial_loss"), summary.get("final_loss")
    if first is None or last is None:
        return ("loss first -> last", "none (timing-only: shapes, no values)", "")
    return ("loss first -> last", f"{first:.4f} -> {last:.4f}", "")


def _test_row(summary: dict[str, Any]) -> tuple[str, str, str]:
    loss, accuracy = summary.get("test_loss"), summary.get("test_accuracy")
    if loss is None:
        return ("test loss, accuracy", "none (no test example evaluated)", "")
    return ("test loss, accuracy", f"{loss:.4f}, "
            + (accuracy_text(accuracy) if accuracy is not None else "none"), "")


def _mesh_row(summary: dict[str, Any]) -> tuple[str, str, str]:
    axes = ", ".join(f"{a}: {n}" for a, n in summary["mesh"].items())
    each = " (a device per TensorCore)" if summary.get("devices_per_chip", 1) > 1 else ""
    named = algorithms_text(summary.get("collective_algorithms") or {})
    algorithm = f"; {named}" if named else ""
    dcn = summary.get("dcn_mesh") or {}
    slices = (f"; {summary.get('slices', 1)} slices over the DCN ("
              + ", ".join(f"{a} x{n}" for a, n in dcn.items()) + ")" if dcn else "")
    return ("mesh", f"{{{axes}}}{each}{algorithm}{slices}", "")


def _bubble_rows(summary: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The pipeline bubble (a mesh with a stage axis): its time per step and its share
    of the forward and backward passes, with the schedule."""
    pipe = summary.get("pipeline")
    if not pipe:
        return []
    repeats = f", {pipe['repeats']} repeats" if pipe["repeats"] > 1 else ""
    return [("  pipeline bubble", f"{summary['pipeline_bubble_seconds'] * 1e3:.4f} ms "
                                  f"({summary['pipeline_bubble_fraction']:.0%} of fwd+bwd; "
                                  f"{pipe['schedule']}, {pipe['stages']} stages x "
                                  f"{pipe['microbatches']} microbatches{repeats})", "simulated")]


def _axis_rows(summary: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Per mesh axis, per step: exposed of all collective seconds, and the bytes a
    device passed to them (summary.json's ``collectives_by_axis``)."""
    return [(f"    {axis}", f"{t['exposed_simulated_seconds'] * 1e3:.4f} ms of "
                         f"{t['simulated_seconds'] * 1e3:.4f}, "
                         f"{int(t['bytes_per_step']):,} B" + _dcn_text(t), "simulated")
            for axis, t in summary.get("collectives_by_axis", {}).items()]


def _dcn_text(figures: dict[str, Any]) -> str:
    """An axis's part across slices (multislice), e.g. ``; DCN 0.0480 ms, 12,448 B sent``."""
    if "dcn_simulated_seconds" not in figures:
        return ""
    return (f"; DCN ({figures['dcn_slices']} slices) {figures['dcn_simulated_seconds'] * 1e3:.4f}"
            f" ms, {int(figures['dcn_bytes_per_step']):,} B sent")


def accuracy_text(accuracy: float) -> str:
    """Test accuracy as every line and table prints it: a fraction, 4 decimals (Keras)."""
    return f"{accuracy:.4f}"


def evaluation_text(evaluation: Any) -> str:
    """``test_loss: L - test_accuracy: A``, the one format of a held-out evaluation
    ("none" where no test example was evaluated, as the summary's null)."""
    loss, accuracy = evaluation.loss, evaluation.accuracy
    if not (math.isfinite(loss) and math.isfinite(accuracy)):
        return "test_loss: none - test_accuracy: none (no test example evaluated)"
    return f"test_loss: {loss:.4f} - test_accuracy: {accuracy_text(accuracy)}"


def epoch_line(totals: StepTotals, evaluation: Any | None, epoch: int, epochs: int,
               wall_seconds: float) -> str:
    """A Keras-style epoch line: the epoch's mean training loss, the test loss and
    accuracy when the run evaluated after this step (``eval_every_steps``, the last
    step), the epoch's mean simulated ms/step and its wall seconds."""
    test = f"{evaluation_text(evaluation)} - " if evaluation is not None else ""
    loss = f"loss: {totals.epoch_loss:.4f} - " if math.isfinite(totals.epoch_loss) else ""
    return (f"Epoch {epoch:,}/{epochs:,} - {totals.epoch_steps:,} steps - {loss}{test}"
            f"{totals.epoch_step_seconds_mean * 1e3:.4f} ms/step (simulated) - "
            f"{wall_seconds:.1f} s (wall)")


def progress_bar(console: Console, total: int, *, disable: bool = False) -> Progress:
    """A progress bar with ETA (wall clock) on a terminal; lines printed through it stay
    above it (``disable``: none, e.g. under a ``StatusLine``)."""
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("steps, elapsed"), TimeElapsedColumn(), TextColumn("ETA"),
                    TimeRemainingColumn(), console=console, transient=True,
                    disable=disable or not console.is_terminal)


class StatusLine:
    """One line of progress that each update replaces, so a long run does not flood a
    notebook cell or a log: in Jupyter a display that is updated in place (IPython's
    ``display_id``, no widgets needed); elsewhere the line rewritten after a carriage
    return, as tqdm does. At most ``updates_per_second`` updates reach the screen; the
    last text is always shown by ``close``. A quiet console shows nothing.

    Args:
        console: the run's console (its file, ``is_jupyter`` and ``quiet``).
        updates_per_second: the most updates drawn per wall second.
    """

    def __init__(self, console: Console, updates_per_second: float = 10.0) -> None:
        self.console = console
        self.min_interval_s = 1.0 / updates_per_second
        self._handle: Any = None
        self._width = 0
        self._drawn_at = -math.inf
        self._pending: str | None = None

    def __enter__(self) -> StatusLine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def update(self, text: str) -> None:
        """Show ``text`` in place of the line before (now, or at the next chance)."""
        self._pending = text
        if time.monotonic() - self._drawn_at >= self.min_interval_s:
            self._draw()

    def _draw(self) -> None:
        text, self._pending = self._pending, None
        if text is None or self.console.quiet:
            return
        self._drawn_at = time.monotonic()
        if self.console.is_jupyter:
            from IPython.display import display

            data = {"text/plain": text}
            if self._handle is None:
                self._handle = display(data, raw=True, display_id=True)
            else:
                self._handle.update(data, raw=True)
            return
        file = self.console.file
        file.write("\r" + text.ljust(self._width))
        file.flush()
        self._width = len(text)

    def close(self) -> None:
        """Draw the last text and end the line."""
        self._draw()
        if self._width and not self.console.is_jupyter:
            self.console.file.write("\n")
            self.console.file.flush()
        self._width = 0


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

"""An HLO step's results, written and shown with the project's report writers.

The files of any run (``pod.report``): ``summary.json`` (``write_json``),
``layers.csv`` (``write_csv``; here one row per JAX op name, so the user sees
the names of their own functions: ``source``, the innermost line of the user's own
code XLA kept for it, and ``call_chain``, the functions that led there), a
``collectives.csv`` beside it, and the Perfetto trace (``pod.report.trace``:
the compute stream with its waits, a lane per unit, a lane per set of device
groups with each collective where the clock placed it). The terminal table is
``pod.report.console.titled_table``.

Every figure is SIMULATED unless it says wall. A step costed from a
CPU-compiled module says "approximate (CPU-compiled HLO)" in the summary, the
table's title, the CSV files' first column header note and the trace's name.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from pod.hlo.ops import instruction_of
from pod.hlo.step import SPARSECORE, HloStep
from pod.report.console import titled_table
from pod.report.files import check_writable, write_csv, write_json
from pod.report.stats import mfu
from pod.report.trace import metadata_events, step_events, write_trace

__all__ = ["APPROXIMATE", "FAITHFUL", "LAYER_COLUMNS", "COLLECTIVE_COLUMNS", "label",
           "summary", "layer_rows", "collective_rows", "summary_table", "ops_table",
           "write_results", "trace_lanes"]

#: How a step costed from each kind of module is labelled everywhere it is shown.
APPROXIMATE = "approximate (CPU-compiled HLO)"
FAITHFUL = "TPU-compiled HLO"

LAYER_COLUMNS = ("op_name", "source", "call_chain", "instructions", "runs",
                 "simulated_seconds", "share", "mxu_flops", "hbm_bytes", "bound", "costed_as",
                 "xla_estimated_seconds")
COLLECTIVE_COLUMNS = ("instruction", "op_name", "op", "lane", "form", "algorithm", "groups",
                      "bytes", "runs", "simulated_seconds", "dcn_simulated_seconds")


def label(step: HloStep) -> str:
    """"TPU-compiled HLO" or "approximate (CPU-compiled HLO)"."""
    return APPROXIMATE if step.approximate else FAITHFUL


def summary(step: HloStep, **extra: Any) -> dict[str, Any]:
    """summary.json's content for an HLO step (simulated seconds unless named wall).

    Args:
        step: the costed step.
        extra: more top-level fields (the capture's: platform, cache, wall seconds).
    """
    stats, top = step.stats, step.topology
    peak = top.peak_bf16_flops_per_s
    seconds = stats.step_seconds
    lanes = {lane: {"bytes_per_step": int(stats.axis_collective_bytes.get(lane, 0)),
                    "simulated_seconds": stats.axis_collective_seconds.get(lane, 0.0),
                    "exposed_simulated_seconds": stats.axis_exposed_seconds.get(lane, 0.0),
                    "costed_as": ", ".join(sorted({r.algorithm for r in step.collectives
                                                   if r.lane == lane}))}
             for lane in step.lanes}
    xla = [r.xla_seconds for r in step.ops]
    return {
        "costed_from": label(step),
        "module": step.module_name,
        "slice": top.slice_name, "generation": top.chip.name, "chips": top.chips,
        "slices": top.slices, "topology": top.torus.name, "devices": step.devices,
        "simulated_step_seconds": seconds,
        "serial_step_seconds": stats.serial_step_seconds,
        "compute_seconds": stats.compute_seconds,
        "collective_seconds": stats.collective_seconds,
        "exposed_collective_seconds": stats.exposed_collective_seconds,
        "overlap_fraction": stats.overlap_fraction,
        "collectives_by_lane": lanes,
        "mxu_flops_per_device": step.flops_per_device,
        "simulated_tflops_per_device": step.flops_per_device / seconds / 1e12 if seconds else 0.0,
        "mfu": mfu(step.flops_per_device * step.devices, seconds, peak),
        "mfu_flops": "the HLO's own MXU FLOPs (recomputation included)",
        "peak_bf16_flops_per_s": peak,
        "compute_bound_seconds": dict(stats.compute_bound_seconds),
        "xla_estimated_compute_seconds": (sum(x for x in xla if x is not None)
                                          if xla and all(x is not None for x in xla) else None),
        "memory": {"peak_bytes": step.memory.peak_bytes,
                   "capacity_bytes": step.memory.capacity_bytes, "fits": step.memory.fits,
                   "verdict": step.memory.verdict(), "xla": step.memory.xla,
                   "xla_platform": step.memory.xla_platform or None,
                   "estimate_bytes": step.memory.estimate_bytes},
        "ici_bytes_per_step": int(sum(stats.ici_link_bytes.values())),
        "trip_counts": step.trip_counts,
        "notes": list(step.notes),
    } | extra


def layer_rows(step: HloStep) -> list[dict[str, Any]]:
    """layers.csv: one row per JAX op name (the instructions XLA kept it on), most
    simulated seconds first; its ``source`` and ``call_chain`` are those of its slowest
    instruction that has a source ("" when none has)."""
    groups: dict[str, list] = defaultdict(list)
    for row in step.ops:
        groups[row.op_name or f"({row.opcode} {row.name})"].append(row)
    total = sum(r.seconds for r in step.ops) or 1.0
    out = []
    for name, rows in groups.items():
        seconds = sum(r.seconds for r in rows)
        main = max(rows, key=lambda r: r.seconds)
        xla = [r.xla_seconds for r in rows]
        where = next((r for r in rows if r.source), None)
        out.append({
            "op_name": name, "source": where.source if where else "",
            "call_chain": where.call_chain if where else "",
            "instructions": len(rows), "runs": sum(r.count for r in rows),
            "simulated_seconds": seconds, "share": seconds / total,
            "mxu_flops": sum(r.flops for r in rows), "hbm_bytes": sum(r.hbm_bytes for r in rows),
            "bound": main.bound, "costed_as": main.how,
            "xla_estimated_seconds": (sum(x for x in xla if x is not None)
                                      if all(x is not None for x in xla) else None)})
    return sorted(out, key=lambda r: -r["simulated_seconds"])


def collective_rows(step: HloStep) -> list[dict[str, Any]]:
    """collectives.csv: one row per collective (or async copy) instruction."""
    return [{"instruction": r.name, "op_name": r.op_name, "op": r.op, "lane": r.lane,
             "form": r.form, "algorithm": r.algorithm, "groups": r.groups, "bytes": r.nbytes,
             "runs": r.count, "simulated_seconds": r.seconds,
             "dcn_simulated_seconds": r.dcn_seconds} for r in step.collectives]


def summary_table(data: dict[str, Any]) -> Table:
    """The terminal table of a summary (:func:`summary`)."""
    where = data["slice"] or f"{data['generation']} {data['topology']}"
    where = f"{data['slices']} x {where}" if data["slices"] > 1 else where
    table = titled_table(f"{data['module']}: {where} ({data['chips']:,} chips, "
                         f"{data['topology']}) from {data['costed_from']}", show_header=True)
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("clock")
    ms = 1e3
    rows = [
        ("step time (critical path)", f"{data['simulated_step_seconds'] * ms:.4f} ms", "simulated"),
        ("  without overlap (sum)", f"{data['serial_step_seconds'] * ms:.4f} ms", "simulated"),
        ("  compute", f"{data['compute_seconds'] * ms:.4f} ms", "simulated"),
        ("  collectives, exposed", f"{data['exposed_collective_seconds'] * ms:.4f} ms of "
                                   f"{data['collective_seconds'] * ms:.4f} "
                                   f"({data['overlap_fraction']:.0%} hidden)", "simulated"),
        *((f"    {lane}" + (f" ({f['costed_as']})" if lane == SPARSECORE else ""),
           f"{f['exposed_simulated_seconds'] * ms:.4f} ms of "
           f"{f['simulated_seconds'] * ms:.4f}, {f['bytes_per_step']:,} B",
           "simulated") for lane, f in data["collectives_by_lane"].items()),
        ("MXU TFLOP/s per device", f"{data['simulated_tflops_per_device']:.1f}", "simulated"),
        ("MFU (the HLO's FLOPs)", f"{data['mfu']:.2%}", "simulated"),
        ("HBM per device", data["memory"]["verdict"], ""),
        ("ICI bytes per step", f"{data['ici_bytes_per_step']:,}", ""),
    ]
    if data.get("compile_wall_seconds") is not None:
        rows.append(("compile", "from the cache" if data.get("cached") else
                     f"{data['compile_wall_seconds']:.1f} s", "wall"))
    for row in rows:
        table.add_row(*row)
    return table


def ops_table(step: HloStep, limit: int = 10) -> Table:
    """The ops that take the most simulated time (layers.csv's first rows)."""
    table = titled_table(f"top {limit} ops by simulated time ({label(step)})", show_header=True)
    for column in ("op_name", "source", "runs", "ms", "share", "bound", "costed as"):
        table.add_column(column, justify="left" if column in ("op_name", "source") else "right")
    for row in layer_rows(step)[:limit]:
        name = "/".join(row["op_name"].split("/")[-3:])
        table.add_row(name, row["source"],
                      f"{row['runs']:,}", f"{row['simulated_seconds'] * 1e3:.4f}",
                      f"{row['share']:.1%}", row["bound"], row["costed_as"])
    return table


def write_results(step: HloStep, output_dir: Path, data: dict[str, Any]) -> list[Path]:
    """Write summary.json, layers.csv, collectives.csv and trace.json.gz into ``output_dir``.

    Returns:
        The paths written.

    Raises:
        OutputError: the file system refused (one line naming the path).
    """
    output_dir = Path(output_dir)
    check_writable(output_dir)
    paths = [output_dir / n for n in ("summary.json", "layers.csv", "collectives.csv",
                                      "trace.json.gz")]
    write_json(paths[0], data)
    write_csv(paths[1], layer_rows(step), LAYER_COLUMNS)
    write_csv(paths[2], collective_rows(step), COLLECTIVE_COLUMNS)
    lanes, spans = trace_lanes(step.lanes, step.stats.collective_spans)
    events = metadata_events(f"{data['module']} on {step.topology.name} ({label(step)})", lanes)
    events += step_events(dataclasses.replace(step.stats, collective_spans=spans), lanes, 0.0,
                          step.trace_rows)
    _name_ops_in_the_program(events, step.ops)
    write_trace(paths[3], events, {"costed_from": label(step), "simulated": True,
                                   "module": data["module"]})
    return paths


def _name_ops_in_the_program(events: list[dict[str, Any]], ops: Sequence[Any]) -> None:
    """Give each op event of the trace (an instruction's kernel, ``short_name``) the JAX op
    name, the user's source line and the call chain that layers.csv gives it (``OpRow``),
    where known, so a click on a kernel in Perfetto shows the user's code."""
    where = {op.name: op for op in ops}
    for event in events:
        op = where.get(instruction_of(event["name"])) if event.get("cat") == "op" else None
        if op is not None:
            event["args"] |= {k: v for k, v in (("op_name", op.op_name), ("source", op.source),
                                                ("call_chain", op.call_chain)) if v}


def trace_lanes(lanes: Sequence[str], spans: Sequence[Any]) -> tuple[list[str], tuple[Any, ...]]:
    """The trace's lanes and spans, a lane whose spans overlap in time split into tracks.

    A DMA lane's copies in flight share its bandwidth and overlap in time
    (``pod.report.clock.SharedLane``), which one track of a trace cannot show: each
    span goes on the first of its lane's tracks ("DMA host", "DMA host (2)", ...)
    free at its start (nothing else of that track still running).

    Args:
        lanes: the clock's lanes, in order.
        spans: the clock's ``CollectiveSpan``s (``.axis`` their lane, ``.start``, ``.end``).

    Returns:
        (lanes, spans): each lane followed by its extra tracks; the spans, in their order,
        each with ``axis`` its track.
    """
    ends: dict[str, list[float]] = {}  # lane -> the end of each of its tracks so far
    track_of: dict[int, str] = {}
    for i in sorted(range(len(spans)), key=lambda i: (spans[i].start, i)):
        span = spans[i]
        tracks = ends.setdefault(span.axis, [])
        k = next((k for k, end in enumerate(tracks) if end <= span.start), len(tracks))
        if k == len(tracks):
            tracks.append(span.end)
        tracks[k] = max(tracks[k], span.end)
        track_of[i] = span.axis if k == 0 else f"{span.axis} ({k + 1})"
    out: list[str] = []
    for lane in [*lanes, *(a for a in ends if a not in lanes)]:
        out += [lane] + [f"{lane} ({k + 1})" for k in range(1, len(ends.get(lane, ())))]
    return out, tuple(dataclasses.replace(s, axis=track_of[i]) for i, s in enumerate(spans))

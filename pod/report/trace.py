"""Simulated timelines in the Chrome trace event format (Perfetto, chrome://tracing).

One "process" per chip with a lane ("thread") per TensorCore unit (MXU,
vector unit, scalar unit), an infeed lane, ICI send and receive lanes (each
chunk the chip sends and receives, a flow arrow from a send to its receive) and
a counter track of the HBM in use per core; one "ICI" process with a lane per
directed link, a lane for the allreduce phases and a lane with one span per
step. Times are SIMULATED microseconds (``ts``, ``dur``), never wall time. A
path ending in ``.gz`` is written gzip-compressed (Perfetto opens it as is).

The layout follows the step-time model of ``pod.report.stats.StepStats``:
infeed, then every core's forward + backward ops back to back, a barrier at
the slowest core, the on-chip reduce of each chip's cores, the ICI allreduce
phase by phase (a link's event lasts its bytes / bandwidth within the phase),
then every core's optimizer ops. So the end of the last event minus the start
of the step equals the reported simulated step time.

Format reference: "Trace Event Format" (Google, the JSON Array/Object format
with ``ph: "X"`` complete events, ``ph: "M"`` metadata events, ``ph: "C"``
counter events and ``ph: "s"`` / ``ph: "f"`` flow events).
"""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

from interconnect import Schedule, Torus
from pod.report.files import output_errors, write_atomic
from pod.report.stats import StepStats

__all__ = ["step_events", "sharded_metadata_events", "sharded_step_events", "write_trace",
           "UNITS"]

UNITS = ("mxu", "vpu", "scalar", "host")
_UNIT_LABEL = {"mxu": "MXU", "vpu": "vector unit", "scalar": "scalar unit",
               "host": "host link"}  # "host": remat offload transfers (chip.TensorCore)
_LANES_PER_CORE = len(UNITS)
_INFEED_TID = 1000
_SEND_TID, _RECEIVE_TID = 1001, 1002
_PHASE_TID = 0
_STEP_TID = -1
_US = 1e6


def _tid(core: int, unit: str) -> int:
    return 1 + core * _LANES_PER_CORE + UNITS.index(unit)


def metadata_events(num_chips: int, cores: int, torus: Torus) -> list[dict[str, Any]]:
    """Process and thread names: a process per chip, lanes per core unit, an ICI process."""
    events: list[dict[str, Any]] = []
    ici_pid = num_chips
    for chip in range(num_chips):
        events.append({"ph": "M", "name": "process_name", "pid": chip, "tid": 0,
                       "args": {"name": f"chip {chip}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": chip, "tid": 0,
                       "args": {"sort_index": chip}})
        events.append({"ph": "M", "name": "thread_name", "pid": chip, "tid": _INFEED_TID,
                       "args": {"name": "infeed (host to chip)"}})
        events.append({"ph": "M", "name": "thread_name", "pid": chip, "tid": _SEND_TID,
                       "args": {"name": "ICI send"}})
        events.append({"ph": "M", "name": "thread_name", "pid": chip, "tid": _RECEIVE_TID,
                       "args": {"name": "ICI receive"}})
        for core in range(cores):
            for unit in UNITS:
                events.append({"ph": "M", "name": "thread_name", "pid": chip,
                               "tid": _tid(core, unit),
                               "args": {"name": f"core {core} {_UNIT_LABEL[unit]}"}})
    events.append({"ph": "M", "name": "process_name", "pid": ici_pid, "tid": 0,
                   "args": {"name": f"ICI ({torus.name})"}})
    events.append({"ph": "M", "name": "process_sort_index", "pid": ici_pid, "tid": 0,
                   "args": {"sort_index": ici_pid}})
    events.append({"ph": "M", "name": "thread_name", "pid": ici_pid, "tid": _PHASE_TID,
                   "args": {"name": "allreduce phases"}})
    events.append({"ph": "M", "name": "thread_name", "pid": ici_pid, "tid": _STEP_TID,
                   "args": {"name": "steps"}})
    for i, (src, dst) in enumerate(torus.links()):
        events.append({"ph": "M", "name": "thread_name", "pid": ici_pid, "tid": i + 1,
                       "args": {"name": f"link {src}->{dst}"}})
    return events


def _ops(events: list, pid: int, core: int, rows: Sequence[Sequence[Any]], start_s: float,
         cat: str, scalar_issue_seconds: float = 0.0) -> float:
    """Lay one core's ops back to back from ``start_s``; returns the end time (seconds).

    Each op's time is split as the cost model accounts it: the scalar unit
    first issues it (``scalar_issue_seconds``, at most the op's time), then
    the op's own unit (MXU or vector unit) runs the rest.
    """
    t = start_s
    for name, unit, seconds, flops, hbm_bytes, bound in rows:
        issue = min(scalar_issue_seconds, seconds)
        if issue > 0:
            events.append({"ph": "X", "name": f"issue {name}", "cat": cat, "pid": pid,
                           "tid": _tid(core, "scalar"), "ts": t * _US, "dur": issue * _US,
                           "args": {"unit": unit}})
        events.append({"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": _tid(core, unit),
                       "ts": (t + issue) * _US, "dur": (seconds - issue) * _US,
                       "args": {"flops": flops, "hbm_bytes": hbm_bytes, "bound": bound}})
        t += seconds
    return t


def phase_link_bytes(schedule: Schedule, torus: Torus) -> list[dict[tuple[int, int], int]]:
    """Bytes on each directed link in each phase (transfers routed dimension-order)."""
    out = []
    for phase in schedule.phases:
        loads: dict[tuple[int, int], int] = defaultdict(int)
        for t in phase:
            if t.nbytes:
                for link in torus.route(t.src, t.dst):
                    loads[tuple(link)] += t.nbytes
        out.append(dict(loads))
    return out


def step_events(stats: StepStats, records: dict[str, Any], schedule: Schedule, torus: Torus,
                phase_seconds: Sequence[float], start_s: float = 0.0,
                scalar_issue_seconds: float = 0.0, fixed_seconds: float = 0.0
                ) -> list[dict[str, Any]]:
    """The complete events of one step.

    Args:
        stats: the step's statistics (its parts decide the layout).
        records: ``Pod.last_trace``: per chip, per core op rows for
            ``compute`` and ``update``, and per chip ``local_reduce`` rows.
        schedule: the allreduce schedule run in the step.
        torus: the ICI topology.
        phase_seconds: simulated seconds of each schedule phase.
        start_s: simulated time the step starts at, seconds.
        scalar_issue_seconds: the scalar unit's issue time per op
            (``TensorCoreSpec.scalar_issue_cycles / clock_hz``), shown on the
            scalar lane before each op.
        fixed_seconds: the collective's fixed cost (``ScheduleCost.fixed_seconds``),
            drawn on the phase lane before its first phase.

    Returns:
        Chrome trace events (``ph: "X"``), times in microseconds.
    """
    events: list[dict[str, Any]] = []
    step = stats.step + 1
    compute_start = start_s + stats.dispatch_seconds + stats.exposed_infeed_seconds
    events.extend(_step_span_and_counters(stats, len(records["compute"]), start_s, compute_start))
    # the infeed ends where the step's compute starts; with overlap (double-buffered)
    # most of it runs during the step before
    infeed_start = max(0.0, compute_start - stats.infeed_seconds)
    for chip, per_core in enumerate(records["compute"]):
        events.append({"ph": "X", "name": "infeed", "cat": "infeed", "pid": chip,
                       "tid": _INFEED_TID, "ts": infeed_start * _US,
                       "dur": (compute_start - infeed_start) * _US,
                       "args": {"step": step, "exposed_us": stats.exposed_infeed_seconds * _US}})
        for core, rows in enumerate(per_core):
            _ops(events, chip, core, rows, compute_start, "compute", scalar_issue_seconds)
    ici_pid = len(records["compute"])
    link_tid = {tuple(link): i + 1 for i, link in enumerate(torus.links())}
    update_start = compute_start + stats.compute_seconds + stats.exposed_allreduce_seconds
    if len(stats.allreduce_buckets) > 1:  # overlapped buckets: one bar each
        events.extend(_bucket_events(stats, ici_pid, compute_start))
        for chip, per_core in enumerate(records["update"]):
            for core, rows in enumerate(per_core):
                _ops(events, chip, core, rows, update_start, "update", scalar_issue_seconds)
        return events
    # one allreduce: its phases in detail, from when its gradients are ready
    reduce_start = compute_start + (stats.allreduce_buckets[0][1] if stats.allreduce_buckets
                                    else stats.compute_seconds)
    for chip, rows in enumerate(records["local_reduce"]):
        _ops(events, chip, 0, rows, reduce_start, "local_reduce", scalar_issue_seconds)
    t = reduce_start + stats.local_reduce_seconds
    if fixed_seconds > 0:
        events.append({"ph": "X", "name": "collective fixed cost", "cat": "ici", "pid": ici_pid,
                       "tid": _PHASE_TID, "ts": t * _US, "dur": fixed_seconds * _US,
                       "args": {"step": step}})
        t += fixed_seconds
    for k, (loads, seconds) in enumerate(zip(phase_link_bytes(schedule, torus), phase_seconds)):
        events.append({"ph": "X", "name": f"phase {k + 1}", "cat": "ici", "pid": ici_pid,
                       "tid": _PHASE_TID, "ts": t * _US, "dur": seconds * _US,
                       "args": {"links_busy": len(loads)}})
        for link, nbytes in loads.items():
            busy = nbytes / stats.ici_link_bandwidth_bytes_per_s
            events.append({"ph": "X", "name": f"{nbytes:,} B", "cat": "ici", "pid": ici_pid,
                           "tid": link_tid[link], "ts": t * _US, "dur": busy * _US,
                           "args": {"bytes": nbytes, "phase": k + 1}})
        events.extend(_send_receive_flows(schedule.phases[k], k + 1, step, t, seconds,
                                          stats.ici_link_bandwidth_bytes_per_s))
        t += seconds
    for chip, per_core in enumerate(records["update"]):
        for core, rows in enumerate(per_core):
            _ops(events, chip, core, rows, update_start, "update", scalar_issue_seconds)
    return events


def _step_span_and_counters(stats: StepStats, chips: int, start_s: float,
                            compute_start: float) -> list[dict[str, Any]]:
    """The step's span on the ICI process's "steps" lane, and per chip a counter track
    of the HBM in use per core: the step's high-water mark while forward and backward
    run (activations held), what stays resident after the step from its update on."""
    end = start_s + stats.step_seconds
    update_start = end - stats.update_seconds
    events: list[dict[str, Any]] = [
        {"ph": "X", "name": f"step {stats.step + 1}", "cat": "step", "pid": chips,
         "tid": _STEP_TID, "ts": start_s * _US, "dur": stats.step_seconds * _US,
         "args": {"loss": stats.loss, "simulated_step_seconds": stats.step_seconds}}]
    for chip in range(chips):
        for ts, values in ((compute_start, stats.hbm_peak_bytes),
                           (update_start, stats.hbm_used_bytes)):
            cores = {f"core {core}": nbytes for (c, core), nbytes in sorted(values.items())
                     if c == chip}
            if cores:
                events.append({"ph": "C", "name": "HBM in use (bytes)", "pid": chip,
                               "ts": ts * _US, "args": cores})
    return events


def _send_receive_flows(transfers: Sequence[Any], phase: int, step: int, start_s: float,
                        phase_seconds: float, link_bandwidth_bytes_per_s: float
                        ) -> list[dict[str, Any]]:
    """Each transfer of a phase as a send on its source chip's "ICI send" lane and a
    receive on its destination's "ICI receive" lane, joined by a flow arrow (``ph: "s"`` at the send's start,
    ``ph: "f"`` at the receive's end; bound to the enclosing slices). A chunk is on
    the wire for bytes / link bandwidth and received by the end of its phase."""
    events: list[dict[str, Any]] = []
    for i, t in enumerate(transfers):
        if not t.nbytes:
            continue
        wire = min(phase_seconds, t.nbytes / link_bandwidth_bytes_per_s) if \
            link_bandwidth_bytes_per_s > 0 else phase_seconds
        flow = f"s{step}p{phase}t{i}"
        args = {"bytes": t.nbytes, "phase": phase, "step": step}
        events += [
            {"ph": "X", "name": f"send to chip {t.dst}", "cat": "ici", "pid": t.src,
             "tid": _SEND_TID, "ts": start_s * _US, "dur": wire * _US, "args": args},
            {"ph": "X", "name": f"receive from chip {t.src}", "cat": "ici", "pid": t.dst,
             "tid": _RECEIVE_TID, "ts": (start_s + phase_seconds - wire) * _US,
             "dur": wire * _US, "args": args},
            {"ph": "s", "name": "ICI chunk", "cat": "ici", "id": flow, "pid": t.src,
             "tid": _SEND_TID, "ts": start_s * _US},
            {"ph": "f", "bp": "e", "name": "ICI chunk", "cat": "ici", "id": flow, "pid": t.dst,
             "tid": _RECEIVE_TID, "ts": (start_s + phase_seconds) * _US},
        ]
    return events


def _bucket_events(stats: StepStats, ici_pid: int, compute_start: float) -> list[dict[str, Any]]:
    """The overlapped allreduce: one bar per gradient bucket on the ICI's phase lane,
    from when its layers' gradients are ready (and the bucket before it is done), so
    it overlaps the backward pass on the cores' lanes."""
    out = []
    for i, (layers, start, end) in enumerate(stats.allreduce_buckets):
        out.append({"ph": "X", "name": f"allreduce bucket {i + 1}", "cat": "ici", "pid": ici_pid,
                    "tid": _PHASE_TID, "ts": (compute_start + start) * _US,
                    "dur": (end - start) * _US,
                    "args": {"layers": list(layers), "step": stats.step + 1,
                             "hidden": end <= stats.compute_seconds}})
    return out


# ---------------------------------------------------------------- sharded steps

_MESH_PID = 0
_SHARDED_STEP_TID, _SHARDED_COMPUTE_TID = 0, 1


def _axis_tid(axes: Sequence[str], axis: str) -> int:
    return 2 + list(axes).index(axis)


def sharded_metadata_events(mesh_name: str, axes: Sequence[str]) -> list[dict[str, Any]]:
    """The lanes of a sharded run's trace: one process for the mesh with a lane of
    steps, a compute lane (the step's slowest device: its ops and its waits for
    collectives) and a lane per mesh axis (that device's collectives over it).

    Args:
        mesh_name: shown as the process name, e.g. "pod.mesh {data: 2, fsdp: 2}".
        axes: the mesh's axis names, in lane order.
    """
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": _MESH_PID, "tid": 0,
         "args": {"name": mesh_name}},
        {"ph": "M", "name": "thread_name", "pid": _MESH_PID, "tid": _SHARDED_STEP_TID,
         "args": {"name": "steps"}},
        {"ph": "M", "name": "thread_name", "pid": _MESH_PID, "tid": _SHARDED_COMPUTE_TID,
         "args": {"name": "compute (slowest device)"}}]
    for axis in axes:
        events.append({"ph": "M", "name": "thread_name", "pid": _MESH_PID,
                       "tid": _axis_tid(axes, axis), "args": {"name": f"ICI {axis}"}})
    return events


def sharded_step_events(stats: StepStats, axes: Sequence[str], start_s: float
                        ) -> list[dict[str, Any]]:
    """One sharded step on the lanes of :func:`sharded_metadata_events`: the step's
    span; on the compute lane the device's compute between its waits and each wait
    (named after the axis it waited for); on each axis's lane its collectives
    (``StepStats.collective_spans``: op, tag, bytes, kind). Simulated microseconds
    from ``start_s``; the last event ends at ``start_s + stats.step_seconds``.

    Args:
        stats: a sharded step's statistics (``traced_device`` >= 0).
        axes: the mesh's axis names (the lanes).
        start_s: the step's start on the run's simulated clock, seconds.
    """
    device = stats.traced_device
    events: list[dict[str, Any]] = [
        {"ph": "X", "name": f"step {stats.step + 1}", "cat": "step", "pid": _MESH_PID,
         "tid": _SHARDED_STEP_TID, "ts": start_s * _US, "dur": stats.step_seconds * _US,
         "args": {"loss": stats.loss, "simulated_step_seconds": stats.step_seconds,
                  "slowest_device": device}}]
    t = 0.0
    for a, b, axis in sorted(stats.compute_waits):  # the stream is sequential: no overlaps
        if a > t:
            events.append({"ph": "X", "name": "compute", "cat": "compute", "pid": _MESH_PID,
                           "tid": _SHARDED_COMPUTE_TID, "ts": (start_s + t) * _US,
                           "dur": (a - t) * _US, "args": {"device": device}})
        events.append({"ph": "X", "name": f"wait for {axis}", "cat": "wait", "pid": _MESH_PID,
                       "tid": _SHARDED_COMPUTE_TID, "ts": (start_s + a) * _US,
                       "dur": (b - a) * _US, "args": {"axis": axis, "device": device}})
        t = max(t, b)
    if stats.step_seconds > t:
        events.append({"ph": "X", "name": "compute", "cat": "compute", "pid": _MESH_PID,
                       "tid": _SHARDED_COMPUTE_TID, "ts": (start_s + t) * _US,
                       "dur": (stats.step_seconds - t) * _US, "args": {"device": device}})
    for span in stats.collective_spans:
        events.append({"ph": "X", "name": f"{span.op} {span.tag}", "cat": "ici",
                       "pid": _MESH_PID, "tid": _axis_tid(axes, span.axis),
                       "ts": (start_s + span.start) * _US, "dur": (span.end - span.start) * _US,
                       "args": {"bytes": span.nbytes, "kind": span.kind, "axis": span.axis,
                                "device": device}})
    return events


def write_trace(path: Path, events: list[dict[str, Any]], metadata: dict[str, Any]) -> None:
    """Write a trace file (JSON object format) that Perfetto and chrome://tracing open.

    Args:
        path: the output file; its directory is created; ``.gz``: gzip-compressed.
        events: metadata and complete events.
        metadata: run facts stored under ``otherData``.

    Raises:
        OutputError: the file system refused (written via a temporary file and
            a rename, so a failed write leaves no half trace).
    """
    path = Path(path)
    text = json.dumps({"traceEvents": events, "otherData": metadata})
    with output_errors(path.parent):
        path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".gz":  # mtime=0: the same trace gives the same bytes
        data = gzip.compress(text.encode(), mtime=0)
        write_atomic(path, lambda f: f.write(data), binary=True)
    else:
        write_atomic(path, lambda f: f.write(text))

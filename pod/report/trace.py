"""Simulated timelines in the Chrome trace event format (Perfetto, chrome://tracing).

One process for the pod's mesh with lanes:

- "steps": one span per traced step;
- "infeed": the host-to-chip transfer of the busiest chip's batch, ending where
  the step's compute starts (behind the step before when overlapped; cut at
  the run's start for the first step);
- "compute (slowest device)": the step's slowest device, its compute between
  its waits and each wait named after the mesh axis it waited for, or
  "pipeline bubble" where it waited for another pipeline stage;
- one lane per TensorCore unit of that device ("MXU", "vector unit", "scalar
  unit") with every op record of the step where the clock placed it;
- one lane per mesh axis ("ICI data", "ICI fsdp", ...) with that device's
  collectives where the clock placed them (``pod.report.clock``);
- with a stage axis, one lane per pipeline stage ("stage 0", "stage 1", ...):
  the stages of the slowest device's stage group, each its compute between its
  waits, the bubble named "pipeline bubble" (where it waited for another stage
  to reach its send).

Times are SIMULATED microseconds (``ts``, ``dur``), never wall time; the last
event of a step ends at its start plus ``StepStats.step_seconds``. A path
ending in ``.gz`` is written gzip-compressed (Perfetto opens it as is).

Format reference: "Trace Event Format" (Google, the JSON Array/Object format
with ``ph: "X"`` complete events and ``ph: "M"`` metadata events).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pod.report.clock import BUBBLE
from pod.report.files import output_errors, write_atomic
from pod.report.stats import StepStats

__all__ = ["metadata_events", "step_events", "write_trace", "UNITS"]

UNITS = ("mxu", "vpu", "scalar", "host")
_UNIT_LABEL = {"mxu": "MXU", "vpu": "vector unit", "scalar": "scalar unit",
               "host": "host link"}  # "host": remat offload transfers (chip.TensorCore)
_US = 1e6
_MESH_PID = 0
_STEP_TID, _INFEED_TID, _COMPUTE_TID = 0, 1, 2


def _unit_tid(unit: str) -> int:
    return 3 + (UNITS.index(unit) if unit in UNITS else len(UNITS))


def _axis_tid(axes: Sequence[str], axis: str) -> int:
    return 10 + list(axes).index(axis)


def _stage_tid(stage: int) -> int:
    return 20 + stage


def metadata_events(mesh_name: str, axes: Sequence[str], stages: int = 1
                    ) -> list[dict[str, Any]]:
    """The lanes of a run's trace (module docstring).

    Args:
        mesh_name: shown as the process name, e.g. "pod.mesh {data: 2, fsdp: 2}".
        axes: the mesh's axis names, in lane order.
        stages: the mesh's stage size (a lane per stage when above 1).
    """
    names = [(_STEP_TID, "steps"), (_INFEED_TID, "infeed"),
             (_COMPUTE_TID, "compute (slowest device)"),
             *((_unit_tid(u), _UNIT_LABEL[u]) for u in UNITS),
             *((_axis_tid(axes, a), f"ICI {a}") for a in axes),
             *((_stage_tid(i), f"stage {i}") for i in range(stages if stages > 1 else 0))]
    events: list[dict[str, Any]] = [{"ph": "M", "name": "process_name", "pid": _MESH_PID,
                                     "tid": 0, "args": {"name": mesh_name}}]
    for tid, name in names:
        events.append({"ph": "M", "name": "thread_name", "pid": _MESH_PID, "tid": tid,
                       "args": {"name": name}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": _MESH_PID, "tid": tid,
                       "args": {"sort_index": tid}})
    return events


def _event(name: str, cat: str, tid: int, start_s: float, seconds: float,
           args: dict[str, Any]) -> dict[str, Any]:
    return {"ph": "X", "name": name, "cat": cat, "pid": _MESH_PID, "tid": tid,
            "ts": start_s * _US, "dur": seconds * _US, "args": args}


def _op_events(rows: Sequence[Sequence[Any]], waits: Sequence[tuple[float, float, str]],
               origin: float, device: int) -> list[dict[str, Any]]:
    """The device's op records back to back on their unit's lane, skipping over the
    compute stream's waits (a wait starts where an op ends: ``pod.report.clock``)."""
    out, t, pending = [], 0.0, sorted(waits)
    for name, unit, seconds, flops, hbm_bytes, bound in rows:
        while pending and pending[0][0] <= t + 1e-15:
            t = max(t, pending.pop(0)[1])
        out.append(_event(str(name), "op", _unit_tid(str(unit)), origin + t, float(seconds),
                          {"flops": int(flops), "hbm_bytes": int(hbm_bytes), "bound": bound,
                           "device": device}))
        t += float(seconds)
    return out


def _stream_events(tid: int, origin: float, end: float,
                   waits: Sequence[tuple[float, float, str]], device: int) -> list[dict[str, Any]]:
    """A compute stream on lane ``tid``: compute between its waits, each wait named
    after the axis it waited for (or the pipeline bubble), until ``end`` (seconds from
    ``origin``)."""
    events, t = [], 0.0
    for a, b, axis in sorted(waits):  # the stream is sequential: no overlaps
        if a > t:
            events.append(_event("compute", "compute", tid, origin + t, a - t, {"device": device}))
        name = axis if axis == BUBBLE else f"wait for {axis}"
        events.append(_event(name, "wait", tid, origin + a, b - a,
                             {"axis": axis, "device": device}))
        t = max(t, b)
    if end > t:
        events.append(_event("compute", "compute", tid, origin + t, end - t, {"device": device}))
    return events


def step_events(stats: StepStats, axes: Sequence[str], start_s: float,
                rows: Sequence[Sequence[Any]] = ()) -> list[dict[str, Any]]:
    """One step on the lanes of :func:`metadata_events` (module docstring).

    Args:
        stats: the step's statistics (``traced_device``, ``compute_waits`` and
            ``collective_spans`` of its slowest device).
        axes: the mesh's axis names (the lanes).
        start_s: the step's start on the run's simulated clock, seconds.
        rows: the slowest device's op rows (name, unit, seconds, flops,
            hbm_bytes, bound), if traced.
    """
    device = stats.traced_device
    origin = start_s + stats.dispatch_seconds + stats.exposed_infeed_seconds
    events: list[dict[str, Any]] = [
        _event(f"step {stats.step + 1}", "step", _STEP_TID, start_s, stats.step_seconds,
               {"loss": stats.loss, "simulated_step_seconds": stats.step_seconds,
                "slowest_device": device})]
    if stats.infeed_seconds > 0:  # it ends where the compute starts; it began behind the
        begin = max(0.0, origin - stats.infeed_seconds)  # step before (the run's start at most)
        events.append(_event("infeed", "infeed", _INFEED_TID, begin, origin - begin,
                             {"infeed_seconds": stats.infeed_seconds,
                              "exposed_seconds": stats.exposed_infeed_seconds}))
    end = (stats.compute_seconds + stats.exposed_collective_seconds
           + stats.pipeline_bubble_seconds + stats.update_seconds)
    events += _stream_events(_COMPUTE_TID, origin, end, stats.compute_waits, device)
    for stage, (member, member_end, waits) in enumerate(stats.stage_timelines):
        events += _stream_events(_stage_tid(stage), origin, member_end, waits, member)
    events += _op_events(rows, stats.compute_waits, origin, device)
    for span in stats.collective_spans:
        events.append(_event(f"{span.op} {span.tag}", "ici", _axis_tid(axes, span.axis),
                             origin + span.start, span.end - span.start,
                             {"bytes": span.nbytes, "kind": span.kind, "axis": span.axis,
                              "device": device}))
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

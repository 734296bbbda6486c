"""The simulated clock of a training step, one for every mesh: a compute stream and
an ICI stream per mesh axis.

A device program (``pod.programs``) leaves two things: its op records
(``chip.OpRecord``, run back to back on the TensorCore: the compute stream)
and its collective calls (``CollectiveCall``: axis, op, bytes in the dtype
that moves, kind, ``after_record`` = the op records issued before it, and its
overlap window). The plan costs each call
(``pod.config.sharding.MeshCollectiveCosts``: every group of the axis at once,
contention included). This module places them in time, as XLA's
latency-hiding scheduler does on a TPU ([SB] "How to Scale Your Model",
training chapter; the XLA async collective pipeline and the flags the
published MaxText runs set: async all-gather, reduce-scatter and all-reduce,
overlap of compute and collectives, windowed-einsum collective matmul):

- Each mesh axis has its own ICI stream (its collectives run on the DMA
  engines and links of its block of the torus; the device drives several
  streams at once); a collective takes the first gap of its axis's stream at
  or after it is ready that fits it, in program order.
- ``activation`` (tensor parallelism's collectives, and a mixture of experts'
  dispatch and combine all-to-alls over ``expert``): the compute stream waits
  for it. With collective matmul (XLA's windowed einsum) it is decomposed
  into the matmul that produces it (``overlap_before`` records: it may start
  when they start) or consumes it (``overlap_after`` records: they run while
  it completes), so only what the matmuls cannot hide shows; it then runs as
  collective-permute steps, each paying the fixed cost of a collective
  (``MeshCollectiveCosts.windowed_steps``).
- ``param_gather`` (FSDP's all-gathers): prefetched ``prefetch_layers`` layers
  ahead, as far as HBM lets (the plan's ``DeviceMemory.prefetch_layers``: one
  layer, fewer down to none when the plan is tight, ``pod.config.fit``). Ready
  when the compute stream reaches the param_gather that many before it (the
  first ones at the step's start; with 0, its own point); the compute stream
  waits at its own point for its end.
- ``grad_reduce`` (gradient reduce-scatters and allreduces): behind the
  backward pass. Ready when the compute stream reaches it; nothing waits
  for it but the optimizer: the records from ``update_start`` on (the
  optimizer's) start only once every grad_reduce has ended.

- ``ppermute`` over the ``stage`` axis (the pipeline's stage-to-stage
  transfers, ``pod.programs.pipeline``): the stages of a pipeline are clocked
  together (:func:`device_clocks`). A device's send goes on its ICI stream
  when its compute stream reaches the call; what it receives comes from the
  source's send, and it waits for it only where it uses it
  (``CollectiveCall.wait_record``; never, for a piece that carries nothing it
  uses): the dataflow of the schedule, each stage running its ops back to
  back wherever their inputs are ready. A wait up to the moment the source
  reached its send is the **pipeline bubble** (the source stage was still
  busy, or idle itself); the rest, the transfer, is exposed ``stage`` time.
  Any other collective over ``stage`` starts once every stage reached it
  (the wait for the others is the bubble too).
  With stages of equal cost and free transfers GPipe's bubble is ``(S - 1)
  (F + B)`` on the first stage, the closed form ``(S - 1) / (M + S - 1)`` of
  its forward and backward time (``pod.programs.pipeline_schedule``).

- DMA transfers (op :data:`DMA`: the HLO path's async copies between HBM, VMEM
  and host memory; the built-in path's host offload, records of bound
  :data:`HOST_OUT` / :data:`HOST_IN`) run on a DMA lane per link whose bandwidth
  the transfers in flight share (:class:`SharedLane`, processor sharing), as the
  chip's DMA engines run every descriptor issued to them at once. The ICI
  streams stay queues: their collectives' costs are whole schedules (per-step
  latency and the busiest link over every group of the axis), and a prefetched
  gather is placed before the compute stream's time, which a shared lane,
  clocked in order of start, cannot take.

With ``overlap=False`` (``training.overlap: false``: for teaching, and for
what XLA fails to overlap) every collective blocks where it is issued: the
step is the serial sum of its records and collectives.

The chip's sustained MXU budget (:func:`sustained_clocks`): the records run their
matmuls at a fresh op's rate, and a step whose MXU work would average above
the chip's sustained rate over the step is held to it (a power- or
clock-limited chip; ``chip.calibration``). A job of several slices waits each
step for its slowest slice (``interconnect.dcn.slice_wait_seconds``), charged
to the mesh axis across slices (``StepContext.slice_axis``).

The step ends when every stream has. What the compute stream waits is the
*exposed* collective time, each wait charged to the axis of the collective it
waited for (the pipeline bubble apart). The serial sum (every record and every collective one after
another) is reported beside it, an upper bound.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pod.programs.collectives import COLLECTIVE_KINDS

__all__ = ["CollectiveSpan", "StepClock", "SharedLane", "DMA", "step_clock", "sustained_clocks",
           "sustained_mxu_fraction", "compute_bound_seconds", "COLLECTIVE_KINDS",
           "DeviceReport",
           "StepContext", "device_clock", "device_clocks", "combine_device_reports", "BUBBLE",
           "PIPELINE_AXIS", "StatsMemo"]

#: A collective's simulated seconds: ``(axis, op, nbytes)``, and ``windowed=True`` for one
#: run as a collective matmul (``pod.config.sharding.MeshCollectiveCosts.seconds``).
CostSeconds = Callable[..., float]

#: What the compute stream's waits for another pipeline stage are charged to (the
#: ``waits`` of a :class:`StepClock`, the trace's compute lane).
BUBBLE = "pipeline bubble"

#: The mesh axis whose devices are clocked together (the pipeline's stages).
PIPELINE_AXIS = "stage"


@dataclass(frozen=True)
class CollectiveSpan:
    """One collective placed in time, simulated seconds from the step's start.

    Attributes:
        axis: the mesh axis; op: allreduce, reduce_scatter or all_gather;
        kind: param_gather, grad_reduce or activation; tag: the program's name for it;
        nbytes: the device's buffer bytes; start, end: its place on the ICI.
    """

    axis: str
    op: str
    kind: str
    tag: str
    nbytes: int
    start: float
    end: float


@dataclass(frozen=True)
class StepClock:
    """One device's step, simulated seconds.

    Attributes:
        step_seconds: the critical path (both streams done).
        compute_seconds: the op records before the optimizer (forward + backward).
        update_seconds: the optimizer's op records.
        collective_seconds: every collective's cost, summed.
        exposed_seconds: what the compute stream waited for collectives, plus
            collectives running past the end of the compute stream.
        serial_seconds: records and collectives one after another (an upper bound).
        axis_bytes: per mesh axis, the bytes of its collectives (the device's buffers).
        axis_seconds: per axis, its collectives' cost, summed.
        axis_exposed_seconds: per axis, the part of ``exposed_seconds`` charged to it.
        spans: every collective placed in time (for the trace).
        host_seconds: host-link transfers (remat offload), all of them (not in
            ``compute_seconds``).
        exposed_host_seconds: the part of them the compute stream waited for.
        waits: the compute stream's waits (start, end, the axis of the collective
            it waited for, or :data:`BUBBLE`), simulated seconds from the step's
            start (for the trace).
        bubble_seconds: what the compute stream waited for other pipeline stages
            to reach their sends (the pipeline bubble; not in ``exposed_seconds``).
        throttle_seconds: what the chip's sustained MXU budget added to the
            compute (:func:`sustained_clocks`; in ``compute_seconds``).
    """

    step_seconds: float
    compute_seconds: float
    update_seconds: float
    collective_seconds: float
    exposed_seconds: float
    serial_seconds: float
    axis_bytes: dict[str, int]
    axis_seconds: dict[str, float]
    axis_exposed_seconds: dict[str, float]
    spans: tuple[CollectiveSpan, ...] = ()
    waits: tuple[tuple[float, float, str], ...] = ()
    host_seconds: float = 0.0
    exposed_host_seconds: float = 0.0
    bubble_seconds: float = 0.0
    throttle_seconds: float = 0.0


#: Relative tolerance of :func:`sustained_clocks`: a step within it of its MXU work at
#: the sustained rate is taken as on the budget (the rest added in closed form).
SUSTAINED_TOLERANCE = 1e-3
#: Clock passes :func:`sustained_clocks` spends at most on stretching the matmuls.
SUSTAINED_PASSES = 3


def _mxu_seconds(report: DeviceReport) -> float:
    return sum(s for s, b in zip(report.record_seconds, report.record_bounds, strict=True)
               if b == "mxu")


def _stretched(report: DeviceReport, k: float) -> DeviceReport:
    """``report`` with its MXU-bound records ``k`` times longer."""
    seconds = tuple(s * k if b == "mxu" else s
                    for s, b in zip(report.record_seconds, report.record_bounds, strict=True))
    return dataclasses.replace(report, record_seconds=seconds)


def sustained_mxu_fraction(core: Any) -> float:
    """e1 / e0 of a TensorCore (``chip.TensorCoreSpec``): its sustained MXU budget against
    a fresh op's rate, the ``fraction`` of :func:`sustained_clocks` (``chip.calibration``:
    e0 ``MXU_FRESH_EFFICIENCY``, e1 ``MXU_SUSTAINED_EFFICIENCY`` per generation)."""
    return core.sustained_mxu_efficiency / core.mxu_efficiency


def sustained_clocks(reports: Sequence[DeviceReport],
                     cost_seconds: CostSeconds, fraction: float, *, overlap: bool = True,
                     prefetch_layers: int = 1) -> tuple[list[StepClock], list[DeviceReport]]:
    """Every device's clock (:func:`device_clocks`) held to the chip's sustained MXU budget.

    The records run their matmuls at a fresh op's efficiency e0
    (``TensorCore(sustained=True)``); the chip sustains only e1 of the ideal rate
    averaged over time (``TensorCoreSpec.sustained_mxu_efficiency``: a power- or
    clock-limited chip; ``chip.calibration``). So a step takes at least its MXU
    work at e1, ``mxu / fraction`` (``fraction = e1 / e0``, ``mxu`` its MXU-bound
    records' seconds): a step with enough other work between its matmuls (vector
    and HBM-bound ops, host transfers, exposed collectives) keeps under the budget
    and is not slowed; one that is all matmuls runs at e1. When the budget binds,
    the step is its MXU work at e1 exactly (the step grows continuously with the
    matmuls' stretch k, so some k brings it there); what changes with k is how
    much of the collectives the slower matmuls hide. So the MXU-bound records are
    stretched and the step clocked again: ``k += (mxu / fraction - step) / mxu``,
    from below (the step grows at most as fast as its matmuls), at most
    :data:`SUSTAINED_PASSES` passes, none when nothing is exposed (then nothing
    more can hide); what remains is added to the compute in closed form. One k
    for every device (that of the device furthest over its budget).

    Args:
        reports, cost_seconds, overlap, prefetch_layers: as :func:`device_clocks`.
        fraction: e1 / e0, in (0, 1]; 1: no budget.

    Returns:
        (clocks, reports): the clocks, ``throttle_seconds`` set to what the budget
        added, and the reports they were clocked from (the MXU-bound records
        stretched), in the order of ``reports``.
    """
    clocks = device_clocks(reports, cost_seconds, overlap=overlap,
                           prefetch_layers=prefetch_layers)
    if fraction >= 1.0:
        return clocks, list(reports)
    mxu = [_mxu_seconds(r) for r in reports]
    j = max(range(len(reports)), key=lambda i: mxu[i] / fraction - clocks[i].step_seconds)
    target = mxu[j] / fraction
    step = clocks[j].step_seconds
    if step >= target or mxu[j] <= 0:
        return clocks, list(reports)
    out, k = list(reports), 1.0
    exposed = step - clocks[j].compute_seconds - clocks[j].update_seconds
    for _ in range(SUSTAINED_PASSES if exposed > SUSTAINED_TOLERANCE * target else 0):
        k += (target - step) / mxu[j]         # the step grows at most as fast as its matmuls
        out = [_stretched(r, k) for r in reports]
        clocks = device_clocks(out, cost_seconds, overlap=overlap,
                               prefetch_layers=prefetch_layers)
        step = clocks[j].step_seconds
        if step >= target * (1.0 - SUSTAINED_TOLERANCE):
            break
    rest = max(0.0, target - step)            # the closed form for what remains
    return [dataclasses.replace(c, step_seconds=c.step_seconds + rest,
                                compute_seconds=c.compute_seconds + rest,
                                throttle_seconds=(k - 1.0) * m + rest)
            for c, m in zip(clocks, mxu, strict=True)], out


class _Ici:
    """One axis's ICI stream: busy intervals, sorted; a collective takes the first gap."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []

    def place(self, ready: float, seconds: float) -> tuple[float, float]:
        t = ready
        i = bisect.bisect_right(self.ends, t)  # intervals ending after t, sorted by start
        while i < len(self.starts) and self.starts[i] < t + seconds:
            t = max(t, self.ends[i])
            i += 1
        if t + seconds > t:  # a zero-length one occupies nothing; kept, it would unsort the ends
            j = bisect.bisect_left(self.starts, t)
            self.starts.insert(j, t)
            self.ends.insert(j, t + seconds)
        return t, t + seconds


class SharedLane:
    """A DMA lane whose bandwidth the transfers in flight share (processor sharing).

    The TPU's DMA engines run every descriptor issued to them at once, and the
    transfers share the link they cross: with n in flight each moves at 1/n of
    the link's bandwidth, so a small transfer issued under a large one finishes
    in about twice its own time, not after the large one (a queue's answer).
    Each transfer is given as its seconds alone on the link (its bytes over the
    link's bandwidth, which the caller knows): the host link is
    ``chip.ChipSpec.host_to_chip_bytes_per_s`` (PCIe per chip, [SB]: 32 GB/s on
    v6e, 16 GB/s before; both directions on one lane, as one link), the DMAs
    between HBM and VMEM the core's achieved HBM bandwidth
    (``chip.TensorCoreSpec.achieved_hbm_bandwidth_bytes_per_s``). Completion
    times are recomputed as transfers start and end: between two events the n
    transfers in flight each do 1/n of a second of their work a second.

    The lane is work-conserving: busy whenever a transfer is in flight, so its
    last end is the first start plus every transfer's seconds plus its idle
    gaps (the same as a queue's); what changes against a queue is the order in
    which transfers end.

    Transfers are added in order of their start (the compute stream's time, which
    never goes back); :meth:`end` answers with the transfers added so far, which
    is final once the caller's clock has reached that end or nothing more starts
    before it (a transfer started later than another's end cannot delay it).

    Raises:
        ValueError: a transfer that starts before one added earlier, or negative seconds.
    """

    def __init__(self) -> None:
        self.now = 0.0                       # the time the lane's state is at
        self.left: dict[int, float] = {}     # in flight: handle -> its seconds alone left
        self.starts: list[float] = []
        self.ends: list[float | None] = []   # None: still in flight at ``now``

    def add(self, start: float, seconds: float) -> int:
        """A transfer of ``seconds`` alone on the link, starting at ``start`` (simulated
        seconds); returns its handle (for :meth:`end`)."""
        if seconds < 0:
            raise ValueError(f"a transfer of {seconds} s: seconds must be >= 0")
        if start < self.now:
            raise ValueError(f"a transfer starting at {start} s after one at {self.now} s: "
                             "a shared lane takes its transfers in order of their start")
        self._finish(_share(self.now, self.left, start))
        self.now = start
        handle = len(self.starts)
        self.starts.append(start)
        self.ends.append(None if seconds > 0 else start)
        if seconds > 0:
            self.left[handle] = float(seconds)
        return handle

    def start(self, handle: int) -> float:
        """When transfer ``handle`` started."""
        return self.starts[handle]

    def end(self, handle: int) -> float:
        """When transfer ``handle`` ends, given the transfers added so far."""
        end = self.ends[handle]
        if end is not None:
            return end
        return _share(self.now, dict(self.left), math.inf)[handle]

    def last_end(self) -> float:
        """When the last transfer added so far ends (0 with none)."""
        ahead = _share(self.now, dict(self.left), math.inf)
        return max([e for e in self.ends if e is not None] + list(ahead.values()), default=0.0)

    def _finish(self, done: dict[int, float]) -> None:
        for handle, end in done.items():
            self.ends[handle] = end


def _share(now: float, left: dict[int, float], until: float) -> dict[int, float]:
    """Run the transfers in flight (``left``: handle -> seconds alone left; updated in
    place) from ``now`` to ``until`` (``math.inf``: until all are done), the n in flight
    each at 1/n of the link; returns the ends of those done by then."""
    done: dict[int, float] = {}
    while left:
        n = len(left)
        least = min(left.values())
        if now + least * n > until:
            share = (until - now) / n
            for handle in left:
                left[handle] -= share
            return done
        now += least * n
        for handle in list(left):
            rest = left[handle] - least
            if rest <= 0.0:  # the least (exactly 0): the loop ends
                del left[handle]
                done[handle] = now
            else:
                left[handle] = rest
    return done


def _windowed(call: Any) -> bool:
    """A collective XLA runs as a collective matmul (windowed einsum): an activation
    all-gather, reduce-scatter or allreduce decomposed into the matmul beside it
    (``overlap_before`` / ``overlap_after``), costed with its collective-permute steps
    (``MeshCollectiveCosts.seconds(windowed=True)``)."""
    return (call.kind == "activation" and call.op in ("all_gather", "reduce_scatter", "allreduce")
            and bool(getattr(call, "overlap_before", 0) or getattr(call, "overlap_after", 0)))


def _check_call(call: Any, last_after: int, n: int) -> None:
    """A call's kind is known and its ``after_record`` within ``last_after..n``."""
    if call.kind not in COLLECTIVE_KINDS:
        raise ValueError(f"collective {call.tag!r}: kind {call.kind!r} is not one of "
                         f"{', '.join(COLLECTIVE_KINDS)}")
    if call.op == DMA and call.kind != "activation":
        raise ValueError(f"transfer {call.tag!r}: a {DMA!r} call is of kind 'activation' "
                         f"(it starts where it is issued), not {call.kind!r}")
    if not last_after <= call.after_record <= n:
        raise ValueError(f"collective {call.tag!r}: after_record {call.after_record} is "
                         f"outside {last_after}..{n} (calls must be in issue order)")


#: The op of a DMA transfer (the HLO path's async copies between HBM, VMEM and host
#: memory): it runs on a :class:`SharedLane` named by its ``axis``, not an ICI stream.
DMA = "dma"


def _due(end: float | Callable[[], float]) -> float:
    """A pending wait's end: a float, or a transfer's end on a shared lane, asked when
    the wait falls due (final then: ``SharedLane``)."""
    return end() if callable(end) else end


#: Record bounds of host-link transfers (remat offload): "host_out" copies a tensor to
#: host memory after the forward pass, "host_in" brings it back before the backward pass
#: (``pod.runtime.device``; ``chip.TensorCore.account_host_transfer``).
HOST_OUT, HOST_IN = "host_out", "host_in"


class _Stream:
    """The compute stream: records back to back, waiting where a collective is due.

    ``pending`` holds (record index, end, axis, bubble until): before running that
    record the stream waits until ``bubble until`` (the pipeline bubble), then until
    ``end`` (charged to ``axis``; ``end`` a float, or a callable giving it when the
    wait falls due: a transfer on a :class:`SharedLane`). Host-link transfers
    (``kinds`` HOST_OUT / HOST_IN) run on a DMA lane of their own beside the
    compute (a :class:`SharedLane`: the transfers in flight share the host link),
    as XLA's async host offload does: an offload starts when its tensor is made and
    nothing waits for it but the step's end; a reload is prefetched one reload
    ahead (it starts when the compute stream has the reload before it: its buffer
    is then free) and the compute waits for it where it is needed. Their time the
    compute waited is charged to "host".
    """

    def __init__(self, seconds: Sequence[float], update_start: int,
                 kinds: Sequence[str] | None = None) -> None:
        self.kinds = kinds or ()
        host = {HOST_OUT, HOST_IN}
        self.host = [i for i, k in enumerate(self.kinds) if k in host]
        self.host_lane = SharedLane()
        self.host_seconds = 0.0
        self.reloads = [i for i in self.host if self.kinds[i] == HOST_IN]
        self.prefetched: dict[int, int] = {}  # reload record -> its handle on the host lane
        hosts = set(self.host)
        self.seconds = ([0.0 if i in hosts else float(s) for i, s in enumerate(seconds)]
                        if hosts else list(map(float, seconds)))
        self.host_record_seconds = {i: float(seconds[i]) for i in self.host}
        self.update_start = update_start
        self.t = 0.0
        self.done = 0
        self.starts: list[float] = []
        self.pending: list[tuple[int, float | Callable[[], float], str, float]] = []
        self.exposed: dict[str, float] = {}
        self.waits: list[tuple[float, float, str]] = []
        self.grad_end, self.grad_axis, self.grad_bubble = 0.0, "", 0.0

    def wait(self, until: float, axis: str, bubble_until: float = 0.0) -> None:
        if bubble_until > self.t:
            self.wait(min(bubble_until, until), BUBBLE)
        if until > self.t:
            self.waits.append((self.t, until, axis))
            self.exposed[axis] = self.exposed.get(axis, 0.0) + until - self.t
            self.t = until

    def run_until(self, index: int) -> None:
        while True:
            if self.pending:
                for due in [w for w in self.pending if w[0] <= self.done]:
                    self.pending.remove(due)
                    self.wait(_due(due[1]), due[2], due[3])
            if self.done >= index:
                return
            if self.done == self.update_start:  # the optimizer waits for the gradients
                self.wait(self.grad_end, self.grad_axis, self.grad_bubble)
            if self.done in self.host_record_seconds:
                self.starts.append(self.t)
                self._host(self.done)
                self.t += self.seconds[self.done]
                self.done += 1
                continue
            self._run_records(self._next_event(index))

    def _next_event(self, index: int) -> int:
        """The first record at or after the next one (up to ``index``) before which
        something happens: a wait falls due, the optimizer starts, a host transfer."""
        stop = index
        if self.pending:
            stop = min(stop, min(w[0] for w in self.pending))
        if self.update_start > self.done:
            stop = min(stop, self.update_start)
        at = bisect.bisect_right(self.host, self.done)
        if at < len(self.host):
            stop = min(stop, self.host[at])
        return max(stop, self.done + 1)

    def _run_records(self, stop: int) -> None:
        """Records ``done`` .. ``stop`` - 1 back to back (the same additions, in the same
        order, as one at a time)."""
        times = list(itertools.accumulate(self.seconds[self.done:stop], initial=self.t))
        self.starts.extend(times[:-1])
        self.t = times[-1]
        self.done = stop

    def _host(self, index: int) -> None:
        """Host transfer ``index`` on the host lane (class docstring): an offload starts
        now; a reload started when the compute stream had the reload before it (the
        first: now), the compute waits for it, and then the next reload starts."""
        self.host_seconds += self.host_record_seconds[index]
        if self.kinds[index] != HOST_IN:
            self.host_lane.add(self.t, self.host_record_seconds[index])
            return
        handle = self.prefetched.pop(index, None)
        if handle is None:
            handle = self.host_lane.add(self.t, self.host_record_seconds[index])
        self.wait(self.host_lane.end(handle), "host")
        at = bisect.bisect_right(self.reloads, index)
        if at < len(self.reloads):  # the next one's buffer is free: it starts now
            after = self.reloads[at]
            self.prefetched[after] = self.host_lane.add(self.t, self.host_record_seconds[after])

    def start_of(self, index: int) -> float:
        """When record ``index`` started (the stream's time if it has not)."""
        return self.starts[index] if 0 <= index < len(self.starts) else self.t


@dataclass(frozen=True)
class _Reach:
    """What a device tells its pipeline stages when it reaches a collective over the
    stage axis: the op and its shift, when its compute stream got there, and (a
    ppermute) when its own send lands."""

    op: str
    shift: int
    ready: float
    end: float


def step_clock(records: Sequence[Any], calls: Sequence[Any],
               cost_seconds: CostSeconds,
               update_start: int | None = None, *, overlap: bool = True,
               kinds: Sequence[str] | None = None, prefetch_layers: int = 1) -> StepClock:
    """Place a device's op records and collective calls in time (module docstring).

    Alone, a device stands for all of its pipeline stages: what it receives by a
    ppermute left its source when it sent its own (use :func:`device_clocks` to
    clock the stages of a pipeline together).

    Args:
        records: its op records in issue order (``.seconds`` simulated).
        calls: its collective calls in issue order (``.axis``, ``.op``, ``.nbytes``,
            ``.kind``, ``.after_record``, ``.tag``; optional ``.overlap_before`` and
            ``.overlap_after``, records of collective matmul; ``.shift`` and
            ``.wait_record`` of a ppermute).
        cost_seconds: (axis, op, nbytes) -> simulated seconds of the collective
            over every group of the axis (the plan's ``MeshCollectiveCosts.seconds``).
        update_start: the optimizer's first record; None: after the last grad_reduce.
        overlap: False: every collective blocks where it is issued.
        kinds: per record what bounds it (``DeviceReport.record_bounds``): host-link
            transfers (:data:`HOST_OUT`, :data:`HOST_IN`) run beside the compute
            (with ``overlap``; else in line, as compute).
        prefetch_layers: FSDP gathers run this many layers ahead (module docstring).

    Returns:
        The :class:`StepClock`.

    Raises:
        ValueError: a call of an unknown kind, or an ``after_record`` outside
            ``0..len(records)`` or decreasing.
    """
    timeline = _timeline([float(r.seconds) for r in records], calls, cost_seconds,
                         update_start, overlap, sync=False, kinds=kinds,
                         prefetch_layers=prefetch_layers)
    return _unsynced(timeline)


def _timeline(seconds: Sequence[float], calls: Sequence[Any],
              cost_seconds: CostSeconds, update_start: int | None,
              overlap: bool, sync: bool, kinds: Sequence[str] | None = None,
              prefetch_layers: int = 1):
    """:func:`step_clock` of the records' ``seconds`` as a generator: with ``sync`` it
    yields a :class:`_Reach` at every call over :data:`PIPELINE_AXIS` and takes back
    (ready, end): the source's ready time and the end of its send (a ppermute), or the
    stages' latest ready time (any other collective). Returns the :class:`StepClock`."""
    n = len(seconds)
    if update_start is None:
        update_start = max((c.after_record for c in calls if c.kind == "grad_reduce"), default=n)
    stream = _Stream(seconds, update_start, kinds if overlap else None)
    ici: dict[str, _Ici] = {}
    axis_bytes: dict[str, int] = {}
    axis_seconds: dict[str, float] = {}
    spans: list[CollectiveSpan] = []
    dma_lanes: dict[str, SharedLane] = {}
    dma: dict[int, tuple[SharedLane, int]] = {}  # span index -> its transfer
    last_after = 0
    reached: list[float] = []  # the compute stream's time at each param_gather so far
    for call in calls:
        _check_call(call, last_after, n)
        last_after = call.after_record
        stream.run_until(call.after_record)
        cost = float(cost_seconds(call.axis, call.op, int(call.nbytes), windowed=True)
                     if overlap and _windowed(call) else
                     cost_seconds(call.axis, call.op, int(call.nbytes)))
        synced = sync and call.axis == PIPELINE_AXIS
        axis_bytes[call.axis] = axis_bytes.get(call.axis, 0) + int(call.nbytes)
        axis_seconds[call.axis] = axis_seconds.get(call.axis, 0.0) + cost
        if call.op == "ppermute":
            start, end = ici.setdefault(call.axis, _Ici()).place(stream.t, cost)
            reach = _Reach(call.op, int(getattr(call, "shift", 0)), stream.t, end)
            src_ready, src_end = (yield reach) if synced else (reach.ready, reach.end)
            spans.append(CollectiveSpan(call.axis, call.op, call.kind, str(call.tag),
                                        int(call.nbytes), start, end))
            if not overlap:
                stream.wait(end, call.axis)
            wait = getattr(call, "wait_record", None)
            if wait is not None:
                stream.pending.append((min(n, int(wait)), src_end, call.axis, src_ready))
            continue
        if call.op == DMA:  # on a shared lane, from where it is issued (SharedLane)
            lane = dma_lanes.setdefault(call.axis, SharedLane())
            handle = lane.add(stream.t, cost)
            dma[len(spans)] = (lane, handle)
            spans.append(CollectiveSpan(call.axis, call.op, call.kind, str(call.tag),
                                        int(call.nbytes), stream.t, stream.t + cost))
            after = int(getattr(call, "overlap_after", 0)) if overlap else 0
            if after:
                stream.pending.append((min(n, call.after_record + after),
                                       functools.partial(lane.end, handle), call.axis, 0.0))
            else:
                stream.wait(lane.end(handle), call.axis)
            continue
        group_ready = (yield _Reach(call.op, 0, stream.t, 0.0))[0] if synced else 0.0
        before = int(getattr(call, "overlap_before", 0)) if overlap else 0
        after = int(getattr(call, "overlap_after", 0)) if overlap else 0
        if call.kind == "param_gather" and overlap:
            ready = _prefetched(reached, prefetch_layers, stream.t)
        else:
            ready = stream.start_of(call.after_record - before) if before else stream.t
        start, end = ici.setdefault(call.axis, _Ici()).place(max(ready, group_ready), cost)
        spans.append(CollectiveSpan(call.axis, call.op, call.kind, str(call.tag),
                                    int(call.nbytes), start, end))
        if call.kind == "param_gather":
            reached.append(stream.t)
        if call.kind == "grad_reduce" and overlap:
            if end >= stream.grad_end:
                stream.grad_end, stream.grad_axis, stream.grad_bubble = end, call.axis, group_ready
        elif after:
            stream.pending.append((min(n, call.after_record + after), end, call.axis,
                                   group_ready))
        else:
            stream.wait(end, call.axis, group_ready)
    return _finish(stream, spans, axis_bytes, axis_seconds, dma)


def _unsynced(timeline: Any) -> StepClock:
    """The clock a ``_timeline(..., sync=False)`` returns (it never yields)."""
    try:
        next(timeline)
    except StopIteration as done:
        return done.value
    raise AssertionError("a timeline without sync never yields")  # pragma: no cover


def _prefetched(reached: Sequence[float], prefetch_layers: int, now: float) -> float:
    """When a param_gather may start: as the compute stream reached the gather
    ``prefetch_layers`` before it (``reached``: its times at the gathers so far; the
    step's start for the first ones), or ``now`` (its own point) with none."""
    if prefetch_layers <= 0:
        return now
    return reached[-prefetch_layers] if len(reached) >= prefetch_layers else 0.0


def _finish(stream: _Stream, spans: list[CollectiveSpan], axis_bytes: dict[str, int],
            axis_seconds: dict[str, float],
            dma: dict[int, tuple[SharedLane, int]]) -> StepClock:
    """The rest of the records, the waits still due, and the clock's figures (``dma``:
    span index -> its transfer on a shared lane, whose end is known at the end)."""
    n, update_start = len(stream.seconds), stream.update_start
    stream.run_until(n)
    if update_start >= n:  # no optimizer records: the step waits for the gradients anyway
        stream.wait(stream.grad_end, stream.grad_axis, stream.grad_bubble)
    for _, end, axis, bubble in list(stream.pending):
        stream.wait(_due(end), axis, bubble)
    for i, (lane, handle) in dma.items():  # the transfers on shared lanes: ends final now
        spans[i] = dataclasses.replace(spans[i], end=lane.end(handle))
    last = max(spans, key=lambda sp: sp.end, default=None)
    if last is not None:  # collectives still running when compute is done
        stream.wait(last.end, last.axis)
    stream.wait(stream.host_lane.last_end(), "host")  # offloads still copying out
    seconds = stream.seconds
    compute, update = sum(seconds[:update_start]), sum(seconds[update_start:])
    total = sum(axis_seconds.values())
    exposed_host = stream.exposed.pop("host", 0.0)
    bubble = stream.exposed.pop(BUBBLE, 0.0)
    return StepClock(step_seconds=stream.t, compute_seconds=compute, update_seconds=update,
                     collective_seconds=total,
                     exposed_seconds=stream.t - compute - update - exposed_host - bubble,
                     serial_seconds=compute + update + total + stream.host_seconds,
                     axis_bytes=axis_bytes, axis_seconds=axis_seconds,
                     axis_exposed_seconds=stream.exposed, spans=tuple(spans),
                     waits=tuple(stream.waits), host_seconds=stream.host_seconds,
                     exposed_host_seconds=exposed_host, bubble_seconds=bubble)


@dataclass(frozen=True)
class DeviceReport:
    """What one device's step returns (crosses the actor boundary; simulated seconds).

    Attributes:
        device: the device id (``pod.config.mesh.Mesh``: chip rank x devices
            per chip + core).
        loss: the training loss on its examples (the program's).
        record_seconds: each op record's simulated seconds, in issue order.
        record_bounds: what bounds each record (``pod.report.stats.op_bound``).
        update_start: index of the optimizer's first record (None: the clock's
            default, after the last grad_reduce).
        calls: its collectives in issue order (``CollectiveCall``).
        mxu_flops: MXU FLOPs it executed.
        hbm_used_bytes, hbm_peak_bytes, hbm_capacity_bytes: its HBM.
        trace: its op rows (name, unit, seconds, flops, hbm_bytes, bound); empty
            unless traced.
        stage_group: the device ids of its pipeline stages (its group along
            ``stage``, ring order; empty without a stage axis): the devices
            :func:`device_clocks` clocks together.
        router_loads: its MoE layers' routing of its tokens
            (``pod.workloads.moe.RouterLoad``, one per layer; empty dense).
    """

    device: int
    loss: float
    record_seconds: tuple[float, ...]
    record_bounds: tuple[str, ...]
    update_start: int | None
    calls: tuple[Any, ...]
    mxu_flops: int
    hbm_used_bytes: int = 0
    hbm_peak_bytes: int = 0
    hbm_capacity_bytes: int = 0
    trace: tuple[tuple[Any, ...], ...] = ()
    stage_group: tuple[int, ...] = ()
    router_loads: tuple[Any, ...] = ()


def device_clock(report: DeviceReport, cost_seconds: CostSeconds, *,
                 overlap: bool = True, prefetch_layers: int = 1) -> StepClock:
    """One device's :class:`StepClock` from its report and the plan's collective costs
    (``MeshCollectiveCosts.seconds``); FSDP gathers ``prefetch_layers`` ahead."""
    timeline = _timeline(report.record_seconds, report.calls, cost_seconds,
                         report.update_start, overlap, sync=False, kinds=report.record_bounds,
                         prefetch_layers=prefetch_layers)
    return _unsynced(timeline)


def device_clocks(reports: Sequence[DeviceReport],
                  cost_seconds: CostSeconds, *,
                  overlap: bool = True, prefetch_layers: int = 1) -> list[StepClock]:
    """Every device's :class:`StepClock`, the stages of a pipeline clocked together: the
    devices of one ``stage_group`` run their timelines side by side, meeting at each
    collective over the stage axis (module docstring); a device without a stage
    group is clocked alone (:func:`device_clock`).

    Returns:
        The clocks, in the order of ``reports``.

    Raises:
        ValueError: a stage group whose devices are not all among the reports, or
            whose devices issued different collectives over the stage axis.
    """
    by_device = {r.device: i for i, r in enumerate(reports)}
    clocks: list[StepClock | None] = [None] * len(reports)
    alone: dict[tuple, StepClock] = {}  # replicas report the same records: clocked once
    for i, r in enumerate(reports):
        if clocks[i] is not None:
            continue
        if len(r.stage_group) <= 1:
            key = (r.record_seconds, r.record_bounds, r.calls, r.update_start)
            clock = alone.get(key)
            if clock is None:
                clock = alone[key] = device_clock(r, cost_seconds, overlap=overlap,
                                                  prefetch_layers=prefetch_layers)
            clocks[i] = clock
            continue
        missing = [d for d in r.stage_group if d not in by_device]
        if missing:
            raise ValueError(f"the pipeline stages {r.stage_group} of device {r.device} are "
                             f"clocked together; the reports lack devices {missing}")
        members = [by_device[d] for d in r.stage_group]
        for index, clock in zip(members, _clock_stages([reports[j] for j in members],
                                                       cost_seconds, overlap, prefetch_layers),
                                strict=True):
            clocks[index] = clock
    return [c for c in clocks if c is not None]


def _clock_stages(reports: Sequence[DeviceReport], cost_seconds: CostSeconds,
                  overlap: bool, prefetch_layers: int = 1) -> list[StepClock]:
    """The timelines of one stage group (``reports`` in ring order) side by side: at
    the k-th stage-axis collective each device learns its source's send (a
    ppermute: the member ``shift`` positions before) or the latest arrival."""
    timelines = [_timeline(r.record_seconds, r.calls, cost_seconds,
                           r.update_start, overlap, sync=True, kinds=r.record_bounds,
                           prefetch_layers=prefetch_layers)
                 for r in reports]
    out: list[Any] = [None] * len(reports)
    replies: list[Any] = [None] * len(reports)
    while True:
        reached: list[_Reach | None] = []
        for i, timeline in enumerate(timelines):
            try:
                reached.append(timeline.send(replies[i]))  # the first send(None) starts it
            except StopIteration as done:
                out[i] = done.value
                reached.append(None)
        if all(r is None for r in reached):
            return out
        kinds = {(r.op, r.shift) for r in reached if r is not None}
        if any(r is None for r in reached) or len(kinds) > 1:
            raise ValueError(f"the pipeline stages {tuple(r.device for r in reports)} issued "
                             f"different collectives over the stage axis: {sorted(kinds)}")
        got = [r for r in reached if r is not None]
        latest = max(r.ready for r in got)
        replies = [(got[(i - r.shift) % len(got)].ready, got[(i - r.shift) % len(got)].end)
                   if r.op == "ppermute" else (latest, 0.0) for i, r in enumerate(got)]


@dataclass(frozen=True)
class StepContext:
    """What turns device reports into a step's figures, from the plan (fixed for a run).

    Attributes:
        global_batch: examples per step.
        model_flops: model FLOPs of a step over the pod (no recomputation), or
            None: the recorded MXU FLOPs are the model FLOPs.
        device_peak_flops_per_s: one device's peak bf16 FLOP/s.
        devices: devices of the mesh (the pod's peak is the device's times this).
        devices_per_chip: 2 on v2 / v3 (a device per TensorCore), else 1.
        host_to_chip_bytes_per_s: the infeed's bandwidth (PCIe; ``chip.spec``).
        dispatch_seconds: a host dispatch per step (0: the loop runs on the device).
        overlap: collectives and infeed overlapped with compute (XLA's async
            collectives); False: everything serial.
        ici_link_bandwidth_bytes_per_s: one ICI link's one-way bandwidth.
        tokens_per_example: tokens in one example (sequence models; 0 otherwise).
        maxtext_flops_per_device: a step's training FLOPs per device as MaxText
            counts them today (``maxtext_utils.calculate_tflops_training_per_device``,
            training-steps.md's 2025 formula); 0 for a model MaxText has no formula for.
        maxtext_2023_flops_per_device: the same by MaxText's 2023 formula with the
            causal halving of the attention term (the v5p table's).
        sustained_mxu_fraction: e1 / e0 of the device's chip, the sustained MXU
            budget against a fresh op's rate (:func:`sustained_clocks`); 1: none.
        slice_wait_fraction: what a multislice job waits a step for its slowest
            slice, as a fraction of one slice's step
            (``interconnect.dcn.slice_wait_seconds``); 0 with one slice.
        slice_axis: the mesh axis across slices the wait is charged to (its
            exposed collective time: the slices meet at its reduction).
        prefetch_layers: layers an FSDP all-gather runs ahead, as far as the plan's
            HBM lets it (``DeviceMemory.prefetch_layers``).
    """

    global_batch: int
    model_flops: int | None
    device_peak_flops_per_s: float
    devices: int
    devices_per_chip: int
    host_to_chip_bytes_per_s: float
    dispatch_seconds: float = 0.0
    overlap: bool = True
    ici_link_bandwidth_bytes_per_s: float = 0.0
    tokens_per_example: int = 0
    maxtext_flops_per_device: float = 0.0
    maxtext_2023_flops_per_device: float = 0.0
    sustained_mxu_fraction: float = 1.0
    slice_wait_fraction: float = 0.0
    slice_axis: str = ""
    prefetch_layers: int = 1


def _bounds(report: DeviceReport, start: int, stop: int) -> dict[str, float]:
    """Seconds by what bounds each record, over records [start, stop)."""
    out: dict[str, float] = {}
    for s, b in zip(report.record_seconds[start:stop], report.record_bounds[start:stop],
                    strict=True):
        if b not in (HOST_OUT, HOST_IN):  # beside the compute (host_offload_seconds)
            out[b] = out.get(b, 0.0) + s
    return out


def _slice_wait(clock: StepClock, context: StepContext) -> tuple[float, dict[str, float]]:
    """What a multislice job waits a step for its slowest slice (a share of one slice's
    step, ``StepContext.slice_wait_fraction``), and the clock's exposed seconds by axis
    with it charged to ``context.slice_axis``."""
    wait = context.slice_wait_fraction * clock.step_seconds
    exposed = dict(clock.axis_exposed_seconds)
    if wait > 0:
        exposed[context.slice_axis] = exposed.get(context.slice_axis, 0.0) + wait
    return wait, exposed


def compute_bound_seconds(report: DeviceReport, clock: StepClock,
                          update_start: int) -> dict[str, float]:
    """Seconds of the forward and backward passes (records before ``update_start``) by
    what bounds each record (``report`` as :func:`sustained_clocks` returned it), with
    what the sustained budget added in closed form (``clock``'s compute beyond those
    records) in the MXU-bound seconds."""
    return _with_throttle(_bounds(report, 0, update_start),
                          clock.compute_seconds - sum(report.record_seconds[:update_start]))


def _with_throttle(bounds: dict[str, float], throttle_seconds: float) -> dict[str, float]:
    """``bounds`` with what the sustained budget added in closed form (beyond the
    stretched records: ``sustained_clocks``) in the MXU-bound seconds."""
    if throttle_seconds > 0:
        bounds["mxu"] = bounds.get("mxu", 0.0) + throttle_seconds
    return bounds


def _stage_timelines(reports: Sequence[DeviceReport], clocks: Sequence[StepClock],
                     slowest: DeviceReport) -> tuple[tuple[int, float, tuple], ...]:
    """The slowest device's stage group, stage by stage: (device, step seconds, waits)
    of each member's clock (empty without a stage axis, or a member not reported)."""
    index = {x.device: i for i, x in enumerate(reports)}
    if len(slowest.stage_group) <= 1 or any(d not in index for d in slowest.stage_group):
        return ()
    return tuple((d, clocks[index[d]].step_seconds, clocks[index[d]].waits)
                 for d in slowest.stage_group)


def _dcn_parts(calls: Sequence[Any], costs: Any) -> tuple[dict[str, float], dict[str, int]]:
    """``StepStats``' ``axis_dcn_seconds`` and ``axis_dcn_bytes``: per mesh axis that spans
    slices, the DCN part of a device's collectives (``costs.dcn_seconds`` and
    ``costs.dcn_bytes``; nothing when ``costs`` has no DCN, or in one slice)."""
    seconds: dict[str, float] = {}
    sent: dict[str, int] = {}
    if not hasattr(costs, "dcn_seconds"):
        return seconds, sent
    for call in calls:
        s = costs.dcn_seconds(call.axis, call.op, int(call.nbytes))
        if s > 0:
            seconds[call.axis] = seconds.get(call.axis, 0.0) + s
            sent[call.axis] = sent.get(call.axis, 0) + int(costs.dcn_bytes(call.axis, call.op,
                                                                          int(call.nbytes)))
    return seconds, sent


def _clocked_parts(report: DeviceReport) -> tuple:
    """What of a report the simulated figures of ``combine_device_reports`` depend on:
    all but its loss, its HBM use (``hbm_used_bytes``, ``hbm_peak_bytes``) and its trace."""
    return (report.device, report.record_seconds, report.record_bounds, report.update_start,
            report.calls, report.mxu_flops, report.hbm_capacity_bytes, report.stage_group,
            report.router_loads)


class StatsMemo:
    """The last step's ``StepStats`` of :func:`combine_device_reports`, for a step that
    clocks the same.

    A data-parallel step's reports carry the same records and calls every step (the
    core reuses its op records: ``pod.runtime.device.RecordSummary``), so every
    simulated figure of the step is the step before's: only the step number, the loss,
    the wall time and the HBM use change. A step whose reports' clocked parts
    (``_clocked_parts``), costs and context (the same objects), ``replicate``,
    ``infeed_bytes`` and ``ici_link_bytes`` equal the last one's takes its stats with
    those four replaced (about 1 ms of the quick start driver's step, of
    ``device_clocks``, ``sustained_clocks`` and ``link_bytes``); any other is clocked
    afresh and remembered.
    """

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._held: tuple[Any, Any] | None = None  # (costs, context): compared by identity
        self._stats: Any = None

    def get(self, key: tuple, costs: Any, context: Any) -> Any:
        """The remembered stats for ``key`` (None: another step)."""
        held = self._held
        if held is None or held[0] is not costs or held[1] is not context or key != self._key:
            return None
        return self._stats

    def put(self, key: tuple, costs: Any, context: Any, stats: Any) -> None:
        """Remember ``stats`` for ``key``, ``costs`` and ``context``."""
        self._key, self._held, self._stats = key, (costs, context), stats


def combine_device_reports(step: int, reports: Sequence[DeviceReport], costs: Any,
                           context: StepContext, *, infeed_bytes: int, wall_seconds: float,
                           loss: float | None = None, replicate: int = 1,
                           ici_link_bytes: dict[str, int] | None = None,
                           memo: StatsMemo | None = None):
    """A step's ``StepStats`` from every device's report (or, timing-only, one device
    that stands for ``replicate`` devices).

    The step is the slowest device's clock (:func:`device_clocks`: its records
    and calls, the collectives costed by ``costs.seconds`` over every group of
    their axis at once, a pipeline's stages clocked together), plus the exposed
    infeed (``infeed_bytes`` of the busiest chip over the host link, hidden behind
    the step before with overlap) and the host dispatch.

    Args:
        step: zero-based step number.
        reports: the devices' reports.
        costs: the plan's ``MeshCollectiveCosts`` at this step.
        context: the run's :class:`StepContext`.
        infeed_bytes: bytes of the busiest chip's share of the batch.
        wall_seconds: the step's wall time.
        loss: the global loss (None: the mean of the reports').
        replicate: devices each report stands for.
        ici_link_bytes: the pod's bytes per link (None: computed from the
            slowest device's calls, ``costs.link_bytes``).
        memo: the last step's stats (:class:`StatsMemo`), reused when this step clocks
            the same (the same figures, bit for bit); None: always clocked.

    Returns:
        The ``pod.report.stats.StepStats``.
    """
    step_loss = float(np.mean([x.loss for x in reports]) if loss is None else loss)
    if memo is None:
        return _combine(step, reports, costs, context, infeed_bytes, wall_seconds, step_loss,
                        replicate, ici_link_bytes)
    key = (tuple(map(_clocked_parts, reports)), replicate, infeed_bytes, ici_link_bytes)
    stats = memo.get(key, costs, context)
    if stats is None:
        stats = _combine(step, reports, costs, context, infeed_bytes, wall_seconds, step_loss,
                         replicate, ici_link_bytes)
        memo.put(key, costs, context, stats)
        return stats
    return dataclasses.replace(stats, step=step, loss=step_loss, wall_seconds=wall_seconds,
                               hbm_used_bytes={x.device: x.hbm_used_bytes for x in reports},
                               hbm_peak_bytes={x.device: x.hbm_peak_bytes for x in reports})


def _combine(step: int, reports: Sequence[DeviceReport], costs: Any, context: StepContext,
             infeed_bytes: int, wall_seconds: float, loss: float, replicate: int,
             ici_link_bytes: dict[str, int] | None):
    """``combine_device_reports`` without the memo (``loss``: the step's)."""
    from pod.report.stats import ExpertLoad, StepStats

    clocks, reports = sustained_clocks(reports, costs.seconds, context.sustained_mxu_fraction,
                                       overlap=context.overlap,
                                       prefetch_layers=context.prefetch_layers)
    slow = max(range(len(clocks)), key=lambda i: clocks[i].step_seconds)
    c, r = clocks[slow], reports[slow]
    slice_wait, axis_exposed = _slice_wait(c, context)
    hardware = replicate * int(sum(x.mxu_flops for x in reports))
    infeed = infeed_bytes / context.host_to_chip_bytes_per_s
    exposed_infeed = max(0.0, infeed - c.step_seconds) if context.overlap else infeed
    update_start = len(r.record_seconds) if r.update_start is None else r.update_start
    dcn_seconds, dcn_bytes = _dcn_parts(r.calls, costs)
    per_chip: dict[int, float] = {}
    for x, clock in zip(reports, clocks, strict=False):
        chip = x.device // context.devices_per_chip
        per_chip[chip] = max(per_chip.get(chip, 0.0), clock.compute_seconds)
    return StepStats(
        step=step, loss=loss,
        global_batch=context.global_batch, infeed_seconds=infeed,
        compute_seconds=c.compute_seconds, collective_seconds=c.collective_seconds,
        update_seconds=c.update_seconds,
        model_flops=hardware if context.model_flops is None else int(context.model_flops),
        hardware_flops=hardware,
        peak_flops_per_s=context.device_peak_flops_per_s * context.devices,
        wall_seconds=wall_seconds, tokens_per_example=context.tokens_per_example,
        maxtext_flops_per_device=context.maxtext_flops_per_device,
        maxtext_2023_flops_per_device=context.maxtext_2023_flops_per_device,
        exposed_collective_seconds=c.exposed_seconds + slice_wait,
        exposed_infeed_seconds=exposed_infeed,
        host_offload_seconds=c.host_seconds, exposed_host_offload_seconds=c.exposed_host_seconds,
        dispatch_seconds=context.dispatch_seconds,
        hbm_used_bytes={x.device: x.hbm_used_bytes for x in reports},
        hbm_peak_bytes={x.device: x.hbm_peak_bytes for x in reports},
        hbm_capacity_bytes=r.hbm_capacity_bytes,
        ici_link_bytes=(costs.link_bytes(r.calls) if ici_link_bytes is None else ici_link_bytes),
        ici_link_bandwidth_bytes_per_s=context.ici_link_bandwidth_bytes_per_s,
        device_mxu_flops={x.device: x.mxu_flops for x in reports},
        device_peak_flops_per_s=context.device_peak_flops_per_s,
        chip_compute_seconds=per_chip,
        axis_collective_bytes=dict(c.axis_bytes), axis_collective_seconds=dict(c.axis_seconds),
        axis_exposed_seconds=axis_exposed, traced_device=r.device,
        collective_spans=c.spans, compute_waits=c.waits,
        stage_timelines=_stage_timelines(reports, clocks, r),
        pipeline_bubble_seconds=c.bubble_seconds,
        axis_dcn_seconds=dcn_seconds, axis_dcn_bytes=dcn_bytes,
        compute_bound_seconds=compute_bound_seconds(r, c, update_start),
        update_bound_seconds=_bounds(r, update_start, len(r.record_seconds)),
        expert_load=ExpertLoad.total(x.router_loads for x in reports))

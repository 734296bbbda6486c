"""What a device program asks of the mesh: collectives over one mesh axis.

A device program (``pod.programs``) runs the same code on every
device of a ``{data, fsdp, tensor}`` mesh and exchanges arrays with the other
devices of its *group* along one axis (the devices that differ from it only
in that axis) through a :class:`DeviceCollectives`. The contract:

- Buffers are 1-D float32 arrays; ``nbytes`` is ``x.nbytes`` of the caller's
  input (what the device puts on the ICI, before the schedule splits it).
- ``axis_index(axis)`` is the device's position in its group, in ring order
  (``pod.config.mesh.Mesh.groups(axis)``, ``order="ring"``), and
  ``all_gather`` concatenates the group's pieces in that same order. Any
  fixed order works for the program as long as it is the same in every group
  of the axis, which ``Mesh.groups`` guarantees (each group is a translate of
  the others).
- ``all_gather(axis, x)``: x (n,) -> (size * n,), piece i from position i.
- ``reduce_scatter(axis, x)``: x (size * n,) -> (n,), the sum over the group
  of chunk ``axis_index`` (chunk i = ``x[i*n:(i+1)*n]``).
- ``allreduce(axis, x)``: x (n,) -> (n,), the sum over the group; every
  member gets the same bits (one reduction, then copies, as a ring schedule
  does).
- ``ppermute(axis, x, shift)``: x (n,) -> (n,), the x of the member ``shift``
  positions before this one in ring order (cyclic: position p receives from
  ``(p - shift) mod size``), as ``jax.lax.ppermute`` with ``perm = [(i, (i +
  shift) % size)]``. The pipeline's stage-to-stage transfer. Its call says
  where the device needs what it received (``CollectiveCall.wait_record``;
  :func:`defer_wait` moves it to where the data is used), so the clock
  (``pod.report.clock``) waits for the sender there and not before.
- ``all_to_all(axis, x)``: x (size * n,) -> (size * n,): piece j of x goes to
  position j, piece i of the result comes from position i (a mixture of
  experts' dispatch and combine; its own inverse). ``nbytes`` is the whole
  buffer, as a reduce-scatter's: what leaves the device is (size - 1) / size
  of it.
- An axis of size 1 (or absent) is free: the input comes back unchanged and
  nothing is recorded.
- Every other call appends a :class:`CollectiveCall` to ``calls`` with the
  compute it follows (``after_record`` = ``len(core.records)`` when issued),
  so the runtime can lay collectives and compute on one timeline.

The sums are float32. :class:`LocalMesh` sums in group order
(((x0 + x1) + x2) + ...); a ring schedule sums each chunk in the order it
travels, so two implementations may differ in the last float32 bit.

:class:`CollectivesBase` does the checks, the size-1 rule and the recording;
an implementation only moves bytes (``_exchange``). :class:`LocalMesh` is the
in-process reference: N device programs in N threads meeting at a barrier
per group. :class:`ShapeCollectives` is the timing-only one: every call
recorded, the results read-only zero views of the right size. No Ray.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, cast, runtime_checkable

import numpy as np

__all__ = ["AXES", "COLLECTIVE_KINDS", "COLLECTIVE_OPS", "CollectiveKind", "CollectiveCall",
           "DeviceCollectives", "CollectivesBase", "LocalMesh", "LocalMeshCollectives",
           "ShapeCollectives", "sum_in_order", "defer_wait"]

AXES = ("data", "stage", "fsdp", "expert", "tensor")
"""Mesh axes, outermost first (as ``pod.config.mesh.AXIS_NAMES``; MaxText's order:
data, stage (pipeline), fsdp, expert, tensor)."""

CollectiveKind = Literal["param_gather", "grad_reduce", "activation"]
COLLECTIVE_KINDS: tuple[str, ...] = ("param_gather", "grad_reduce", "activation")
"""param_gather: FSDP weights (XLA prefetches them one layer ahead);
grad_reduce: gradients (they overlap the rest of the backward pass);
activation: tensor-parallel activations (the next op waits for them)."""

COLLECTIVE_OPS = ("all_gather", "reduce_scatter", "allreduce", "ppermute", "all_to_all")


@dataclass(frozen=True)
class CollectiveCall:
    """One collective a device program issued (for timing and observability).

    Attributes:
        axis: the mesh axis (``AXES``).
        op: "all_gather", "reduce_scatter", "allreduce" or "all_to_all".
        nbytes: bytes of this device's input buffer in the dtype that moves
            (``itemsize`` bytes per element, e.g. 2 for bf16 parameters and
            activations as XLA moves them): n * itemsize for an all-gather of
            (n,) or an allreduce of (n,); size * n * itemsize for a
            reduce-scatter or an all-to-all of (size * n,). The buffers the emulation exchanges
            are float32 whatever the wire dtype (rounding to bf16 and back is
            elementwise, so a gather of rounded values is the rounding of a
            gather); the clock costs the wire bytes.
        tag: what moved, e.g. "block1 fwd" (FSDP gather of a layer) or
            "block1/attention fwd" (tensor-parallel allreduce).
        kind: see :data:`COLLECTIVE_KINDS`.
        after_record: ``len(core.records)`` when issued: the collective
            follows the compute recorded before that index.
        overlap_before: records before ``after_record`` it may run beside
            (collective matmul: decomposed into the matmul that produces it).
        overlap_after: records after it that may run before the compute waits
            for it (collective matmul: the matmul that consumes it).
        shift: ppermute only: positions (ring order) each buffer moves; 0 for
            the other ops.
        wait_record: ppermute only: the record before which this device waits
            for the piece it received (``after_record`` when it is used at
            once; later when :func:`defer_wait` moved it), or None when the
            piece carries nothing the device uses (the pipeline's idle
            stages send zeros): then nothing waits for it.
    """

    axis: str
    op: str
    nbytes: int
    tag: str
    kind: str
    after_record: int
    overlap_before: int = 0
    overlap_after: int = 0
    shift: int = 0
    wait_record: int | None = None


def defer_wait(calls: list[CollectiveCall], index: int | None, record: int) -> None:
    """Move the wait of ppermute call ``calls[index]`` to record ``record``: the device
    uses what it received only from there on (the pipeline keeps a stage's input
    until the tick it runs that microbatch). ``index`` None (no call was recorded: an
    axis of size 1) does nothing.

    Raises:
        ValueError: not a ppermute, or a record before the call.
    """
    if index is None:
        return
    call = calls[index]
    if call.op != "ppermute" or record < call.after_record:
        raise ValueError(f"defer_wait: call {index} ({call.op} {call.tag!r}, after record "
                         f"{call.after_record}) cannot wait at record {record}")
    calls[index] = dataclasses.replace(call, wait_record=int(record))


@runtime_checkable
class DeviceCollectives(Protocol):
    """One device's view of the mesh (the module docstring is the contract)."""

    calls: list[CollectiveCall]

    def axis_size(self, axis: str) -> int:
        """Devices along ``axis`` (1 for an axis the mesh does not have)."""

    def axis_index(self, axis: str) -> int:
        """This device's position in its group along ``axis``, ring order, 0 .. size-1."""

    def all_gather(self, axis: str, x: np.ndarray, *, tag: str, kind: str,
                   after_record: int, **wire: int) -> np.ndarray:
        """x (n,) float32 -> (size * n,): every member's x in group order."""

    def reduce_scatter(self, axis: str, x: np.ndarray, *, tag: str, kind: str,
                       after_record: int, **wire: int) -> np.ndarray:
        """x (size * n,) float32 -> (n,): the group's sum of chunk ``axis_index``."""

    def allreduce(self, axis: str, x: np.ndarray, *, tag: str, kind: str,
                  after_record: int, **wire: int) -> np.ndarray:
        """x (n,) float32 -> (n,): the group's sum."""

    def ppermute(self, axis: str, x: np.ndarray, shift: int, *, tag: str, kind: str,
                 after_record: int, used: bool = True, **wire: int) -> np.ndarray:
        """x (n,) float32 -> (n,): the x of the member ``shift`` positions before."""

    def align(self, point: int) -> None:
        """A point every device of the mesh reaches in the same order (a pipeline tick):
        the collectives after it are numbered from it (XLA's channel ids), so that
        devices that issued different numbers of collectives before (stages of a
        pipeline) agree on the next one's. Nothing in process."""

    def all_to_all(self, axis: str, x: np.ndarray, *, tag: str, kind: str,
                   after_record: int, **wire: int) -> np.ndarray:
        """x (size * n,) float32 -> (size * n,): piece j to position j, piece i from i."""


def sum_in_order(parts: Sequence[np.ndarray]) -> np.ndarray:
    """(((p0 + p1) + p2) + ...) in float32, a new array (the reference reduction order)."""
    out = np.array(parts[0], dtype=np.float32, copy=True)
    for p in parts[1:]:
        out += p
    return out


class CollectivesBase:
    """Checks, the size-1 rule and the call record; subclasses move the bytes.

    Args:
        sizes: axis name -> size (missing axes are 1), names from :data:`AXES`.
        index: axis name -> this device's position in its group (ring order).

    Raises:
        ValueError: an unknown axis, a size < 1 or an index out of range.

    Subclasses implement ``_exchange(axis, op, x) -> np.ndarray`` for axes of
    size > 1, ``x`` already checked (1-D float32, divisible for reduce-scatter).
    """

    def __init__(self, sizes: Mapping[str, int], index: Mapping[str, int]):
        for name in (*sizes, *index):
            if name not in AXES:
                raise ValueError(f"mesh axis {name!r} is unknown; allowed: {', '.join(AXES)}")
        self._sizes = {a: int(sizes.get(a, 1)) for a in AXES}
        self._index = {a: int(index.get(a, 0)) for a in AXES}
        for a in AXES:
            if self._sizes[a] < 1 or not 0 <= self._index[a] < self._sizes[a]:
                raise ValueError(f"mesh axis {a}: index {self._index[a]} is not in "
                                 f"[0, {self._sizes[a]})")
        self.calls: list[CollectiveCall] = []

    def axis_size(self, axis: str) -> int:
        """Devices along ``axis`` (1 when the mesh does not have it)."""
        return self._sizes[self._axis(axis)]

    def take_calls(self) -> list[CollectiveCall]:
        """The calls since the last take, and forget them (as ``TensorCore.take_records``;
        take both at the same points so that ``after_record`` indexes the records taken)."""
        calls, self.calls = self.calls, []
        return calls

    def axis_index(self, axis: str) -> int:
        """Position in the group along ``axis``, ring order."""
        return self._index[self._axis(axis)]

    def _axis(self, axis: str) -> str:
        if axis not in AXES:
            raise ValueError(f"mesh axis {axis!r} is unknown; allowed: {', '.join(AXES)}")
        return axis

    def _call(self, op: str, axis: str, x, tag: str, kind: str, after_record: int,
              itemsize: int = 4, overlap_before: int = 0, overlap_after: int = 0,
              shift: int = 0) -> np.ndarray:
        size = self.axis_size(axis)
        if kind not in COLLECTIVE_KINDS:
            raise ValueError(f"collective kind {kind!r} is unknown; allowed: "
                             f"{', '.join(COLLECTIVE_KINDS)}")
        x = np.asarray(x)
        if x.ndim != 1 or x.dtype != np.float32:
            raise ValueError(f"{op} {tag!r} over {axis}: needs a 1-D float32 buffer, got "
                             f"{x.dtype} {x.shape}")
        if op in ("reduce_scatter", "all_to_all") and x.size % size:
            raise ValueError(f"{op} {tag!r} over {axis}: {x.size} elements do not "
                             f"split into {size} equal chunks")
        if size == 1:
            return x
        wait = int(after_record) if op == "ppermute" else None
        self.calls.append(CollectiveCall(axis, op, int(x.size) * int(itemsize), tag, kind,
                                         int(after_record), int(overlap_before),
                                         int(overlap_after), int(shift), wait))
        if op == "ppermute":
            return self._permute(axis, x, int(shift))
        return self._exchange(axis, op, x)

    def all_gather(self, axis: str, x: np.ndarray, *, tag: str, kind: str, after_record: int,
                   **wire: int) -> np.ndarray:
        """x (n,) float32 -> (size * n,): every member's x, in group (ring) order.
        ``wire``: ``itemsize``, ``overlap_before``, ``overlap_after`` of the recorded call
        (``CollectiveCall``)."""
        return self._call("all_gather", axis, x, tag, kind, after_record, **wire)

    def reduce_scatter(self, axis: str, x: np.ndarray, *, tag: str, kind: str, after_record: int,
                       **wire: int) -> np.ndarray:
        """x (size * n,) float32 -> (n,): the group's float32 sum of chunk ``axis_index``.
        ``wire``: ``itemsize``, ``overlap_before``, ``overlap_after`` of the recorded call
        (``CollectiveCall``)."""
        return self._call("reduce_scatter", axis, x, tag, kind, after_record, **wire)

    def allreduce(self, axis: str, x: np.ndarray, *, tag: str, kind: str, after_record: int,
                  **wire: int) -> np.ndarray:
        """x (n,) float32 -> (n,): the group's float32 sum, the same bits on every member.
        ``wire``: ``itemsize``, ``overlap_before``, ``overlap_after`` of the recorded call
        (``CollectiveCall``)."""
        return self._call("allreduce", axis, x, tag, kind, after_record, **wire)

    def ppermute(self, axis: str, x: np.ndarray, shift: int, *, tag: str, kind: str,
                 after_record: int, used: bool = True, **wire: int) -> np.ndarray:
        """x (n,) float32 -> (n,): the x of the member ``shift`` positions before this one
        in ring order (cyclic), as ``jax.lax.ppermute``. ``used``: this device uses what
        it receives (the call's ``wait_record`` is ``after_record``; :func:`defer_wait`
        moves it); False: it does not (no wait). ``wire``: ``itemsize`` of the recorded
        call. On an axis of size 1 x comes back (a shift of a one-device ring).

        Raises:
            ValueError: a shift that is not an int, or a bad buffer (as every call).
        """
        if isinstance(shift, bool) or not isinstance(shift, (int, np.integer)):
            raise ValueError(f"ppermute {tag!r} over {axis}: shift {shift!r} is not an int")
        count = len(self.calls)
        out = self._call("ppermute", axis, x, tag, kind, after_record, shift=int(shift), **wire)
        if not used and len(self.calls) > count:  # nothing waits for what it received
            self.calls[-1] = dataclasses.replace(self.calls[-1], wait_record=None)
        return out

    def align(self, point: int) -> None:
        """A point every device reaches in the same order (``DeviceCollectives.align``);
        only a transport that numbers its runs needs it: nothing here."""

    def all_to_all(self, axis: str, x: np.ndarray, *, tag: str, kind: str, after_record: int,
                   **wire: int) -> np.ndarray:
        """x (size * n,) float32 -> (size * n,): piece j of x to position j, piece i of the
        result from position i. ``wire`` as :meth:`all_gather`."""
        return self._call("all_to_all", axis, x, tag, kind, after_record, **wire)

    def _exchange(self, axis: str, op: str, x: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _permute(self, axis: str, x: np.ndarray, shift: int) -> np.ndarray:
        """The ppermute's exchange (axis of size > 1): the piece from position
        ``(index - shift) mod size``."""
        raise NotImplementedError


class ShapeCollectives(CollectivesBase):
    """Timing-only collectives: every call is checked and recorded as a functional
    transport records it (so the clock costs it the same); the results are
    read-only zero views of the right size (``timing_zeros``: no memory for a
    gathered layer or a summed activation).

    Args:
        sizes: axis name -> size; index: axis name -> this device's position
            (as :class:`CollectivesBase`).
        tape: a ``pod.programs.replay.LayerTape`` the program replays its layers' passes
            from (None: every pass runs op by op).
    """

    def __init__(self, sizes: Mapping[str, int], index: Mapping[str, int], *,
                 tape: Any = None) -> None:
        super().__init__(sizes, index)
        self.tape = tape

    def _exchange(self, axis: str, op: str, x: np.ndarray) -> np.ndarray:
        from pod.workloads.layers import timing_zeros

        size = self.axis_size(axis)
        n = {"all_gather": x.size * size, "reduce_scatter": x.size // size}.get(op, x.size)
        return timing_zeros((n,), np.float32)

    def _permute(self, axis: str, x: np.ndarray, shift: int) -> np.ndarray:
        from pod.workloads.layers import timing_zeros

        return timing_zeros((x.size,), np.float32)


class _Exchange:
    """One group's meeting point: every member posts, waits for the others, reads.

    Two sets of slots, used in turn, make one barrier per exchange enough: a
    member posting its exchange k + 2 into the set of exchange k has passed
    the barrier of k + 1, which every member reaches only after reading k.
    """

    def __init__(self, size: int, timeout_seconds: float):
        self.slots: list[list[np.ndarray | None]] = [[None] * size, [None] * size]
        self.count = [0] * size          # exchanges each member has made
        self.barrier = threading.Barrier(size, timeout=timeout_seconds)

    def swap(self, position: int, x: np.ndarray) -> list[np.ndarray]:
        slots = self.slots[self.count[position] % 2]
        self.count[position] += 1
        slots[position] = x
        self.barrier.wait()              # everyone has posted
        return cast(list[np.ndarray], list(slots))  # no slot left None: everyone has posted


class LocalMeshCollectives(CollectivesBase):
    """One device of a :class:`LocalMesh` (made by it, not directly)."""

    def __init__(self, mesh: LocalMesh, device: int):
        self.mesh = mesh
        self.device = device
        self.coords = mesh.coords(device)
        super().__init__(mesh.sizes, {a: mesh.ring_position(a, self.coords[a]) for a in AXES})

    def _exchange(self, axis: str, op: str, x: np.ndarray) -> np.ndarray:
        parts = self.mesh.exchange(axis, self.coords).swap(self.axis_index(axis), x)
        if op == "all_gather":
            return np.concatenate(parts)
        if op == "allreduce":
            return sum_in_order(parts)
        n = x.size // len(parts)
        i = self.axis_index(axis)
        if op == "all_to_all":
            return np.concatenate([p[i * n:(i + 1) * n] for p in parts])
        return sum_in_order([p[i * n:(i + 1) * n] for p in parts])

    def _permute(self, axis: str, x: np.ndarray, shift: int) -> np.ndarray:
        parts = self.mesh.exchange(axis, self.coords).swap(self.axis_index(axis), x)
        source = parts[(self.axis_index(axis) - shift) % len(parts)]
        if source.size != x.size:
            raise ValueError(f"ppermute over {axis}: {x.size} elements here, {source.size} "
                             "from the source (every member must pass the same size)")
        return np.array(source, dtype=np.float32, copy=True)


class LocalMesh:
    """An in-process mesh: the reference the runtime's ICI collectives are checked against.

    Devices are numbered row-major over the mesh coordinates (data, fsdp,
    tensor), tensor fastest. A device's position in its group along an axis
    is its coordinate's place in ``rings[axis]`` (default: the identity, so
    position = coordinate).

    Args:
        sizes: axis name -> size >= 1 (missing axes are 1).
        rings: axis name -> a permutation of range(size), the ring order, e.g.
            ``{a.name: a.ring for a in mesh.axes}`` of a ``pod.config.mesh.Mesh``.
        timeout_seconds: wall seconds a device waits for its group before the
            run fails (a program that skipped a collective would hang).

    Raises:
        ValueError: an unknown axis, a size < 1, or a ring that is not a permutation.
    """

    def __init__(self, sizes: Mapping[str, int], rings: Mapping[str, Sequence[int]] | None = None,
                 timeout_seconds: float = 120.0):
        probe = CollectivesBase(sizes, {})
        self.sizes = {a: probe.axis_size(a) for a in AXES}
        self.rings = {a: tuple(range(self.sizes[a])) for a in AXES}
        for a, ring in (rings or {}).items():
            if a not in AXES or sorted(ring) != list(range(self.sizes[a])):
                raise ValueError(f"ring of mesh axis {a!r} must be a permutation of "
                                 f"range({self.sizes.get(a, 1)}), got {tuple(ring)}")
            self.rings[a] = tuple(int(i) for i in ring)
        self.timeout_seconds = float(timeout_seconds)
        self._exchanges: dict[tuple, _Exchange] = {}
        self._lock = threading.Lock()
        self.devices = [LocalMeshCollectives(self, d) for d in range(self.size)]

    @classmethod
    def for_mesh(cls, mesh, timeout_seconds: float = 120.0) -> LocalMesh:
        """The LocalMesh of a ``pod.config.mesh.Mesh``: its sizes and ring orders.
        LocalMesh device d has mesh coordinates ``coords(d)``, i.e. it stands for
        the pod's device ``mesh.devices[coords]``; its positions are the pod's."""
        return cls(mesh.sizes, rings={a.name: a.ring for a in mesh.axes},
                   timeout_seconds=timeout_seconds)

    @property
    def size(self) -> int:
        """Number of devices."""
        return math.prod(self.sizes.values())

    def coords(self, device: int) -> dict[str, int]:
        """Mesh coordinates {axis: index} of a device number (row-major, tensor fastest)."""
        index = np.unravel_index(int(device), [self.sizes[a] for a in AXES])
        return {a: int(i) for a, i in zip(AXES, index, strict=True)}

    def ring_position(self, axis: str, coordinate: int) -> int:
        """Position in ring order of mesh coordinate ``coordinate`` along ``axis``."""
        return self.rings[axis].index(int(coordinate))

    def exchange(self, axis: str, coords: Mapping[str, int]) -> _Exchange:
        """The meeting point of the group along ``axis`` through ``coords``."""
        key = (axis, *(int(coords[a]) for a in AXES if a != axis))
        with self._lock:
            if key not in self._exchanges:
                self._exchanges[key] = _Exchange(self.sizes[axis], self.timeout_seconds)
            return self._exchanges[key]

    def run(self, program: Callable[[LocalMeshCollectives], object]) -> list:
        """Runs ``program(comm)`` on every device at once, one thread each.

        Returns:
            The results, by device number.

        Raises:
            The first exception a device raised (the others are released from
            their barriers and their ``BrokenBarrierError`` is not reported).
        """
        self._exchanges = {}  # fresh barriers (a failed run leaves its own broken)
        results: list = [None] * self.size
        errors: list[tuple[int, BaseException]] = []

        def body(d: int) -> None:
            try:
                results[d] = program(self.devices[d])
            except BaseException as err:  # noqa: BLE001 - re-raised by the caller below
                errors.append((d, err))
                with self._lock:
                    for ex in self._exchanges.values():
                        ex.barrier.abort()

        threads = [threading.Thread(target=body, args=(d,), name=f"device{d}")
                   for d in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            first = [e for e in errors if not isinstance(e[1], threading.BrokenBarrierError)]
            raise (first or errors)[0][1]
        return results

    def groups(self, axis: str) -> list[tuple[int, ...]]:
        """Device numbers of every group along ``axis``, each in ring order."""
        others = [a for a in AXES if a != axis]
        out = []
        for rest in itertools.product(*(range(self.sizes[a]) for a in others)):
            coords = dict(zip(others, rest, strict=True))
            out.append(tuple(int(np.ravel_multi_index(
                [coords.get(a, c) if a != axis else c for a in AXES],
                [self.sizes[a] for a in AXES])) for c in self.rings[axis]))
        return out

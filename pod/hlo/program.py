"""An HLO module as the sequence of things one device runs in a step.

The entry computation of a scheduled module lists its instructions in the
order the TPU runs them. :func:`flatten` walks it and turns it into events:

- a kernel (:class:`OpEvent`): any op that computes or moves data on the
  TensorCore (costed by ``pod.hlo.ops``);
- a collective's start and done (:class:`StartEvent`, :class:`DoneEvent`): an
  async pair (``all-gather-start`` / ``all-gather-done``, ``async-start`` /
  ``async-done`` wrapping a reduce-scatter or all-to-all,
  ``collective-permute-start`` / ``-done``, and XLA TPU's async collective
  fusions, whose start and done fusions end in ``AsyncCollectiveStart`` /
  ``AsyncCollectiveDone``: the compute fusions between them carry the
  collective's continuation and are costed for their compute only) is its own
  window; a synchronous collective starts and is done at once; the asynchronous
  copies of a TPU (``copy-start`` / ``copy-done``, ``slice-start`` /
  ``slice-done``, ``dynamic-slice-start`` / ``-done``: DMAs between HBM, VMEM and
  host memory) are windows too, on a DMA lane, except a cross-program prefetch
  (``cross_program_prefetch_index``: XLA copies it while the step before runs),
  which costs nothing;
- a SparseCore offload (libtpu 0.0.50's gathers: a ``call-start`` on
  ``async_execution_thread="sparsecore"``, its operands given by ``call-update``,
  waited for at ``call-done``) is a window too, opened where it is given its operands
  (the ``call-update``: libtpu's ``call-start()`` takes none; it cannot gather before the
  table and indices are made) and on a lane of its own: op
  "sparsecore", its bytes the HBM traffic of the offloaded computation
  (``pod.hlo.ops.sparsecore_work``), or XLA's ``estimated_cycles`` where the call has
  them; with neither (an op the bound from bytes does not cover) it is refused.

``while`` loops are unrolled: the body's events repeated by the trip count
(XLA's ``known_trip_count``, else read off a counted loop: an induction
variable started at a constant, stepped by a constant and compared with one);
``call`` is inlined; a ``conditional`` runs its largest branch (named in the
notes). A loop whose count cannot be read is refused, never counted once.

A module compiled for CPU devices has synchronous collectives only (no
latency-hiding scheduler ran for a TPU); with ``approximate`` each collective's
window is instead the one XLA's scheduler aims at on a TPU: it starts once its
operands are made and is waited for where its result is first used.

Pure: no jax, no ray.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field

from pod.errors import HloError, HloOpError, HloParseError
from pod.hlo.groups import OPS, Groups, parse_pairs, parse_replica_groups
from pod.hlo.module import HloComputation, HloInstruction, HloModule
from pod.hlo.ops import COLLECTIVE_OPCODES, FREE, short_name, sparsecore_work

__all__ = ["OpEvent", "StartEvent", "DoneEvent", "CollectiveInfo", "Program", "flatten",
           "trip_count", "collective_info", "offload_info", "MAX_EVENTS"]

#: The most events a step may unroll to (loops of loops of huge trip counts are refused).
MAX_EVENTS = 5_000_000


@dataclass(frozen=True)
class CollectiveInfo:
    """One collective (or DMA) as the clock needs it.

    Attributes:
        instr: the HLO instruction that starts it (what the trace names).
        op: the emulator's op (all_gather, reduce_scatter, allreduce, all_to_all,
            ppermute), "dma" (an async copy) or "sparsecore" (an offload to the
            SparseCore).
        groups: its replica groups (device ids as the module writes them), or the
            (source, target) pairs of a permute; () for a DMA.
        nbytes: each device's buffer (an all-gather's gathered result, a DMA's
            copied bytes, the HBM bytes a SparseCore offload reads and writes).
        itemsize: bytes per element of what moves.
        form: "async", "sync", "async collective fusion", "window (approximate)", "dma",
            "sparsecore offload".
        memory_spaces: a DMA's (source, destination) memory spaces.
        source: the defining collective's instruction.
        role: in a CPU-compiled module, "param_gather" (an all-gather of weights: sliced
            from the step's parameters), "grad_reduce" (a reduction no matmul of the step
            reads: gradients) or "" (activations), for the project's overlap rules
            (``pod.report.clock``).
        xla_cycles: a SparseCore offload's ``estimated_cycles`` as XLA gave them (on the
            call, else the sum over its kernels when each has one), None without.
    """

    instr: HloInstruction
    op: str
    groups: Groups
    nbytes: int
    itemsize: int
    form: str
    memory_spaces: tuple[int, int] = (0, 0)
    source: HloInstruction | None = None
    role: str = ""
    xla_cycles: int | None = None


@dataclass(frozen=True)
class OpEvent:
    """A kernel the compute stream runs."""

    comp: HloComputation
    instr: HloInstruction


@dataclass(frozen=True)
class StartEvent:
    """A collective (or DMA) window opens; ``key`` matches its :class:`DoneEvent`."""

    key: int
    info: CollectiveInfo


@dataclass(frozen=True)
class DoneEvent:
    """The compute stream waits for window ``key`` here."""

    key: int


@dataclass
class Program:
    """A device's step as events (module docstring).

    Attributes:
        events: in the order run.
        trip_counts: while loop name -> its trip count.
        notes: what was assumed (a conditional's branch, a window without its
            start or done), for the report.
    """

    events: list[OpEvent | StartEvent | DoneEvent] = field(default_factory=list)
    trip_counts: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


#: The TPU's asynchronous copies: DMAs between HBM, VMEM and host memory.
_DMA_STARTS = ("copy-start", "slice-start", "dynamic-slice-start", "dynamic-update-slice-start")


def _const(comp: HloComputation, name: str) -> int | None:
    """The integer a name holds if it is a constant (through copies, converts, bitcasts)."""
    instr = comp.by_name.get(name)
    while instr is not None and instr.opcode in ("copy", "convert", "bitcast", "reshape"):
        instr = comp.by_name.get(instr.operands[0])
    if instr is None or instr.opcode != "constant":
        return None
    match = re.fullmatch(r"\s*(-?\d+)\s*", instr.literal)
    return int(match.group(1)) if match else None


def _tuple_index(comp: HloComputation, name: str, param: str) -> int | None:
    """i when ``name`` is ``get-tuple-element(param), index=i`` (through copies)."""
    instr = comp.by_name.get(name)
    while instr is not None and instr.opcode in ("copy", "convert", "bitcast", "reshape"):
        instr = comp.by_name.get(instr.operands[0])
    if instr is None or instr.opcode != "get-tuple-element" or instr.operands[0] != param:
        return None
    return instr.int_list("index")[0]


def trip_count(module: HloModule, comp: HloComputation, loop: HloInstruction) -> int:
    """How many times a ``while`` runs its body.

    XLA's ``known_trip_count`` when recorded; else a counted loop: the condition
    compares tuple element i (a constant c1 at the start, ``+ s`` per iteration in
    the body) with a constant c2 (``LT``, ``LE``, ``GT``, ``GE``, ``NE``).

    Raises:
        HloError: neither (the loop is named with its line).
    """
    known = loop.known_trip_count
    if known is not None:
        return known
    cond = module.computations[loop.attr_names("condition")[0]]
    body = module.computations[loop.attr_names("body")[0]]
    root = cond.root
    fail = HloError(f"line {loop.line}: while {loop.name!r}: its trip count is not recorded "
                    "(known_trip_count) and it is not a counted loop; the step cannot be costed")
    if root.opcode != "compare" or len(root.operands) != 2:
        raise fail
    param = next((i.name for i in cond.instructions if i.opcode == "parameter"), "")
    a, b = root.operands
    direction = root.attrs.get("direction", "")
    index, limit = _tuple_index(cond, a, param), _const(cond, b)
    if index is None:
        index, limit = _tuple_index(cond, b, param), _const(cond, a)
        direction = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE"}.get(direction, direction)
    init_tuple = comp.by_name.get(loop.operands[0])
    if index is None or limit is None or init_tuple is None or init_tuple.opcode != "tuple":
        raise fail
    start = _const(comp, init_tuple.operands[index])
    body_param = next((i.name for i in body.instructions if i.opcode == "parameter"), "")
    step_instr = body.by_name.get(body.root.operands[index]) if body.root.opcode == "tuple" \
        else None
    step = None
    if step_instr is not None and step_instr.opcode in ("add", "subtract"):
        x, y = step_instr.operands
        if _tuple_index(body, x, body_param) == index:
            step = _const(body, y)
        elif _tuple_index(body, y, body_param) == index and step_instr.opcode == "add":
            step = _const(body, x)
        if step is not None and step_instr.opcode == "subtract":
            step = -step
    if start is None or not step:
        raise fail
    span = {"LT": limit - start, "LE": limit - start + 1, "NE": limit - start,
            "GT": start - limit, "GE": start - limit + 1}.get(direction)
    if span is None:
        raise fail
    step = abs(step)
    return max(0, -(-span // step))


def _defining(module: HloModule, comp: HloComputation,
              instr: HloInstruction) -> tuple[HloComputation, HloInstruction] | None:
    """The collective inside ``instr`` (itself, or within the computation it calls)."""
    base = instr.opcode.removesuffix("-start")
    if base in COLLECTIVE_OPCODES:
        return comp, instr
    for name in instr.called:
        inner = module.computations[name]
        for i in inner.instructions:
            found = _defining(module, inner, i)
            if found is not None:
                return found
    return None


def collective_info(module: HloModule, comp: HloComputation, instr: HloInstruction,
                    form: str) -> CollectiveInfo:
    """What ``instr`` moves: its op, groups and bytes (``CollectiveInfo``).

    Raises:
        HloParseError: replica groups or pairs that do not parse (with the line).
    """
    found = _defining(module, comp, instr)
    if found is None:
        raise HloError(f"line {instr.line}: {instr.name!r} is not a collective")
    where, coll = found
    base = coll.opcode.removesuffix("-start")
    op = OPS[base]
    shapes = {i.name: i.shape for i in where.instructions}
    ins = [shapes[o] for o in coll.operands if o in shapes]
    in_bytes = sum(s.nbytes for s in ins)
    try:
        if op == "ppermute":
            groups: Groups = parse_pairs(coll.attrs.get("source_target_pairs", "{}"))
        else:
            groups = parse_replica_groups(coll.attrs.get("replica_groups", ""), module.devices)
    except ValueError as err:
        raise HloParseError(coll.line, f"{coll.name}: {err}") from None
    if op == "all_gather":
        leaves = coll.shape.leaves
        outs = leaves[len(ins):] if coll.opcode.endswith("-start") and len(leaves) > len(ins) \
            else leaves
        nbytes = sum(a.nbytes for a in outs)
    else:
        nbytes = in_bytes
    if op == "allreduce" and (_is_reduce_scatter(module, instr) or (
            form == "window (approximate)" and groups
            and _scattered(module, where, coll, len(groups[0])))):
        op = "reduce_scatter"
    first = (ins[0].array if ins else coll.shape.array)
    itemsize = max(1, int(round(first.itemsize)))
    role = ""
    if form == "window (approximate)":
        if first.dtype == "f32" and _from_bf16(module, where, coll):
            nbytes, itemsize = nbytes // 2, 2  # the CPU promoted bf16 data to float32
        if op == "all_gather" and all(_from_parameters(module, comp, o) for o in instr.operands):
            role = "param_gather"
        elif op in ("reduce_scatter", "allreduce") and not _feeds_mxu(module, comp, instr.name):
            role = "grad_reduce"
    return CollectiveInfo(instr, op, groups, int(nbytes), itemsize, form, source=coll,
                          role=role)


_MOVES = frozenset({"bitcast", "reshape", "copy", "convert", "dynamic-slice", "slice",
                    "transpose", "get-tuple-element", "broadcast"})


def _moves_only(module: HloModule, instr: HloInstruction) -> bool:
    """A fusion of data movement alone (slices, converts, layout changes)."""
    return instr.opcode == "fusion" and all(
        i.opcode in FREE | _MOVES for c in instr.called
        for i in module.computations[c].instructions)


def _from_parameters(module: HloModule, comp: HloComputation, name: str) -> bool:
    """``name`` is a computation parameter moved about (sliced, converted, relaid): the
    step's weights, not an activation it computed."""
    seen: set[str] = set()
    frontier = [name]
    while frontier:
        instr = comp.by_name.get(frontier.pop())
        if instr is None or instr.name in seen:
            continue
        seen.add(instr.name)
        if instr.opcode == "parameter":
            continue
        if instr.opcode not in _MOVES and not _moves_only(module, instr) \
                and instr.opcode != "constant":
            return False
        frontier.extend(o for o in instr.operands)
    return True


def _feeds_mxu(module: HloModule, comp: HloComputation, name: str) -> bool:
    """Some matmul of ``comp`` reads ``name`` (through data movement)."""
    users = comp.users()
    frontier, seen = [name], set()
    while frontier:
        for user in users.get(frontier.pop(), []):
            if user.name in seen:
                continue
            seen.add(user.name)
            if user.opcode in ("dot", "convolution") or (user.opcode == "fusion" and any(
                    i.opcode in ("dot", "convolution") for c in user.called
                    for i in module.computations[c].instructions)):
                return True
            if user.opcode in _MOVES or _moves_only(module, user):
                frontier.append(user.name)
    return False


def _from_bf16(module: HloModule, comp: HloComputation, coll: HloInstruction) -> bool:
    """A CPU-compiled collective of float32 data that was bf16 before the CPU promoted it
    (XLA's CPU has no bf16 arithmetic): a reducer XLA marks ``_promoted``, or an
    operand converted from bf16 (a convert, or a fusion holding one)."""
    if "_promoted" in coll.attrs.get("to_apply", ""):
        return True
    for name in coll.operands:
        producer = comp.by_name.get(name)
        if producer is None:
            continue
        inner = ([i for c in producer.called for i in module.computations[c].instructions]
                 if producer.opcode == "fusion" else [producer])
        scope = {i.name: i for i in inner} | comp.by_name
        for instr in inner:
            if instr.opcode == "convert" and instr.operands and instr.operands[0] in scope and \
                    scope[instr.operands[0]].shape.array.dtype == "bf16":
                return True
    return False


_PASS = ("get-tuple-element", "bitcast", "reshape", "convert", "copy")


def _slices_to_part(comp: HloComputation, name: str, size: int) -> bool:
    """Every use of ``name`` in ``comp`` (through converts and reshapes) is a
    dynamic-slice to 1 / ``size`` of it."""
    users = comp.users().get(name, [])
    if not users:
        return False
    for user in users:
        if user.opcode in _PASS:
            if not _slices_to_part(comp, user.name, size):
                return False
        elif user.opcode != "dynamic-slice" or user.shape.elements * size != \
                comp.by_name[name].shape.elements:
            return False
    return True


def _scattered(module: HloModule, comp: HloComputation, coll: HloInstruction, size: int) -> bool:
    """A CPU-compiled all-reduce whose result each device only slices to its part: what
    XLA's TPU pipeline turns into a reduce-scatter (``ReduceScatterCreator``). Its
    users are followed through tuple reads, converts and convert-only fusions, into
    the fusions that slice it."""
    frontier, seen = [coll.name], set()
    users = comp.users()
    while frontier:
        name = frontier.pop()
        for user in users.get(name, []):
            if user.name in seen:
                continue
            seen.add(user.name)
            if user.opcode in _PASS:
                frontier.append(user.name)
            elif user.opcode == "dynamic-slice":
                if user.shape.elements * size != comp.by_name[name].shape.elements:
                    return False
            elif user.opcode == "fusion":
                inner = module.computations[user.called[0]]
                if all(i.opcode in FREE | {"convert", "copy"} for i in inner.instructions):
                    frontier.append(user.name)
                    continue
                for index, operand in enumerate(user.operands):
                    param = inner.parameter(index) if operand == name else None
                    if param is not None and not _slices_to_part(inner, param.name, size):
                        return False
            else:
                return False
    return bool(seen)


def _is_reduce_scatter(module: HloModule, instr: HloInstruction) -> bool:
    """XLA TPU's reduce-scatter fusion: an all-reduce whose result the fusion slices to
    this device's part (``all-reduce-scatter`` computations)."""
    if instr.opcode != "fusion":
        return False
    comp = module.computations[instr.called[0]]
    coll = next((i for i in comp.instructions if i.opcode == "all-reduce"), None)
    return coll is not None and instr.shape.nbytes < coll.shape.nbytes


def _fusion_role(module: HloModule, instr: HloInstruction) -> str:
    """A fusion's role: "start" / "done" of an async collective fusion, "collective" (a
    collective alone, run at once), "continuation" (compute carrying a collective's
    progress), or "" (plain compute)."""
    comp = module.computations[instr.called[0]]
    target = comp.root.attrs.get("custom_call_target", "").strip('"')
    if target == "AsyncCollectiveStart":
        return "start"
    if target == "AsyncCollectiveDone":
        return "done"
    if _defining(module, comp, comp.root) is None and not any(
            i.opcode.removesuffix("-start") in COLLECTIVE_OPCODES for i in comp.instructions):
        return ""
    compute = [i for i in comp.instructions if i.opcode not in FREE | COLLECTIVE_OPCODES
               | {"dynamic-slice", "multiply", "custom-call"}]
    return "continuation" if compute else "collective"


class _Walker:
    def __init__(self, module: HloModule, approximate: bool) -> None:
        self.module = module
        self.approximate = approximate
        self.program = Program()
        self.keys = itertools.count()
        self.offloads: dict[str, CollectiveInfo] = {}  # SparseCore calls not yet started
        self.offload_infos: dict[str, CollectiveInfo] = {}

    def emit(self, event: OpEvent | StartEvent | DoneEvent) -> None:
        if len(self.program.events) >= MAX_EVENTS:
            raise HloError(f"the step unrolls to more than {MAX_EVENTS:,} events (loops of "
                           "loops); cost a smaller step")
        self.program.events.append(event)

    def note(self, text: str) -> None:
        if text not in self.program.notes:
            self.program.notes.append(text)

    def walk(self, comp: HloComputation) -> None:
        if self.approximate:
            self._walk_windows(comp)
            return
        open_by_name: dict[str, int] = {}
        open_by_channel: dict[str, int] = {}
        for instr in comp.instructions:
            self._instruction(comp, instr, open_by_name, open_by_channel)
        for name, key in list(open_by_name.items()) + list(open_by_channel.items()):
            self.note(f"{comp.name}: window {name} has no done in its computation: closed at "
                      "its end")
            self.emit(DoneEvent(key))

    def _control(self, comp: HloComputation, instr: HloInstruction) -> bool:
        op = instr.opcode
        if op == "while":
            n = trip_count(self.module, comp, instr)
            self.program.trip_counts[instr.name] = n
            body = self.module.computations[instr.attr_names("body")[0]]
            for _ in range(n):
                self.walk(body)
            return True
        if op == "call":
            self.walk(self.module.computations[instr.called[0]])
            return True
        if op == "conditional":
            branches = [self.module.computations[c] for c in instr.called]
            largest = max(branches, key=lambda c: len(c.instructions))
            self.note(f"conditional {instr.name}: its largest branch {largest.name} costed")
            self.walk(largest)
            return True
        return False

    def _instruction(self, comp: HloComputation, instr: HloInstruction,
                     open_by_name: dict[str, int], open_by_channel: dict[str, int]) -> None:
        op = instr.opcode
        if op in FREE or self._control(comp, instr):
            return
        if op in _DMA_STARTS:
            if "cross_program_prefetch_index" in instr.attrs:
                open_by_name[instr.name] = -1  # prefetched during the step before: free
                return
            key = next(self.keys)
            open_by_name[instr.name] = key
            self.emit(StartEvent(key, _dma(comp, instr)))
            return
        if op.endswith("-done") or op == "async-done":
            start = self._start_of(comp, instr)
            self._start_offload(start, open_by_name)  # an offload never given operands
            found = open_by_name.pop(start, None) if start else None
            if found is not None and found >= 0:
                self.emit(DoneEvent(found))
            elif found is not None:
                pass  # a cross-program prefetch: nothing to wait for
            elif start:
                self.note(f"{comp.name}: {instr.name} ends a window started elsewhere: not costed")
            return
        if op == "call-start" and _thread(instr) == "sparsecore":
            info = self.offload_infos.get(instr.name)  # a loop body: once, not per trip
            if info is None:
                info = self.offload_infos[instr.name] = offload_info(self.module, instr)
            self.offloads[instr.name] = info
            if instr.operands:  # given its operands here: it starts here
                self._start_offload(instr.name, open_by_name)
            return
        if op in ("async-update", "call-update"):
            if op == "call-update" and len(instr.operands) > 1:
                self._start_offload(self._start_of(comp, instr), open_by_name)
            return
        if op.endswith("-start") and op.removesuffix("-start") in COLLECTIVE_OPCODES or (
                op == "async-start" and _defining(self.module, comp, instr) is not None):
            key = next(self.keys)
            open_by_name[instr.name] = key
            self.emit(StartEvent(key, collective_info(self.module, comp, instr, "async")))
            return
        if op in COLLECTIVE_OPCODES:
            self._sync(comp, instr)
            return
        if op == "fusion":
            role = _fusion_role(self.module, instr)
            if role in ("start", "done"):
                inner = _defining(self.module, comp, instr)
                channel = inner[1].attrs.get("channel_id", instr.name) if inner else instr.name
                if role == "start":
                    key = next(self.keys)
                    open_by_channel[channel] = key
                    self.emit(StartEvent(key, collective_info(self.module, comp, instr,
                                                              "async collective fusion")))
                elif channel in open_by_channel:
                    self.emit(DoneEvent(open_by_channel.pop(channel)))
                else:
                    self.note(f"{comp.name}: {instr.name} ends a collective started elsewhere")
                return
            if role == "collective":
                self._sync(comp, instr)
                return
        self.emit(OpEvent(comp, instr))

    def _start_offload(self, start: str, open_by_name: dict[str, int]) -> None:
        """Open the window of SparseCore offload ``start`` (once) where it is given its
        operands: libtpu's ``call-start()`` takes none and reserves the SparseCore; the
        ``call-update`` that passes them starts the work."""
        info = self.offloads.pop(start, None)
        if info is not None:
            key = next(self.keys)
            open_by_name[start] = key
            self.emit(StartEvent(key, info))

    def _start_of(self, comp: HloComputation, done: HloInstruction) -> str:
        """The start a done closes (through async-updates and tuple reads)."""
        name = done.operands[0] if done.operands else ""
        instr = comp.by_name.get(name)
        while instr is not None and instr.opcode in ("async-update", "call-update",
                                                     "get-tuple-element"):
            name = instr.operands[0]
            instr = comp.by_name.get(name)
        return name

    def _sync(self, comp: HloComputation, instr: HloInstruction) -> None:
        key = next(self.keys)
        self.emit(StartEvent(key, collective_info(self.module, comp, instr, "sync")))
        self.emit(DoneEvent(key))

    def _walk_windows(self, comp: HloComputation) -> None:
        """A CPU-compiled computation: each collective starts after its last operand's
        producer and is done before its first user (module docstring)."""
        index = {i.name: n for n, i in enumerate(comp.instructions)}
        users: dict[str, int] = {}
        for n, i in enumerate(comp.instructions):
            for o in i.operands:
                users.setdefault(o, n)
        starts: dict[int, list[HloInstruction]] = {}
        dones: dict[int, list[int]] = {}
        keys: dict[str, int] = {}
        for instr in comp.instructions:
            if instr.opcode in COLLECTIVE_OPCODES or (
                    instr.opcode == "fusion"
                    and _fusion_role(self.module, instr) in ("collective", "continuation")):
                after = max((index[o] for o in instr.operands if o in index), default=-1)
                starts.setdefault(after, []).append(instr)
        for first in starts.get(-1, []):
            self._open(comp, first, keys, dones, users)
        for n, instr in enumerate(comp.instructions):
            for key in dones.pop(n, []):
                self.emit(DoneEvent(key))
            if instr.name not in keys and instr.opcode not in FREE \
                    and not self._control(comp, instr):
                self.emit(OpEvent(comp, instr))
            for coll in starts.get(n, []):
                self._open(comp, coll, keys, dones, users)
        for pending in dones.values():
            for key in pending:
                self.emit(DoneEvent(key))

    def _open(self, comp: HloComputation, instr: HloInstruction, keys: dict[str, int],
              dones: dict[int, list[int]], users: dict[str, int]) -> None:
        key = next(self.keys)
        keys[instr.name] = key
        self.emit(StartEvent(key, collective_info(self.module, comp, instr,
                                                  "window (approximate)")))
        dones.setdefault(users.get(instr.name, len(comp.instructions)), []).append(key)


def _thread(instr: HloInstruction) -> str:
    """The thread an async call runs its computation on (``async_execution_thread``)."""
    return instr.attrs.get("async_execution_thread", "main").strip('"') or "main"


def offload_info(module: HloModule, instr: HloInstruction) -> CollectiveInfo:
    """A ``call-start`` that offloads its computation to the SparseCore: op "sparsecore",
    its HBM bytes (``pod.hlo.ops.sparsecore_work``) and XLA's cycles where it gave them.

    Raises:
        HloOpError: the offloaded computation holds an op the bound from bytes does not
            cover and XLA gave no estimate (the op named, with its line).
    """
    called = [module.computations[c] for c in instr.called if c in module.computations]
    works = [sparsecore_work(module, c) for c in called]
    cycles = instr.estimated_cycles
    if cycles is None:
        kernels = [i for c in called for i in _offload_kernels(module, c)]
        found = [k.estimated_cycles for k in kernels]
        if kernels and all(f is not None for f in found):
            cycles = sum(f for f in found if f is not None)
    unknown = [u for w in works for u in w.unknown]
    if unknown and cycles is None:
        first = unknown[0]
        raise HloOpError(f"line {first.line}: {first.opcode} {short_name(first)!r} runs on the "
                         f"SparseCore ({instr.name}) and has no cost model there, and "
                         "XLA gave no estimated_cycles for the call")
    return CollectiveInfo(instr, "sparsecore", (), sum(w.hbm_bytes for w in works), 1,
                          "sparsecore offload", xla_cycles=cycles)


def _offload_kernels(module: HloModule, comp: HloComputation) -> list[HloInstruction]:
    """The kernels an offloaded computation runs: its fusions, through nested calls."""
    out: list[HloInstruction] = []
    for instr in comp.instructions:
        if instr.opcode == "fusion":
            out.append(instr)
        elif instr.opcode in ("call", "call-start"):
            for name in instr.called:
                out.extend(_offload_kernels(module, module.computations[name]))
    return out


def _dma(comp: HloComputation, instr: HloInstruction) -> CollectiveInfo:
    """An async copy or slice: the bytes it moves and between which memory spaces
    (``copy-start`` is (destination, source, context); ``slice-start`` is ((source),
    destination, context); ``dynamic-update-slice-start`` is ((buffer, update, indices...),
    buffer, context): it moves the update into the buffer, as XLA's host offload writes one
    layer's activations into the stack of all layers')."""
    leaves = instr.shape.leaves
    if instr.opcode == "copy-start" and len(leaves) >= 2:
        dest, src = leaves[0], leaves[1]
    elif instr.opcode == "dynamic-update-slice-start" and len(leaves) > len(instr.operands):
        dest, src = leaves[len(instr.operands)], leaves[1]
        return CollectiveInfo(instr, "dma", (), int(src.nbytes), 1, "dma",
                              (src.memory_space, dest.memory_space))
    elif len(leaves) > len(instr.operands):  # ((operands...), destination, context)
        src, dest = leaves[0], leaves[len(instr.operands)]
    else:
        source = comp.by_name.get(instr.operands[0]) if instr.operands else None
        src = source.shape.array if source is not None else instr.shape.array
        dest = instr.shape.array
    return CollectiveInfo(instr, "dma", (), int(dest.nbytes), 1, "dma",
                          (src.memory_space, dest.memory_space))


def flatten(module: HloModule, *, approximate: bool = False) -> Program:
    """The entry computation as events (module docstring).

    Args:
        module: the parsed module.
        approximate: a CPU-compiled module: windows of its collectives as XLA's
            scheduler aims at them on a TPU (module docstring).

    Returns:
        The :class:`Program`.

    Raises:
        HloError: a loop whose trip count cannot be read; a step of more than
            :data:`MAX_EVENTS` events.
        HloParseError: replica groups that do not parse.
    """
    walker = _Walker(module, approximate)
    if not module.is_scheduled and not approximate:
        walker.note("the module is not scheduled (is_scheduled=false): its printed order is "
                    "taken as the order run")
    walker.walk(module.entry_computation)
    return walker.program

"""HBM a module's step holds at its peak, and what is live there, read off its schedule.

XLA's buffer assignment (``compiled.memory_analysis()``) is the figure that counts when a
TPU compile ran; for a module alone (an HLO dump, a CPU compile) this is the estimate, and
beside XLA's figure it says which buffers make the peak. The walk follows XLA's dataflow
(``HloDataflowAnalysis``: which instructions define a buffer, which only pass one on) over
the scheduled order:

- each array an instruction defines is a buffer, live from that instruction to its last
  reader; the ENTRY's parameters live throughout (the caller holds the arguments), its
  result to the end, except the outputs the module writes into a donated argument's buffer
  (the header's ``input_output_alias``: an optimizer's new weights and moments take the old
  ones' buffers);
- ops that define no buffer pass their operand's on: ``bitcast``, ``get-tuple-element``,
  ``tuple``, ``while`` (its state, updated in place), ``opt-barrier``, ``add-dependency``,
  ``async-update``, an in-place ``dynamic-update-slice`` or ``scatter``, a fusion whose
  fused root (or root tuple element) is one of those on a fusion parameter, and the
  outputs a fusion or custom call declares in ``output_to_operand_aliasing`` (XLA's async
  collective fusions pass the gathered buffer on so), each output alone;
- an async pair: a ``*-start`` holds its operands (element 0 of its tuple) and defines its
  results and context; its ``*-done`` returns the results (``copy-start`` is (destination,
  source, context): its destination is new, ``copy-done`` returns it); an async
  ``dynamic-update-slice`` writes in place;
- a ``while`` adds its body's own peak (not the carried state, counted outside, nor the new
  state the body returns, which takes the carry's buffer) on top of what is live around it;
  a ``call`` or ``conditional`` the largest of its computations';
- bytes are the arrays' (``tiled=True``: the layout's, its ``T(8,128)`` tile padding the
  minor dimensions, ``ArrayShape.tiled_nbytes``); a buffer outside memory space 0 is no
  HBM and is left out (``S(1)`` a TPU's VMEM, ``S(5)`` host memory of XLA's host offload,
  ``S(3)`` an on-chip space of the v4 modules, ``S(2)``, ``S(4)``, ``S(6)`` synchronisation
  flags and scalars), as are constants (XLA gives them their own allocations).

Tile padding is how XLA sizes a TPU buffer, but it does not bring the walk closer to XLA's
peak: on the 19 modules of docs/xla-oracle.md (2026-11-29) the mean error is 1.6% untiled
and 1.9% tiled (it moves M1 from -3.1% to -0.0% and T3 from -1.7% to +5.8%, the others by
0.5 points or less), so the default is the arrays' bytes.

Not modelled: XLA's reuse of a dead buffer's memory for another (fragmentation: the walk
is a lower bound on what a heap holds), the scoped VMEM of kernels, an op that XLA lets
share its operand's buffer when that operand dies there (an elementwise fusion: the walk
counts both at that instruction). Checked against XLA's own peak on the oracle's committed
compiles (docs/xla-oracle.md, VALIDATION.md section 11 (c)).

Pure: no jax, no ray.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

from pod.hlo.module import ArrayShape, HloComputation, HloInstruction, HloModule, Shape

__all__ = ["LiveBuffer", "MemoryPeak", "memory_peak", "peak_bytes"]

#: A value: a buffer's number, None (no HBM buffer of its own here), or a tuple's values.
_Value: TypeAlias = "int | None | list[_Value]"

#: Output index -> (operand number, index in the operand) of the outputs an op writes into
#: an operand's buffer.
_Aliases: TypeAlias = "dict[tuple[int, ...], tuple[int, tuple[int, ...]]]"

#: Ops whose result is their first operand's buffer.
_PASS_FIRST = frozenset({"bitcast", "while", "opt-barrier", "add-dependency", "async-update",
                         "dynamic-update-slice", "scatter"})
#: Ops through which a fused root still names the same buffer.
_VIEWS = ("bitcast", "reshape")


@dataclass(frozen=True)
class LiveBuffer:
    """One buffer live at a peak.

    Attributes:
        name: the instruction that defines it, with the index of a tuple result's element
            in XLA's notation (``fusion.3{1}``).
        shape: its array type without layout, e.g. "bf16[8,4096,14336]".
        op_name: the JAX op that made it (the instruction's ``metadata={op_name=...}``),
            "" when absent.
        size_bytes: its HBM bytes in its layout (tiles' padding included).
    """

    name: str
    shape: str
    op_name: str
    size_bytes: int


@dataclass(frozen=True)
class MemoryPeak:
    """The most HBM bytes a computation holds at once, and what they are.

    Attributes:
        peak_bytes: the live buffers plus ``inner``'s peak at ``at``; for the ENTRY, the
            step's peak per device.
        computation: the computation's name.
        at: the instruction at the peak (the first, where several tie).
        live: the buffers live at ``at``, largest first (a body's carried state is not
            among them: it is counted where the loop is).
        inner: the peak of the computation ``at`` runs (a while's body), or None.
    """

    peak_bytes: int
    computation: str
    at: str
    live: tuple[LiveBuffer, ...]
    inner: MemoryPeak | None = None

    @property
    def live_bytes(self) -> int:
        """Bytes of :attr:`live` alone (``peak_bytes`` less the inner computation's)."""
        return sum(b.size_bytes for b in self.live)


def _flat(value: _Value) -> list[int]:
    if isinstance(value, list):
        return [b for v in value for b in _flat(v)]
    return [] if value is None else [value]


def _at(value: _Value, index: Sequence[int]) -> _Value:
    """The element at ``index`` of a tuple value; None where the index leaves the tuple."""
    for k in index:
        if not isinstance(value, list) or k >= len(value):
            return None
        value = value[k]
    return value


def _none(shape: Shape) -> _Value:
    """A value of ``shape`` holding no buffer of this computation (a body's carried state)."""
    return [_none(s) for s in shape.tuple_shapes] if shape.is_tuple else None


class _Walk:
    """The buffers of one module and each computation's peak (memoised)."""

    def __init__(self, module: HloModule, tiled: bool):
        self.module = module
        self.tiled = tiled
        self.buffers: list[LiveBuffer] = []
        self.memo: dict[str, MemoryPeak] = {}

    def _new(self, instr: HloInstruction, array: ArrayShape, index: tuple[int, ...],
             tupled: bool) -> _Value:
        if array.memory_space != 0:
            return None
        size = array.tiled_nbytes if self.tiled else array.nbytes
        if not size:
            return None
        name = instr.name + ("{" + ",".join(map(str, index)) + "}" if tupled else "")
        self.buffers.append(LiveBuffer(name, array.text, instr.op_name, size))
        return len(self.buffers) - 1

    def _fresh(self, instr: HloInstruction, ops: list[_Value],
               aliased: _Aliases,
               shape: Shape | None = None, index: tuple[int, ...] = ()) -> _Value:
        """New buffers for ``shape`` (the instruction's), but the outputs in ``aliased``
        (output index -> (operand, index in it)), which are the operand's."""
        shape = instr.shape if shape is None else shape
        if index in aliased:
            operand, inside = aliased[index]
            return _at(ops[operand], inside) if operand < len(ops) else None
        if shape.is_tuple:
            return [self._fresh(instr, ops, aliased, part, (*index, k))
                    for k, part in enumerate(shape.tuple_shapes)]
        return self._new(instr, shape.array, index, instr.shape.is_tuple)

    def _in_place(self, instr: HloInstruction) -> _Aliases:
        """Outputs a fusion or custom call writes into an operand's buffer: those it
        declares and a fused root (or root tuple element) that updates a fusion parameter
        in place."""
        out = instr.operand_aliases
        if instr.opcode != "fusion" or not instr.attr_names("calls"):
            return out
        comp = self.module.computations[instr.attr_names("calls")[0]]

        def through_views(node: HloInstruction | None) -> HloInstruction | None:
            while node is not None and node.opcode in _VIEWS and node.operands:
                node = comp.by_name.get(node.operands[0])
            return node

        root = through_views(comp.root)
        tupled = root is not None and root.opcode == "tuple"
        parts = [through_views(comp.by_name.get(o)) for o in root.operands] if (
            root is not None and tupled) else [root]
        for k, part in enumerate(parts):
            if part is None or part.opcode not in ("dynamic-update-slice", "scatter"):
                continue
            target = through_views(comp.by_name.get(part.operands[0]))
            if target is not None and target.opcode == "parameter":
                out.setdefault((k,) if tupled else (), (int(target.literal), ()))
        return out

    def _value(self, instr: HloInstruction, values: dict[str, _Value], entry: bool) -> _Value:
        ops = [values.get(o) for o in instr.operands]
        code = instr.opcode
        if code == "parameter":
            return self._fresh(instr, [], {}) if entry else _none(instr.shape)
        if code == "constant":
            return _none(instr.shape)
        if code == "get-tuple-element":
            return _at(ops[0], instr.int_list("index")[:1])
        if code == "tuple":
            return list(ops)
        if code in _PASS_FIRST:
            return ops[0] if ops else None
        if code.endswith("-done"):
            start = ops[0] if ops else None
            if code == "copy-done":
                return _at(start, (0,))
            if code == "recv-done":
                return [_at(start, (0,)), None]
            if code == "send-done":
                return None
            return _at(start, (1,)) if isinstance(start, list) and len(start) > 1 else start
        if code.endswith("-start") and instr.shape.is_tuple and code != "all-reduce-start":
            if code == "copy-start":
                return self._fresh(instr, ops, {(1,): (0, ())})
            held: _Aliases = ({(0, k): (k, ()) for k in range(len(ops))}
                    if instr.shape.tuple_shapes[0].is_tuple else {(0,): (0, ())})
            if code == "dynamic-update-slice-start":
                held[(1,)] = (0, ())
            return self._fresh(instr, ops, held)
        if code in ("fusion", "custom-call"):
            return self._fresh(instr, ops, self._in_place(instr))
        return self._fresh(instr, ops, {})

    def _inner(self, instr: HloInstruction) -> MemoryPeak | None:
        if instr.opcode == "while":
            names = instr.attr_names("body") + instr.attr_names("condition")
        elif instr.opcode in ("call", "conditional"):
            names = instr.called
        else:
            return None
        peaks = [self.peak(self.module.computations[n]) for n in names]
        return max(peaks, key=lambda p: p.peak_bytes, default=None)

    def _excluded(self, comp: HloComputation, root: _Value, params: set[int]) -> set[int]:
        """Buffers the computation's result writes into its caller's: a body's new state
        (the carry's buffer), the ENTRY's outputs into donated arguments."""
        if not comp.is_entry:
            return set(_flat(root))
        out: set[int] = set()
        for index in self.module.output_aliases:
            out.update(b for b in _flat(_at(root, index)) if b not in params)
        return out

    def peak(self, comp: HloComputation) -> MemoryPeak:
        """The peak of ``comp``'s live bytes (memoised; a recursive call adds nothing)."""
        if comp.name in self.memo:
            return self.memo[comp.name]
        self.memo[comp.name] = MemoryPeak(0, comp.name, "", ())
        instrs = comp.instructions
        end = len(instrs)
        values: dict[str, _Value] = {}
        defined: dict[int, int] = {}
        for n, instr in enumerate(instrs):
            before = len(self.buffers)
            values[instr.name] = self._value(instr, values, comp.is_entry)
            defined.update((b, n) for b in range(before, len(self.buffers)))
        last = dict(defined)
        for n, instr in enumerate(instrs):
            for operand in instr.operands:
                for b in _flat(values.get(operand)):
                    if b in last:
                        last[b] = max(last[b], n)
        params = {b for i in instrs if i.opcode == "parameter" for b in _flat(values[i.name])}
        root = values[comp.root.name]
        for b in _flat(root) + sorted(params):
            if b in last:
                last[b] = end
        for b in params:
            defined[b] = 0
        excluded = self._excluded(comp, root, params)
        counted = [b for b in defined if b not in excluded]
        delta = [0] * (end + 2)
        for b in counted:
            delta[defined[b]] += self.buffers[b].size_bytes
            delta[last[b] + 1] -= self.buffers[b].size_bytes
        live, best, best_at, best_inner = 0, -1, 0, None
        for n, instr in enumerate(instrs):
            live += delta[n]
            inner = self._inner(instr)
            total = live + (inner.peak_bytes if inner else 0)
            if total > best:
                best, best_at, best_inner = total, n, inner
        at_peak = sorted((self.buffers[b] for b in counted
                          if defined[b] <= best_at <= last[b]),
                         key=lambda x: (-x.size_bytes, x.name))
        result = MemoryPeak(max(best, 0), comp.name, instrs[best_at].name, tuple(at_peak),
                            best_inner)
        self.memo[comp.name] = result
        return result


def memory_peak(module: HloModule, *, tiled: bool = False) -> MemoryPeak:
    """The step's HBM peak per device and what is live there (module docstring).

    Args:
        module: the parsed module (scheduled: its printed order is the order run).
        tiled: bytes in the layout's tiles (``ArrayShape.tiled_nbytes``, as XLA sizes a
            TPU buffer); False (the default): the arrays' bytes alone, which is as close
            to XLA's peak on the oracle's compiles (module docstring).

    Returns:
        The ENTRY computation's :class:`MemoryPeak`: ``peak_bytes`` is its arguments, the
        buffers live at the peak and, where the peak is inside a loop, the body's own.
    """
    return _Walk(module, tiled).peak(module.entry_computation)


def peak_bytes(module: HloModule, *, tiled: bool = False) -> int:
    """HBM bytes one device holds at the step's peak (:func:`memory_peak`'s).

    Args:
        module: the parsed module.
        tiled: as :func:`memory_peak`'s.

    Returns:
        Bytes, int >= 0.
    """
    return memory_peak(module, tiled=tiled).peak_bytes

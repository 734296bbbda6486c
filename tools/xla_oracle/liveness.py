"""Which buffers a scheduled HLO module holds at its peak: a liveness walk of XLA's schedule.

Pure Python (no jax), on the text ``compiled.as_text()`` prints (``is_scheduled=true``: each
computation's instructions in the order they run). It reads what
``memory_analysis().peak_memory_in_bytes`` sums without XLA's buffer assignment, to find
what the HBM plan (``pod.programs.memory``) misses or over-counts at the step's peak:

- every array an instruction defines is a buffer, live from that instruction to its last
  reader (through the aliases below); the ENTRY's parameters live through the step (the
  train step's arguments, donated to its outputs), its root's buffers to the end;
- aliases define no buffer: ``get-tuple-element``, ``tuple``, ``bitcast``, a ``while``
  (its result is its carried operand, updated in place), ``copy-done`` (the copy-start's
  destination), an async ``*-done`` (its start's result), a ``*-start`` (its operands, then
  new result buffers), ``dynamic-update-slice`` and a fusion whose root is one (in place on
  the operand it updates);
- a ``while`` instruction adds the peak of its body's own temporaries (the carried buffers
  are counted once, outside; a new value the body returns in its carry takes the carry's
  buffer); a ``conditional`` or ``call`` the largest of its computations';
- bytes are the tiled layout's (``T(8,128)``: the two minor dimensions padded to the
  tile's 8 rows and 128 columns; a dimension of 1 under ``T(2,128)`` takes 2 rows); a
  buffer outside memory space 0 (``S(1)``: VMEM, ``S(5)``: host, ...) is no HBM and is
  left out.

Not modelled: XLA's reuse of a dead buffer's memory for another (fragmentation), the
scoped VMEM of kernels, rematerialisation after scheduling. The walk's peak is therefore
a reading aid, checked against XLA's own peak where both are known (``python -m
tools.xla_oracle.liveness FILE``, docs/xla-oracle.md), not a replacement for it.
"""

from __future__ import annotations

import argparse
import gzip
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tools.xla_oracle.inventory import (
    DTYPE_BYTES,
    Computation,
    Instruction,
    _split_top,
    parse_module,
)

__all__ = ["Buffer", "Peak", "array_bytes", "peak_of_module", "main"]

_LEAF = re.compile(r"^([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?$")
_ALIAS_OPS = {"bitcast", "get-tuple-element", "tuple", "while", "copy-done", "opt-barrier"}


@dataclass(frozen=True)
class Buffer:
    """One array an instruction defines.

    Attributes:
        name: the defining instruction (``name#i`` for its i-th tuple element).
        shape: the array's type text.
        bytes: its size in the tiled layout (0 outside HBM).
        op_name: the jax op that made it (``metadata={op_name=...}``), or "".
    """

    name: str
    shape: str
    bytes: int
    op_name: str


@dataclass
class Peak:
    """The largest live bytes of a computation and what is live there.

    Attributes:
        bytes: live buffers + the nested computation's peak at that instruction.
        at: the instruction at the peak.
        live: the buffers live there (largest first).
        inner: the nested computation's peak at ``at`` (a while's body), or None.
    """

    bytes: int
    at: str
    live: list[Buffer] = field(default_factory=list)
    inner: Peak | None = None


def array_bytes(shape: str) -> int:
    """Bytes of one array type text in its tiled layout; 0 outside HBM (memory space != 0).

    >>> array_bytes("bf16[4,100]{1,0:T(8,128)(2,1)}")   # one 8 x 128 tile
    2048
    >>> array_bytes("f32[4,100]{1,0}")
    1600
    """
    m = _LEAF.match(shape.strip())
    if not m or m.group(1) not in DTYPE_BYTES:
        return 0
    dtype, dims_text, layout = m.group(1), m.group(2), m.group(3) or ""
    space = re.search(r"S\((\d+)\)", layout)
    if space and space.group(1) != "0":
        return 0
    dims = [int(d) for d in dims_text.split(",") if d]
    item = DTYPE_BYTES[dtype]
    tile = re.search(r"T\((\d+),(\d+)\)", layout)
    order = layout.strip("{}").split(":")[0]
    if tile and len(dims) >= 2 and order:
        minor_to_major = [int(d) for d in order.split(",")]
        rows = int(tile.group(1))
        minor, second = minor_to_major[0], minor_to_major[1]
        dims[minor] = -(-dims[minor] // int(tile.group(2))) * int(tile.group(2))
        dims[second] = -(-dims[second] // rows) * rows
    return int(math.prod(dims) * item)


def _leaves(shape: str) -> list[str]:
    """The array types of a (possibly nested) tuple type, flattened."""
    shape = re.sub(r"/\*[^*]*\*/", "", shape).strip()
    if shape.startswith("("):
        return [leaf for part in _split_top(shape[1:-1]) for leaf in _leaves(part)]
    return [shape]


def _tree(shape: str, make) -> object:
    """A value tree of ``shape``: a list per tuple, ``make(leaf_shape)`` per array."""
    shape = re.sub(r"/\*[^*]*\*/", "", shape).strip()
    if shape.startswith("("):
        return [_tree(part, make) for part in _split_top(shape[1:-1])]
    return make(shape)


def _flat(tree: object) -> list[int]:
    if isinstance(tree, list):
        return [b for t in tree for b in _flat(t)]
    return [tree] if isinstance(tree, int) else []


def _attr(ins: Instruction, key: str) -> str | None:
    m = re.search(rf"\b{key}=%?([^\s,}}]+)", ins.attrs)
    return m.group(1) if m else None


def _op_name(ins: Instruction) -> str:
    m = re.search(r'op_name="([^"]*)"', ins.attrs)
    return m.group(1) if m else ""


def _declared_aliases(ins: Instruction) -> dict[tuple[int, ...], tuple[int, tuple[int, ...]]]:
    """``output_to_operand_aliasing={{1}: (0, {}), ...}``: output index -> (operand, index)."""
    m = re.search(r"output_to_operand_aliasing=\{(.*?\))\}", ins.attrs)
    if not m:
        return {}
    out = {}
    for where, operand, inside in re.findall(r"\{([0-9,\s]*)\}:\s*\((\d+),\s*\{([0-9,\s]*)\}\)",
                                             m.group(1)):
        key = tuple(int(x) for x in where.split(",") if x.strip())
        out[key] = (int(operand), tuple(int(x) for x in inside.split(",") if x.strip()))
    return out


def _in_place_operands(comps: dict[str, Computation], ins: Instruction
                       ) -> dict[tuple[int, ...], tuple[int, tuple[int, ...]]]:
    """Output index -> (operand, index) a fusion or custom call writes in place: those it
    declares (``output_to_operand_aliasing``) and a fused root (or root tuple element) that
    is a dynamic-update-slice of one of the fusion's parameters (through bitcasts)."""
    out = _declared_aliases(ins)
    called = comps.get(_attr(ins, "calls") or "")
    if called is None or not called.instructions:
        return out
    by_name = {i.name: i for i in called.instructions}

    def through_bitcasts(name: str) -> Instruction | None:
        node = by_name.get(name)
        while node is not None and node.opcode == "bitcast":
            node = by_name.get(node.operands[0])
        return node

    root = next((i for i in called.instructions if i.is_root), called.instructions[-1])
    root = through_bitcasts(root.name) or root
    tupled = root.opcode == "tuple"
    elements = [through_bitcasts(o) for o in root.operands] if tupled else [root]
    for k, element in enumerate(elements):
        if element is not None and element.opcode == "dynamic-update-slice":
            target = through_bitcasts(element.operands[0])
            if target is not None and target.opcode == "parameter":
                out.setdefault((k,) if tupled else (), (int(target.operands[0]), ()))
    return out


def _at(tree: object, index: tuple[int, ...]) -> object:
    for k in index:
        tree = tree[k] if isinstance(tree, list) and k < len(tree) else tree
    return tree


class _Walk:
    def __init__(self, comps: dict[str, Computation]):
        self.comps = comps
        self.buffers: list[Buffer] = []
        self.memo: dict[str, Peak] = {}

    def _new(self, ins: Instruction, shape: str, index: int | None = None) -> int:
        name = ins.name if index is None else f"{ins.name}#{index}"
        self.buffers.append(Buffer(name, shape, array_bytes(shape), _op_name(ins)))
        return len(self.buffers) - 1

    def _fresh(self, ins: Instruction, shape: str | None = None) -> object:
        counter = iter(range(10**6))
        many = (shape or ins.shape).strip().startswith("(")
        return _tree(shape or ins.shape,
                     lambda s: self._new(ins, s, next(counter) if many else None))

    def _value(self, ins: Instruction, values: dict[str, object]) -> object:
        ops = [values.get(o, []) for o in ins.operands]
        code = ins.opcode
        if code == "get-tuple-element":
            index = int(_attr(ins, "index") or 0)
            return ops[0][index] if isinstance(ops[0], list) else ops[0]
        if code == "tuple":
            return ops
        if code in ("bitcast", "while", "opt-barrier", "dynamic-update-slice"):
            return ops[0]
        if code == "copy-done":
            return ops[0][0] if isinstance(ops[0], list) else ops[0]
        if code.endswith("-done"):
            return ops[0][1] if isinstance(ops[0], list) and len(ops[0]) > 1 else ops[0]
        if code.endswith("-start") and ins.shape.startswith("("):
            fresh = self._fresh(ins)
            assert isinstance(fresh, list)
            if code == "copy-start":
                return [fresh[0], ops[0], *fresh[2:]]
            if code == "async-start":
                return [ops, *fresh[1:]]
            return [*ops, *fresh[len(ops):]]
        if code in ("fusion", "custom-call"):
            in_place = _in_place_operands(self.comps, ins)
            if () in in_place:
                operand, inside = in_place[()]
                return _at(ops[operand], inside)
            if in_place:
                fresh = self._fresh(ins)
                assert isinstance(fresh, list)
                for (k, *_), (operand, inside) in in_place.items():
                    fresh[k] = _at(ops[operand], inside)
                return fresh
        return self._fresh(ins)

    def _inner(self, ins: Instruction) -> Peak | None:
        if ins.opcode == "while":
            names = [_attr(ins, "body")]
        elif ins.opcode in ("conditional", "call"):
            found = re.search(r"(branch_computations=\{[^}]*\}|to_apply=\S+|"
                              r"true_computation=\S+.*false_computation=\S+)", ins.attrs)
            names = re.findall(r"%?([\w.\-]+)", found.group(0)) if found else []
        else:
            return None
        peaks = [self.peak(self.comps[n], entry=False) for n in names if n in self.comps]
        return max(peaks, key=lambda p: p.bytes, default=None)

    def peak(self, comp: Computation, entry: bool) -> Peak:
        """The peak of ``comp``'s live bytes (a body's own: not its carried parameter)."""
        if comp.name in self.memo:
            return self.memo[comp.name]
        values: dict[str, object] = {}
        defined: dict[int, int] = {}
        carried: set[int] = set()
        instrs = comp.instructions
        for n, ins in enumerate(instrs):
            before = len(self.buffers)
            values[ins.name] = self._value(ins, values)
            for b in range(before, len(self.buffers)):
                defined[b] = n
                if ins.opcode == "parameter" and not entry:
                    carried.add(b)
        last = dict(defined)
        for n, ins in enumerate(instrs):
            for o in ins.operands:
                for b in _flat(values.get(o, [])):
                    if b in last:
                        last[b] = max(last[b], n)
        root = next((i for i in instrs if i.is_root), instrs[-1] if instrs else None)
        end = len(instrs)
        if root is not None:
            for b in _flat(values[root.name]):
                if b in last:
                    last[b] = end
                    if not entry:
                        carried.add(b)   # a new carry value takes the carry's buffer
        if entry:
            for ins in instrs:
                if ins.opcode == "parameter":
                    for b in _flat(values[ins.name]):
                        defined[b], last[b] = 0, end
        best = Peak(0, "")
        counted = [b for b in defined if b not in carried and self.buffers[b].bytes]
        for n, ins in enumerate(instrs):
            inner = self._inner(ins)
            live = [b for b in counted if defined[b] <= n <= last[b]]
            total = sum(self.buffers[b].bytes for b in live) + (inner.bytes if inner else 0)
            if total > best.bytes:
                best = Peak(total, ins.name,
                            sorted((self.buffers[b] for b in live), key=lambda x: -x.bytes),
                            inner)
        self.memo[comp.name] = best
        return best


def peak_of_module(text: str) -> Peak:
    """The liveness walk's peak of a scheduled HLO module's ENTRY computation.

    Raises:
        HloParseError: text the inventory's parser cannot read.
    """
    comps = parse_module(text)
    entry = next(c for c in comps.values() if c.is_entry)
    return _Walk(comps).peak(entry, entry=True)


def _print(peak: Peak, top: int, depth: int = 0) -> None:
    pad = "    " * depth
    print(f"{pad}peak {peak.bytes / 2**30:.3f} GiB at {peak.at}"
          + (f" (inner {peak.inner.bytes / 2**30:.3f} GiB)" if peak.inner else ""))
    for b in peak.live[:top]:
        print(f"{pad}  {b.bytes / 2**30:8.3f}  {b.name[:40]:40s} {b.shape.split('{')[0][:34]:34s}"
              f" {b.op_name[-70:]}")
    if peak.inner is not None:
        _print(peak.inner, top, depth + 1)


def main(argv: list[str] | None = None) -> int:
    """``python -m tools.xla_oracle.liveness FILE.hlo.txt[.gz] [--top N]``: the walk's
    peak and the buffers live there, nested into the while bodies at the peak."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args(argv)
    opener = gzip.open if args.file.suffix == ".gz" else open
    with opener(args.file, "rt") as fh:
        _print(peak_of_module(fh.read()), args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())

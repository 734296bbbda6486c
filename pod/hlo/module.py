"""An XLA HLO module as data: the text XLA prints (``compiled.as_text()``,
``--xla_dump_to`` files, MaxText's ``dump_hlo``, PyTorch/XLA's dumps) parsed into
computations of instructions, each with its shape, operands and attributes.

The grammar followed is XLA's HLO text format (``xla/hlo/parser/hlo_parser.cc``;
the printer ``HloInstruction::ToString``)::

    HloModule name, is_scheduled=true, num_partitions=8, ...
    %computation (p: bf16[8,128]) -> bf16[8,128] {
      %p = bf16[8,128]{1,0:T(8,128)(2,1)} parameter(0)
      ROOT %neg = bf16[8,128]{1,0} negate(%p), metadata={op_name="jit(f)/neg"}
    }
    ENTRY %main (...) -> ... { ... }

A shape is an array ``dtype[d0,d1]{layout}`` (the layout's minor-to-major order,
tiles ``T(8,128)`` and memory space ``S(n)``: on a TPU ``S(1)`` is the
TensorCore's VMEM, the alternate memory XLA's memory-space assignment places
small buffers in) or a tuple of shapes. ``%`` before names is optional (some
printers omit it); ``/*index=5*/`` comments are ignored. The module's
``FileNames`` / ``FunctionNames`` / ``FileLocations`` / ``StackFrames`` tables
(newer XLA) map an instruction's ``stack_frame_id`` to its stack of source lines
(``pod.hlo.frames``: the user's own line, the chain of functions that called it).

Nothing here knows what an op costs (``pod.hlo.ops``) or how a program runs
(``pod.hlo.program``). Pure Python: no jax, no ray.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from pod.errors import HloParseError
from pod.hlo.frames import StackFrame, call_chain, read_frames, stack, user_frame

__all__ = ["DTYPE_BYTES", "ArrayShape", "Shape", "HloInstruction", "HloComputation",
           "HloModule", "parse_hlo", "parse_shape", "split_top", "VMEM_SPACE",
           "HOST_SPACE"]

#: XLA's "no estimate" in ``estimated_cycles`` (the largest int64).
_NO_ESTIMATE = 2**63 - 1

#: Bytes per element of each HLO primitive type (``xla/xla_data.proto``); sub-byte types
#: (s4, u4, f4e2m1fn) count half a byte, as XLA packs them.
DTYPE_BYTES: dict[str, float] = {
    "pred": 1, "s2": 0.25, "u2": 0.25, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2,
    "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4,
    "f64": 8, "c64": 8, "c128": 16, "f8e5m2": 1, "f8e4m3fn": 1, "f8e4m3b11fnuz": 1,
    "f8e5m2fnuz": 1, "f8e4m3fnuz": 1, "f8e4m3": 1, "f8e3m4": 1, "f8e8m0fnu": 1,
    "f4e2m1fn": 0.5, "token": 0, "opaque": 0,
}

#: The memory space of a TPU's VMEM in a layout (``S(1)``): XLA's alternate memory.
VMEM_SPACE = 1
#: The memory space of host memory in a layout (``S(5)``): XLA's host offload.
HOST_SPACE = 5

_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\](\{[^{}]*(?:\([^()]*\)[^{}]*)*\})?")
_SPACE = re.compile(r"S\((\d+)\)")
_TILE = re.compile(r"T\((\d+(?:,\d+)*)\)")
_ALIAS = re.compile(r"\{([\d,\s]*)\}\s*:\s*\(\s*(\d+)\s*,\s*\{([\d,\s]*)\}")
_COMMENT = re.compile(r"/\*.*?\*/")
_NAME = r"%?([A-Za-z_][\w.\-]*)"
_HEADER = re.compile(r"^(ENTRY\s+)?" + _NAME + r"\s*(.*)\{\s*$")
_INSTRUCTION = re.compile(r"^(ROOT\s+)?" + _NAME + r"\s*=\s*(.*)$")
_OPCODE = re.compile(r"\s*([a-z][a-z0-9\-]*)\(")


@dataclass(frozen=True)
class ArrayShape:
    """One array: element type, dimensions, memory space.

    Attributes:
        dtype: XLA's primitive type name, e.g. "bf16", "f32", "s32", "pred".
        dims: the dimensions (``()`` for a scalar).
        memory_space: the layout's ``S(n)``, 0 (HBM) when absent; 1 is a TPU's VMEM.
        minor_to_major: the layout's dimension order (``{1,0}`` -> (1, 0)); ``()`` when
            the shape has no layout (then row-major).
        tile: the layout's first tile (``T(8,128)`` -> (8, 128)), which pads the minor
            dimensions in memory; ``()`` when untiled.
    """

    dtype: str
    dims: tuple[int, ...]
    memory_space: int = 0
    minor_to_major: tuple[int, ...] = ()
    tile: tuple[int, ...] = ()

    @property
    def elements(self) -> int:
        """Number of elements (1 for a scalar)."""
        return math.prod(self.dims)

    @property
    def itemsize(self) -> float:
        """Bytes per element (:data:`DTYPE_BYTES`)."""
        return DTYPE_BYTES[self.dtype]

    @property
    def nbytes(self) -> int:
        """Bytes of the array, rounded up."""
        return math.ceil(self.elements * self.itemsize)

    @property
    def tiled_nbytes(self) -> int:
        """Bytes the array takes in memory in its tiled layout: the dimensions in layout
        order (major to minor) with the minor ones padded to multiples of :attr:`tile`
        (a tile of more dimensions than the array's pads leading dimensions of 1), as
        XLA's ``ShapeUtil::ByteSizeOf`` counts a TPU layout. ``T(8,128)`` pads
        ``f32[4,100]{1,0}`` to 8 x 128 elements (4096 bytes); the sub-tiles that follow
        (``(2,1)`` packing bf16 pairs) divide the first tile and pad nothing more. Equal to
        :attr:`nbytes` for an untiled array.

        >>> parse_shape("bf16[4,100]{1,0:T(8,128)(2,1)}").array.tiled_nbytes
        2048
        """
        if not self.tile:
            return self.nbytes
        order = self.minor_to_major or tuple(reversed(range(len(self.dims))))
        if sorted(order) != list(range(len(self.dims))):
            return self.nbytes
        physical = [self.dims[d] for d in reversed(order)]
        physical = [1] * (len(self.tile) - len(physical)) + physical
        for k, size in enumerate(reversed(self.tile)):
            physical[-1 - k] = -(-physical[-1 - k] // size) * size
        return math.ceil(math.prod(physical) * self.itemsize)

    @property
    def text(self) -> str:
        """The array's type without its layout, e.g. "bf16[8,128]"."""
        return f"{self.dtype}[{','.join(str(d) for d in self.dims)}]"


@dataclass(frozen=True)
class Shape:
    """An instruction's shape: one array, or a tuple (its leaves, nested tuples flattened).

    Attributes:
        leaves: the arrays, in order.
        is_tuple: a tuple shape (possibly of one element, or empty).
        tuple_shapes: a tuple's elements (each a :class:`Shape`, nested tuples kept, as
            XLA's ``Shape::tuple_shapes``); ``()`` for an array.
    """

    leaves: tuple[ArrayShape, ...]
    is_tuple: bool = False
    tuple_shapes: tuple[Shape, ...] = ()

    @property
    def nbytes(self) -> int:
        """Bytes of every leaf."""
        return sum(a.nbytes for a in self.leaves)

    def hbm_bytes(self) -> int:
        """Bytes of the leaves outside VMEM (memory space 1): what moves through HBM."""
        return sum(a.nbytes for a in self.leaves if a.memory_space != VMEM_SPACE)

    @property
    def array(self) -> ArrayShape:
        """The single array of a non-tuple shape (the first leaf of a tuple)."""
        if not self.leaves:
            return ArrayShape("token", ())
        return self.leaves[0]

    @property
    def elements(self) -> int:
        """Elements of the largest leaf."""
        return max((a.elements for a in self.leaves), default=0)


def split_top(text: str, sep: str = ",") -> list[str]:
    """``text`` split at ``sep`` outside brackets, braces, parentheses and strings.

    Args:
        text: e.g. ``a={1,2}, b="x,y", c=f(1,2)``.
        sep: one character.

    Returns:
        The stripped parts (empty ones dropped).
    """
    parts, depth, start = [], 0, 0
    for i, ch in _unquoted(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return [p for p in parts if p]


def _unquoted(text: str, start: int = 0) -> Iterator[tuple[int, str]]:
    """(index, character) of ``text`` from ``start``, skipping quoted strings (their
    escapes included) and the quotes."""
    quote, i = "", start
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
        else:
            yield i, ch
        i += 1


def _open_braces(text: str) -> int:
    """Braces ``text`` opens and does not close (outside strings): an attribute XLA printed
    over several lines (a Pallas kernel's ``frontend_attributes={kernel_metadata={...}}``)."""
    depth = 0
    for _, ch in _unquoted(text):
        depth += (ch == "{") - (ch == "}")
    return depth


def _closing(text: str, start: int) -> int:
    """The index just past the bracket closing the one at ``text[start]``; -1 if none."""
    pairs = {"(": ")", "[": "]", "{": "}"}
    stack: list[str] = []
    for i, ch in _unquoted(text, start):
        if ch in pairs:
            stack.append(pairs[ch])
        elif stack and ch == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
    return -1


def parse_shape(text: str) -> Shape:
    """Parse an HLO shape: ``bf16[8,128]{1,0:T(8,128)S(1)}``, ``f32[]``, ``(s32[], bf16[4])``.

    Args:
        text: the shape's text alone.

    Returns:
        The :class:`Shape`.

    Raises:
        ValueError: text that is not a shape (the caller names the line).
    """
    text = text.strip()
    if text.startswith("("):
        if not text.endswith(")"):
            raise ValueError(f"unbalanced tuple shape {text[:60]!r}")
        parts = tuple(parse_shape(part) for part in split_top(text[1:-1]))
        return Shape(tuple(leaf for part in parts for leaf in part.leaves), is_tuple=True,
                     tuple_shapes=parts)
    match = _ARRAY.fullmatch(text)
    if not match or match.group(1) not in DTYPE_BYTES:
        raise ValueError(f"not a shape: {text[:60]!r}")
    dims = tuple(int(d.lstrip("<=")) for d in match.group(2).split(",") if d.strip())
    layout = (match.group(3) or "{}")[1:-1]
    order, _, tiling = layout.partition(":")
    space = _SPACE.search(tiling)
    tile = _TILE.search(tiling)
    return Shape((ArrayShape(
        match.group(1), dims, int(space.group(1)) if space else 0,
        tuple(int(d) for d in order.split(",") if d.strip().isdigit()),
        tuple(int(d) for d in tile.group(1).split(",")) if tile else ()),))


def _read_shape(text: str) -> tuple[str, str]:
    """(the shape at the start of ``text``, the rest)."""
    text = text.lstrip()
    if text.startswith("("):
        end = _closing(text, 0)
        if end < 0:
            raise ValueError("unbalanced parentheses in the shape")
        return text[:end], text[end:]
    match = _ARRAY.match(text)
    if not match:
        raise ValueError(f"no shape at {text[:40]!r}")
    return match.group(0), text[match.end():]


@dataclass(frozen=True, eq=False)
class HloInstruction:
    """One HLO instruction.

    Attributes:
        name: its name without ``%``, e.g. "fusion.12".
        opcode: e.g. "fusion", "all-gather-start", "while".
        shape: its result shape.
        operands: the names of its operands, in order.
        attrs: its attributes as written (``calls`` -> "%fused_computation.3", ...).
        line: its 1-based line in the text.
        is_root: the computation's ROOT.
        literal: a constant's literal text ("" for other ops).
    """

    name: str
    opcode: str
    shape: Shape
    operands: tuple[str, ...]
    attrs: dict[str, str]
    line: int
    is_root: bool = False
    literal: str = ""

    def attr_names(self, key: str) -> tuple[str, ...]:
        """Computation names an attribute refers to (``calls=%c``, ``to_apply=%c``,
        ``branch_computations={%a, %b}``, ``calls={%a, %b}``)."""
        raw = self.attrs.get(key, "")
        return tuple(n.strip().lstrip("%") for n in raw.strip("{}").split(",") if n.strip())

    @property
    def called(self) -> tuple[str, ...]:
        """Every computation this instruction calls (fusion, while, call, reduce's
        ``to_apply``, conditional branches, async wrapped computations)."""
        out: list[str] = []
        for key in ("calls", "to_apply", "condition", "body", "branch_computations",
                    "true_computation", "false_computation"):
            out.extend(self.attr_names(key))
        return tuple(out)

    @cached_property
    def metadata(self) -> dict[str, str]:
        """The ``metadata={op_name="..." source_file=... stack_frame_id=5}`` fields."""
        raw = self.attrs.get("metadata", "").strip("{}")
        return {k: v.strip('"') for k, v in
                re.findall(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)', raw)}

    @property
    def op_name(self) -> str:
        """The JAX op name XLA kept (``metadata.op_name``), "" when absent."""
        return self.metadata.get("op_name", "")

    @cached_property
    def backend_config(self) -> dict[str, Any]:
        """The ``backend_config`` JSON as a dict ({} when absent or not JSON)."""
        raw = self.attrs.get("backend_config", "")
        if not raw.startswith("{"):
            return {}
        try:
            value = json.loads(raw)
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}

    @property
    def estimated_cycles(self) -> int | None:
        """XLA's own estimate of the op's TensorCore cycles (TPU backend_config
        ``window_config.estimated_cycles`` or ``estimated_cycles``), None when absent
        or XLA's "no estimate" (the largest int64, 9223372036854775807, which libtpu
        0.0.50 writes on its SparseCore gather fusions)."""
        config = self.backend_config
        for where in (config.get("window_config", {}), config):
            value = where.get("estimated_cycles") if isinstance(where, dict) else None
            if value is not None:
                try:
                    cycles = int(value)
                except (TypeError, ValueError):
                    return None
                return None if cycles >= _NO_ESTIMATE else cycles
        return None

    @property
    def known_trip_count(self) -> int | None:
        """A while loop's trip count as XLA recorded it (``backend_config
        known_trip_count.n``), None when absent."""
        value = self.backend_config.get("known_trip_count", {})
        n = value.get("n") if isinstance(value, dict) else None
        try:
            return int(n) if n is not None else None
        except (TypeError, ValueError):
            return None

    @property
    def operand_aliases(self) -> dict[tuple[int, ...], tuple[int, tuple[int, ...]]]:
        """``output_to_operand_aliasing={{1}: (0, {}), ...}`` (a fusion or custom call
        that writes an output into an operand's buffer): output index -> (operand number,
        index in the operand); {} when none."""
        return _aliases(self.attrs.get("output_to_operand_aliasing", ""))

    def int_list(self, key: str) -> tuple[int, ...]:
        """An attribute of integers such as ``dimensions={1}`` or ``index=0``."""
        return tuple(int(v) for v in re.findall(r"-?\d+", self.attrs.get(key, "")))


@dataclass(frozen=True, eq=False)
class HloComputation:
    """One computation: its instructions in the order printed (the schedule, in a
    scheduled module).

    Attributes:
        name: its name without ``%``.
        instructions: in order.
        is_entry: the module's ENTRY computation.
        line: the 1-based line of its header.
        execution_thread: the thread it runs on, ``main`` unless its closing brace names
            another (``}, execution_thread="sparsecore"``).
    """

    name: str
    instructions: tuple[HloInstruction, ...]
    is_entry: bool = False
    line: int = 0
    execution_thread: str = "main"
    by_name: dict[str, HloInstruction] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.by_name.update({i.name: i for i in self.instructions})

    @property
    def root(self) -> HloInstruction:
        """The ROOT instruction (the last one when none is marked)."""
        return next((i for i in self.instructions if i.is_root), self.instructions[-1])

    def parameter(self, index: int) -> HloInstruction | None:
        """Its ``parameter(index)`` instruction."""
        return next((i for i in self.instructions
                     if i.opcode == "parameter" and i.literal.strip() == str(index)), None)

    def users(self) -> dict[str, list[HloInstruction]]:
        """Operand name -> the instructions that read it."""
        out: dict[str, list[HloInstruction]] = {}
        for instr in self.instructions:
            for op in instr.operands:
                out.setdefault(op, []).append(instr)
        return out


@dataclass(frozen=True, eq=False)
class HloModule:
    """A parsed HLO module.

    Attributes:
        name: the module's name (``HloModule name``).
        computations: name -> computation.
        entry: the ENTRY computation's name.
        attrs: the header's attributes (``num_partitions``, ``is_scheduled``, ...).
        frames: stack frame id -> its frame (``pod.hlo.frames``); {} when the module has
            no source tables.
    """

    name: str
    computations: dict[str, HloComputation]
    entry: str
    attrs: dict[str, str] = field(default_factory=dict)
    frames: dict[str, StackFrame] = field(default_factory=dict)
    _stacks: dict[str, tuple[StackFrame, ...]] = field(default_factory=dict, init=False,
                                                       repr=False)

    @property
    def entry_computation(self) -> HloComputation:
        """The ENTRY computation."""
        return self.computations[self.entry]

    @property
    def num_partitions(self) -> int:
        """SPMD partitions (devices) the module was compiled for (1 when not said)."""
        return int(self.attrs.get("num_partitions", "1") or 1)

    @property
    def replica_count(self) -> int:
        """Replicas the module was compiled for (1 when not said)."""
        return int(self.attrs.get("replica_count", "1") or 1)

    @property
    def devices(self) -> int:
        """Devices the module runs on: replicas x partitions."""
        return self.num_partitions * self.replica_count

    @property
    def output_aliases(self) -> dict[tuple[int, ...], tuple[int, tuple[int, ...]]]:
        """The header's ``input_output_alias``: output index -> (parameter number,
        index in the parameter), e.g. ``{ {0}: (0, {}, may-alias) }`` -> {(0,): (0, ())}: the
        output is written into the donated argument's buffer ({} when none)."""
        return _aliases(self.attrs.get("input_output_alias", ""))

    @property
    def is_scheduled(self) -> bool:
        """XLA scheduled it (``is_scheduled=true``): the printed order is the order run."""
        return self.attrs.get("is_scheduled", "") == "true"

    def stack_of(self, instr: HloInstruction) -> tuple[StackFrame, ...]:
        """The stack frames of ``instr``'s ``stack_frame_id``, innermost first, each call
        site once (``pod.hlo.frames.stack``); () without one."""
        frame = instr.metadata.get("stack_frame_id", "")
        if frame not in self._stacks:
            self._stacks[frame] = stack(self.frames, frame)
        return self._stacks[frame]

    def source_of(self, instr: HloInstruction) -> str:
        """Where the user wrote ``instr``: "file:line (function)" of the innermost frame of
        its stack that is the user's own code, not a framework's
        (``pod.hlo.frames.is_library_file``; the innermost frame when none is), else its
        ``source_file`` / ``source_line`` metadata; "" when unknown."""
        frame = user_frame(self.stack_of(instr))
        if frame is not None:
            return frame.describe()
        meta = instr.metadata
        if meta.get("source_file"):
            return f"{meta['source_file'].rsplit('/', 1)[-1]}:{meta.get('source_line', '?')}"
        return ""

    def call_chain_of(self, instr: HloInstruction) -> str:
        """The functions that led to ``instr``, outermost to innermost, joined by " > ",
        from the function jax compiled (``pod.hlo.frames.call_chain``), e.g. "train_step >
        loss_fn > Decoder.__call__ > attention"; "" when it has no stack frame."""
        return call_chain(self.stack_of(instr), self.name)

    def instructions(self) -> Iterator[tuple[HloComputation, HloInstruction]]:
        """Every (computation, instruction) of the module."""
        for comp in self.computations.values():
            for instr in comp.instructions:
                yield comp, instr


def _index(text: str) -> tuple[int, ...]:
    """"0, 1" -> (0, 1); "" -> ()."""
    return tuple(int(v) for v in text.replace(" ", "").split(",") if v)


def _aliases(text: str) -> dict[tuple[int, ...], tuple[int, tuple[int, ...]]]:
    """``{ {0}: (0, {}, may-alias), {1}: (2, {1}) }`` -> {(0,): (0, ()), (1,): (2, (1,))}."""
    return {_index(out): (int(number), _index(within))
            for out, number, within in _ALIAS.findall(text)}


def _parse_instruction(text: str, number: int) -> HloInstruction:
    match = _INSTRUCTION.match(text)
    if not match:
        raise HloParseError(number, f"not an instruction: {text[:80]!r}")
    root, name, rest = bool(match.group(1)), match.group(2), match.group(3)
    try:
        shape_text, rest = _read_shape(rest)
        shape = parse_shape(shape_text)
    except ValueError as err:
        raise HloParseError(number, f"{name}: {err}") from None
    op = _OPCODE.match(rest)
    if not op:
        raise HloParseError(number, f"{name}: no opcode after the shape: {rest[:60]!r}")
    opcode = op.group(1)
    start = op.end() - 1
    end = _closing(rest, start)
    if end < 0:
        raise HloParseError(number, f"{name}: unbalanced parentheses after {opcode}")
    inside, tail = rest[start + 1:end - 1], rest[end:]
    literal, operands = "", []
    if opcode in ("constant", "parameter", "iota", "partition-id", "replica-id", "after-all"):
        literal = inside
    else:
        for part in split_top(inside):
            token = part.split()[-1]
            if not token.startswith("%") and not re.fullmatch(r"[A-Za-z_][\w.\-]*", token):
                raise HloParseError(number, f"{name}: operand {part[:40]!r} is not a name")
            operands.append(token.lstrip("%"))
    attrs: dict[str, str] = {}
    for part in split_top(tail.lstrip(", ")):
        key, sep, value = part.partition("=")
        if sep:
            attrs[key.strip()] = value.strip()
    return HloInstruction(name, opcode, shape, tuple(operands), attrs, number, root, literal)


def parse_hlo(text: str) -> HloModule:
    """Parse the text of an HLO module.

    Args:
        text: one module as XLA prints it.

    Returns:
        The :class:`HloModule`.

    Raises:
        HloParseError: a line that is neither a header, an instruction, a closing
            brace nor a source table; an instruction whose shape or operands do not
            parse; a computation called but not defined; no ENTRY computation. The
            message starts with the line number.
    """
    name, header_attrs = "", {}
    computations: dict[str, HloComputation] = {}
    entry = ""
    current: tuple[str, bool, int] | None = None
    body: list[HloInstruction] = []
    tables: list[tuple[int, str]] = []
    pending, first = "", 0  # an instruction XLA printed over several lines, and its first
    for number, raw in enumerate(text.splitlines(), 1):
        line = _COMMENT.sub("", raw).strip()
        if pending:
            line, number, pending = f"{pending} {line}", first, ""
        elif not line or line.startswith("//") or line.startswith("#"):
            continue
        if current is None and line.startswith("HloModule"):
            head, _, rest = line.partition(",")
            name = head.split(None, 1)[1].strip() if len(head.split()) > 1 else ""
            for part in split_top(rest):
                key, _, value = part.partition("=")
                header_attrs[key.strip()] = value.strip()
            continue
        if current is None:
            match = _HEADER.match(line)
            if match and ("->" in match.group(3) or not match.group(3)
                          or match.group(3).startswith("(")):
                current = (match.group(2), bool(match.group(1)), number)
                body = []
                continue
            tables.append((number, line))
            if re.match(r"^(\d+\s|FileNames|FunctionNames|FileLocations|StackFrames)", line):
                continue
            raise HloParseError(number, f"expected a computation header, got {line[:80]!r}")
        if line == "}" or line.startswith("},"):
            # a computation that runs on another execution thread closes with its name
            # (libtpu 0.0.50's SparseCore gathers: `}, execution_thread="sparsecore"`)
            comp_name, is_entry, start = current
            if not body:
                raise HloParseError(start, f"computation {comp_name} has no instructions")
            thread = re.search(r'execution_thread="([^"]*)"', line)
            computations[comp_name] = HloComputation(comp_name, tuple(body), is_entry, start,
                                                     thread.group(1) if thread else "main")
            entry = comp_name if is_entry else entry
            current = None
            continue
        if _open_braces(line) > 0:  # continued on the next line
            pending, first = line, number
            continue
        body.append(_parse_instruction(line, number))
    if pending:
        raise HloParseError(first, f"braces not closed: {pending[:80]!r}")
    if current is not None:
        raise HloParseError(current[2], f"computation {current[0]} is not closed by '}}'")
    if not computations:
        raise HloParseError(0, "no HLO computation in the text (is it an HLO module?)")
    if not entry:
        raise HloParseError(0, "no ENTRY computation in the module")
    for comp in computations.values():
        for instr in comp.instructions:
            missing = [c for c in instr.called if c not in computations]
            if missing:
                raise HloParseError(instr.line, f"{instr.name} calls {missing[0]}, which the "
                                                "module does not define")
    return HloModule(name, computations, entry, header_attrs, read_frames(tables))

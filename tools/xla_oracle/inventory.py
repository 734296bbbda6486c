"""The op inventory of a compiled (scheduled, partitioned) HLO module, from its text.

Pure Python (no jax): the fast tests run it on a committed snippet. It reads the text
``compiled.as_text()`` prints for a TPU, walks the call graph from the ENTRY computation and
counts, per step:

- every collective (``all-gather``, ``all-reduce``, ``reduce-scatter``, ``all-to-all``,
  ``collective-permute``, their ``-start`` forms, ``send`` / ``recv``, ``ragged-all-to-all``,
  ``collective-broadcast``), with its dtype, result and operand bytes, replica-group size,
  number of groups and the form the groups were written in (explicit ``{{0,1},...}``, iota
  ``[4,2]<=[8]``, or the ``mesh['axis_0'=4,...] {'axis_0'}`` form), and whether it sits in
  an async collective fusion (XLA TPU's ``AsyncCollectiveStart``). One collective of an
  async collective fusion is printed up to three times (in the start fusion, in the compute
  fusion it overlaps with, in the done fusion), all with its ``channel_id``: it is counted
  once per channel. XLA TPU writes a reduce-scatter as an ``all-reduce`` whose result a
  ``dynamic-slice`` takes (a ``kCustom`` fusion named ``all-reduce-scatter...``): it is
  counted as a ``reduce-scatter`` (operand: the all-reduce's input; result: the slice). An
  ``all-reduce`` elsewhere whose every user keeps only 1 / group size of its result (a
  dynamic-slice fused with a convert, as the scanned gradients are written) stays an
  all-reduce, marked ``scattered``.
- fusions by kind (``kLoop``, ``kInput``, ``kOutput``, ``kCustom``), custom calls by target.

Counts are per step: an op in a ``while`` body counts its loop's trip count (read from
``known_trip_count`` in the loop's backend_config when present, else from the condition's
``compare(counter, constant)``, the form ``jax.lax.scan`` compiles to, assuming the counter
starts at 0), nested loops multiply. Conditional branches are each counted once (an upper
bound; ``branches_counted`` says how many).

Bytes are logical (elements x dtype size), not the tiled, padded layout.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DTYPE_BYTES", "parse_module", "shape_bytes", "replica_groups", "op_inventory",
           "HloParseError"]

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
               "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
               "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3b11fnuz": 1, "f8e4m3fnuz": 1,
               "f8e5m2fnuz": 1, "s4": 0.5, "u4": 0.5, "token": 0}

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute",
               "ragged-all-to-all", "collective-broadcast", "send", "recv")

_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_COMP_HEADER = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*\((.*)\)\s*->\s*(.*?)\s*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")


class HloParseError(ValueError):
    """HLO text the inventory cannot read; the message names the line."""


@dataclass
class Instruction:
    name: str
    shape: str        # the result type text, e.g. "bf16[4,2048]{1,0}" or "(f32[], ...)"
    opcode: str
    operands: list[str]
    attrs: str        # everything after the operand list
    is_root: bool = False


@dataclass
class Computation:
    name: str
    is_entry: bool
    params: dict[str, str] = field(default_factory=dict)   # name -> shape text
    instructions: list[Instruction] = field(default_factory=list)
    shapes: dict[str, str] = field(default_factory=dict)    # instruction name -> shape

    def shape_of(self, name: str) -> str | None:
        """The result type of instruction or parameter ``name``."""
        return self.shapes.get(name) or self.params.get(name)


def shape_bytes(shape: str) -> float:
    """Logical bytes of a shape text (an array or a tuple of arrays): elements x dtype size.

    >>> shape_bytes("(bf16[4,2]{1,0}, f32[3])")
    28.0
    """
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape):
        if dtype not in DTYPE_BYTES:
            continue
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        total += n * DTYPE_BYTES[dtype]
    return total


def _dtypes(shape: str) -> list[str]:
    return [d for d, _ in _ARRAY.findall(shape) if d in DTYPE_BYTES and d != "token"]


def _split_top(text: str, sep: str = ",") -> list[str]:
    """Split at ``sep`` outside brackets, braces and parentheses."""
    out: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == sep and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


def _matching(text: str, start: int) -> int:
    """Index of the bracket closing the one at ``start``."""
    pairs = {"(": ")", "[": "]", "{": "}"}
    depth = 0
    for i in range(start, len(text)):
        if text[i] in pairs:
            depth += 1
        elif text[i] in pairs.values():
            depth -= 1
            if depth == 0:
                return i
    raise HloParseError(f"unbalanced brackets in {text[:80]!r}")


def _parse_instruction(line: str, lineno: int) -> Instruction | None:
    m = _INSTR.match(line)
    if not m:
        return None
    is_root, name, rest = bool(m.group(1)), m.group(2), m.group(3)
    # the result type: a tuple "( ... )" or one array "dtype[dims]{layout}"
    if rest.startswith("("):
        end = _matching(rest, 0)
        shape, rest = rest[:end + 1], rest[end + 1:].lstrip()
    else:
        sm = re.match(r"^(\S+?\[[^\]]*\](?:\{[^}]*\})?|\S+\[\]|token\[\])\s*", rest)
        if not sm:
            raise HloParseError(f"line {lineno}: cannot read the type of {name}: {rest[:60]!r}")
        shape, rest = sm.group(1), rest[sm.end():]
    om = re.match(r"^([a-z][a-z0-9\-_.]*)\(", rest)
    if not om:
        raise HloParseError(f"line {lineno}: cannot read the opcode of {name}: {rest[:60]!r}")
    opcode = om.group(1)
    start = om.end() - 1
    end = _matching(rest, start)
    operands = [o.split()[-1].lstrip("%") for o in _split_top(rest[start + 1:end]) if o]
    attrs = rest[end + 1:]
    return Instruction(name.lstrip("%"), shape, opcode, operands, attrs, is_root)


def parse_module(text: str) -> dict[str, Computation]:
    """HLO module text -> computations by name (the ENTRY one has ``is_entry``).

    Raises:
        HloParseError: a line that starts an instruction but cannot be read, naming its
            line number; a module with no ENTRY computation.
    """
    comps: dict[str, Computation] = {}
    current: Computation | None = None
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.rstrip()
        if not line or line.startswith("HloModule") or line.lstrip().startswith("//"):
            continue
        if current is None:
            m = _COMP_HEADER.match(line)
            if m:
                current = Computation(m.group(2).lstrip("%"), bool(m.group(1)))
                for p in _split_top(m.group(3)):
                    if ":" in p:
                        pname, pshape = p.split(":", 1)
                        current.params[pname.strip().lstrip("%")] = pshape.strip()
            continue
        if line.strip() == "}":
            comps[current.name] = current
            current = None
            continue
        ins = _parse_instruction(line, lineno)
        if ins is not None:
            current.instructions.append(ins)
            current.shapes[ins.name] = ins.shape
    if not any(c.is_entry for c in comps.values()):
        raise HloParseError("no ENTRY computation in the HLO text")
    return comps


def replica_groups(attrs: str, num_devices: int | None = None) -> dict[str, Any] | None:
    """The replica groups of a collective's attributes: form, group size, group count.

    Forms: ``explicit`` (``{{0,1},{2,3}}``), ``iota`` (``[2,2]<=[4]``, optionally
    transposed), ``mesh`` (``mesh['axis_0'=4,'axis_1'=2] {'axis_0'}``; a sub-axis
    ``'axis_0':(2)2`` counts its size, the number after the parenthesis), ``pairs``
    (``source_target_pairs`` of a collective-permute). None when the op has none.
    """
    m = re.search(r"replica_groups=(\{\{.*?\}\}|\{\})", attrs)
    if m:
        groups = re.findall(r"\{([0-9,\s]*)\}", m.group(1)[1:-1]) if m.group(1) != "{}" else []
        sizes = [len([x for x in g.split(",") if x.strip()]) for g in groups]
        if not sizes:
            return {"form": "explicit", "group_size": num_devices, "groups": 1,
                    "text": m.group(1)}
        return {"form": "explicit", "group_size": sizes[0], "groups": len(sizes),
                "text": m.group(1)[:200]}
    m = re.search(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](T\([0-9,]+\))?", attrs)
    if m:
        dims = [int(x) for x in m.group(1).split(",")]
        return {"form": "iota", "group_size": dims[-1], "groups": math.prod(dims[:-1]),
                "text": m.group(0).removeprefix("replica_groups=")}
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*"
                  r"(?:,\s*device_ids=\((?:[^()]|\([^()]*\))*\)\s*)?\{([^}]*)\}", attrs)
    if m:
        axes = dict((k.strip("' "), int(v)) for k, v in
                    (a.split("=") for a in m.group(1).split(",") if "=" in a))
        total = math.prod(axes.values())
        size = 1
        for part in _split_top(m.group(2)):
            part = part.strip()
            if not part:
                continue
            sub = re.match(r"'([^']+)'\s*:\s*\((\d+)\)\s*(\d+)", part)
            if sub:
                size *= int(sub.group(3))
            else:
                size *= axes.get(part.strip("'"), 1)
        text = attrs[m.start():m.end()].removeprefix("replica_groups=")
        return {"form": "mesh", "group_size": size, "groups": total // max(size, 1),
                "text": text[:200]}
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
    if m:
        pairs = re.findall(r"\{(\d+),(\d+)\}", m.group(0))
        return {"form": "pairs", "group_size": 2, "groups": len(pairs),
                "text": f"{len(pairs)} source-target pairs"}
    return None


def _constant_value(comp: Computation, name: str, depth: int = 0) -> int | None:
    """The integer constant ``name`` holds in ``comp``, through copies and bitcasts."""
    ins = next((i for i in comp.instructions if i.name == name), None)
    if ins is None or depth > 8:
        return None
    if ins.opcode == "constant" and ins.operands and re.fullmatch(r"-?\d+", ins.operands[0]):
        return int(ins.operands[0])
    if ins.opcode in ("copy", "bitcast", "convert") and ins.operands:
        return _constant_value(comp, ins.operands[0], depth + 1)
    return None


def _trip_count(ins: Instruction, caller: Computation,
                comps: dict[str, Computation]) -> tuple[int, str]:
    """A while loop's trip count and where it was read: ``known_trip_count`` in its
    backend_config, else ``bound - start`` from the condition's root ``compare(counter,
    constant)`` and the counter's constant initial value in the loop's init tuple (0 if
    that cannot be read, said so)."""
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', ins.attrs)
    if m:
        return int(m.group(1)), "known_trip_count"
    cm = re.search(r"condition=%?([^\s,]+)", ins.attrs)
    cond = comps.get(cm.group(1)) if cm else None
    if cond is None:
        return 1, "unknown (counted once)"
    root = next((i for i in cond.instructions if i.is_root), None)
    direction = re.search(r"direction=(\w+)", root.attrs) if root else None
    if root is None or root.opcode != "compare" or direction is None:
        return 1, "unknown (counted once)"
    bound = index = None
    for op in root.operands:
        value = _constant_value(cond, op)
        if value is not None:
            bound = value
            continue
        gte = next((i for i in cond.instructions if i.name == op), None)
        if gte is not None and gte.opcode == "get-tuple-element":
            im = re.search(r"index=(\d+)", gte.attrs)
            index = int(im.group(1)) if im else None
    if bound is None:
        return 1, "unknown (counted once)"
    start, how = 0, "condition compare, counter from 0 (assumed)"
    init = next((i for i in caller.instructions if i.name == ins.operands[0]),
                None) if ins.operands else None
    if init is not None and init.opcode == "tuple" and index is not None \
            and index < len(init.operands):
        value = _constant_value(caller, init.operands[index])
        if value is not None:
            start, how = value, "condition compare and the counter's initial value"
    n = bound - start + (1 if direction.group(1) == "LE" else 0)
    return max(n, 0), how


def _elements(shape: str) -> int:
    return sum(math.prod(int(d) for d in dims.split(",") if d) if dims else 1
               for dtype, dims in _ARRAY.findall(shape) if dtype in DTYPE_BYTES)


def _only_shards_used(comp: Computation, ins: Instruction, group_size: int) -> bool:
    """True when every user of all-reduce ``ins`` in its computation produces 1 /
    ``group_size`` of its elements: a reduce-scatter written as an all-reduce whose result
    each device slices (a ``dynamic-slice``, or a fusion holding one)."""
    if ins.shape.startswith("(") or group_size <= 1:
        return False
    users = [i for i in comp.instructions if ins.name in i.operands]
    whole = _elements(ins.shape)
    return bool(users) and all(
        u.opcode in ("dynamic-slice", "fusion") and _elements(u.shape) * group_size == whole
        for u in users)


def _called(ins: Instruction) -> list[tuple[str, str]]:
    """(role, computation name) pairs this instruction calls."""
    out = []
    for m in re.finditer(r"\b(calls|body|branch_computations|called_computations)="
                         r"(\{[^}]*\}|%?[^\s,}]+)", ins.attrs):
        names = m.group(2).strip("{}")
        for n in names.split(","):
            n = n.strip().lstrip("%")
            if n:
                out.append((m.group(1), n))
    return out


def op_inventory(text: str) -> dict[str, Any]:
    """The op inventory of an HLO module's text (see the module docstring).

    Returns:
        ``{"collectives": [...], "collective_totals": {...}, "fusions": {...},
        "custom_calls": {...}, "while_loops": [...], "instructions": n}``; each collective
        entry: op, dtype, result_bytes, operand_bytes, replica_groups (form, group_size,
        groups, text), async, count (per step), computation, op_name (the JAX source).

    Raises:
        HloParseError: text that does not parse.
    """
    comps = parse_module(text)
    entry = next(c for c in comps.values() if c.is_entry)
    multiplicity: dict[str, int] = defaultdict(int)
    loops: list[dict[str, Any]] = []
    branches = 0

    def visit(comp: Computation, mult: int, depth: int = 0) -> None:
        nonlocal branches
        if depth > 64:
            raise HloParseError(f"call depth over 64 at {comp.name}")
        multiplicity[comp.name] += mult
        for ins in comp.instructions:
            for role, name in _called(ins):
                callee = comps.get(name)
                if callee is None:
                    continue
                if ins.opcode == "while" and role == "body":
                    trips, how = _trip_count(ins, comp, comps)
                    loops.append({"name": ins.name, "body": name, "trip_count": trips,
                                  "from": how, "times_entered": mult})
                    visit(callee, mult * trips, depth + 1)
                elif role == "branch_computations":
                    branches += 1
                    visit(callee, mult, depth + 1)
                else:
                    visit(callee, mult, depth + 1)

    visit(entry, 1)
    fusions: Counter[str] = Counter()
    custom_calls: Counter[str] = Counter()
    n_instr = 0
    # one logical collective can appear up to three times: in the async start fusion, in
    # the compute fusion it overlaps with, and in the done fusion, all with its channel_id
    by_channel: dict[str, dict[str, Any]] = {}
    for cname, mult in multiplicity.items():
        comp = comps[cname]
        root = next((i for i in comp.instructions if i.is_root), None)
        is_start = root is not None and 'custom_call_target="AsyncCollectiveStart"' in root.attrs
        for ins in comp.instructions:
            n_instr += mult
            if ins.opcode == "fusion":
                kind = re.search(r"kind=(\w+)", ins.attrs)
                fusions[kind.group(1) if kind else "?"] += mult
            elif ins.opcode == "custom-call":
                target = re.search(r'custom_call_target="([^"]+)"', ins.attrs)
                custom_calls[target.group(1) if target else "?"] += mult
            base = ins.opcode.removesuffix("-start")
            if base not in COLLECTIVES or ins.opcode.endswith("-done"):
                continue
            channel = re.search(r"channel_id=(\d+)", ins.attrs)
            key = channel.group(1) if channel else f"{cname}/{ins.name}"
            seen = by_channel.get(key)
            is_async = is_start or ins.opcode.endswith("-start")
            if seen is not None:
                seen["async"] = seen["async"] or is_async
                seen["mult"] = max(seen["mult"], mult)
                if is_start:
                    seen.update(comp=comp, ins=ins)
                continue
            by_channel[key] = {"comp": comp, "ins": ins, "mult": mult, "async": is_async}
    collectives: dict[tuple, dict[str, Any]] = {}
    for found in by_channel.values():
        comp, ins, mult = found["comp"], found["ins"], found["mult"]
        base = ins.opcode.removesuffix("-start")
        operand_bytes = sum(shape_bytes(comp.shape_of(o) or "") for o in ins.operands)
        result_shape = ins.shape
        if ins.opcode.endswith("-start") and ins.shape.startswith("("):
            # (operand, result, contexts...): the result is the second element
            parts = _split_top(ins.shape[1:-1])
            result_shape = parts[1] if len(parts) > 1 else ins.shape
        result_bytes = shape_bytes(result_shape)
        op = base
        groups = replica_groups(ins.attrs)
        scattered = False
        if base == "all-reduce":
            # XLA TPU's reduce-scatter fusion: an all-reduce whose result a dynamic-slice
            # takes, in a kCustom fusion named all-reduce-scatter
            scatter = next((i for i in comp.instructions if i.opcode == "dynamic-slice"
                            and i.operands and i.operands[0] == ins.name), None)
            if scatter is not None and comp.name.startswith("all-reduce-scatter"):
                op, result_bytes = "reduce-scatter", shape_bytes(scatter.shape)
            elif groups and groups["group_size"]:
                scattered = _only_shards_used(comp, ins, groups["group_size"])

        dtypes = _dtypes(result_shape) or _dtypes(ins.shape)
        op_name = re.search(r'op_name="([^"]*)"', ins.attrs)
        key = (op, tuple(dtypes[:1]), result_bytes, operand_bytes,
               groups["text"] if groups else None, found["async"], scattered)
        row = collectives.setdefault(key, {
            "op": op, "dtype": dtypes[0] if dtypes else None,
            "result_bytes": result_bytes, "operand_bytes": operand_bytes,
            "replica_groups": groups, "async": found["async"], "scattered": scattered,
            "count": 0,
            "instructions": 0, "example": ins.name,
            "op_name": op_name.group(1)[:160] if op_name else None})
        row["count"] += mult
        row["instructions"] += 1
    rows = sorted(collectives.values(), key=lambda r: (-r["count"] * r["result_bytes"], r["op"]))
    totals: dict[str, dict[str, float]] = {}
    for r in rows:
        t = totals.setdefault(r["op"], {"count": 0, "result_bytes": 0.0, "operand_bytes": 0.0})
        t["count"] += r["count"]
        t["result_bytes"] += r["count"] * r["result_bytes"]
        t["operand_bytes"] += r["count"] * r["operand_bytes"]
    return {"collectives": rows, "collective_totals": totals, "fusions": dict(fusions),
            "fusion_count": sum(fusions.values()), "custom_calls": dict(custom_calls),
            "while_loops": loops, "branches_counted": branches,
            "instructions_per_step": n_instr, "computations": len(comps)}

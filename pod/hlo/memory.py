"""HBM a module's step holds at its peak, read off its schedule.

XLA's buffer assignment (``compiled.memory_analysis()``) is the figure that
counts when a TPU compile ran; for a module alone (an HLO dump, a CPU compile)
this is the estimate: walk the schedule, each buffer live from the instruction
that defines it to its last use (through the ops that only rename a buffer:
``bitcast``, ``get-tuple-element``, ``tuple``, a ``while`` of its state, an
in-place ``dynamic-update-slice`` or a fusion XLA aliases to an operand), and
take the largest sum. The entry's parameters live throughout (the caller holds
the arguments), its result to the end, except the outputs the module writes into
a donated argument's buffer (the header's ``input_output_alias``: an optimizer's
new weights and moments take the old ones' buffers); a loop adds its body's own
peak on top of what is live around it. Buffers in a TPU's VMEM (``S(1)``) or in host
memory (``S(5)``, XLA's host offload) are not HBM.

It is a lower bound on what XLA assigns (no fragmentation, no padding to
tiles, no scoped buffers of the kernels) and an upper bound on what a better
schedule would need.

Pure: no jax, no ray.
"""

from __future__ import annotations

from pod.hlo.module import HOST_SPACE, VMEM_SPACE, HloComputation, HloInstruction, HloModule

#: Memory spaces that are not HBM: VMEM and host memory.
_NOT_HBM = (VMEM_SPACE, HOST_SPACE)

__all__ = ["peak_bytes"]

#: Ops whose result is (part of) an operand's buffer, not a new one.
_ALIASES = frozenset({"bitcast", "get-tuple-element", "tuple", "while", "copy-done",
                      "slice-done", "dynamic-slice-done", "dynamic-update-slice-done",
                      "async-done", "async-update", "all-gather-done", "all-reduce-done",
                      "collective-permute-done", "opt-barrier", "add-dependency", "reshape",
                      "dynamic-update-slice"})


def _in_place(module: HloModule, instr: HloInstruction) -> list[bool]:
    """Per leaf of a fusion's result: an update in place of an operand (the fused root's
    element is a ``dynamic-update-slice``: XLA writes it into the operand's buffer)."""
    comp = module.computations[instr.called[0]]
    root = comp.root
    parts = [comp.by_name.get(o) for o in root.operands] if root.opcode == "tuple" else [root]
    out = []
    for part in parts:
        while part is not None and part.opcode in ("bitcast", "reshape") and part.operands:
            part = comp.by_name.get(part.operands[0])
        out.append(part is not None and part.opcode == "dynamic-update-slice")
    return out


def _defined_bytes(module: HloModule, instr: HloInstruction) -> int:
    """HBM bytes of the new buffers ``instr`` defines (0 for an alias)."""
    if instr.opcode in _ALIASES or instr.opcode in ("parameter", "constant"):
        return 0
    if instr.opcode == "fusion" and "output_to_operand_aliasing" in instr.attrs:
        return 0
    leaves = instr.shape.leaves
    if instr.opcode == "fusion" and instr.called:
        in_place = _in_place(module, instr)
        if len(in_place) == len(leaves):
            leaves = tuple(a for a, done in zip(leaves, in_place, strict=True) if not done)
    if instr.opcode == "copy-start":
        leaves = leaves[:1]  # (destination, source, context)
    elif instr.opcode.endswith("-start"):
        leaves = leaves[len(instr.operands):] or leaves  # ((operands), results, context)
    return sum(a.nbytes for a in leaves if a.memory_space not in _NOT_HBM)


def _donated(module: HloModule) -> dict[str, int]:
    """Entry instruction -> bytes of its result the module returns in a donated argument's
    buffer (``HloModule.output_aliases``; a tuple root's elements, through bitcasts and one
    ``get-tuple-element``): XLA writes them there, so they are no new buffer."""
    entry = module.entry_computation
    root = entry.root
    out: dict[str, int] = {}
    for index in module.output_aliases:
        if root.opcode == "tuple" and len(index) == 1 and index[0] < len(root.operands):
            instr = entry.by_name.get(root.operands[index[0]])
        elif root.opcode != "tuple" and not index:
            instr = root
        else:
            continue
        while instr is not None and instr.opcode in ("bitcast", "reshape") and instr.operands:
            instr = entry.by_name.get(instr.operands[0])
        leaf = 0
        if instr is not None and instr.opcode == "get-tuple-element":
            leaf = int(instr.attrs.get("index", "0"))
            instr = entry.by_name.get(instr.operands[0])
        if instr is None or instr.opcode == "parameter" or leaf >= len(instr.shape.leaves):
            continue
        array = instr.shape.leaves[leaf]
        if array.memory_space not in _NOT_HBM:
            out[instr.name] = out.get(instr.name, 0) + array.nbytes
    return out


def _computation_peak(module: HloModule, comp: HloComputation, memo: dict[str, int],
                      donated: dict[str, int] | None = None) -> int:
    """The peak bytes of ``comp``'s own buffers (its parameters excluded; ``donated``:
    bytes of an instruction's result that live in an argument's buffer)."""
    if comp.name in memo:
        return memo[comp.name]
    memo[comp.name] = 0  # a recursive call costs nothing more
    instrs = comp.instructions
    index = {i.name: n for n, i in enumerate(instrs)}
    owners: dict[str, set[str]] = {}
    for instr in instrs:
        if instr.opcode in _ALIASES or (instr.opcode == "fusion" and (
                "output_to_operand_aliasing" in instr.attrs or (
                    instr.called and any(_in_place(module, instr))))):
            owners[instr.name] = set().union(*(owners.get(o, set()) for o in instr.operands))
        else:
            owners[instr.name] = {instr.name}
    last = {i.name: n for n, i in enumerate(instrs)}
    for n, instr in enumerate(instrs):
        for operand in instr.operands:
            for owner in owners.get(operand, ()):
                last[owner] = max(last[owner], n)
    for owner in owners.get(comp.root.name, ()):
        last[owner] = len(instrs)
    delta = [0] * (len(instrs) + 2)
    for instr in instrs:
        size = _defined_bytes(module, instr)
        if donated:
            size = max(0, size - donated.get(instr.name, 0))
        if size:
            delta[index[instr.name]] += size
            delta[last[instr.name] + 1] -= size
    live, peak = 0, 0
    for n, instr in enumerate(instrs):
        live += delta[n]
        inner = 0
        if instr.opcode == "while":
            inner = _computation_peak(module, module.computations[instr.attr_names("body")[0]],
                                      memo)
        elif instr.opcode in ("call", "conditional"):
            inner = max(_computation_peak(module, module.computations[c], memo)
                        for c in instr.called)
        peak = max(peak, live + inner)
    memo[comp.name] = peak
    return peak


def peak_bytes(module: HloModule) -> int:
    """HBM bytes one device holds at the step's peak (module docstring): the entry's
    parameters plus the peak of its own buffers.

    Args:
        module: the parsed module.

    Returns:
        Bytes, int >= 0.
    """
    entry = module.entry_computation
    params = sum(sum(a.nbytes for a in i.shape.leaves if a.memory_space not in _NOT_HBM)
                 for i in entry.instructions if i.opcode == "parameter")
    return params + _computation_peak(module, entry, {}, _donated(module))

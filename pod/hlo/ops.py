"""What one HLO op costs on a TensorCore: the chip model applied to XLA's ops.

Each top-level instruction of a scheduled module is one kernel the TensorCore
runs (XLA's fusions are its kernels). Its cost comes from the ``chip``
package, as the built-in programs' ops do:

- ``convolution`` / ``dot`` (alone or inside a fusion): ``TensorCore.account_kernel``
  with one GEMM per product (M, K, N and batch from the dot's dimension numbers
  or the convolution's ``dim_labels`` and window: the multiply-adds it really
  does, padding taps excluded) and the fusion's HBM traffic; the fusion's other
  element-wise work runs on the VPU beside the MXU as an epilogue
  (``account_vector(fused="previous")``: it adds only what the MXU and HBM time
  does not cover);
- element-wise, reduce and data-movement fusions and ops: ``account_vector``:
  the element-ops of every instruction (a transcendental one weighs
  ``transcendental_cycles_per_element_op``; at least one per output element) and
  the HBM bytes the kernel reads and writes;
- ``copy`` / ``transpose`` / other data movement alone: ``account_vector`` of
  its bytes (one op per element, as the calibration row C5 costs a copy);
- a Pallas / Mosaic kernel (``custom-call``): the project's kernel model where
  it has one (flash attention, ``pod.workloads.flash``); otherwise XLA's own
  ``estimated_cycles``, named "[XLA estimate]"; with neither it is refused
  (``HloOpError``), never costed as zero.

HBM bytes of a kernel: its operands and outputs, except buffers in a TPU's
VMEM (layout ``S(1)``: XLA's memory-space assignment put them there), a
parameter the kernel only slices (it reads the slice), an output updated in
place (``dynamic-update-slice``: it writes the update), and the buffers an async
collective fusion carries through a compute kernel (its DMA moves them, not
the kernel).

With ``approximate`` (an HLO module compiled for CPU devices, which XLA does not
fuse as it does for a TPU and computes in float32) the project's own fusion
rules stand in for XLA's TPU fusion (``pod.workloads.fusion``): a dot runs as
the TPU runs it by default (bf16 inputs in one MXU pass, bf16 bytes in HBM),
element-wise consumers of a dot are its epilogue (no HBM bytes), converts and
layout changes feeding only dots are folded into the dot's read, and fusions
of converts alone (the CPU's bf16 <-> float32 promotions) cost nothing.

Pure: no jax, no ray.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from chip import OpRecord, TensorCore, TensorCoreSpec
from pod.errors import HloOpError
from pod.hlo.module import ArrayShape, HloComputation, HloInstruction, HloModule, Shape

__all__ = ["OpCost", "OpCoster", "ELEMENTWISE", "TRANSCENDENTAL", "MOVEMENT", "FREE",
           "COLLECTIVE_OPCODES", "gemm_dims", "short_name", "instruction_of",
           "XLA_ESTIMATE_SUFFIX", "SparseCoreWork", "sparsecore_work"]

#: Element-wise ops: one VPU element-op per output element.
ELEMENTWISE = frozenset({
    "add", "subtract", "multiply", "divide", "maximum", "minimum", "compare", "select", "and",
    "or", "xor", "not", "negate", "abs", "sign", "convert", "clamp", "floor", "ceil",
    "round-nearest-afz", "round-nearest-even", "remainder", "shift-left",
    "shift-right-arithmetic", "shift-right-logical", "popcnt", "count-leading-zeros",
    "is-finite", "real", "imag", "complex", "bitcast-convert", "reduce-precision",
    "stochastic-convert", "map", "rng", "rng-bit-generator", "rng-get-and-update-state",
})
#: Transcendental ops: ``TensorCoreSpec.transcendental_cycles_per_element_op`` element-ops.
TRANSCENDENTAL = frozenset({
    "exponential", "exponential-minus-one", "log", "log-plus-one", "tanh", "logistic", "sqrt",
    "rsqrt", "cbrt", "sine", "cosine", "tan", "erf", "power", "atan2",
})
#: Data movement: no arithmetic; alone, a kernel of its bytes.
MOVEMENT = frozenset({
    "broadcast", "reshape", "transpose", "copy", "slice", "dynamic-slice",
    "dynamic-update-slice", "concatenate", "pad", "reverse", "gather", "iota",
})
#: No kernel at all: names for buffers, tuples, ids and ordering tokens.
FREE = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
    "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain",
    "get-dimension-size", "set-dimension-size",
})
#: Collectives (costed by ``pod.hlo.groups``, placed by ``pod.hlo.program``).
COLLECTIVE_OPCODES = frozenset({
    "all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute",
    "collective-broadcast", "ragged-all-to-all",
})
#: Custom calls that are bookkeeping, not work (XLA TPU's buffer and concat markers).
FREE_CUSTOM_CALLS = frozenset({
    "AllocateBuffer", "ConcatBitcast", "AsyncCollectiveStart", "AsyncCollectiveDone",
    "Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape", "MoveToHost", "MoveToDevice",
    "annotate_device_placement", "LayoutConstraint", "AssumeGatherIndicesInBound",
    "GatherScatterIndicesBitpacked",
    "X64Combine", "X64SplitLow",
    "X64SplitHigh", "PadToStatic", "SliceToDynamic",
})


@dataclass(frozen=True)
class OpCost:
    """One kernel's simulated cost.

    Attributes:
        records: its op records (``chip.OpRecord``): the kernel and its fused VPU
            work; empty for an op that costs nothing or is folded into another.
        how: how it was costed: "mxu", "vpu", "hbm", "flash kernel model",
            "XLA estimate", "free", "folded into <name>".
        xla_seconds: XLA's own estimate of the op (``estimated_cycles`` / clock),
            None when the module has none.
    """

    records: tuple[OpRecord, ...]
    how: str
    xla_seconds: float | None = None

    @property
    def seconds(self) -> float:
        """Simulated seconds the kernel adds to the compute stream."""
        return sum(r.seconds for r in self.records)

    @property
    def flops(self) -> float:
        """MXU FLOPs (2 per multiply-accumulate)."""
        return sum(r.flops for r in self.records if r.unit == "mxu")


_NONE = OpCost((), "free")


def short_name(instr: HloInstruction) -> str:
    """A readable record name: the op name's last two parts and the instruction,
    e.g. "closed_call/dot_general [fusion.12]"."""
    op = instr.op_name
    tail = "/".join(op.split("/")[-2:]) if op else instr.opcode
    return f"{tail} [{instr.name}]"


#: What a record's name adds after :func:`short_name` for an op costed by XLA's own
#: ``estimated_cycles`` (a custom call the chip model has no kernel model of).
XLA_ESTIMATE_SUFFIX = " [XLA estimate]"


def instruction_of(record_name: str) -> str:
    """The instruction a record named by :func:`short_name` is of ("fusion.12"), with or
    without :data:`XLA_ESTIMATE_SUFFIX`; "" for another name."""
    head, bracket, rest = record_name.removesuffix(XLA_ESTIMATE_SUFFIX).rpartition(" [")
    return rest[:-1] if bracket and rest.endswith("]") else ""


def gemm_dims(instr: HloInstruction, shapes: dict[str, Shape]) -> tuple[int, int, int, int]:
    """(M, K, N, batch) of a ``dot`` or ``convolution``: the GEMMs the MXU runs.

    A dot's batch dimensions are the batch, its contracting ones K, the others
    M (lhs) and N (rhs). A convolution is its im2col GEMM: M = batch x output
    positions, N = output features per group, K = input features per group x the
    kernel taps that fall on the input (padding and dilation holes excluded, so
    a dot XLA wrote as a padded convolution costs what the dot does), batch =
    feature groups x batch groups. A spatial axis of one input position whose
    every output position reads a tap of its own (XLA TPU's ``bte,end->btnd``
    written as a convolution over the heads: ``window={size=1xH pad=0_0x(H-1)_(H-1)
    rhs_reversal=0x1}``) is an output-feature axis of the GEMM: it multiplies N, not
    M (the weights of each head side by side, as the dot's N = heads x head
    dimension; XLA's own ``estimated_cycles`` put T8's query projection, written so,
    10% above its output projection of the same FLOPs, a dot, where an N of one head,
    128, would double it on v6e's 256-wide MXU).

    Args:
        instr: the dot or convolution.
        shapes: operand name -> shape.

    Returns:
        (M, K, N, batch), ints >= 0 (K rounded up).
    """
    lhs, rhs = (shapes[o].array for o in instr.operands[:2])
    if instr.opcode == "dot":
        lb, lc = set(instr.int_list("lhs_batch_dims")), set(instr.int_list("lhs_contracting_dims"))
        rb, rc = set(instr.int_list("rhs_batch_dims")), set(instr.int_list("rhs_contracting_dims"))
        batch = math.prod(lhs.dims[d] for d in lb)
        k = math.prod(lhs.dims[d] for d in lc)
        m = math.prod(s for d, s in enumerate(lhs.dims) if d not in lb | lc)
        n = math.prod(s for d, s in enumerate(rhs.dims) if d not in rb | rc)
        return m, k, n, batch
    return _conv_dims(instr, lhs, rhs, instr.shape.array)


def _conv_dims(instr: HloInstruction, lhs: ArrayShape, rhs: ArrayShape,
               out: ArrayShape) -> tuple[int, int, int, int]:
    labels = instr.attrs.get("dim_labels", "bf_io->bf")
    lhs_l, rest = labels.split("_", 1)
    rhs_l, out_l = rest.split("->")
    window = _window(instr.attrs.get("window", ""))
    fgc = int(instr.attrs.get("feature_group_count", "1"))
    bgc = int(instr.attrs.get("batch_group_count", "1"))
    spatial = sorted(c for c in lhs_l if c.isdigit())
    taps, positions, columns = 1.0, 1, 1
    for axis, digit in enumerate(spatial):
        size_in = lhs.dims[lhs_l.index(digit)]
        size_k = rhs.dims[rhs_l.index(digit)]
        size_out = out.dims[out_l.index(digit)]
        w = {k: v[axis] if axis < len(v) else d for k, (v, d) in
             {key: (window.get(key, ()), default) for key, default in
              (("stride", 1), ("lhs_dilate", 1), ("rhs_dilate", 1), ("pad_lo", 0))}.items()}
        valid = _valid_taps(size_in, size_k, size_out, w)
        if size_in == 1 and size_out > 1 and valid == size_out:
            columns *= size_out  # each output reads its own tap: an output-feature axis
            continue
        taps *= valid / max(size_out, 1)
        positions *= size_out
    batch = lhs.dims[lhs_l.index("b")] // bgc
    groups = fgc * bgc
    n = out.dims[out_l.index("f")] // groups * columns
    k = math.ceil(lhs.dims[lhs_l.index("f")] // fgc * taps)
    return batch * positions, k, n, groups


def _window(text: str) -> dict[str, tuple[int, ...]]:
    """``window={size=1x4 pad=0_0x3_3 stride=2x2 ...}`` -> per field, per spatial axis."""
    out: dict[str, tuple[int, ...]] = {}
    for part in text.strip("{}").split():
        key, _, value = part.partition("=")
        if key == "pad":
            pads = [p.split("_") for p in value.split("x")]
            out["pad_lo"] = tuple(int(p[0]) for p in pads)
        elif key in ("size", "stride", "lhs_dilate", "rhs_dilate"):
            out[key] = tuple(int(v) for v in value.split("x"))
    return out


def _valid_taps(size_in: int, size_k: int, size_out: int, w: dict[str, int]) -> float:
    """Pairs (output position, kernel tap) of one spatial axis that read the input
    (not padding, not a dilation hole)."""
    if size_out * size_k > 10**7:  # too many to count: every tap
        return float(size_out * size_k)
    o = np.arange(size_out)[:, None]
    t = np.arange(size_k)[None, :]
    x = o * w["stride"] + t * w["rhs_dilate"] - w["pad_lo"]
    valid = (x >= 0) & (x <= (size_in - 1) * w["lhs_dilate"]) & (x % w["lhs_dilate"] == 0)
    return float(valid.sum())


@dataclass
class _Work:
    """What a fused computation does: its GEMMs and precision, its VPU element-ops."""

    gemms: list[tuple[int, int, int, int]] = field(default_factory=list)
    precision: str = "bf16"
    vpu_ops: float = 0.0
    elements: int = 0
    collective: bool = False
    custom: list[HloInstruction] = field(default_factory=list)


class OpCoster:
    """Costs a module's ops on one TensorCore (module docstring).

    Args:
        module: the parsed module.
        core_spec: the device's TensorCore (``device_chip_spec(chip).core``).
        sustained: MXU at its sustained efficiency (a training step: seconds of
            back-to-back work); False: each op from an idle start, as a
            benchmarked single op (the calibration rows C1-C4).
        approximate: a CPU-compiled module (module docstring).
    """

    def __init__(self, module: HloModule, core_spec: TensorCoreSpec, *, sustained: bool = True,
                 approximate: bool = False) -> None:
        self.module = module
        self.spec = core_spec
        self.approximate = approximate
        self._cores = {p: TensorCore(core_spec, numerics=False, execute=False, precision=p,
                                     sustained=sustained, name=f"hlo/{p}")
                       for p in ("bf16", "fp32", "int8")}
        self._cache: dict[int, OpCost] = {}
        self._folded: dict[int, str] = {}
        self._work: dict[str, _Work] = {}
        self._shapes: dict[str, dict[str, Shape]] = {}
        self._users: dict[str, dict[str, list[HloInstruction]]] = {}

    # -- public ------------------------------------------------------------------

    def cost(self, comp: HloComputation, instr: HloInstruction) -> OpCost:
        """The kernel ``instr`` of ``comp`` runs (collectives and control flow excluded:
        the caller handles them), cached per instruction.

        Raises:
            HloOpError: an op with no model and no XLA estimate.
        """
        key = id(instr)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cost(comp, instr)
            self._cache[key] = hit
        return hit

    def shapes(self, comp: HloComputation) -> dict[str, Shape]:
        """Instruction name -> shape in ``comp`` (kept per computation)."""
        hit = self._shapes.get(comp.name)
        if hit is None:
            hit = self._shapes[comp.name] = {i.name: i.shape for i in comp.instructions}
        return hit

    def users(self, comp: HloComputation) -> dict[str, list[HloInstruction]]:
        """Instruction name -> its users in ``comp`` (kept per computation)."""
        hit = self._users.get(comp.name)
        if hit is None:
            hit = self._users[comp.name] = comp.users()
        return hit

    # -- dispatch ----------------------------------------------------------------

    def _cost(self, comp: HloComputation, instr: HloInstruction) -> OpCost:
        if id(instr) in self._folded:
            return OpCost((), f"folded into {self._folded[id(instr)]}")
        op = instr.opcode
        if op in FREE:
            return _NONE
        if op == "fusion":
            return self._fusion(comp, instr)
        if op in ("dot", "convolution"):
            return self._mxu(comp, instr, self._epilogues(comp, instr,
                                                          self._work_of_ops([instr], comp)),
                             instr.shape)
        if op == "custom-call":
            return self._custom_call(comp, instr)
        if op in ELEMENTWISE or op in TRANSCENDENTAL or op in MOVEMENT or op in _REDUCING:
            if self.approximate and self._fold(comp, instr):
                return OpCost((), f"folded into {self._folded[id(instr)]}")
            work = self._work_of_ops([instr], comp)
            return self._vpu(comp, instr, work, self._hbm_bytes(comp, instr))
        return self._estimate(instr, self._hbm_bytes(comp, instr))

    def _fusion(self, comp: HloComputation, instr: HloInstruction) -> OpCost:
        called = self.module.computations[instr.called[0]]
        work = self._fused_work(called)
        if work.custom and not work.gemms:
            return self._custom_call(comp, work.custom[0], outer=instr)
        if work.gemms:
            return self._mxu(comp, instr, self._epilogues(comp, instr, work), instr.shape)
        if self.approximate and self._fold(comp, instr):
            return OpCost((), f"folded into {self._folded[id(instr)]}")
        if self.approximate and self._only_converts(called):
            return OpCost((), "a CPU float32 promotion (none on a TPU)")
        return self._vpu(comp, instr, work, self._hbm_bytes(comp, instr))

    def _epilogues(self, comp: HloComputation, instr: HloInstruction, work: _Work) -> _Work:
        """Approximate mode: the element-wise users of an MXU op joined to it as its
        epilogue (their VPU work beside the MXU, no HBM bytes of their own)."""
        if not self.approximate:
            return work
        extra = 0.0
        for user in self.users(comp).get(instr.name, []):
            if id(user) in self._folded or not self._elementwise(user):
                continue
            inner = (self._fused_work(self.module.computations[user.called[0]])
                     if user.opcode == "fusion" else self._work_of_ops([user], comp))
            extra += inner.vpu_ops
            self._folded[id(user)] = instr.name
        return dataclasses.replace(work, vpu_ops=work.vpu_ops + extra) if extra else work

    def _only_converts(self, comp: HloComputation) -> bool:
        """A fused computation of converts and layout ops only: on a CPU the bf16 <-> float32
        promotions XLA adds because the CPU has no bf16 arithmetic."""
        ops = [i for i in comp.instructions if i.opcode not in FREE]
        return bool(ops) and all(i.opcode in ("convert", "bitcast", "reshape", "broadcast", "copy")
                                 for i in ops) and any(i.opcode == "convert" for i in ops)

    # -- work of computations ------------------------------------------------------

    def _fused_work(self, comp: HloComputation) -> _Work:
        """The work of a fused computation (nested fusions included), cached."""
        hit = self._work.get(comp.name)
        if hit is None:
            hit = self._work_of_ops(comp.instructions, comp)
            self._work[comp.name] = hit
        return hit

    def _work_of_ops(self, instrs: Iterable[HloInstruction], comp: HloComputation) -> _Work:
        work = _Work()
        shapes = self.shapes(comp)
        for instr in instrs:
            op, out = instr.opcode, instr.shape.elements
            work.elements = max(work.elements, out)
            if op == "fusion":
                inner = self._fused_work(self.module.computations[instr.called[0]])
                work.gemms += inner.gemms
                work.vpu_ops += inner.vpu_ops
                work.collective |= inner.collective
                work.custom += inner.custom
                work.precision = inner.precision if inner.gemms else work.precision
            elif op in ("dot", "convolution"):
                work.gemms.append(gemm_dims(instr, shapes))
                work.precision = self._precision(instr, shapes)
            elif op in ELEMENTWISE:
                work.vpu_ops += out
            elif op in TRANSCENDENTAL:
                work.vpu_ops += out * self.spec.transcendental_cycles_per_element_op
            elif op in _REDUCING:
                work.vpu_ops += self._reducing_ops(instr, shapes)
            elif op in COLLECTIVE_OPCODES:
                work.collective = True
            elif op == "custom-call" and instr.attrs.get("custom_call_target", "").strip('"') \
                    not in FREE_CUSTOM_CALLS:
                work.custom.append(instr)
        return work

    def _reducing_ops(self, instr: HloInstruction, shapes: dict[str, Shape]) -> float:
        """Element-ops of a reduce (its input elements), reduce-window (output x window),
        scatter (updates), select-and-scatter (source x window), sort (n log2 n)."""
        ins = [shapes[o].elements for o in instr.operands if o in shapes]
        biggest = max(ins, default=instr.shape.elements)
        if instr.opcode == "reduce-window":
            size = _window(instr.attrs.get("window", "")).get("size", (1,))
            return float(instr.shape.elements * math.prod(size))
        if instr.opcode == "sort":
            return float(biggest * max(1.0, math.log2(max(biggest, 2))))
        if instr.opcode == "scatter" and len(ins) >= 3:
            return float(ins[-1])
        return float(biggest)

    def _precision(self, instr: HloInstruction, shapes: dict[str, Shape]) -> str:
        """The MXU mode of a product: int8 for 8-bit integer operands, fp32 for float32
        operands at HIGHEST precision (XLA's 6-pass bf16), else one bf16 pass (XLA's
        DEFAULT precision on a TPU)."""
        dtypes = {shapes[o].array.dtype for o in instr.operands[:2] if o in shapes}
        if dtypes & {"s8", "u8", "s4", "u4"}:
            return "int8"
        highest = "highest" in instr.attrs.get("operand_precision", "").lower() or \
            "highest" in instr.attrs.get("precision_config", "").lower()
        return "fp32" if highest and "f32" in dtypes else "bf16"

    # -- kernels -------------------------------------------------------------------

    def _records(self, precision: str, record_calls) -> tuple[OpRecord, ...]:
        core = self._cores[precision]
        core.take_records()
        record_calls(core)
        return tuple(core.take_records())

    def _xla_seconds(self, instr: HloInstruction) -> float | None:
        cycles = instr.estimated_cycles
        return None if cycles is None else cycles / self.spec.clock_hz

    def _mxu(self, comp: HloComputation, instr: HloInstruction, work: _Work,
             shape: Shape) -> OpCost:
        name = short_name(instr)
        hbm = self._hbm_bytes(comp, instr, mxu=True)
        epilogue = max(0.0, work.vpu_ops)
        elements = max(1, work.elements)

        def calls(core: TensorCore) -> None:
            core.account_kernel(name, [g for g in work.gemms if all(g)] or [(0, 0, 0, 1)], hbm)
            if epilogue:
                core.account_vector(f"{name}/epilogue", elements, 0,
                                    ops_per_element=epilogue / elements, fused="previous")

        return OpCost(self._records(work.precision, calls), "mxu", self._xla_seconds(instr))

    def _vpu(self, comp: HloComputation, instr: HloInstruction, work: _Work,
             hbm: int) -> OpCost:
        name = short_name(instr)
        elements = max(1, work.elements)
        ops = max(work.vpu_ops, float(instr.shape.elements))

        def calls(core: TensorCore) -> None:
            core.account_vector(name, elements, hbm, ops_per_element=ops / elements)

        records = self._records("bf16", calls)
        how = "hbm" if records and records[0].bound == "memory" else "vpu"
        return OpCost(records, how, self._xla_seconds(instr))

    def _estimate(self, instr: HloInstruction, hbm: int) -> OpCost:
        """XLA's own estimate of an op the model does not know; refused without one."""
        cycles = instr.estimated_cycles
        if cycles is None:
            raise HloOpError(f"line {instr.line}: {instr.opcode} {instr.name!r} has no cost model "
                             "here and XLA gave no estimated_cycles for it; compile for a TPU "
                             "(tpu-compile extra) or leave the op out")
        name = short_name(instr) + XLA_ESTIMATE_SUFFIX
        records = self._records("bf16", lambda core: core.account(name, "vpu", 0.0, hbm, cycles))
        return OpCost(records, "XLA estimate", cycles / self.spec.clock_hz)

    def _custom_call(self, comp: HloComputation, instr: HloInstruction,
                     outer: HloInstruction | None = None) -> OpCost:
        target = instr.attrs.get("custom_call_target", "").strip('"')
        where = outer or instr
        if target in FREE_CUSTOM_CALLS:
            return _NONE
        flash = self._flash(comp, where, instr)
        if flash is not None:
            return flash
        return self._estimate(where, self._hbm_bytes(comp, where))

    def _flash(self, comp: HloComputation, where: HloInstruction,
               instr: HloInstruction) -> OpCost | None:
        """A Pallas flash-attention kernel (the forward, or the backward's ``dkv`` / ``dq``
        kernels, or both fused), q and k of (B, H, T, Dh) and (B, K, T, Dh) as
        ``jax.experimental.pallas.ops.tpu.flash_attention`` and splash take them, costed
        by ``pod.workloads.flash`` (causal; the query and key blocks from the kernel's name,
        else 512);
        None for any other kernel."""
        from pod.workloads import flash

        text = f"{instr.name} {where.name} {where.op_name}".lower()
        if "flash" not in text and "splash" not in text:
            return None
        shapes = self.shapes(comp)
        four = [shapes[o].array for o in where.operands
                if o in shapes and len(shapes[o].array.dims) == 4]
        if len(four) < 2:
            return None
        (b, h, t, dh), kv_heads = four[0].dims, four[1].dims[1]
        found = re.search(r"block_q(?:_major)?[_=](\d+)", text)
        block = int(found.group(1)) if found else flash.FLASH_BLOCK_SIZE
        found = re.search(r"block_k(?:v)?(?:_major)?[_=](\d+)", text)
        block_kv = int(found.group(1)) if found else None
        name = short_name(where)
        kernels = [k for k in flash.BACKWARD_KERNELS if f"_{k}" in text]
        if not kernels and "bwd" in text:
            kernels = list(flash.BACKWARD_KERNELS)  # a fused backward kernel: both

        def calls(core: TensorCore) -> None:
            if not kernels:
                flash.record_flash_forward(core, name, b, h, kv_heads, t, dh, block, block_kv)
            for kernel in kernels:
                flash.record_flash_backward_kernel(core, f"{name}/{kernel}", kernel, b, h,
                                                   kv_heads, t, dh, block, block_kv)

        return OpCost(self._records("bf16", calls), "flash kernel model",
                      self._xla_seconds(where))

    # -- bytes ---------------------------------------------------------------------

    def _hbm_bytes(self, comp: HloComputation, instr: HloInstruction, mxu: bool = False) -> int:
        """HBM bytes ``instr`` reads and writes (module docstring)."""
        shapes = self.shapes(comp)
        called = (self.module.computations[instr.called[0]]
                  if instr.opcode == "fusion" and instr.called else None)
        total = 0
        for index, operand in enumerate(instr.operands):
            shape = shapes.get(operand)
            if shape is None:
                continue
            total += self._read_bytes(shape, called, index, mxu)
        return total + self._write_bytes(instr, called, mxu)

    def _itemsize(self, array: ArrayShape, mxu: bool) -> float:
        """Bytes per element: a CPU-compiled dot's float operands at the TPU's bf16."""
        if self.approximate and mxu and array.dtype in ("f32", "f64"):
            return 2.0
        return array.itemsize

    def _leaf_bytes(self, shape: Shape, mxu: bool) -> int:
        return sum(math.ceil(a.elements * self._itemsize(a, mxu)) for a in shape.leaves
                   if a.memory_space != 1)

    def _read_bytes(self, shape: Shape, called: HloComputation | None, index: int,
                    mxu: bool) -> int:
        full = self._leaf_bytes(shape, mxu)
        if called is None or not full:
            return full
        param = called.parameter(index)
        if param is None:
            return full
        users = _users_through_bitcasts(called, param.name)
        if not users or all(_carried(called, u) for u in users):
            return 0  # unused, or a buffer an async collective carries through the kernel
        aliases = _aliases(called, param.name)
        read = 0
        for user in users:
            if user.opcode in ("dynamic-slice", "slice", "gather"):
                read += self._leaf_bytes(user.shape, mxu)
            elif user.opcode == "dynamic-update-slice" and user.operands[0] in aliases:
                continue  # updated in place: not read
            elif user.opcode == "fusion" and user.called:
                # a fusion nested in the kernel (XLA TPU's async collective fusions hold
                # one per operand): what it reads of each operand that is this buffer
                nested = self.module.computations[user.called[0]]
                read += sum(self._read_bytes(shape, nested, i, mxu)
                            for i, o in enumerate(user.operands) if o in aliases)
            elif user.opcode == "pad" and (sliced := self._sliced_through_pad(
                    called, user, mxu)) is not None:
                read += sliced
            else:
                return full
        return min(read, full)

    def _sliced_through_pad(self, comp: HloComputation, pad: HloInstruction,
                            mxu: bool) -> int | None:
        """HBM bytes a kernel reads of a buffer it pads only to slice (XLA's windowed
        collective matmuls pad the gathered axis, then slice a window out of it): per
        slice, at most min(slice, buffer) elements along each axis (exact when a slice
        takes a padded axis whole); None when the padded array has another user."""
        source = comp.by_name.get(pad.operands[0])
        users = _users_through_bitcasts(comp, pad.name)
        if source is None or not users or any(
                u.opcode not in ("dynamic-slice", "slice") for u in users):
            return None
        dims, itemsize = source.shape.array.dims, self._itemsize(source.shape.array, mxu)
        if any(len(u.shape.array.dims) != len(dims) for u in users):
            return None
        return sum(math.ceil(math.prod(min(s, d) for s, d in zip(u.shape.array.dims, dims,
                                                                   strict=True)) * itemsize)
                   for u in users)

    def _write_bytes(self, instr: HloInstruction, called: HloComputation | None,
                     mxu: bool) -> int:
        full = self._leaf_bytes(instr.shape, mxu)
        if called is None:
            return full
        roots = _root_leaves(called)
        if len(roots) != len(instr.shape.leaves):
            return full
        total = 0
        for leaf, root in zip(instr.shape.leaves, roots, strict=True):
            if leaf.memory_space == 1 or root is None or root.opcode == "parameter" \
                    or root.opcode in COLLECTIVE_OPCODES:
                continue  # VMEM, or a collective's buffer passed through: the DMA's, not ours
            if root is not None and root.opcode == "dynamic-update-slice":
                update = called.by_name.get(root.operands[1])
                if update is not None:
                    total += self._leaf_bytes(update.shape, mxu)
                    continue
            total += math.ceil(leaf.elements * self._itemsize(leaf, mxu))
        return total

    # -- approximate fusion (CPU-compiled modules) ----------------------------------

    def _fold(self, comp: HloComputation, instr: HloInstruction) -> bool:
        """In a CPU-compiled module, fold ``instr`` into a dot as XLA would on a TPU: a
        convert or layout change all of whose users are dots (a prologue: the dot reads
        it), or an element-wise op of a dot's output (an epilogue). Returns whether it
        was folded (``self._folded`` names the dot)."""
        users = self.users(comp).get(instr.name, [])
        layout = instr.opcode in ("convert", "transpose", "copy", "reshape", "broadcast") or (
            instr.opcode == "fusion" and self._is_layout(instr))
        if layout and users and all(self._is_mxu(u) for u in users):
            self._folded[id(instr)] = users[0].name
            return True
        producers = [comp.by_name[o] for o in instr.operands if o in comp.by_name]
        if self._elementwise(instr) and any(self._is_mxu(p) for p in producers):
            dot = next(p for p in producers if self._is_mxu(p))
            self._folded[id(instr)] = dot.name
            return True
        return False

    def _is_mxu(self, instr: HloInstruction) -> bool:
        if instr.opcode in ("dot", "convolution"):
            return True
        return instr.opcode == "fusion" and bool(
            self._fused_work(self.module.computations[instr.called[0]]).gemms)

    def _is_layout(self, instr: HloInstruction) -> bool:
        comp = self.module.computations[instr.called[0]]
        return all(i.opcode in FREE | {"convert", "transpose", "copy", "reshape", "broadcast"}
                   for i in comp.instructions)

    def _elementwise(self, instr: HloInstruction) -> bool:
        if instr.opcode in ELEMENTWISE or instr.opcode in TRANSCENDENTAL:
            return True
        if instr.opcode != "fusion":
            return False
        comp = self.module.computations[instr.called[0]]
        return all(i.opcode in ELEMENTWISE | TRANSCENDENTAL | FREE | {"broadcast", "reshape"}
                   for i in comp.instructions)


_REDUCING = frozenset({"reduce", "reduce-window", "scatter", "select-and-scatter", "sort"})


def _aliases(comp: HloComputation, name: str) -> set[str]:
    """``name`` and the bitcasts / reshapes of it."""
    out, frontier = {name}, [name]
    users = comp.users()
    while frontier:
        for user in users.get(frontier.pop(), []):
            if user.opcode in ("bitcast", "reshape") and user.name not in out:
                out.add(user.name)
                frontier.append(user.name)
    return out


def _users_through_bitcasts(comp: HloComputation, name: str) -> list[HloInstruction]:
    """The users of ``name`` and of its bitcasts / reshapes (not those themselves)."""
    users = comp.users()
    names = _aliases(comp, name)
    return [u for n in names for u in users.get(n, []) if u.name not in names]


def _carried(comp: HloComputation, user: HloInstruction) -> bool:
    """``user`` only carries a buffer for an async collective through a fused kernel: the
    root tuple passing it on, the collective itself, or XLA's start / done markers."""
    if user.opcode in COLLECTIVE_OPCODES or (user.is_root and user.opcode == "tuple"):
        return True
    return user.opcode == "custom-call" and user.attrs.get(
        "custom_call_target", "").strip('"') in ("AsyncCollectiveStart", "AsyncCollectiveDone")


def _root_leaves(comp: HloComputation) -> list[HloInstruction | None]:
    """The instruction producing each leaf of the root (a tuple's elements; bitcasts
    looked through)."""
    root = comp.root
    parts = [comp.by_name.get(o) for o in root.operands] if root.opcode == "tuple" else [root]
    out: list[HloInstruction | None] = []
    for part in parts:
        while part is not None and part.opcode in ("bitcast", "reshape") and part.operands:
            part = comp.by_name.get(part.operands[0])
        out.append(part)
    return out


#: What a SparseCore offload moves between HBM and the SparseCore: its gathers, scatters
#: and dynamic slices (``sparsecore_work``).
SPARSECORE_MOVES = frozenset({"gather", "scatter", "dynamic-slice", "dynamic-update-slice"})
#: Ops that call the computations a SparseCore offload nests (walked into).
_SPARSECORE_NESTS = frozenset({"fusion", "call", "call-start", "async-start"})
#: Ops of a SparseCore offload that move no HBM bytes of their own there: index arithmetic,
#: layout changes and the nested async pairs' other halves.
_SPARSECORE_FREE = (FREE | ELEMENTWISE | (MOVEMENT - SPARSECORE_MOVES)
                    | {"call-done", "call-update", "async-done", "async-update"})


@dataclass(frozen=True)
class SparseCoreWork:
    """What a computation offloaded to the SparseCore reads and writes in HBM.

    Attributes:
        hbm_bytes: bytes its gathers, scatters and dynamic slices read and write
            (``sparsecore_work``).
        moves: those instructions' names, in order.
        unknown: instructions of another kind (no bound from bytes for them).
    """

    hbm_bytes: int
    moves: tuple[str, ...]
    unknown: tuple[HloInstruction, ...]


def _sparsecore_bytes(instr: HloInstruction, shapes: dict[str, Shape]) -> int:
    """HBM bytes one data-moving op of a SparseCore offload reads and writes: a gather
    reads the rows it gathers (its output) and its indices and writes its output; a
    scatter reads its updates and indices and reads and writes the rows they land on
    (update-sized: its combiner reads them); a dynamic slice reads and writes the slice;
    a dynamic-update-slice reads and writes the update."""
    def nbytes(name: str) -> int:
        shape = shapes.get(name)
        return shape.nbytes if shape is not None else 0

    if instr.opcode == "gather":
        return 2 * instr.shape.nbytes + nbytes(instr.operands[1])
    if instr.opcode == "scatter":
        n = len(instr.operands) // 2  # (operands..., indices, updates...)
        updates = sum(nbytes(o) for o in instr.operands[n + 1:])
        return 3 * updates + nbytes(instr.operands[n])
    if instr.opcode == "dynamic-slice":
        return 2 * instr.shape.nbytes
    return 2 * nbytes(instr.operands[1])  # dynamic-update-slice


def sparsecore_work(module: HloModule, comp: HloComputation) -> SparseCoreWork:
    """The HBM traffic of ``comp``, a computation libtpu offloads to the SparseCore (the
    ``to_apply`` of a ``call-start`` on ``async_execution_thread="sparsecore"``), with the
    computations it nests (its fusions, calls and nested async calls; not reducers).

    The SparseCore's own rate is not modelled (no figure for it is published): the
    offload is bounded by the bytes it moves through HBM (``_sparsecore_bytes``), which the
    caller divides by the chip's HBM bandwidth. Element-wise index arithmetic and layout
    changes inside it add no bytes; any other op is returned in ``unknown``.

    Args:
        module: the parsed module.
        comp: the offloaded computation.

    Returns:
        The :class:`SparseCoreWork`.
    """
    total, moves, unknown = 0, [], []
    frontier, seen = [comp], set()
    while frontier:
        current = frontier.pop()
        if current.name in seen:
            continue
        seen.add(current.name)
        shapes = {i.name: i.shape for i in current.instructions}
        for instr in current.instructions:
            op = instr.opcode
            if op in SPARSECORE_MOVES:
                total += _sparsecore_bytes(instr, shapes)
                moves.append(instr.name)
            elif op in _SPARSECORE_NESTS:
                frontier.extend(module.computations[c] for c in instr.called)
            elif op == "custom-call" and instr.attrs.get(
                    "custom_call_target", "").strip('"') in FREE_CUSTOM_CALLS:
                continue
            elif op not in _SPARSECORE_FREE:
                unknown.append(instr)
    return SparseCoreWork(total, tuple(moves), tuple(unknown))

"""A TensorCore: runs ops with numpy and accounts the time the real core would take.

Every op returns its real numpy result and appends an `OpRecord` to
`TensorCore.records`. Per op:

    compute_seconds = cycles / clock_hz
    memory_seconds  = hbm_bytes / achieved_hbm_bandwidth_bytes_per_s
    seconds         = max(compute_seconds, memory_seconds)   (roofline)

`cycles` = `mxu_cycles` (MXU ops) or the VPU's cycles, plus `issue_cycles`,
the scalar unit's issue cost (`chip.scalar`). The achieved HBM bandwidth and
the MXU's sustained efficiency are calibrated constants of the spec
(`chip.calibration`). Host dispatch (about 100 us per jitted call on real
TPUs) is not a chip cost and is not modelled here. Callers must call
`take_records()` every step so `records` stays bounded.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from chip.errors import PrecisionError
from chip.hbm import HBM
from chip.mxu import MXU_MODELS, check_mxu_model, mxu_gemm_cycles
from chip.numerics import (
    FP32_PASSES,
    mxu_matmul,
    mxu_matmul_aqt_int8,
    mxu_matmul_fp32,
    mxu_matmul_int8,
    to_bf16,
)
from chip.scalar import scalar_cycles
from chip.spec import TensorCoreSpec
from chip.vector import vpu_cycles

UNITS = ("mxu", "vpu", "scalar", "host")
"""Where an op runs: the MXU, the VPU, the scalar unit, or the host link (a DMA between
HBM and host memory over PCIe, `TensorCore.account_host_transfer`)."""

#: Host to chip bandwidth of a TensorCore made without one (`TensorCore(host_bytes_per_s=)`),
#: bytes/s: the PCIe figure of the v2 .. v5p presets [SB] (chip/spec.py).
DEFAULT_HOST_BYTES_PER_S = 1.6e10



@dataclass(frozen=True, slots=True)
class OpRecord:
    """Simulated cost of one op on a TensorCore.

    Attributes:
        name: Op name given by the caller, e.g. "dense1/fwd".
        unit: "mxu", "vpu", "scalar" or "host" (`UNITS`).
        flops: Floating-point operations done (2 per multiply-accumulate).
        hbm_bytes: Bytes moved between HBM and the core.
        cycles: Core cycles of compute: the unit's cycles plus issue_cycles.
        compute_seconds: cycles / clock_hz, simulated seconds.
        memory_seconds: hbm_bytes / achieved HBM bandwidth, simulated seconds.
        seconds: max(compute_seconds, memory_seconds), simulated seconds.
        bound: "compute" or "memory", whichever is larger (compute on a tie);
            "host" for a host transfer (its time is the host link's).
        mxu_cycles: The op's MXU cycles (0 for VPU and scalar ops), the
            sustained efficiency included.
        issue_cycles: The scalar unit's cycles issuing the op.
        fused_into: For VPU work fused into a matmul kernel (``fused`` in
            `TensorCore.vector`), the name of that MXU record; "" for an op
            of its own. A fused op moves no HBM bytes of its own and runs
            beside the kernel's MXU work: its `seconds` are only the part of
            its VPU time the kernel's own time does not cover (so a fused op
            adds max(MXU, VPU, HBM) - max(MXU, HBM) to the step, the roofline
            of the fused kernel); `compute_seconds` is its whole VPU time.
    """

    name: str
    unit: str
    flops: float
    hbm_bytes: int
    cycles: int
    compute_seconds: float
    memory_seconds: float
    seconds: float
    bound: str
    mxu_cycles: int = 0
    issue_cycles: int = 0
    fused_into: str = ""


#: Where VPU work runs: None, an op of its own; "previous", fused into the last MXU op
#: recorded (an epilogue: a bias add, an activation, a residual add after the product);
#: "next", fused into the next MXU op recorded (a prologue: a norm before the product).
FUSIONS = (None, "previous", "next")


def _zeros_view(shape: tuple[int, ...], dtype) -> np.ndarray:
    """Read-only zeros of ``shape`` that take no memory (every stride 0): what a
    timing-only core returns for a product it does not compute. A pod-scale
    product (a (B*H, T, T) score tensor of GiBs) could not even be allocated. One view
    per (shape, dtype) is handed out (read-only: nothing can tell them apart)."""
    key = (shape, dtype)
    out = _ZERO_VIEWS.get(key)
    if out is None:
        zero = np.zeros(1, dtype)
        out = np.ndarray(tuple(int(n) for n in shape), zero.dtype, buffer=zero,
                         strides=(0,) * len(shape))
        out.flags.writeable = False
        if len(_ZERO_VIEWS) >= 4096:
            _ZERO_VIEWS.clear()
        _ZERO_VIEWS[key] = out
    return out


#: ``_zeros_view``'s views by (shape, dtype) as asked
_ZERO_VIEWS: dict[tuple[Any, Any], np.ndarray] = {}


def _nbytes(x: Any) -> int:
    nbytes = getattr(x, "nbytes", None)
    return int(nbytes) if nbytes is not None else int(np.asarray(x).nbytes)


def _size(x: Any) -> int:
    size = getattr(x, "size", None)
    return int(size) if size is not None else int(np.asarray(x).size)


def _elements_and_bytes(arrays: tuple, outs: tuple | list) -> tuple[int, int]:
    """(the largest size, the sum of nbytes) over an op's inputs and outputs."""
    elements = hbm_bytes = 0
    for group in (arrays, outs):
        for x in group:
            if type(x) is np.ndarray:
                size, nbytes = x.size, x.nbytes
            else:
                size, nbytes = _size(x), _nbytes(x)
            if size > elements:
                elements = size
            hbm_bytes += nbytes
    return int(elements), int(hbm_bytes)


#: distinct op costs one TensorCore keeps (a model has a few hundred; varying shapes
#: such as a last partial batch add a few more)
_RECORD_CACHE_SIZE = 4096
#: distinct MXU and VPU cycle counts one TensorCore keeps (by shape, whatever the op's name)
_CYCLE_CACHE_SIZE = 4096


def _bounded_put(cache: dict, key: tuple, value: int) -> None:
    """``cache[key] = value``, the cache cleared first when it holds ``_CYCLE_CACHE_SIZE``."""
    if len(cache) >= _CYCLE_CACHE_SIZE:
        cache.clear()
    cache[key] = value

PRECISIONS = ("bf16", "fp32", "int8")
"""MXU precision modes: bf16 (one pass), fp32 (6 bf16 passes), int8 (quantised)."""

_OPERAND_BYTES = {"bf16": 2, "fp32": 4, "int8": 1}  # bytes per MXU input element in HBM
# Bytes per MXU output element written to HBM: a bf16 matmul accumulates in
# fp32 inside the MXU and writes bf16 back [PALLAS]; fp32 writes float32,
# int8 its int32 accumulators. (The emulator still returns float32 arrays:
# only the cost follows the hardware.)
_OUTPUT_BYTES = {"bf16": 2, "fp32": 4, "int8": 4}

#: VPU element-ops per operand element of an AQT int8 product (``quantized``): |x|, the
#: running maximum over the contraction axis, the multiply by 1 / scale, the rounding,
#: the clip and convert to int8 (fused into the product that reads the operand, as a
#: norm's statistic over K is: ``pod.workloads.fusion``).
QUANTIZE_OPS_PER_ELEMENT = 5.0
#: VPU element-ops per output element dequantising an AQT product: times the row scale
#: and the column scale (the product's epilogue).
DEQUANTIZE_OPS_PER_ELEMENT = 2.0


def check_precision(precision: str, spec: TensorCoreSpec, chip_name: str | None = None) -> str:
    """Checks that `precision` is a known mode the core's MXU can run.

    Args:
        precision: "bf16", "fp32" or "int8".
        spec: The TensorCore (its int8 throughput).
        chip_name: Chip name for the message (e.g. "v2"), if known.

    Returns:
        The precision.

    Raises:
        PrecisionError: (a ChipError and ValueError) for an unknown mode, or
            int8 on an MXU without int8 throughput (TPU v2, v3).
    """
    if precision not in PRECISIONS:
        raise PrecisionError(
            f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}"
        )
    if precision == "int8" and spec.int8_macs_per_bf16_mac <= 0:
        which = f"TPU {chip_name}" if chip_name else "this TensorCore"
        raise PrecisionError(
            f"precision 'int8' needs an MXU with int8 throughput, which {which} does not have "
            f"(TPU v2 and v3 have none; int8 runs on v4, v5e, v5p, v6e); use bf16 or fp32"
        )
    return precision


class TensorCore:
    """One TensorCore: MXUs, VPU, scalar unit and its own HBM budget.

    Args:
        spec: The core's figures.
        numerics: True to emulate MXU numerics (per `precision`, float32
            result); False for plain numpy in the inputs' dtype (e.g. float64
            for finite-difference gradient tests). Costs are the same either way.
        name: Name used in records and HBM errors, e.g. "chip0/core1".
        precision: MXU precision mode, one of `PRECISIONS`:
            "bf16" (default): inputs rounded to bf16, float32 accumulation, one pass;
            "fp32": XLA's 6-pass bf16 decomposition (`numerics.mxu_matmul_fp32`),
            six times the MXU passes, float32 inputs in HBM;
            "int8": symmetric per-tensor quantisation, int32 accumulation
            (`numerics.mxu_matmul_int8`), cycles / spec.int8_macs_per_bf16_mac.
        double_buffered: With mxu_model "scalesim", hide every weight load
            but the first (see `mxu_gemm_cycles`); "pipelined" already
            double-buffers weights, so there it changes nothing.
        mxu_model: MXU cycle count, one of `MXU_MODELS`: "pipelined"
            (default; the TPU: one pipeline bubble per op, the calibrated
            `spec.mxu_efficiency` applied) or "scalesim" (SCALE-Sim's "ws"
            count, a bubble per fold, cycle for cycle, no efficiency).
        execute: False skips the MXU products (they return zeros of the
            right shape and dtype) while every cost is still recorded:
            timing-only mode, where costs depend on shapes alone.
        host_bytes_per_s: This core's share of the chip's host link (PCIe),
            bytes/s, for host transfers; None: `DEFAULT_HOST_BYTES_PER_S`
            (`Chip` passes spec.host_to_chip_bytes_per_s / tensorcores).
        sustained: the core runs ops back to back in steady state (a training
            step): every MXU op at a fresh op's `spec.mxu_efficiency` (e0), with
            no fall per op; the chip's sustained budget
            (`spec.sustained_mxu_efficiency`, e1) holds the step's MXU work on
            average and is applied to the whole step by its clock
            (`pod.report.clock`: a step with enough other work between its
            matmuls is not slowed). False (one benchmarked op from an idle
            start): at `spec.mxu_efficiency_over` the op's duration.

    Attributes:
        spec: The TensorCoreSpec.
        precision: As given.
        emulates_numerics: The `numerics` argument.
        numerics: True when the MXU rounds its inputs to bf16 (numerics
            emulated and precision "bf16"). Layers read it to round weights
            once per step and pass `*_rounded=True`; in fp32 and int8 mode it
            is False, so they pass the float32 values unrounded and the core
            splits or quantises them itself.
        double_buffered: As given.
        mxu_model: As given.
        name: As given.
        hbm: This core's HBM budget (capacity spec.hbm_bytes).
        records: OpRecords since the last `take_records()`.

    Raises:
        TypeError: if spec is not a TensorCoreSpec.
        PrecisionError: for an unknown precision, or int8 on an MXU without it.
        ValueError: for an unknown mxu_model.
    """

    def __init__(self, spec: TensorCoreSpec, *, numerics: bool = True, name: str = "core0",
                 precision: str = "bf16", double_buffered: bool = False,
                 execute: bool = True, mxu_model: str = MXU_MODELS[0],
                 host_bytes_per_s: float | None = None, sustained: bool = False) -> None:
        if not isinstance(spec, TensorCoreSpec):
            raise TypeError(f"spec must be a TensorCoreSpec, got {spec!r}")
        self.spec = spec
        self.sustained = bool(sustained)
        self.precision = check_precision(precision, spec)
        self.mxu_model = check_mxu_model(mxu_model)
        self.emulates_numerics = bool(numerics)
        self.double_buffered = bool(double_buffered)
        self.execute = bool(execute)
        self.host_bytes_per_s = float(DEFAULT_HOST_BYTES_PER_S if host_bytes_per_s is None
                                      else host_bytes_per_s)
        if not self.host_bytes_per_s > 0:
            raise ValueError(f"host_bytes_per_s must be > 0, got {host_bytes_per_s!r}")
        self.name = name
        self.hbm = HBM(spec.hbm_bytes, name=name)
        self.records: list[OpRecord] = []
        self._scalar_cycles = scalar_cycles(spec, 1)
        # costs depend on shapes only: one OpRecord per distinct (op, figures), reused
        # every step (records are frozen); cleared when it holds _RECORD_CACHE_SIZE
        self._records_by_key: dict[tuple, OpRecord] = {}
        # cycle counts by shape (pure functions of the figures; an op's record is kept
        # by name, and every layer of a model names its ops anew): _CYCLE_CACHE_SIZE each
        self._mxu_cycles_by_shape: dict[tuple, int] = {}
        self._vpu_cycles_by_size: dict[tuple, int] = {}
        # fusion: the last MXU record, the VPU seconds fused into it so far, and the
        # prologue ops waiting for the next MXU record
        self._host: OpRecord | None = None
        self._host_vpu_seconds = 0.0
        self._pending: list[tuple] = []

    @property
    def numerics(self) -> bool:
        """True when MXU inputs are rounded to bf16 (numerics emulated, precision bf16)."""
        return self.emulates_numerics and self.precision == "bf16"

    def __repr__(self) -> str:
        return (f"TensorCore(name={self.name!r}, numerics={self.emulates_numerics}, "
                f"precision={self.precision!r})")

    def _cached(self, key: tuple) -> OpRecord | None:
        """The record of an op already costed with these figures (appended), or None."""
        record = self._records_by_key.get(key)
        if record is not None:
            self._append(record)
        return record

    def _append(self, record: OpRecord) -> None:
        """Appends a record; an MXU record becomes the kernel later fused ops join,
        and takes the prologue ops waiting for it. Any other op first records the
        waiting prologue ops as ops of their own (no matmul took them)."""
        if self._pending and record.unit in ("vpu", "scalar"):
            self._flush_pending()
        self.records.append(record)
        if record.unit == "mxu":
            self._host, self._host_vpu_seconds = record, 0.0
            pending, self._pending = self._pending, []
            for op in pending:
                self._fused_record(*op)

    def _flush_pending(self) -> None:
        pending, self._pending = self._pending, []
        for name, elements, hbm_bytes, ops, transcendental in pending:
            self._vpu_record(name, elements, hbm_bytes, ops, transcendental)

    def _vpu_record(self, name: str, elements: int, hbm_bytes: int, ops_per_element: float,
                    transcendental: bool) -> OpRecord:
        key = ("vpu", name, elements, hbm_bytes, ops_per_element, transcendental)
        record = self._cached(key)
        if record is None:
            cycles = self._vpu_cycles(elements, ops_per_element, transcendental)
            record = self._keep(key, self._record(
                name, "vpu", float(elements) * ops_per_element, hbm_bytes,
                cycles + self._scalar_cycles, issue_cycles=self._scalar_cycles))
        return record

    def _fused_record(self, name: str, elements: int, hbm_bytes: int, ops_per_element: float,
                      transcendental: bool) -> OpRecord:
        """VPU work fused into the last MXU record (``OpRecord.fused_into``); an op of
        its own, with its HBM bytes, when no MXU op was recorded yet."""
        host = self._host
        if host is None:
            return self._vpu_record(name, elements, hbm_bytes, ops_per_element, transcendental)
        cycles = self._vpu_cycles(elements, ops_per_element, transcendental)
        compute = cycles / self.spec.clock_hz
        before = self._host_vpu_seconds
        exposed = max(0.0, before + compute - host.seconds) - max(0.0, before - host.seconds)
        self._host_vpu_seconds = before + compute
        record = OpRecord(name, "vpu", float(elements) * ops_per_element, 0, cycles, compute, 0.0,
                          exposed, "compute", fused_into=host.name)
        self.records.append(record)
        return record

    def _vpu_cycles(self, elements: int, ops_per_element: float, transcendental: bool) -> int:
        """``vpu_cycles`` on this core, kept per (elements, ops, transcendental) of exact
        Python types (anything else is computed, and checked, every time)."""
        key = (elements, ops_per_element, transcendental)
        exact = type(elements) is int and type(ops_per_element) in (int, float)
        cycles = self._vpu_cycles_by_size.get(key) if exact else None
        if cycles is None:
            cycles = vpu_cycles(elements, ops_per_element, transcendental, self.spec)
            if exact:
                _bounded_put(self._vpu_cycles_by_size, key, cycles)
        return cycles

    def _keep(self, key: tuple, record: OpRecord) -> OpRecord:
        cache = self._records_by_key
        if len(cache) >= _RECORD_CACHE_SIZE:
            cache.clear()
        cache[key] = record
        return record

    def _record(self, name: str, unit: str, flops: float, hbm_bytes: int, cycles: int, *,
                mxu_cycles: int = 0, issue_cycles: int = 0) -> OpRecord:
        compute_seconds = cycles / self.spec.clock_hz
        memory_seconds = hbm_bytes / self.spec.achieved_hbm_bandwidth_bytes_per_s
        if compute_seconds >= memory_seconds:
            seconds, bound = compute_seconds, "compute"
        else:
            seconds, bound = memory_seconds, "memory"
        record = OpRecord(
            name, unit, flops, hbm_bytes, cycles, compute_seconds, memory_seconds, seconds, bound,
            mxu_cycles, issue_cycles,
        )
        self._append(record)
        return record

    # -- MXU -------------------------------------------------------------------

    def mxu_cycles(self, m: int, k: int, n: int, *, batch: int = 1,
                   mxu_model: str | None = None, precision: str | None = None) -> int:
        """MXU cycles of `batch` GEMMs (M x K) . (K x N) in this core's precision.

        bf16: `mxu_gemm_cycles` over the core's MXUs; fp32: six passes, i.e. six
        times the folds (`numerics.FP32_PASSES`); int8: the bf16 count divided by
        spec.int8_macs_per_bf16_mac, rounded up. In the "pipelined" model the
        count is then divided by the calibrated efficiency (`_mxu_efficiency`:
        spec.mxu_efficiency for a short op, falling towards
        spec.sustained_mxu_efficiency for a long one or on a sustained core) and
        rounded up; "scalesim" is SCALE-Sim's count as is. Zero if
        any dimension is 0. The scalar issue cost is not included.

        Args:
            m, k, n: GEMM dimensions, ints >= 0.
            batch: Independent GEMMs with their own weights, int >= 1.
            mxu_model: "pipelined" or "scalesim" for this call; None uses the
                core's `mxu_model`.
            precision: the precision of this product (an AQT int8 product on a
                bf16 core: "int8"); None uses the core's.

        Returns:
            Cycles, int.

        Raises:
            ValueError: if a dimension is negative or not an integer, or
                mxu_model is unknown.
        """
        precision = self.precision if precision is None else precision
        key = (m, k, n, batch, mxu_model, precision)
        exact = type(m) is int and type(k) is int and type(n) is int and type(batch) is int
        cycles = self._mxu_cycles_by_shape.get(key) if exact else None
        if cycles is not None:
            return cycles
        cycles = self._count_mxu_cycles(m, k, n, batch, mxu_model, precision)
        if exact:
            _bounded_put(self._mxu_cycles_by_shape, key, cycles)
        return cycles

    def _count_mxu_cycles(self, m: int, k: int, n: int, batch: int, mxu_model: str | None,
                          precision: str | None = None) -> int:
        """``mxu_cycles`` computed (and its arguments checked); ``precision`` None: the
        core's."""
        precision = self.precision if precision is None else precision
        model = self.mxu_model if mxu_model is None else check_mxu_model(mxu_model)
        for label, v in (("m", m), ("k", k), ("n", n)):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
                raise ValueError(f"{label} must be an integer >= 0, got {v!r}")
        if not (m and k and n):
            return 0
        passes = FP32_PASSES if precision == "fp32" else 1
        cycles = mxu_gemm_cycles(int(m), int(k), int(n), self.spec.mxu, self.spec.mxus_per_core,
                                 batch=batch * passes, double_buffered=self.double_buffered,
                                 mxu_model=model)
        if precision == "int8":
            cycles = math.ceil(cycles / self.spec.int8_macs_per_bf16_mac)
        if model == "pipelined":
            cycles = math.ceil(cycles / self._mxu_efficiency(cycles))
        return cycles

    def _mxu_efficiency(self, ideal_cycles: int) -> float:
        """The MXU efficiency of an op of ``ideal_cycles``: a fresh op's on a sustained
        core (the step's clock holds the step to the sustained budget), else the mean
        over the op's duration from an idle start."""
        if self.sustained:
            return self.spec.mxu_efficiency
        seconds = ideal_cycles / self.spec.clock_hz / self.spec.mxu_efficiency
        return self.spec.mxu_efficiency_over(seconds)

    def account_matmul(self, m: int, k: int, n: int, *, name: str = "matmul", batch: int = 1,
                       shared_weights: bool = False, mxu_model: str | None = None,
                       a_elements: int | None = None, out_elements: int | None = None,
                       quantized: bool = False) -> OpRecord:
        """Records the cost of a matmul without computing it (timing-only runs).

        Same cost as `matmul` / `batch_matmul` on inputs of these shapes:
        flops = 2*batch*M*K*N (useful FLOPs; fp32's six passes are in the
        cycles, not the FLOPs); hbm_bytes = operand bytes in (2 per element in
        bf16, 4 in fp32, 1 in int8; the weights once when shared) + output
        bytes out (2 per element in bf16 [PALLAS], 4 in fp32 and int8);
        mxu_cycles = `mxu_cycles`; issue_cycles = the scalar issue cost;
        cycles = their sum.

        Args:
            m, k, n: GEMM dimensions, ints >= 0.
            name: Op name for the record.
            batch: Number of (M x K) . (K x N) products, int >= 1.
            shared_weights: True if every product uses the same (K x N)
                weights (they then stay in the array: one GEMM of batch*M rows).
            mxu_model: MXU cycle count for this call; None uses the core's.
            a_elements: elements of the (M x K) operand read from HBM when that
                is not batch*M*K: a convolution forms its patch matrix on chip
                from its input, so it reads the input's elements (None: batch*M*K).
            out_elements: elements written to HBM when not batch*M*N (a
                transposed convolution sums its patches on chip into its
                output's elements; None: batch*M*N).
            quantized: an AQT int8 product on this core (MaxText ``quantization:
                int8``): both operands quantised per channel on the VPU (a
                "<name>/quantize" record fused into the product, ``QUANTIZE_OPS_PER_
                ELEMENT`` per operand element: the operands are read from HBM as
                stored, in the core's precision), the product at the int8 rate
                (cycles / spec.int8_macs_per_bf16_mac), the output dequantised in its
                epilogue ("<name>/dequantize") and written in the core's precision.

        Returns:
            The OpRecord appended to `records` (the MXU one).

        Raises:
            ValueError: if a dimension is negative, batch < 1 or mxu_model unknown.
            PrecisionError: ``quantized`` on an MXU without int8 throughput (v2, v3).
        """
        if quantized:
            check_precision("int8", self.spec)
            a_q = batch * m * k if a_elements is None else a_elements
            self._vpu(f"{name}/quantize", a_q + (k * n if shared_weights else batch * k * n), 0,
                      QUANTIZE_OPS_PER_ELEMENT, False, "next")
        record = self._account_mxu(m, k, n, name, batch, shared_weights, mxu_model, a_elements,
                                   out_elements, quantized)
        if quantized:
            self._vpu(f"{name}/dequantize", batch * m * n if out_elements is None
                      else out_elements, 0, DEQUANTIZE_OPS_PER_ELEMENT, False, "previous")
        return record

    def _account_mxu(self, m, k, n, name, batch, shared_weights, mxu_model, a_elements,
                     out_elements, quantized) -> OpRecord:
        """``account_matmul``'s MXU record (kept per figures)."""
        key: tuple | None = None
        if type(m) is int and type(k) is int and type(n) is int and type(batch) is int:
            key = ("mxu", name, m, k, n, batch, shared_weights, mxu_model, a_elements, out_elements,
                   quantized)
            record = self._cached(key)
            if record is not None:
                return record
        if isinstance(batch, bool) or not isinstance(batch, numbers.Integral) or batch < 1:
            raise ValueError(f"batch must be a positive integer, got {batch!r}")
        op_bytes = _OPERAND_BYTES[self.precision]
        weights = k * n if shared_weights else batch * k * n
        a_in = batch * m * k if a_elements is None else a_elements
        out = batch * m * n if out_elements is None else out_elements
        hbm_bytes = op_bytes * (a_in + weights) + _OUTPUT_BYTES[self.precision] * out
        precision = "int8" if quantized else None
        if shared_weights:
            cycles = self.mxu_cycles(batch * m, k, n, mxu_model=mxu_model, precision=precision)
        else:
            cycles = self.mxu_cycles(m, k, n, batch=batch, mxu_model=mxu_model,
                                     precision=precision)
        record = self._mxu_record(name, 2.0 * batch * m * k * n, int(hbm_bytes), cycles)
        return record if key is None else self._keep(key, record)

    def _mxu_record(self, name: str, flops: float, hbm_bytes: int, mxu_cycles: int) -> OpRecord:
        return self._record(name, "mxu", flops, hbm_bytes, mxu_cycles + self._scalar_cycles,
                            mxu_cycles=mxu_cycles, issue_cycles=self._scalar_cycles)

    def mxu_input(self, x: np.ndarray) -> np.ndarray:
        """Returns x as this core's MXU takes it, to round once and reuse.

        bf16 with numerics: bf16-rounded float32 (pass it with `*_rounded=True`
        to skip rounding again; cache it when the same weights are used many
        times). Otherwise x unchanged.
        """
        return to_bf16(x) if self.numerics else np.asarray(x)

    def _product(self, a: np.ndarray, b: np.ndarray, a_rounded: bool,
                 b_rounded: bool, quantized: bool = False) -> np.ndarray:
        if not self.execute:  # timing-only: the cost is recorded by the caller
            dtype = np.float32 if self.emulates_numerics else np.result_type(a, b)
            return _zeros_view((a.shape[0], b.shape[1]), dtype)
        if not self.emulates_numerics:
            return a @ b
        if quantized:
            return mxu_matmul_aqt_int8(a, b)
        if self.precision == "bf16":
            return mxu_matmul(a, b, a_rounded, b_rounded)
        if self.precision == "fp32":
            return mxu_matmul_fp32(a, b)
        return mxu_matmul_int8(a, b)

    def matmul(
        self,
        a: np.ndarray,
        b: np.ndarray,
        *,
        name: str = "matmul",
        a_rounded: bool = False,
        b_rounded: bool = False,
        a_elements: int | None = None,
        out_elements: int | None = None,
        quantized: bool = False,
    ) -> np.ndarray:
        """Multiplies a (M, K) by b (K, N) on the MXUs.

        With numerics the product follows the core's precision (bf16: inputs
        rounded to bf16 unless flagged as already rounded, float32
        accumulation; fp32: six bf16 passes; int8: quantised, int32
        accumulation). Records one "mxu" OpRecord (see `account_matmul`): in
        bf16, flops = 2*M*K*N, hbm_bytes = 2*(M*K + K*N) + 2*M*N (bf16 out
        [PALLAS]), cycles = `mxu_cycles` plus the scalar issue cost.

        Args:
            a: (M, K) activations.
            b: (K, N) weights.
            name: Op name for the record.
            a_rounded: a already holds bf16 values in float32 (skip its
                rounding; bf16 precision only, ignored otherwise).
            b_rounded: b already holds bf16 values in float32 (likewise).
            a_elements, out_elements: HBM elements read for a and written, when
                not M*K and M*N (see `account_matmul`; costs only).
            quantized: an AQT int8 product (`account_matmul`); with numerics
                `numerics.mxu_matmul_aqt_int8` (per-channel int8, int32 sums).

        Returns:
            (M, N) product: float32 with numerics, else `a @ b` in the inputs' dtype.

        Raises:
            ValueError: if a or b is not 2-D or their inner dimensions differ.
        """
        a = np.asarray(a)  # no copy for an ndarray
        b = np.asarray(b)
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
            raise ValueError(
                f"matmul {name!r} needs a (M, K) and b (K, N), got shapes {a.shape} and {b.shape}"
            )
        m, k = a.shape
        n = b.shape[1]
        out = self._product(a, b, a_rounded, b_rounded, quantized)
        self.account_matmul(m, k, n, name=name, a_elements=a_elements, out_elements=out_elements,
                            quantized=quantized)
        return out

    def batch_matmul(self, a: np.ndarray, b: np.ndarray, *,
                     name: str = "batch_matmul") -> np.ndarray:
        """Batched matmul: a (B, M, K) by b (B, K, N), or by shared weights b (K, N).

        Shared weights stay in the arrays: costed as one GEMM of B*M rows.
        Per-example weights: B times the folds, spread over the MXUs
        (`mxu_gemm_cycles(..., batch=B)`). Numerics as `matmul`.

        Args:
            a: (B, M, K) activations.
            b: (B, K, N) per-example weights or (K, N) shared weights.
            name: Op name for the record.

        Returns:
            (B, M, N) product.

        Raises:
            ValueError: on mismatched shapes.
        """
        a = np.asarray(a)
        b = np.asarray(b)
        shared = b.ndim == 2
        ok = a.ndim == 3 and b.ndim in (2, 3) and a.shape[2] == b.shape[-2]
        if ok and not shared:
            ok = b.shape[0] == a.shape[0]
        if not ok:
            raise ValueError(f"batch_matmul {name!r} needs a (B, M, K) and b (B, K, N) or (K, N), "
                             f"got shapes {a.shape} and {b.shape}")
        bsz, m, k = a.shape
        n = b.shape[-1]
        if shared:
            out = self._product(a.reshape(bsz * m, k), b, False, False).reshape(bsz, m, n)
        elif not self.execute:
            out = _zeros_view((bsz, m, n), np.float32)
        elif self.emulates_numerics and self.precision == "bf16":
            out = np.matmul(to_bf16(a), to_bf16(b))
        else:
            out = np.stack([self._product(a[i], b[i], False, False) for i in range(bsz)]) \
                if bsz else np.matmul(a, b)
        if bsz:
            self.account_matmul(m, k, n, name=name, batch=bsz, shared_weights=shared)
        else:
            self._mxu_record(name, 0.0, 0, 0)
        return out

    def _group_bounds(self, rows: int, group_sizes: Any, name: str) -> list[tuple[int, int]]:
        """(start, stop) row ranges of ``group_sizes``: an int G (G equal groups) or G counts."""
        if isinstance(group_sizes, numbers.Integral):
            groups = int(group_sizes)
            if groups < 1 or rows % groups:
                raise ValueError(f"grouped matmul {name!r}: {rows} rows do not split into "
                                 f"{groups} equal groups; give the group sizes")
            sizes = [rows // groups] * groups
        else:
            sizes = [int(s) for s in np.asarray(group_sizes).reshape(-1)]
            if not sizes or min(sizes) < 0 or sum(sizes) != rows:
                raise ValueError(f"grouped matmul {name!r}: group sizes {sizes} must be counts "
                                 f">= 0 summing to the {rows} rows")
        ends = np.cumsum([0] + sizes)
        return [(int(a), int(b)) for a, b in zip(ends[:-1], ends[1:], strict=True)]

    @staticmethod
    def _group_count(group_sizes: Any) -> int:
        if isinstance(group_sizes, numbers.Integral):
            return int(group_sizes)
        return int(np.asarray(group_sizes).size)

    def grouped_matmul(self, a: np.ndarray, b: np.ndarray, group_sizes: Any, *,
                       name: str = "grouped_matmul", a_rounded: bool = False,
                       b_rounded: bool = False, quantized: bool = False) -> np.ndarray:
        """Rows of a (M, K), grouped, each group times its own weights of b (G, K, N).

        A mixture-of-experts layer's expert products: the rows routed to expert g
        (consecutive, ``group_sizes[g]`` of them) times expert g's weights; the
        grouped matmul of megablox (``gmm``, MaxText's ``sparse_matmul``). The
        cost depends on shapes only, as a plan of any size needs it: G GEMMs of
        ceil(M / G) rows each with their own weights (``account_matmul`` with
        ``batch=G``; a skewed split's tiles add up to about the same rows), the
        M x K rows read and the M x N written once.

        Args:
            a: (M, K) rows, sorted by group.
            b: (G, K, N) one weight matrix per group.
            group_sizes: (G,) rows per group summing to M, or the int G for equal
                groups (on a timing-only core only G matters).
            name: Op name for the record.
            a_rounded, b_rounded, quantized: as `matmul` (an AQT int8 product per group).

        Returns:
            (M, N): float32 with numerics, else in the inputs' dtype.

        Raises:
            ValueError: on mismatched shapes or group sizes.
        """
        a, b = np.asarray(a), np.asarray(b)
        g = self._group_count(group_sizes)
        if a.ndim != 2 or b.ndim != 3 or a.shape[1] != b.shape[1] or b.shape[0] != g or g < 1:
            raise ValueError(f"grouped matmul {name!r} needs a (M, K), b (G, K, N) and G group "
                             f"sizes, got shapes {a.shape}, {b.shape} and {g} groups")
        (m, k), n = a.shape, b.shape[2]
        if not self.execute:
            dtype = np.float32 if self.emulates_numerics else np.result_type(a, b)
            out = _zeros_view((m, n), dtype)
        else:
            bounds = self._group_bounds(m, group_sizes, name)
            out = np.concatenate([self._product(a[s:e], b[i], a_rounded, b_rounded, quantized)
                                  for i, (s, e) in enumerate(bounds)])
        self.account_matmul(-(-m // g), k, n, name=name, batch=g, a_elements=m * k,
                            out_elements=m * n, quantized=quantized)
        return out

    def grouped_transposed_matmul(self, a: np.ndarray, b: np.ndarray, group_sizes: Any, *,
                                  name: str = "grouped_transposed_matmul",
                                  a_rounded: bool = False, b_rounded: bool = False,
                                  quantized: bool = False) -> np.ndarray:
        """Per group g, a[rows of g]^T times b[rows of g]: the weight gradients of
        :meth:`grouped_matmul` (megablox's ``tgmm``). Costed from shapes only as G
        GEMMs (K x ceil(M / G)) . (ceil(M / G) x N), writing the (G, K, N) result.

        Args:
            a: (M, K) rows, sorted by group.
            b: (M, N) rows, in the same groups.
            group_sizes: as :meth:`grouped_matmul`.
            name, a_rounded, b_rounded, quantized: as :meth:`grouped_matmul`.

        Returns:
            (G, K, N).

        Raises:
            ValueError: on mismatched shapes or group sizes.
        """
        a, b = np.asarray(a), np.asarray(b)
        g = self._group_count(group_sizes)
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[0] or g < 1:
            raise ValueError(f"grouped transposed matmul {name!r} needs a (M, K), b (M, N) and "
                             f"G >= 1 group sizes, got shapes {a.shape}, {b.shape} and {g} groups")
        (m, k), n = a.shape, b.shape[1]
        if not self.execute:
            dtype = np.float32 if self.emulates_numerics else np.result_type(a, b)
            out = _zeros_view((g, k, n), dtype)
        else:
            bounds = self._group_bounds(m, group_sizes, name)
            out = np.stack([self._product(a[s:e].T, b[s:e], a_rounded, b_rounded, quantized)
                            for s, e in bounds])
        self.account_matmul(k, -(-m // g), n, name=name, batch=g, a_elements=m * k,
                            out_elements=g * k * n, quantized=quantized)
        return out

    def conv2d(self, x: np.ndarray, w: np.ndarray, *, stride: int = 1, padding: str = "valid",
               name: str = "conv2d") -> np.ndarray:
        """2-D convolution (NHWC) as an im2col GEMM on the MXUs.

        The patches of x become a (B*H_out*W_out, KH*KW*C_in) matrix and the
        kernel a (KH*KW*C_in, C_out) one (`mxu.conv2d_gemm_shape`); the cycles
        are those of that GEMM. HBM traffic counts x, w and the output once
        (the TPU forms patches on chip; they are not written to HBM): in bf16
        2 bytes per input and per output element [PALLAS].

        Args:
            x: (B, H, W, C_in) input.
            w: (KH, KW, C_in, C_out) kernel.
            stride: Step in both spatial axes, int >= 1.
            padding: "valid" (none) or "same" (TF/XLA: out = ceil(in / stride),
                the odd pixel after).
            name: Op name for the record.

        Returns:
            (B, H_out, W_out, C_out) output (float32 with numerics).

        Raises:
            ValueError: on bad shapes, stride or padding.
        """
        x = np.asarray(x)
        w = np.asarray(w)
        if x.ndim != 4 or w.ndim != 4 or x.shape[3] != w.shape[2]:
            raise ValueError(f"conv2d {name!r} needs x (B, H, W, C) and w (KH, KW, C, F), "
                             f"got shapes {x.shape} and {w.shape}")
        if isinstance(stride, bool) or not isinstance(stride, numbers.Integral) or stride < 1:
            raise ValueError(f"stride must be a positive integer, got {stride!r}")
        if padding not in ("valid", "same"):
            raise ValueError(f"padding must be 'valid' or 'same', got {padding!r}")
        bsz, h, wd, c = x.shape
        kh, kw, _, f = w.shape
        x_elements = x.size
        if padding == "same":
            pads = []
            for size, kern in ((h, kh), (wd, kw)):
                out = -(-size // stride)
                total = max((out - 1) * stride + kern - size, 0)
                pads.append((total // 2, total - total // 2))
            x = np.pad(x, ((0, 0), pads[0], pads[1], (0, 0)))
        hp, wp = x.shape[1], x.shape[2]
        if hp < kh or wp < kw:
            raise ValueError(f"conv2d {name!r}: kernel {kh}x{kw} larger than padded input "
                             f"{hp}x{wp}")
        ho, wo = (hp - kh) // stride + 1, (wp - kw) // stride + 1
        patches = np.lib.stride_tricks.sliding_window_view(x, (kh, kw), axis=(1, 2))
        patches = patches[:, ::stride, ::stride]                     # (B, Ho, Wo, C, KH, KW)
        cols = patches.transpose(0, 1, 2, 4, 5, 3).reshape(bsz * ho * wo, kh * kw * c)
        out = self._product(cols, w.reshape(kh * kw * c, f), False, False)
        m, k, n = bsz * ho * wo, kh * kw * c, f
        op_bytes = _OPERAND_BYTES[self.precision]
        hbm_bytes = op_bytes * (x_elements + w.size) + _OUTPUT_BYTES[self.precision] * m * n
        cycles = self.mxu_cycles(m, k, n) if m else 0
        self._mxu_record(name, 2.0 * m * k * n, int(hbm_bytes), cycles)
        return out.reshape(bsz, ho, wo, f)

    # -- VPU -------------------------------------------------------------------

    def vector(
        self,
        name: str,
        fn: Callable[..., Any],
        *arrays: Any,
        ops_per_element: float = 1.0,
        transcendental: bool = False,
        fused: str | None = None,
    ) -> Any:
        """Computes fn(*arrays) on the VPU and records its cost.

        elements = the largest size among the inputs and the result;
        flops = elements * ops_per_element; hbm_bytes = inputs' nbytes + result's
        nbytes; cycles = `vpu_cycles` plus the scalar issue cost. A result that
        is a tuple or list counts all its arrays. Fused work (``fused``, as XLA
        fuses elementwise ops into the matmul that produces or consumes them)
        moves no HBM bytes and has no issue cost of its own; it is recorded
        right after its MXU op (``OpRecord.fused_into``).

        Args:
            name: Op name for the record, e.g. "relu/fwd" or "adam/update".
            fn: Function of the arrays, run as is (numpy).
            *arrays: Its inputs (arrays or scalars).
            ops_per_element: Element-ops per element (>= 0).
            transcendental: True for exp / log / tanh / ... work.
            fused: one of `FUSIONS`: None, an op of its own; "previous", fused
                into the last MXU op recorded; "next", into the next one (the
                record waits for it; if another op comes first, it is recorded
                as an op of its own just before that op).

        Returns:
            Whatever fn returns.

        Raises:
            ValueError: if ops_per_element is negative or fused unknown.
        """
        result = fn(*arrays)
        outs = result if isinstance(result, (tuple, list)) else (result,)
        elements, hbm_bytes = _elements_and_bytes(arrays, outs)
        self._vpu(name, elements, hbm_bytes, ops_per_element, transcendental, fused)
        return result

    def _vpu(self, name: str, elements: int, hbm_bytes: int, ops_per_element: float,
             transcendental: bool, fused: str | None) -> OpRecord | None:
        if fused not in FUSIONS:
            raise ValueError(f"fused must be one of {FUSIONS}, got {fused!r}")
        op = (name, int(elements), int(hbm_bytes), ops_per_element, bool(transcendental))
        if fused == "next":
            self._vpu_cycles(op[1], ops_per_element, transcendental)  # checks the figures
            self._pending.append(op)
            return None
        if fused == "previous":
            if self._pending:
                self._flush_pending()
            return self._fused_record(*op)
        return self._vpu_record(*op)

    def account_vector(self, name: str, elements: int, hbm_bytes: int, *,
                       ops_per_element: float = 1.0, transcendental: bool = False,
                       fused: str | None = None) -> OpRecord | None:
        """Records the cost of VPU work without computing it (timing-only runs).

        Same cost as `vector` on arrays of that many elements and bytes.

        Args:
            name: Op name for the record.
            elements: Elements processed, int >= 0.
            hbm_bytes: Bytes read and written, int >= 0 (ignored when fused).
            ops_per_element: Element-ops per element (>= 0).
            transcendental: True for exp / log / tanh / ... work.
            fused: as `vector`.

        Returns:
            The OpRecord appended to `records` (None while a "next" op waits).

        Raises:
            ValueError: on a negative or non-integer figure, or an unknown fused.
        """
        if (isinstance(hbm_bytes, bool) or not isinstance(hbm_bytes, numbers.Integral)
                or hbm_bytes < 0):
            raise ValueError(f"hbm_bytes must be an integer >= 0, got {hbm_bytes!r}")
        return self._vpu(name, elements, hbm_bytes, ops_per_element, transcendental, fused)

    @property
    def operand_bytes(self) -> int:
        """Bytes in HBM of one MXU input element in this precision (bf16 2, fp32 4, int8 1)."""
        return _OPERAND_BYTES[self.precision]

    @property
    def output_bytes(self) -> int:
        """Bytes of one MXU output element written to HBM (bf16 2 [PALLAS], fp32 and int8 4)."""
        return _OUTPUT_BYTES[self.precision]

    def account_kernel(self, name: str, gemms, hbm_bytes: int) -> OpRecord:
        """Records one kernel of several MXU products (a Pallas kernel such as flash
        attention), from shapes alone: one MXU record (the kernel later fused VPU
        work joins).

        cycles = the sum of `mxu_cycles` of the products plus one scalar issue
        cost; flops = 2 * batch * M * K * N summed; hbm_bytes as given: the
        kernel's own traffic (its blocks move between HBM and VMEM once; what
        it re-reads from VMEM is free).

        Args:
            name: Op name for the record.
            gemms: (m, k, n, batch) per product, ints >= 0 (batch >= 1).
            hbm_bytes: Bytes the kernel reads and writes, int >= 0.

        Returns:
            The OpRecord appended to `records`.

        Raises:
            ValueError: on a bad dimension or byte count.
        """
        gemms = tuple((int(m), int(k), int(n), int(b)) for m, k, n, b in gemms)
        key = ("kernel", name, gemms, int(hbm_bytes))
        record = self._cached(key)
        if record is not None:
            return record
        if not hbm_bytes >= 0:
            raise ValueError(f"hbm_bytes must be >= 0, got {hbm_bytes!r}")
        cycles = sum(self.mxu_cycles(m, k, n, batch=b) for m, k, n, b in gemms)
        flops = sum(2.0 * b * m * k * n for m, k, n, b in gemms)
        return self._keep(key, self._mxu_record(name, flops, int(hbm_bytes), cycles))

    def account(self, name: str, unit: str, flops: float, hbm_bytes: int, cycles: int) -> OpRecord:
        """Records work done outside the other methods (e.g. data movement).

        The figures are recorded as given (no scalar issue cost is added;
        for unit "mxu", mxu_cycles = cycles).

        Args:
            name: Op name for the record.
            unit: "mxu", "vpu" or "scalar".
            flops: Floating-point operations (>= 0).
            hbm_bytes: Bytes moved to or from HBM (int >= 0).
            cycles: Compute cycles (int >= 0).

        Returns:
            The OpRecord appended to `records`.

        Raises:
            ValueError: if unit is unknown or a figure is negative.
        """
        if unit not in UNITS:
            raise ValueError(f"unit must be one of {UNITS}, got {unit!r}")
        if not flops >= 0:
            raise ValueError(f"flops must be >= 0, got {flops!r}")
        if not hbm_bytes >= 0:
            raise ValueError(f"hbm_bytes must be >= 0, got {hbm_bytes!r}")
        if not cycles >= 0:
            raise ValueError(f"cycles must be >= 0, got {cycles!r}")
        mxu_cycles = int(cycles) if unit == "mxu" else 0
        return self._record(name, unit, flops, int(hbm_bytes), int(cycles), mxu_cycles=mxu_cycles)

    def account_host_transfer(self, name: str, nbytes: int) -> OpRecord:
        """Records a DMA between HBM and host memory (remat offload and reload).

        seconds = nbytes / `host_bytes_per_s` (the core's share of the host
        link; one direction at a time); unit and bound "host"; hbm_bytes =
        nbytes (the DMA reads or writes HBM); no cycles. The step's clock can
        run it beside the compute (it uses neither the MXU nor the VPU).

        Args:
            name: Op name, e.g. "block1/offload/query_proj".
            nbytes: Bytes moved, int >= 0.

        Returns:
            The OpRecord appended to `records`.

        Raises:
            ValueError: a negative or non-integer byte count.
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Integral) or nbytes < 0:
            raise ValueError(f"nbytes must be an integer >= 0, got {nbytes!r}")
        key = ("host", name, int(nbytes))
        record = self._cached(key)
        if record is None:
            seconds = int(nbytes) / self.host_bytes_per_s
            record = self._keep(key, OpRecord(name, "host", 0.0, int(nbytes), 0, 0.0, seconds,
                                              seconds, "host"))
            self._append(record)
        return record

    def take_records(self) -> list[OpRecord]:
        """Returns the records since the last call and clears them.

        Returns:
            list of OpRecord, in execution order.
        """
        if self._pending:  # prologue ops no matmul took: ops of their own
            self._flush_pending()
        self._host, self._host_vpu_seconds = None, 0.0  # a step's kernels end with it
        records, self.records = self.records, []
        return records

    def fusion_state(self) -> tuple[OpRecord | None, float, tuple[tuple, ...]]:
        """What the next op's record depends on besides its own figures: (the MXU record
        later fused VPU work joins, or None; the VPU seconds fused into it so far; the
        prologue ops waiting for the next MXU record, as (name, elements, hbm_bytes,
        ops_per_element, transcendental))."""
        return self._host, self._host_vpu_seconds, tuple(self._pending)

    def append_records(self, records: list[OpRecord],
                       fusion_state: tuple[OpRecord | None, float, tuple[tuple, ...]]) -> None:
        """Append records made before (a replayed pass: ``pod.programs.replay``) and set the
        fusion state they leave (:meth:`fusion_state`), as if their ops had run here."""
        self.records.extend(records)
        host, vpu_seconds, pending = fusion_state
        self._host, self._host_vpu_seconds, self._pending = host, float(vpu_seconds), list(pending)

"""A TensorCore: runs ops with numpy and accounts the time the real core would take.

Every op returns its real numpy result and appends an `OpRecord` to
`TensorCore.records`. Per op:

    compute_seconds = cycles / clock_hz
    memory_seconds  = hbm_bytes / hbm_bandwidth_bytes_per_s
    seconds         = max(compute_seconds, memory_seconds)   (roofline)

`cycles` includes the scalar unit's issue cost (`chip.scalar`). Callers must
call `take_records()` every step so `records` stays bounded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from chip.hbm import HBM
from chip.mxu import mxu_gemm_cycles
from chip.numerics import mxu_matmul
from chip.scalar import scalar_cycles
from chip.spec import TensorCoreSpec
from chip.vector import vpu_cycles

UNITS = ("mxu", "vpu", "scalar")


@dataclass(frozen=True, slots=True)
class OpRecord:
    """Simulated cost of one op on a TensorCore.

    Attributes:
        name: Op name given by the caller, e.g. "dense1/fwd".
        unit: "mxu", "vpu" or "scalar".
        flops: Floating-point operations done (2 per multiply-accumulate).
        hbm_bytes: Bytes moved between HBM and the core.
        cycles: Core cycles of compute, including the scalar issue cost.
        compute_seconds: cycles / clock_hz, simulated seconds.
        memory_seconds: hbm_bytes / HBM bandwidth, simulated seconds.
        seconds: max(compute_seconds, memory_seconds), simulated seconds.
        bound: "compute" or "memory", whichever is larger (compute on a tie).
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


def _nbytes(x: Any) -> int:
    nbytes = getattr(x, "nbytes", None)
    return int(nbytes) if nbytes is not None else int(np.asarray(x).nbytes)


def _size(x: Any) -> int:
    size = getattr(x, "size", None)
    return int(size) if size is not None else int(np.asarray(x).size)


class TensorCore:
    """One TensorCore: MXUs, VPU, scalar unit and its own HBM budget.

    Args:
        spec: The core's figures.
        numerics: True to emulate MXU numerics (bf16 inputs, float32
            accumulation and result); False for plain numpy in the inputs' dtype
            (e.g. float64 for finite-difference gradient tests). Costs are the
            same either way.
        name: Name used in records and HBM errors, e.g. "chip0/core1".

    Attributes:
        spec: The TensorCoreSpec.
        numerics: As given.
        name: As given.
        hbm: This core's HBM budget (capacity spec.hbm_bytes).
        records: OpRecords since the last `take_records()`.
    """

    def __init__(self, spec: TensorCoreSpec, *, numerics: bool = True, name: str = "core0") -> None:
        if not isinstance(spec, TensorCoreSpec):
            raise TypeError(f"spec must be a TensorCoreSpec, got {spec!r}")
        self.spec = spec
        self.numerics = bool(numerics)
        self.name = name
        self.hbm = HBM(spec.hbm_bytes, name=name)
        self.records: list[OpRecord] = []
        self._scalar_cycles = scalar_cycles(spec, 1)

    def __repr__(self) -> str:
        return f"TensorCore(name={self.name!r}, numerics={self.numerics})"

    def _record(self, name: str, unit: str, flops: float, hbm_bytes: int, cycles: int) -> OpRecord:
        compute_seconds = cycles / self.spec.clock_hz
        memory_seconds = hbm_bytes / self.spec.hbm_bandwidth_bytes_per_s
        if compute_seconds >= memory_seconds:
            seconds, bound = compute_seconds, "compute"
        else:
            seconds, bound = memory_seconds, "memory"
        record = OpRecord(
            name, unit, flops, hbm_bytes, cycles, compute_seconds, memory_seconds, seconds, bound
        )
        self.records.append(record)
        return record

    def matmul(
        self,
        a: np.ndarray,
        b: np.ndarray,
        *,
        name: str = "matmul",
        a_rounded: bool = False,
        b_rounded: bool = False,
    ) -> np.ndarray:
        """Multiplies a (M, K) by b (K, N) on the MXUs.

        With numerics, inputs are rounded to bf16 (unless flagged as already
        rounded) and the product is accumulated in float32. Records one "mxu"
        OpRecord: flops = 2*M*K*N; hbm_bytes = 2*(M*K + K*N) + 4*M*N (bf16 in,
        float32 out); cycles = `mxu_gemm_cycles` over the core's MXUs plus the
        scalar issue cost.

        Args:
            a: (M, K) activations.
            b: (K, N) weights.
            name: Op name for the record.
            a_rounded: a already holds bf16 values in float32 (skip its rounding).
            b_rounded: b already holds bf16 values in float32 (skip its rounding).

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
        out = mxu_matmul(a, b, a_rounded, b_rounded) if self.numerics else a @ b
        if m and k and n:
            cycles = mxu_gemm_cycles(m, k, n, self.spec.mxu, self.spec.mxus_per_core)
        else:
            cycles = 0
        self._record(
            name, "mxu", 2.0 * m * k * n, 2 * (m * k + k * n) + 4 * m * n,
            cycles + self._scalar_cycles,
        )
        return out

    def vector(
        self,
        name: str,
        fn: Callable[..., Any],
        *arrays: Any,
        ops_per_element: float = 1.0,
        transcendental: bool = False,
    ) -> Any:
        """Computes fn(*arrays) on the VPU and records its cost.

        elements = the largest size among the inputs and the result;
        flops = elements * ops_per_element; hbm_bytes = inputs' nbytes + result's
        nbytes; cycles = `vpu_cycles` plus the scalar issue cost. A result that
        is a tuple or list counts all its arrays.

        Args:
            name: Op name for the record, e.g. "relu/fwd" or "adam/update".
            fn: Function of the arrays, run as is (numpy).
            *arrays: Its inputs (arrays or scalars).
            ops_per_element: Element-ops per element (>= 0).
            transcendental: True for exp / log / tanh / ... work.

        Returns:
            Whatever fn returns.

        Raises:
            ValueError: if ops_per_element is negative.
        """
        result = fn(*arrays)
        outs = result if isinstance(result, (tuple, list)) else (result,)
        elements = max([_size(x) for x in arrays] + [_size(x) for x in outs])
        hbm_bytes = sum(_nbytes(x) for x in arrays) + sum(_nbytes(x) for x in outs)
        cycles = vpu_cycles(elements, ops_per_element, transcendental, self.spec)
        self._record(
            name, "vpu", float(elements) * ops_per_element, hbm_bytes,
            cycles + self._scalar_cycles,
        )
        return result

    def account(self, name: str, unit: str, flops: float, hbm_bytes: int, cycles: int) -> OpRecord:
        """Records work done outside the other methods (e.g. data movement).

        The figures are recorded as given (no scalar issue cost is added).

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
        return self._record(name, unit, flops, int(hbm_bytes), int(cycles))

    def take_records(self) -> list[OpRecord]:
        """Returns the records since the last call and clears them.

        Returns:
            list of OpRecord, in execution order.
        """
        records, self.records = self.records, []
        return records

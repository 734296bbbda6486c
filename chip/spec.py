"""Chip specifications: frozen dataclasses and the public presets.

Figures come from public sources; the comment beside every
number gives its source key:

- [GC-v3], [GC-v4], [GC-v5e], [GC-v5p], [GC-v6e]: Google Cloud TPU system
  architecture pages.
- [SB]: "How to Scale Your Model" (Google DeepMind scaling book); [SB-tpus],
  [SB-roof] name its chapters "How to Think About TPUs" and "Rooflines".
- [PALLAS]: JAX docs, Pallas TPU matmul guide, "XLA matmul" timings on one v5e.
- [RECIPES]: AI-Hypercomputer/tpu-recipes microbenchmarks (v6e-1, device time).
- [JS168]: AI-Hypercomputer/jetstream-pytorch pull request 168 (v5e, host time).
- [JAX]: jax/_src/pallas/mosaic/tpu_info.py.
- [XLA]: XLA's own figure, read by the XLA oracle (tools/xla_oracle, docs/xla-oracle.md):
  the HBM a compiled program may use, from libtpu 0.0.42.1's out-of-memory message
  ("exceeds available HBM (...)"), kept per config in tools/xla_oracle/results/<id>.json
  (compile.oom.available_bytes); tests/chip/test_spec.py checks the presets against them.
- [SEED]: the project's seed documents (TPU v2 lecture and tutorials).
- der.: derived here from the other numbers.
- assumption: not published; chosen by us and documented as such.
- fit: fitted to published measurements by `chip.calibration` (rows C1-C5,
  cited by id); `python -m chip.fitting` re-runs the fit and prints it,
  and tests/chip/test_calibration.py fails if a constant here drifts from it.

Derived figures (peak FLOP/s, ...) are properties, never stored. The one stored
peak, `ChipSpec.published_peak_bf16_flops_per_s`, is Google's published number,
kept only so tests can compare the derived peak against it.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

# The calibrated (fitted) constants: chip.calibration holds them with the rows that set
# each (benchmarks/fidelity.py --fit-mxu and python -m chip.fitting fit them again).
from chip.calibration import (
    HBM_EFFICIENCY,
    MXU_BURST_SECONDS,
    MXU_FRESH_EFFICIENCY,
    MXU_SUSTAINED_EFFICIENCY,
)
from chip.errors import ChipSpecError

_GIB = 2**30
_MIB = 2**20

# Assumptions shared by every preset (not published by Google):
# - A transcendental op (exp, log, tanh, ...) costs 4x the VPU cycles of an
#   add or multiply per element (assumption; the EUP is a separate, slower unit).
_TRANSCENDENTAL_CYCLES = 4.0
# - The scalar unit spends a handful of cycles issuing each op (address
#   arithmetic, loop control, sync flags) (assumption).
_SCALAR_ISSUE_CYCLES = 8
# - An int8 MXU pass does (published int8 peak / published bf16 peak) times the
#   MACs of a bf16 pass; 0 means the MXU has no int8 mode. The ratio is der.
#   from the published peaks; how the hardware achieves it is not published.
# - Each (lane, sublane) of the VPU holds 2 floating-point ALUs: "2048
#   floating point adders" per v4 TensorCore = 2 x 8 x 128 [SB-tpus]; with it
#   a v5p chip does 2 cores x 2048 x 1.75e9 = 7.2e12 FLOP/s, "roughly 7e12
#   FLOPs / second" [SB-roof].
_VPU_ALUS_PER_LANE = 2

#: How a generation wires the ends of a slice's torus axes (``ChipSpec.wraparound_rule``;
#: [SB], "How to Think About TPUs"): ``every_axis``, an axis of 2 or more chips wraps
#: (v2, v3: every slice a 2-D torus); ``full_side``, an axis wraps only when it is as long
#: as a side of the largest pod (``max_pod_shape``: v5e / v6e wrap an axis of 16);
#: ``whole_cubes``, every axis wraps when the slice is made of whole 4x4x4 cubes (v4,
#: v5p: the optical switches close the rings of complete cubes only).
WRAPAROUND_RULES = ("every_axis", "full_side", "whole_cubes")
#: The side of the cubes ``whole_cubes`` slices are made of (chips).
_CUBE_SIDE = 4


def _check_int(owner: str, field: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ChipSpecError(f"{owner}.{field} must be an integer >= {minimum}, got {value!r}")


def _check_positive(owner: str, field: str, value, allow_zero: bool = False) -> None:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value >= 0 if allow_zero else value > 0)
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ChipSpecError(f"{owner}.{field} must be a finite number {bound}, got {value!r}")


@dataclass(frozen=True)
class MXUSpec:
    """One matrix unit: a weight-stationary systolic array of multiply-accumulate cells.

    Attributes:
        rows: Rows of the array (R); a weight tile covers R of the K dimension.
        cols: Columns of the array (C); a weight tile covers C of the N dimension.

    Raises:
        ChipSpecError: (a ValueError) if rows or cols is not a positive integer.
    """

    rows: int
    cols: int

    def __post_init__(self) -> None:
        _check_int("MXUSpec", "rows", self.rows, 1)
        _check_int("MXUSpec", "cols", self.cols, 1)

    @property
    def macs_per_cycle(self) -> int:
        """Multiply-accumulates per cycle when the array is full (rows * cols)."""
        return self.rows * self.cols


@dataclass(frozen=True)
class TensorCoreSpec:
    """One TensorCore: its MXUs, VPU, scalar unit and its share of the chip's HBM.

    Attributes:
        mxu: Shape of each MXU.
        mxus_per_core: Number of MXUs in this TensorCore.
        clock_hz: Core clock, Hz.
        hbm_bytes: This core's share of the chip's HBM capacity, bytes.
        hbm_bandwidth_bytes_per_s: This core's share of the chip's HBM bandwidth, bytes/s.
        vmem_bytes: On-chip vector memory of this core, bytes.
        vpu_lanes: VPU lanes (128 on every generation so far).
        vpu_sublanes: VPU sublanes (8).
        vpu_alus_per_lane: Floating-point ALUs per (lane, sublane) (2 [SB-tpus]);
            the VPU does lanes * sublanes * ALUs element-ops per cycle.
        transcendental_cycles_per_element_op: Cost of a transcendental element-op
            relative to an add/multiply (which costs 1) (assumption).
        scalar_issue_cycles: Cycles the scalar unit spends issuing each op (assumption).
        int8_macs_per_bf16_mac: int8 MXU throughput relative to bf16 (der.:
            published int8 peak / bf16 peak); 0.0 for an MXU without int8
            (TPU v2, v3).
        mxu_efficiency: A fresh op's fraction of the ideal pipelined MXU rate
            (e0), 0 < x <= 1 (fit, see `chip.calibration`); MXU cycles of the
            "pipelined" model are divided by it. 1.0 = the ideal pipeline.
        hbm_efficiency: Achieved fraction of `hbm_bandwidth_bytes_per_s`,
            0 < x <= 1 (fit, see `chip.calibration`); HBM time is
            bytes / (hbm_bandwidth_bytes_per_s * hbm_efficiency).
        mxu_sustained_efficiency: The MXU's sustained budget: its work averaged
            over time, as a fraction of the ideal rate, cannot exceed this
            (a power- or clock-limited chip), 0 < x <= mxu_efficiency, or None
            (= mxu_efficiency: no budget). A benchmarked GEMM runs at
            ``mxu_efficiency`` at first and its rate falls towards this with time
            constant ``mxu_burst_seconds`` (`mxu_efficiency_over`); a training
            step runs its matmuls at ``mxu_efficiency`` and is held to its MXU work
            at this rate when that is longer (`pod.report.clock`). Fit on the GEMM
            rows and the published training steps together
            (`chip.calibration`; benchmarks/fidelity.py --fit-mxu; VALIDATION.md).
        mxu_burst_seconds: Time constant of that fall, seconds (0: no fall).

    Raises:
        ChipSpecError: (a ValueError) quoting the first invalid field.
    """

    mxu: MXUSpec
    mxus_per_core: int
    clock_hz: float
    hbm_bytes: int
    hbm_bandwidth_bytes_per_s: float
    vmem_bytes: int
    vpu_lanes: int = 128
    vpu_sublanes: int = 8
    vpu_alus_per_lane: int = _VPU_ALUS_PER_LANE
    transcendental_cycles_per_element_op: float = _TRANSCENDENTAL_CYCLES
    scalar_issue_cycles: int = _SCALAR_ISSUE_CYCLES
    int8_macs_per_bf16_mac: float = 0.0
    mxu_efficiency: float = 1.0
    hbm_efficiency: float = 1.0
    mxu_sustained_efficiency: float | None = None
    mxu_burst_seconds: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.mxu, MXUSpec):
            raise ChipSpecError(f"TensorCoreSpec.mxu must be an MXUSpec, got {self.mxu!r}")
        _check_int("TensorCoreSpec", "mxus_per_core", self.mxus_per_core, 1)
        _check_positive("TensorCoreSpec", "clock_hz", self.clock_hz)
        _check_int("TensorCoreSpec", "hbm_bytes", self.hbm_bytes, 1)
        _check_positive("TensorCoreSpec", "hbm_bandwidth_bytes_per_s",
                        self.hbm_bandwidth_bytes_per_s)
        _check_int("TensorCoreSpec", "vmem_bytes", self.vmem_bytes, 0)
        _check_int("TensorCoreSpec", "vpu_lanes", self.vpu_lanes, 1)
        _check_int("TensorCoreSpec", "vpu_sublanes", self.vpu_sublanes, 1)
        _check_int("TensorCoreSpec", "vpu_alus_per_lane", self.vpu_alus_per_lane, 1)
        _check_positive(
            "TensorCoreSpec", "transcendental_cycles_per_element_op",
            self.transcendental_cycles_per_element_op,
        )
        _check_int("TensorCoreSpec", "scalar_issue_cycles", self.scalar_issue_cycles, 0)
        _check_positive("TensorCoreSpec", "int8_macs_per_bf16_mac", self.int8_macs_per_bf16_mac,
                        allow_zero=True)
        for field in ("mxu_efficiency", "hbm_efficiency"):
            value = getattr(self, field)
            _check_positive("TensorCoreSpec", field, value)
            if value > 1:
                raise ChipSpecError(f"TensorCoreSpec.{field} must be a fraction in (0, 1], "
                                    f"got {value!r}")
        if self.mxu_sustained_efficiency is not None:
            _check_positive("TensorCoreSpec", "mxu_sustained_efficiency",
                            self.mxu_sustained_efficiency)
            if self.mxu_sustained_efficiency > self.mxu_efficiency:
                raise ChipSpecError(f"TensorCoreSpec.mxu_sustained_efficiency "
                                    f"{self.mxu_sustained_efficiency!r} must not exceed "
                                    f"mxu_efficiency {self.mxu_efficiency!r}")
        _check_positive("TensorCoreSpec", "mxu_burst_seconds", self.mxu_burst_seconds,
                        allow_zero=True)

    @property
    def sustained_mxu_efficiency(self) -> float:
        """The MXU's efficiency under sustained load (``mxu_sustained_efficiency``, or
        ``mxu_efficiency`` when there is no drop)."""
        s = self.mxu_sustained_efficiency
        return self.mxu_efficiency if s is None else s

    def mxu_efficiency_over(self, seconds: float) -> float:
        """The mean MXU efficiency of one op that keeps the MXU busy ``seconds`` from an
        idle start: the rate falls exponentially from ``mxu_efficiency`` (e0) to the
        sustained one (e1) with time constant tau (``mxu_burst_seconds``), so the mean
        over d is e1 + (e0 - e1) (tau / d) (1 - exp(-d / tau)); e0 when tau is 0 or d
        is 0. A power- or clock-limited chip behaves so; measurements.md: 92.5% of
        peak at 8192^3 (6 ms), 81.7% at 32768^3 (438 ms) on v5e."""
        e0, e1, tau = self.mxu_efficiency, self.sustained_mxu_efficiency, self.mxu_burst_seconds
        if tau <= 0 or seconds <= 0 or e1 >= e0:
            return e0
        x = seconds / tau
        return e1 + (e0 - e1) * (-math.expm1(-x)) / x

    @property
    def peak_bf16_flops_per_s(self) -> float:
        """Peak bf16 FLOP/s of this core: 2 * mxus_per_core * rows * cols * clock_hz."""
        return 2.0 * self.mxus_per_core * self.mxu.rows * self.mxu.cols * self.clock_hz

    @property
    def peak_int8_ops_per_s(self) -> float:
        """Peak int8 ops/s of this core (2 per MAC); 0.0 when the MXU has no int8 mode."""
        return self.peak_bf16_flops_per_s * self.int8_macs_per_bf16_mac

    @property
    def vpu_elements_per_cycle(self) -> int:
        """Element-ops the VPU completes per cycle (lanes * sublanes * ALUs per lane)."""
        return self.vpu_lanes * self.vpu_sublanes * self.vpu_alus_per_lane

    @property
    def peak_vpu_flops_per_s(self) -> float:
        """Peak VPU FLOP/s of this core (one op per ALU per cycle)."""
        return self.vpu_elements_per_cycle * self.clock_hz

    @property
    def achieved_hbm_bandwidth_bytes_per_s(self) -> float:
        """HBM bandwidth the cost model uses, bytes/s: spec bandwidth * hbm_efficiency."""
        return self.hbm_bandwidth_bytes_per_s * self.hbm_efficiency


#: Chips in one 4x4x4 cube, the unit a v4 / v5p slice of 64 chips or more is built of [SB].
CUBE_CHIPS = 64


def cube_box(cubes: int, max_pod_shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The slice shape (chips per axis, ascending) of ``cubes`` 4x4x4 cubes: the box of
    a x b x c cubes (a <= b <= c, a * b * c = cubes) with the shortest longest side, then
    the least sum of sides (the most nearly cubic), that fits ``max_pod_shape`` axis by
    axis once both are sorted; None when no box fits. 3 cubes -> (4, 4, 12), 6 ->
    (4, 8, 12), 16 -> (8, 8, 16).
    """
    limits = sorted(max_pod_shape)
    boxes = [(a, b, cubes // (a * b))
             for a in range(1, cubes + 1) for b in range(a, cubes + 1)
             if cubes % (a * b) == 0 and cubes // (a * b) >= b]
    fitting = [box for box in boxes
               if all(4 * n <= limit for n, limit in zip(box, limits, strict=True))]
    if not fitting:
        return None
    best = min(fitting, key=lambda box: (box[2], sum(box)))
    return tuple(4 * n for n in best)


@dataclass(frozen=True)
class ChipSpec:
    """One TPU chip: its TensorCores, HBM, ICI links and host connection.

    Attributes:
        name: Generation name, e.g. "v4".
        core: Spec of each TensorCore (all cores of a chip are alike).
        tensorcores: TensorCores per chip.
        hbm_bytes: HBM capacity of the chip as published, bytes (what `describe` shows).
        hbm_bandwidth_bytes_per_s: HBM bandwidth of the chip, bytes/s; each core
            gets an equal share (`core.hbm_bandwidth_bytes_per_s`).
        ici_links: ICI links per chip.
        ici_link_bandwidth_bytes_per_s: Bandwidth of one ICI link, one direction, bytes/s.
        ici_latency_s: Latency of one ICI hop, seconds.
        torus_dims: Number of torus dimensions of the pod (2 or 3).
        max_pod_shape: Chips along each torus axis in the largest pod.
        chips_per_host: Chips attached to one host.
        host_to_chip_bytes_per_s: Host to chip (PCIe) bandwidth per chip, bytes/s.
        published_peak_bf16_flops_per_s: Google's published bf16 peak per chip,
            FLOP/s, kept only for comparison with the derived peak; None for a
            custom chip.
        slice_counts_tensorcores: True if slice names count TensorCores
            ("v2-8" = 4 chips), False if they count chips ("v5e-8" = 8 chips).
        megacore: True if the chip's TensorCores act as one "megacore" (v4,
            v5p [GC-v4][SB]): the compiler splits each op over both cores,
            so there is no separate core-to-core reduce of their results.
            The chip model only exposes the flag; callers that reduce over
            the cores of a chip should skip that step when it is True.
        dcn_bytes_per_s: Data-centre network bandwidth across slices per chip,
            one direction, bytes/s: the host's network interfaces shared by
            its chips (multislice collectives).
        dcn_latency_s: Latency of one message across the DCN, seconds.
        slice_shapes: Google Cloud's slices of the generation, ``(count in the name,
            torus shape)`` pairs in order: ``(32, (2, 2, 4))`` is v4-32. The count is
            TensorCores when ``slice_counts_tensorcores`` (each shape holds count /
            tensorcores chips), else chips. Empty: no named slices (a custom chip is
            given by chips and topology).
        wraparound_rule: which axes of a slice's torus wrap, one of
            ``WRAPAROUND_RULES`` (:meth:`default_wraparound`).
        hbm_available_bytes: HBM a program's buffers may use on the chip, bytes: what
            decides whether a step fits. XLA keeps part of the published capacity for
            itself (runtime, program, scratch), so on v4, v5e, v5p and v6e this is XLA's own
            figure ([XLA]: v4 30.75 GiB of 32, v6e 31.25 GiB of 32); 0 (the default: a custom
            chip, v2, v3, not measured) takes ``hbm_bytes``. Each core gets
            hbm_available_bytes // tensorcores (`core.hbm_bytes`, its HBM budget).

    Raises:
        ChipSpecError: (a ValueError) quoting the first invalid field, or if the
            core's HBM share does not match the chip's figures, or a slice shape
            does not hold its name's count.
    """

    name: str
    core: TensorCoreSpec
    tensorcores: int
    hbm_bytes: int
    hbm_bandwidth_bytes_per_s: float
    ici_links: int
    ici_link_bandwidth_bytes_per_s: float
    ici_latency_s: float
    torus_dims: int
    max_pod_shape: tuple[int, ...]
    chips_per_host: int
    host_to_chip_bytes_per_s: float
    published_peak_bf16_flops_per_s: float | None
    slice_counts_tensorcores: bool
    megacore: bool = False
    dcn_bytes_per_s: float = 3.1e9
    dcn_latency_s: float = 2e-5
    slice_shapes: tuple[tuple[int, tuple[int, ...]], ...] = ()
    wraparound_rule: str = "every_axis"
    hbm_available_bytes: int = 0  # 0: hbm_bytes (not measured)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ChipSpecError(f"ChipSpec.name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.core, TensorCoreSpec):
            raise ChipSpecError(f"ChipSpec.core must be a TensorCoreSpec, got {self.core!r}")
        _check_int("ChipSpec", "tensorcores", self.tensorcores, 1)
        _check_int("ChipSpec", "hbm_bytes", self.hbm_bytes, 1)
        if self.hbm_available_bytes == 0:
            object.__setattr__(self, "hbm_available_bytes", self.hbm_bytes)
        _check_int("ChipSpec", "hbm_available_bytes", self.hbm_available_bytes, 1)
        _check_positive("ChipSpec", "hbm_bandwidth_bytes_per_s", self.hbm_bandwidth_bytes_per_s)
        _check_int("ChipSpec", "ici_links", self.ici_links, 0)
        _check_positive("ChipSpec", "ici_link_bandwidth_bytes_per_s",
                        self.ici_link_bandwidth_bytes_per_s)
        _check_positive("ChipSpec", "ici_latency_s", self.ici_latency_s, allow_zero=True)
        _check_int("ChipSpec", "torus_dims", self.torus_dims, 1)
        try:
            shape = tuple(self.max_pod_shape)
        except TypeError:
            raise ChipSpecError(
                "ChipSpec.max_pod_shape must be a tuple of positive integers, "
                f"got {self.max_pod_shape!r}"
            ) from None
        if len(shape) != self.torus_dims or any(
            isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 1 for d in shape
        ):
            raise ChipSpecError(
                f"ChipSpec.max_pod_shape must be {self.torus_dims} positive integers "
                f"(torus_dims={self.torus_dims}), got {self.max_pod_shape!r}"
            )
        object.__setattr__(self, "max_pod_shape", tuple(int(d) for d in shape))
        _check_int("ChipSpec", "chips_per_host", self.chips_per_host, 1)
        _check_positive("ChipSpec", "host_to_chip_bytes_per_s", self.host_to_chip_bytes_per_s)
        if self.published_peak_bf16_flops_per_s is not None:
            _check_positive(
                "ChipSpec", "published_peak_bf16_flops_per_s", self.published_peak_bf16_flops_per_s
            )
        if not isinstance(self.slice_counts_tensorcores, bool):
            raise ChipSpecError(
                "ChipSpec.slice_counts_tensorcores must be a bool, "
                f"got {self.slice_counts_tensorcores!r}"
            )
        if not isinstance(self.megacore, bool):
            raise ChipSpecError(f"ChipSpec.megacore must be a bool, got {self.megacore!r}")
        _check_positive("ChipSpec", "dcn_bytes_per_s", self.dcn_bytes_per_s)
        _check_positive("ChipSpec", "dcn_latency_s", self.dcn_latency_s, allow_zero=True)
        self._check_slices()
        if self.megacore and self.tensorcores < 2:
            raise ChipSpecError(
                f"ChipSpec {self.name!r}: megacore needs at least 2 TensorCores, "
                f"got tensorcores={self.tensorcores!r}"
            )
        # The core's HBM budget is its share of what the chip makes available: one figure.
        share_bytes = self.hbm_available_bytes // self.tensorcores
        if self.core.hbm_bytes != share_bytes:
            raise ChipSpecError(
                f"ChipSpec {self.name!r}: core.hbm_bytes={self.core.hbm_bytes!r} must be "
                f"hbm_available_bytes // tensorcores = {share_bytes!r}"
            )
        share = self.hbm_bandwidth_bytes_per_s / self.tensorcores
        if not math.isclose(self.core.hbm_bandwidth_bytes_per_s, share, rel_tol=1e-9):
            raise ChipSpecError(
                f"ChipSpec {self.name!r}: core.hbm_bandwidth_bytes_per_s="
                f"{self.core.hbm_bandwidth_bytes_per_s!r} must be "
                f"hbm_bandwidth_bytes_per_s / tensorcores = {share!r}"
            )

    def _check_slices(self) -> None:
        """``slice_shapes`` as tuples of ints, each shape of ``torus_dims`` axes holding its
        name's count; ``wraparound_rule`` one of ``WRAPAROUND_RULES``."""
        if self.wraparound_rule not in WRAPAROUND_RULES:
            raise ChipSpecError(f"ChipSpec.wraparound_rule must be one of "
                                f"{', '.join(WRAPAROUND_RULES)}, got {self.wraparound_rule!r}")
        per_chip = self.tensorcores if self.slice_counts_tensorcores else 1
        slices = []
        try:
            for count, shape in self.slice_shapes:
                slices.append((count, tuple(shape)))
        except (TypeError, ValueError):
            raise ChipSpecError("ChipSpec.slice_shapes must be (count, shape) pairs, got "
                                f"{self.slice_shapes!r}") from None
        for count, shape in slices:
            _check_int("ChipSpec", "slice_shapes count", count, 1)
            if len(shape) != self.torus_dims or any(
                isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 1
                for d in shape
            ) or math.prod(shape) * per_chip != count:
                unit = "TensorCores" if self.slice_counts_tensorcores else "chips"
                raise ChipSpecError(
                    f"ChipSpec {self.name!r}: slice {self.name}-{count} has shape {shape!r}: "
                    f"expected {self.torus_dims} positive axes holding {count} {unit} "
                    f"({per_chip} per chip)")
        if len({count for count, _ in slices}) != len(slices):
            raise ChipSpecError(f"ChipSpec {self.name!r}: slice_shapes names a count twice")
        object.__setattr__(self, "slice_shapes",
                           tuple((int(c), tuple(int(d) for d in shape)) for c, shape in slices))

    def slice_shape(self, count: int) -> tuple[int, ...] | None:
        """The torus shape of the slice ``<name>-<count>`` (chips per axis), None when
        Google has no such slice.

        The table (``slice_shapes``) first. A generation built of whole 4x4x4 cubes
        (``wraparound_rule`` ``whole_cubes``: v4, v5p) also has a slice for every whole
        number of cubes that fits its largest pod, named by its count as the table's are
        (v4-384 = 192 chips = 3 cubes, 4x4x12 [GC-v4]): the shape is :func:`cube_box`'s,
        which reproduces every cube-built shape of the tables (tests/chip/test_spec.py).
        """
        shapes = dict(self.slice_shapes)
        if count in shapes or self.wraparound_rule != "whole_cubes":
            return shapes.get(count)
        per_chip = self.tensorcores if self.slice_counts_tensorcores else 1
        chips, rest = divmod(count, per_chip)
        if rest or chips < CUBE_CHIPS or chips % CUBE_CHIPS:
            return None
        return cube_box(chips // CUBE_CHIPS, self.max_pod_shape)

    def default_wraparound(self, shape: tuple[int, ...]) -> tuple[bool, ...]:
        """Which axes of a slice of ``shape`` (chips per axis) have wraparound links, by
        ``wraparound_rule`` (``WRAPAROUND_RULES``): one bool per axis.

        ``every_axis``: an axis of 2+ chips; ``full_side``: an axis as long as a side of
        ``max_pod_shape`` (v5e / v6e: 16); ``whole_cubes``: every axis of a 3-D shape made
        of whole 4x4x4 cubes (v4 / v5p), else none.
        """
        if self.wraparound_rule == "full_side":
            return tuple(axis in self.max_pod_shape for axis in shape)
        if self.wraparound_rule == "whole_cubes":
            cubes = len(shape) == 3 and all(axis % _CUBE_SIDE == 0 for axis in shape)
            return tuple(cubes for _ in shape)
        return tuple(axis > 1 for axis in shape)

    @property
    def peak_bf16_flops_per_s(self) -> float:
        """Derived peak bf16 FLOP/s of the chip: tensorcores * core.peak_bf16_flops_per_s."""
        return self.tensorcores * self.core.peak_bf16_flops_per_s

    @property
    def peak_vpu_flops_per_s(self) -> float:
        """Peak VPU FLOP/s of the chip: tensorcores * core.peak_vpu_flops_per_s."""
        return self.tensorcores * self.core.peak_vpu_flops_per_s

    @property
    def mxus(self) -> int:
        """MXUs on the chip (all TensorCores)."""
        return self.tensorcores * self.core.mxus_per_core

    @property
    def max_pod_chips(self) -> int:
        """Chips in the largest pod (product of `max_pod_shape`)."""
        return math.prod(self.max_pod_shape)

    @classmethod
    def from_chip_figures(
        cls,
        *,
        name: str,
        tensorcores: int,
        mxu: MXUSpec,
        mxus_per_core: int,
        clock_hz: float,
        hbm_bytes: int,
        hbm_bandwidth_bytes_per_s: float,
        vmem_bytes_per_core: int,
        hbm_available_bytes: int = 0,
        **chip_fields,
    ) -> ChipSpec:
        """Builds a ChipSpec from per-chip HBM figures, splitting them over the cores.

        Args:
            name: Generation name.
            tensorcores: TensorCores per chip.
            mxu: Shape of each MXU.
            mxus_per_core: MXUs per TensorCore.
            clock_hz: Core clock, Hz.
            hbm_bytes: HBM capacity of the chip, bytes.
            hbm_bandwidth_bytes_per_s: HBM bandwidth of the chip, bytes/s.
            vmem_bytes_per_core: VMEM of each core, bytes.
            hbm_available_bytes: HBM a program may use on the chip, bytes (0: hbm_bytes).
            **chip_fields: The remaining ChipSpec fields (ici_*, torus_dims, ...),
                and optionally TensorCoreSpec's VPU / scalar fields.

        Returns:
            The ChipSpec, with core.hbm_bytes = hbm_available_bytes // tensorcores and
            core.hbm_bandwidth_bytes_per_s = hbm_bandwidth_bytes_per_s / tensorcores.

        Raises:
            ChipSpecError: if any figure is invalid.
        """
        core_field_names = {f.name for f in dataclasses.fields(TensorCoreSpec)}
        core_extra = {k: chip_fields.pop(k) for k in list(chip_fields) if k in core_field_names}
        _check_int("ChipSpec", "tensorcores", tensorcores, 1)
        _check_positive("ChipSpec", "hbm_bandwidth_bytes_per_s", hbm_bandwidth_bytes_per_s)
        _check_int("ChipSpec", "hbm_bytes", hbm_bytes, 1)
        _check_int("ChipSpec", "hbm_available_bytes", hbm_available_bytes, 0)
        available_bytes = hbm_available_bytes or hbm_bytes
        core = TensorCoreSpec(
            mxu=mxu,
            mxus_per_core=mxus_per_core,
            clock_hz=clock_hz,
            hbm_bytes=available_bytes // tensorcores,
            hbm_bandwidth_bytes_per_s=hbm_bandwidth_bytes_per_s / tensorcores,
            vmem_bytes=vmem_bytes_per_core,
            **core_extra,
        )
        return cls(
            name=name,
            core=core,
            tensorcores=tensorcores,
            hbm_bytes=hbm_bytes,
            hbm_available_bytes=available_bytes,
            hbm_bandwidth_bytes_per_s=hbm_bandwidth_bytes_per_s,
            **chip_fields,
        )


#: One message across the data-centre network between slices, seconds: no published TPU
#: figure; tens of microseconds is the order of a datacentre round trip. An assumption,
#: stated in VALIDATION.md (multislice rows are bandwidth-bound: it hardly moves them).
DCN_LATENCY_S = 2e-5

_MXU_128 = MXUSpec(rows=128, cols=128)  # 128x128 bf16 MACs [SEED: 16K MACs per MXU][GC-v3][GC-v4]
_MXU_256 = MXUSpec(rows=256, cols=256)  # 256x256 [GC-v6e]

V2 = ChipSpec.from_chip_figures(
    name="v2",
    tensorcores=2,  # [JAX][SEED]
    mxu=_MXU_128,  # [SEED: 16K MACs per MXU]
    mxus_per_core=1,  # [SEED]
    clock_hz=700e6,  # der. (45e12 / (2 * 1 * 16384 * 2) ~ 0.69e9; 4.6e13 [JAX] -> 0.70e9)
    hbm_bytes=16 * _GIB,  # 16 GiB, 8 GiB per core [SEED]
    hbm_bandwidth_bytes_per_s=7.16e11,  # [JAX] (600e9 often quoted; unconfirmed)
    vmem_bytes_per_core=16 * _MIB,  # [JAX]
    ici_links=4,  # ICI table
    ici_link_bandwidth_bytes_per_s=62e9,  # ~62e9 one way, unconfirmed (ICI table)
    ici_latency_s=1e-6,  # [SB]
    torus_dims=2,  # 2-D torus (ICI table)
    max_pod_shape=(16, 16),  # 256 chips (ICI table)
    chips_per_host=4,  # ICI table
    host_to_chip_bytes_per_s=1.6e10,  # [SB]
    published_peak_bf16_flops_per_s=45e12,  # [SEED: 180e12 per 4-chip board]
    slice_counts_tensorcores=True,  # "v2-8" = 8 cores = 4 chips [SEED]
    megacore=False,  # two separate cores, not megacore (compute table)
    mxu_efficiency=MXU_FRESH_EFFICIENCY,  # fit: C1, C2, C4 (v5e) with T1-T9, M1-M3, shared
    # no rows: v4's fit carried over (the oldest generation with rows)
    mxu_sustained_efficiency=MXU_SUSTAINED_EFFICIENCY["v4"],  # fit: v4's (T9, M3)
    mxu_burst_seconds=MXU_BURST_SECONDS,  # fit: C1, C2, C4 (v5e), shared
    hbm_efficiency=HBM_EFFICIENCY,  # fit: C5 (v6e), shared
    dcn_bytes_per_s=3.1e9,  # unpublished for v2: v5e's per-chip figure [SB] assumed
    dcn_latency_s=DCN_LATENCY_S,  # an assumption (no published figure): see DCN_LATENCY_S
    slice_shapes=(  # Google Cloud's v2 slice names, TensorCores -> chips per axis (ICI table)
        (8, (2, 2)), (32, (4, 4)), (128, (8, 8)), (256, (8, 16)), (512, (16, 16))),
    wraparound_rule="every_axis",  # every slice a 2-D torus [SB]
)

V3 = ChipSpec.from_chip_figures(
    name="v3",
    tensorcores=2,  # tpu-specs.md compute table
    mxu=_MXU_128,  # [GC-v3]
    mxus_per_core=2,  # [GC-v3]
    clock_hz=940e6,  # der. (123e12 / (2 * 2 * 16384 * 2))
    hbm_bytes=32 * _GIB,  # [GC-v3]
    hbm_bandwidth_bytes_per_s=900e9,  # [GC-v3]
    vmem_bytes_per_core=16 * _MIB,  # [JAX]
    ici_links=4,  # ICI table
    ici_link_bandwidth_bytes_per_s=1e11,  # [SB]
    ici_latency_s=1e-6,  # [SB]
    torus_dims=2,  # 2-D torus (ICI table)
    max_pod_shape=(32, 32),  # 1024 chips [GC-v3]
    chips_per_host=4,  # ICI table
    host_to_chip_bytes_per_s=1.6e10,  # [SB]
    published_peak_bf16_flops_per_s=123e12,  # [GC-v3]
    slice_counts_tensorcores=True,  # "v3-8" = 4 chips [GC-v3]
    megacore=False,  # two separate cores, not megacore (compute table)
    mxu_efficiency=MXU_FRESH_EFFICIENCY,  # fit: C1, C2, C4 (v5e) with T1-T9, M1-M3, shared
    # no rows: v4's fit carried over (the oldest generation with rows)
    mxu_sustained_efficiency=MXU_SUSTAINED_EFFICIENCY["v4"],  # fit: v4's (T9, M3)
    mxu_burst_seconds=MXU_BURST_SECONDS,  # fit: C1, C2, C4 (v5e), shared
    hbm_efficiency=HBM_EFFICIENCY,  # fit: C5 (v6e), shared
    dcn_bytes_per_s=3.1e9,  # unpublished for v3: v5e's per-chip figure [SB] assumed
    dcn_latency_s=DCN_LATENCY_S,  # an assumption (no published figure): see DCN_LATENCY_S
    slice_shapes=(  # slice names, TensorCores -> chips per axis [GC-v3]
        (8, (2, 2)), (32, (4, 4)), (64, (4, 8)), (128, (8, 8)), (256, (8, 16)), (512, (16, 16)),
        (1024, (16, 32)), (2048, (32, 32))),
    wraparound_rule="every_axis",  # every slice a 2-D torus [SB]
)

V4 = ChipSpec.from_chip_figures(
    name="v4",
    tensorcores=2,  # megacore (tpu-specs.md compute table)
    mxu=_MXU_128,  # [GC-v4]
    mxus_per_core=4,  # [GC-v4]
    clock_hz=1050e6,  # der. (275e12 / (2 * 4 * 16384 * 2))
    hbm_bytes=32 * _GIB,  # [GC-v4]
    hbm_available_bytes=33_017_561_088,  # 30.75 GiB [XLA]
    hbm_bandwidth_bytes_per_s=1200e9,  # [GC-v4]
    vmem_bytes_per_core=16 * _MIB,  # [JAX] (plus 128 MiB CMEM, not modelled)
    int8_macs_per_bf16_mac=1.0,  # der.: int8 275e12 / bf16 275e12 [GC-v4]
    ici_links=6,  # ICI table
    ici_link_bandwidth_bytes_per_s=4.5e10,  # [SB]
    ici_latency_s=1e-6,  # [SB]
    torus_dims=3,  # 3-D torus (ICI table)
    max_pod_shape=(16, 16, 16),  # 4096 chips [GC-v4]
    chips_per_host=4,  # ICI table
    host_to_chip_bytes_per_s=1.6e10,  # [SB]
    published_peak_bf16_flops_per_s=275e12,  # [GC-v4]
    slice_counts_tensorcores=True,  # "v4-8" = 4 chips [GC-v4]
    megacore=True,  # the two TensorCores act as one [GC-v4][SB]
    mxu_efficiency=MXU_FRESH_EFFICIENCY,  # fit: C1, C2, C4 (v5e) with T1-T9, M1-M3, shared
    mxu_sustained_efficiency=MXU_SUSTAINED_EFFICIENCY["v4"],  # fit: T9, M3
    mxu_burst_seconds=MXU_BURST_SECONDS,  # fit: C1, C2, C4 (v5e), shared
    hbm_efficiency=HBM_EFFICIENCY,  # fit: C5 (v6e), shared
    # unpublished for v4 (4 chips per host, as v5p):
    dcn_bytes_per_s=6.25e9,  # v5p's per-chip figure [SB] assumed
    dcn_latency_s=DCN_LATENCY_S,  # an assumption (no published figure): see DCN_LATENCY_S
    # custom shapes of 4x4x4 cubes are given by pod.topology
    slice_shapes=(  # slice names, TensorCores -> chips per axis [GC-v4]
        (8, (2, 2, 1)), (16, (2, 2, 2)), (32, (2, 2, 4)), (64, (2, 4, 4)), (128, (4, 4, 4)),
        (256, (4, 4, 8)), (512, (4, 8, 8)), (1024, (8, 8, 8)), (2048, (8, 8, 16)),
        (4096, (8, 16, 16)), (8192, (16, 16, 16))),
    wraparound_rule="whole_cubes",  # [SB]: wraparound on complete 4x4x4 cubes only
)

V5E = ChipSpec.from_chip_figures(
    name="v5e",
    tensorcores=1,  # tpu-specs.md compute table
    mxu=_MXU_128,  # [GC-v5e]
    mxus_per_core=4,  # [GC-v5e]
    clock_hz=1.5e9,  # [SB]
    hbm_bytes=16 * 10**9,  # 16 GB [GC-v5e]
    hbm_available_bytes=16_911_433_728,  # 15.75 GiB [XLA] (Google's "16 GB" is 16 GiB)
    hbm_bandwidth_bytes_per_s=819e9,  # [GC-v5e] (8.1e11 [SB])
    vmem_bytes_per_core=128 * _MIB,  # [SB]
    int8_macs_per_bf16_mac=2.0,  # der.: int8 394e12 / bf16 197e12 [GC-v5e]
    ici_links=4,  # ICI table
    ici_link_bandwidth_bytes_per_s=4.5e10,  # [SB]
    ici_latency_s=1e-6,  # [SB]
    torus_dims=2,  # 2-D torus (ICI table)
    max_pod_shape=(16, 16),  # 256 chips [GC-v5e]
    chips_per_host=8,  # ICI table
    host_to_chip_bytes_per_s=1.6e10,  # [SB]
    published_peak_bf16_flops_per_s=197e12,  # [GC-v5e]
    slice_counts_tensorcores=False,  # "v5e-8" = 8 chips [GC-v5e]
    megacore=False,  # one TensorCore (compute table)
    mxu_efficiency=MXU_FRESH_EFFICIENCY,  # fit: C1, C2, C4 (v5e) with T1-T9, M1-M3, shared
    mxu_sustained_efficiency=MXU_SUSTAINED_EFFICIENCY["v5e"],  # fit: C1, C2, C4, T3, T4, M1
    mxu_burst_seconds=MXU_BURST_SECONDS,  # fit: C1, C2, C4 (v5e), shared
    hbm_efficiency=HBM_EFFICIENCY,  # fit: C5 (v6e), shared
    dcn_bytes_per_s=3.1e9,  # [SB]: about 3.1e9 B/s per chip across slices
    dcn_latency_s=DCN_LATENCY_S,  # an assumption (no published figure): see DCN_LATENCY_S
    slice_shapes=(  # slice names, chips -> chips per axis [GC-v5e]
        (1, (1, 1)), (4, (2, 2)), (8, (2, 4)), (16, (4, 4)), (32, (4, 8)), (64, (8, 8)),
        (128, (8, 16)), (256, (16, 16))),
    wraparound_rule="full_side",  # [SB]: an axis wraps only at its full 16
)

V5P = ChipSpec.from_chip_figures(
    name="v5p",
    tensorcores=2,  # tpu-specs.md compute table
    mxu=_MXU_128,  # [GC-v5p]
    mxus_per_core=4,  # [GC-v5p]
    clock_hz=1.75e9,  # [SB]
    hbm_bytes=95 * _GIB,  # 95 GiB usable [GC-v5p]
    hbm_available_bytes=102_800_042_229,  # 95.74 GiB [XLA]
    hbm_bandwidth_bytes_per_s=2765e9,  # [GC-v5p] (2.8e12 [SB])
    vmem_bytes_per_core=64 * _MIB,  # [JAX]
    int8_macs_per_bf16_mac=2.0,  # der.: int8 918e12 [SB] / bf16 459e12 [GC-v5p]
    ici_links=6,  # ICI table
    ici_link_bandwidth_bytes_per_s=9e10,  # [SB]
    ici_latency_s=1e-6,  # [SB]
    torus_dims=3,  # 3-D torus (ICI table)
    max_pod_shape=(16, 20, 28),  # 8960 chips [GC-v5p]
    chips_per_host=4,  # ICI table
    host_to_chip_bytes_per_s=1.6e10,  # [SB]
    published_peak_bf16_flops_per_s=459e12,  # [GC-v5p]
    slice_counts_tensorcores=True,  # "v5p-8" = 4 chips [GC-v5p]
    megacore=True,  # the two TensorCores act as one [GC-v4][SB]
    mxu_efficiency=MXU_FRESH_EFFICIENCY,  # fit: C1, C2, C4 (v5e) with T1-T9, M1-M3, shared
    mxu_sustained_efficiency=MXU_SUSTAINED_EFFICIENCY["v5p"],  # fit: T1, T2, M2
    mxu_burst_seconds=MXU_BURST_SECONDS,  # fit: C1, C2, C4 (v5e), shared
    hbm_efficiency=HBM_EFFICIENCY,  # fit: C5 (v6e), shared
    dcn_bytes_per_s=6.25e9,  # [SB]: about 6.25e9 B/s per chip across slices
    dcn_latency_s=DCN_LATENCY_S,  # an assumption (no published figure): see DCN_LATENCY_S
    # the standard shapes and the largest pod; other shapes of 4x4x4 cubes by pod.topology
    slice_shapes=(  # slice names, TensorCores -> chips per axis [GC-v5p]
        (8, (2, 2, 1)), (16, (2, 2, 2)), (32, (2, 2, 4)), (64, (2, 4, 4)), (128, (4, 4, 4)),
        (256, (4, 4, 8)), (512, (4, 8, 8)), (1024, (8, 8, 8)), (2048, (8, 8, 16)),
        (4096, (8, 16, 16)), (8192, (16, 16, 16)), (17920, (16, 20, 28))),
    wraparound_rule="whole_cubes",  # [SB]: wraparound on complete 4x4x4 cubes only
)

V6E = ChipSpec.from_chip_figures(
    name="v6e",
    tensorcores=1,  # tpu-specs.md compute table
    mxu=_MXU_256,  # [GC-v6e]
    mxus_per_core=4,  # der.: 4 at 1.75 GHz matches the peak (Google's page says 2)
    clock_hz=1.75e9,  # der. (unpublished; 918e12 / (2 * 4 * 65536) ~ 1.75e9)
    hbm_bytes=32 * 10**9,  # 32 GB [GC-v6e]
    hbm_available_bytes=33_554_432_000,  # 31.25 GiB [XLA] (Google's "32 GB" is 32 GiB)
    hbm_bandwidth_bytes_per_s=1638e9,  # [GC-v6e]
    vmem_bytes_per_core=128 * _MIB,  # [JAX]
    int8_macs_per_bf16_mac=2.0,  # der.: int8 1836e12 / bf16 918e12 [GC-v6e]
    ici_links=4,  # ICI table
    ici_link_bandwidth_bytes_per_s=9e10,  # [SB]
    ici_latency_s=1e-6,  # [SB]
    torus_dims=2,  # 2-D torus (ICI table)
    max_pod_shape=(16, 16),  # 256 chips [GC-v6e]
    chips_per_host=8,  # ICI table
    host_to_chip_bytes_per_s=3.2e10,  # [SB]
    published_peak_bf16_flops_per_s=918e12,  # [GC-v6e]
    slice_counts_tensorcores=False,  # "v6e-8" = 8 chips [GC-v6e]
    megacore=False,  # one TensorCore (compute table)
    mxu_efficiency=MXU_FRESH_EFFICIENCY,  # fit: C1, C2, C4 (v5e) with T1-T9, M1-M3, shared
    mxu_sustained_efficiency=MXU_SUSTAINED_EFFICIENCY["v6e"],  # fit: T5, T6, T7, T8
    mxu_burst_seconds=MXU_BURST_SECONDS,  # fit: C1, C2, C4 (v5e), shared
    hbm_efficiency=HBM_EFFICIENCY,  # fit: C5 (v6e), shared
    # unpublished for v6e (8 chips per host, as v5e):
    dcn_bytes_per_s=3.1e9,  # v5e's per-chip figure [SB] assumed
    dcn_latency_s=DCN_LATENCY_S,  # an assumption (no published figure): see DCN_LATENCY_S
    slice_shapes=(  # slice names, chips -> chips per axis [GC-v6e]
        (1, (1, 1)), (4, (2, 2)), (8, (2, 4)), (16, (4, 4)), (32, (4, 8)), (64, (8, 8)),
        (128, (8, 16)), (256, (16, 16))),
    wraparound_rule="full_side",  # [SB]: an axis wraps only at its full 16
)

PRESETS: dict[str, ChipSpec] = {s.name: s for s in (V2, V3, V4, V5E, V5P, V6E)}


def get_chip_spec(name: str) -> ChipSpec:
    """Returns the preset ChipSpec for a generation name.

    Args:
        name: One of the keys of `PRESETS` ("v2", "v3", "v4", "v5e", "v5p", "v6e").

    Returns:
        The frozen ChipSpec.

    Raises:
        ChipSpecError: (a ValueError) if the name is unknown; the message lists the choices.
    """
    try:
        return PRESETS[name]
    except (KeyError, TypeError):
        choices = ", ".join(repr(k) for k in PRESETS)
        raise ChipSpecError(f"unknown chip {name!r}; choose one of {choices}") from None

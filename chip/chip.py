"""A TPU chip: its TensorCores, each with its own share of the chip's HBM."""

from __future__ import annotations

from chip.core import TensorCore, check_precision
from chip.spec import ChipSpec


class Chip:
    """One TPU chip.

    Args:
        spec: The chip's figures (e.g. `get_chip_spec("v2")`).
        chip_id: Index of the chip in the pod (int >= 0).
        numerics: Passed to every TensorCore (MXU numerics if True).
        precision: MXU precision of every core: "bf16" (default), "fp32" or
            "int8" (see `TensorCore`).
        double_buffered: Double-buffered MXU weights on every core ("scalesim"
            model only, see `TensorCore`).
        mxu_model: MXU cycle count of every core: "pipelined" (default) or
            "scalesim" (see `TensorCore`).

    Attributes:
        spec: The ChipSpec.
        chip_id: As given.
        numerics: As given.
        precision: As given.
        mxu_model: As given.
        cores: spec.tensorcores TensorCores named "chip{chip_id}/core{i}", each
            with an HBM of spec.core.hbm_bytes and an equal share of the host
            link (spec.host_to_chip_bytes_per_s / tensorcores).

    Raises:
        ValueError: if chip_id is not an int >= 0.
        TypeError: if spec is not a ChipSpec.
        PrecisionError: unknown precision, or int8 on a chip without it (v2, v3).
        ValueError: unknown mxu_model.
    """

    def __init__(self, spec: ChipSpec, chip_id: int = 0, *, numerics: bool = True,
                 precision: str = "bf16", double_buffered: bool = False,
                 mxu_model: str = "pipelined") -> None:
        if not isinstance(spec, ChipSpec):
            raise TypeError(f"spec must be a ChipSpec, got {spec!r}")
        if isinstance(chip_id, bool) or not isinstance(chip_id, int) or chip_id < 0:
            raise ValueError(f"chip_id must be an integer >= 0, got {chip_id!r}")
        self.spec = spec
        self.chip_id = chip_id
        self.numerics = bool(numerics)
        self.precision = check_precision(precision, spec.core, spec.name)
        self.mxu_model = mxu_model
        self.cores = [
            TensorCore(spec.core, numerics=numerics, name=f"chip{chip_id}/core{i}",
                       precision=precision, double_buffered=double_buffered, mxu_model=mxu_model,
                       host_bytes_per_s=spec.host_to_chip_bytes_per_s / spec.tensorcores)
            for i in range(spec.tensorcores)
        ]

    def __repr__(self) -> str:
        return f"Chip(spec={self.spec.name!r}, chip_id={self.chip_id}, cores={len(self.cores)})"

    @property
    def hbm_peak_bytes(self) -> list[int]:
        """Peak HBM use of each core, bytes, in core order."""
        return [core.hbm.peak_bytes for core in self.cores]

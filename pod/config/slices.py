"""Google Cloud TPU slice names and the pod shapes they stand for.

A slice name is ``<generation>-<count>``. For v2, v3, v4 and v5p the count is
TensorCores (``v2-8`` = 4 chips of 2 cores); for v5e and v6e it counts chips
(``v5e-16`` = 16 chips) [GC-v4], [GC-v5e]. The chip preset's
``slice_counts_tensorcores`` says which.

Shapes: a slice is laid out on the generation's torus (2-D for v2, v3, v5e,
v6e; 3-D for v4, v5p); a named slice takes its shape from its chip preset's
``slice_shapes`` (Google's tables: v4-32 = 2x2x4, v5e-8 = 2x4; :data:`SLICE_SHAPES`
gathers them); v4 and v5p also name every whole number of 4x4x4 cubes that fits their
largest pod (v4-384 = 4x4x12: ``ChipSpec.slice_shape``). A chip preset with a count and
no shape gets the most nearly square (cubic) power-of-two factorisation.

Wraparound follows the generation's rules [SB], its chip preset's
``wraparound_rule``: v5e / v6e wrap an axis only at its full size 16; v4 / v5p
have wraparound only on complete 4x4x4 cubes and their multiples; v2 / v3
slices are 2-D tori.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from chip import PRESETS, ChipSpec, get_chip_spec
from chip.spec import CUBE_CHIPS
from interconnect import Torus, parse_shape
from pod.errors import ScenarioError

__all__ = ["Topology", "SLICE_SHAPES", "parse_slice", "slice_shape", "default_shape",
           "default_wraparound", "resolve_pod"]

_SLICE_RE = re.compile(r"^(v[0-9a-z]+)-([0-9]+)$")


@dataclass(frozen=True)
class Topology:
    """The hardware a scenario's ``pod`` section resolves to (``TrainingPlan.topology``):
    which chip, how many, and how they are wired. MaxText and JAX call this the
    topology (``compile_topology: v5e-256``, ``num_slices``).

    Attributes:
        chip: the chip preset every chip of the pod uses.
        torus: the ICI topology of one slice; ``torus.num_chips`` chips.
        slice_name: Google's name for the slice when it has one, else "".
        slices: identical slices joined by the data-centre network (multislice,
            ``pod.slices``); chip ranks run on from one slice to the next.
    """

    chip: ChipSpec
    torus: Torus
    slice_name: str = ""
    slices: int = 1

    @property
    def slice_chips(self) -> int:
        """Chips in one slice."""
        return self.torus.num_chips

    @property
    def chips(self) -> int:
        """Number of chips in the pod (every slice's)."""
        return self.slices * self.torus.num_chips

    @property
    def tensorcores(self) -> int:
        """Number of TensorCores in the pod (chips x cores per chip)."""
        return self.chips * self.chip.tensorcores

    @property
    def peak_bf16_flops_per_s(self) -> float:
        """Pod peak bf16 FLOP/s: chips x the chip's derived peak."""
        return self.chips * self.chip.peak_bf16_flops_per_s

    @property
    def hbm_bytes(self) -> int:
        """Total HBM of the pod in bytes."""
        return self.chips * self.chip.hbm_bytes

    @property
    def name(self) -> str:
        """The slice name, or ``<chip>:<torus>`` when there is none; ``<K> x <slice>``
        for K slices."""
        one = self.slice_name or f"{self.chip.name}:{self.torus.name}"
        return one if self.slices == 1 else f"{self.slices} x {one}"


#: Google Cloud's slice names -> torus shape (chips per axis), by generation: each chip
#: preset's ``slice_shapes`` (``chip.spec``: a new generation is its preset and its
#: calibration rows). The number in the name counts TensorCores for v2, v3, v4, v5p and
#: chips for v5e, v6e [GC-v3], [GC-v4], [GC-v5e], [GC-v5p], [GC-v6e]. v4 and v5p also
#: accept custom shapes made of 4x4x4 cubes (give ``pod.topology`` with ``chip``); the
#: table holds the standard ones and the largest pod.
SLICE_SHAPES: dict[str, dict[int, tuple[int, ...]]] = {
    name: dict(spec.slice_shapes) for name, spec in PRESETS.items() if spec.slice_shapes}


def parse_slice(name: str) -> tuple[ChipSpec, int]:
    """Parse a Google slice name into its chip preset and chip count.

    Args:
        name: e.g. "v2-8", "v4-32", "v5e-16".

    Returns:
        (chip preset, number of chips).

    Raises:
        ScenarioError: the text is not ``<chip>-<count>``, the chip is unknown,
            or Google has no slice of that count (the message lists the
            valid names of that generation).
    """
    return _slice(name)[:2]


def slice_shape(name: str) -> tuple[int, ...]:
    """The torus shape of a Google slice, e.g. ``slice_shape("v4-32") == (2, 2, 4)``.

    Raises:
        ScenarioError: as :func:`parse_slice`.
    """
    return _slice(name)[2]


def _slice(name: str) -> tuple[ChipSpec, int, tuple[int, ...]]:
    match = _SLICE_RE.match(str(name).strip().lower())
    if not match:
        raise ScenarioError(
            f"slice {name!r} is not a slice name; expected <chip>-<count> such as v2-8, "
            f"v4-32 or v5e-16 with chip one of {', '.join(PRESETS)}"
        )
    chip = get_chip_spec(match.group(1))
    count = int(match.group(2))
    unit = "TensorCores" if chip.slice_counts_tensorcores else "chips"
    shape = chip.slice_shape(count)
    if shape is None:
        valid = ", ".join(f"{chip.name}-{c}" for c, _ in chip.slice_shapes)
        per_chip = (f", a multiple of {chip.tensorcores} per chip"
                    if chip.slice_counts_tensorcores else "")
        if chip.wraparound_rule == "whole_cubes":  # ChipSpec.slice_shape: whole 4x4x4 cubes
            cube = CUBE_CHIPS * (chip.tensorcores if chip.slice_counts_tensorcores else 1)
            largest = math.prod(chip.max_pod_shape) * cube // CUBE_CHIPS
            valid += (f", and any multiple of {cube} up to {largest} whose 4x4x4 cubes fit "
                      f"the {'x'.join(map(str, chip.max_pod_shape))} pod")
        raise ScenarioError(
            f"slice {name!r} does not exist: the number counts {unit} for {chip.name}{per_chip}; "
            f"valid {chip.name} slices: {valid}"
        )
    return chip, math.prod(shape), shape


def default_shape(chips: int, dims: int) -> tuple[int, ...]:
    """The most nearly square (cubic) shape of ``dims`` axes holding ``chips``.

    Factors of two are dealt to the smallest axis first (largest axis first
    in the result), then any odd remainder goes to the first axis.

    Args:
        chips: number of chips, >= 1.
        dims: number of torus axes (1, 2 or 3).

    Returns:
        A shape tuple whose product is ``chips``, e.g. (2, 2) for 4 chips
        in 2-D, (4, 4, 2) for 32 chips in 3-D. Axes of size 1 are kept.

    Raises:
        ValueError: chips < 1 or dims not in 1..3.
    """
    if chips < 1:
        raise ValueError(f"chips must be >= 1, got {chips}")
    if dims not in (1, 2, 3):
        raise ValueError(f"dims must be 1, 2 or 3, got {dims}")
    axes = [1] * dims
    rest = chips
    while rest % 2 == 0:
        axes[axes.index(min(axes))] *= 2
        rest //= 2
    axes.sort(reverse=True)
    axes[0] *= rest
    return tuple(axes)


def default_wraparound(chip: ChipSpec, shape: tuple[int, ...]) -> tuple[bool, ...]:
    """Which axes have wraparound links, by the generation's rules [SB]: the chip
    preset's ``wraparound_rule`` (``ChipSpec.default_wraparound``).

    Args:
        chip: the chip preset.
        shape: the torus shape.

    Returns:
        One bool per axis.
    """
    return chip.default_wraparound(shape)


def _chip(name: str) -> ChipSpec:
    """``get_chip_spec``, with the scenario field in the message."""
    try:
        return get_chip_spec(name)
    except ValueError as err:  # ChipSpecError
        raise ScenarioError(f"pod.chip: {err}") from None


def resolve_pod(
    *,
    slice_name: str | None = None,
    chip: str | None = None,
    chips: int | None = None,
    topology: str | None = None,
    wraparound: bool | None = None,
    slices: int = 1,
) -> Topology:
    """Resolve the pod a scenario asks for.

    Either ``slice_name`` or ``chip`` (with ``chips`` and/or ``topology``)
    names one slice; ``slices`` of them make the pod (multislice). The
    topology shape must hold exactly the slice's chips.

    Raises:
        ScenarioError: conflicting or incomplete fields, a topology whose
            shape does not match the chip count, an unknown slice or chip
            name, or malformed topology text; the message starts with the
            field (``pod.slice: ...``, ``pod.chip: ...``, ``pod.topology: ...``).
    """
    name = ""
    named_shape = None
    count: int | None
    if slice_name:
        try:
            spec, count, named_shape = _slice(slice_name)
        except ValueError as err:  # ScenarioError, ChipSpecError: name the field
            raise ScenarioError(f"pod.slice: {err}") from None
        name = slice_name.lower()
        if chip and _chip(chip).name != spec.name:
            raise ScenarioError(f"pod.chip: {chip!r} contradicts pod.slice {slice_name!r}, a "
                                f"{spec.name} slice; give one of them")
        if chips is not None and chips != count:
            raise ScenarioError(
                f"pod.chips: {chips} contradicts pod.slice {slice_name!r}, which has {count} "
                f"chips; give one of them"
            )
    elif chip:
        spec = _chip(chip)
        count = chips
    else:
        raise ScenarioError("pod: give either slice (e.g. v2-8) or chip (e.g. v2) with chips")

    if topology:
        try:
            shape = parse_shape(topology)
        except ValueError as err:  # TopologyError: name the field
            raise ScenarioError(f"pod.topology: {err}") from None
        product = 1
        for axis in shape:
            product *= axis
        if count is None:
            count = product
        elif product != count:
            example = "x".join(map(str, named_shape or default_shape(count, spec.torus_dims)))
            raise ScenarioError(
                f"pod.topology: {topology!r} holds {product} chips but the pod has {count}; "
                f"give a shape of {count} chips such as {example}"
            )
    elif named_shape is not None:
        shape = named_shape
    else:
        if count is None:
            raise ScenarioError("pod: give chips or topology together with chip")
        shape = default_shape(count, spec.torus_dims)
    wrap = default_wraparound(spec, shape) if wraparound is None else wraparound
    if not isinstance(slices, int) or isinstance(slices, bool) or slices < 1:
        raise ScenarioError(f"pod.slices: {slices!r} is not a number of slices; give a whole "
                            "number >= 1")
    return Topology(chip=spec, torus=Torus(shape, wrap), slice_name=name, slices=slices)

"""``tpu-pod collective``: a collective benchmark read like nccl-tests, in simulated time.

For each message size it costs one collective on the chip's ICI
(``interconnect.collective_cost``: per phase the busiest directed link's
bytes over its bandwidth plus per-hop latency) and reports, as the GPU
collective benchmarks do:

- ``size``: the whole buffer in bytes (for all-gather, the gathered output;
  for all-to-all, rounded down to a multiple of chips x 4 bytes);
- ``time``: simulated seconds;
- ``algbw = size / time``;
- ``busbw = algbw x factor``, the factor of nccl-tests' PERFORMANCE.md:
  allreduce ``2 (n-1)/n``, reduce-scatter, all-gather and all-to-all
  ``(n-1)/n``, broadcast 1;
- the busiest link's utilisation: its busy time over the collective's time.

Elements are float32 (4 bytes). Every figure is simulated time.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from chip import ChipSpec, get_chip_spec
from interconnect import ALGORITHMS, LinkFaults, Torus, calibrated_link, parse_shape
from pod.config.ici import choose_algorithm
from pod.errors import BenchError
from pod.config.slices import default_wraparound

__all__ = ["CollectiveRow", "OPS_BY_NAME", "bus_factor", "parse_size", "parse_sizes", "run_collective_bench"]

ITEMSIZE = 4  # float32

#: CLI names of the operations -> interconnect op names.
OPS_BY_NAME = {"allreduce": "allreduce", "reduce-scatter": "reduce_scatter",
               "all-gather": "all_gather", "all-to-all": "all_to_all", "broadcast": "broadcast",
               "ppermute": "ppermute"}

_UNITS = {"": 1, "b": 1, "k": 1024, "kib": 1024, "kb": 1000, "m": 1024**2, "mib": 1024**2,
          "mb": 1000**2, "g": 1024**3, "gib": 1024**3, "gb": 1000**3}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """Parses a byte count: ``4096``, ``1KiB``, ``64K`` (K = KiB as in nccl-tests), ``1MB`` (10^6).

    Raises:
        BenchError: not a positive whole number with a known unit; the message lists the units.
    """
    match = _SIZE_RE.match(str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise BenchError(f"size {text!r} is not valid: write a whole number of bytes with an optional "
                         f"unit B, K/KiB, M/MiB, G/GiB (powers of 1024) or KB, MB, GB (powers of 1000), "
                         f"e.g. 1KiB or 64M")
    value = int(match.group(1)) * _UNITS[unit]
    if value < 1:
        raise BenchError(f"size {text!r} is not valid: must be at least 1 byte")
    return value


def parse_sizes(text: str) -> list[int]:
    """One size, or ``MIN:MAX`` doubling from MIN while <= MAX (as nccl-tests ``-b -e -f 2``).

    Raises:
        BenchError: a bad size, or MIN > MAX.
    """
    parts = str(text).split(":")
    if len(parts) == 1:
        return [parse_size(parts[0])]
    if len(parts) != 2:
        raise BenchError(f"sizes {text!r} is not valid: give one size or a range MIN:MAX, e.g. 1KiB:1GiB")
    low, high = parse_size(parts[0]), parse_size(parts[1])
    if low > high:
        raise BenchError(f"sizes {text!r} is not valid: MIN ({low} bytes) is larger than MAX ({high} bytes)")
    sizes = []
    while low <= high:
        sizes.append(low)
        low *= 2
    return sizes


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw for an operation on n ranks (nccl-tests, PERFORMANCE.md)."""
    if n <= 1:
        return 1.0 if op == "broadcast" else 0.0
    return {"allreduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_gather": (n - 1) / n,
            "all_to_all": (n - 1) / n, "broadcast": 1.0, "ppermute": 1.0}[op]


@dataclass(frozen=True)
class CollectiveRow:
    """One line of the table; every time is simulated.

    Attributes:
        size_bytes: the buffer (see module docstring).
        count: float32 elements.
        algorithm: the algorithm run (chosen when not given).
        simulated_seconds: the collective over the ICI.
        algbw_bytes_per_s: size / time.
        busbw_bytes_per_s: algbw x bus factor.
        busiest_link_utilization: busiest link's busy time / time, 0..1.
        local_reduce_seconds: the on-chip add of the chip's TensorCores
            before the ICI (reducing ops on multi-core chips; else 0), at the
            core's HBM bandwidth: (cores - 1) x 3 x size / bandwidth, as
            ``ChipActor.compute`` costs it on the vector unit. Not in
            ``simulated_seconds``.
    """

    size_bytes: int
    count: int
    algorithm: str
    simulated_seconds: float
    algbw_bytes_per_s: float
    busbw_bytes_per_s: float
    busiest_link_utilization: float
    local_reduce_seconds: float

    def as_dict(self) -> dict:
        return asdict(self)


def run_collective_bench(chip: str, topology: str, op: str, sizes: list[int], *,
                         algorithm: str | None = None, wraparound: bool | None = None,
                         faults: LinkFaults | None = None) -> tuple[ChipSpec, Torus, list[CollectiveRow]]:
    """Costs the collective at every size.

    Args:
        chip: chip preset name (v2 ... v6e).
        topology: shape text, e.g. "4x4".
        op: a key of :data:`OPS_BY_NAME`.
        sizes: bytes per size.
        algorithm: an algorithm of the op, or None for the fastest at each size.
        wraparound: None: the chip generation's rules.
        faults: slowed / failed links.

    Returns:
        (chip spec, torus, rows).

    Raises:
        BenchError, ChipSpecError, TopologyError, ScheduleError: bad options.
    """
    spec = get_chip_spec(chip)
    if op not in OPS_BY_NAME:
        raise BenchError(f"op {op!r} is not valid: expected one of {', '.join(OPS_BY_NAME)}")
    name = OPS_BY_NAME[op]
    if algorithm is not None and algorithm not in ALGORITHMS[name]:
        raise BenchError(f"algorithm {algorithm!r} is not available for {op}: expected one of "
                         f"{', '.join(ALGORITHMS[name])}")
    shape = parse_shape(topology)
    torus = Torus(shape, default_wraparound(spec, shape) if wraparound is None else wraparound)
    n = torus.num_chips
    link = calibrated_link(spec.name, spec.ici_link_bandwidth_bytes_per_s, spec.ici_latency_s)
    rows = []
    for size in sizes:
        count = size // ITEMSIZE
        if name == "all_to_all":
            count -= count % n
        if count < 1:
            raise BenchError(f"size {size} bytes is too small for {op} of float32 on {n} chips")
        nbytes = count * ITEMSIZE
        chosen, cost = choose_algorithm(name, torus, count, link, algorithm=algorithm, faults=faults)
        seconds = cost.seconds
        algbw = nbytes / seconds if seconds > 0 else float("inf")
        reduces = name in ("allreduce", "reduce_scatter")
        # megacore chips (v4, v5p) are one device: no separate core-to-core reduce
        local = (0.0 if spec.megacore else
                 (spec.tensorcores - 1) * 3 * nbytes / spec.core.achieved_hbm_bandwidth_bytes_per_s
                 if reduces else 0.0)
        rows.append(CollectiveRow(size_bytes=nbytes, count=count, algorithm=chosen,
                                  simulated_seconds=seconds, algbw_bytes_per_s=algbw,
                                  busbw_bytes_per_s=algbw * bus_factor(name, n),
                                  busiest_link_utilization=cost.busiest_link_utilization,
                                  local_reduce_seconds=local))
    return spec, torus, rows


def format_size(nbytes: int) -> str:
    """1024 -> '1 KiB'."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"

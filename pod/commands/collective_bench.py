"""``tpu-pod collective``: a collective benchmark read like nccl-tests, in simulated time.

For each message size it costs one collective on the chip's ICI
(``interconnect.collective_cost``: per phase the busiest directed link's
bytes over its bandwidth plus per-hop latency) and reports, as the GPU
collective benchmarks do:

- ``size``: the whole buffer in bytes as given (for all-gather, the gathered
  output). Elements are of ``dtype`` (bf16 2 bytes, fp32 4, int8 1); a size that
  is not a whole number of elements, or (reduce-scatter, all-gather,
  all-to-all) of elements per chip, is cut down to one, as nccl-tests cuts its
  counts, and the row says how (``cut``): nothing is rounded silently;
- ``time``: simulated seconds;
- ``algbw = bytes moved / time``;
- ``busbw = algbw x factor``, the factor of nccl-tests' PERFORMANCE.md
  (NVIDIA/nccl-tests, doc/PERFORMANCE.md, "Bus bandwidth"): allreduce
  ``2 (n-1)/n``, reduce-scatter, all-gather and all-to-all ``(n-1)/n``,
  broadcast 1;
- the busiest link's utilisation: its busy time over the collective's time.

The run ends with nccl-tests' summary line, ``# Avg bus bandwidth : X``, the
mean busbw over the sizes (nccl-tests' ``common.cu`` averages the bus bandwidth
of every size it ran), in GB/s. Every figure is simulated time.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from statistics import fmean

from chip import ChipSpec
from interconnect import (
    ALGORITHMS,
    MAX_COST_WORK,
    LinkFaults,
    Torus,
    calibrated_link,
    check_cost_work,
    cost_work,
)
from pod.config.ici import choose_algorithm
from pod.config.slices import resolve_pod
from pod.errors import BenchError, ScenarioError

__all__ = ["CollectiveRow", "DTYPES", "OPS_BY_NAME", "avg_bus_bandwidth", "bus_factor",
           "bench_torus", "cut_count", "format_size", "parse_size", "parse_sizes",
           "run_collective_bench", "summary_line"]

#: ``--dtype`` names -> bytes per element (nccl-tests' ``-d``: bfloat16, float, int8); the
#: names of the precisions elsewhere (``chip.PRECISIONS``, ``matmul --precision``).
DTYPES = {"bf16": 2, "fp32": 4, "int8": 1}
#: other names of those element types, accepted as they are (``f32`` was ``--dtype``'s name)
DTYPE_ALIASES = {"f32": "fp32", "float32": "fp32", "float": "fp32", "bfloat16": "bf16"}

#: CLI names of the operations -> interconnect op names.
OPS_BY_NAME = {"allreduce": "allreduce", "reduce-scatter": "reduce_scatter",
               "all-gather": "all_gather", "all-to-all": "all_to_all", "broadcast": "broadcast",
               "ppermute": "ppermute"}

#: Ops whose buffer is split into one equal part per chip (nccl-tests cuts their count
#: to a multiple of the ranks: ``count / nranks * nranks``).
_PER_CHIP = ("reduce_scatter", "all_gather", "all_to_all")

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
        raise BenchError(f"size {text!r} is not valid: write a whole number of bytes with an "
                         f"optional unit B, K/KiB, M/MiB, G/GiB (powers of 1024) or KB, MB, GB "
                         f"(powers of 1000), "
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
        raise BenchError(f"sizes {text!r} is not valid: give one size or a range MIN:MAX, "
                         "e.g. 1KiB:1GiB")
    low, high = parse_size(parts[0]), parse_size(parts[1])
    if low > high:
        raise BenchError(f"sizes {text!r} is not valid: MIN ({low} bytes) is larger than MAX "
                         f"({high} bytes)")
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
        requested_bytes: the size as given.
        size_bytes: the bytes the collective moves: ``count`` whole elements
            (``requested_bytes`` unless cut, see ``cut``).
        count: elements of ``dtype``.
        dtype: bf16, fp32 or int8.
        cut: how ``requested_bytes`` was cut to ``size_bytes`` ("" if it was not).
        algorithm: the algorithm run (chosen when not given).
        simulated_seconds: the collective over the ICI.
        algbw_bytes_per_s: size_bytes / time.
        busbw_bytes_per_s: algbw x bus factor.
        busiest_link_utilization: busiest link's busy time / time, 0..1.
        local_reduce_seconds: the on-chip add of the chip's TensorCores
            before the ICI (reducing ops on multi-core chips; else 0), at the
            core's HBM bandwidth: (cores - 1) x 3 x size / bandwidth, as
            ``ChipActor.compute`` costs it on the vector unit. Not in
            ``simulated_seconds``.
    """

    requested_bytes: int
    size_bytes: int
    count: int
    dtype: str
    cut: str
    algorithm: str
    simulated_seconds: float
    algbw_bytes_per_s: float
    busbw_bytes_per_s: float
    busiest_link_utilization: float
    local_reduce_seconds: float

    def as_dict(self) -> dict:
        return asdict(self)


def bench_torus(*, slice_name: str | None = None, chip: str | None = None,
                topology: str | None = None,
                wraparound: bool | None = None) -> tuple[ChipSpec, Torus]:
    """The chip and torus of a benchmark: a slice (``v4-128``), or a chip with a topology.

    Raises:
        BenchError: neither given, or a bad slice, chip or shape (one line naming the
            option: ``--slice``, ``--chip``, ``--topology``).
    """
    if not slice_name and not (chip and topology):
        raise BenchError("give --slice (e.g. v4-128) or --chip with --topology (e.g. --chip v5e "
                         "--topology 4x4)")
    try:
        pod = resolve_pod(slice_name=slice_name, chip=chip, topology=topology,
                          wraparound=wraparound)
    except (ScenarioError, ValueError) as err:
        raise BenchError(re.sub(r"\bpod\.(slice|chips|chip|topology)\b", r"--\1",
                                str(err))) from None
    return pod.chip, pod.torus


def cut_count(size_bytes: int, itemsize: int, op: str, chips: int,
              dtype: str = "fp32") -> tuple[int, str]:
    """Whole elements of a ``size_bytes`` buffer for ``op`` on ``chips``, and how it was cut.

    Returns:
        (count, cut): ``cut`` is "" when ``size_bytes`` is ``count`` whole elements, else
        one sentence saying what was dropped and why.

    Raises:
        BenchError: too small to hold one element (one per chip for per-chip ops).
    """
    count = size_bytes // itemsize
    reasons = []
    if count * itemsize != size_bytes:
        reasons.append(f"{size_bytes:,} B is not a whole number of {itemsize}-byte {dtype} "
                       f"elements")
    if op in _PER_CHIP and count % chips:
        reasons.append(f"{count:,} elements do not split into {chips} equal parts (one per chip)")
        count -= count % chips
    if count < 1:
        least = itemsize * (chips if op in _PER_CHIP else 1)
        raise BenchError(f"size {size_bytes:,} B is too small for {op.replace('_', '-')} of "
                         f"{dtype} on {chips} chips: at least {least:,} B")
    if not reasons:
        return count, ""
    return count, (f"{'; '.join(reasons)}: cut to {count:,} elements = {count * itemsize:,} B "
                   f"(as nccl-tests cuts its counts)")


def run_collective_bench(chip: str | None, topology: str | None, op: str, sizes: list[int], *,
                         algorithm: str | Sequence[str] | None = None,
                         wraparound: bool | None = None, faults: LinkFaults | None = None,
                         dtype: str = "fp32", slice_name: str | None = None
                         ) -> tuple[ChipSpec, Torus, list[CollectiveRow]]:
    """Costs the collective at every size (and every algorithm given).

    Args:
        chip: chip preset name (v2 ... v6e), with ``topology``; or None with ``slice_name``.
        topology: shape text, e.g. "4x4".
        op: a key of :data:`OPS_BY_NAME`.
        sizes: bytes per size, as given.
        algorithm: an algorithm of the op, several (a row each per size), or None for
            the fastest at each size.
        wraparound: None: the chip generation's rules.
        faults: slowed / failed links.
        dtype: a key of :data:`DTYPES` (or of :data:`DTYPE_ALIASES`).
        slice_name: a Google slice name (``v4-128``) instead of chip and topology.

    Returns:
        (chip spec, torus, rows): per size, a row per algorithm.

    Raises:
        BenchError, ChipSpecError, TopologyError, ScheduleError: bad options.
    """
    if op not in OPS_BY_NAME:
        raise BenchError(f"op {op!r} is not valid: expected one of {', '.join(OPS_BY_NAME)}")
    dtype = DTYPE_ALIASES.get(dtype, dtype)
    if dtype not in DTYPES:
        raise BenchError(f"dtype {dtype!r} is not valid: expected one of {', '.join(DTYPES)}")
    name = OPS_BY_NAME[op]
    algorithms = [algorithm] if algorithm is None or isinstance(algorithm, str) else list(algorithm)
    for given in algorithms:
        if given is not None and given not in ALGORITHMS[name]:
            raise BenchError(f"algorithm {given!r} is not available for {op}: expected one of "
                             f"{', '.join(ALGORITHMS[name])}")
    spec, torus = bench_torus(slice_name=slice_name, chip=chip, topology=topology,
                              wraparound=wraparound)
    link = calibrated_link(spec.name, spec.ici_link_bandwidth_bytes_per_s, spec.ici_latency_s)
    candidates = _affordable(name, torus, algorithms, len(sizes), faults)
    rows = []
    for size in sizes:
        count, cut = cut_count(size, DTYPES[dtype], name, torus.num_chips, dtype)
        for given in algorithms:
            chosen, cost = choose_algorithm(name, torus, count, link, algorithm=given,
                                            itemsize=DTYPES[dtype], faults=faults,
                                            candidates=candidates)
            rows.append(_row(spec, name, torus.num_chips, size, count, dtype, cut, chosen, cost))
    return spec, torus, rows


#: The work one ``tpu-pod collective`` may take over all its sizes
#: (``interconnect.cost_work`` units: about 10 ns of CPU each, so about 5 s).
MAX_BENCH_WORK = 2 * MAX_COST_WORK


def _affordable(op: str, torus: Torus, algorithms: Sequence[str | None], sizes: int,
                faults: LinkFaults | None) -> list[str] | None:
    """The algorithms ``auto`` compares: those whose cost at every size fits
    ``MAX_BENCH_WORK`` (None when every one does). A given algorithm is checked too.

    Raises:
        ScheduleError: a given algorithm, or every one, past the limit (one line).
    """
    for given in algorithms:
        if given is not None:
            check_cost_work(op, torus, given, faults, calls=sizes, limit=MAX_BENCH_WORK)
    names = ALGORITHMS[op]
    fits = [a for a in names if cost_work(op, torus, a, faults) * sizes <= MAX_BENCH_WORK]
    if not fits:
        check_cost_work(op, torus, names[0], faults, calls=sizes, limit=MAX_BENCH_WORK)
    return None if len(fits) == len(names) else fits


def _row(spec: ChipSpec, op: str, n: int, size: int, count: int, dtype: str, cut: str,
         algorithm: str, cost) -> CollectiveRow:
    nbytes = count * DTYPES[dtype]
    seconds = cost.seconds
    algbw = nbytes / seconds if seconds > 0 else float("inf")
    reduces = op in ("allreduce", "reduce_scatter")
    # megacore chips (v4, v5p) are one device: no separate core-to-core reduce
    local = (0.0 if spec.megacore or not reduces else
             (spec.tensorcores - 1) * 3 * nbytes / spec.core.achieved_hbm_bandwidth_bytes_per_s)
    return CollectiveRow(requested_bytes=size, size_bytes=nbytes, count=count, dtype=dtype,
                         cut=cut, algorithm=algorithm, simulated_seconds=seconds,
                         algbw_bytes_per_s=algbw, busbw_bytes_per_s=algbw * bus_factor(op, n),
                         busiest_link_utilization=cost.busiest_link_utilization,
                         local_reduce_seconds=local)


def avg_bus_bandwidth(rows: Sequence[CollectiveRow], *, by_algorithm: bool = False
                      ) -> dict[str, float]:
    """Mean busbw (bytes/s) over the sizes, nccl-tests' average (the plain mean of every
    size's bus bandwidth): one figure keyed "" (the fastest per size, or one algorithm),
    or with ``by_algorithm`` one per algorithm given."""
    series: dict[str, list[float]] = {}
    for row in rows:
        series.setdefault(row.algorithm if by_algorithm else "", []).append(row.busbw_bytes_per_s)
    return {name: fmean(values) for name, values in series.items()}


def summary_line(busbw_bytes_per_s: float, label: str = "") -> str:
    """nccl-tests' closing line, ``# Avg bus bandwidth    : 123.456 GB/s`` (GB = 10^9 B)."""
    return (f"# Avg bus bandwidth    : {busbw_bytes_per_s / 1e9:.4f} GB/s"
            + (f" ({label})" if label else ""))


def format_size(nbytes: int) -> str:
    """1024 -> '1 KiB'."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes:,} B"

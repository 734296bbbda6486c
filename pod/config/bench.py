"""A benchmark scenario (``benchmark:`` instead of ``model`` / ``training``)
resolved and checked without Ray: its pod and its HBM plan per TensorCore."""

from __future__ import annotations

from dataclasses import dataclass

from chip import HBM, check_precision
from pod.config.scenario import BenchmarkConfig, Scenario
from pod.config.slices import Topology, resolve_pod
from pod.errors import ScenarioError

__all__ = ["BenchmarkPlan", "check_benchmark"]


@dataclass(frozen=True)
class BenchmarkPlan:
    """A benchmark scenario resolved against its pod.

    Attributes:
        scenario: The scenario (its ``benchmark`` section is set).
        topology: the chip preset and the slice's ICI torus (``Topology``).
        memory: Per TensorCore HBM plan, bytes: the benchmark's arrays and total.
    """

    scenario: Scenario
    topology: Topology
    memory: dict[str, int]

    @property
    def benchmark(self) -> BenchmarkConfig:
        """The scenario's benchmark section (a benchmark plan's scenario always has one)."""
        return _benchmark_section(self.scenario)

    def __repr__(self) -> str:
        """One line (a notebook cell's value)."""
        b = self.benchmark
        return (f"<BenchmarkPlan {self.scenario.name}: {b.kind} N={b.n:,} x {b.iterations:,} "
                f"on {self.topology.name} ({self.topology.chips:,} chips), {b.precision}>")

    @property
    def flops(self) -> float:
        """FLOPs of the whole run over the pod (useful FLOPs)."""
        b = self.benchmark
        per = 2.0 * b.n**3 if b.kind == "matmul" else float(b.n) ** 2
        return self.topology.tensorcores * b.iterations * per


def _benchmark_section(scenario: Scenario) -> BenchmarkConfig:
    """The scenario's benchmark section.

    Raises:
        ScenarioError: a training scenario (it has none).
    """
    if scenario.benchmark is None:
        raise ScenarioError(f"{scenario.name}: not a benchmark scenario (no benchmark section)")
    return scenario.benchmark


def check_benchmark(scenario: Scenario) -> BenchmarkPlan:
    """Resolve and check a benchmark scenario without Ray.

    Raises:
        ScenarioError: not a benchmark scenario. PrecisionError: int8 on v2 / v3.
        HBMOutOfMemoryError: the arrays do not fit one TensorCore's HBM.
    """
    b = _benchmark_section(scenario)
    cfg = scenario.pod
    pod = resolve_pod(slice_name=cfg.slice, chip=cfg.chip, chips=cfg.chips,
                      topology=cfg.topology, wraparound=cfg.wraparound)
    try:
        check_precision(b.precision, pod.chip.core, pod.chip.name)
    except ValueError as err:
        raise ScenarioError(f"benchmark.precision: {err}") from None
    if b.kind == "matrix_add" and b.precision != "bf16":
        raise ScenarioError("benchmark.precision: matrix_add runs on the VPU in float32; "
                            f"leave precision at bf16 (got {b.precision!r})")
    n2 = b.n * b.n
    if b.kind == "matmul":
        items = {"x": 4 * n2, "y": 4 * n2, "product": 4 * n2}
    else:
        items = {"a": 4 * n2, "b": 4 * n2, "c": 4 * n2}
    hbm = HBM(pod.chip.core.hbm_bytes, name=f"{pod.chip.name} TensorCore")
    for tag, nbytes in items.items():
        hbm.allocate(tag, nbytes)
    return BenchmarkPlan(scenario=scenario, topology=pod, memory={**items, "total": hbm.used_bytes})

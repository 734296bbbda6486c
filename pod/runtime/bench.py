"""The seed benchmarks over chip actors: ``BenchmarkChipActor`` (one chip running
the work on each of its TensorCores) and ``run_benchmark_chips``."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from chip import Chip, get_chip_spec
from pod.config.bench import BenchmarkPlan
from pod.runtime.blas import one_blas_thread

__all__ = ["BenchmarkChipActor", "benchmark_inputs", "run_benchmark_chips"]


def benchmark_inputs(kind: str, n: int, seed: int, chip_id: int, core: int
                     ) -> tuple[np.ndarray, np.ndarray]:
    """The two N x N float32 inputs of one TensorCore (deterministic).

    matmul: x ~ N(0, 1), y ~ N(0, 1) / sqrt(N) (keeps x finite under x <- x . y).
    matrix_add: a, b ~ N(0, 1).
    """
    rng = np.random.default_rng([seed, chip_id, core])
    first = rng.standard_normal((n, n), dtype=np.float32)
    second = rng.standard_normal((n, n), dtype=np.float32)
    if kind == "matmul":
        second *= np.float32(1.0 / np.sqrt(n))
    return first, second


class BenchmarkChipActor:
    """One chip running a seed benchmark on each of its TensorCores (Ray actor body).

    Args:
        chip: Chip preset name.
        chip_id: This chip's rank.
        precision: MXU precision of its cores.
        limit_threads: Pin BLAS to one thread (several actors share few cores).
    """

    def __init__(self, chip: str, chip_id: int, precision: str = "bf16",
                 limit_threads: bool = True) -> None:
        if limit_threads:
            one_blas_thread()
        self.chip = Chip(get_chip_spec(chip), chip_id, precision=precision)
        self.chip_id = chip_id

    def run(self, kind: str, n: int, iterations: int, functional: bool, seed: int
            ) -> list[dict[str, Any]]:
        """Run the benchmark on every core.

        Returns:
            Per core: simulated ``seconds`` (the ops back to back), ``flops``,
            ``bound`` (of the last op), ``wall_seconds``, and with functional
            runs ``checksum`` (float64 sum of the final x or c) and ``finite``.
        """
        out = []
        for i, core in enumerate(self.chip.cores):
            t0 = time.perf_counter()
            result = None
            if functional:
                a, b = benchmark_inputs(kind, n, seed, self.chip_id, i)
                if kind == "matmul":
                    y = core.mxu_input(b)  # the same weights every iteration: round once
                    x = a
                    for it in range(iterations):
                        x = core.matmul(x, y, name=f"matmul{it}", b_rounded=True)
                    result = x
                else:
                    for it in range(iterations):
                        result = core.vector(f"add{it}", np.add, a, b)
            else:
                for it in range(iterations):
                    if kind == "matmul":
                        core.account_matmul(n, n, n, name=f"matmul{it}")
                    else:
                        core.account_vector(f"add{it}", n * n, 3 * 4 * n * n)
            records = core.take_records()
            entry = {
                "core": i,
                "seconds": float(sum(r.seconds for r in records)),
                "flops": float(sum(r.flops for r in records)),
                "bound": records[-1].bound if records else "",
                "wall_seconds": time.perf_counter() - t0,
            }
            if result is not None:
                entry["checksum"] = float(np.sum(result, dtype=np.float64))
                entry["finite"] = bool(np.isfinite(result).all())
            out.append(entry)
        return out


def run_benchmark_chips(plan: BenchmarkPlan, functional: bool) -> list[list[dict[str, Any]]]:
    """Run the benchmark on one actor per chip (a local Ray cluster if none is joined).

    Returns:
        Per chip, per core: ``BenchmarkChipActor.run``'s entries.

    Raises:
        ClusterError: Ray could not start.
    """
    import ray

    from pod.runtime.cluster import ensure_ray, shutdown_ray

    b = plan.benchmark
    owns = ensure_ray(plan.scenario.ray.address)
    try:
        remote = ray.remote(BenchmarkChipActor).options(num_cpus=0)
        # handles typed Any, as Pod.actors: Ray's stubs type an actor's methods as the plain
        # methods (no .remote)
        actors: list[Any] = [remote.remote(plan.topology.chip.name, r, b.precision)
                             for r in range(plan.topology.chips)]
        try:
            return ray.get([a.run.remote(b.kind, b.n, b.iterations, functional, b.seed)
                            for a in actors])
        finally:
            for a in actors:
                ray.kill(a)
    finally:
        if owns:
            shutdown_ray()

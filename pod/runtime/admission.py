"""Admission before work: does a functional pod fit this machine, before any actor starts?

A functional run starts one Ray actor process per chip (holding its devices:
two TensorCores on v2 / v3). Each costs memory whatever the model
(``ACTOR_BASE_BYTES``, measured) plus its share of the model (the plan's HBM
plan: parameters, gradients, optimizer state, activations, held as numpy
arrays), and asks Ray for a token CPU share (``ACTOR_CPUS``). A pod that
does not fit used to start actors until the machine ran out of memory (1,024
chips: the OOM killer); ``admit`` refuses it first, with one line saying how
many chips fit and that timing-only mode (``sweep.mode: timing``) costs any
pod size without actors.

A local cluster is checked against this machine's memory and CPUs before Ray
starts (``admit``); a run that joins a cluster (``ray.address``,
``RAY_ADDRESS``) is checked once joined, before any actor starts, against what
Ray says the cluster has free (``admit_joined``: its "memory" and "CPU"
resources over every node).

This module does not import ray.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pod.errors import ScenarioError

__all__ = ["ACTOR_BASE_BYTES", "RAY_RESERVE_BYTES", "ACTOR_CPUS",
           "Admission", "admission", "admit", "admit_joined", "available_memory_bytes"]

#: Memory one chip actor process costs beyond its model (bytes): its unique set
#: (USS: private pages; Python, numpy, Ray's core worker) measured on 32 v4 chip
#: actors of a small MLP after one step, Ray 2.60, Python 3.11, numpy 2.4: USS 58.9
#: MB, PSS 60.4 MB, RSS 112 MB (the rest shared libraries), and MemAvailable fell by
#: 59.2 MB per actor. Measured with ``python benchmarks/actor_memory.py 32``.
ACTOR_BASE_BYTES = 60 << 20
#: Ray's daemons (GCS, raylet, their agents; about 0.3 GB measured beside 32
#: actors) and the driver: kept free before any actor is counted.
RAY_RESERVE_BYTES = 1 << 30
#: The CPU share a chip actor asks Ray for (``pod.runtime.pod``): a token share, so that
#: a pod of many chips fits on a few cores (the emulation is not CPU-bound per actor);
#: placement groups need a non-zero resource per bundle. 0.001: 2,000 chips per
#: advertised CPU (0.01 refused a v5e-256 on a 2-core machine: 2.56 CPUs of bundles).
ACTOR_CPUS = 0.001


@dataclass(frozen=True)
class Admission:
    """What a functional pod needs of the machine and what the machine has.

    Attributes:
        actors: actor processes the pod starts (one per chip).
        actor_bytes: memory one actor needs: base + its model state.
        needed_bytes: actors x actor_bytes + ``RAY_RESERVE_BYTES``.
        available_bytes: memory available here (``available_memory_bytes``).
        cpus_needed: the CPU shares the actors ask for.
        cpus: CPUs a local cluster advertises (the machine's).
        actors_that_fit: how many actors this machine takes, by memory and CPUs.
    """

    actors: int
    actor_bytes: int
    needed_bytes: int
    available_bytes: int
    cpus_needed: float
    cpus: float
    actors_that_fit: int

    @property
    def fits(self) -> bool:
        return self.actors <= self.actors_that_fit


def _meminfo_bytes(key: str, text: str) -> int | None:
    match = re.search(rf"^{key}:\s+(\d+)\s*kB", text, re.M)
    return int(match.group(1)) * 1024 if match else None


def _cgroup_free_bytes() -> int | None:
    """Memory left under this process's cgroup v2 limit (None: no limit)."""
    try:
        line = Path("/proc/self/cgroup").read_text().splitlines()[0]
        group = Path("/sys/fs/cgroup") / line.split("::", 1)[1].lstrip("/")
        limit = (group / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((group / "memory.current").read_text()))
    except (OSError, IndexError, ValueError):
        return None


def available_memory_bytes() -> int | None:
    """Memory this machine can give new processes: ``MemAvailable`` (/proc/meminfo), or
    what is left under the cgroup's limit if that is less; None where neither is known."""
    try:
        available = _meminfo_bytes("MemAvailable", Path("/proc/meminfo").read_text())
    except OSError:
        available = None
    cgroup = _cgroup_free_bytes()
    known = [v for v in (available, cgroup) if v is not None]
    return min(known) if known else None


#: A functional benchmark core's peak working set, in n x n float32 arrays, by kind and
#: MXU precision: the two inputs, the rounded weights, x and the MXU's temporaries
#: (``BenchmarkChipActor.run``; tracemalloc peaks at n = 1,024 on v5p: matmul bf16 6.1,
#: int8 9.6, fp32 13.0 (three bf16 passes); matrix_add 4.0). The cores of an actor run
#: one after another: an actor holds one core's arrays at a time.
BENCH_WORKING_ARRAYS = {("matmul", "fp32"): 13, ("matmul", "int8"): 10, ("matmul", "bf16"): 7,
                        ("matrix_add", "bf16"): 4}


def _actors(plan: Any) -> tuple[int, int, float]:
    """(actor processes, model bytes per actor, CPU share per actor) of a plan: a
    ``TrainingPlan`` (its HBM plan per device, every device of a chip), or a
    ``BenchmarkPlan`` of a functional benchmark (``BENCH_WORKING_ARRAYS`` n x n
    float32 arrays)."""
    benchmark = getattr(getattr(plan, "scenario", None), "benchmark", None)
    if benchmark is not None:
        arrays = BENCH_WORKING_ARRAYS.get((benchmark.kind, benchmark.precision),
                                          BENCH_WORKING_ARRAYS[(benchmark.kind, "bf16")])
        return plan.topology.chips, arrays * 4 * benchmark.n ** 2, ACTOR_CPUS
    per_device = int(plan.memory.get("total", 0))
    return plan.topology.chips, per_device * plan.mesh.devices_per_chip, ACTOR_CPUS


def admission(plan: Any, *, available_bytes: int | None = None,
              cpus: float | None = None, reserve_bytes: int = RAY_RESERVE_BYTES
              ) -> Admission | None:
    """What a functional run of ``plan`` needs here and what this machine has.

    Args:
        plan: a checked ``TrainingPlan``.
        available_bytes: memory available (default: ``available_memory_bytes``).
        cpus: CPUs (default: ``os.cpu_count``).
        reserve_bytes: memory kept for Ray's daemons and the driver (0 for a
            joined cluster, whose daemons run already).

    Returns:
        The figures, or None where the machine's memory cannot be read.
    """
    available = available_memory_bytes() if available_bytes is None else available_bytes
    if available is None:
        return None
    cpus = cpus or os.cpu_count() or 1
    actors, model_bytes, share = _actors(plan)
    actor_bytes = ACTOR_BASE_BYTES + model_bytes
    by_memory = max(0, (available - reserve_bytes) // actor_bytes)
    by_cpus = int(math.floor(cpus / share + 1e-9))
    return Admission(actors=actors, actor_bytes=actor_bytes,
                     needed_bytes=actors * actor_bytes + reserve_bytes,
                     available_bytes=available, cpus_needed=actors * share, cpus=cpus,
                     actors_that_fit=int(min(by_memory, by_cpus)))


def admit(plan: Any, *, address: str | None = None, available_bytes: int | None = None,
          cpus: int | None = None) -> None:
    """Refuse a functional pod this machine cannot hold, before any actor starts.

    Args:
        plan: a checked ``TrainingPlan``, or the ``BenchmarkPlan`` of a functional
            benchmark.
        address: the cluster the run joins (default: the scenario's
            ``ray.address``, else ``RAY_ADDRESS``): a joined cluster is not checked.
        available_bytes, cpus: the machine's figures (default: measured here).

    Raises:
        ScenarioError: the actors need more memory or CPUs than this machine has;
            one line with how many chips would fit.
    """
    if address or plan.scenario.ray.address or os.environ.get("RAY_ADDRESS"):
        return
    found = admission(plan, available_bytes=available_bytes, cpus=cpus)
    if found is not None and not found.fits:
        raise ScenarioError(_refusal(plan, found, "pod:", "this machine has", "here"))


def admit_joined(plan: Any, address: str, available_resources: Mapping[str, float]) -> None:
    """Refuse a functional pod a joined cluster cannot hold, before any actor starts:
    ``admit``'s check against what the cluster has free (Ray's
    ``ray.available_resources()``: "memory" in bytes and "CPU", summed over its nodes).

    Raises:
        ClusterError: one line naming ``ray.address``, with how many chips would fit.
    """
    memory, cpus = available_resources.get("memory"), available_resources.get("CPU")
    if memory is None or cpus is None:
        return
    found = admission(plan, available_bytes=int(memory), cpus=float(cpus), reserve_bytes=0)
    if found is not None and not found.fits:
        from pod.errors import ClusterError

        raise ClusterError(_refusal(plan, found, f"ray.address: the cluster at {address!r}:",
                                    "the cluster has free", "there"))


def _refusal(plan: Any, found: Admission, field: str, has: str, where: str) -> str:
    """The one line of a pod that does not fit (``admit``, ``admit_joined``)."""
    per_chip = found.actors // plan.topology.chips if found.actors >= plan.topology.chips else 1
    chips = found.actors_that_fit // max(1, per_chip)
    gib = 2 ** 30
    reserve = found.needed_bytes - found.actors * found.actor_bytes
    ray = f" + {reserve / gib:.0f} GiB for Ray" if reserve else ""
    why = (f"{found.needed_bytes / gib:,.1f} GiB of memory ({found.actor_bytes / 2**20:,.0f} MiB "
           f"per actor process, measured{ray}) but {found.available_bytes / gib:,.1f} GiB is "
           "available" if found.needed_bytes > found.available_bytes else
           f"{found.cpus_needed:g} CPUs of Ray's but {has} {found.cpus:g}")
    benchmark = getattr(plan.scenario, "benchmark", None) is not None
    instead = ("benchmark.functional: false costs the benchmark at any size without "
               "computing it" if benchmark else "Timing-only mode (sweep.mode: timing, "
               "`tpu-pod sweep`) costs any pod size without actors")
    return (f"{field} {plan.topology.chips:,} functional chips "
            f"({found.actors:,} actor processes) need "
            f"{why}; at most {chips:,} chips fit {where}. {instead}")

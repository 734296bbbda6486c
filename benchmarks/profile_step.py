"""Where the wall time of one quick-start step goes (driver and chip actors).

Usage:
    .venv/bin/python benchmarks/profile_step.py [--steps 30]

Two views, wall clock and CPU time (never simulated time):

1. **The pod** (a real ``Pod`` on ``scenarios/quickstart.yaml``: 4 chip actors,
   2 TensorCores each, one call per chip per step): the step's wall time, the
   CPU of the chip actors and of the driver; the driver's own share (choosing
   the batch, submitting the calls, ``combine_device_reports``) is profiled
   with cProfile.
2. **One device in this process** (the very ``Device`` a chip actor holds,
   device 0, its collectives skipped: ``ShapeCollectives`` gives zeros of the
   right shape), cProfile over its ``step`` with a CPU-time clock (less
   sensitive to other jobs on the machine), BLAS on one thread as in a chip actor
   (``pod.runtime.blas``); time per category: MXU products
   (BLAS), bf16 rounding, op records (the cost model's bookkeeping: records,
   cycles, totals), and the rest of the layers' and the optimizer's numpy and
   Python. cProfile slows Python-heavy code more than BLAS, so the split is a
   guide; the plain times beside it are not profiled.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import time

import numpy as np
import ray
from _cpu import cpu_seconds  # (benchmarks/, the script's folder)

from pod.config.plan import batch_indices, build_plan
from pod.config.scenario import load_scenario
from pod.config.sharding import device_groups
from pod.programs import ShapeCollectives
from pod.runtime.base import plan_program
from pod.runtime.blas import one_blas_thread
from pod.runtime.cluster import ensure_ray, shutdown_ray
from pod.runtime.device import Device
from pod.runtime.pod import Pod

QUICKSTART = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scenarios",
                          "quickstart.yaml")

# category -> (file suffix, function name) whose CUMULATIVE time counts (first match wins)
_CUMULATIVE = {
    "bf16 rounding": [("chip/numerics.py", "to_bf16")],
    "op records": [("chip/core.py", "_record"), ("chip/vector.py", "vpu_cycles"),
                   ("chip/core.py", "mxu_cycles"), ("pod/report/stats.py", "of"),
                   ("chip/core.py", "_vpu_record"),
                   ("chip/core.py", "_cached_record")],
}
# category -> functions whose OWN time counts
_OWN = {"MXU products (BLAS)": [("chip/numerics.py", "mxu_matmul")]}


def _split(stats: pstats.Stats, total: float) -> dict[str, float]:
    """Seconds per category from a profile (categories do not nest here)."""
    out = {}
    for label, table, index in (*((k, v, 3) for k, v in _CUMULATIVE.items()),
                                *((k, v, 2) for k, v in _OWN.items())):
        out[label] = sum(row[index] for (path, _, name), row in stats.stats.items()
                         if any(path.endswith(f) and name == n for f, n in table))
    out["everything else (layers' numpy and Python)"] = total - sum(out.values())
    return out


def profile_chip(plan, steps: int) -> None:
    training = plan.scenario.training
    groups = device_groups(plan.mesh, 0)
    device = Device(plan.topology.chip, 0, groups, plan_program(plan), training.seed,
                    devices_per_chip=plan.mesh.devices_per_chip, precision=training.precision,
                    mxu_model=plan.scenario.pod.mxu_model,
                    activation_bytes=int(plan.memory.get("activations", 0)))
    data, seed, per_device = plan.dataset, training.seed, plan.per_device_batch
    axes = ("data", "fsdp", "tensor")

    def comm():
        return ShapeCollectives({a: groups.axis_size(a) for a in axes},
                                {a: groups.ring_index(a) for a in axes})

    def shard(step):
        idx = batch_indices(data.x_train.shape[0], plan.global_batch, step, seed)
        return data.x_train[idx][:per_device], data.y_train[idx][:per_device]

    step_s = []
    for step in range(steps + 2):
        x, y = shard(step)
        t0 = time.process_time()
        device.step(comm(), x, y, step, seed)
        if step >= 2:
            step_s.append(time.process_time() - t0)
    print(f"\none device in-process ({per_device} examples, collectives skipped), CPU ms, "
          f"median of {steps}: step {statistics.median(step_s) * 1e3:.2f}")
    prof = cProfile.Profile(time.process_time)  # CPU time: less sensitive to other jobs
    for step in range(steps):
        x, y = shard(step)
        c = comm()
        prof.enable()
        device.step(c, x, y, step, seed)
        prof.disable()
    stats = pstats.Stats(prof)
    total = stats.total_tt
    print(f"  step under cProfile: {total / steps * 1e3:.2f} CPU ms per step")
    for label, seconds in _split(stats, total).items():
        print(f"    {label:45s} {seconds / steps * 1e3:7.2f} ms  {seconds / total:6.1%}")


def profile_pod(plan, steps: int) -> None:
    pod = Pod(plan)
    pod.start()
    try:
        for step in range(3):
            pod.step(step)
        pids = ray.get([a.__ray_call__.remote(lambda self: os.getpid()) for a in pod.actors])
        cpu0, driver0, t_all = cpu_seconds(pids), time.process_time(), time.perf_counter()
        for step in range(3, steps + 3):
            pod.step(step)
        t_all = time.perf_counter() - t_all
        cpu = (cpu_seconds(pids) - cpu0) / steps
        driver_cpu = (time.process_time() - driver0) / steps
        print(f"pod step without a profiler: {t_all / steps * 1e3:.2f} ms wall (mean); CPU per "
              f"step: chip actors {cpu * 1e3:.1f} ms (summed over {len(pids)}), driver "
              f"{driver_cpu * 1e3:.1f} ms")
        whole = []
        prof = cProfile.Profile()
        for step in range(steps + 3, 2 * steps + 3):
            t0 = time.perf_counter()
            prof.enable()
            pod.step(step)
            prof.disable()
            whole.append(time.perf_counter() - t0)
        driver = pstats.Stats(prof)
    finally:
        pod.shutdown()
    print(f"pod step under cProfile (Pod.step), wall ms, median of {steps}: "
          f"{statistics.median(whole) * 1e3:.2f}")
    total = driver.total_tt
    own = {"ray calls (submit, get)": 0.0, "combine_device_reports (stats)": 0.0, "batch": 0.0}
    for (path, _, name), row in driver.stats.items():
        if "/ray/" in path and name in ("remote", "_remote", "get"):
            own["ray calls (submit, get)"] = max(own["ray calls (submit, get)"], row[3])
        elif name == "combine_device_reports":
            own["combine_device_reports (stats)"] += row[3]
        elif name == "batch_indices":
            own["batch"] += row[3]
    print(f"  driver under cProfile: {total / steps * 1e3:.2f} ms of CPU-profiled time per step "
          "(includes waiting in ray.get)")
    for label, seconds in own.items():
        print(f"    {label:45s} {seconds / steps * 1e3:7.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    plan = build_plan(load_scenario(QUICKSTART))
    print(f"load average at the start: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    started = ensure_ray(None)
    try:
        profile_pod(plan, args.steps)
    finally:
        if started:
            shutdown_ray()
    np.seterr(all="ignore")
    with one_blas_thread():  # as in a chip actor: BLAS's own threads would be profiled too
        profile_chip(plan, args.steps)
    print(f"load average at the end: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()

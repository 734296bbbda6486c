"""The data axis's allreduce through one device (star) against the two-phase direct one.

Usage:
    .venv/bin/python benchmarks/star_allreduce.py [--repeats 10] [--kib 172,1024,4096,16384]

``GroupTransport.allreduce`` (``pod.runtime.mesh_collectives``) sends buffers of at
most ``pod.runtime.direct.STAR_MAX_BYTES`` through the group's first device and
larger ones in two phases straight to each chunk's owner; both add in the ring's
order. This runs both, alternated, on the quick start's pod (v2-8: 8 devices in 4
chip actors, the ``data`` axis of 8) at each size: one call per chip actor, its
two devices allreducing a buffer of their device id + 1 (the sum, 36, is checked
on every device). Prints the median wall time from the driver (the Ray calls
included, the same for both) and the chip actors' mean CPU time per allreduce
(``/proc/<pid>/stat``), after 2 warm-up rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import ray
from _cpu import cpu_seconds  # (benchmarks/, the script's folder)

from pod.config.plan import build_plan
from pod.config.scenario import load_scenario
from pod.runtime.cluster import ensure_ray, shutdown_ray
from pod.runtime.pod import Pod

QUICKSTART = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scenarios",
                          "quickstart.yaml")
_WARM_UP = 2


def _allreduce(elements: int, star: bool, run_base: int):
    """A function for ``ChipActor.__ray_call__``: every device of the chip allreduces
    (its id + 1) over ``data``, through one device or in two phases."""

    def run(chip):
        import numpy as np

        import pod.runtime.mesh_collectives as mesh_collectives
        from pod.runtime.mesh_collectives import GroupTransport

        mesh_collectives.STAR_MAX_BYTES = 1 << 62 if star else 0

        def device(d):
            transport = GroupTransport(chip._port(d.device), d.groups, chip.addresses, run_base)
            return float(transport.allreduce(np.full(elements, d.device + 1, np.float32),
                                             "data")[-1])

        return chip._each(device)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10, help="timed rounds of each")
    parser.add_argument("--kib", default="172,1024,4096,16384", help="buffer sizes, KiB")
    args = parser.parse_args()
    plan = build_plan(load_scenario(QUICKSTART))
    print(f"load average at the start: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    started = ensure_ray(None)
    pod = Pod(plan)
    try:
        pod.start()
        pod.step(0)  # opens every link
        pids = ray.get([a.__ray_call__.remote(lambda self: os.getpid()) for a in pod.actors])
        want = sum(range(1, plan.mesh.size + 1))
        run_base = 1 << 50  # above the step's run ids
        for kib in (int(k) for k in args.kib.split(",")):
            wall: dict[bool, list[float]] = {True: [], False: []}
            cpu: dict[bool, list[float]] = {True: [], False: []}
            for rep in range(_WARM_UP + args.repeats):
                for star in (True, False):
                    run_base += 1 << 20
                    c0, t0 = cpu_seconds(pids), time.perf_counter()
                    out = ray.get([a.__ray_call__.remote(_allreduce(kib * 256, star, run_base))
                                   for a in pod.actors])
                    t1, c1 = time.perf_counter(), cpu_seconds(pids)
                    if any(v != want for chip in out for v in chip):
                        raise RuntimeError(f"wrong sum: {out}, want {want}")
                    if rep >= _WARM_UP:
                        wall[star].append(t1 - t0)
                        cpu[star].append(c1 - c0)
            print(f"{kib:6d} KiB: star {statistics.median(wall[True]) * 1e3:6.1f} ms wall, "
                  f"{statistics.mean(cpu[True]) * 1e3:6.1f} ms CPU | two-phase direct "
                  f"{statistics.median(wall[False]) * 1e3:6.1f} ms wall, "
                  f"{statistics.mean(cpu[False]) * 1e3:6.1f} ms CPU", flush=True)
    finally:
        pod.shutdown()
        if started:
            shutdown_ray()
    print(f"load average at the end: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()

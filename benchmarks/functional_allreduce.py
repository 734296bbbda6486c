"""Wall time of a functional allreduce over 8 chip actors vs a driver gather-sum-broadcast.

Usage: .venv/bin/python benchmarks/functional_allreduce.py [--repeats 5]
    [--algorithms ring,torus]

All variants run over the same 8 chip actors (``BufferActor``: a buffer and its
ICI port) in one run, alternated, and
the medians are printed (wall time). The emulator's allreduce moves chunks
chip to chip as the schedule says: one call per chip runs its whole part of
the schedule and sends its chunks to the receivers over chip-to-chip links
(pod/runtime/ici.py). The baseline ray.get()s every buffer to the driver, sums with numpy,
puts the sum once and sets it on every actor. Every result is checked equal
to the numpy sum.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import numpy as np  # noqa: E402
import ray  # noqa: E402

from interconnect import Torus, build_collective  # noqa: E402
from pod.runtime.cluster import ensure_ray, shutdown_ray  # noqa: E402
from pod.runtime.collective import BufferActor, run_schedule  # noqa: E402

SIZES = {"64 KiB": 64 << 10, "16 MiB": 16 << 20, "64 MiB": 64 << 20}


def baseline(actors):
    buffers = ray.get([a.get_buffer.remote() for a in actors])
    total = np.sum(np.stack(buffers), axis=0, dtype=np.float32)
    ref = ray.put(total)
    ray.get([a.set_buffer.remote(ref) for a in actors])


def emulated(actors, schedule):
    ray.get(run_schedule(actors, schedule))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--algorithms", default="ring,torus")
    parser.add_argument("--topology", default="2x4")
    args = parser.parse_args()
    started = ensure_ray(None)
    torus = Torus(tuple(int(a) for a in args.topology.split("x")), True)
    remote = ray.remote(BufferActor).options(num_cpus=0)
    actors = [remote.remote(r) for r in range(torus.num_chips)]
    rng = np.random.default_rng(0)
    print(f"{torus.num_chips} chip actors, topology {torus.name}, medians of {args.repeats} (wall); "
          f"loadavg {open('/proc/loadavg').read().strip()}")
    print(f"{'size':>8} {'variant':>24} {'median ms':>10} {'min ms':>8} {'vs baseline':>12}")
    try:
        for label, nbytes in SIZES.items():
            count = nbytes // 4
            buffers = [rng.integers(-8, 8, count).astype(np.float32) for _ in actors]
            total = np.sum(np.stack(buffers), axis=0)
            names = [a for a in args.algorithms.split(",") if a]
            schedules = {a: build_collective("allreduce", torus, count, 4, a) for a in names}
            times = {name: [] for name in ["baseline", *schedules]}
            for _ in range(args.repeats):
                for name in times:
                    if name != "baseline":
                        ray.get([a.set_chunk_bounds.remote(schedules[name].chunk_bounds)
                                 for a in actors])
                    ray.get([a.set_buffer.remote(b) for a, b in zip(actors, buffers)])
                    t0 = time.perf_counter()
                    if name == "baseline":
                        baseline(actors)
                    else:
                        emulated(actors, schedules[name])
                    times[name].append(time.perf_counter() - t0)
                    got = ray.get(actors[-1].get_buffer.remote())
                    assert np.array_equal(got, total), name
            base = statistics.median(times["baseline"])
            for name, values in times.items():
                med = statistics.median(values)
                print(f"{label:>8} {name:>24} {med * 1e3:10.1f} {min(values) * 1e3:8.1f} "
                      f"{med / base:11.2f}x", flush=True)
        print(f"loadavg {open('/proc/loadavg').read().strip()}")
    finally:
        for a in actors:
            ray.kill(a)
        if started:
            shutdown_ray()


if __name__ == "__main__":
    main()

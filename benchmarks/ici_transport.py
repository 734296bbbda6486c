"""The functional allreduce's chip-to-chip transport: shared memory against TCP, side by side.

Usage:

    .venv/bin/python benchmarks/ici_transport.py [--repeats 15] [--algorithms ring,torus]

8 chip actors (``BufferActor``, v5e-style 2x4 torus, as ``benchmarks/vs_peers.py``)
run the allreduce of the quick start's CNN gradients (44,138 float32, 177 kB) and
of 16 MiB, each schedule once with chunks through shared memory between the
actors (``pod.runtime.ici_shm``, the default) and once with every payload over
loopback TCP (``IciPort(shared_memory=False)``, the transport before it), the
variants alternated within each repeat. Each allreduce is timed from the driver
around one call per actor (wall), and the CPU seconds of the 8 actor processes
over it are summed (``/proc/<pid>/stat`` utime + stime, 10 ms ticks). Every
result is checked bit-identical to ``interconnect.execute``. Prints medians and
the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import numpy as np  # noqa: E402
import ray  # noqa: E402

from interconnect import Torus, build_collective, execute  # noqa: E402
from pod.runtime.cluster import ensure_ray, shutdown_ray  # noqa: E402
from pod.runtime.collective import BufferActor, run_schedule, split_chunks  # noqa: E402

TORUS = Torus((2, 4), True)
SIZES = {"177 kB (the CNN's gradients)": 44_138 * 4, "16 MiB": 16 << 20}
_TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    """utime + stime of these processes, seconds."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total * _TICK_S


def measure(chips, pids, nbytes: int, algorithms: list[str], repeats: int) -> dict:
    """Median wall ms and actor CPU ms of each (algorithm, transport), alternated."""
    count = nbytes // 4
    rng = np.random.default_rng(count)
    buffers = [rng.standard_normal(count).astype(np.float32) for _ in chips]
    addresses = ray.get([a.ici_address.remote(b"") for a in chips])
    built = {a: split_chunks(build_collective("allreduce", TORUS, count, 4, a)) for a in algorithms}
    want = {a: execute(s, buffers)[-1] for a, s in built.items()}
    wall: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], list[float]] = {}
    for _ in range(repeats):
        for algorithm, schedule in built.items():
            for transport in ("shm", "tcp"):
                ray.get([a.set_shared_memory.remote(transport == "shm") for a in chips])
                ray.get([a.set_chunk_bounds.remote(schedule.chunk_bounds) for a in chips])
                ray.get([a.set_buffer.remote(b) for a, b in zip(chips, buffers, strict=True)])
                c0, t0 = cpu_seconds(pids), time.perf_counter()
                ray.get(run_schedule(chips, schedule, addresses=addresses))
                t1, c1 = time.perf_counter(), cpu_seconds(pids)
                wall.setdefault((algorithm, transport), []).append(t1 - t0)
                cpu.setdefault((algorithm, transport), []).append(c1 - c0)
                got = ray.get(chips[-1].get_buffer.remote())
                if got.tobytes() != want[algorithm].tobytes():
                    raise AssertionError(f"{algorithm} over {transport}: not execute's bits")
    return {k: (statistics.median(wall[k]) * 1e3, statistics.median(cpu[k]) * 1e3) for k in wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--algorithms", default="ring,torus")
    args = parser.parse_args()
    algorithms = [a for a in args.algorithms.split(",") if a]
    started = ensure_ray(None)
    try:
        remote = ray.remote(BufferActor).options(num_cpus=0)
        chips = [remote.remote(r) for r in range(TORUS.num_chips)]
        pids = ray.get([a.__ray_call__.remote(lambda self: os.getpid()) for a in chips])
        print(f"{len(chips)} chip actors, {TORUS.name} torus; medians of {args.repeats}; "
              f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())} "
              f"({os.cpu_count()} cores)")
        print(f"{'size':>30} {'algorithm':>9} {'tcp wall':>9} {'shm wall':>9} {'ratio':>6} "
              f"{'tcp cpu':>8} {'shm cpu':>8} {'ratio':>6}  (ms; cpu: 8 actors summed)")
        for label, nbytes in SIZES.items():
            res = measure(chips, pids, nbytes, algorithms, args.repeats)
            for a in algorithms:
                (tw, tc), (sw, sc) = res[(a, "tcp")], res[(a, "shm")]
                print(f"{label:>30} {a:>9} {tw:9.1f} {sw:9.1f} {sw / tw:6.2f} "
                      f"{tc:8.0f} {sc:8.0f} {sc / tc if tc else float('nan'):6.2f}", flush=True)
        print(f"load average at the end: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    finally:
        if started:
            shutdown_ray()


if __name__ == "__main__":
    main()

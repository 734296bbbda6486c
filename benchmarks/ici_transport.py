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
result is checked bit-identical to ``interconnect.execute``.

Then the quick start's step (``scenarios/quickstart.yaml``: a ``Pod`` of 4 chip
actors, its gradient allreduce of 177 kB over a ring of 4: 44 kB chunks) with
the chip actors' ports switched between the two transports step by step
(``--steps`` of each, after 3 warm-up steps); each step's loss and the final
parameters are the same bits either way (checked against a second pod run on
TCP only). Prints medians and the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import numpy as np  # noqa: E402
import ray  # noqa: E402
from _cpu import cpu_seconds  # noqa: E402  (benchmarks/, the script's folder)

from interconnect import Torus, build_collective, execute  # noqa: E402
from pod.config.plan import build_plan  # noqa: E402
from pod.config.scenario import load_scenario  # noqa: E402
from pod.runtime.cluster import ensure_ray, shutdown_ray  # noqa: E402
from pod.runtime.collective import BufferActor, run_schedule, split_chunks  # noqa: E402
from pod.runtime.pod import Pod  # noqa: E402

TORUS = Torus((2, 4), True)
QUICKSTART = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scenarios",
                          "quickstart.yaml")
SIZES = {"177 kB (the CNN's gradients)": 44_138 * 4, "16 MiB": 16 << 20}


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


def _set_ports(chip, enabled: bool) -> None:
    """Runs inside a chip actor (``__ray_call__``): every port's transport."""
    for port in chip._ports.values():
        port.shared_memory = enabled


def measure_step(steps: int) -> dict[str, float]:
    """Median wall ms of a quick-start step per transport, alternated step by step;
    the losses and final parameters checked against a pod on TCP only."""
    plan = build_plan(load_scenario(QUICKSTART))
    total = 3 + 2 * steps
    wall: dict[str, list[float]] = {"shm": [], "tcp": []}
    runs = {}
    for mixed in (True, False):
        with Pod(plan) as pod:
            losses = []
            for step in range(total):
                transport = "shm" if mixed and step % 2 else "tcp"
                ray.get([a.__ray_call__.remote(_set_ports, transport == "shm")
                         for a in pod.actors])
                t0 = time.perf_counter()
                losses.append(pod.step(step).loss)
                if mixed and step >= 3:
                    wall[transport].append(time.perf_counter() - t0)
            runs[mixed] = (losses, [s.params for s in pod.shards()])
    (got_losses, got), (want_losses, want) = runs[True], runs[False]
    if got_losses != want_losses or any(a[k].tobytes() != b[k].tobytes()
                                        for a, b in zip(got, want, strict=True) for k in a):
        raise AssertionError("the step over shared memory is not the step over TCP, bit for bit")
    return {k: statistics.median(v) * 1e3 for k, v in wall.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--algorithms", default="ring,torus")
    parser.add_argument("--steps", type=int, default=15, help="quick-start steps per transport")
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
        step = measure_step(args.steps)
        print(f"quick-start step (wall, median of {args.steps} each): tcp {step['tcp']:.1f} ms, "
              f"shm {step['shm']:.1f} ms, ratio {step['shm'] / step['tcp']:.2f}; "
              "losses and parameters bit-identical")
        print(f"load average at the end: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    finally:
        if started:
            shutdown_ray()


if __name__ == "__main__":
    main()

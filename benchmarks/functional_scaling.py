"""Functional emulation on one machine: actor start-up, wall time per step and
memory per chip actor as the pod grows (a small MLP, 8 examples per TensorCore).

Every chip is a Ray actor that really computes; this measures how the host
copes. The data are synthetic and labelled (``data: synthetic``, as many
examples as four global batches), so any pod size runs; ``--data digits``
uses the 1,437 training digits (at most 1,437 examples per step). Run:

    .venv/bin/python benchmarks/functional_scaling.py [--chip v4] [--chips 8,16,32,64] [--steps 5]
    .venv/bin/python benchmarks/functional_scaling.py --chip v5e --chips 256   # a v5e-256, 16x16

Memory is read from ``/proc/<pid>/smaps_rollup`` of every chip actor after the
last step (the actors run on this machine's node): RSS (resident, shared
libraries counted in every process), PSS (shared pages split between their
users; the sum over actors is what they cost together) and USS (private
pages: what the machine gets back when that actor ends). Wall clock
throughout, except "simulated ms per step".
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from pod.config.plan import build_plan
from pod.config.scenario import parse_scenario
from pod.runtime.cluster import ensure_ray
from pod.runtime.pod import Pod


def scenario(chip: str, chips: int, data: str, per_core_batch: int, steps: int,
             tensorcores_per_chip: int) -> dict:
    global_batch = per_core_batch * tensorcores_per_chip * chips
    dataset = {"name": "digits"} if data == "digits" else {
        "name": "synthetic", "options": {"num_examples": max(2048, 4 * global_batch)}}
    return {
        "name": "functional-bench",
        "pod": {"chip": chip, "chips": chips},
        "model": {"name": "mlp", "options": {"hidden": [64]}},
        "data": dataset,
        "training": {"global_batch": global_batch, "steps": steps},
        "metrics": {"port": 0},
    }


def memory_mib(pid: int) -> dict[str, float]:
    """RSS, PSS and USS (private clean + dirty) of one process, MiB."""
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and parts[1].isdigit():
                fields[parts[0].rstrip(":")] = int(parts[1]) / 1024
    return {"rss": fields.get("Rss", 0.0), "pss": fields.get("Pss", 0.0),
            "uss": fields.get("Private_Clean", 0.0) + fields.get("Private_Dirty", 0.0)}


def actor_memory(pod: Pod) -> list[dict[str, float]]:
    import ray

    pids = ray.get([a.__ray_call__.remote(lambda self: os.getpid()) for a in pod.actors])
    return [memory_mib(pid) for pid in pids]


def available_gib() -> float:
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) for line in f}
    return info["MemAvailable"] / (1 << 20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chip", default="v4")
    parser.add_argument("--chips", default="8,16,32,64")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--data", choices=("synthetic", "digits"), default="synthetic")
    parser.add_argument("--per-core-batch", type=int, default=8)
    parser.add_argument("--mib-per-actor", type=float, default=80.0,
                        help="skip a size unless MemAvailable holds this per chip actor plus "
                             "--spare-gib (other jobs share the machine)")
    parser.add_argument("--spare-gib", type=float, default=3.0)
    args = parser.parse_args()
    ensure_ray(None)
    print(f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}; "
          f"{available_gib():.1f} GiB available; {args.chip}, MLP 64-64-10, {args.data} data")
    print("| chips | TensorCores | actor start-up (wall s) | wall s per step (median) | "
          "simulated ms per step | RSS per actor (MiB, median) | PSS per actor | "
          "USS per actor | PSS of all actors (GiB) | replicas identical |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for chips in (int(c) for c in args.chips.split(",")):
        from chip import get_chip_spec

        cores = get_chip_spec(args.chip).tensorcores
        need_gib = chips * args.mib_per_actor / 1024 + args.spare_gib
        if available_gib() < need_gib:
            print(f"| {chips} | skipped: needs {need_gib:.1f} GiB available, "
                  f"{available_gib():.1f} GiB are |", flush=True)
            continue
        plan = build_plan(parse_scenario(scenario(args.chip, chips, args.data,
                                                  args.per_core_batch, args.steps, cores)))
        pod = Pod(plan)
        try:
            startup = pod.start()
            walls, sims = [], []
            for step in range(args.steps):
                t0 = time.perf_counter()
                stats = pod.step(step)
                walls.append(time.perf_counter() - t0)
                sims.append(stats.step_seconds)
            memory = actor_memory(pod)
            identical = pod.replicas_identical()
        finally:
            pod.shutdown()

        def med(key: str) -> float:
            return statistics.median(m[key] for m in memory)

        print(f"| {chips} | {plan.topology.tensorcores} | {startup:.1f} | "
              f"{statistics.median(walls[1:] or walls):.3f} | {statistics.median(sims) * 1e3:.4f} | "
              f"{med('rss'):.0f} | {med('pss'):.0f} | {med('uss'):.0f} | "
              f"{sum(m['pss'] for m in memory) / 1024:.1f} | {'yes' if identical else 'NO'} |",
              flush=True)
    print(f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()

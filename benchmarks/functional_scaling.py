"""Functional emulation on one machine: actor start-up and wall time per step
at 8, 16, 32 and 64 chips (v4, a small MLP on digits, 8 examples per core).

Every chip is a Ray actor that really computes; this measures how the host
copes as the pod grows. Run:
    .venv/bin/python benchmarks/functional_scaling.py [--chips 8,16,32,64] [--steps 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

from pod.runtime.cluster import ensure_ray
from pod.runtime.coordinator import Pod
from pod.config.plan import build_plan
from pod.config.scenario import parse_scenario


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chips", default="8,16,32,64")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    ensure_ray(None)
    print("| chips | TensorCores | actor start-up (wall s) | wall s per step (median) | "
          "simulated ms per step | replicas identical |")
    print("|---:|---:|---:|---:|---:|---|")
    for chips in (int(c) for c in args.chips.split(",")):
        plan = build_plan(parse_scenario({
            "name": "functional-bench",
            "pod": {"chip": "v4", "chips": chips},
            "model": {"name": "mlp", "options": {"hidden": [64]}},
            "data": {"name": "digits"},
            "training": {"global_batch": 8 * 2 * chips, "steps": args.steps},
            "metrics": {"port": 0},
        }))
        pod = Pod(plan)
        try:
            startup = pod.start()
            walls, sims = [], []
            for step in range(args.steps):
                t0 = time.perf_counter()
                stats = pod.step(step)
                walls.append(time.perf_counter() - t0)
                sims.append(stats.step_seconds)
            identical = pod.replicas_identical()
        finally:
            pod.shutdown()
        print(f"| {chips} | {plan.pod.tensorcores} | {startup:.1f} | "
              f"{statistics.median(walls[1:] or walls):.3f} | {statistics.median(sims) * 1e3:.4f} | "
              f"{'yes' if identical else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()

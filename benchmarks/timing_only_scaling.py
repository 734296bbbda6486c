"""Wall time of one timing-only step against pod size, 4 to 8,960 chips (v5p).

Timing-only mode (pod.runtime.timing.TimingPod) costs one representative chip and the
ICI allreduce of the whole pod, without actors. This measures, per pod size,
the wall seconds of (a) building the pod (plan, algorithm choice and ICI cost)
and (b) one accounted step, for the torus allreduce on v5p slices up to the
full 16x20x28 pod. Goal (issue 5): the 8,960-chip step in under 1 s of wall
time, and wall time growing no faster than linearly in chips.

Run: .venv/bin/python benchmarks/timing_only_scaling.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from pod.config.plan import build_plan
from pod.config.scenario import parse_scenario
from pod.runtime.timing import TimingPod

SHAPES = ["2x2x1", "2x2x2", "4x4x4", "8x8x8", "8x16x16", "16x16x16", "16x20x28"]


def scenario(shape: str, algorithm: str):
    chips = 1
    for axis in shape.split("x"):
        chips *= int(axis)
    return parse_scenario({
        "name": "timing-bench",
        "pod": {"chip": "v5p", "topology": shape, "allreduce": algorithm},
        "model": {"name": "mlp", "options": {"hidden": [1024, 1024]}},
        "data": {"name": "digits"},
        "training": {"global_batch": 32 * 2 * chips, "steps": 1},
        "metrics": {"port": 0},
    })


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--algorithm", default="torus")
    args = parser.parse_args()
    print("| chips | shape | build pod (wall s) | one step (wall s) | total (wall s) | "
          "wall us per chip | simulated step ms |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for shape in SHAPES:
        builds, steps = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            plan = build_plan(scenario(shape, args.algorithm), timing_only=True)
            pod = TimingPod(plan)
            t1 = time.perf_counter()
            stats = pod.step(0)
            t2 = time.perf_counter()
            builds.append(t1 - t0)
            steps.append(t2 - t1)
        build, step = statistics.median(builds), statistics.median(steps)
        chips = plan.topology.chips
        print(f"| {chips:,} | {shape} | {build:.3f} | {step:.3f} | {build + step:.3f} | "
              f"{(build + step) / chips * 1e6:,.1f} | {stats.step_seconds * 1e3:.4f} |", flush=True)


if __name__ == "__main__":
    main()

"""Wall time and memory of timing-only sharded steps at pod scale (issue 14, item 1).

Each point is a full-size scenario (scenarios/llama-33b-v5p-128.yaml,
llama2-7b-v5e-256.yaml, gpt3-175b-v5p-17920.yaml) on a slice and mesh, costed
by ``pod.runtime.timing.TimingPod`` in a fresh Python process
(so its peak RSS is its own). Printed per point, wall clock: building the
plan, the first step (it also costs each distinct collective over every group
of its mesh axis, cached after), the median of the next steps, and the peak
RSS; the CPU seconds of a step (process time: what the wall time would be
on an idle core); simulated: the step, MFU and tokens/s.

Run: python benchmarks/sharded_timing.py            (every point)
     python benchmarks/sharded_timing.py --point gpt3-175b-8960
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: name -> (scenario file, overrides): tens of billions on 64 to 1,024 v5p chips,
#: billions on 256 v5e / v6e, hundreds of billions up to the 8,960-chip v5p pod.
POINTS = {
    "llama-33b-64": ("llama-33b-v5p-128.yaml", {}),
    "llama-33b-256": ("llama-33b-v5p-128.yaml", {"pod__slice": "v5p-512",
                                                "pod__mesh": {"fsdp": 64, "tensor": 4},
                                                "training__global_batch": 256}),
    "llama-33b-1024": ("llama-33b-v5p-128.yaml", {"pod__slice": "v5p-2048",
                                                 "pod__mesh": {"fsdp": 256, "tensor": 4},
                                                 "training__global_batch": 1024}),
    "llama2-7b-v5e-256": ("llama2-7b-v5e-256.yaml", {}),
    "llama2-7b-v6e-256": ("llama2-7b-v5e-256.yaml", {"pod__slice": "v6e-256"}),
    "gpt3-175b-1024": ("gpt3-175b-v5p-17920.yaml", {"pod__slice": "v5p-2048",
                                                   "pod__mesh": {"fsdp": 128, "tensor": 8},
                                                   "training__global_batch": 256}),
    "gpt3-175b-8960": ("gpt3-175b-v5p-17920.yaml", {}),
}


def run_point(name: str, steps: int) -> dict:
    """Cost ``steps`` steps of one point in this process; its figures."""
    import resource

    from pod.config.plan import build_plan
    from pod.config.scenario import load_scenario
    from pod.runtime.timing import TimingPod

    path, overrides = POINTS[name]
    t0 = time.perf_counter()
    scenario = load_scenario(ROOT / "scenarios" / path)
    if overrides:
        scenario = scenario.with_overrides(**overrides)
    plan = build_plan(scenario, timing_only=True, sharded_ok=True)
    plan_wall = time.perf_counter() - t0
    pod = TimingPod(plan)
    walls, cpus, stats = [], [], None
    for step in range(steps):
        t, c = time.perf_counter(), time.process_time()
        stats = pod.step(step)
        walls.append(time.perf_counter() - t)
        cpus.append(time.process_time() - c)
    tokens = plan.global_batch * plan.model.config.sequence_length
    return {"point": name, "chips": plan.topology.chips, "slice": plan.topology.slice_name,
            "mesh": plan.mesh.sizes, "params_billion": plan.num_params / 1e9,
            "plan_wall_s": plan_wall, "first_step_wall_s": walls[0],
            "step_wall_s": statistics.median(walls[1:] or walls),
            "first_step_cpu_s": cpus[0], "step_cpu_s": statistics.median(cpus[1:] or cpus),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "records": len(pod.last_report.record_seconds), "collectives": len(pod.last_report.calls),
            "sim_step_s": stats.step_seconds, "mfu": stats.mfu,
            "sim_tokens_per_s": tokens / stats.step_seconds,
            "hbm_per_device_gib": plan.memory["total"] / 2**30}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--point", choices=sorted(POINTS), action="append",
                        help="a point (repeatable; default: all)")
    parser.add_argument("--steps", type=int, default=4, help="steps per point (default 4)")
    parser.add_argument("--inline", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    names = args.point or list(POINTS)
    if args.inline:
        for name in names:
            print(json.dumps(run_point(name, args.steps)), flush=True)
        return
    print(f"{'point':<20} {'chips':>5} {'params':>7} {'plan s':>7} {'1st step s':>10} "
          f"{'step s':>7} {'1st cpu':>7} {'cpu s':>6} {'RSS MiB':>8} {'ops':>6} {'sim step s':>10} {'MFU':>6} "
          f"{'tokens/s':>11} {'HBM GiB':>8}   (wall unless 'sim')")
    for name in names:  # a fresh process per point: its own peak RSS
        out = subprocess.run([sys.executable, __file__, "--inline", "--point", name,
                              "--steps", str(args.steps)], capture_output=True, text=True,
                             check=True, cwd=ROOT)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{r['point']:<20} {r['chips']:>5} {r['params_billion']:>6.1f}B "
              f"{r['plan_wall_s']:>7.2f} {r['first_step_wall_s']:>10.2f} {r['step_wall_s']:>7.2f} "
              f"{r['first_step_cpu_s']:>7.2f} {r['step_cpu_s']:>6.2f} "
              f"{r['peak_rss_mib']:>8.0f} {r['records']:>6} {r['sim_step_s']:>10.3f} "
              f"{r['mfu']:>6.1%} {r['sim_tokens_per_s']:>11,.0f} {r['hbm_per_device_gib']:>8.1f}",
              flush=True)


if __name__ == "__main__":
    main()

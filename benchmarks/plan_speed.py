"""How fast ``tpu-pod plan`` answers, before and after, measured side by side in one run.

Usage:

    .venv/bin/python benchmarks/plan_speed.py [--baseline REF] [--repeats N]
        [--variants baseline,exhaustive,one,pool] [-- PLAN ARGUMENTS...]

Default question: ``tpu-pod plan llama2-7b --slice v5e-256`` (the README's, the
default search: every mesh over data, stage, fsdp and tensor, six remat policies,
1, 2, 4 and 8 sequences per device: 3,960 points). Each variant runs the command in
a fresh process (``python -m pod plan ... --json``), the variants alternated
``--repeats`` times:

- ``baseline``: the code at ``--baseline`` (a git revision of this repository,
  default ``b817573``, where issue 32 measured 115 s), checked out in a temporary
  git worktree and run from there;
- ``exhaustive``: this checkout, every point that plans costed (``--exhaustive``), one
  process (``--jobs 1``): the layer tape and the shared caches alone;
- ``one``: this checkout, pruning by the bound, one process (``--jobs 1``);
- ``pool``: this checkout as a user runs it (pruning, a process per core).

Prints, per run: the points, how many were costed, pruned and dropped, the wall
seconds (the process's, start-up included), the CPU seconds of the process and its
workers, points per wall second, and the machine's load average before and after
(other jobs on a shared machine move every wall figure; the CPU seconds move less).
Then the median wall seconds of each variant and their ratio to the baseline's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ARGS = ["llama2-7b", "--slice", "v5e-256"]
VARIANTS = {"baseline": [], "exhaustive": ["--exhaustive", "--jobs", "1"],
            "one": ["--jobs", "1"], "pool": []}


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_once(where: Path, args: list[str], extra: list[str]) -> dict:
    """One plan in a fresh process from checkout ``where``: its JSON's counts, the wall
    and CPU seconds, the load average before and after."""
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "pod", "plan", *args, *extra, "--json",
                   "--output-dir", out]
        env = {**os.environ, "PYTHONPATH": str(where)}
        load0, cpu0, t0 = os.getloadavg()[0], _cpu_seconds(), time.perf_counter()
        done = subprocess.run(command, cwd=where, env=env, capture_output=True, text=True)
        wall, cpu, load1 = time.perf_counter() - t0, _cpu_seconds() - cpu0, os.getloadavg()[0]
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed in {where}:\n{done.stderr[-2000:]}")
    doc = json.loads(done.stdout)
    return {"points": doc["points"], "costed": doc["costed"], "pruned": doc.get("pruned", 0),
            "dropped": doc["dropped"], "wall": wall, "cpu": cpu, "load": (load0, load1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", default="b817573", help="git revision of the baseline")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--variants", default="baseline,exhaustive,one,pool")
    parser.add_argument("plan_args", nargs="*", help="tpu-pod plan's arguments (after --)")
    options = parser.parse_args()
    args = options.plan_args or DEFAULT_ARGS
    variants = [v.strip() for v in options.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: {', '.join(unknown)} unknown; variants: "
                         f"{', '.join(VARIANTS)}")
    print(f"tpu-pod plan {' '.join(args)}; {options.repeats} repeat(s); cores "
          f"{os.cpu_count()}")
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "baseline"
        if "baseline" in variants:
            subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(base),
                            options.baseline], cwd=ROOT, check=True)
        try:
            walls: dict[str, list[float]] = {v: [] for v in variants}
            print(f"{'variant':<11} {'points':>6} {'costed':>6} {'pruned':>6} {'dropped':>7} "
                  f"{'wall s':>7} {'CPU s':>7} {'points/s':>8}  load before, after")
            for _ in range(options.repeats):
                for v in variants:
                    r = run_once(base if v == "baseline" else ROOT, args, VARIANTS[v])
                    walls[v].append(r["wall"])
                    print(f"{v:<11} {r['points']:>6} {r['costed']:>6} {r['pruned']:>6} "
                          f"{r['dropped']:>7} {r['wall']:>7.1f} {r['cpu']:>7.1f} "
                          f"{r['points'] / r['wall']:>8.1f}  {r['load'][0]:.1f}, "
                          f"{r['load'][1]:.1f}", flush=True)
        finally:
            if "baseline" in variants:
                subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT,
                               check=False)
    medians = {v: statistics.median(w) for v, w in walls.items()}
    ref = medians.get("baseline")
    for v, m in medians.items():
        ratio = f" ({ref / m:.1f}x faster than the baseline)" if ref and v != "baseline" else ""
        print(f"median wall {v}: {m:.1f} s{ratio}")


if __name__ == "__main__":
    main()

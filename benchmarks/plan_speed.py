"""How fast ``tpu-pod plan`` answers, before and after, measured side by side in one run.

Usage:

    .venv/bin/python benchmarks/plan_speed.py [--baseline REF] [--repeats N]
        [--variants baseline,exhaustive,one,pool] [--readme] [-- PLAN ARGUMENTS...]

Default question: ``tpu-pod plan llama2-7b --slice v5e-256`` (the README's, the
default search: every mesh over data, stage, fsdp and tensor, six remat policies,
1, 2, 4 and 8 sequences per device: 3,960 points at b817573). ``--readme``: every
``tpu-pod plan`` example of the README (``README_QUESTIONS``), one after the other.
Each variant runs the command in a fresh process (``python -m pod plan ... --json``),
the variants alternated ``--repeats`` times:

- ``baseline``: the code at ``--baseline`` (a git revision of this repository,
  default ``b817573``, where issue 32 measured 115 s), checked out in a temporary
  git worktree and run from there, as a user runs it; ``baseline-one``: the same in one
  process (``--jobs 1``);
- ``exhaustive``: this checkout, every point that plans costed (``--exhaustive``), one
  process (``--jobs 1``): the layer tape and the shared caches alone;
- ``one``: this checkout, pruning by the bound, one process (``--jobs 1``);
- ``pool``: this checkout as a user runs it (pruning, a process per core).

Prints, per run: the points, how many were costed, pruned and dropped, the wall
seconds (the process's, start-up included), the CPU seconds of the process and its
workers, points per wall second, the machine's load average before and after
(other jobs on a shared machine move every wall figure; the CPU seconds move less),
and whether its ten best rows (layout, remat, batch, simulated step seconds) are
those of ``exhaustive`` in the same run (the baseline's figures differ: the model
changed since). Then the median wall seconds of each variant and their ratio to the
baseline's, per question.
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
#: The README's ``tpu-pod plan`` examples (section "Which layout?", and the default search
#: of its command list).
README_QUESTIONS = [
    DEFAULT_ARGS,
    ["llama2-7b", "--slice", "v5e-256", "--seq-len", "4096", "--tokens-per-step", "4Mi",
     "--token-budget", "2T"],
    ["maxtext-2023-s1", "--slice", "v5p-64", "--mesh-axes", "fsdp,tensor"],
    ["maxtext-2023-s1", "--slice", "v5e-64", "--num-slices", "1,2,4", "--mesh-axes", "fsdp",
     "--remat", "full", "--tokens-per-step", "512Ki"],
]
#: What identifies a row of the table, and its figure (compared across variants).
TOP_KEYS = ("slice", "slices", "mesh", "remat", "per_device_batch", "capacity_factor",
            "simulated_step_seconds")
VARIANTS = {"baseline": [], "baseline-one": ["--jobs", "1"],
            "exhaustive": ["--exhaustive", "--jobs", "1"], "one": ["--jobs", "1"], "pool": []}


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
    top = [tuple(r.get(k) for k in TOP_KEYS) for r in doc["rows"][:10] if r.get("rank")]
    rows = {r["point"]: {k: v for k, v in r.items() if k != "wall_seconds"}
            for r in doc["rows"]}
    return {"points": doc["points"], "costed": doc["costed"], "pruned": doc.get("pruned", 0),
            "dropped": doc["dropped"], "wall": wall, "cpu": cpu, "load": (load0, load1),
            "top": top, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", default="b817573", help="git revision of the baseline")
    parser.add_argument("--after", help="git revision of the other variants [default: this "
                                        "checkout as it is]")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--variants", default="baseline,exhaustive,one,pool")
    parser.add_argument("--readme", action="store_true",
                        help="every tpu-pod plan example of the README")
    parser.add_argument("--same-rows", action="store_true",
                        help="also check every row (every column but wall_seconds) of the "
                             "pruning variants against the baseline's (a baseline with the "
                             "same model and figures: the speed-ups must not move a bit; a "
                             "point pruned here must rank past the 30 best there)")
    parser.add_argument("plan_args", nargs="*", help="tpu-pod plan's arguments (after --)")
    options = parser.parse_args()
    questions = README_QUESTIONS if options.readme else [options.plan_args or DEFAULT_ARGS]
    variants = [v.strip() for v in options.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: {', '.join(unknown)} unknown; variants: "
                         f"{', '.join(VARIANTS)}")
    print(f"{options.repeats} repeat(s); cores {os.cpu_count()}; baseline {options.baseline}; "
          f"after {options.after or 'this checkout'}")
    medians: list[tuple[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"baseline": (Path(tmp) / "baseline", options.baseline)} \
            if any(v.startswith("baseline") for v in variants) else {}
        if options.after:
            trees["after"] = (Path(tmp) / "after", options.after)
        for path, revision in trees.values():
            subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(path),
                            revision], cwd=ROOT, check=True)
        try:
            where = {v: trees.get("baseline" if v.startswith("baseline") else "after",
                                  (ROOT,))[0] for v in variants}
            for args in questions:
                walls = _question(args, variants, options.repeats, where, options.same_rows)
                medians.append((" ".join(args), {v: statistics.median(w)
                                                  for v, w in walls.items()}))
        finally:
            for path, _ in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT,
                               check=False)
    for question, by_variant in medians:
        print(f"tpu-pod plan {question}")
        ref = by_variant.get("baseline")
        for v, m in by_variant.items():
            ratio = (f" ({ref / m:.1f}x faster than the baseline)" if ref and v != "baseline"
                     else "")
            print(f"  median wall {v}: {m:.1f} s{ratio}")


def compare_rows(rows: dict, baseline: dict, keep: int = 30) -> str:
    """Every row (by point, every column but wall_seconds) against the baseline's: the
    same, or costed by the baseline and pruned here below the ``keep`` best (its rank
    there past ``keep``: a tighter bound), or pruned in both with another bound in its
    reason; a costed row's rank may move past ``keep`` only (fewer costed points rank
    before it)."""
    equal = below = reworded = differ = 0
    for point, mine in rows.items():
        theirs = baseline.get(point)
        if theirs is None:
            differ += 1
        elif repr(mine) == repr(theirs):
            equal += 1
        elif (mine["status"] == "ok" and theirs["status"] == "ok" and mine["rank"] > keep
              and repr({**mine, "rank": 0}) == repr({**theirs, "rank": 0})):
            equal += 1
        elif mine["status"] == "pruned" and theirs["status"] == "ok" and theirs["rank"] > keep:
            below += 1
        elif (mine["status"] == theirs["status"] == "pruned"
              and repr({**mine, "reason": ""}) == repr({**theirs, "reason": ""})):
            reworded += 1
        else:
            differ += 1
    differ += len(set(baseline) - set(rows))
    text = f"{equal} of {len(rows)} rows = baseline's"
    if below:
        text += f", {below} costed there pruned here (ranked past {keep} there)"
    if reworded:
        text += f", {reworded} pruned in both (the bound in the reason differs)"
    return text + (f", {differ} rows DIFFER" if differ else "")


def _question(args: list[str], variants: list[str], repeats: int, where: dict[str, Path],
              same_rows: bool = False) -> dict[str, list[float]]:
    """Every variant of one question, ``repeats`` times alternated (each run from its
    checkout, ``where``); their wall seconds. With ``same_rows`` the rows of ``one`` and
    ``pool`` are compared with the baseline's, all of them."""
    print(f"\ntpu-pod plan {' '.join(args)}")
    walls: dict[str, list[float]] = {v: [] for v in variants}
    print(f"{'variant':<11} {'points':>6} {'costed':>6} {'pruned':>6} {'dropped':>7} "
          f"{'wall s':>7} {'CPU s':>7} {'points/s':>8}  load before, after  top 10")
    for _ in range(repeats):
        reference = baseline_rows = None
        for v in variants:
            r = run_once(where[v], args, VARIANTS[v])
            walls[v].append(r["wall"])
            if v == "exhaustive":
                reference = r["top"]
            if v.startswith("baseline"):
                baseline_rows = r["rows"]
            same = ("" if v.startswith("baseline") or v == "exhaustive" or reference is None
                    else "= exhaustive's" if r["top"] == reference else "DIFFERS")
            if same_rows and baseline_rows is not None and v in ("one", "pool"):
                same += "; " + compare_rows(r["rows"], baseline_rows)
            print(f"{v:<11} {r['points']:>6} {r['costed']:>6} {r['pruned']:>6} "
                  f"{r['dropped']:>7} {r['wall']:>7.1f} {r['cpu']:>7.1f} "
                  f"{r['points'] / r['wall']:>8.1f}  {r['load'][0]:.1f}, "
                  f"{r['load'][1]:.1f}  {same}", flush=True)
    return walls


if __name__ == "__main__":
    main()

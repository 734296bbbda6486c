"""Wall time of the collective costs a plan asks for: the cost engine beside the old fast paths.

Issue 31: one engine (``interconnect.cost.price`` over ``PairPhases``) prices every
collective; a hand-vectorised fast path may stay only where it is more than 3x faster
on what ``tpu-pod plan`` (and a sweep: the same ``MeshCollectiveCosts``) costs. This
records the collective costs of real plans (every distinct call a plan makes to
``group_collective_cost``, ``group_ppermute_cost`` and ``collective_cost``, through
``pod.config.sharding.MeshCollectiveCosts``), then times each one fresh (no cache),
alternating the two paths, median of the repeats:

- **engine**: the registry's phases priced by ``interconnect.cost.price``;
- **fast path**: the old per-algorithm functions (``interconnect.groups.group_ring_cost``,
  ``group_torus_cost``, ``group_all_to_all_cost``, ``group_ppermute_cost``'s vectorised
  body, ``interconnect.cost._ring_family_cost`` / ``_axis_collective_cost``). They were
  removed after this measurement (none was 3x faster): only commit fa9ad92 has them
  (``git archive fa9ad92 | tar -x -C DIR`` and run this file there); elsewhere the
  column is NaN and the engine's figures stand alone, a check that plans cost no slower
  than BENCHMARKS.md says.

Every pair of results is checked equal before it is timed.

Run: python benchmarks/collective_engine.py [--repeats 5] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import interconnect  # noqa: E402
import pod.config.sharding as sharding  # noqa: E402
from interconnect import groups as groups_module  # noqa: E402

_SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios"

#: the plans and sweeps whose collective calls are recorded: label -> (``pod.plan`` or
#: ``pod.sweep``, keyword arguments)
WORKLOADS = {
    "plan maxtext-2023-s1 v5p-64 fsdp,tensor": ("plan", dict(
        model="maxtext-2023-s1", slice="v5p-64", mesh_axes=("fsdp", "tensor"))),
    "plan gpt3-175b v5p-2048 fsdp,tensor": ("plan", dict(
        model="gpt3-175b", slice="v5p-2048", mesh_axes=("fsdp", "tensor"), remat=("full",),
        per_device_batch=(1,))),
    "plan llama2-7b v5e-256 b1": ("plan", dict(
        model="llama2-7b", slice="v5e-256", per_device_batch=(1,), remat=("full",))),
    "plan maxtext-2023-s1 v3-32 b1": ("plan", dict(
        model="maxtext-2023-s1", slice="v3-32", per_device_batch=(1,), remat=("full",))),
    "plan pipeline-transformer v5e-16": ("plan", dict(
        model=str(_SCENARIOS / "pipeline-transformer-v5e-8.yaml"), slice="v5e-16",
        mesh_axes=("data", "stage"), per_device_batch=(4,), remat=("full",))),
    "sweep layouts-mixtral-8x7b-v5p-128": ("sweep", dict(
        scenario=str(_SCENARIOS / "layouts-mixtral-8x7b-v5p-128.yaml"))),
    "sweep scaling-v5e-strong": ("sweep", dict(
        scenario=str(_SCENARIOS / "scaling-v5e-strong.yaml"))),
}
QUICK = ("plan maxtext-2023-s1 v5p-64 fsdp,tensor", "plan maxtext-2023-s1 v3-32 b1",
         "plan pipeline-transformer v5e-16")


def record(kind: str, kwargs: dict) -> list[tuple[str, tuple, dict]]:
    """Every distinct collective cost call one plan or sweep makes: (function, args, kwargs)."""
    import tempfile

    import pod

    calls: dict[str, tuple[str, tuple, dict]] = {}
    originals = {"group_collective_cost": sharding.group_collective_cost,
                 "group_ppermute_cost": sharding.group_ppermute_cost,
                 "collective_cost": interconnect.collective_cost}

    def recorder(name: str, function: Callable) -> Callable:
        def wrapped(*args, **kwargs):
            calls.setdefault(repr((name, args, sorted(kwargs.items()))), (name, args, kwargs))
            return function(*args, **kwargs)
        return wrapped

    sharding.group_collective_cost = recorder("group_collective_cost",
                                              originals["group_collective_cost"])
    sharding.group_ppermute_cost = recorder("group_ppermute_cost",
                                            originals["group_ppermute_cost"])
    interconnect.collective_cost = recorder("collective_cost", originals["collective_cost"])
    try:
        if kind == "plan":
            pod.plan(**kwargs)
        else:
            with tempfile.TemporaryDirectory() as out:
                pod.sweep(**kwargs, output_dir=out)
    finally:
        sharding.group_collective_cost = originals["group_collective_cost"]
        sharding.group_ppermute_cost = originals["group_ppermute_cost"]
        interconnect.collective_cost = originals["collective_cost"]
    return list(calls.values())


def engine_call(name: str, args: tuple, kwargs: dict):
    """The call through today's public function (the engine, once the fast paths are gone)."""
    return {"group_collective_cost": groups_module.group_collective_cost,
            "group_ppermute_cost": groups_module.group_ppermute_cost,
            "collective_cost": interconnect.collective_cost}[name](*args, **kwargs)


def fast_path_call(name: str, args: tuple, kwargs: dict) -> Callable[[], object] | None:
    """The old fast path of the call, or None when this checkout no longer has it."""
    old = getattr(groups_module, "_old_fast_path", None)
    return None if old is None else (lambda: old(name, args, kwargs))


def figures(cost) -> tuple:
    """What must agree to the bit: seconds (the old whole-torus axis path lost link 0's
    all-gather bytes on tori that mix ring and line axes, e.g. v5e's 16x8: its link bytes
    are not compared; tests/interconnect shows the engine right there)."""
    return (cost.seconds, cost.phase_seconds, cost.busiest_link_seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="the two small plans only")
    args = parser.parse_args()
    print(f"{'workload':<40} {'function':<22} {'calls':>5} {'engine s':>9} {'fast path s':>11} "
          f"{'engine / fast':>13}")
    totals: dict[str, float] = defaultdict(float)
    for label, (kind, kwargs) in WORKLOADS.items():
        if args.quick and label not in QUICK:
            continue
        calls = record(kind, kwargs)
        by_function: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
        for name, call_args, call_kwargs in calls:
            fast = fast_path_call(name, call_args, call_kwargs)
            if fast is not None:
                assert figures(fast()) == figures(engine_call(name, call_args, call_kwargs))
            walls: dict[str, list[float]] = defaultdict(list)
            for _ in range(args.repeats):
                for which, run in (("engine", lambda: engine_call(name, call_args, call_kwargs)),
                                   ("fast", fast)):
                    if run is None:
                        continue
                    start = time.perf_counter()
                    run()
                    walls[which].append(time.perf_counter() - start)
            row = by_function[name]
            row[0] += statistics.median(walls["engine"])
            row[1] += statistics.median(walls["fast"]) if walls["fast"] else float("nan")
            row[2] += 1
        for name, (engine_s, fast_s, count) in sorted(by_function.items()):
            totals["engine"] += engine_s
            totals["fast"] += fast_s
            print(f"{label:<40} {name:<22} {count:>5} {engine_s:>9.4f} {fast_s:>11.4f} "
                  f"{engine_s / fast_s:>13.2f}", flush=True)
    print(f"{'total':<40} {'':<22} {'':>5} {totals['engine']:>9.4f} {totals['fast']:>11.4f} "
          f"{totals['engine'] / totals['fast']:>13.2f}")


if __name__ == "__main__":
    main()

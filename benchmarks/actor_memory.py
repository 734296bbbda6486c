"""Memory one chip actor process costs: the figure behind ``ACTOR_BASE_BYTES``.

Starts a local Ray cluster as a run does, a pod of N v4 chip actors of a small
MLP, runs one step, then reads every ``ray::ChipActor`` process's
``/proc/<pid>/smaps_rollup``: RSS (with the shared libraries), PSS (shared
pages split between their users) and USS (private pages: what one more actor
adds), and how far ``MemAvailable`` fell per actor. Ray's daemons are listed
too (what ``RAY_RESERVE_BYTES`` keeps free).

Run: .venv/bin/python benchmarks/actor_memory.py [CHIPS]   (default 32)

Measured 2026-11-25 (Ray 2.60, Python 3.11, numpy 2.4, 2 cores, 24 GiB), 32 chips:
USS 58.9 MB, PSS 60.4 MB, RSS 112 MB per actor; MemAvailable fell 59.2 MB per actor;
daemons about 0.3 GB (GCS 54, raylet 31, agents 120 + 31, log monitor 77 MB).
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

from pod.config.plan import build_plan
from pod.config.scenario import parse_scenario
from pod.runtime.cluster import ensure_ray, shutdown_ray
from pod.runtime.coordinator import Pod

MB = 2 ** 20


def available_bytes() -> int:
    text = Path("/proc/meminfo").read_text()
    return int(re.search(r"MemAvailable:\s+(\d+)", text).group(1)) * 1024


def memory_of(needle: str) -> list[tuple[int, int, int]]:
    """(RSS, PSS, USS) in bytes of every process whose command line holds ``needle``."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle not in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode():
                continue
            roll = (entry / "smaps_rollup").read_text()
        except OSError:
            continue

        def get(key: str) -> int:
            return int(re.search(rf"^{key}:\s+(\d+)", roll, re.M).group(1)) * 1024

        out.append((get("Rss"), get("Pss"), get("Private_Clean") + get("Private_Dirty")))
    return out


def main(chips: int) -> None:
    plan = build_plan(parse_scenario({
        "name": "actor-memory", "pod": {"chip": "v4", "chips": chips}, "model": {"name": "mlp"},
        "training": {"global_batch": 16 * chips, "steps": 1}, "metrics": {"port": 0}}))
    owns = ensure_ray(None)
    time.sleep(2)
    before = available_bytes()
    try:
        with Pod(plan) as pod:
            pod.step(0)
            time.sleep(1)
            actors = memory_of("ray::ChipActor")
            drop = (before - available_bytes()) / len(actors)
            for i, name in enumerate(("RSS", "PSS", "USS")):
                values = sorted(a[i] for a in actors)
                print(f"{name} per actor ({len(values)} actors): median "
                      f"{values[len(values) // 2] / MB:.1f} MB, max {values[-1] / MB:.1f} MB")
            print(f"MemAvailable fell {drop / MB:.1f} MB per actor")
            for daemon in ("gcs_server", "raylet", "dashboard", "runtime_env", "log_monitor"):
                print(f"{daemon}: {sum(m[0] for m in memory_of(daemon)) / MB:.0f} MB RSS")
    finally:
        if owns:
            shutdown_ray()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 32)

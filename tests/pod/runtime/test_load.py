"""Load: a 16-chip pod for a few hundred steps with checkpoints every few steps keeps its
memory flat, in the driver and in every chip actor (RSS read from /proc/<pid>/status).

Marked ``load`` (deselect with ``-m "not load"``); about a minute on a 2-core machine.
``TPU_POD_LOAD_STEPS`` changes the length (default 300).
"""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest
from rich.console import Console

from pod.config.plan import build_plan
from pod.config.scenario import parse_scenario

pytestmark = [pytest.mark.load, pytest.mark.usefixtures("ray_cluster")]

STEPS = int(os.environ.get("TPU_POD_LOAD_STEPS", "300"))
MIB = 2**20


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (VmRSS in /proc/<pid>/status), bytes."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def slope_mib_per_100_steps(samples: list[tuple[int, float]]) -> float:
    """Least-squares growth of RSS (bytes) against step, in MiB per 100 steps."""
    steps, rss = np.array(samples, dtype=np.float64).T
    return float(np.polyfit(steps, rss, 1)[0] * 100 / MIB)


def test_sixteen_chips_hundreds_of_steps_with_checkpoints_keep_memory_flat(tmp_path, monkeypatch):
    import ray

    import pod.commands.train as run_module
    from pod.runtime.coordinator import Pod

    pods: list[Pod] = []

    class RecordedPod(Pod):
        def start(self) -> float:
            pods.append(self)
            return super().start()

    monkeypatch.setattr(run_module, "Pod", RecordedPod)
    scenario = parse_scenario({
        "name": "load",
        "pod": {"chip": "v5e", "chips": 16, "topology": "4x4"},   # 2 TPU hosts of 8 chips
        "model": {"name": "mlp", "options": {"hidden": [64], "batch_norm": True, "dropout": 0.1}},
        "data": {"name": "digits"},
        "training": {"global_batch": 64, "steps": STEPS, "eval_every_steps": 50,
                     "optimizer": {"name": "adam", "learning_rate": 0.003}},
        "metrics": {"port": 0},
        "checkpoint": {"every_steps": 5, "keep": 2},
    })
    driver = os.getpid()
    actors: list[int] = []
    driver_rss: list[tuple[int, float]] = []
    actor_rss: list[tuple[int, float]] = []   # the sum over the 16 actors

    def sample(stats):
        if not actors:
            pids = ray.get([a.__ray_call__.remote(lambda self: os.getpid()) for a in pods[0].actors])
            actors.extend(pids)
        if (stats.step + 1) % 10 == 0:
            driver_rss.append((stats.step, rss_bytes(driver)))
            actor_rss.append((stats.step, sum(rss_bytes(p) for p in actors)))

    summary = run_module.run_training(build_plan(scenario), output_dir=tmp_path, log_every=0,
                                      console=Console(file=io.StringIO()), on_step=sample)
    assert summary["steps"] == STEPS and summary["checkpoints_written"] == STEPS // 5
    assert len(list((tmp_path / "checkpoints").glob("ckpt-*.msgpack"))) == 2
    warm = len(driver_rss) // 3            # the first third warms caches and allocators up
    d_slope = slope_mib_per_100_steps(driver_rss[warm:])
    a_slope = slope_mib_per_100_steps(actor_rss[warm:])
    report = {"steps": STEPS, "chips": 16,
              "driver_rss_mib": [round(r / MIB, 1) for _, r in driver_rss],
              "actors_rss_mib": [round(r / MIB, 1) for _, r in actor_rss],
              "driver_slope_mib_per_100_steps": round(d_slope, 3),
              "actors_slope_mib_per_100_steps": round(a_slope, 3),
              "wall_seconds": round(summary["wall_seconds"], 1)}
    (tmp_path / "load.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report))
    # flat: growth beyond noise would be a per-step leak (a record, a label, a reference);
    # 1 MiB per 100 steps in the driver is ~3 KiB per step, 16 MiB over 16 actors the same each
    assert d_slope < 1.0, report
    assert a_slope < 16.0, report

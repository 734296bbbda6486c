"""Load: a 16-chip pod for a few hundred steps with checkpoints every few steps retains
nothing per step in the driver, and keeps its chip actors' memory flat.

The driver is checked by its Python allocations, not its RSS (RSS moves with the
allocator and Ray's native buffers: it failed once at 1.3 MiB per 100 steps with samples
flat to 3 MiB). After an untraced warm-up, ``tracemalloc`` snapshots are taken every 15
steps over the last 60 (each after a full collection, which also empties the free lists)
and the live allocations are grouped by site: the innermost frame in pod/, chip/ or
interconnect/ (a Path made by pathlib for pod/state/checkpoint.py is charged there), else
the innermost frame. A site that grows by ``MIN_SITE_BYTES_PER_STEP`` per step in every
interval is a per-step leak, and the failure names it with its stacks; noise goes up and
down. The whole traced heap's growth is bounded too (a leak spread over many sites).
RSS is still sampled and reported (the driver, and the sum of the 16 actors, which keeps
a loose bound). A second, cheap test injects a leak (``Run.record`` keeping every
``StepStats``) and checks the detector names it.

Marked ``load`` (deselect with ``-m "not load"``); 80-100 s for the first test and 10-15 s
for the second on a loaded 2-core machine (tracing makes the 75 traced steps several times
slower in the driver, so only the last 75 of the 300 are traced).
``TPU_POD_LOAD_STEPS`` changes the length (default 300, at least 200).
"""

from __future__ import annotations

import gc
import io
import json
import os
import time
import tracemalloc
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
from rich.console import Console

from pod.config.plan import build_plan
from pod.config.scenario import parse_scenario

pytestmark = [pytest.mark.load, pytest.mark.usefixtures("ray_cluster")]

STEPS = int(os.environ.get("TPU_POD_LOAD_STEPS", "300"))
MIB = 2**20
REPO = Path(__file__).resolve().parents[3]
PROJECT_DIRS = tuple(str(REPO / d) + os.sep for d in ("pod", "chip", "interconnect"))
THIS_FILE = str(Path(__file__).resolve())

#: a site growing by this much per step in every interval is a leak. Noise measured on a
#: loaded 2-core machine: Ray's deserialised results (ray/_private/worker.py) move by up
#: to ~2.2 KiB per 15-step interval, about half the time upwards, repository sites by
#: < 600 B; a steps.csv row or a StepStats kept per step is 1-10 KiB a step
MIN_SITE_BYTES_PER_STEP = 160
#: the whole traced driver heap may not grow by more than this per step (any number of sites)
MAX_TOTAL_BYTES_PER_STEP = 1024
#: frames kept per allocation (enough to reach the repository from pathlib; each costs CPU)
FRAMES = 6
#: allocations made under these library files are bounded by the library: rich keeps a
#: task's progress samples of the last 30 s (at most 1000), more of them as steps speed up
BOUNDED = (f"{os.sep}rich{os.sep}progress.py",)
#: the injected leak's store (test_the_retention_probe_names_an_injected_per_step_leak)
LEAKED: list[Any] = []


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


class RetentionProbe:
    """What the driver keeps alive step after step, from ``tracemalloc`` snapshots.

    Call ``sample(step)`` after each step (one-based count of steps done): tracing
    starts at ``start`` (the warm-up before it is not traced: tracing costs CPU), the
    baseline snapshot is ``settle`` steps later and another every ``interval`` steps up
    to ``end``.
    """

    def __init__(self, start: int, settle: int, interval: int, end: int,
                 frames: int = FRAMES) -> None:
        assert (end - start - settle) // interval >= 3, "need at least three intervals"
        self.start, self.settle, self.interval, self.end = start, settle, interval, end
        self.frames = frames
        self.sites: list[dict[str, int]] = []        # per snapshot: site -> live bytes
        self.stacks: dict[str, Counter] = {}         # site -> stack -> live bytes (last snapshot)
        self.types: list[Counter] = []               # per snapshot: gc-tracked objects by type
        self.steps: list[int] = []
        self.seconds: list[float] = []
        self.was_tracing = tracemalloc.is_tracing()

    def sample(self, step: int) -> None:
        since = step - self.start - self.settle
        if step == self.start and not self.was_tracing:
            tracemalloc.start(self.frames)
        if since >= 0 and since % self.interval == 0 and step <= self.end:
            self.snapshot(step)
            if step + self.interval > self.end:
                self.stop()

    def stop(self) -> None:
        if not self.was_tracing and tracemalloc.is_tracing():
            tracemalloc.stop()

    def snapshot(self, step: int) -> None:
        t0 = time.perf_counter()
        gc.collect()
        snap = tracemalloc.take_snapshot().filter_traces([
            tracemalloc.Filter(False, tracemalloc.__file__)])
        if not self.types or step + self.interval > self.end:  # the baseline and the last
            self.types.append(Counter(type(o).__name__ for o in gc.get_objects()))
        sites: dict[str, int] = {}
        stacks: dict[str, Counter] = {}
        for trace in snap.traces:
            site = self.site(trace.traceback)
            if site is None:
                continue
            sites[site] = sites.get(site, 0) + trace.size
            stacks.setdefault(site, Counter())[self.stack(trace.traceback)] += trace.size
        self.sites.append(sites)
        self.stacks = stacks
        self.steps.append(step)
        self.seconds.append(round(time.perf_counter() - t0, 2))

    @staticmethod
    def site(tb: tracemalloc.Traceback) -> str | None:
        """Where an allocation is charged: the innermost frame in pod/, chip/ or
        interconnect/, else the innermost frame (Ray's threads, libraries); None for this
        test's own records (the probe, the RSS samples), allocated from this file first,
        and for the ``BOUNDED`` library structures."""
        for frame in reversed(tb):  # a Traceback lists the oldest frame first
            if frame.filename == THIS_FILE or frame.filename.endswith(BOUNDED):
                return None
            if frame.filename.startswith(PROJECT_DIRS):
                return f"{os.path.relpath(frame.filename, REPO)}:{frame.lineno}"
        return f"{tb[0].filename}:{tb[0].lineno}"

    @staticmethod
    def stack(tb: tracemalloc.Traceback) -> str:
        """The allocation's frames, innermost first (repository files by their path)."""
        def name(path: str) -> str:
            return os.path.relpath(path, REPO) if path.startswith(PROJECT_DIRS) else os.path.basename(path)

        return " <- ".join(f"{name(f.filename)}:{f.lineno}" for f in reversed(tb))

    def growth(self) -> dict[str, list[int]]:
        """Per site, its growth in bytes in each interval after the baseline."""
        names = set().union(*self.sites)
        return {s: [b.get(s, 0) - a.get(s, 0) for a, b in zip(self.sites, self.sites[1:])]
                for s in names}

    def window_steps(self) -> int:
        return self.steps[-1] - self.steps[0]

    def growing_sites(self, min_bytes_per_step: float = MIN_SITE_BYTES_PER_STEP) -> dict[str, int]:
        """Sites that grew by ``min_bytes_per_step`` or more per step in every interval
        (a leak grows steadily; warm-up is one interval's jump, noise goes up and down):
        their total growth in bytes."""
        least = min_bytes_per_step * self.interval
        return {s: sum(g) for s, g in self.growth().items() if min(g) >= least}

    def total_growth(self) -> int:
        return sum(self.sites[-1].values()) - sum(self.sites[0].values())

    def type_growth(self, at_least: int) -> dict[str, int]:
        """gc-tracked types whose count grew by ``at_least`` or more over the window
        (tuples left out: the collector stops tracking tuples of atoms lazily)."""
        first, last = self.types[0], self.types[-1]
        return {t: last[t] - first[t] for t in last
                if last[t] - first[t] >= at_least and t != "tuple"}

    def top_sites(self, n: int = 5) -> dict[str, list[int]]:
        """The ``n`` sites that grew most over the window: growth per interval."""
        growth = sorted(self.growth().items(), key=lambda kv: -sum(kv[1]))[:n]
        return dict(growth)

    def describe(self, sites: dict[str, int]) -> list[str]:
        """A failure's text: each site's growth per step and its biggest stacks."""
        lines = []
        for site, grew in sorted(sites.items(), key=lambda kv: -kv[1]):
            lines.append(f"{site}: +{grew} B over {self.window_steps()} steps "
                         f"({grew / self.window_steps():.0f} B/step; per interval "
                         f"{self.growth()[site]})")
            lines += [f"    {size} B live  {stack}"
                      for stack, size in self.stacks.get(site, Counter()).most_common(2)]
        return lines


class Discard(io.TextIOBase):
    """A console file that keeps nothing (a StringIO would grow with the output)."""

    def write(self, text: str) -> int:
        return len(text)


def load_scenario(chips: int, topology: str | None, steps: int):
    pod = {"chip": "v5e", "chips": chips} | ({"topology": topology} if topology else {})
    return parse_scenario({
        "name": "load",
        "pod": pod,
        "model": {"name": "mlp", "options": {"hidden": [64], "batch_norm": True, "dropout": 0.1}},
        "data": {"name": "digits"},
        "training": {"global_batch": 64, "steps": steps, "eval_every_steps": 50,
                     "optimizer": {"name": "adam", "learning_rate": 0.003}},
        "metrics": {"port": 0},
        "checkpoint": {"every_steps": 5, "keep": 2},
    })


def run(scenario, tmp_path: Path, on_step: Callable[[Any], None]) -> dict[str, Any]:
    import pod.commands.train as run_module

    return run_module.run_training(build_plan(scenario), output_dir=tmp_path, log_every=0,
                                   console=Console(file=Discard()), on_step=on_step)


def test_sixteen_chips_hundreds_of_steps_with_checkpoints_retain_nothing_per_step(tmp_path,
                                                                                  monkeypatch):
    import ray

    import pod.runtime.pod as ray_pod

    assert STEPS >= 200, "TPU_POD_LOAD_STEPS: at least 200 (a warm-up and the window)"
    pods: list[ray_pod.Pod] = []

    class RecordedPod(ray_pod.Pod):
        def start(self, *args, **options) -> float:
            pods.append(self)
            return super().start(*args, **options)

    monkeypatch.setattr(ray_pod, "Pod", RecordedPod)  # ``Run`` imports it when it starts
    # the last 60 steps are the window, in 4 intervals of 15 (a multiple of the checkpoint
    # period, so each snapshot is taken at the same point of it); tracing starts 15 steps
    # before the window (Ray's buffers made since then settle; tracing costs the driver
    # CPU, so the warm-up before it is untraced)
    interval, settle = 15, 15
    end = STEPS - STEPS % 5
    start = end - 4 * interval - settle
    probe = RetentionProbe(start=start, settle=settle, interval=interval, end=end)
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
        probe.sample(stats.step + 1)

    cpu0 = time.process_time()
    try:
        summary = run(load_scenario(16, "4x4", STEPS), tmp_path, sample)  # 2 TPU hosts of 8 chips
    finally:
        probe.stop()
    cpu = time.process_time() - cpu0
    assert summary["steps"] == STEPS and summary["checkpoints_written"] == STEPS // 5
    assert len(list((tmp_path / "checkpoints").glob("ckpt-*.msgpack"))) == 2

    window = probe.window_steps()
    leaks = probe.growing_sites()
    total = probe.total_growth()
    warm = len(driver_rss) // 3            # the first third warms caches and allocators up
    a_slope = slope_mib_per_100_steps(actor_rss[warm:])
    report = {"steps": STEPS, "chips": 16, "traced_steps": [start, end],
              "snapshots_at": probe.steps, "snapshot_seconds": probe.seconds,
              "driver_python_growth_bytes": total,
              "driver_python_growth_bytes_per_step": round(total / window, 1),
              "growing_sites": {s: f"+{g} B" for s, g in leaks.items()},
              "top_sites_growth_per_interval": probe.top_sites(),
              "types_grown_by_a_step_or_more": probe.type_growth(window),
              "driver_rss_mib": [round(r / MIB, 1) for _, r in driver_rss],
              "actors_rss_mib": [round(r / MIB, 1) for _, r in actor_rss],
              "driver_rss_slope_mib_per_100_steps": round(slope_mib_per_100_steps(driver_rss[warm:]), 3),
              "actors_rss_slope_mib_per_100_steps": round(a_slope, 3),
              "wall_seconds": round(summary["wall_seconds"], 1), "driver_cpu_seconds": round(cpu, 1)}
    (tmp_path / "load.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report))
    # the driver retains nothing per step: no site grows in every interval (a record, a
    # label, a reference kept per step), and the whole traced heap stays within noise
    assert not leaks, "\n".join(["driver allocations growing step after step:",
                                 *probe.describe(leaks), json.dumps(report)])
    assert total < MAX_TOTAL_BYTES_PER_STEP * window, "\n".join([
        f"driver heap grew {total} B over {window} steps; biggest sites:",
        *probe.describe(dict(sorted(((s, sum(g)) for s, g in probe.growth().items()),
                                    key=lambda kv: -kv[1])[:5])), json.dumps(report)])
    # the actors: RSS, loosely (16 MiB per 100 steps over 16 actors is ~6 KiB per step each;
    # their steps allocate and free whole arrays, so RSS moves with the allocator)
    assert a_slope < 16.0, report


def test_the_retention_probe_names_an_injected_per_step_leak(tmp_path, monkeypatch):
    """The detector itself: ``Run.record`` made to keep every StepStats in a module-level
    list (a classic per-step leak) is flagged, at the site that made the StepStats."""
    import pod.commands.train as run_module

    record = run_module.Run.record

    def leaky_record(self, stats, out):
        LEAKED.append(stats)
        record(self, stats, out)

    monkeypatch.setattr(run_module.Run, "record", leaky_record)
    probe = RetentionProbe(start=10, settle=5, interval=10, end=45)   # 1 chip, 45 steps
    try:
        summary = run(load_scenario(1, None, 45), tmp_path, lambda stats: probe.sample(stats.step + 1))
        assert summary["steps"] == 45 and len(LEAKED) == 45
    finally:
        probe.stop()
        LEAKED.clear()
    growing = probe.growing_sites()
    print(json.dumps({"window_steps": probe.window_steps(), "growing_sites": growing,
                      "types_grown": probe.type_growth(probe.window_steps())}))
    assert growing, "the injected leak was not detected"
    # the StepStats and its dicts are built by the one clock
    assert any(s.startswith("pod/report/clock.py:") for s in growing), \
        "\n".join(probe.describe(growing))
    assert sum(growing.values()) / probe.window_steps() > 500, "\n".join(probe.describe(growing))
    assert probe.type_growth(probe.window_steps()).get("StepStats", 0) >= probe.window_steps()

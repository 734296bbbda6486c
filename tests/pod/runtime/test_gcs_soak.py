"""Soak: Ray's GCS, the driver and the actors stay flat over many actor calls (issue 26).

Ray's GCS kept every task's events: about 2.6 KB per actor call here (12 KB per
data-parallel step; 46 -> 291 MB over 20,000 steps; 61 -> 358 MB over 120,000 calls of
this test's kind, against 46.4 -> 48.2 MB with task events off). The emulator's local cluster
turns task events off (``RAY_task_events_report_interval_ms=0``,
``pod.runtime.cluster._LOCAL_RAY_SETTINGS``). This drives 8 actors of the shared
test cluster (started as the CLI starts its own) with cheap calls: a warm-up of
``WARMUP_CALLS`` (the GCS's own start-up growth), then ``INTERVALS`` intervals of
``INTERVAL_CALLS``, sampling the RSS of this cluster's GCS, the driver and the
actors after each. With task events on, the GCS grew 120 MB per 40,000 calls here;
the bound below is a tenth of that.

Marked ``load`` (about 2-3 minutes on a loaded 2-core machine; deselect with
``-m "not load"``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

pytestmark = [pytest.mark.load, pytest.mark.usefixtures("ray_cluster")]

ACTORS = 8
WARMUP_CALLS = 40_000
INTERVAL_CALLS = 20_000
INTERVALS = 2
MIB = 2 ** 20
#: growth allowed over the measured window (40,000 calls): task events on grew ~100 MiB
MAX_GCS_GROWTH_BYTES = 12 * MIB
MAX_DRIVER_GROWTH_BYTES = 16 * MIB
MAX_ACTOR_GROWTH_BYTES = 8 * MIB


def _rss(pid: int) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+)", text).group(1)) * 1024


def _gcs_pid() -> int:
    """The GCS of this process's local cluster (other sessions run clusters too)."""
    from pod.runtime.cluster import cluster_temp_dir

    mine = f"{cluster_temp_dir()}/"
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "gcs_server" in cmd and mine in cmd:
            return int(entry.name)
    raise AssertionError("no GCS of this process's cluster")


def test_the_gcs_the_driver_and_the_actors_stay_flat_over_many_calls():
    import ray

    assert os.environ.get("RAY_task_events_report_interval_ms") == "0"

    @ray.remote(num_cpus=0.001)
    class Echo:
        def pid(self) -> int:
            return os.getpid()

        def echo(self, x: int) -> int:
            return x

    actors = [Echo.remote() for _ in range(ACTORS)]
    pids = ray.get([a.pid.remote() for a in actors])
    gcs = _gcs_pid()

    def calls(n: int) -> None:
        for i in range(n // ACTORS):
            ray.get([a.echo.remote(i) for a in actors])

    def sample() -> tuple[int, int, int]:
        return _rss(gcs), _rss(os.getpid()), max(_rss(p) for p in pids)

    try:
        calls(WARMUP_CALLS)
        samples = [sample()]
        for _ in range(INTERVALS):
            calls(INTERVAL_CALLS)
            samples.append(sample())
    finally:
        for actor in actors:
            ray.kill(actor)
    (gcs0, driver0, actor0), (gcs1, driver1, actor1) = samples[0], samples[-1]
    shown = [tuple(round(v / MIB, 1) for v in s) for s in samples]
    assert gcs1 - gcs0 < MAX_GCS_GROWTH_BYTES, f"GCS, driver, largest actor (MiB): {shown}"
    assert driver1 - driver0 < MAX_DRIVER_GROWTH_BYTES, shown
    assert actor1 - actor0 < MAX_ACTOR_GROWTH_BYTES, shown

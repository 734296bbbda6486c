"""The CPU seconds of processes, for the benchmarks that measure CPU beside wall time
(``vs_peers.py``, ``profile_step.py``, ``ici_transport.py``; run as scripts, so they
import this module from their own folder)."""

from __future__ import annotations

import os

__all__ = ["cpu_seconds"]


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes so far: utime + stime of
    ``/proc/<pid>/stat`` (in clock ticks, ``SC_CLK_TCK`` per second; Linux only).

    Raises:
        FileNotFoundError: a process that is gone.
    """
    ticks = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")

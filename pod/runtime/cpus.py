"""``pin_to_cpu``: the chip actors of a host with no more CPUs than chips each keep one CPU.

A host's chip actors all compute at once (a data-parallel step: every device's
forward and backward, then the allreduce, then every device's update). When they
are at least as many as the CPUs the process may use, the kernel moves them
between CPUs as they wake and sleep. Spread evenly instead (the host's ``k``-th
chip on CPU ``k mod n`` of the ``n`` allowed), each keeps its CPU: the quick
start (4 chip actors on the 2 CPUs of BENCHMARKS.md's machine, load 3-8 from
other jobs) took a median
26.7 / 35.2 / 25.3 / 26.3 ms a step pinned against 31.6 / 37.1 / 29.1 / 36.3 ms
free (blocks of 10 steps alternated in one pod, runs of 400 to 600 steps, the
last at load 7-8), about the same CPU time (BENCHMARKS.md, the step's round 5):
less waiting, not less work (why, not isolated: fewer wake-ups onto a CPU another
actor holds while the other CPU runs something else).
With more CPUs than chips nothing is pinned: two pods on one large host would
otherwise share its first CPUs and leave the rest idle. Pinning moves no number:
the bits are the same on every CPU.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection

__all__ = ["choose_cpu", "pin_to_cpu"]


def choose_cpu(slot: int, host_chips: int, allowed: Collection[int]) -> int | None:
    """The CPU of the host's chip number ``slot`` (from 0) of ``host_chips``, among the
    ``allowed`` CPUs: the ``slot mod n``-th in ascending order when ``host_chips >= n``
    (every CPU is wanted by a chip); None with more CPUs than chips or none allowed."""
    cpus = sorted(allowed)
    if not cpus or int(host_chips) < len(cpus):
        return None
    return cpus[int(slot) % len(cpus)]


def pin_to_cpu(slot: int, host_chips: int) -> int | None:
    """Pin every thread of this process (and so the threads it starts later) to
    ``choose_cpu(slot, host_chips, <the CPUs this process may use>)``.

    Returns:
        The CPU; None if not pinned (more CPUs than chips, or no
        ``os.sched_setaffinity``: not Linux).
    """
    if not hasattr(os, "sched_setaffinity"):
        return None
    cpu = choose_cpu(slot, host_chips, os.sched_getaffinity(0))
    if cpu is None:
        return None
    os.sched_setaffinity(0, {cpu})  # this thread, and the threads it starts from now on
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        threads = []
    for tid in threads:  # Ray's threads, started before this one
        with contextlib.suppress(OSError):  # one that ended meanwhile
            os.sched_setaffinity(tid, {cpu})
    return cpu

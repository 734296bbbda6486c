"""``pod.runtime.cpus``: a host's chip actors spread one per CPU when they fill its CPUs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pod.runtime.cpus import choose_cpu


def test_chips_that_fill_the_cpus_spread_evenly_and_fewer_chips_are_not_pinned():
    # 4 chips on 2 CPUs (the quick start here): two per CPU, alternating
    assert [choose_cpu(k, 4, {0, 1}) for k in range(4)] == [0, 1, 0, 1]
    # the CPUs a process may use need not start at 0 nor be contiguous
    assert [choose_cpu(k, 3, [6, 2, 9]) for k in range(3)] == [2, 6, 9]
    # more CPUs than chips: pinning would crowd two pods onto the first CPUs
    assert choose_cpu(0, 4, range(8)) is None
    assert choose_cpu(0, 1, ()) is None


_PIN = """
import os, sys, threading
started = threading.Event()
before = threading.Thread(target=started.wait, daemon=True)  # a thread started before
before.start()
from pod.runtime.cpus import pin_to_cpu
cpu = pin_to_cpu(int(sys.argv[1]), int(sys.argv[2]))
after = threading.Thread(target=started.wait, daemon=True)
after.start()
sets = {sorted(os.sched_getaffinity(t))[0] if len(os.sched_getaffinity(t)) == 1 else -1
        for t in (0, before.native_id, after.native_id)}
started.set()
print(cpu, *sorted(sets))
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux's sched_setaffinity")
def test_a_pinned_process_keeps_every_thread_on_its_cpu():
    allowed = sorted(os.sched_getaffinity(0))
    n = len(allowed)

    def run(slot: int, chips: int) -> list[str]:
        return subprocess.run([sys.executable, "-c", _PIN, str(slot), str(chips)],
                              capture_output=True, text=True, check=True).stdout.split()

    # the last slot of a host with as many chips as CPUs: the last CPU, every thread on it
    assert run(n - 1, n) == [str(allowed[-1]), str(allowed[-1])]
    # a chip more than the CPUs wraps around to the first
    assert run(n, n + 1) == [str(allowed[0]), str(allowed[0])]
    # more CPUs than chips: not pinned (-1: every thread keeps several CPUs, where n > 1)
    got = run(0, n - 1) if n > 1 else ["None", "-1"]
    assert got == ["None", "-1"]

"""``keep_freed_memory``: a step's freed temporaries are reused, not faulted in again."""

from __future__ import annotations

import subprocess
import sys

import pytest

# a step's temporaries of 1 and 3 MiB, allocated and freed 20 times after a first
# step; prints the minor page faults of those 20 steps
_STEPS = """
import resource, sys
import numpy as np
if sys.argv[1] == "keep":
    from pod.runtime.heap import keep_freed_memory
    assert keep_freed_memory()
def step():
    a = np.ones(1 << 18, np.float32)
    b = np.ones(3 << 18, np.float32)
    del a, b
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _STEPS, mode], capture_output=True, text=True,
                         check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_temporaries_are_reused_without_page_faults():
    # 20 steps of 4 MiB (1,024 pages each): glibc's default thresholds give part of
    # them back and fault them in again every step (about 50 pages a step here);
    # kept, a step faults none in (a few pages of slack)
    default, kept = _faults("default"), _faults("keep")
    assert default >= 100
    assert kept <= 4

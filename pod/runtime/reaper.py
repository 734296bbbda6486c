"""The reaper of a local Ray cluster: ends Ray's processes when the driver that
started them dies without stopping them (``kill -9``, the OOM killer).

Ray ties its GCS and raylet to the driver (``PR_SET_PDEATHSIG``), but not the
raylet's helpers: its dashboard and runtime-env agents notice the raylet's death
within a second, then spend about 60 s trying to report it to the dead GCS
before they exit, and the session directory stays behind. A reaper is a small
process of the standard library only (started by ``pod.runtime.cluster`` as
``python -I -S reaper.py``, in a session of its own) that reads lines from its
stdin, a pipe whose only writer is the driver:

- ``group PGID``: a process group of Ray's (each daemon leads its own; the
  raylet's agents are in the raylet's group);
- ``env KEY=VALUE``: a variable only this cluster's processes have in their
  environment (the token path), which finds Ray's workers (each in a group of
  its own, started by the raylet);
- ``dir PATH``: the session directory to remove;
- ``done``: the driver stopped the cluster itself; nothing to do.

At end of file without ``done`` (the driver is gone: the kernel closed its end)
the reaper sends SIGKILL to every group and every matching process of this
user, waits up to ``GRACE_SECONDS`` for them to go, removes the directory and
exits. It never signals anything else: groups it was told of, and processes
whose environment carries the cluster's own token path.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import time

#: Seconds to wait for the killed processes to be gone before removing their files.
GRACE_SECONDS = 5.0


def _members(groups: list[int], marker: bytes | None) -> list[int]:
    """Live processes (not zombies) of this user in ``groups``, or whose environment
    holds ``marker`` (``KEY=VALUE``)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                state, _, pgid = f.read().rsplit(b")", 1)[1].split()[:3]
            if state == b"Z":
                continue
            if int(pgid) in groups:
                found.append(int(entry))
                continue
            if marker:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if marker in f.read().split(b"\0"):
                        found.append(int(entry))
        except (OSError, ValueError):  # gone, or another user's
            continue
    return found


def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def reap(lines) -> bool:
    """Read the driver's lines to their end; kill and clean up unless ``done`` came.

    Args:
        lines: an iterable of text lines (the pipe from the driver).

    Returns:
        True if it had to reap (the driver died without stopping the cluster).
    """
    groups: list[int] = []
    marker: bytes | None = None
    directory: str | None = None
    for line in lines:
        kind, _, value = line.strip().partition(" ")
        if kind == "done":
            return False
        if kind == "group" and value.isdigit():
            groups.append(int(value))
        elif kind == "env" and "=" in value:
            marker = value.encode()
        elif kind == "dir" and value:
            directory = value
    deadline = time.monotonic() + GRACE_SECONDS
    while (left := _members(groups, marker)) and time.monotonic() < deadline:
        _kill(left)  # again: a worker the raylet was starting as the driver died
        time.sleep(0.1)
    if directory:
        shutil.rmtree(directory, ignore_errors=True)
    return True


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the driver's to handle
    reap(sys.stdin)

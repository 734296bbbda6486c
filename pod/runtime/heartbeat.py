"""``Heartbeat``: the driver pings every chip actor's process, to tell a frozen chip
from a busy one.

A chip actor runs one task at a time, so a Ray call cannot ask a chip that is
mid-step whether it still runs. Its ``IciPort`` can: the port's reader threads
run beside the actor's task thread, and a heartbeat link (``pod.runtime.ici``,
a hello with ``PING_RANK`` and the pod's key) has each byte echoed by one of
them. So a chip that computes, or waits in a collective for a peer, answers
within milliseconds; a process that does not run at all (SIGSTOP, a frozen
host, a paused VM) answers nothing, while its sockets stay open and Ray still
counts it alive (issue 34: such a run waited past 400 s).

The driver polls without blocking (``poll``, from its waits for actor calls):
each poll reads the answers that came, sends a new ping to every chip that
answered its last one at least ``interval_s`` ago, and returns the chips whose
ping has waited longer than ``timeout_s``. A link that closes (the process
died) is dropped: Ray reports a dead actor itself (``RayActorError``).
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass

from pod.runtime.ici import PING_RANK, hello

__all__ = ["Heartbeat", "HEARTBEAT_TIMEOUT_S", "HEARTBEAT_INTERVAL_S"]

#: Wall seconds a ping may go unanswered before its chip is declared frozen. An
#: answer needs only a reader thread and the GIL for a moment: measured on this
#: 2-core machine at load average 11, 2,212 pings during 300 quick-start steps of
#: 4 chip actors answered in 0.06 ms (median), 20 ms (99th percentile), 67 ms at
#: most. Ten seconds leaves a margin of 150 times that, and is twice Ray's own time
#: to report a killed actor (5 s).
HEARTBEAT_TIMEOUT_S = 10.0
#: Wall seconds between two pings of one chip (one byte each way).
HEARTBEAT_INTERVAL_S = 1.0
_CONNECT_TIMEOUT_S = 5.0


@dataclass
class _Link:
    sock: socket.socket
    sent_at: float | None = None  # the unanswered ping's time, if one is out
    answered_at: float = 0.0


class Heartbeat:
    """Heartbeat links from the driver to each chip (module docstring).

    Args:
        addresses: chip rank -> (host, port) of one of its ``IciPort`` s.
        key: the pod's link secret (``Pod.ici_key``).
        timeout_s: wall seconds after which an unanswered ping declares its
            chip frozen.
        interval_s: wall seconds between pings of one chip.

    A chip whose port cannot be reached when the heartbeat starts has no link
    (``unwatched``): its failures are left to Ray and to the step deadline.

    Raises:
        ValueError: a timeout or interval that is not positive.
    """

    def __init__(self, addresses: Mapping[int, tuple[str, int]], key: bytes, *,
                 timeout_s: float = HEARTBEAT_TIMEOUT_S,
                 interval_s: float = HEARTBEAT_INTERVAL_S) -> None:
        if not (timeout_s > 0 and interval_s > 0):
            raise ValueError(f"heartbeat timeout_s and interval_s must be positive, got "
                             f"{timeout_s!r} and {interval_s!r}")
        self.timeout_s, self.interval_s = float(timeout_s), float(interval_s)
        self._links: dict[int, _Link] = {}
        self.unwatched: list[int] = []
        now = time.monotonic()
        message = hello(PING_RANK, key)
        for rank, (host, port) in addresses.items():
            try:
                sock = socket.create_connection((host, int(port)), timeout=_CONNECT_TIMEOUT_S)
                sock.sendall(message)
                sock.setblocking(False)
            except OSError:
                self.unwatched.append(int(rank))
                continue
            self._links[int(rank)] = _Link(sock, answered_at=now - self.interval_s)  # ping at once

    def poll(self, now: float | None = None) -> list[int]:
        """Read the answers that came, ping the chips due, and return the ranks
        whose ping has gone unanswered for more than ``timeout_s`` (ascending)."""
        now = time.monotonic() if now is None else now
        silent = []
        for rank, link in list(self._links.items()):
            if link.sent_at is not None and not self._read(rank, link, now):
                if now - link.sent_at > self.timeout_s:
                    silent.append(rank)
                continue
            if rank in self._links and now - link.answered_at >= self.interval_s:
                try:
                    link.sock.send(b"p")
                    link.sent_at = now
                except BlockingIOError:  # a full send buffer: the ping before is still out
                    pass
                except OSError:
                    self._drop(rank)
        return sorted(silent)

    def _read(self, rank: int, link: _Link, now: float) -> bool:
        """True if the outstanding ping was answered (or the link is gone)."""
        try:
            data = link.sock.recv(64)
        except BlockingIOError:
            return False
        except OSError:
            data = b""
        if not data:  # closed: the process died, which Ray reports
            self._drop(rank)
            return True
        link.sent_at, link.answered_at = None, now
        return True

    def _drop(self, rank: int) -> None:
        link = self._links.pop(rank, None)
        if link is not None:
            with contextlib.suppress(OSError):
                link.sock.close()

    def close(self) -> None:
        """Close every heartbeat link."""
        for rank in list(self._links):
            self._drop(rank)

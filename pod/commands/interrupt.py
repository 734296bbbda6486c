"""``InterruptGuard``: SIGINT / SIGTERM deferred to the next step boundary, so a
run stops between steps with a consistent state it can checkpoint; a step that
does not end within ``STOP_GRACE_S`` of the signal is abandoned instead."""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

from pod.errors import RunInterrupted

__all__ = ["InterruptGuard", "RaiseOnSignals", "STOP_GRACE_S"]

#: Wall seconds a run waits, after SIGINT / SIGTERM, for the work in progress (a step,
#: the final checkpoint) before it abandons it and stops: a signal is answered within
#: this bound whatever the chips do (the pod's waits poll it: ``overdue``).
STOP_GRACE_S = 1.0


class InterruptGuard:
    """Defer SIGINT and SIGTERM to step boundaries while a run trains.

    Inside the ``with`` block, the first SIGINT or SIGTERM only sets
    ``signum``; the training loop checks it between steps, checkpoints and
    stops. Work that does not reach a step boundary (a chip that stopped
    answering, a step that never ends) is abandoned once the signal is
    ``STOP_GRACE_S`` old: the pod's waits call ``overdue``. A second signal
    raises ``RunInterrupted`` at once (a user who presses Ctrl-C twice means
    it). Outside the main thread (where Python cannot install handlers) the
    guard does nothing.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._deadline = 0.0  # when the grace of the pending signal ends (monotonic)
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:  # noqa: ARG002 - signal API
        if self.signum is not None:
            raise RunInterrupted(signum, f"interrupted twice by {signal.Signals(signum).name}")
        self.signum, self._deadline = signum, time.monotonic() + STOP_GRACE_S

    def __enter__(self) -> InterruptGuard:
        self.arm()
        return self

    def arm(self) -> None:
        """Install the handlers (again): ``ray.init`` installs its own SIGTERM handler,
        so a run arms the guard once Ray is up. The handlers found are restored on exit."""
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous = signal.signal(sig, self._handle)
                self._previous.setdefault(sig, previous)

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def check(self) -> None:
        """Raise ``RunInterrupted`` if a signal arrived (call between steps)."""
        if self.signum is not None:
            raise RunInterrupted(self.signum)

    def overdue(self) -> None:
        """Raise ``RunInterrupted`` if a signal's grace is over (``STOP_GRACE_S`` after
        it came, unless ``renew``-ed): call while waiting for work that may never
        end, such as a step's chips."""
        if self.signum is not None and time.monotonic() > self._deadline:
            raise RunInterrupted(self.signum)

    def renew(self, grace_s: float) -> None:
        """Give the pending signal a grace of ``grace_s`` wall seconds from now: the
        run's final checkpoint, taken after the signal at a step boundary from chips
        that just answered, gets a grace of its own."""
        self._deadline = time.monotonic() + grace_s


class RaiseOnSignals:
    """SIGINT and SIGTERM raise ``RunInterrupted`` at once, inside the ``with`` block
    (a sweep: what is finished is on disk already, the point under way is dropped),
    so a SIGTERM ends in exit 143 with the CLI's line rather than a silent kill.
    The handlers found are restored on exit; outside the main thread it does
    nothing."""

    def __init__(self) -> None:
        self._previous: dict[int, Any] = {}

    @staticmethod
    def _raise(signum: int, frame: Any) -> None:  # noqa: ARG004 - signal API
        raise RunInterrupted(signum)

    def __enter__(self) -> RaiseOnSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._raise)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

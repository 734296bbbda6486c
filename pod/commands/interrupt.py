"""``InterruptGuard``: SIGINT / SIGTERM deferred to the next step boundary, so a
run stops between steps with a consistent state it can checkpoint."""

from __future__ import annotations

import signal
import threading
from typing import Any

from pod.errors import RunInterrupted

__all__ = ["InterruptGuard", "RaiseOnSignals"]


class InterruptGuard:
    """Defer SIGINT and SIGTERM to step boundaries while a run trains.

    Inside the ``with`` block, the first SIGINT or SIGTERM only sets
    ``signum``; the training loop checks it between steps, checkpoints and
    stops. A second signal raises ``RunInterrupted`` at once (a user who
    presses Ctrl-C twice means it). Outside the main thread (where Python
    cannot install handlers) the guard does nothing.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:  # noqa: ARG002 - signal API
        if self.signum is not None:
            raise RunInterrupted(signum, f"interrupted twice by {signal.Signals(signum).name}")
        self.signum = signum

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

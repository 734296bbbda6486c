"""``InterruptGuard``: a signal waits for the step boundary, but only for its grace
(``STOP_GRACE_S``) when the pod's waits ask (``overdue``); a second signal is at once.
The clock is moved by hand (``time.monotonic`` patched): no timed assertion."""

from __future__ import annotations

import os
import signal

import pytest

import pod.commands.interrupt as interrupt
from pod.commands.interrupt import STOP_GRACE_S, InterruptGuard
from pod.errors import RunInterrupted


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(interrupt.time, "monotonic", lambda: now[0])
    return now


def test_a_signal_is_overdue_only_after_its_grace_and_renew_starts_a_new_one(clock):
    with InterruptGuard() as guard:
        guard.overdue()  # no signal: nothing
        os.kill(os.getpid(), signal.SIGTERM)
        assert guard.signum == signal.SIGTERM
        with pytest.raises(RunInterrupted):
            guard.check()  # at a step boundary: at once
        clock[0] += STOP_GRACE_S * 0.9
        guard.overdue()  # within the grace: the step may still end
        clock[0] += STOP_GRACE_S * 0.2
        with pytest.raises(RunInterrupted) as err:
            guard.overdue()
        assert err.value.exit_code == 143
        guard.renew(10.0)  # the final checkpoint's own grace
        clock[0] += 9.0
        guard.overdue()
        clock[0] += 2.0
        with pytest.raises(RunInterrupted):
            guard.overdue()


def test_a_second_signal_raises_at_once(clock):
    with InterruptGuard():
        os.kill(os.getpid(), signal.SIGINT)
        with pytest.raises(RunInterrupted, match="interrupted twice by SIGINT"):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

"""The driver's heartbeat (issue 34, item 0): a chip whose process no longer runs is told
from one that is busy. No Ray: a real ``IciPort`` in this process answers pings from its
reader thread, a port that accepts and never answers stands for a stopped process (the
kernel still accepts its connections), and the clock is given to ``poll`` so no
assertion depends on timing."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from pod.runtime.heartbeat import Heartbeat
from pod.runtime.ici import IciPort

KEY = b"pod-key"


@pytest.fixture
def port():
    p = IciPort(0, KEY)
    yield p
    p.close()


@pytest.fixture
def stopped_process():
    """A listening port nobody reads from: what a SIGSTOPped actor's port looks like."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    yield ("127.0.0.1", server.getsockname()[1])
    server.close()


def _answered(beat: Heartbeat, rank: int) -> bool:
    """Poll (real time) until ``rank``'s ping is answered; False after 10 s."""
    give_up = time.monotonic() + 10
    while time.monotonic() < give_up:
        beat.poll()
        link = beat._links[rank]
        if link.sent_at is None and link.answered_at > 0:
            return True
        time.sleep(0.01)
    return False


def test_a_running_port_answers_and_is_never_declared_silent(port):
    beat = Heartbeat({3: port.address}, KEY, timeout_s=5.0, interval_s=0.01)
    try:
        assert beat.poll() == []  # the first ping goes out
        assert _answered(beat, 3)
        later = time.monotonic() + 1000  # long after: the answer came, a new ping goes out
        assert beat.poll(now=later) == []
        assert _answered(beat, 3)
    finally:
        beat.close()


def test_a_process_that_does_not_run_is_declared_silent_after_the_timeout(stopped_process):
    beat = Heartbeat({0: stopped_process, 2: stopped_process}, KEY, timeout_s=5.0)
    try:
        t0 = time.monotonic()
        assert beat.poll(now=t0) == []  # pings sent
        assert beat.poll(now=t0 + 4.9) == []  # within the timeout
        assert beat.poll(now=t0 + 5.1) == [0, 2]
    finally:
        beat.close()


def test_a_wrong_key_is_refused_by_the_port_and_a_closed_port_is_not_silent(port):
    beat = Heartbeat({1: port.address}, b"another pod", timeout_s=5.0)
    try:
        t0 = time.monotonic()
        beat.poll(now=t0)
        give_up = time.monotonic() + 10
        while 1 in beat._links and time.monotonic() < give_up:  # the port closes the link
            beat.poll(now=t0 + 1)
            time.sleep(0.01)
        assert 1 not in beat._links  # dropped: a closed link is Ray's to report, not silent
        assert beat.poll(now=t0 + 100) == []
        assert any("wrong link key" in r for r in port.dropped_reasons)
    finally:
        beat.close()


def test_a_port_that_cannot_be_reached_is_unwatched():
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    address = ("127.0.0.1", free.getsockname()[1])
    free.close()  # nothing listens there now
    beat = Heartbeat({5: address}, KEY)
    assert beat.unwatched == [5] and beat.poll() == []


def test_pings_do_not_disturb_the_ports_collectives(port):
    """A heartbeat link is not a chip: it never counts as a lost sender, and a run on the
    port still completes while pings come and go."""
    import numpy as np

    other = IciPort(1, KEY)
    beat = Heartbeat({0: port.address, 1: other.address}, KEY, interval_s=0.001)
    stop = threading.Event()

    def ping() -> None:
        while not stop.is_set():
            assert beat.poll() == []
            time.sleep(0.001)

    pinger = threading.Thread(target=ping)
    pinger.start()
    try:
        a, b = np.arange(4, dtype=np.float32), np.ones(4, dtype=np.float32)
        plan0 = [(0, [(1, 0, 0)], [(1, 0, 0, True)])]
        plan1 = [(0, [(0, 0, 0)], [(0, 0, 0, True)])]
        addresses = {0: port.address, 1: other.address}
        t = threading.Thread(target=other.run, args=(7, plan1, addresses, b, ((0, 4),)))
        t.start()
        port.run(7, plan0, addresses, a, ((0, 4),))
        t.join()
        np.testing.assert_array_equal(a, np.arange(4) + 1)
        np.testing.assert_array_equal(b, np.arange(4) + 1)
    finally:
        stop.set()
        pinger.join()
        beat.close()
        other.close()


def test_timeouts_must_be_positive():
    with pytest.raises(ValueError, match="must be positive"):
        Heartbeat({}, KEY, timeout_s=0)

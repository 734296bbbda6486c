"""The ICI receiver trusts nothing it can check (``pod.runtime.ici``), in-process:
``IciPort``s and raw sockets, no Ray."""

from __future__ import annotations

import socket
import struct
import threading
import time

import numpy as np
import pytest

from interconnect import ALGORITHMS, Torus, build_collective, execute
from pod.errors import IciError
from pod.runtime.ici import IciPort
from tests.pod.runtime.ici_threads import run_all

#: the wire header (run id, phase, sender rank, sequence, payload bytes)
HEADER = struct.Struct("<QIIIQ")
#: one phase 0 in which chip 0 receives chunk seq 0 (into chunk 0) from chip 1 and reduces it
PLAN_ONE = [(0, [], [(1, 0, 0, True)])]
BOUNDS_ONE = ((0, 4),)


@pytest.fixture
def ports():
    """Make ports (``make(rank, **kwargs)``); close them all afterwards."""
    made = []

    def make(rank, *args, **kwargs):
        made.append(IciPort(rank, *args, **kwargs))
        return made[-1]

    yield make
    for port in made:
        port.close()


def _send_raw(sender: IciPort, receiver: IciPort, *messages: bytes) -> socket.socket:
    """Send raw bytes to ``receiver`` on ``sender``'s authenticated link (hello done).

    A receiver that finds a violation in the first bytes drops the link at once, so
    the rest of a message may meet a reset connection: that is the behaviour under
    test, not a failure of the sender (what the receiver did is asserted by the test).
    """
    sock = sender._link(receiver.address)
    try:
        for message in messages:
            sock.sendall(message)
    except (ConnectionResetError, BrokenPipeError):
        pass
    return sock


def _run_expecting_error(port: IciPort, buffer: np.ndarray, plan=PLAN_ONE, bounds=BOUNDS_ONE,
                         run_id: int = 9) -> IciError:
    started = time.monotonic()
    with pytest.raises(IciError) as info:
        port.run(run_id, plan, {}, buffer, bounds, timeout=20)
    assert time.monotonic() - started < 10, "the violation was noticed only at the timeout"
    return info.value


@pytest.mark.parametrize("sent_bytes", [0, 8])
def test_a_link_closed_mid_chunk_fails_the_run_and_leaves_the_chunk_unapplied(ports, sent_bytes):
    receiver, sender = ports(2), ports(1)
    # chunk 0 arrives whole; chunk 1's payload is cut after ``sent_bytes`` of 16
    plan = [(3, [], [(1, 0, 0, True), (1, 1, 1, True)])]
    bounds = ((0, 4), (4, 8))
    whole = np.arange(4, dtype=np.float32).tobytes()
    sock = _send_raw(sender, receiver, HEADER.pack(9, 3, 1, 0, 16), whole,
                     HEADER.pack(9, 3, 1, 1, 16), b"\x01" * sent_bytes)
    sock.close()
    buffer = np.full(8, 7.0, np.float32)
    error = _run_expecting_error(receiver, buffer, plan, bounds)
    assert str(error) == (f"chip 2: phase 3: the link from chip 1 closed mid-chunk "
                          f"(got {sent_bytes} of 16 bytes)")
    np.testing.assert_array_equal(buffer[4:], np.full(4, 7.0, np.float32))


def test_a_short_chunk_is_rejected_not_broadcast(ports):
    receiver, sender = ports(0), ports(1)
    _send_raw(sender, receiver, HEADER.pack(9, 0, 1, 0, 4), np.ones(1, np.float32).tobytes())
    buffer = np.zeros(4, np.float32)
    error = _run_expecting_error(receiver, buffer)
    assert str(error) == ("chip 0: phase 0: the chunk from chip 1 declares 4 bytes, "
                          "the plan expects 16")
    np.testing.assert_array_equal(buffer, np.zeros(4, np.float32))


def test_a_length_that_is_not_whole_float32_is_rejected(ports):
    receiver, sender = ports(0), ports(1)
    _send_raw(sender, receiver, HEADER.pack(9, 0, 1, 0, 6), b"\x00" * 6,
              HEADER.pack(9, 0, 1, 0, 16), np.ones(4, np.float32).tobytes())
    error = _run_expecting_error(receiver, np.zeros(4, np.float32))
    assert "declares 6 bytes, not a whole number of float32" in str(error)
    assert str(error).startswith("chip 0: phase 0: ")


def test_the_sender_is_the_hellos_rank_not_the_headers(ports):
    receiver, impostor = ports(0), ports(1)
    # the link says chip 1; its header claims chip 2, whose chunk the plan expects
    plan = [(0, [], [(2, 0, 0, False)])]
    _send_raw(impostor, receiver, HEADER.pack(9, 0, 2, 0, 16), np.ones(4, np.float32).tobytes())
    buffer = np.zeros(4, np.float32)
    error = _run_expecting_error(receiver, buffer, plan)
    assert str(error) == "chip 0: phase 0: a header from the link of chip 1 names chip 2 as its sender"
    np.testing.assert_array_equal(buffer, np.zeros(4, np.float32))
    assert any("names chip 2 as its sender" in r for r in receiver.dropped_reasons)


def test_an_unexpected_chunk_is_rejected_and_the_mailbox_stays_bounded(ports):
    receiver, sender = ports(0), ports(1)
    chunk = np.ones(4, np.float32).tobytes()
    # chunks of a run that is not this chip's are not read (the sender waits) ...
    stale = [HEADER.pack(5, 0, 1, seq, 16) + chunk for seq in range(50)]
    _send_raw(sender, receiver, *stale)
    time.sleep(0.3)
    assert len(receiver._mailbox) == 0
    # ... then, once this chip runs another one, discarded; the link still delivers
    _send_raw(sender, receiver, HEADER.pack(6, 0, 1, 0, 16), chunk)
    buffer = np.zeros(4, np.float32)
    receiver.run(6, PLAN_ONE, {}, buffer, BOUNDS_ONE, timeout=20)
    np.testing.assert_array_equal(buffer, np.ones(4, np.float32))
    assert any("which is over" in r for r in receiver.dropped_reasons)
    # a chunk of the current run that its plan does not expect is a violation
    flood = [HEADER.pack(9, 0, 1, seq, 16) + chunk for seq in range(1, 200)]
    try:
        _send_raw(sender, receiver, *flood)
    except OSError:  # the receiver may drop the link while the flood is still going out
        pass
    error = _run_expecting_error(receiver, np.zeros(4, np.float32))
    assert str(error) == ("chip 0: phase 0: chip 1 sent chunk 1 of phase 0, which this chip's "
                          "plan does not expect (or already received)")
    assert len(receiver._mailbox) == 0


def test_the_mailbox_is_bounded_in_chunks_and_bytes(ports):
    from pod.runtime.ici import IciLimits

    chunk = np.ones(4, np.float32).tobytes()
    # the run waits on chip 2's chunk while chip 1's two chunks come in: one fits
    plan = [(0, [], [(2, 0, 0, True), (1, 0, 1, True), (1, 1, 2, True)])]
    bounds = ((0, 4), (4, 8), (8, 12))
    for limits, full in [(IciLimits(max_mailbox_chunks=1), "1 of 1 chunks, 16 of 2,147,483,648"),
                         (IciLimits(max_mailbox_bytes=20), "1 of 4096 chunks, 16 of 20")]:
        receiver, sender = ports(0, limits=limits), ports(1)
        _send_raw(sender, receiver, HEADER.pack(9, 0, 1, 0, 16), chunk,
                  HEADER.pack(9, 0, 1, 1, 16), chunk)
        error = _run_expecting_error(receiver, np.zeros(12, np.float32), plan, bounds)
        assert str(error) == (f"chip 0: phase 0: no room in the mailbox for the chunk from chip 1 "
                              f"(16 bytes): it holds {full} bytes")
        assert len(receiver._mailbox) == 0


def test_a_huge_declared_payload_is_rejected_before_any_allocation(ports):
    receiver, sender, honest = ports(0), ports(1), ports(2)
    sizes = []
    real_buffer = receiver._buffer

    def spy(count):
        sizes.append(count)
        return real_buffer(count)

    receiver._buffer = spy
    _send_raw(sender, receiver, HEADER.pack(9, 0, 1, 0, 2**40))
    error = _run_expecting_error(receiver, np.zeros(4, np.float32))
    assert str(error) == ("chip 0: phase 0: the chunk from chip 1 declares 1,099,511,627,776 "
                          "bytes, more than the 1,073,741,824-byte cap on a chunk")
    assert all(count <= 4 for count in sizes), sizes
    # the port still serves its other links
    plan = [(0, [], [(2, 0, 0, True)])]
    _send_raw(honest, receiver, HEADER.pack(10, 0, 2, 0, 16), np.ones(4, np.float32).tobytes())
    buffer = np.zeros(4, np.float32)
    receiver.run(10, plan, {}, buffer, BOUNDS_ONE, timeout=20)
    np.testing.assert_array_equal(buffer, np.ones(4, np.float32))


def _ici_threads() -> int:
    return sum(t.name.startswith("ici-") for t in threading.enumerate())


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


@pytest.mark.slow  # several seconds: the slow tier (make test stays under 3 minutes)
def test_connections_without_a_hello_hold_few_threads(ports):
    before = _ici_threads()
    receiver = ports(0)
    silent = [socket.create_connection(receiver.address, timeout=5) for _ in range(200)]
    try:
        time.sleep(0.5)
        pending = receiver.limits.max_pending_handshakes
        assert _ici_threads() - before <= pending + 1  # + the accept thread
        # the ones beyond the cap are closed at once
        assert sum(_closed_within(s, 0.02) for s in silent) >= 200 - pending
    finally:
        for sock in silent:
            sock.close()


def test_a_connection_that_sends_no_hello_is_closed_after_the_handshake_timeout(ports):
    from pod.runtime.ici import IciLimits

    receiver = ports(0, limits=IciLimits(handshake_timeout_s=0.5, max_pending_handshakes=8))
    silent = [socket.create_connection(receiver.address, timeout=5) for _ in range(8)]
    started = time.monotonic()
    assert all(_closed_within(s, 5.0) for s in silent)
    assert 0.4 < time.monotonic() - started < 4.0
    assert sum("sent no hello within 0.5 s" in r for r in receiver.dropped_reasons) == 8
    for sock in silent:
        sock.close()
    # the slots are free again: a chip still gets through
    sender = ports(1)
    _send_raw(sender, receiver, HEADER.pack(9, 0, 1, 0, 16), np.ones(4, np.float32).tobytes())
    buffer = np.zeros(4, np.float32)
    receiver.run(9, PLAN_ONE, {}, buffer, BOUNDS_ONE, timeout=20)
    np.testing.assert_array_equal(buffer, np.ones(4, np.float32))


def test_a_wrong_key_is_dropped_and_recorded(ports):
    receiver, stranger = ports(0, b"pod key"), ports(1, b"another key")
    try:
        _send_raw(stranger, receiver, HEADER.pack(9, 0, 1, 0, 16), np.ones(4, np.float32).tobytes())
    except OSError:  # the receiver may drop the connection before it finishes sending
        pass
    buffer = np.zeros(4, np.float32)
    with pytest.raises(IciError, match="chip 0: phase 0: no chunk from chip 1 within"):
        receiver.run(9, PLAN_ONE, {}, buffer, BOUNDS_ONE, timeout=1.0)
    np.testing.assert_array_equal(buffer, np.zeros(4, np.float32))
    assert receiver.dropped_reasons == ("closed a connection claiming chip 1: wrong link key",)


@pytest.mark.parametrize("algorithm", ALGORITHMS["allreduce"])
def test_three_ports_give_the_results_of_execute_bit_for_bit(ports, algorithm):
    schedule = build_collective("allreduce", Torus((3,), True), 1001, 4, algorithm)
    rng = np.random.default_rng(11)
    buffers = [rng.standard_normal(1001).astype(np.float32) for _ in range(3)]
    chips = [ports(r, b"pod key") for r in range(3)]
    work = run_all(chips, schedule, buffers, [4])
    for got, ref in zip(work, execute(schedule, buffers)):
        np.testing.assert_array_equal(got, ref)
    assert all(not p.dropped_reasons and not p._mailbox for p in chips)


def test_limits_are_checked():
    from pod.runtime.ici import IciLimits

    with pytest.raises(ValueError, match="IciLimits.max_chunk_bytes must be positive, got 0"):
        IciLimits(max_chunk_bytes=0)

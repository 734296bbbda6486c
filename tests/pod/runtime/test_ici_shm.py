"""Chunks through shared memory between ports of one machine (``pod.runtime.ici_shm``),
in-process: the same bits as TCP and as ``interconnect.execute``, the ring's room
reused and never overwritten while a chunk waits, nothing left in /dev/shm, and a
bad reference refused like any protocol violation."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from interconnect import ALGORITHMS, Torus, build_collective, execute
from pod.errors import IciError
from pod.runtime.ici import IciPort
from pod.runtime.ici_shm import (
    MIN_SHM_BYTES,
    SEGMENT_DIR,
    SEGMENT_PREFIX,
    SHM_FLAG,
    SHM_REF,
    ShmReceiver,
    ShmSender,
)
from tests.pod.runtime.ici_threads import run_all

HEADER = struct.Struct("<QIIIQ")


def segments() -> set[str]:
    return {n for n in os.listdir(SEGMENT_DIR) if n.startswith(SEGMENT_PREFIX)}


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS["allreduce"]))
def test_shared_memory_allreduces_are_tcps_and_executes_bits(algorithm):
    """Four ports on a ring of 4, chunks of 64 KiB (above ``MIN_SHM_BYTES``), three runs
    back to back (the ring's room freed and reused): bit-identical to the same runs
    over TCP and to ``execute`` applied three times; no segment left in /dev/shm."""
    before = segments()
    count = 4 * (MIN_SHM_BYTES // 4) * 2
    schedule = build_collective("allreduce", Torus((4,), True), count, 4, algorithm)
    rng = np.random.default_rng(3)
    buffers = [rng.standard_normal(count).astype(np.float32) for _ in range(4)]
    want = buffers
    for _ in range(3):
        want = execute(schedule, want)
    results = {}
    for shared in (True, False):
        ports = [IciPort(r, b"k", shared_memory=shared) for r in range(4)]
        try:
            results[shared] = run_all(ports, schedule, buffers, run_ids=[11, 12, 13])
            made = [s for p in ports for s in p._shm_out.values()]
            assert all(s is not None for s in made)
            assert bool(made) == shared  # shared memory used exactly when asked for
        finally:
            for p in ports:
                p.close()
    for got, tcp, ref in zip(results[True], results[False], want, strict=True):
        assert got.tobytes() == tcp.tobytes() == ref.tobytes()
    assert segments() == before


def test_a_full_ring_sends_inline_and_never_overwrites_a_waiting_chunk():
    """A sender whose ring holds unreleased chunks sends the next inline (no wait); the
    receiver's read position frees room only over chunks released in sending order."""
    before = segments()
    sender = ShmSender(MIN_SHM_BYTES)
    receiver = ShmReceiver(sender.name)
    assert sender.name not in segments()  # unlinked once mapped by both ends
    try:
        half = sender.capacity // 2
        a = np.full(half // 4, 1.0, np.float32)
        b = np.full(half // 4, 2.0, np.float32)
        ref_a = sender.place(memoryview(a).cast("B"))
        ref_b = sender.place(memoryview(b).cast("B"))
        assert ref_a is not None and ref_b is not None
        assert sender.place(memoryview(a[:8]).cast("B")) is None  # full: inline
        view_a = receiver.view(SHM_REF.unpack(ref_a)[0], half)
        view_b = receiver.view(SHM_REF.unpack(ref_b)[0], half)
        receiver.release(2 * half)  # b first: a still waits, so no room yet
        assert sender.place(memoryview(a[:8]).cast("B")) is None
        assert np.all(view_a == 1.0) and np.all(view_b == 2.0)
        receiver.release(half)  # now both
        c = np.full(8, 3.0, np.float32)
        ref_c = sender.place(memoryview(c).cast("B"))
        assert ref_c is not None and SHM_REF.unpack(ref_c)[0] == 2 * half  # the next lap
        assert np.array_equal(receiver.view(2 * half, 32), c)
        with pytest.raises(ValueError, match="does not follow"):
            receiver.view(0, 32)  # behind the link's last chunk
        assert sender.place(memoryview(np.zeros(half // 4 + 1, np.float32)).cast("B")) is None
    finally:
        del view_a, view_b
        sender.close()
        receiver.close()
    assert segments() == before


@pytest.mark.parametrize("name, match", [
    (b"../../etc/passwd".ljust(44, b"x"), "not a link segment"),
    ((SEGMENT_PREFIX + "0" * 32).encode(), "No such file"),
])
def test_a_bad_segment_reference_fails_the_run_naming_the_sender(name, match):
    receiver, sender = IciPort(0, b"k"), IciPort(1, b"k")
    try:
        sock = sender._link(receiver.address)
        sock.sendall(HEADER.pack(9, 0, 1, 0, (1 << 16) | SHM_FLAG) + SHM_REF.pack(0, name))
        with pytest.raises(IciError, match=f"shared-memory chunk from chip 1: .*{match}"):
            receiver.run(9, [(0, [], [(1, 0, 0, True)])], {}, np.zeros(1 << 14, np.float32),
                         ((0, 1 << 14),), timeout=20)
    finally:
        receiver.close()
        sender.close()


def test_links_past_a_ports_budget_stay_on_tcp_with_the_same_bits(monkeypatch):
    """Each port's rings are bounded (``PORT_BUDGET_BYTES``): with room for one 1 MiB ring,
    a bidirectional ring's second link per port goes over TCP, and the result is still
    ``execute``'s."""
    import pod.runtime.ici as ici

    monkeypatch.setattr(ici, "PORT_BUDGET_BYTES", 1 << 20)
    count = 4 * (MIN_SHM_BYTES // 4) * 2
    schedule = build_collective("allreduce", Torus((4,), True), count, 4, "bidirectional_ring")
    rng = np.random.default_rng(4)
    buffers = [rng.standard_normal(count).astype(np.float32) for _ in range(4)]
    ports = [IciPort(r, b"k") for r in range(4)]
    try:
        got = run_all(ports, schedule, buffers, run_ids=[1])
        links = [sorted(s is not None for s in p._shm_out.values()) for p in ports]
    finally:
        for p in ports:
            p.close()
    assert links == [[False, True]] * 4
    for g, ref in zip(got, execute(schedule, buffers), strict=True):
        assert g.tobytes() == ref.tobytes()

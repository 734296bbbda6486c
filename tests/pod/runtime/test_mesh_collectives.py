"""Sub-group collectives over IciPorts (``pod.runtime.mesh_collectives``), in-process:
one thread per device runs a toy SPMD program; numpy per group is the reference."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest

from interconnect import Torus
from pod.config.mesh import layout_mesh
from pod.config.sharding import device_groups
from pod.runtime.ici import IciPort
from pod.runtime.mesh_collectives import GroupTransport

AXES = {"data": 2, "fsdp": 2, "tensor": 2}



def run_on_threads(run, n: int, ports) -> None:
    """``run(device)`` for devices 0..n-1, each on its own thread (60 s each at most),
    then every port closed."""
    threads = [threading.Thread(target=run, args=(d,)) for d in range(n)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        for p in ports:
            p.close()

def _program(comm: GroupTransport, x: np.ndarray, jitter: random.Random) -> list[np.ndarray]:
    """A toy SPMD program: collectives over every axis, in an order all devices share;
    random sleeps let some devices run several collectives ahead of others."""
    out = []
    for step, axis in enumerate(["tensor", "fsdp", "data", "fsdp", "tensor", "data"]):
        time.sleep(jitter.random() * 0.01)
        if step % 3 == 0:
            out.append(comm.allreduce(x + step, axis))
        elif step % 3 == 1:
            out.append(comm.reduce_scatter(x * (step + 1), axis))
        else:
            out.append(comm.all_gather(x[:3] - step, axis))
    return out


def _reference(mesh, inputs: dict[int, np.ndarray], device: int) -> list[np.ndarray]:
    """The same program from numpy sums over each group."""
    groups = device_groups(mesh, device)
    out = []
    for step, axis in enumerate(["tensor", "fsdp", "data", "fsdp", "tensor", "data"]):
        members = groups.ring[axis]  # shards and gathers in ring order (the contract)
        if step % 3 == 0:
            out.append(np.sum([inputs[d] + step for d in members], axis=0))
        elif step % 3 == 1:
            total = np.sum([inputs[d] * (step + 1) for d in members], axis=0)
            out.append(np.split(total, len(members))[groups.ring_index(axis)])
        else:
            out.append(np.concatenate([inputs[d][:3] - step for d in members]))
    return out


@pytest.mark.parametrize("shape", [(2, 2, 2), (2, 4)])
def test_a_toy_spmd_program_over_three_axes_matches_numpy(shape):
    mesh = layout_mesh(AXES, Torus(shape))
    n = mesh.size
    ports = [IciPort(d, b"key") for d in range(n)]
    addresses = {d: p.address for d, p in enumerate(ports)}
    rng = np.random.default_rng(5)
    # integer-valued floats: every summation order is exact
    inputs = {d: rng.integers(-20, 20, size=(8, 3)).astype(np.float32) for d in range(n)}
    results, errors = {}, []

    def run(device):
        try:
            for base in (1000, 2000):  # two steps on the same ports: ids keep increasing
                comm = GroupTransport(ports[device], device_groups(mesh, device), addresses, base)
                results[(base, device)] = _program(comm, inputs[device],
                                                   random.Random(device * 7 + base))
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    run_on_threads(run, n, ports)
    assert not errors, errors
    for base in (1000, 2000):
        for d in range(n):
            for got, want in zip(results[(base, d)], _reference(mesh, inputs, d)):
                np.testing.assert_array_equal(got, want)


def test_a_chunk_of_a_later_run_waits_and_of_an_earlier_run_is_dropped():
    import struct

    header = struct.Struct("<QIIIQ")
    receiver, sender = IciPort(0, b"k"), IciPort(1, b"k")
    try:
        plan = [(0, [], [(1, 0, 0, True)])]
        payload = np.ones(4, np.float32).tobytes()
        sock = sender._link(receiver.address)
        # run 6 (later) first on the link, then ... the receiver registers 5, then 6
        buf5, buf6 = np.zeros(4, np.float32), np.zeros(4, np.float32)
        done = threading.Event()

        def receive():
            receiver.run(5, plan, {}, buf5, ((0, 4),), timeout=10, sequenced=True)
            receiver.run(6, plan, {}, buf6, ((0, 4),), timeout=10, sequenced=True)
            done.set()

        t = threading.Thread(target=receive)
        t.start()
        sock.sendall(header.pack(5, 0, 1, 0, 16) + payload)
        sock.sendall(header.pack(6, 0, 1, 0, 16) + (2 * np.ones(4, np.float32)).tobytes())
        t.join(20)
        assert done.is_set()
        np.testing.assert_array_equal(buf5, np.ones(4))
        np.testing.assert_array_equal(buf6, 2 * np.ones(4))
        # a chunk of run 4 (over) is discarded, the link kept; run 7 still gets its chunk
        sock.sendall(header.pack(4, 0, 1, 0, 16) + payload)
        sock.sendall(header.pack(7, 0, 1, 0, 16) + payload)
        buf7 = np.zeros(4, np.float32)
        receiver.run(7, plan, {}, buf7, ((0, 4),), timeout=10, sequenced=True)
        np.testing.assert_array_equal(buf7, np.ones(4))
        assert any("run 4" in r for r in receiver.dropped_reasons)
        with pytest.raises(RuntimeError, match="sequenced run ids must increase"):
            receiver.run(7, plan, {}, buf7, ((0, 4),), timeout=1, sequenced=True)
    finally:
        receiver.close()
        sender.close()


def test_the_header_checks_still_hold_in_a_sequenced_run():
    import struct

    from pod.errors import IciError

    header = struct.Struct("<QIIIQ")
    receiver, sender = IciPort(0, b"k"), IciPort(1, b"k")
    try:
        sock = sender._link(receiver.address)
        sock.sendall(header.pack(3, 0, 1, 0, 8) + b"\0" * 8)  # the plan expects 16 bytes
        with pytest.raises(IciError, match="declares 8 bytes, the plan expects 16"):
            receiver.run(3, [(0, [], [(1, 0, 0, True)])], {}, np.zeros(4, np.float32),
                         ((0, 4),), timeout=10, sequenced=True)
    finally:
        receiver.close()
        sender.close()

"""All-to-all over the expert axis, device to device over IciPorts (the runtime's
transport, in-process threads), against the in-process LocalMesh and numpy."""

from __future__ import annotations


import numpy as np

from interconnect import Torus
from pod.config.mesh import layout_mesh
from pod.config.sharding import device_groups
from pod.programs.collectives import LocalMesh
from pod.runtime.ici import IciPort
from pod.runtime.mesh_collectives import GroupTransport, RuntimeCollectives
from tests.pod.runtime.test_mesh_collectives import run_on_threads

AXES = {"data": 2, "expert": 4}


def _inputs(n):
    rng = np.random.default_rng(3)
    return {d: rng.standard_normal(4 * 6).astype(np.float32) for d in range(n)}


def test_all_to_all_over_the_transport_equals_the_local_mesh_and_numpy():
    mesh = layout_mesh(AXES, Torus((2, 4)))
    n = mesh.size
    inputs = _inputs(n)
    ports = [IciPort(d, b"key") for d in range(n)]
    addresses = {d: p.address for d, p in enumerate(ports)}
    results, errors = {}, []

    def run(device):
        try:
            comm = RuntimeCollectives(GroupTransport(ports[device], device_groups(mesh, device),
                                                     addresses, 100))
            out = comm.all_to_all("expert", inputs[device], tag="moe dispatch", kind="activation",
                                  after_record=0, itemsize=2)
            back = comm.all_to_all("expert", out, tag="moe combine", kind="activation",
                                   after_record=0, itemsize=2)
            results[device] = (out, back, comm.calls)
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    run_on_threads(run, n, ports)
    assert not errors, errors
    local = LocalMesh.for_mesh(mesh)
    by_local = local.run(lambda comm: comm.all_to_all(
        "expert", inputs[int(mesh.devices[tuple(local.coords(comm.device)[a]
                                                 for a in mesh.axis_names)])],
        tag="t", kind="activation", after_record=0))
    for i, got in enumerate(by_local):
        device = int(mesh.devices[tuple(local.coords(i)[a] for a in mesh.axis_names)])
        np.testing.assert_array_equal(results[device][0], got)
    for device in range(n):
        groups = device_groups(mesh, device)
        ring, me = groups.ring["expert"], groups.ring_index("expert")
        want = np.concatenate([inputs[d][me * 6:(me + 1) * 6] for d in ring])
        out, back, calls = results[device]
        np.testing.assert_array_equal(out, want)
        np.testing.assert_array_equal(back, inputs[device])  # its own inverse
        assert [(c.axis, c.op, c.nbytes) for c in calls] == [("expert", "all_to_all", 48)] * 2

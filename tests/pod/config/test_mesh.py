"""The device mesh (pod/config/mesh.py): layout invariants over tori, messages.

Devices are mock ids (``chip rank * devices_per_chip + core``), as JAX's mesh
tests use mock TPU devices; no Ray.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from interconnect import Torus
from pod.config.mesh import (AxisBlock, build_mesh, device_hbm_bytes, devices_per_chip,
                             layout_mesh, parse_mesh_axes)
from pod.config.scenario import parse_scenario
from pod.config.slices import resolve_pod
from pod.errors import ScenarioError

GIB = 2**30


def _meshes(count: int) -> list[dict[str, int]]:
    """Every {data, fsdp, tensor} split of ``count`` devices."""
    return [{"data": count // (f * t), "fsdp": f, "tensor": t}
            for t in range(1, count + 1) for f in range(1, count // t + 1)
            if count % (f * t) == 0]


@st.composite
def tori_and_meshes(draw, sizes=(1, 2, 3, 4, 6, 8)):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.sampled_from(sizes)) for _ in range(ndim))
    assume(math.prod(shape) <= 64)
    wrap = tuple(draw(st.booleans()) for _ in range(ndim))
    per_chip = draw(st.sampled_from((1, 2)))
    axes = draw(st.sampled_from(_meshes(math.prod(shape) * per_chip)))
    return Torus(shape, wrap), per_chip, axes


def _check_step(mesh, info, a: int, b: int) -> None:
    """Consecutive devices of a group: on one chip, or 1..hops_per_step ICI hops apart."""
    (ra, ca), (rb, cb) = mesh.chip_and_core(a), mesh.chip_and_core(b)
    if ra == rb:
        assert ca != cb and mesh.devices_per_chip > 1, (a, b)
        return
    assert ca == cb, (a, b)
    hops = mesh.torus.hops(ra, rb)
    assert 1 <= hops <= info.hops_per_step, (a, b, hops, info)
    if all(block.stride == 1 for block in info.blocks):
        assert mesh.torus.has_link(ra, rb), (a, b)


def _check_invariants(mesh) -> None:
    count = mesh.torus.num_chips * mesh.devices_per_chip
    assert mesh.devices.shape == mesh.shape and math.prod(mesh.shape) == count
    assert sorted(mesh.devices.ravel().tolist()) == list(range(count))
    for name, info in zip(mesh.axis_names, mesh.axes):
        for order in ("ring", "mesh"):
            groups = mesh.groups(name, order)
            assert len(groups) == count // info.size
            assert all(len(g) == info.size for g in groups)
            assert sorted(d for g in groups for d in g) == list(range(count))
        assert [set(g) for g in mesh.groups(name, "ring")] == \
               [set(g) for g in mesh.groups(name, "mesh")]
        assert math.prod(block.size for block in info.blocks) == info.size
        for group in mesh.groups(name):
            for a, b in zip(group, group[1:]):
                _check_step(mesh, info, a, b)
            if info.closed:
                _check_step(mesh, info, group[-1], group[0])


@settings(max_examples=300, deadline=None)
@given(tori_and_meshes())
def test_every_valid_mesh_on_every_torus_keeps_the_invariants(case):
    torus, per_chip, axes = case
    mesh = layout_mesh(axes, torus, per_chip)  # every mesh of the right product lays out
    _check_invariants(mesh)


@settings(max_examples=200, deadline=None)
@given(tori_and_meshes(sizes=(1, 2, 4, 8)))
def test_power_of_two_tori_take_every_mesh(case):
    torus, per_chip, axes = case
    _check_invariants(layout_mesh(axes, torus, per_chip))


@settings(max_examples=200, deadline=None)
@given(tori_and_meshes())
def test_data_alone_is_todays_data_parallel_layout(case):
    torus, per_chip, _ = case
    count = torus.num_chips * per_chip
    mesh = layout_mesh({"data": count}, torus, per_chip)
    assert mesh.axis_names == ("data",) and mesh.shape == (count,)
    np.testing.assert_array_equal(mesh.devices, np.arange(count))
    assert mesh.groups("data", "mesh") == [tuple(range(count))]
    assert mesh.sizes == {"data": count}
    has_unit_axis = 1 in torus.shape
    if per_chip == 1 and not has_unit_axis and mesh.is_ring("data"):
        assert mesh.groups("data") == [tuple(torus.ring_order())]


def test_v2_cores_are_the_innermost_pair():
    mesh = build_mesh({"data": 4, "tensor": 2}, resolve_pod(slice_name="v2-8"))
    assert mesh.groups("tensor") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert mesh.torus_axes("tensor") == (AxisBlock(None, 2, 1, False),)
    assert mesh.axes[1].hops_per_step == 0
    assert mesh.groups("data", "mesh") == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert mesh.groups("data") == [(0, 2, 6, 4), (1, 3, 7, 5)]  # a ring of the 2x2 chips
    assert mesh.is_ring("data") and mesh.chip_and_core(5) == (2, 1)


def test_devices_per_generation():
    got = {name: devices_per_chip(resolve_pod(slice_name=s).chip)
           for name, s in [("v2", "v2-8"), ("v3", "v3-8"), ("v4", "v4-8"), ("v5p", "v5p-8"),
                           ("v5e", "v5e-4"), ("v6e", "v6e-4")]}
    assert got == {"v2": 2, "v3": 2, "v4": 1, "v5p": 1, "v5e": 1, "v6e": 1}
    v4 = resolve_pod(slice_name="v4-8").chip
    assert device_hbm_bytes(v4) == v4.hbm_available_bytes  # megacore: one device, the whole chip
    v2 = resolve_pod(slice_name="v2-8").chip
    assert device_hbm_bytes(v2) == v2.core.hbm_bytes


def test_tensor_takes_the_fastest_torus_axes_whole():
    mesh = build_mesh({"data": 2, "tensor": 8}, resolve_pod(slice_name="v4-32"))  # 2x2x4
    np.testing.assert_array_equal(mesh.devices, np.arange(16).reshape(2, 8))
    assert mesh.torus_axes("tensor") == (AxisBlock(1, 2, 1, False), AxisBlock(2, 4, 1, False))
    assert mesh.groups("tensor")[0] == (0, 1, 2, 3, 7, 6, 5, 4)  # a closed 2x4 ring
    assert mesh.is_ring("tensor") and mesh.torus_axes("data") == (AxisBlock(0, 2, 1, False),)


def test_a_split_axis_leaves_its_strided_part_outside():
    mesh = build_mesh({"data": -1, "fsdp": 2, "tensor": 2}, resolve_pod(slice_name="v5e-16"))
    assert mesh.sizes == {"data": 4, "fsdp": 2, "tensor": 2}
    assert mesh.torus_axes("tensor") == (AxisBlock(1, 2, 1, False),)
    assert mesh.torus_axes("fsdp") == (AxisBlock(0, 2, 1, False),)
    assert mesh.torus_axes("data") == (AxisBlock(0, 2, 2, False), AxisBlock(1, 2, 2, False))
    assert [a.hops_per_step for a in mesh.axes] == [2, 1, 1]
    assert mesh.groups("tensor")[:2] == [(0, 1), (4, 5)]


def test_a_ring_over_wraparound_is_closed_and_a_line_is_open():
    ring = layout_mesh({"data": 2, "tensor": 4}, Torus((2, 4), (False, True)))
    line = layout_mesh({"data": 2, "tensor": 4}, Torus((2, 4), (False, False)))
    assert ring.is_ring("tensor") and ring.torus_axes("tensor") == (AxisBlock(1, 4, 1, True),)
    assert not line.is_ring("tensor") and line.groups("tensor")[0] == (0, 1, 2, 3)


def test_the_mesh_is_an_immutable_value():
    pod = resolve_pod(slice_name="v2-8")
    mesh = build_mesh({"tensor": 2, "data": -1}, pod)
    assert mesh == build_mesh({"data": 4, "tensor": 2}, pod)
    assert hash(mesh) == hash(build_mesh({"data": 4, "tensor": 2}, pod))
    with pytest.raises(ValueError):
        mesh.devices[0, 0] = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        mesh.shape = (8,)
    with pytest.raises(ValueError, match="its axes: data, tensor"):
        mesh.groups("fsdp")


def test_groups_are_kept_and_given_as_a_fresh_list():
    """A mesh keeps its groups per (axis, order): the same as numpy's rows of its device
    array with the axis last (the ring order its ``MeshAxis.ring``), each call a list of
    its own (what a caller does to it changes no later call)."""
    mesh = build_mesh({"data": 2, "fsdp": 4, "tensor": 2}, resolve_pod(slice_name="v5e-16"))
    for index, name in enumerate(mesh.axis_names):
        rows = np.moveaxis(mesh.devices, index, -1).reshape(-1, mesh.axis_size(name))
        ring = list(mesh.axes[index].ring)
        assert mesh.groups(name, "mesh") == [tuple(map(int, r)) for r in rows]
        want = [tuple(map(int, r[ring])) for r in rows]
        first = mesh.groups(name)
        assert first == want
        first.clear()
        assert mesh.groups(name) == want
    with pytest.raises(ValueError, match="order 'diagonal' is unknown"):
        mesh.groups("data", "diagonal")


# ------------------------------------------------------------------ messages


@pytest.mark.parametrize("axes, message", [
    ({"data": 3, "tensor": 4}, "pod.mesh: {data: 3, tensor: 4} has 12 devices but the v4-32 "
     "slice has 16; sizes must multiply to 16 (e.g. {data: 4, tensor: 4}, {data: 2, fsdp: 2, "
     "tensor: 4})"),
    ({"data": -1, "tensor": 3}, "pod.mesh: {data: -1, tensor: 3}: the other axes take 3 devices, "
     "which does not divide the 16 devices of the v4-32 slice; sizes must multiply to 16 (e.g. "
     "{data: 4, tensor: 4}, {data: 8, tensor: 2})"),
])
def test_sizes_that_do_not_multiply_to_the_devices_name_valid_meshes(axes, message):
    with pytest.raises(ScenarioError) as err:
        build_mesh(axes, resolve_pod(slice_name="v4-32"))
    assert str(err.value) == message


def test_v2_counts_a_device_per_tensorcore_in_the_message():
    with pytest.raises(ScenarioError) as err:
        build_mesh({"data": 4}, resolve_pod(slice_name="v2-8"))
    assert str(err.value) == ("pod.mesh: {data: 4} has 4 devices but the v2-8 slice has 8 (a "
                              "device per TensorCore); sizes must multiply to 8 (e.g. {data: 8}, "
                              "{data: 4, fsdp: 2})")


def test_an_axis_may_take_blocks_of_several_torus_axes():
    # 9 on a 6x6 torus: a 3-chip block of each axis, a 3x3 sub-grid of neighbours
    mesh = build_mesh({"data": 4, "tensor": 9}, resolve_pod(chip="v5e", topology="6x6"))
    assert mesh.torus_axes("tensor") == (AxisBlock(0, 3, 1, False), AxisBlock(1, 3, 1, False))
    assert mesh.torus_axes("data") == (AxisBlock(0, 2, 3, False), AxisBlock(1, 2, 3, False))
    assert mesh.groups("tensor", "mesh")[0] == (0, 1, 2, 6, 7, 8, 12, 13, 14)
    assert not mesh.is_ring("tensor")  # 3x3 without wraparound: no cycle (odd and bipartite)


def _scenario_error(mesh) -> str:
    with pytest.raises(ScenarioError) as err:
        parse_scenario({"pod": {"slice": "v4-32", "mesh": mesh}, "model": {"name": "mlp"},
                        "training": {"global_batch": 64, "steps": 1}})
    return str(err.value)


@pytest.mark.parametrize("mesh, message", [
    ({"data": 2, "model": 8}, "{data: 2, model: 8}: unknown axis 'model'; allowed: data, stage, "
     "fsdp, fsdp_transpose, expert, tensor"),
    ({"data": -1, "tensor": -1}, "{data: -1, tensor: -1}: data and tensor are both -1; at most "
     "one axis takes the rest of the devices"),
    ({"data": 0}, "{data: 0}: data: 0 is not a size; give a size >= 1, or -1 for the rest of the "
     "devices (at most one axis)"),
    ({"tensor": -2}, "{tensor: -2}: tensor: -2 is not a size; give a size >= 1, or -1 for the "
     "rest of the devices (at most one axis)"),
    ({"tensor": 2.5}, "{tensor: 2.5}: tensor: 2.5 is not a whole number; give a size >= 1, or -1 "
     "for the rest of the devices"),
    ({"tensor": True}, "{tensor: True}: tensor: True is not a whole number; give a size >= 1, or "
     "-1 for the rest of the devices"),
    ({}, "{}: give at least one axis such as {data: 2, tensor: 4}; axes: data, stage, fsdp, "
     "fsdp_transpose, expert, tensor"),
    (16, "must be a mapping of axis name to size such as {data: 2, tensor: 4}; axes: data, stage, fsdp, "
     "fsdp_transpose, expert, tensor (got 16)"),
])
def test_a_malformed_mesh_is_one_line_naming_the_field(mesh, message):
    assert _scenario_error(mesh) == f"<scenario>: pod.mesh: {message}"


def test_axes_are_kept_in_mesh_order_whatever_the_order_written():
    assert list(parse_mesh_axes({"tensor": 4, "data": -1})) == ["data", "tensor"]

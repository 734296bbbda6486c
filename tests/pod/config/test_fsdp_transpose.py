"""MaxText's ``fsdp_transpose`` mesh axis (``ici_fsdp_transpose_parallelism``; training-steps.md
T7) runs as FSDP over the fsdp x fsdp_transpose block (pod.config.mesh.FOLDED_AXES says why
that is the same step): the same devices, collectives and costs as ``{fsdp: a b}``, and the
reports say which MaxText axes it came from."""

from __future__ import annotations

import numpy as np
import pytest

from pod.config.mesh import build_mesh, fold_axes, parse_mesh_axes
from pod.config.plan import build_plan
from pod.config.scenario import parse_scenario
from pod.config.slices import resolve_pod
from pod.errors import ScenarioError
from pod.runtime.timing import TimingPod


def test_the_axis_joins_fsdp_with_maxtexts_layout():
    """fsdp_transpose is inner to fsdp in MaxText's mesh: the block of both is the
    fsdp axis of their product, on the same devices and torus axes."""
    pod = resolve_pod(slice_name="v6e-256")
    whole = build_mesh({"fsdp": 256}, pod)
    for axes in ({"fsdp_transpose": -1}, {"fsdp": 16, "fsdp_transpose": 16},
                 {"fsdp": 4, "fsdp_transpose": -1}):
        mesh = build_mesh(axes, pod)
        assert mesh.sizes == {"fsdp": 256} and mesh == whole
        np.testing.assert_array_equal(mesh.devices, whole.devices)
        assert mesh.torus_axes("fsdp") == whole.torus_axes("fsdp")
        assert mesh.groups("fsdp") == whole.groups("fsdp")
    label = build_mesh({"fsdp_transpose": -1}, pod).label
    assert label == "{fsdp: 256} (fsdp_transpose 256 as fsdp)"
    assert whole.label == "{fsdp: 256}" and whole.folded == ()
    mixed = build_mesh({"data": 2, "fsdp_transpose": 8, "tensor": 16}, pod)
    assert mixed.sizes == {"data": 2, "fsdp": 8, "tensor": 16}
    assert mixed.folded == (("fsdp_transpose", 8),)
    assert fold_axes({"fsdp": 2, "fsdp_transpose": 4, "data": 3}) == (
        {"data": 3, "fsdp": 8}, {"fsdp_transpose": 4})


def test_parse_keeps_maxtexts_names_in_maxtexts_order():
    assert list(parse_mesh_axes({"tensor": 2, "fsdp_transpose": 4, "fsdp": 2})) == [
        "fsdp", "fsdp_transpose", "tensor"]
    with pytest.raises(ScenarioError, match=r"unknown axis 'sequence'; allowed: data, stage, "
                                            r"fsdp, fsdp_transpose, expert, tensor"):
        parse_mesh_axes({"sequence": 2})


def _scenario(mesh):
    return parse_scenario({
        "name": "t", "pod": {"chip": "v5e", "chips": 8, "mesh": mesh},
        "model": {"name": "transformer", "options": {"embed_dim": 256, "heads": 4,
                                                     "head_dim": 64, "mlp_dim": 1024,
                                                     "layers": 2}},
        "data": {"name": "synthetic_text", "options": {"vocabulary": 256,
                                                       "sequence_length": 128,
                                                       "num_examples": 40}},
        "training": {"global_batch": 16, "steps": 1}})


def test_a_step_on_fsdp_transpose_is_the_fsdp_step():
    """The plan, the memory and every simulated figure of a timing-only step are those
    of {fsdp: 8}."""
    plans = {k: build_plan(_scenario(m), timing_only=True)
             for k, m in (("fsdp", {"fsdp": 8}), ("transpose", {"fsdp_transpose": 8}),
                          ("both", {"fsdp": 2, "fsdp_transpose": 4}))}
    steps = {k: TimingPod(p).step(0) for k, p in plans.items()}
    for k in ("transpose", "both"):
        assert plans[k].memory == plans["fsdp"].memory
        assert plans[k].per_device_batch == plans["fsdp"].per_device_batch == 2
        assert steps[k].step_seconds == steps["fsdp"].step_seconds > 0
        assert steps[k].axis_collective_seconds == steps["fsdp"].axis_collective_seconds
    assert plans["both"].mesh.label == "{fsdp: 8} (fsdp_transpose 4 as fsdp)"

"""A new TPU generation is one chip preset (and its calibration rows): its slice names,
shapes and wraparound come from the preset alone (issue 31 item 3)."""

from __future__ import annotations

import dataclasses

import pytest

import chip.spec
from pod.config.slices import SLICE_SHAPES, resolve_pod
from pod.errors import ScenarioError


def test_the_slice_table_is_the_presets():
    assert SLICE_SHAPES == {name: dict(spec.slice_shapes)
                            for name, spec in chip.spec.PRESETS.items()}


def test_a_new_generation_is_one_preset(monkeypatch):
    """A made-up 'v9' (v5e's figures, slices of 8 and 64 chips, 8x8 at most, wrapping a
    full side): its slices resolve with their shapes and wraparound, an unknown count is
    refused with the valid names, and a custom shape wraps by the preset's rule."""
    v9 = dataclasses.replace(chip.spec.PRESETS["v5e"], name="v9", max_pod_shape=(8, 8),
                             slice_shapes=((8, (2, 4)), (64, (8, 8))),
                             wraparound_rule="full_side")
    monkeypatch.setitem(chip.spec.PRESETS, "v9", v9)
    pod = resolve_pod(slice_name="v9-64")
    assert pod.chip is v9 and pod.torus.shape == (8, 8)
    assert pod.torus.wraparound == (True, True)
    assert resolve_pod(slice_name="v9-8").torus.wraparound == (False, False)
    assert resolve_pod(chip="v9", topology="8x2").torus.wraparound == (True, False)
    with pytest.raises(ScenarioError, match="valid v9 slices: v9-8, v9-64"):
        resolve_pod(slice_name="v9-16")


def test_a_cube_built_slice_resolves_and_the_refusal_says_which_exist():
    """v4-384 (192 chips, three 4x4x4 cubes: issue 29 item 5) resolves to a 4x4x12 torus
    wrapping on every axis; a count that is not whole cubes is refused with the rule."""
    pod = resolve_pod(slice_name="v4-384")
    assert (pod.chips, pod.torus.shape, pod.torus.wraparound) == (192, (4, 4, 12),
                                                                (True, True, True))
    with pytest.raises(ScenarioError, match="v4-200.*any multiple of 128 up to 8192"):
        resolve_pod(slice_name="v4-200")

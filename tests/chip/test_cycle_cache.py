"""The TensorCore keeps MXU and VPU cycle counts by shape (every layer names its ops anew,
so the record cache, kept by name, misses them): the kept counts are the computed ones."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chip import MXU_MODELS, TensorCore, get_chip_spec
from chip.vector import vpu_cycles

SPEC = get_chip_spec("v5e").core


@given(st.integers(0, 5000), st.integers(0, 5000), st.integers(0, 5000), st.integers(1, 8),
       st.sampled_from(("bf16", "fp32", "int8")), st.sampled_from((None, *MXU_MODELS)),
       st.booleans())
@settings(max_examples=60, deadline=None)
def test_kept_mxu_cycles_are_the_computed_ones(m, k, n, batch, precision, model, buffered):
    core = TensorCore(SPEC, precision=precision, double_buffered=buffered)
    first = core.mxu_cycles(m, k, n, batch=batch, mxu_model=model)
    assert first == core._count_mxu_cycles(m, k, n, batch, model)
    assert core.mxu_cycles(m, k, n, batch=batch, mxu_model=model) == first  # kept


@given(st.integers(0, 10**9), st.sampled_from((0, 1, 2.5, 8.0)), st.booleans())
@settings(max_examples=60, deadline=None)
def test_kept_vpu_cycles_are_the_computed_ones(elements, ops, transcendental):
    core = TensorCore(SPEC)
    expected = vpu_cycles(elements, ops, transcendental, SPEC)
    assert core._vpu_cycles(elements, ops, transcendental) == expected
    assert core._vpu_cycles(elements, ops, transcendental) == expected


def test_a_bad_figure_is_refused_even_when_its_value_is_kept():
    """3.0 equals 3 (and hashes alike): only exact ints are kept and looked up, so a float
    dimension is checked (and refused) whatever was kept before."""
    core = TensorCore(SPEC)
    core.mxu_cycles(3, 4, 5)
    with pytest.raises(ValueError, match="m must be an integer"):
        core.mxu_cycles(3.0, 4, 5)
    with pytest.raises(ValueError, match="m must be an integer"):
        core.mxu_cycles(True, 4, 5)
    core._vpu_cycles(7, 1, False)
    with pytest.raises(ValueError, match="elements must be an integer"):
        core._vpu_cycles(7.0, 1, False)

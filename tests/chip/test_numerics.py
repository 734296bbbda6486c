"""Tests of chip.numerics: bf16 rounding and the MXU product against numpy."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from chip import numerics as chip_numerics
from chip import to_bf16
from chip.numerics import dequantize_int8, mxu_matmul, quantize_int8


def bf16_reference(x):
    """Round-to-nearest-even to bf16 on float32 bits (finite values), independent of ml_dtypes."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32)


def test_known_values():
    x = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-7, -2.5, 0.0, 1 + 2**-8 + 2**-20],
                 dtype=np.float32)
    # 1 + 2^-8 is a tie -> even (1); 1 + 3*2^-8 is a tie -> even (1 + 2^-6).
    expect = np.array([1.0, 1.0, 1 + 2**-6, 1 + 2**-7, -2.5, 0.0, 1 + 2**-7], dtype=np.float32)
    out = to_bf16(x)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, expect)


def test_matches_bit_reference_on_random_values():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(10_000) * 10.0 ** rng.integers(-30, 30, 10_000)).astype(np.float32)
    np.testing.assert_array_equal(to_bf16(x), bf16_reference(x))


def test_special_values():
    out = to_bf16(np.array([np.nan, np.inf, -np.inf, 3.4e38], dtype=np.float32))
    assert np.isnan(out[0]) and out[1] == np.inf and out[2] == -np.inf
    assert out[3] == np.inf  # above bf16's largest finite value (~3.39e38)


def test_shape_and_float64_input():
    x = np.linspace(-3, 3, 24).reshape(2, 3, 4)
    out = to_bf16(x)
    assert out.shape == x.shape and out.dtype == np.float32
    np.testing.assert_array_equal(out, bf16_reference(x.astype(np.float32)))


finite_f32 = hnp.arrays(np.float32, hnp.array_shapes(max_dims=2, max_side=16),
                        elements=st.floats(-2.0**100, 2.0**100, width=32))


@settings(max_examples=200, deadline=None)
@given(finite_f32)
def test_to_bf16_idempotent_and_close(x):
    once = to_bf16(x)
    np.testing.assert_array_equal(to_bf16(once), once)
    # bf16 keeps 8 significant bits: unit roundoff 2^-8 (normal numbers).
    normal = np.abs(x) > 1e-37
    assert np.all(np.abs(once[normal] - x[normal]) <= np.abs(x[normal]) * 2.0**-8)


def test_mxu_matmul_is_float32_product_of_rounded_inputs():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((33, 70)).astype(np.float32)
    b = rng.standard_normal((70, 19)).astype(np.float32)
    out = mxu_matmul(a, b)
    assert out.dtype == np.float32 and out.shape == (33, 19)
    ref = bf16_reference(a) @ bf16_reference(b)
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-5)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    rel = np.linalg.norm(out - exact) / np.linalg.norm(exact)
    assert 0 < rel < 1e-2


def test_mxu_matmul_skips_rounding_when_flagged():
    a = np.full((2, 2), 1 + 2**-10, dtype=np.float32)  # not a bf16 value
    b = np.eye(2, dtype=np.float32)
    np.testing.assert_array_equal(mxu_matmul(a, b), np.ones((2, 2), np.float32))
    np.testing.assert_array_equal(mxu_matmul(a, b, a_rounded=True), a)


def test_int8_round_trip():
    rng = np.random.default_rng(2)
    x = rng.standard_normal(1000).astype(np.float32)
    q, scale = quantize_int8(x)
    assert q.dtype == np.int8 and np.max(np.abs(q)) == 127
    assert scale == pytest.approx(np.max(np.abs(x)) / 127)
    assert np.max(np.abs(dequantize_int8(q, scale) - x)) <= scale / 2 + 1e-7
    q0, s0 = quantize_int8(np.zeros(3))
    assert s0 == 1.0 and not q0.any()


def test_to_bf16_keeps_a_zero_stride_view_a_view_with_the_rounded_value():
    """A timing-only stand-in (every stride 0) is rounded as its one value and stays a
    view taking no memory; the values equal rounding the dense array."""
    from chip.numerics import to_bf16

    view = np.broadcast_to(np.float32(1.0 + 2.0**-10), (4096, 4096))
    rounded = to_bf16(view)
    assert rounded.shape == view.shape and not any(rounded.strides)
    np.testing.assert_array_equal(rounded[:3, :3], to_bf16(np.array(view[:3, :3])))
    assert float(rounded[0, 0]) == 1.0  # bf16 keeps 7 mantissa bits


# -- the integer rounding of large float32 arrays against ml_dtypes' cast ---------------

def _ml_dtypes_bits(x: np.ndarray) -> np.ndarray:
    """The bits ml_dtypes' bfloat16 cast gives (the reference the fast path must match)."""
    import ml_dtypes

    return x.astype(ml_dtypes.bfloat16).astype(np.float32).view(np.uint32)


# bit patterns where rounding is delicate: zeros, subnormals (the smallest, the largest,
# a tie), the smallest normal, ties to even up and down, the carry into the next binade
# and past the largest bf16 (to infinity), the largest float32, infinities and NaNs
# (quiet, signalling, with payloads in the low half only), each with either sign
_SPECIAL_BITS = [0x00000000, 0x00000001, 0x00008000, 0x00018000, 0x007FFFFF, 0x00800000,
                 0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0x3FFF8000, 0x3FFFFFFF,
                 0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0x7F800000, 0x7F800001, 0x7F807FFF,
                 0x7F808000, 0x7FBFFFFF, 0x7FC00000, 0x7FFF8000, 0x7FFFFFFF]
_SPECIAL_BITS += [b | 0x80000000 for b in _SPECIAL_BITS]

bit_patterns = st.lists(st.one_of(st.sampled_from(_SPECIAL_BITS), st.integers(0, 2**32 - 1)),
                        min_size=1, max_size=64)


@settings(max_examples=80, deadline=None)
@given(bit_patterns, st.booleans())
@np.errstate(invalid="ignore")  # ml_dtypes' cast of a NaN
def test_large_array_rounding_matches_ml_dtypes_bits(patterns, with_nan):
    bits = np.array(patterns, dtype=np.uint32)
    if not with_nan:  # a NaN sends the whole array to the cast: test the bits path too
        x = bits.view(np.float32)
        bits = bits[~np.isnan(x)] if (~np.isnan(x)).any() else np.array([0x3F808000], np.uint32)
    # tiled past the size where to_bf16 takes the integer path, and strided
    reps = -(-2 * chip_numerics.BITS_ROUNDING_MIN_ELEMENTS // bits.size)
    x = np.tile(bits, reps).view(np.float32)
    assert x.size >= chip_numerics.BITS_ROUNDING_MIN_ELEMENTS
    for arr in (x, x[::2]):
        np.testing.assert_array_equal(to_bf16(arr).view(np.uint32), _ml_dtypes_bits(arr))
    direct = chip_numerics.round_bf16_bits(x)
    if np.isnan(x).any():
        assert direct is None
    else:
        np.testing.assert_array_equal(direct.view(np.uint32), _ml_dtypes_bits(x))


@np.errstate(invalid="ignore")
def test_large_array_rounding_every_special_value():
    x = np.tile(np.array(_SPECIAL_BITS, np.uint32), 1000).view(np.float32)
    finite_or_inf = x[~np.isnan(x)]
    assert finite_or_inf.size >= chip_numerics.BITS_ROUNDING_MIN_ELEMENTS
    np.testing.assert_array_equal(to_bf16(finite_or_inf).view(np.uint32),
                                  _ml_dtypes_bits(finite_or_inf))
    np.testing.assert_array_equal(to_bf16(x).view(np.uint32), _ml_dtypes_bits(x))

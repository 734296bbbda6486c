"""MXU numerics: bfloat16 rounding, the bf16 x bf16 -> fp32 product, int8 quantisation.

The MXU multiplies bfloat16 operands and accumulates in float32. We emulate it
by rounding the float32 inputs to bfloat16 values (round to nearest even:
ml_dtypes' cast, or its very bits from integer operations on large arrays),
keeping them in float32 storage, and multiplying in float32: every product of
two bf16 values is exact in float32, so only the accumulation order differs
from the hardware.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

_BF16 = ml_dtypes.bfloat16

#: float32 arrays of at least this many elements are rounded with integer operations
#: (`round_bf16_bits`); smaller ones by ml_dtypes' cast, which costs less per call
#: (1.4 against 6.5 us at 320 elements; 171 against 110 us at 131,072: min of 7
#: repeats of 300 on one core of the project's machine)
BITS_ROUNDING_MIN_ELEMENTS = 16384

_LOW_HALF = np.uint32(0x7FFF)
_HIGH_HALF = np.uint32(0xFFFF0000)


def to_bf16(x: np.ndarray) -> np.ndarray:
    """Rounds values to bfloat16 (round to nearest even), returned as float32.

    Args:
        x: Array (any shape) or scalar of real numbers.

    Returns:
        float32 array of x's shape whose values are representable in bfloat16.
        NaN stays NaN, infinities stay infinite, overflow rounds to infinity;
        the bits of ml_dtypes' ``astype(bfloat16).astype(float32)`` (tested over
        special values). Rate on one core of the project's machine: about 0.85 ns
        per element for large float32 arrays (`round_bf16_bits`), 1.3 ns through
        ml_dtypes, so round weights once per step, not once per use.
    """
    # ml_dtypes converts float64 via float32, so a float64 input can be rounded
    # twice (differs from direct rounding only on exact float32 ties).
    a = np.asarray(x)
    if a.size > 1 and not any(a.strides):
        # a zero-stride view (a timing-only stand-in, every element the same): round
        # its one value and keep it a view, so shape-only costing allocates nothing
        one = a.reshape(-1)[:1].astype(_BF16).astype(np.float32)
        return np.broadcast_to(one.reshape(()), a.shape)
    if a.dtype == np.float32 and a.size >= BITS_ROUNDING_MIN_ELEMENTS:
        out = round_bf16_bits(a)
        if out is not None:
            return out
    return a.astype(_BF16).astype(np.float32)


def round_bf16_bits(a: np.ndarray) -> np.ndarray | None:
    """float32 values rounded to bfloat16 (nearest even) on their bits: add 0x7FFF
    plus the lowest kept bit, clear the low 16 bits (a carry into the exponent gives
    the next binade, and infinity past the largest bf16). Five integer passes, no
    conversion; subnormals round as normals do (the same bit layout).

    Args:
        a: float32 array (any shape, non-empty).

    Returns:
        float32 array of a's shape, or None if ``a`` holds a NaN (adding to a NaN's
        bits can carry into its sign or make it infinite; `to_bf16` then casts).
    """
    if np.isnan(a.max()):
        return None
    bits = a.view(np.uint32)
    out = np.right_shift(bits, 16)
    np.bitwise_and(out, 1, out=out)                # the lowest kept bit: ties go to even
    np.add(out, _LOW_HALF, out=out)
    np.add(out, bits, out=out)
    np.bitwise_and(out, _HIGH_HALF, out=out)
    return out.view(np.float32)


def mxu_matmul(
    a: np.ndarray, b: np.ndarray, a_rounded: bool = False, b_rounded: bool = False
) -> np.ndarray:
    """The MXU product: bf16 x bf16 multiplies, float32 accumulation.

    Args:
        a: (M, K) activations.
        b: (K, N) weights.
        a_rounded: True if a already holds bf16 values in float32 (skip rounding).
        b_rounded: True if b already holds bf16 values in float32 (skip rounding).

    Returns:
        (M, N) float32 product of the bf16-rounded inputs.
    """
    a32 = np.asarray(a, dtype=np.float32) if a_rounded else to_bf16(a)
    b32 = np.asarray(b, dtype=np.float32) if b_rounded else to_bf16(b)
    return np.matmul(a32, b32)


def quantize_int8(x: np.ndarray) -> tuple[np.ndarray, float]:
    """Symmetric per-tensor int8 quantisation.

    Args:
        x: Array of real numbers (any shape).

    Returns:
        (q, scale): q int8 array of x's shape with values in [-127, 127], and the
        float scale such that x ~ q * scale (scale = max|x| / 127; 1.0 for all zeros).
    """
    x = np.asarray(x, dtype=np.float32)
    amax = float(np.max(np.abs(x))) if x.size else 0.0
    scale = amax / 127.0 if amax > 0 else 1.0
    q = np.clip(np.rint(x / scale), -127, 127).astype(np.int8)
    return q, scale


def dequantize_int8(q: np.ndarray, scale: float) -> np.ndarray:
    """Inverse of `quantize_int8`.

    Args:
        q: int8 array.
        scale: The scale returned by `quantize_int8`.

    Returns:
        float32 array q * scale.
    """
    return np.asarray(q, dtype=np.float32) * np.float32(scale)


def split_bf16x3(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Splits float32 values into three bf16 parts: x ~ hi + mid + lo.

    hi = bf16(x), mid = bf16(x - hi), lo = bf16(x - hi - mid) (each difference
    exact in float32). Three 8-bit significands cover float32's 24 bits, so
    hi + mid + lo recovers x to about float32 precision.

    Args:
        x: Array of real numbers (any shape).

    Returns:
        (hi, mid, lo), float32 arrays of x's shape holding bf16 values.
    """
    x = np.asarray(x, dtype=np.float32)
    hi = to_bf16(x)
    rest = x - hi
    mid = to_bf16(rest)
    lo = to_bf16(rest - mid)
    return hi, mid, lo


FP32_PASSES = 6
"""MXU passes of a float32 matmul: XLA's "HIGHEST" precision (bf16_6x)."""


def mxu_matmul_fp32(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """A float32 matmul as six bf16 MXU passes (XLA's HIGHEST precision).

    Both operands are split into bf16 parts (`split_bf16x3`); the product
    keeps the six terms whose order is at least 2^-16 relative:
    hi.hi + hi.mid + mid.hi + hi.lo + lo.hi + mid.mid (dropping mid.lo,
    lo.mid, lo.lo). Each pass is a bf16 x bf16 -> fp32 MXU product; the
    passes are summed smallest first in float32. Source: XLA's
    "bf16_6x" algorithm for PrecisionConfig HIGHEST on TPU (also described in
    Henry, Tang & Heinecke, "Leveraging the bfloat16 Artificial Intelligence
    Datatype For Higher-Precision Computations", ARITH 2019).

    Args:
        a: (M, K) activations.
        b: (K, N) weights.

    Returns:
        (M, N) float32; its error against the exact product is close to a
        float32 matmul's (tested against float64 in tests/chip).
    """
    a_hi, a_mid, a_lo = split_bf16x3(a)
    b_hi, b_mid, b_lo = split_bf16x3(b)
    small = np.matmul(a_mid, b_mid)
    small += np.matmul(a_lo, b_hi)
    small += np.matmul(a_hi, b_lo)
    middle = np.matmul(a_mid, b_hi)
    middle += np.matmul(a_hi, b_mid)
    out = np.matmul(a_hi, b_hi)
    out += middle + small
    return out


def quantize_int8_channels(x: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 quantisation with one scale per channel: the scale of each slice
    along ``axis`` is max|x| / 127 over that axis (1.0 for an all-zero slice), as AQT
    calibrates a dot's operand over its contraction axis (per token for activations,
    per output channel for weights).

    Args:
        x: Array of real numbers.
        axis: The axis the scales are taken over (kept, of size 1, in the scales).

    Returns:
        (q, scales): q int8 of x's shape in [-127, 127]; scales float32, x's shape
        with ``axis`` of size 1, such that x ~ q * scales.
    """
    x = np.asarray(x, dtype=np.float32)
    amax = np.max(np.abs(x), axis=axis, keepdims=True) if x.size else np.zeros(1, np.float32)
    scales = np.where(amax > 0, amax / np.float32(127.0), np.float32(1.0)).astype(np.float32)
    q = np.clip(np.rint(x / scales), -127, 127).astype(np.int8)
    return q, scales


def mxu_matmul_aqt_int8(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """An AQT int8 product (MaxText ``quantization: int8``, Google's Accurate Quantized
    Training): each operand quantised symmetrically per channel over the contraction
    axis (``quantize_int8_channels``: a's rows, b's columns), int8 x int8 with exact
    int32 accumulation, the result rescaled by the outer product of the scales.

    Round to nearest throughout: AQT's configuration for MaxText adds stochastic
    rounding to the gradient operand of the backward products (``rng_type``); that
    noise is not modelled (the cost is the same).

    Args:
        a: (M, K) operand (activations, or a gradient).
        b: (K, N) operand (weights, or activations).

    Returns:
        (M, N) float32 dequantised product.
    """
    qa, sa = quantize_int8_channels(a, axis=1)                           # (M, K), (M, 1)
    qb, sb = quantize_int8_channels(b, axis=0)                           # (K, N), (1, N)
    acc = np.matmul(qa.astype(np.float64), qb.astype(np.float64))       # exact integers
    return (acc * sa.astype(np.float64) * sb.astype(np.float64)).astype(np.float32)


def mxu_matmul_int8(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """An int8 MXU matmul: symmetric per-tensor quantisation, int32 accumulation.

    a and b are quantised with `quantize_int8` (scales s_a, s_b), multiplied
    as int8 x int8 with exact int32 accumulation, and the int32 result is
    rescaled: out = (q_a . q_b) * s_a * s_b.

    The integer product is computed in float64 BLAS, which is exact while
    K * 127 * 127 < 2**53 (K < 5.5e11); int32 overflow (K > 133,000 with
    extreme values) is not modelled.

    Args:
        a: (M, K) activations.
        b: (K, N) weights.

    Returns:
        (M, N) float32 dequantised product.
    """
    qa, sa = quantize_int8(a)
    qb, sb = quantize_int8(b)
    acc = np.matmul(qa.astype(np.float64), qb.astype(np.float64))  # exact integers
    return (acc * (sa * sb)).astype(np.float32)

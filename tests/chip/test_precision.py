"""Precision modes (numerics against float64, cost), batched matmul, conv2d, timing-only ops."""

import dataclasses
import math

import numpy as np
import pytest

from chip import (Chip, ChipError, MXUSpec, PrecisionError, TensorCore, TensorCoreSpec,
                  get_chip_spec, mxu_gemm_cycles, mxu_matmul_fp32, quantize_int8, split_bf16x3,
                  to_bf16)

from tests.chip.rates import fresh_op_cycles

V2, V4, V5E = get_chip_spec("v2"), get_chip_spec("v4"), get_chip_spec("v5e")


def rel_err(x, exact):
    return float(np.linalg.norm(x.astype(np.float64) - exact) / np.linalg.norm(exact))


@pytest.fixture(scope="module")
def operands():
    rng = np.random.default_rng(42)
    a = rng.standard_normal((64, 512)).astype(np.float32)
    b = rng.standard_normal((512, 48)).astype(np.float32)
    return a, b, a.astype(np.float64) @ b.astype(np.float64)


def test_split_bf16x3_recovers_float32():
    x = np.random.default_rng(0).standard_normal(10_000).astype(np.float32) * 1e3
    hi, mid, lo = split_bf16x3(x)
    for part in (hi, mid, lo):
        np.testing.assert_array_equal(part, to_bf16(part))  # each part is a bf16 value
    recon = hi.astype(np.float64) + mid + lo
    assert np.max(np.abs(recon - x) / np.abs(x)) < 2.0**-22


def test_fp32_six_pass_error_is_close_to_float32(operands):
    a, b, exact = operands
    err_fp32 = rel_err(mxu_matmul_fp32(a, b), exact)
    err_numpy32 = rel_err(a @ b, exact)
    err_bf16 = rel_err(to_bf16(a) @ to_bf16(b), exact)
    assert err_fp32 < 4 * err_numpy32 + 1e-7      # float32 class
    assert err_fp32 < err_bf16 / 100               # far better than one bf16 pass
    assert err_bf16 > 1e-3                          # bf16 inputs: ~3 significant digits


def test_int8_quantised_matmul_against_float64(operands):
    a, b, exact = operands
    core = TensorCore(V5E.core, precision="int8")
    out = core.matmul(a, b)
    qa, sa = quantize_int8(a)
    qb, sb = quantize_int8(b)
    # Independent reference: exact integer product in Python ints via int64.
    ref = (qa.astype(np.int64) @ qb.astype(np.int64)) * (sa * sb)
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())
    assert 1e-3 < rel_err(out, exact) < 5e-2       # 8-bit quantisation error


def test_precision_costs():
    m = k = n = 1024
    a = np.ones((m, k), np.float32)
    recs = {}
    for prec, spec in (("bf16", V5E.core), ("fp32", V5E.core), ("int8", V5E.core)):
        core = TensorCore(spec, precision=prec, numerics=False)
        core.matmul(a, a)
        recs[prec] = core.records[0]
    base = mxu_gemm_cycles(m, k, n, V5E.core.mxu, V5E.core.mxus_per_core)
    issue = V5E.core.scalar_issue_cycles
    # one op from an idle start each: its efficiency is the mean over its own length
    assert recs["bf16"].cycles == fresh_op_cycles(V5E.core, base) + issue
    # fp32: six passes = six times the folds (closed form), ~6x the bf16 cycles:
    # pipelined, 6 * 64 / 4 rounds of M rows plus one bubble.
    folds = (k // 128) * (n // 128)
    fp32_ideal = math.ceil(6 * folds / 4) * m + 2 * 128 + 128 - 3
    assert recs["fp32"].cycles == fresh_op_cycles(V5E.core, fp32_ideal) + issue
    assert recs["fp32"].cycles / recs["bf16"].cycles == pytest.approx(6, rel=0.03)
    # int8 on v5e: twice the MACs per cycle (394 vs 197 TOP/s [GC-v5e]).
    assert recs["int8"].cycles == fresh_op_cycles(V5E.core, math.ceil(base / 2)) + issue
    # bf16 writes bf16 outputs (fp32 accumulate inside) [PALLAS]; fp32 and int8 4 bytes.
    assert recs["bf16"].hbm_bytes == 2 * (2 * m * k) + 2 * m * n
    assert recs["fp32"].hbm_bytes == 4 * (2 * m * k) + 4 * m * n
    assert recs["int8"].hbm_bytes == 1 * (2 * m * k) + 4 * m * n
    assert {r.flops for r in recs.values()} == {2.0 * m * k * n}


@pytest.mark.parametrize("name", ["v2", "v3"])
def test_int8_is_a_clear_error_on_v2_and_v3(name):
    spec = get_chip_spec(name)
    with pytest.raises(PrecisionError, match=f"TPU {name} does not have") as info:
        Chip(spec, precision="int8")
    assert isinstance(info.value, ChipError) and "\n" not in str(info.value)
    with pytest.raises(PrecisionError, match="int8"):
        TensorCore(spec.core, precision="int8")
    with pytest.raises(PrecisionError, match="'fp16'.*bf16, fp32, int8"):
        TensorCore(spec.core, precision="fp16")


def test_layers_see_numerics_only_in_bf16():
    assert TensorCore(V4.core).numerics
    assert not TensorCore(V4.core, precision="fp32").numerics  # layers then skip bf16 rounding
    assert TensorCore(V4.core, precision="fp32").emulates_numerics
    chip = Chip(V4, precision="fp32")
    assert all(c.precision == "fp32" for c in chip.cores)
    # fp32 ignores the *_rounded flags: inputs are split, not taken as bf16.
    core = TensorCore(V4.core, precision="fp32")
    a = np.full((2, 3), 1 + 2**-10, np.float32)
    out = core.matmul(a, np.ones((3, 2), np.float32), a_rounded=True, b_rounded=True)
    np.testing.assert_allclose(out, 3 * (1 + 2**-10), rtol=1e-7)


def test_four_mxus_take_a_quarter_through_the_core():
    one = TensorCoreSpec(mxu=MXUSpec(128, 128), mxus_per_core=1, clock_hz=1e9,
                         hbm_bytes=2**34, hbm_bandwidth_bytes_per_s=1e15, vmem_bytes=0)
    four = dataclasses.replace(one, mxus_per_core=4)
    cyc = [TensorCore(s).account_matmul(2048, 2048, 2048).cycles for s in (one, four)]
    assert cyc[1] / cyc[0] == pytest.approx(0.25, rel=0.01)


def test_double_buffered_core():
    plain = TensorCore(V2.core, mxu_model="scalesim").account_matmul(256, 512, 512)
    buffered = TensorCore(V2.core, double_buffered=True,
                          mxu_model="scalesim").account_matmul(256, 512, 512)
    assert plain.cycles - buffered.cycles == (16 - 1) * 128
    # The pipelined model (default) already double-buffers: the flag changes nothing.
    assert TensorCore(V2.core).account_matmul(256, 512, 512) == \
        TensorCore(V2.core, double_buffered=True).account_matmul(256, 512, 512)


def test_mxu_model_on_the_core_and_per_call():
    m, k, n = 32, 1024, 1024  # 32 examples per core: 64 folds of M = 32 rows
    pipelined = TensorCore(V5E.core)
    scalesim = TensorCore(V5E.core, mxu_model="scalesim")
    assert pipelined.mxu_model == "pipelined" and scalesim.mxu_model == "scalesim"
    p = pipelined.account_matmul(m, k, n)
    s = scalesim.account_matmul(m, k, n)
    issue = V5E.core.scalar_issue_cycles
    # scalesim: 16 rounds of one fold's 2R + C + M - 2 cycles, no efficiency.
    assert s.mxu_cycles == 16 * (2 * 128 + 128 + m - 2) - 1
    # pipelined: 15 waits of R (weight load, M < R) plus one fold, over the efficiency.
    assert p.mxu_cycles == math.ceil((15 * 128 + 2 * 128 + 128 + m - 2 - 1)
                                     / V5E.core.mxu_efficiency)
    assert (p.issue_cycles, s.issue_cycles) == (issue, issue)
    assert p.cycles == p.mxu_cycles + issue and s.cycles == s.mxu_cycles + issue
    # Per call, the core's default is overridden.
    assert pipelined.account_matmul(m, k, n, mxu_model="scalesim").mxu_cycles == s.mxu_cycles
    assert pipelined.mxu_cycles(m, k, n, mxu_model="scalesim") == s.mxu_cycles
    with pytest.raises(ValueError, match="'pipelined', 'scalesim'"):
        TensorCore(V5E.core, mxu_model="ws")
    with pytest.raises(ValueError, match="'pipelined', 'scalesim'"):
        pipelined.account_matmul(m, k, n, mxu_model="os")
    chip = Chip(get_chip_spec("v4"), mxu_model="scalesim")
    assert all(c.mxu_model == "scalesim" for c in chip.cores)


def test_batch_matmul_shared_and_per_example_weights():
    rng = np.random.default_rng(3)
    a = rng.standard_normal((4, 16, 32))
    w = rng.standard_normal((32, 8))
    ws = rng.standard_normal((4, 32, 8))
    core = TensorCore(V4.core, numerics=False)
    np.testing.assert_allclose(core.batch_matmul(a, w), np.einsum("bmk,kn->bmn", a, w))
    np.testing.assert_allclose(core.batch_matmul(a, ws), np.einsum("bmk,bkn->bmn", a, ws))
    shared, per_example = core.take_records()
    issue = V4.core.scalar_issue_cycles
    eff = V4.core.mxu_efficiency
    assert shared.cycles == math.ceil(mxu_gemm_cycles(64, 32, 8, V4.core.mxu, 4) / eff) + issue
    assert per_example.cycles == math.ceil(
        mxu_gemm_cycles(16, 32, 8, V4.core.mxu, 4, batch=4) / eff) + issue
    assert shared.flops == per_example.flops == 2 * 4 * 16 * 32 * 8
    assert per_example.hbm_bytes - shared.hbm_bytes == 2 * 3 * 32 * 8
    assert shared.issue_cycles == issue and shared.mxu_cycles == shared.cycles - issue
    bf = TensorCore(V4.core).batch_matmul(a.astype(np.float32), ws.astype(np.float32))
    np.testing.assert_array_equal(bf, np.matmul(to_bf16(a), to_bf16(ws)))
    with pytest.raises(ValueError, match=r"\(4, 16, 32\).*\(3, 32, 8\)"):
        core.batch_matmul(a, ws[:3])


def direct_conv(x, w, stride, pads):
    """Reference convolution by explicit loops in float64."""
    x = np.pad(x, ((0, 0), pads[0], pads[1], (0, 0)))
    b, h, wd, c = x.shape
    kh, kw, _, f = w.shape
    ho, wo = (h - kh) // stride + 1, (wd - kw) // stride + 1
    out = np.zeros((b, ho, wo, f))
    for i in range(ho):
        for j in range(wo):
            patch = x[:, i * stride:i * stride + kh, j * stride:j * stride + kw, :]
            out[:, i, j, :] = np.tensordot(patch, w, axes=([1, 2, 3], [0, 1, 2]))
    return out


@pytest.mark.parametrize("stride, padding, pads", [
    (1, "valid", ((0, 0), (0, 0))),
    (2, "valid", ((0, 0), (0, 0))),
    (1, "same", ((1, 1), (0, 1))),   # 3x2 kernel: rows 1+1, cols 0 before 1 after
])
def test_conv2d_as_im2col_gemm(stride, padding, pads):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 7, 6, 3))
    w = rng.standard_normal((3, 2, 3, 4))
    core = TensorCore(V2.core, numerics=False)
    out = core.conv2d(x, w, stride=stride, padding=padding)
    ref = direct_conv(x, w, stride, pads)
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12)
    (rec,) = core.records
    b, ho, wo, f = out.shape
    ideal = mxu_gemm_cycles(b * ho * wo, 3 * 2 * 3, 4, V2.core.mxu)
    assert rec.cycles == math.ceil(ideal / V2.core.mxu_efficiency) + V2.core.scalar_issue_cycles
    # HBM: x, w once, bf16 output [PALLAS] (numerics=False still costs bf16).
    assert rec.hbm_bytes == 2 * (x.size + w.size) + 2 * out.size
    assert rec.flops == 2 * b * ho * wo * 18 * 4


def test_timing_only_matches_functional_cost():
    a = np.ones((300, 200), np.float32)
    b = np.ones((200, 130), np.float32)
    core = TensorCore(V2.core)
    core.matmul(a, b)
    core.account_matmul(300, 200, 130)
    core.vector("add", np.add, a, a)
    core.account_vector("add", a.size, 3 * a.nbytes)
    r = core.records
    assert r[0] == r[1] and r[2] == r[3]


def test_vector_op_is_memory_bound_and_says_so():
    # An elementwise add reads 8 bytes and writes 4 per element: 12 bytes per
    # 1/2048 cycle -> far above HBM's ~0.5 byte/cycle on v2: memory bound.
    core = TensorCore(V2.core)
    rec = core.account_vector("add", 4096 * 4096, 12 * 4096 * 4096)
    assert rec.bound == "memory"
    achieved = V2.core.hbm_bandwidth_bytes_per_s * V2.core.hbm_efficiency
    assert rec.seconds == pytest.approx(12 * 4096 * 4096 / achieved)
    # 8 sublanes x 128 lanes x 2 ALUs = 2048 element-ops per cycle [SB-tpus].
    assert rec.cycles == 4096 * 4096 // 2048 + V2.core.scalar_issue_cycles
    assert rec.issue_cycles == V2.core.scalar_issue_cycles and rec.mxu_cycles == 0


def test_scalar_issue_cost_is_configurable_and_dominates_tiny_ops():
    spec = dataclasses.replace(V2.core, scalar_issue_cycles=100)
    core = TensorCore(spec)
    x = np.ones(8, np.float32)
    for _ in range(10):
        core.vector("tiny", np.add, x, x)
    # ceil(8 / 2048) = 1 VPU cycle + 100 issue cycles each.
    assert [r.cycles for r in core.records] == [101] * 10
    zero = TensorCore(dataclasses.replace(V2.core, scalar_issue_cycles=0))
    assert zero.vector("tiny", np.add, x, x) is not None and zero.records[0].cycles == 1

"""Flash attention (issue 23, item 3): the blocked kernel's numerics against plain
attention, its causal blocks in closed form, and its cost: block products on the
MXU, the softmax fused into them, no T x T tensor in HBM, scores recomputed in
backward. No Ray."""

from __future__ import annotations

import math

import numpy as np
import pytest

from chip import TensorCore, get_chip_spec
from pod.workloads import CausalSelfAttention, build_model
from pod.workloads.flash import (FLASH_BLOCK_SIZE, STATS_BYTES_PER_ROW, BackwardBlocks,
                                 causal_blocks, flash_backward, flash_forward)

pytestmark = pytest.mark.usefixtures("one_blas_thread")

SPEC = get_chip_spec("v5p").core


def plain_attention(q, k, v, scale):
    """float64 causal attention with every query head's kv head repeated: q (N, G*T,
    Dh), k, v (N, T, Dh) -> (o, probs) with o (N, G*T, Dh)."""
    n, gt, dh = q.shape
    t = k.shape[1]
    qg = q.reshape(n, gt // t, t, dh).astype(np.float64)
    s = np.einsum("ngid,njd->ngij", qg, k.astype(np.float64)) * scale
    s = np.where(np.triu(np.ones((t, t), bool), 1), -np.inf, s)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("ngij,njd->ngid", p, v.astype(np.float64)).reshape(n, gt, dh), p


def plain_grads(q, k, v, do, scale):
    """dq, dk, dv of ``plain_attention`` in float64, written out."""
    n, gt, dh = q.shape
    t = k.shape[1]
    g = gt // t
    qg, dog = q.reshape(n, g, t, dh).astype(np.float64), do.reshape(n, g, t, dh).astype(np.float64)
    _, p = plain_attention(q, k, v, scale)
    dv = np.einsum("ngij,ngid->njd", p, dog)
    dp = np.einsum("ngid,njd->ngij", dog, v.astype(np.float64))
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) * scale
    dq = np.einsum("ngij,njd->ngid", ds, k.astype(np.float64)).reshape(n, gt, dh)
    dk = np.einsum("ngij,ngid->njd", ds, qg)
    return dq, dk, dv


# --------------------------------------------------------------------------- blocks

def test_causal_blocks_in_closed_form():
    """n blocks a side: n (n + 1) / 2 computed, the n diagonal ones masked; a
    partial last block; a sequence shorter than a block is one masked block."""
    big = causal_blocks(8192)
    assert big.block == FLASH_BLOCK_SIZE == 512
    assert big.shapes == (((512, 512, False), 120), ((512, 512, True), 16))  # 16 * 17 / 2 = 136
    assert big.score_elements == 136 * 512 ** 2 and big.masked_elements == 16 * 512 ** 2
    assert big.score_elements / 8192 ** 2 == pytest.approx(0.53125)     # 47% of the square skipped
    edge = causal_blocks(20, 8)                                          # rows 8, 8, 4
    assert dict(edge.shapes) == {(8, 8, True): 2, (8, 8, False): 1, (4, 8, False): 2,
                                 (4, 4, True): 1}
    assert edge.row_visits == 8 + 16 + 12
    assert causal_blocks(64).shapes == (((64, 64, True), 1),)
    with pytest.raises(ValueError, match="steps and block >= 1"):
        causal_blocks(0)


# --------------------------------------------------------------------------- numerics

@pytest.mark.parametrize("n, g, t, dh, block", [(3, 1, 20, 8, 8), (2, 2, 20, 4, 8),
                                                (2, 4, 13, 6, 512), (1, 2, 33, 4, 5)],
                         ids=["mha-3-blocks", "gqa-edge-block", "gqa-one-block", "odd-blocks"])
def test_flash_equals_plain_attention_within_fp32_tolerance(n, g, t, dh, block):
    rng = np.random.default_rng(t + g)
    q = rng.standard_normal((n, g * t, dh)).astype(np.float32) * 1.5
    k, v = (rng.standard_normal((n, t, dh)).astype(np.float32) * 1.5 for _ in range(2))
    do = rng.standard_normal(q.shape).astype(np.float32)
    scale = 1 / math.sqrt(dh)
    o, lse = flash_forward(q, k, v, scale, block, rounding=False)
    want, p = plain_attention(q, k, v, scale)
    assert o.dtype == lse.dtype == np.float32
    np.testing.assert_allclose(o, want, rtol=1e-5, atol=1e-6)
    s = np.einsum("ngid,njd->ngij", q.reshape(n, g, t, dh).astype(np.float64), k) * scale
    s = np.where(np.triu(np.ones((t, t), bool), 1), -np.inf, s)
    np.testing.assert_allclose(lse.reshape(n, g, t), np.log(np.exp(s).sum(-1)), rtol=1e-5)
    got = flash_backward(q, k, v, o, lse, do, scale, block, rounding=False)
    for name, a, b in zip(("dq", "dk", "dv"), got, plain_grads(q, k, v, do, scale)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5, err_msg=name)


@pytest.mark.parametrize("kv_heads, rotary", [(4, True), (2, True), (1, False)],
                         ids=["mha", "gqa", "mqa"])
def test_flash_layer_equals_the_dot_product_layer(kv_heads, rotary):
    """The attention layer with the flash kernel (blocks of 4 over 10 positions) and
    with plain attention: the same output and gradients within fp32 tolerance."""
    core = TensorCore(SPEC, numerics=False)
    x = np.random.default_rng(kv_heads).standard_normal((2, 10, 12)).astype(np.float32)
    dy = np.random.default_rng(9).standard_normal((2, 10, 12)).astype(np.float32)
    layers = [CausalSelfAttention(4, 4, kv_heads=kv_heads, rotary=rotary, attention=a,
                                  block_size=4) for a in ("dot_product", "flash")]
    params = layers[0].init_params(np.random.default_rng(1), (10, 12))
    (y0, c0), (y1, c1) = (layer.forward(core, params, x) for layer in layers)
    np.testing.assert_allclose(y1, y0, rtol=1e-5, atol=1e-6)
    (dx0, g0), (dx1, g1) = (layer.backward(core, params, c, dy) for layer, c in zip(layers, (c0, c1)))
    np.testing.assert_allclose(dx1, dx0, rtol=1e-4, atol=1e-5)
    for key in g0:
        np.testing.assert_allclose(g1[key], g0[key], rtol=1e-4, atol=1e-5, err_msg=key)
    assert "probs" not in c1 and c1["stats"].shape == (2 * kv_heads, (4 // kv_heads) * 10)


# --------------------------------------------------------------------------- cost

def attention_records(attention, t=48, batch=2, heads=4, kv_heads=2, dh=8, block=16,
                      backward=None):
    core = TensorCore(SPEC, execute=False)
    layer = CausalSelfAttention(heads, dh, kv_heads=kv_heads, attention=attention, block_size=block,
                                backward_blocks=backward, name="att")
    params = {k: np.zeros(s, np.float32) for k, s in layer.param_shapes((t, 32)).items()}
    x = np.zeros((batch, t, 32), np.float32)
    _, cache = layer.forward(core, params, x)
    forward = core.take_records()
    layer.backward(core, params, cache, x)
    return forward, core.take_records()


def test_the_flash_kernels_cost_blocks_on_the_mxu_and_no_t_by_t_tensor_in_hbm():
    b, t, h, kv, dh, block = 2, 48, 4, 2, 8, 16
    forward, backward = attention_records("flash")
    by = {r.name: r for r in forward + backward}
    blocks = causal_blocks(t, block)                                     # 3 a side: 6 of 9
    scores = b * h * blocks.score_elements
    assert blocks.score_elements == 6 * 16 * 16
    kernel = by["att/flash_fwd"]
    assert kernel.unit == "mxu" and kernel.flops == 2 * 2 * dh * scores
    q, kvb, stats = b * t * h * dh * 2, b * t * kv * dh * 2, b * h * t * STATS_BYTES_PER_ROW
    assert kernel.hbm_bytes == q + 2 * kvb + q + stats                    # q, k, v in; o, m, l out
    for name in ("att/flash_fwd/softmax", "att/flash_fwd/exp"):
        assert by[name].fused_into == "att/flash_fwd" and by[name].hbm_bytes == 0
    assert by["att/flash_fwd/exp"].flops == scores + b * h * blocks.row_visits
    assert by["att/flash_bwd_dkv"].flops == 4 * 2 * dh * scores             # S, dP, dV, dK
    assert by["att/flash_bwd_dq"].flops == 3 * 2 * dh * scores              # S, dP, dQ
    assert by["att/flash_bwd_dkv/softmax"].fused_into == "att/flash_bwd_dkv"
    assert by["att/flash_bwd_dq/exp"].fused_into == "att/flash_bwd_dq"
    assert not any(n.endswith(("/scores", "/softmax_bwd", "/d_probs")) for n in by)
    # HBM: linear in T for flash, the dot product moves T x T scores and probabilities
    dot_fwd, dot_bwd = attention_records("dot_product")
    flash_bytes = sum(r.hbm_bytes for r in forward + backward)
    dot_bytes = sum(r.hbm_bytes for r in dot_fwd + dot_bwd)
    assert dot_bytes - flash_bytes > 4 * b * h * t * t                    # several T x T passes
    assert sum(r.hbm_bytes for r in forward + backward if "flash" in r.name) < 40 * q


def test_splash_fused_backward_kernel_is_dkv_with_its_dq_five_products_not_seven():
    """sa_use_fused_bwd_kernel (jax's splash_attention_kernel, use_fused_bwd_kernel): the
    dkv kernel also forms dQ = dS K from the dS it holds, so the backward's block products
    are S, dP, dV, dK, dQ (5) where the two kernels run 4 + 3; it writes one partial dQ
    per key block, in the query's dtype, which a vector op then sums."""
    b, t, h, kv, dh, block = 2, 48, 4, 2, 8, 16
    _, two = attention_records("flash")
    _, fused = attention_records("flash", backward=BackwardBlocks(fused=True))
    scores = b * h * causal_blocks(t, block).score_elements
    by = {r.name: r for r in fused}
    assert by["att/flash_bwd_fused"].unit == "mxu"
    assert by["att/flash_bwd_fused"].flops == 5 * 2 * dh * scores
    assert not any(r.name.startswith(("att/flash_bwd_dkv", "att/flash_bwd_dq")) for r in fused)
    assert by["att/flash_bwd_fused/softmax"].fused_into == "att/flash_bwd_fused"
    mxu = [sum(r.flops for r in rs if r.unit == "mxu" and "flash" in r.name) for rs in (two, fused)]
    assert mxu[1] * 7 == mxu[0] * 5
    q, kvb = b * t * h * dh * 2, b * t * kv * dh * 2                      # bf16 bytes
    partials = t // block                                                # one per key block
    dkv = {r.name: r for r in two}["att/flash_bwd_dkv"].hbm_bytes        # reads + dK, dV
    assert by["att/flash_bwd_fused"].hbm_bytes == dkv + partials * q
    assert by["att/flash_bwd/dq_sum"].hbm_bytes == (partials + 1) * q
    assert kvb < q


def test_each_backward_kernel_runs_its_own_blocks():
    """sa_block_q_dkv / sa_block_q_dq (T7's 2048 over a forward of 1024): a larger query
    block computes more of the causal triangle, in that kernel only."""
    b, t, h, dh = 2, 48, 4, 8
    _, backward = attention_records("flash", block=8,
                                    backward=BackwardBlocks(dkv=(16, 8), dq=(24, 8)))
    by = {r.name: r for r in backward}
    for kernel, rows, products in (("dkv", 16, 4), ("dq", 24, 3)):
        scores = b * h * causal_blocks(t, rows, 8).score_elements
        assert by[f"att/flash_bwd_{kernel}"].flops == products * 2 * dh * scores
    assert causal_blocks(t, 24, 8).score_elements > causal_blocks(t, 16, 8).score_elements \
        > causal_blocks(t, 8, 8).score_elements
    assert BackwardBlocks().kernels(1024, None) == (("dkv", 1024, 1024), ("dq", 1024, 1024))
    assert BackwardBlocks(dkv=(2048, 512), dq=(64, 64), fused=True).kernels(1024, 512) == (
        ("fused", 2048, 512),)


@pytest.mark.parametrize("options", [
    {}, {"remat": "full"}, {"sa_use_fused_bwd_kernel": True, "sa_block_kv": 256},
    {"sa_block_q": 256, "sa_block_q_dkv": 1024, "sa_block_kv_dq": 128, "remat": "full"},
    {"remat": "minimal", "block": "parallel", "kv_heads": 1},
    {"attention": "dot_product", "remat": "full", "kv_heads": 2},
    {"attention": "dot_product", "remat": "minimal", "fused_qkv": True}])
@pytest.mark.parametrize("steps", [16, 1100])
def test_recorded_mxu_flops_are_the_hardware_flops(options, steps):
    """Every MXU record of a training step, summed, is ``hardware_flops_per_example``
    x the batch: flash's causal blocks (1100 positions: 3 blocks a side, a partial
    one) and its backward recomputation, remat's reruns, in closed form. Timing-only
    core (costs from shapes)."""
    model = build_model("transformer", (steps,), 64, embed_dim=32, heads=4, head_dim=8,
                        mlp_dim=48, layers=2, **options)
    core = TensorCore(SPEC, execute=False)
    x = np.zeros((2, steps), np.int64)
    model.loss_and_grads(core, model.init_params(0), x, x)
    mxu = sum(r.flops for r in core.take_records() if r.unit == "mxu")
    assert mxu == 2 * model.hardware_flops_per_example()


def test_a_multi_block_flash_step_records_the_same_ops_timing_only():
    """1030 positions (3 blocks of 512 a side): an executing core and a timing-only
    one record the same ops (the kernels are costed from shapes)."""
    model = build_model("transformer", (1030,), 32, embed_dim=16, heads=2, head_dim=8,
                        mlp_dim=16, layers=1, remat="full")
    x = np.random.default_rng(0).integers(0, 32, (1, 1030))
    runs = []
    for execute in (True, False):
        core = TensorCore(SPEC, execute=execute)
        model.loss_and_grads(core, model.init_params(0), x, x)
        runs.append(core.take_records())
    assert runs[0] == runs[1] and any(r.name.endswith("flash_bwd_dq") for r in runs[0])

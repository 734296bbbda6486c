"""The transformer language model (issue 13, item 6) and AdamW.

Gradients of every new layer against central finite differences in float64
(numerics off); one block's forward against a plain-numpy reference written
here; causal masking; the RoPE relative-position property; remat variants
bit-identical with the right cost and memory ordering; parameter and FLOP
counts in closed form; a tiny model learning the Python docs text. No Ray.
"""

from __future__ import annotations

import itertools
import math
import time

import numpy as np
import pytest

from chip import TensorCore, get_chip_spec
from pod.workloads import (
    MLP,
    OPTIMIZER_NAMES,
    CausalSelfAttention,
    LayerNorm,
    RMSNorm,
    TokenEmbedding,
    TransformerBlock,
    TransformerConfig,
    Unembed,
    build_model,
    build_optimizer,
    load_dataset,
)
from pod.workloads.attention import apply_rope, rope_tables
from pod.workloads.transformer import maxtext_tflops_2023, maxtext_tflops_2025
from tests.pod.workloads.test_workloads import numeric_grad

pytestmark = pytest.mark.usefixtures("one_blas_thread")

TINY = {"embed_dim": 8, "heads": 2, "head_dim": 4, "mlp_dim": 12, "layers": 2}


# --------------------------------------------------------------------------- helpers

def small_params(layer, input_shape, seed=0, scale=0.5):
    """float64 params: kernels ~ N(0, scale^2 / fan_in) (so the softmax is
    not saturated and finite differences stay accurate); norm scales around
    1, biases and position vectors small but non-zero."""
    rng = np.random.default_rng(seed)
    out = {}
    for k, v in layer.init_params(rng, input_shape).items():
        if k.endswith("scale"):
            out[k] = 1.0 + 0.3 * rng.standard_normal(v.shape)
        elif v.ndim == 2 and not k.endswith(("embedding", "position")):
            out[k] = rng.standard_normal(v.shape) * scale / math.sqrt(v.shape[0])
        else:
            out[k] = 0.3 * rng.standard_normal(v.shape)
    return out


def check_grads(core, layer, x, params, *, rtol=1e-6, atol=1e-8, check_dx=True):
    """Loss = sum(r * layer(x)); backward's dx and param grads against central
    differences (float64, numerics off)."""
    rng = np.random.default_rng(1)
    y, cache = layer.forward(core, params, x, training=True)
    r = rng.standard_normal(y.shape)

    def loss():
        out, _ = layer.forward(core, params, x, training=True)
        return float(np.sum(r * out))

    dx, grads = layer.backward(core, params, cache, r, need_dx=check_dx)
    if check_dx:
        assert dx.shape == x.shape and dx.dtype == np.float64
        np.testing.assert_allclose(dx, numeric_grad(loss, x), rtol=rtol, atol=atol)
    assert grads.keys() == params.keys()
    for k, p in params.items():
        assert grads[k].shape == p.shape, k
        np.testing.assert_allclose(grads[k], numeric_grad(loss, p), rtol=rtol, atol=atol, err_msg=k)


def float64_model_params(model, seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for k, v in model.init_params(seed).items():
        if k.endswith("scale"):
            out[k] = 1.0 + 0.2 * rng.standard_normal(v.shape)
        elif k.endswith(("embedding", "position")):
            out[k] = 0.5 * rng.standard_normal(v.shape)
        else:
            out[k] = rng.standard_normal(v.shape) * 0.5 / math.sqrt(v.shape[0])
    return out


def tokens(shape, vocabulary, seed):
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocabulary, size=shape), rng.integers(0, vocabulary, size=shape)


# --------------------------------------------------------------------------- layer gradients

@pytest.mark.parametrize("norm", [RMSNorm, LayerNorm], ids=["rmsnorm", "layernorm"])
def test_norm_grads(core64, norm):
    x = np.random.default_rng(2).standard_normal((2, 3, 5)) * 2 + 0.5
    layer = norm()
    check_grads(core64, layer, x, small_params(layer, x.shape[1:]))


def test_norm_forwards_against_closed_forms(core64):
    x = np.random.default_rng(3).standard_normal((2, 4, 6)) * 3 + 1
    g = np.linspace(0.5, 2.0, 6)
    b = np.linspace(-1, 1, 6)
    y, _ = RMSNorm().forward(core64, {"scale": g}, x)
    np.testing.assert_allclose(y, x / np.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-6) * g,
                               rtol=1e-12)
    y, _ = LayerNorm().forward(core64, {"scale": g, "bias": b}, x)
    np.testing.assert_allclose(y, (x - x.mean(-1, keepdims=True))
                               / np.sqrt(x.var(-1, keepdims=True) + 1e-6) * g + b, rtol=1e-10)


@pytest.mark.parametrize("rotary, options", [
    (True, {}), (False, {}), (True, {"kv_heads": 2}), (True, {"kv_heads": 1, "use_bias": True}),
    (False, {"kv_heads": 2, "fused_qkv": True, "use_bias": True})],
    ids=["rope", "no_rope", "gqa", "mqa-bias", "gqa-fused-bias"])
def test_attention_grads(core64, rotary, options):
    heads = 4 if options else 2
    x = np.random.default_rng(4).standard_normal((2, 5, 6))
    layer = CausalSelfAttention(heads, 4, rotary=rotary, **options)
    check_grads(core64, layer, x, small_params(layer, x.shape[1:], scale=1.5))


@pytest.mark.parametrize("activation, use_bias", [("gated_silu", False), ("gelu", False),
                                                  ("relu", True), ("gated_gelu", True)])
def test_mlp_grads(core64, activation, use_bias):
    x = np.random.default_rng(5).standard_normal((2, 3, 6))
    layer = MLP(7, activation, use_bias=use_bias)
    check_grads(core64, layer, x, small_params(layer, x.shape[1:], scale=1.5))


@pytest.mark.parametrize("norm, remat, options", [
    ("rmsnorm", "none", {}), ("layernorm", "minimal", {}), ("rmsnorm", "full", {}),
    ("rmsnorm", "none", {"block": "parallel", "use_bias": True}),
    ("layernorm", "minimal", {"block": "parallel", "kv_heads": 1}),
    ("rmsnorm", "full", {"use_bias": True, "fused_qkv": True, "kv_heads": 1}),
], ids=["none", "minimal", "full", "parallel-bias", "parallel-mqa-minimal", "bias-fused-full"])
def test_block_grads(core64, norm, remat, options):
    x = np.random.default_rng(6).standard_normal((2, 4, 8))
    layer = TransformerBlock(2, 4, 12, norm=norm, remat=remat, name="block", **options)
    check_grads(core64, layer, x, small_params(layer, x.shape[1:], scale=1.2))


def test_embedding_with_learned_positions_grads(core64):
    layer = TokenEmbedding(7, 4, max_steps=6)
    ids = np.array([[1, 3, 3, 0, 6], [2, 2, 5, 1, 1]])                 # repeats: scatter-add
    params = small_params(layer, ids.shape[1:])
    y, _ = layer.forward(core64, params, ids)
    np.testing.assert_array_equal(y, params["embedding"][ids] + params["position"][:5])
    check_grads(core64, layer, ids, params, check_dx=False)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_unembed_grads(core64, tied):
    x = np.random.default_rng(7).standard_normal((2, 3, 5))
    layer = Unembed(9, tied=tied)
    params = ({"embedding": np.random.default_rng(8).standard_normal((9, 5))} if tied
              else small_params(layer, x.shape[1:]))
    y, _ = layer.forward(core64, params, x)
    w = params["embedding"].T if tied else params["kernel"]
    np.testing.assert_allclose(y, x @ w, rtol=1e-12)
    check_grads(core64, layer, x, params)


@pytest.mark.parametrize("options", [
    {"tied_embeddings": True, "positions": "rotary"},
    {"tied_embeddings": False, "positions": "learned", "norm": "layernorm", "mlp_activation": "gelu"},
], ids=["tied_rope", "untied_learned"])
def test_model_loss_grads_against_finite_differences(core64, options):
    """The whole model, softmax cross-entropy included; the tied table's
    gradient is the sum of its lookup and logits uses."""
    model = build_model("transformer", (5,), 11, **TINY, **options)
    params = float64_model_params(model)
    x, y = tokens((3, 5), 11, seed=9)
    loss, grads = model.loss_and_grads(core64, params, x, y)
    assert loss == pytest.approx(model.evaluate(core64, params, x, y)[0], rel=1e-12)
    rng = np.random.default_rng(10)
    for key, p in params.items():
        entries = rng.choice(p.size, size=min(p.size, 6), replace=False)

        def f():
            return model.evaluate(core64, params, x, y)[0]                # forward only

        expected = numeric_grad(f, p, entries=entries).reshape(-1)[entries]
        np.testing.assert_allclose(grads[key].reshape(-1)[entries], expected,
                                   rtol=1e-6, atol=1e-8, err_msg=key)


# --------------------------------------------------------------------------- references

def reference_block(x, p, heads, head_dim, eps=1e-6):
    """One pre-norm block in plain float64 numpy, written independently of
    the layers: RMSNorm, per-head loops, RoPE as a complex rotation, causal
    softmax by explicit prefixes, SwiGLU MLP."""
    b, t, _c = x.shape

    def rms(v, g):
        return v / np.sqrt(np.mean(v ** 2, axis=-1, keepdims=True) + eps) * g

    def rope(v):                                                          # (T, Dh)
        half = head_dim // 2
        freq = 1.0 / 10000.0 ** (np.arange(half) * 2.0 / head_dim)
        z = (v[:, :half] + 1j * v[:, half:]) * np.exp(1j * np.outer(np.arange(len(v)), freq))
        return np.concatenate([z.real, z.imag], axis=1)

    n1 = rms(x, p["norm1/scale"])
    q, k, v = (n1 @ p[f"attention/{w}"] for w in ("query", "key", "value"))
    ctx = np.zeros((b, t, heads * head_dim))
    for bi in range(b):
        for h in range(heads):
            cols = slice(h * head_dim, (h + 1) * head_dim)
            qh, kh, vh = rope(q[bi, :, cols]), rope(k[bi, :, cols]), v[bi, :, cols]
            for i in range(t):
                s = kh[:i + 1] @ qh[i] / math.sqrt(head_dim)            # keys 0..i only
                w = np.exp(s - s.max())
                ctx[bi, i, cols] = (w / w.sum()) @ vh[:i + 1]
    h1 = x + ctx @ p["attention/out"]
    n2 = rms(h1, p["norm2/scale"])
    a = n2 @ p["mlp/wi_0"]
    gate = a / (1 + np.exp(-a))
    return h1 + (gate * (n2 @ p["mlp/wi_1"])) @ p["mlp/wo"]


def test_block_forward_matches_numpy_reference(core64):
    x = np.random.default_rng(11).standard_normal((2, 6, 8))
    block = TransformerBlock(2, 4, 12, name="block")
    params = small_params(block, x.shape[1:], scale=1.5)
    y, _ = block.forward(core64, params, x)
    np.testing.assert_allclose(y, reference_block(x, params, 2, 4), rtol=1e-11, atol=1e-12)


def reference_parallel_gqa_block(x, p, heads, kv_heads, head_dim, eps=1e-6):
    """The PaLM / MaxText 2023 parallel block with grouped-query attention, a relu
    MLP and biases, in float64 numpy with per-head loops (no RoPE): query head h
    reads kv head h // (heads / kv_heads)."""
    b, t, _c = x.shape
    n = x / np.sqrt(np.mean(x ** 2, axis=-1, keepdims=True) + eps) * p["norm/scale"]
    q = n @ p["attention/query"] + p["attention/query_bias"]
    k = n @ p["attention/key"] + p["attention/key_bias"]
    v = n @ p["attention/value"] + p["attention/value_bias"]
    ctx = np.zeros((b, t, heads * head_dim))
    for bi in range(b):
        for h in range(heads):
            kv = h // (heads // kv_heads)
            qs, ks = slice(h * head_dim, (h + 1) * head_dim), slice(kv * head_dim, (kv + 1) * head_dim)
            for i in range(t):
                s = k[bi, :i + 1, ks] @ q[bi, i, qs] / math.sqrt(head_dim)
                w = np.exp(s - s.max())
                ctx[bi, i, qs] = (w / w.sum()) @ v[bi, :i + 1, ks]
    attn = ctx @ p["attention/out"] + p["attention/out_bias"]
    mlp = np.maximum(n @ p["mlp/wi"] + p["mlp/wi_bias"], 0) @ p["mlp/wo"] + p["mlp/wo_bias"]
    return x + attn + mlp


def test_parallel_gqa_block_matches_numpy_reference(core64):
    x = np.random.default_rng(17).standard_normal((2, 6, 8))
    block = TransformerBlock(4, 2, 12, kv_heads=2, block="parallel", mlp_activation="relu",
                             use_bias=True, rotary=False, name="block")
    params = small_params(block, x.shape[1:], scale=1.5)
    assert {k for k in params if k.endswith("bias")} == {
        "attention/query_bias", "attention/key_bias", "attention/value_bias",
        "attention/out_bias", "mlp/wi_bias", "mlp/wo_bias"}
    assert params["attention/key"].shape == (8, 4) and params["attention/query"].shape == (8, 8)
    y, _ = block.forward(core64, params, x)
    np.testing.assert_allclose(y, reference_parallel_gqa_block(x, params, 4, 2, 2), rtol=1e-11,
                               atol=1e-12)


def test_fused_qkv_is_the_three_projections_with_grouped_columns(core64):
    """A fused (C, (H+2K) Dh) projection whose columns are, per kv head, its query
    heads then its key then its value head computes what the three projections do;
    its gradient is theirs, regrouped."""
    heads, kv_heads, dh = 4, 2, 3
    g = heads // kv_heads
    x = np.random.default_rng(18).standard_normal((2, 5, 6))
    split = CausalSelfAttention(heads, dh, kv_heads=kv_heads, rotary=False, use_bias=True)
    fused = CausalSelfAttention(heads, dh, kv_heads=kv_heads, rotary=False, use_bias=True,
                                fused_qkv=True)
    p = small_params(split, x.shape[1:], scale=1.5)

    def grouped(q, k, v):                                                # (..., columns)
        lead = q.shape[:-1]
        return np.concatenate([q.reshape(*lead, kv_heads, g, dh), k.reshape(*lead, kv_heads, 1, dh),
                               v.reshape(*lead, kv_heads, 1, dh)], axis=-2).reshape(*lead, -1)

    pf = {"qkv": grouped(p["query"], p["key"], p["value"]), "out": p["out"],
          "qkv_bias": grouped(p["query_bias"], p["key_bias"], p["value_bias"])}
    assert fused.param_shapes((5, 6)) == {k: v.shape for k, v in pf.items()}
    y, cache = split.forward(core64, p, x)
    yf, cache_f = fused.forward(core64, pf, x)
    np.testing.assert_allclose(yf, y, rtol=1e-12, atol=1e-12)
    dy = np.random.default_rng(19).standard_normal(y.shape)
    dx, grads = split.backward(core64, p, cache, dy)
    dxf, grads_f = fused.backward(core64, pf, cache_f, dy)
    np.testing.assert_allclose(dxf, dx, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(grads_f["qkv"], grouped(grads["query"], grads["key"], grads["value"]),
                               rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(grads_f["qkv_bias"], grouped(grads["query_bias"], grads["key_bias"],
                                                            grads["value_bias"]), rtol=1e-12)


def test_causal_mask_future_tokens_do_not_change_earlier_logits(core64):
    model = build_model("transformer", (8,), 13, **TINY)
    params = float64_model_params(model)
    x, _ = tokens((2, 8), 13, seed=12)
    before = model.predict(core64, params, x)
    for j in (3, 7):
        changed = x.copy()
        changed[:, j] = (changed[:, j] + 5) % 13
        after = model.predict(core64, params, changed)
        np.testing.assert_array_equal(after[:, :j], before[:, :j])
        assert np.abs(after[:, j:] - before[:, j:]).max() > 1e-3


def test_rope_depends_on_relative_position_only():
    rng = np.random.default_rng(13)
    dh, t = 8, 12
    cos, sin = rope_tables(t, dh)
    q, k = rng.standard_normal(dh), rng.standard_normal(dh)
    qr = apply_rope(np.tile(q, (t, 1)), cos, sin)                         # q at every position
    kr = apply_rope(np.tile(k, (t, 1)), cos, sin)
    dots = qr @ kr.T                                                      # (m, n) -> q_m . k_n
    for offset in range(-3, 4):
        diagonal = np.diagonal(dots, offset)
        np.testing.assert_allclose(diagonal, diagonal[0], rtol=1e-12, atol=1e-12)
    assert np.ptp(np.diagonal(dots, 0)) < 1e-12 and abs(dots[0, 0] - dots[0, 5]) > 1e-3
    np.testing.assert_allclose(qr[0], q)                                  # position 0: identity
    np.testing.assert_allclose(np.linalg.norm(qr, axis=1), np.linalg.norm(q))  # a rotation
    np.testing.assert_allclose(apply_rope(qr, cos, sin, inverse=True), np.tile(q, (t, 1)),
                               atol=1e-12)


# --------------------------------------------------------------------------- remat

def _step(model, params, x, y):
    core = TensorCore(get_chip_spec("v4").core, numerics=True)
    loss, grads = model.loss_and_grads(core, params, x, y)
    records = core.take_records()
    return loss, grads, records


CUSTOM = {"query_proj": "device", "context": "offload", "mlpwi_1": "offload"}
POLICIES = ["none", "full", "minimal", "save_dot_except_mlp", "save_dot_except_mlpwi",
            "save_qkv_proj", "save_dot_with_context_except_mlp", "save_out_proj",
            "qkv_proj_offloaded", "minimal_offloaded", "custom"]
OFFLOADING = ("qkv_proj_offloaded", "minimal_offloaded", "custom")


def recompute_closed_form(policy, attention, block, t=16, c=16, h=2, kv=1, dh=4, f=32):
    """MXU FLOPs per example and block that backward reruns under ``policy``, by hand:
    the projections, attention products (T = 16 is one flash block, computed whole)
    and MLP input products whose outputs a policy does not keep; the output
    projection when the sequential block does not keep out_proj; never the MLP's."""
    q, k, o, w = 2 * t * c * h * dh, 2 * t * c * kv * dh, 2 * t * h * dh * c, 2 * t * c * f
    product = 2 * t * t * h * dh                                          # q.k^T or p.v
    out = 0 if block == "parallel" else o
    return {"none": 0,
            "full": q + 2 * k + 2 * product + out + 2 * w,
            "minimal": 2 * product,
            "save_dot_except_mlp": 2 * product + 2 * w,
            "save_dot_except_mlpwi": 2 * product + 2 * w,
            "save_qkv_proj": 2 * product + out + 2 * w,
            # the context kept: flash reruns nothing, the dot product its scores
            "save_dot_with_context_except_mlp": (product if attention == "dot_product" else 0)
            + 2 * w,
            "save_out_proj": q + 2 * k + 2 * product + 2 * w,
            # what save_qkv_proj and minimal keep, in host memory: the same recomputation
            "qkv_proj_offloaded": 2 * product + out + 2 * w,
            "minimal_offloaded": 2 * product,
            # q kept, k and v rerun; context offloaded: flash reruns nothing, the dot
            # product still reruns its scores; mlpwi_1 offloaded, wi_0 rerun
            "custom": 2 * k + (product if attention == "dot_product" else 0) + out + w}[policy]


@pytest.mark.parametrize("attention, block", [("flash", "sequential"), ("dot_product", "parallel")])
def test_remat_policies_bit_identical_with_closed_form_recomputation(attention, block):
    """MaxText's policies and a custom one with offloads: the same loss and gradients
    bit for bit; the MXU FLOPs recorded are the hardware FLOPs, whose excess over no
    remat is each policy's recomputation in closed form; offloaded tensors go to the
    host after forward and come back before backward (their bytes in bf16); the
    HBM they keep falls as the policy keeps less."""
    options = dict(TINY, embed_dim=16, mlp_dim=32, kv_heads=1, attention=attention, block=block)
    models = {r: build_model("transformer", (16,), 20, **options, remat=r,
                             remat_custom=CUSTOM if r == "custom" else None) for r in POLICIES}
    params = models["none"].init_params(3)
    x, y = tokens((4, 16), 20, seed=14)
    results = {r: _step(m, params, x, y) for r, m in models.items()}
    loss0, grads0, _ = results["none"]
    base = models["none"].hardware_flops_per_example()
    for r, (loss, grads, records) in results.items():
        assert loss == loss0
        for k in grads0:
            np.testing.assert_array_equal(grads[k], grads0[k], err_msg=f"{r} {k}")
        hardware = models[r].hardware_flops_per_example()
        assert sum(rec.flops for rec in records if rec.unit == "mxu") == 4 * hardware, r
        assert hardware - base == 2 * recompute_closed_form(r, attention, block), r
        host = [rec for rec in records if rec.unit == "host"]
        assert bool(host) == (r in OFFLOADING), r
    offloaded = {r: {rec.name.split("/")[-1] for rec in results[r][2] if rec.unit == "host"}
                 for r in ("qkv_proj_offloaded", "minimal_offloaded")}
    assert offloaded["qkv_proj_offloaded"] == {"query_proj", "key_proj", "value_proj"}
    assert offloaded["minimal_offloaded"] == {"query_proj", "key_proj", "value_proj", "mlpwi_0",
                                              "mlpwi_1"} | ({"out_proj"} if block == "sequential"
                                                            else set())
    host = {rec.name: rec for rec in results["custom"][2] if rec.unit == "host"}
    context = 4 * 16 * 2 * 4 * 2 + (4 * 2 * 16 * 4 if attention == "flash" else 0)  # o, lse
    assert host["block1/offload/context"].hbm_bytes == host["block2/reload/context"].hbm_bytes == context
    assert host["block1/offload/mlpwi_1"].hbm_bytes == 4 * 16 * 32 * 2
    assert len(host) == 8 and all(rec.seconds == rec.hbm_bytes / 1.6e10 for rec in host.values())
    device = {r: m.activation_memory(4).device_bytes for r, m in models.items()}
    assert device["none"] > device["minimal"] > device["save_qkv_proj"] > device["full"]
    for offloading, on_device in (("qkv_proj_offloaded", "save_qkv_proj"),
                                  ("minimal_offloaded", "minimal")):  # the same bytes, on host
        memory = models[offloading].activation_memory(4)
        assert memory.device_bytes == device["full"]
        assert memory.host_bytes == device[on_device] - device["full"]
    assert models["custom"].activation_memory(4).host_bytes == 2 * (context + 4 * 16 * 32 * 2)


def test_activation_memory_in_closed_form():
    """bf16 activations by hand, per example: the kept tensors of every block (T C the
    block input; q H Dh + 2 K Dh per position; the summed attention output T C; the
    MLP input products T F each), the ids (int32), the final norm's x_hat and
    1/sigma and the output layer's input; the residual stream split over tensor."""
    t, c, h, kv, dh, f, v = 16, 16, 2, 1, 4, 32, 20
    options = dict(TINY, embed_dim=c, mlp_dim=f, kv_heads=kv, head_dim=dh)
    rest = 4 * t + 2 * t * c * 2 + 4 * t
    minimal = build_model("transformer", (t,), v, **options, remat="minimal")
    per_block = (t * c + t * (h + 2 * kv) * dh + t * c + 2 * t * f) * 2
    assert minimal.activation_memory(3).device_bytes == 3 * (2 * per_block + rest)
    full = build_model("transformer", (t,), v, **options, remat="full")
    assert full.activation_memory(3, precision="fp32").device_bytes == 3 * (
        2 * t * c * 4 + 4 * t + 2 * t * c * 4 + 4 * t)
    # tensor 2: heads 1 of 2, kv heads ... (kv 1 cannot split: None); F / 2
    gqa2 = build_model("transformer", (t,), v, **{**options, "kv_heads": 2}, remat="minimal")
    split = (t * c // 2 + t * (1 + 2 * 1) * dh + t * c // 2 + 2 * t * f // 2) * 2
    rest2 = 4 * t + 2 * t * c * 2 // 2 + 4 * t // 2
    assert gqa2.activation_memory(1, tensor=2).device_bytes == 2 * split + rest2
    assert minimal.activation_memory(1, tensor=2) is None
    # transient: one block's whole backward set (the logits are the device program's)
    assert minimal.activation_memory(2).transient_bytes == 2 * minimal.layers[
        1].transient_bytes((t, c), 2)


@pytest.mark.parametrize("remat", POLICIES)
def test_block_cache_elements_count_what_forward_keeps(core64, remat):
    block = TransformerBlock(2, 4, 12, remat=remat, remat_custom=CUSTOM if remat == "custom" else None,
                             name="block")
    x = np.random.default_rng(15).standard_normal((3, 5, 8))
    _, cache = block.forward(core64, small_params(block, (5, 8)), x, training=True)

    def count(c):
        if isinstance(c, dict):
            return sum(count(v) for v in c.values())
        return c.size

    assert count(cache) == 3 * block.cache_elements((5, 8))


# --------------------------------------------------------------------------- counts

def test_param_count_closed_form():
    # C 32, H 2, Dh 16 (D 32), F 128, L 2, V 50, T 64, rmsnorm, gated, tied:
    # blocks 2 * (2*32 + 4*32*32 + 3*32*128) = 2 * 16448; final norm 32; table 50*32
    model = build_model("transformer", (64,), 50, embed_dim=32, heads=2, layers=2)
    assert model.num_params == 2 * (2 * 32 + 4 * 32 * 32 + 3 * 32 * 128) + 32 + 50 * 32 == 34528
    assert model.config.param_count() == model.num_params
    for options in ({"tied_embeddings": False}, {"positions": "learned"},
                    {"norm": "layernorm", "mlp_activation": "gelu", "heads": 4, "head_dim": 6}):
        m = build_model("transformer", (10,), 7, **{"embed_dim": 12, "heads": 3, "layers": 3,
                                                    **options})
        assert m.config.param_count() == m.num_params == sum(p.size for p in m.init_params(0).values())
    untied = build_model("transformer", (64,), 50, embed_dim=32, heads=2, layers=2,
                         tied_embeddings=False)
    assert untied.num_params == model.num_params + 32 * 50
    assert sum(n for _, n in model.gradient_buckets()) == model.num_params
    assert model.gradient_buckets()[-1] == ("embed", 50 * 32)


OPTION_GRID = [dict(zip(("kv_heads", "block", "mlp_activation", "use_bias", "fused_qkv", "norm",
                         "tied_embeddings", "positions"), values))
               for values in itertools.product((None, 1, 3), ("sequential", "parallel"),
                                               ("gated_silu", "gated_gelu", "gelu", "relu"),
                                               (False, True), (False, True),
                                               ("rmsnorm", "layernorm"), (True, False),
                                               ("rotary", "learned"))]


def test_param_count_closed_form_over_every_option():
    """``param_count`` against the parameters the layers really create, over every
    combination of kv heads, block, activation, biases, fused qkv, norm, tied output
    and positions (768 models, 6 heads x 4 of 12 wide); ``matmul_param_count``
    against the matrices the MXU multiplies by."""
    for options in OPTION_GRID:
        model = build_model("transformer", (10,), 7, embed_dim=12, heads=6, head_dim=4, mlp_dim=20,
                            layers=2, **options)
        shapes = model.param_shapes
        assert model.config.param_count() == sum(math.prod(s) for s in shapes.values()), options
        matrices = sum(math.prod(s) for k, s in shapes.items()
                       if len(s) == 2 and not k.endswith(("embedding", "position")))
        tied_logits = 7 * 12 if options["tied_embeddings"] else 0       # the table, as (C, V)
        assert model.config.matmul_param_count() == matrices + tied_logits, options


# training-steps.md: the T1 and T5 rows (MaxText 2023 s = 32; Llama 3.1 8B on v6e-256)
T1 = {"embed_dim": 10240, "heads": 32, "head_dim": 256, "mlp_dim": 32768, "layers": 32,
      "mlp_activation": "relu", "block": "parallel", "tied_embeddings": True}
T5 = {"embed_dim": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128, "mlp_dim": 14336,
      "layers": 32, "mlp_activation": "gated_silu", "tied_embeddings": False}


def test_maxtext_2023_formula_reproduces_t1():
    """T1: 32.5B parameters (training-steps.md's table); 328 TFLOP/s per chip is 71.47%
    of v5p's 459 TFLOP/s, so the step implied by the MFU is the step implied by the
    TFLOP/s (9.9 s, the published step issue 23 quotes), with the causal halving."""
    cfg = TransformerConfig(vocabulary=32768, sequence_length=2048, **T1)
    assert cfg.param_count() == pytest.approx(32.5e9, abs=0.05e9)
    flops = maxtext_tflops_2023(cfg, 8, causal_halving=True)
    n = cfg.param_count()                                                 # by hand
    assert flops == 6 * n * 2048 * 8 + 12 * 32 * 32 * 256 * 2048 ** 2 * 8 / 2
    step_from_mfu = flops / (0.7147 * 459e12)
    assert flops / step_from_mfu / 1e12 == pytest.approx(328, rel=5e-3)
    assert step_from_mfu == pytest.approx(9.9, abs=0.05)
    assert maxtext_tflops_2023(cfg, 8) > flops                            # unhalved: more


def test_maxtext_2025_formula_reproduces_t5():
    """T5: 417.397 TFLOP/s per device at the logged 4.546 s step; by hand from
    training-steps.md's per-layer terms."""
    cfg = TransformerConfig(vocabulary=128256, sequence_length=8192, **T5)
    flops = maxtext_tflops_2025(cfg, 4)
    b, t, e, f, v = 4, 8192, 4096, 14336, 128256
    ffn = 2 * b * t * f * e * 2 + 2 * b * t * f * e
    qkv, proj = 2 * b * t * e * (32 + 2 * 8) * 128, 2 * b * t * e * 32 * 128
    want = 3 * ((ffn + qkv + proj) * 32 + 2 * b * t * e * v) + 3 * 4 * b * t * t * 32 * 128 * 32
    assert flops == want
    assert flops / 4.546 / 1e12 == pytest.approx(417.397, rel=5e-3)
    assert flops / 4.546 / (4 * 8192) / 6 < 1e10                         # sanity: 6 N per token


def test_model_flops_formula():
    model = build_model("transformer", (64,), 50, embed_dim=32, heads=2, layers=2, mlp_dim=96)
    n = 2 * (4 * 32 * 32 + 3 * 32 * 96) + 32 * 50                          # matmul weights
    assert model.model_flops_per_example() == 6 * n * 64 + 12 * 2 * 64 * 64 * 32
    assert model.model_flops_per_example() == model.flops_per_example()    # layer by layer
    full = build_model("transformer", (64,), 50, embed_dim=32, heads=2, layers=2, mlp_dim=96,
                       remat="full", attention="dot_product")
    per_block_forward = 2 * 64 * (4 * 32 * 32 + 3 * 32 * 96) + 4 * 64 * 64 * 32
    assert full.hardware_flops_per_example() == (full.model_flops_per_example()
                                                 + 2 * (per_block_forward - 2 * 64 * 96 * 32))
    # flash: T = 64 is one block, computed whole and masked: 2 products forward, 7 backward
    # (the scores and dP recomputed by both kernels), against 2 and 4; no remat
    attention_product = 2 * 64 * 64 * 32                                  # 2 T^2 H Dh
    assert model.hardware_flops_per_example() == (model.model_flops_per_example()
                                                  + 2 * 3 * attention_product)


# --------------------------------------------------------------------------- options

@pytest.mark.parametrize("options, message", [
    ({"heads": 0}, "transformer: option heads must be a positive integer, got 0"),
    ({"embed_dim": 30, "heads": 4}, "transformer: option head_dim is needed"),
    ({"head_dim": 5}, "transformer: option head_dim must be even for rotary positions"),
    ({"mlp_activation": "swish"},
     "transformer: option mlp_activation must be one of gated_silu, gated_gelu, gelu, relu, "
     "got 'swish'"),
    ({"kv_heads": 3}, "transformer: option kv_heads must divide heads 4 (1, 2, 4), got 3"),
    ({"kv_heads": 0}, "transformer: option kv_heads must be a positive integer, got 0"),
    ({"block": "serial"},
     "transformer: option block must be one of sequential, parallel, got 'serial'"),
    ({"use_bias": "yes"}, "transformer: option use_bias must be true or false, got 'yes'"),
    ({"fused_qkv": 1}, "transformer: option fused_qkv must be true or false, got 1"),
    ({"norm": "batch"}, "transformer: option norm must be one of rmsnorm, layernorm"),
    ({"positions": "alibi"}, "transformer: option positions must be one of rotary, learned"),
    ({"remat": "some"}, "transformer: option remat must be one of none, full, minimal, "
                        "save_dot_except_mlp, save_dot_except_mlpwi, save_qkv_proj, "
                        "save_dot_with_context_except_mlp, save_out_proj, qkv_proj_offloaded, "
                        "minimal_offloaded, custom"),
    ({"remat": "full", "remat_custom": {"context": "device"}},
     "transformer: option remat_custom needs remat: custom, got remat: full"),
    ({"remat": "custom", "remat_custom": {"contexts": "device"}},
     "transformer: option remat_custom: unknown tensor 'contexts'; tensors: decoder_layer_input, "
     "query_proj, key_proj, value_proj, qkv_proj, out_proj, mlpwi, mlpwi_0, mlpwi_1, mlpwo, "
     "context"),
    ({"remat": "custom", "remat_custom": {"context": "host"}},
     "transformer: option remat_custom.context must be one of remat, device, offload, got 'host'"),
    ({"remat": "custom", "remat_custom": ["context"]},
     "transformer: option remat_custom must be a mapping of tensor name to remat | device | "
     "offload"),
    ({"tied_embeddings": "yes"}, "transformer: option tied_embeddings must be true or false"),
    ({"layers": 1.5}, "transformer: option layers must be a positive integer"),
    ({"dropout": 0.1}, "unknown option(s) 'dropout' for model 'transformer'"),
])
def test_bad_options_are_one_line_errors(options, message):
    with pytest.raises(ValueError) as err:
        build_model("transformer", (16,), 20, **options)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_bad_input_shape():
    with pytest.raises(ValueError, match="transformer: input_shape must be"):
        build_model("transformer", (4, 4), 20)
    assert build_model("transformer", (5,), 20, head_dim=7, positions="learned").config.head_dim == 7


def test_next_token_logits_match_the_full_forward(core):
    model = build_model("transformer", (8,), 13, **TINY, positions="learned")
    params = model.init_params(0)
    x, _ = tokens((2, 8), 13, seed=16)
    full = model.predict(core, params, x)
    np.testing.assert_array_equal(model.next_token_logits(core, params, x), full[:, -1])
    np.testing.assert_allclose(model.next_token_logits(core, params, x[:, :3]), full[:, 2],
                               rtol=1e-5, atol=1e-6)                       # shorter context
    longer = np.concatenate([x[:, :2], x], axis=1)                        # window: last 8
    np.testing.assert_array_equal(model.next_token_logits(core, params, longer), full[:, -1])


def test_sample_is_seeded_and_follows_the_logits(core):
    model = build_model("transformer", (6,), 13, **TINY)
    params = model.init_params(0)
    params["embed/embedding"] *= 40                                       # peaked logits (tied)
    a = model.sample(core, params, [1, 2], length=9, temperature=1.0, seed=3)
    assert a == model.sample(core, params, [1, 2], length=9, temperature=1.0, seed=3)
    assert len(a) == 9 and all(0 <= i < 13 for i in a)
    greedy = model.sample(core, params, [1, 2], length=9, temperature=1e-6, seed=4)
    ids = [1, 2]
    for _ in range(9):                                                    # argmax by hand
        ids.append(int(model.next_token_logits(core, params, np.array([ids]))[0].argmax()))
    assert greedy == ids[2:]
    core.take_records()


# --------------------------------------------------------------------------- AdamW

def test_adamw_matches_optax_formula_and_decouples_decay(core):
    assert "adamw" in OPTIMIZER_NAMES
    opt = build_optimizer("adamw", learning_rate=0.1, weight_decay=0.5)
    p = {"w": np.array([1.0, -2.0, 3.0], np.float32)}
    g1 = {"w": np.array([0.5, 0.0, -1.0], np.float32)}
    g2 = {"w": np.array([-0.25, 0.0, 2.0], np.float32)}
    p1, state = opt.update(core, g1, opt.init(p), p, 1)
    p2, _ = opt.update(core, g2, state, p1, 2)
    m = v = np.zeros(3)
    for step, g, before, after in ((1, g1, p, p1), (2, g2, p1, p2)):
        gw = g["w"].astype(np.float64)
        m = 0.9 * m + 0.1 * gw
        v = 0.999 * v + 0.001 * gw ** 2
        m_hat, v_hat = m / (1 - 0.9 ** step), v / (1 - 0.999 ** step)
        w = before["w"].astype(np.float64)
        expected = w - 0.1 * (m_hat / (np.sqrt(v_hat) + 1e-8) + 0.5 * w)   # optax.adamw
        np.testing.assert_allclose(after["w"], expected, rtol=1e-6)
    # a zero gradient still decays: p (1 - lr wd); Adam's part is 0
    assert p2["w"][1] == pytest.approx(-2.0 * 0.95 * 0.95, rel=1e-6)
    with pytest.raises(ValueError, match="adamw: weight_decay must be a number >= 0"):
        build_optimizer("adamw", weight_decay=-1.0)


# --------------------------------------------------------------------------- training

@pytest.mark.slow  # several seconds: the slow tier (make test stays under 3 minutes)
def test_tiny_transformer_learns_the_python_docs(core):
    """2 layers, embed 32, 2 heads, T 64, batch 16, AdamW, numerics on."""
    data = load_dataset("text", sequence_length=64, seed=0)
    model = build_model("transformer", (64,), data.num_classes, embed_dim=32, heads=2, layers=2,
                        mlp_dim=64)
    params = model.init_params(0)
    opt = build_optimizer("adamw", learning_rate=3e-3, weight_decay=1e-4)
    state = opt.init(params)
    rng = np.random.default_rng(0)
    losses = []
    start = time.perf_counter()
    for step in range(1, 81):
        idx = rng.choice(len(data.x_train), 16, replace=False)
        loss, grads = model.loss_and_grads(core, params, data.x_train[idx], data.y_train[idx])
        params, state = opt.update(core, grads, state, params, step)
        core.take_records()
        losses.append(loss)
    wall = time.perf_counter() - start
    initial, final = np.mean(losses[:3]), np.mean(losses[-5:])
    print(f"tiny transformer: loss {initial:.3f} -> {final:.3f} in 80 steps, {wall:.1f} s wall")
    assert initial == pytest.approx(math.log(data.num_classes), rel=0.05)
    assert final < 0.8 * initial
    test_loss, _ = model.evaluate(core, params, data.x_test[:64], data.y_test[:64])
    assert test_loss < 0.8 * initial

"""MaxText's April 2023 attention (training-steps.md T9): the T5 relative position bias and
the QK norm. Their gradients against central differences (float64), the layer's forward
against plain numpy written here, the bias's buckets against T5's closed form, their
costs (the bias table's products once per step, timing-only records equal to executed
ones), and the sharded program equal to one device. No Ray."""

from __future__ import annotations

import math

import numpy as np
import pytest

from chip import TensorCore, get_chip_spec
from pod.workloads import CausalSelfAttention, TransformerBlock, TransformerConfig, build_model
from pod.workloads.attention import RELPOS_BUCKETS, relative_position_buckets
from tests.pod.programs.test_transformer import FP32_ATOL, global_losses, sharded, single
from tests.pod.workloads.test_transformer import (
    check_grads,
    float64_model_params,
    small_params,
    tokens,
)
from tests.pod.workloads.test_workloads import numeric_grad

pytestmark = pytest.mark.usefixtures("one_blas_thread")

MAXTEXT_2023 = {"positions": "relative", "use_qk_norm": True, "attention": "dot_product",
                "block": "parallel", "mlp_activation": "relu"}


def t5_bucket(relative_position: int, num_buckets: int = 32, max_distance: int = 128) -> int:
    """T5's ``_relative_position_bucket`` for one pair, unidirectional, transcribed from
    Raffel et al.'s Mesh TensorFlow code (key - query = ``relative_position``)."""
    n = max(-relative_position, 0)
    max_exact = num_buckets // 2
    if n < max_exact:
        return n
    large = max_exact + int(math.log(n / max_exact) / math.log(max_distance / max_exact)
                            * (num_buckets - max_exact))
    return min(large, num_buckets - 1)


def test_buckets_are_t5s_causal_buckets():
    """Exact below 16 positions back, logarithmic to 128, the last bucket beyond; a key
    after the query is bucket 0 (masked anyway)."""
    t = 300
    got = relative_position_buckets(t)
    assert got.shape == (t, t) and got.dtype == np.int32
    for i in (0, 5, 16, 40, 127, 128, 299):
        assert [int(v) for v in got[i]] == [t5_bucket(j - i) for j in range(t)], i
    assert got[20, 4] == 16 and got[40, 8] == 21 and got[299, 0] == 31 and got[3, 9] == 0


def reference_attention(x, p, heads, kv_heads, head_dim, eps=1e-6):
    """MaxText 2023's attention in float64 numpy, per head and query: q, k and v
    projections, each head's q and k RMS-normalised over Dh (one scale each), the
    scaled scores plus the head's relative position bias, causal softmax."""
    b, t, _ = x.shape
    q, k, v = (x @ p[w] for w in ("query", "key", "value"))

    def rms(z, g):
        return z / np.sqrt(np.mean(z ** 2, axis=-1, keepdims=True) + eps) * g

    ctx = np.zeros((b, t, heads * head_dim))
    for bi in range(b):
        for h in range(heads):
            kv = h // (heads // kv_heads)
            qs = slice(h * head_dim, (h + 1) * head_dim)
            ks = slice(kv * head_dim, (kv + 1) * head_dim)
            qh, kh = rms(q[bi, :, qs], p["query_norm"]), rms(k[bi, :, ks], p["key_norm"])
            for i in range(t):
                s = kh[:i + 1] @ qh[i] / math.sqrt(head_dim)
                s = s + [p["relpos_bias"][h, t5_bucket(j - i)] for j in range(i + 1)]
                w = np.exp(s - s.max())
                ctx[bi, i, qs] = (w / w.sum()) @ v[bi, :i + 1, ks]
    return ctx @ p["out"]


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_attention_with_bias_and_qk_norm_matches_numpy(core64, kv_heads):
    x = np.random.default_rng(1).standard_normal((2, 20, 6))
    layer = CausalSelfAttention(4, 3, kv_heads=kv_heads, rotary=False, qk_norm=True,
                                relative_bias=True)
    params = small_params(layer, x.shape[1:], scale=1.5)
    params["relpos_bias"] = np.random.default_rng(2).standard_normal((4, RELPOS_BUCKETS))
    assert layer.param_shapes((20, 6))["relpos_bias"] == (4, RELPOS_BUCKETS)
    y, _ = layer.forward(core64, params, x)
    np.testing.assert_allclose(y, reference_attention(x, params, 4, kv_heads, 3), rtol=1e-10,
                               atol=1e-12)


@pytest.mark.parametrize("options", [
    {"qk_norm": True}, {"relative_bias": True, "rotary": False},
    {"qk_norm": True, "relative_bias": True, "rotary": False, "kv_heads": 2},
    {"qk_norm": True, "fused_qkv": True, "kv_heads": 2, "attention": "flash"}],
    ids=["qk_norm", "relpos", "both-gqa", "qk_norm-fused-flash"])
def test_attention_option_grads(core64, options):
    x = np.random.default_rng(4).standard_normal((2, 5, 4))
    layer = CausalSelfAttention(4, 2, **{"attention": "dot_product", **options})
    params = small_params(layer, x.shape[1:], scale=1.5)
    if "relpos_bias" in params:
        params["relpos_bias"] = np.random.default_rng(5).standard_normal(
            params["relpos_bias"].shape)
    check_grads(core64, layer, x, params)


@pytest.mark.parametrize("remat", ["none", "full", "minimal"])
def test_maxtext_2023_block_grads(core64, remat):
    x = np.random.default_rng(6).standard_normal((2, 4, 4))
    layer = TransformerBlock(2, 2, 6, block="parallel", mlp_activation="relu", rotary=False,
                             attention="dot_product", qk_norm=True, relative_bias=True,
                             remat=remat, name="block")
    check_grads(core64, layer, x, small_params(layer, x.shape[1:], scale=1.2))


def test_the_whole_2023_model_against_finite_differences(core64):
    model = build_model("transformer", (6,), 11, embed_dim=8, heads=2, head_dim=4, mlp_dim=12,
                        layers=2, **MAXTEXT_2023)
    params = float64_model_params(model)
    x, y = tokens((2, 6), 11, seed=3)
    _, grads = model.loss_and_grads(core64, params, x, y)
    for key in ("block1/attention/relpos_bias", "block2/attention/query_norm",
                "block1/attention/key_norm", "block2/attention/key"):
        entries = np.arange(min(params[key].size, 8))
        want = numeric_grad(lambda: model.evaluate(core64, params, x, y)[0], params[key],
                            entries=entries).reshape(-1)[entries]
        np.testing.assert_allclose(grads[key].reshape(-1)[entries], want, rtol=1e-6,
                                   atol=1e-9, err_msg=key)


def _records(layer, x, execute):
    core = TensorCore(get_chip_spec("v4").core)
    core.execute = execute
    params = {k: np.zeros(s, np.float32) for k, s in layer.param_shapes(x.shape[1:]).items()}
    y, cache = layer.forward(core, params, x)
    layer.backward(core, params, cache, np.zeros(y.shape, np.float32) if execute else y)
    return [(r.name, r.unit, r.flops, r.hbm_bytes, r.seconds) for r in core.take_records()]


def test_the_bias_costs_two_table_products_per_step_and_timing_only_records_the_same():
    """Forward: the (H, 32) table times the (32, T T) one-hot, once whatever the batch;
    backward: the examples' score gradients summed, then (H, T T) x (T T, 32). A
    timing-only pass records every op as the executed one."""
    h, t = 4, 64
    layer = TransformerBlock(h, 8, 32, block="parallel", rotary=False,
                             attention="dot_product", qk_norm=True, relative_bias=True,
                             remat="full", name="b")
    x = np.random.default_rng(7).standard_normal((3, t, 16)).astype(np.float32)
    executed = _records(layer, x, True)
    assert executed == _records(layer, x, False)
    table = [r for r in executed if "relpos_bias" in r[0]]
    names = [r[0] for r in table]
    # full remat: the forward's product, again in the recomputation, then the gradient
    assert names == ["b/attention/relpos_bias", "b/attention/relpos_bias",
                     "b/attention/relpos_bias_bwd/sum", "b/attention/relpos_bias_bwd/d_table"]
    assert table[0][2] == table[3][2] == 2 * h * RELPOS_BUCKETS * t * t
    assert table[2][1] == "vpu"
    norms = {r[0] for r in executed if "_norm/" in r[0]}
    assert norms >= {"b/attention/query_norm/rsqrt", "b/attention/key_norm/normalize",
                     "b/attention/query_norm/d_scale", "b/attention/key_norm/dx"}


@pytest.mark.parametrize("mesh", [{"data": 2, "fsdp": 2, "tensor": 2}, {"tensor": 4}])
def test_the_sharded_2023_model_trains_as_one_device(mesh):
    """fp32, 2 steps: the relative bias table split over tensor by heads, the qk norms
    replicated; the sharded parameters within FP32_ATOL of one device's."""
    ref, losses = single("fp32", 2, **MAXTEXT_2023)
    program, devices = sharded("fp32", tuple(mesh.items()), 2, **MAXTEXT_2023)
    whole = program.assemble([d[0] for d in devices])
    for key, value in ref.items():
        np.testing.assert_allclose(whole[key], value, atol=FP32_ATOL, err_msg=key)
    np.testing.assert_allclose(global_losses(program, devices), losses, rtol=1e-6)


def test_relative_positions_need_the_dot_product_kernel():
    with pytest.raises(ValueError, match=r"^transformer: option positions relative needs "
                                         r"attention: dot_product .*got attention: flash$"):
        TransformerConfig(vocabulary=8, sequence_length=4, positions="relative")


def test_splash_blocks_set_how_much_of_the_causal_triangle_is_computed():
    """MaxText's sa_block_q / sa_block_kv: at T 8192, 2048-blocks compute 10 of 16 blocks
    (62.5% of the square) against 136 of 256 (53.1%) at 512; query blocks of 2048 with key
    blocks of 512 compute 40 blocks of 2048 x 512, the same 62.5%."""
    from pod.workloads.flash import causal_blocks

    square = causal_blocks(8192, 2048, 2048)
    assert square.score_elements == 10 * 2048 ** 2 and square.masked_elements == 4 * 2048 ** 2
    split = causal_blocks(8192, 2048, 512)
    assert dict(split.shapes) == {(2048, 512, False): 24, (2048, 512, True): 16}
    assert split.score_elements == square.score_elements
    base = {"embed_dim": 64, "heads": 2, "layers": 1}
    small, big = (build_model("transformer", (8192,), 32, **{**base, "sa_block_q": q,
                                                              "sa_block_kv": q})
                  for q in (512, 2048))
    assert big.config.sa_block_q == 2048
    ratio = (big.hardware_flops_per_example() - small.hardware_flops_per_example()) / (
        9 * 2 * 32 * 2 * (10 * 2048 ** 2 - 136 * 512 ** 2))               # 2+7 products, 2 heads
    assert ratio == pytest.approx(1.0)

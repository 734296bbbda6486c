"""The transformer with mixture-of-experts blocks (issue 24, item 3): gradients against
finite differences, remat variants bit-identical, parameter counts (Mixtral 8x7B's
published 46.7B total / 12.9B active), FLOPs of the active parameters, one-line errors."""

from __future__ import annotations

import re

import numpy as np
import pytest

from chip import TensorCore, get_chip_spec
from pod.workloads import TransformerBlock, TransformerConfig, build_model
from pod.workloads.moe import MoE
from pod.workloads.transformer import maxtext_tflops_2025, router_loads
from tests.pod.workloads.test_transformer import check_grads, float64_model_params, small_params, tokens

pytestmark = pytest.mark.usefixtures("one_blas_thread")

MOE = {"embed_dim": 8, "heads": 2, "head_dim": 4, "mlp_dim": 6, "layers": 2, "experts": 4,
       "experts_per_token": 2}
#: Mixtral 8x7B ([Mixtral] Jiang et al. 2024, Table 1; MaxText models/mixtral-8x7b.yml)
MIXTRAL = {"embed_dim": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128, "mlp_dim": 14336,
           "layers": 32, "tied_embeddings": False, "experts": 8, "experts_per_token": 2}


def _moe_block(remat, cf):
    return TransformerBlock(2, 4, 6, remat=remat, name="block",
                            moe={"experts": 4, "experts_per_token": 2, "capacity_factor": cf,
                                 "aux_loss_weight": 0.0})


@pytest.mark.parametrize("remat,cf", [("none", 0.0), ("minimal", 1.5), ("full", 0.0)])
def test_moe_block_grads(core64, remat, cf):
    """Without the balancing loss (the probe loss is sum(r * y) alone)."""
    x = np.random.default_rng(6).standard_normal((2, 4, 8))
    block = _moe_block(remat, cf)
    params = small_params(block, x.shape[1:], scale=1.2)
    params["mlp/router"] = np.random.default_rng(1).standard_normal((8, 4)) * 2.0
    check_grads(core64, block, x, params)


def test_model_loss_with_the_balancing_loss_against_finite_differences(core64):
    model = build_model("transformer", (5,), 11, **MOE, moe_aux_loss_weight=0.3)
    params = float64_model_params(model)
    for key in params:
        if key.endswith("router"):
            params[key] = np.random.default_rng(2).standard_normal(params[key].shape) * 3.0
    x, y = tokens((3, 5), 11, seed=9)
    loss, grads = model.loss_and_grads(core64, params, x, y)
    out, caches = model.forward(core64, model.prepare_params(core64, params), x, training=True)
    aux = sum(load.aux_loss for load in router_loads(caches))
    assert 0 < aux and loss == pytest.approx(model.evaluate(core64, params, x, y)[0] + aux,
                                             rel=1e-12)
    rng, eps = np.random.default_rng(10), 1e-6
    for key, p in params.items():
        for i in rng.choice(p.size, size=min(p.size, 4), replace=False):
            up, down = p.copy(), p.copy()
            up.flat[i] += eps
            down.flat[i] -= eps
            numeric = (model.loss_and_grads(core64, {**params, key: up}, x, y)[0]
                       - model.loss_and_grads(core64, {**params, key: down}, x, y)[0]) / (2 * eps)
            assert grads[key].flat[i] == pytest.approx(numeric, rel=1e-5, abs=1e-8), key


def test_remat_variants_bit_identical_and_the_flops_of_active_parameters():
    """Dropless with T k a multiple of E: the grouped products run exactly the active
    rows, so the recorded MXU FLOPs are the model's (4 sequences x fwd + bwd; dot-product
    attention computes the whole T x T, as the model FLOPs count it)."""
    options = dict(MOE, embed_dim=16, mlp_dim=32, experts=8, attention="dot_product")
    models = {r: build_model("transformer", (16,), 20, **options, remat=r)
              for r in ("none", "minimal", "full")}
    params = models["none"].init_params(3)
    x, y = tokens((4, 16), 20, seed=14)
    results = {}
    for r, m in models.items():
        core = TensorCore(get_chip_spec("v4").core)
        loss, grads = m.loss_and_grads(core, params, x, y)
        results[r] = loss, grads, sum(rec.flops for rec in core.take_records() if rec.unit == "mxu")
    for r in ("minimal", "full"):
        assert results[r][0] == results["none"][0]
        for k, g in results["none"][1].items():
            np.testing.assert_array_equal(results[r][1][k], g, err_msg=f"{r} {k}")
    for r, m in models.items():
        assert results[r][2] == 4 * m.hardware_flops_per_example(), r
    assert results["none"][2] == 4 * models["none"].model_flops_per_example()
    cfg = models["none"].config
    active = cfg.layers * (16 * 24 + 8 * 16 + 16 * 8 + 2 * 3 * 16 * 32) + 16 * 20  # H Dh = 8
    assert cfg.matmul_param_count() == active
    assert models["none"].model_flops_per_example() == 6 * active * 16 + 12 * 2 * 16 * 16 * 8


def test_param_count_is_every_array_and_active_the_k_experts():
    model = build_model("transformer", (12,), 30, **MOE)
    cfg = model.config
    assert cfg.param_count() == model.num_params == sum(p.size for p in model.init_params(0).values())
    block = model.layers[1]
    assert isinstance(block.mlp, MoE) and block.param_shapes((12, 8))["mlp/wi_0"] == (4, 8, 6)
    dense_mlp = 3 * 8 * 6
    assert cfg.param_count() - cfg.param_count(active=True) == 2 * (4 - 2) * dense_mlp


def test_mixtral_8x7b_has_its_published_parameter_counts():
    """46.7B parameters, 12.9B active per token ([Mixtral] sec. 2: "47B" and "13B";
    Mistral AI's announcement: 46.7B total, 12.9B per token)."""
    cfg = TransformerConfig(vocabulary=32000, sequence_length=4096, **MIXTRAL)
    assert cfg.param_count() == pytest.approx(46.7e9, abs=0.05e9)
    assert cfg.param_count(active=True) == pytest.approx(12.9e9, abs=0.05e9)
    # by hand: attention 4096 x 6144 + 4096 x 4096, 8 experts of 3 x 4096 x 14336, router
    # 4096 x 8, two norms; 32 layers; untied embedding and output 2 x 32000 x 4096; final norm
    layer = 4096 * 6144 + 4096 * 4096 + 8 * 3 * 4096 * 14336 + 4096 * 8 + 2 * 4096
    assert cfg.param_count() == 32 * layer + 2 * 32000 * 4096 + 4096


def test_maxtext_2025_formula_counts_k_experts_and_the_router():
    cfg = TransformerConfig(vocabulary=32000, sequence_length=4096, **MIXTRAL)
    dense = TransformerConfig(vocabulary=32000, sequence_length=4096,
                              **{**MIXTRAL, "experts": 0})
    b, t, e = 1, 4096, 4096
    router = 2 * b * t * e * 8
    ffn = 2 * b * t * 14336 * e * 3
    assert maxtext_tflops_2025(cfg, 1) - maxtext_tflops_2025(dense, 1) == 3 * 32 * (router + ffn)


@pytest.mark.parametrize("options,message", [
    ({"experts": 1}, "option experts must be 0 (a dense MLP) or an integer >= 2, got 1"),
    ({"experts": 4, "experts_per_token": 5}, "option experts_per_token must be 1 .. experts 4"),
    ({"experts": 4, "capacity_factor": -1}, "option capacity_factor must be a number >= 0"),
    ({"experts": 64, "capacity_factor": 0.5}, "option capacity_factor 0.5 leaves an expert no "
                                              "token"),
    ({"experts": 4, "use_bias": True}, "option use_bias must be false with experts"),
    ({"experts": 4, "moe_aux_loss_weight": "high"}, "option moe_aux_loss_weight must be"),
])
def test_bad_moe_options_are_one_line_errors(options, message):
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        TransformerConfig(vocabulary=10, sequence_length=8, **options)
    assert "\n" not in str(info.value)


def test_minimal_remat_keeps_the_attention_products_of_an_moe_block_not_the_experts():
    """``minimal`` is checkpoint_dots_with_no_batch_dims: an MoE's expert products are
    batched over the experts, so they are recomputed; a dense block keeps its MLP's."""
    moe, dense = _moe_block("minimal", 1.5), TransformerBlock(2, 4, 6, remat="minimal")
    assert {"q", "k", "v", "out_proj"} <= moe.kept() and {"u", "u0", "u1"}.isdisjoint(moe.kept())
    assert {"q", "k", "v", "out_proj", "u"} <= dense.kept()
    x = (4, 8)   # minimal keeps what save_dot_except_mlp keeps in an MoE block, more in a dense
    assert moe.cache_elements(x) == _moe_block("save_dot_except_mlp", 1.5).cache_elements(x)
    assert dense.cache_elements(x) > TransformerBlock(
        2, 4, 6, remat="save_dot_except_mlp").cache_elements(x)

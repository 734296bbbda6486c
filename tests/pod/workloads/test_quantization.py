"""AQT int8 training as MaxText runs it (``quantization: int8``, pod.workloads.quantization):
the per-channel int8 product against numpy, what runs in int8 and what stays bf16, the
int8 rate, a model that still trains, MFU against the bf16 peak. No Ray."""

from __future__ import annotations

import numpy as np
import pytest

from chip import PrecisionError, TensorCore, get_chip_spec, mxu_matmul_aqt_int8, mxu_matmul_int8
from pod.config.plan import build_plan
from pod.config.scenario import parse_scenario
from pod.errors import ScenarioError
from pod.report.stats import mfu
from pod.runtime.timing import TimingPod
from pod.workloads import TransformerConfig, TransformerModel, build_optimizer

pytestmark = pytest.mark.usefixtures("one_blas_thread")

TINY = {"vocabulary": 32, "sequence_length": 16, "embed_dim": 32, "heads": 4, "head_dim": 8,
        "mlp_dim": 64, "layers": 2}


def test_the_product_is_per_channel_int8_with_int32_sums():
    """numpy written here: a's rows and b's columns each scaled by their own max|.| / 127,
    rounded, multiplied as integers, rescaled. Rows of very different sizes keep their
    precision (a per-tensor scale would flatten the small rows to 0)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((6, 40)).astype(np.float32) * np.logspace(-3, 1, 6)[:, None]
    b = rng.standard_normal((40, 5)).astype(np.float32)
    sa = np.abs(a).max(axis=1, keepdims=True) / 127
    sb = np.abs(b).max(axis=0, keepdims=True) / 127
    qa, qb = np.clip(np.rint(a / sa), -127, 127), np.clip(np.rint(b / sb), -127, 127)
    want = (qa.astype(np.int64) @ qb.astype(np.int64)) * sa * sb
    got = mxu_matmul_aqt_int8(a, b)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    exact = a.astype(np.float64) @ b
    small = slice(0, 1)                                                   # max|a| ~ 1e-3
    per_channel = np.abs(got[small] - exact[small]).max()
    per_tensor = np.abs(mxu_matmul_int8(a, b)[small] - exact[small]).max()
    assert per_channel < 0.02 * np.abs(exact[small]).max() < per_tensor


@pytest.mark.parametrize("chip, ratio", [("v5e", 2), ("v6e", 2), ("v4", 1)])
def test_a_quantized_product_runs_at_the_int8_rate_and_reads_bf16(chip, ratio):
    """The MXU record: int8 cycles (an int8-precision core's), bf16 operands and output
    in HBM; the quantisation fused into it and the dequantisation in its epilogue."""
    spec = get_chip_spec(chip).core
    core = TensorCore(spec)
    a, b = np.ones((512, 1024), np.float32), np.ones((1024, 768), np.float32)
    core.matmul(a, b, name="p", quantized=True)
    product, quant, dequant = core.take_records()  # the prologue follows its product
    int8 = TensorCore(spec, precision="int8")
    assert product.mxu_cycles == int8.mxu_cycles(512, 1024, 768)
    bf16 = TensorCore(spec).mxu_cycles(512, 1024, 768)
    assert product.mxu_cycles == pytest.approx(bf16 / ratio, rel=0.01)
    assert product.hbm_bytes == 2 * (512 * 1024 + 1024 * 768) + 2 * 512 * 768
    assert (quant.name, quant.fused_into, quant.hbm_bytes) == ("p/quantize", "p", 0)
    assert quant.flops == 5.0 * (512 * 1024 + 1024 * 768)
    assert (dequant.name, dequant.fused_into, dequant.flops) == ("p/dequantize", "p",
                                                                 2.0 * 512 * 768)
    with pytest.raises(PrecisionError, match=r"TPU v2 and v3 have none"):
        TensorCore(get_chip_spec("v3").core).matmul(a, b, quantized=True)


def _records(options, execute=True, chip="v5e"):
    model = TransformerModel(TransformerConfig(**TINY, **options))
    core = TensorCore(get_chip_spec(chip).core, execute=execute)
    params = model.init_params(0)
    x = np.random.default_rng(1).integers(0, 32, (2, 16))
    loss, _ = model.loss_and_grads(core, params, x, x)
    return loss, core.take_records()


def _split(records):
    """MXU record names: (those run quantised, those run in bf16); a product is quantised
    when its fused quantisation follows it (dot-product attention's dq kernel product and
    the query projection's weight gradient are both "d_query": one of each)."""
    int8, bf16 = set(), set()
    for i, r in enumerate(records):
        if r.unit == "mxu":
            fused = []
            for after in records[i + 1:]:
                if after.fused_into != r.name:
                    break
                fused.append(after.name)
            (int8 if f"{r.name}/quantize" in fused else bf16).add(r.name)
    return int8, bf16


@pytest.mark.parametrize("options", [{}, {"attention": "dot_product", "remat": "full"},
                                     {"experts": 4, "experts_per_token": 2,
                                      "capacity_factor": 1.5}],
                         ids=["flash", "dot_product-full", "moe"])
def test_what_is_int8_and_what_stays_bf16(options):
    """Int8: each projection's forward, input-gradient and weight-gradient products (the
    MLP's or the experts'). bf16: the attention kernel, the logits, the router."""
    _, records = _records({**options, "quantization": "int8"})
    int8, bf16 = _split(records)
    att = ("query", "key", "value")
    mlp = ("mlp/wi_0", "mlp/wi_1", "mlp/wo", "mlp/d_wo", "mlp/d_hidden", "mlp/d_wi_0",
           "mlp/dx_wi_0", "mlp/d_wi_1", "mlp/dx_wi_1")
    for block in ("block1", "block2"):
        want = {f"{block}/attention/{p}" for w in att for p in (w, f"d_{w}", f"dx_{w}")}
        want |= {f"{block}/attention/{p}" for p in ("out", "d_out", "d_context")}
        want |= {f"{block}/{p}" for p in mlp}
        assert {n for n in int8 if n.startswith(block + "/")} == want
    assert not {n for n in bf16 if "/mlp/w" in n or n.endswith(("/query", "/out"))}
    kernel = {n.split("/", 2)[2] for n in bf16 if "/attention/" in n}
    assert kernel == ({"flash_fwd", "flash_bwd_dkv", "flash_bwd_dq"} if not options else
                      {"scores", "context", "d_probs", "d_value", "d_query", "d_key"}
                      if "attention" in options else {"flash_fwd", "flash_bwd_dkv",
                                                      "flash_bwd_dq"})
    assert {"unembed/fwd", "unembed/dW", "unembed/dx"} <= bf16
    if "experts" in options:
        assert {"block1/mlp/router", "block1/mlp/d_router", "block1/mlp/dx_router"} <= bf16
    # without quantization nothing is int8
    assert _split(_records(options)[1])[0] == set()


def test_a_timing_only_pass_records_the_int8_ops_too():
    _, executed = _records({"quantization": "int8"})
    _, shaped = _records({"quantization": "int8"}, execute=False)
    assert [(r.name, r.seconds, r.hbm_bytes) for r in shaped] == [
        (r.name, r.seconds, r.hbm_bytes) for r in executed]


def test_an_int8_model_trains_close_to_bf16():
    """AdamW, 12 steps on a repeated batch: the int8 loss falls as the bf16 one does."""
    losses = {}
    for q in ("", "int8"):
        model = TransformerModel(TransformerConfig(**TINY, quantization=q))
        core, opt = TensorCore(get_chip_spec("v5e").core), build_optimizer("adamw",
                                                                           learning_rate=1e-2)
        params = model.init_params(0)
        state = opt.init(params)
        rng = np.random.default_rng(2)
        x, y = rng.integers(0, 32, (4, 16)), rng.integers(0, 32, (4, 16))
        losses[q] = []
        for step in range(1, 13):
            loss, grads = model.loss_and_grads(core, params, x, y)
            params, state = opt.update(core, grads, state, params, step)
            losses[q].append(loss)
    assert losses["int8"][-1] < 0.5 * losses["int8"][0]
    assert abs(losses["int8"][-1] - losses[""][-1]) < 0.15 * losses[""][-1]


def _scenario(**options):
    return parse_scenario({
        "name": "aqt", "pod": {"chip": "v5e", "chips": 4, "mesh": {"fsdp": 4}},
        "model": {"name": "transformer", "options": {"embed_dim": 2048, "heads": 16,
                                                     "head_dim": 128, "mlp_dim": 8192,
                                                     "layers": 2, **options}},
        "data": {"name": "synthetic_text", "options": {"vocabulary": 256,
                                                       "sequence_length": 1024,
                                                       "num_examples": 40}},
        "training": {"global_batch": 16, "steps": 1}})


def test_an_int8_step_is_faster_and_its_mfu_is_against_the_bf16_peak():
    """Timing-only on v5e, matmuls large enough to be MXU-bound: the same model FLOPs
    in less time (but not half: attention, logits and the VPU stay as they were); MFU
    divides them by the pod's bf16 peak (an int8 run's 'effective MFU', as the
    published int8 rows)."""
    stats = {q: TimingPod(build_plan(_scenario(quantization=q), timing_only=True)).step(0)
             for q in ("", "int8")}
    assert stats["int8"].model_flops == stats[""].model_flops
    assert 0.5 * stats[""].step_seconds < stats["int8"].step_seconds < 0.85 * stats[
        ""].step_seconds
    bf16_peak = 4 * get_chip_spec("v5e").core.peak_bf16_flops_per_s
    assert stats["int8"].peak_flops_per_s == pytest.approx(bf16_peak)
    assert stats["int8"].mfu == pytest.approx(mfu(stats["int8"].model_flops,
                                                  stats["int8"].step_seconds, bf16_peak))


def test_int8_is_refused_where_it_is_not_maxtexts():
    with pytest.raises(ScenarioError, match=r"^training\.precision: 'int8' would run every "
                                            r"matmul .* model\.options\.quantization: int8"):
        build_plan(parse_scenario({**_scenario().model_dump(mode="json", exclude_none=True),
                                   "training": {"global_batch": 16, "steps": 1,
                                                "precision": "int8"}}), timing_only=True)
    v2 = _scenario(quantization="int8").model_dump(mode="json", exclude_none=True)
    v2["pod"] = {"chip": "v2", "chips": 2, "mesh": {"fsdp": 4}}
    with pytest.raises(ScenarioError, match=r"^model\.options\.quantization 'int8' needs an "
                                            r"MXU with int8 throughput, which TPU v2"):
        build_plan(parse_scenario(v2), timing_only=True)
    with pytest.raises(ValueError, match=r"option quantization must be .* got 'int4'"):
        TransformerConfig(**TINY, quantization="int4")

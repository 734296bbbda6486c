"""ResNet: its layers against central finite differences (float64, numerics
off) and a direct-loop numpy reference, the model against torchvision's
published parameter and MAC counts, the timing-only path against the
executed one (the same records), and a small ResNet trained data-parallel on
real digits (loss falls, replicas bit-identical)."""

from __future__ import annotations

import numpy as np
import pytest

from chip import TensorCore, get_chip_spec
from pod.workloads import (BatchNormalization, GlobalAveragePooling2D, MaxPool2DSame, ResidualBlock,
                           build_model, build_optimizer)
from tests.pod.workloads.test_workloads import check_layer_grads, numeric_grad

pytestmark = pytest.mark.usefixtures("one_blas_thread")


# --------------------------------------------------------------------------- references

def conv_reference(x, w, stride):
    """'same' convolution by direct loops over output pixels (TF padding: the odd
    pixel after), x (B, H, W, C), w (KH, KW, C, F) -> (B, Ho, Wo, F)."""
    b, h, wd, c = x.shape
    kh, kw, _, f = w.shape
    ho, wo = -(-h // stride), -(-wd // stride)
    pad_h = max((ho - 1) * stride + kh - h, 0)
    pad_w = max((wo - 1) * stride + kw - wd, 0)
    xp = np.zeros((b, h + pad_h, wd + pad_w, c))
    xp[:, pad_h // 2:pad_h // 2 + h, pad_w // 2:pad_w // 2 + wd] = x
    out = np.zeros((b, ho, wo, f))
    for i in range(ho):
        for j in range(wo):
            patch = xp[:, i * stride:i * stride + kh, j * stride:j * stride + kw, :]  # (B, KH, KW, C)
            out[:, i, j, :] = np.tensordot(patch, w, axes=([1, 2, 3], [0, 1, 2]))
    return out


def bn_reference(x, gamma, beta, eps=1e-5):
    mean = x.mean(axis=(0, 1, 2))
    var = ((x - mean) ** 2).mean(axis=(0, 1, 2))
    return gamma * (x - mean) / np.sqrt(var + eps) + beta


def block_reference(x, p, bottleneck, stride, projection):
    relu = lambda v: np.maximum(v, 0)  # noqa: E731
    bn = lambda v, k: bn_reference(v, p[f"{k}/gamma"], p[f"{k}/beta"])  # noqa: E731
    if bottleneck:
        h = relu(bn(conv_reference(x, p["conv1/kernel"], 1), "bn1"))
        h = relu(bn(conv_reference(h, p["conv2/kernel"], stride), "bn2"))
        h = bn(conv_reference(h, p["conv3/kernel"], 1), "bn3")
    else:
        h = relu(bn(conv_reference(x, p["conv1/kernel"], stride), "bn1"))
        h = bn(conv_reference(h, p["conv2/kernel"], 1), "bn2")
    s = bn(conv_reference(x, p["shortcut_conv/kernel"], stride), "shortcut_bn") if projection else x
    return relu(h + s)


def random_params(layer, input_shape, seed=0):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(v.shape) * (0.3 if k.endswith("kernel") else 1.0) + (
        1.0 if k.endswith("gamma") else 0.0) for k, v in layer.init_params(rng, input_shape).items()}


BLOCKS = {
    "basic-projection-stride2": dict(filters=3, bottleneck=False, stride=2, projection=True),
    "basic-identity": dict(filters=4, bottleneck=False, stride=1, projection=False),
    "bottleneck-projection-stride2": dict(filters=2, bottleneck=True, stride=2, projection=True),
    "bottleneck-identity": dict(filters=1, bottleneck=True, stride=1, projection=False),
}


# --------------------------------------------------------------------------- layers

@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_residual_block_forward_matches_a_direct_loop_reference(core64, name):
    block = ResidualBlock(**BLOCKS[name], name="b")
    x = np.random.default_rng(1).standard_normal((2, 5, 5, 4))           # odd: 'same' padding
    params = random_params(block, x.shape[1:])
    y, _ = block.forward(core64, params, x, training=True)
    want = block_reference(x, params, block.bottleneck, block.stride, block.projection)
    assert y.shape == want.shape == (2, *block.output_shape(x.shape[1:]))
    np.testing.assert_allclose(y, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_residual_block_grads_match_finite_differences(core64, name):
    block = ResidualBlock(**BLOCKS[name], name="b")
    x = np.random.default_rng(2).standard_normal((2, 5, 5, 4))
    check_layer_grads(core64, block, x, training=True, rtol=1e-5, atol=1e-7)


def test_an_identity_shortcut_where_the_shape_changes_is_refused():
    with pytest.raises(ValueError, match="identity shortcut needs stride 1 and 8 input channels"):
        ResidualBlock(8, bottleneck=False, stride=1).output_shape((4, 4, 3))


def test_overlapping_max_pool_forward_and_grads(core64):
    x = np.random.default_rng(3).standard_normal((2, 7, 6, 3))
    pool = MaxPool2DSame(3, 2)
    y, _ = pool.forward(core64, {}, x)
    assert y.shape == (2, 4, 3, 3)
    # 'same' 3x3/2: 7 rows pad 1 before and 1 after (output row 1 covers input rows 1..3);
    # 6 columns pad 0 before and 1 after (output column 2 covers input columns 4..5)
    assert y[1, 1, 2, 0] == x[1, 1:4, 4:6, 0].max()
    assert y[0, 0, 0, 2] == x[0, 0:2, 0:3, 2].max()
    check_layer_grads(core64, pool, x)


def test_max_pool_sends_a_tie_to_the_first_maximum_only(core64):
    x = np.ones((1, 3, 3, 1))
    pool = MaxPool2DSame(3, 2)
    y, cache = pool.forward(core64, {}, x)
    dx, _ = pool.backward(core64, {}, cache, np.ones_like(y))
    # 'same' 3x3/2 on 3 pads 1 before and 1 after: two windows per axis; each
    # window routes to its first in-bounds maximum in row-major order
    want = np.zeros((3, 3))
    want[0, 0] = 1.0                                                      # window (0, 0)
    want[0, 1] += 1.0                                                     # window (0, 1): cols 1..2
    want[1, 0] += 1.0                                                     # window (1, 0)
    want[1, 1] += 1.0                                                     # window (1, 1)
    np.testing.assert_array_equal(dx[0, :, :, 0], want)


def test_global_average_pool_forward_and_grads(core64):
    x = np.random.default_rng(4).standard_normal((3, 4, 5, 2))
    gap = GlobalAveragePooling2D()
    y, _ = gap.forward(core64, {}, x)
    np.testing.assert_allclose(y, x.mean(axis=(1, 2)))
    check_layer_grads(core64, gap, x)


# --------------------------------------------------------------------------- the model

def test_parameter_and_mac_counts_equal_torchvision():
    """torchvision's model table: ResNet-18 11,689,512 parameters and 1.81 GFLOPS,
    ResNet-50 25,557,032 and 4.09 GFLOPS (its "GFLOPS" are multiply-adds)."""
    r18 = build_model("resnet", (224, 224, 3), 1000, depth=18)
    r50 = build_model("resnet", (224, 224, 3), 1000, depth=50)
    assert (r18.name, r18.num_params) == ("resnet18", 11_689_512)
    assert (r50.name, r50.num_params) == ("resnet50", 25_557_032)
    assert r18.forward_flops_per_example() / 2 / 1e9 == pytest.approx(1.81, abs=0.005)
    assert r50.forward_flops_per_example() / 2 / 1e9 == pytest.approx(4.09, abs=0.005)
    # 53 BatchNorms in ResNet-50, each with two running averages
    assert len(r50.state_shapes) == 2 * 53


def test_a_tiny_resnet_model_matches_finite_differences(core64):
    model = build_model("resnet", (6, 6, 2), 3, width=2, blocks=[1, 1], block="basic")
    rng = np.random.default_rng(5)
    params = {k: rng.standard_normal(v.shape) * 0.5 + (1.0 if k.endswith("gamma") else 0.0)
              for k, v in model.init_params(0).items()}
    x = rng.standard_normal((4, 6, 6, 2))
    y = rng.integers(0, 3, 4)
    state = model.init_state()
    loss, grads = model.loss_and_grads(core64, params, x, y, state=state)
    for key in ("stem_conv/kernel", "stage2_block1/conv1/kernel",
                "stage2_block1/shortcut_bn/gamma", "fc/kernel"):
        p = params[key]
        entries = range(0, p.size, max(1, p.size // 12))
        num = numeric_grad(lambda: model.loss_and_grads(core64, params, x, y, state=state)[0], p,
                           entries=entries)
        np.testing.assert_allclose(grads[key].reshape(-1)[list(entries)],
                                   num.reshape(-1)[list(entries)], rtol=1e-5, atol=1e-8,
                                   err_msg=key)


def test_training_moves_the_running_averages_and_evaluation_uses_them(core):
    model = build_model("resnet", (8, 8, 1), 10, width=4, blocks=[1], block="basic")
    x = np.random.default_rng(6).standard_normal((8, 8, 8, 1)).astype(np.float32) * 2 + 1
    y = np.arange(8) % 10
    params, state = model.init_params(0), model.init_state()
    _, _, new = model.loss_grads_and_state(core, params, x, y, state=state)
    assert set(new) == set(state)
    # stem_bn saw the conv of x: its moving mean moved by 0.1 x the batch mean (momentum 0.9)
    assert not np.array_equal(new["stem_bn/moving_mean"], state["stem_bn/moving_mean"])
    assert not np.array_equal(new["stage1_block1/bn2/moving_variance"],
                              state["stage1_block1/bn2/moving_variance"])
    a = model.predict(core, params, x, state=state)
    b = model.predict(core, params, x, state=new)
    assert not np.array_equal(a, b)


@pytest.mark.parametrize("name,options,shape", [
    ("resnet", {"width": 4, "blocks": [1, 1], "block": "bottleneck", "stem": "imagenet"}, (32, 32, 3)),
    ("resnet", {"width": 4, "blocks": [1, 1], "block": "basic"}, (8, 8, 1)),
    ("cnn", {}, (8, 8, 1)),
    ("mlp", {"batch_norm": True}, (8, 8, 1)),
], ids=["resnet-bottleneck", "resnet-basic", "cnn", "mlp-bn"])
def test_timing_only_records_equal_the_executed_ones(name, options, shape):
    """A timing-only core skips the products, im2col and VPU work but records
    exactly the ops, FLOPs, bytes and cycles an executing core does."""
    model = build_model(name, shape, 10, **options)
    x = np.random.default_rng(7).standard_normal((4, *shape)).astype(np.float32)
    y = np.arange(4)
    runs = []
    for execute in (True, False):
        core = TensorCore(get_chip_spec("v4").core, numerics=True, execute=execute)
        opt = build_optimizer("adam", learning_rate=0.01)
        params = model.init_params(0)
        _, grads, _ = model.loss_grads_and_state(core, params, x, y, state=model.init_state(),
                                                 rng=np.random.default_rng(0))
        opt.update(core, grads, opt.init(params), params, 1)
        runs.append(core.take_records())
    executed, timed = runs
    assert len(executed) == len(timed) > 10
    assert executed == timed


# --------------------------------------------------------------------------- data parallel

def test_a_small_resnet_trains_data_parallel_on_digits():
    """4 chips x 2 TensorCores (v2-8: 8 devices, in process), real digits: the loss
    falls over a few Adam steps and every replica ends bit-identical (BN statistics
    per replica)."""
    from pod.config.plan import build_plan
    from pod.config.scenario import parse_scenario
    from pod.runtime.local import LocalPod

    plan = build_plan(parse_scenario({
        "name": "resnet-dp",
        "pod": {"slice": "v2-8"},
        "model": {"name": "resnet", "options": {"width": 8, "blocks": [1, 1], "block": "basic"}},
        "data": {"name": "digits"},
        "training": {"global_batch": 64, "steps": 10,
                     "optimizer": {"name": "adam", "learning_rate": 0.01}},
        "metrics": {"port": 0},
    }))
    with LocalPod(plan) as pod:
        losses = [pod.step(s).loss for s in range(plan.steps)]
        assert pod.replicas_identical()
        start = plan.model.init_params(0)
        after = pod.shards()[7].params
        assert any(not np.array_equal(start[k], after[k]) for k in start)
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.3, losses


def test_a_conv_with_patches_on_chip_reads_its_input_once():
    """HBM bytes in bf16 (2 per element in and out, [PALLAS]): with the patches in HBM
    each GEMM reads the (M, K) patch matrix and col2im is a VPU pass; on chip the
    forward and dW read x, dx writes x's shape, and there is no col2im pass. The
    MXU cycles are the same."""
    from pod.workloads import Conv2D

    x = np.zeros((2, 6, 6, 3), np.float32)
    m, k, n = 2 * 3 * 3, 3 * 3 * 3, 4                                     # stride 2: 3x3 outputs
    runs = {}
    for in_hbm in (True, False):
        conv = Conv2D(n, 3, stride=2, use_bias=False, im2col_in_hbm=in_hbm, name="c")
        core = TensorCore(get_chip_spec("v4").core, numerics=True)
        params = conv.init_params(np.random.default_rng(0), x.shape[1:])
        y, cache = conv.forward(core, params, x)
        conv.backward(core, params, cache, np.ones_like(y))
        runs[in_hbm] = {r.name: r for r in core.take_records()}
    hbm, chip = runs[True], runs[False]
    assert set(hbm) == {"c/fwd", "c/dW", "c/dx", "c/col2im"}
    assert set(chip) == {"c/fwd", "c/dW", "c/dx"}
    w = k * n
    assert hbm["c/fwd"].hbm_bytes == 2 * (m * k + w) + 2 * m * n
    assert chip["c/fwd"].hbm_bytes == 2 * (x.size + w) + 2 * m * n
    assert chip["c/dW"].hbm_bytes == 2 * (x.size + m * n) + 2 * w
    assert chip["c/dx"].hbm_bytes == 2 * (m * n + w) + 2 * x.size
    for name in chip:
        assert chip[name].mxu_cycles == hbm[name].mxu_cycles > 0

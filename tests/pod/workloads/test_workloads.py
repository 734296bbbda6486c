"""pod.workloads: gradients against finite differences, convolution against a
direct loop, bf16 numerics, optimizers against closed forms, determinism, and
a short training run on digits. No Ray."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pod.workloads import (DATASET_NAMES, MODEL_NAMES, OPTIMIZER_NAMES, Conv2D, Dense, Dropout,
                           Flatten, MaxPool2D, ReLU, build_model, build_optimizer, load_dataset,
                           softmax_cross_entropy)
from pod.workloads.layers import same_padding

pytestmark = pytest.mark.usefixtures("one_blas_thread")


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


# --------------------------------------------------------------------------- helpers

def numeric_grad(f, x: np.ndarray, eps: float = 1e-6, entries=None) -> np.ndarray:
    """Central differences of scalar f at x (float64), all entries or the
    given flat indices (others left 0)."""
    g = np.zeros_like(x)
    flat, gflat = x.reshape(-1), g.reshape(-1)
    for i in (range(flat.size) if entries is None else entries):
        old = flat[i]
        flat[i] = old + eps
        up = f()
        flat[i] = old - eps
        down = f()
        flat[i] = old
        gflat[i] = (up - down) / (2 * eps)
    return g


def check_layer_grads(core, layer, x, *, training=False, seed=None, rtol=1e-6, atol=1e-8):
    """Loss = sum(r * layer(x)) for a fixed random r; compares backward's dx
    and parameter grads with central differences."""
    rng = np.random.default_rng(0)
    params = {k: rng.standard_normal(v.shape) for k, v in
              layer.init_params(rng, x.shape[1:]).items()}                  # float64
    drop_rng = (lambda: np.random.default_rng(seed)) if seed is not None else (lambda: None)
    y, cache = layer.forward(core, params, x, training=training, rng=drop_rng())
    r = rng.standard_normal(y.shape)

    def loss():
        out, _ = layer.forward(core, params, x, training=training, rng=drop_rng())
        return float(np.sum(r * out))

    dx, grads = layer.backward(core, params, cache, r)
    assert dx.shape == x.shape and dx.dtype == np.float64
    np.testing.assert_allclose(dx, numeric_grad(loss, x), rtol=rtol, atol=atol)
    assert grads.keys() == params.keys()
    for k, p in params.items():
        assert grads[k].shape == p.shape
        np.testing.assert_allclose(grads[k], numeric_grad(loss, p), rtol=rtol, atol=atol, err_msg=k)


# --------------------------------------------------------------------------- layers

def test_dense_grads(core64):
    x = np.random.default_rng(1).standard_normal((3, 5))
    check_layer_grads(core64, Dense(4), x)


@pytest.mark.parametrize("kernel,stride,padding,shape", [
    (2, 1, "same", (2, 5, 4, 3)),
    (3, 2, "same", (2, 6, 5, 2)),
    (3, 1, "valid", (1, 5, 6, 2)),
])
def test_conv2d_grads(core64, kernel, stride, padding, shape):
    x = np.random.default_rng(2).standard_normal(shape)
    check_layer_grads(core64, Conv2D(4, kernel, stride=stride, padding=padding), x)


def test_relu_grads(core64):
    x = np.random.default_rng(3).standard_normal((4, 7))
    x[np.abs(x) < 0.05] = 0.5                                            # keep away from the kink
    check_layer_grads(core64, ReLU(), x)


def test_maxpool_grads_distinct_values(core64):
    # distinct values 1 apart: finite differences never cross a tie; odd
    # sizes check the cropped last row / column gets zero gradient
    rng = np.random.default_rng(4)
    x = rng.permutation(2 * 5 * 7 * 3).reshape(2, 5, 7, 3).astype(np.float64)
    check_layer_grads(core64, MaxPool2D(2), x)


def test_maxpool_tied_maxima_go_to_first_max_only(core64):
    pool = MaxPool2D(2)
    x = np.array([[1.0, 1.0, 0.0, 3.0],                                  # window A: all 4 tied
                  [1.0, 1.0, 2.0, 3.0],                                  # window B: (0,1),(1,1) tie
                  [0.0, 5.0, 4.0, 0.0],                                  # window C: (1,0),(0,1) tie
                  [5.0, 0.0, 4.0, 4.0]])                                 # window D: 3 tied
    x = x.reshape(1, 4, 4, 1)
    y, cache = pool.forward(core64, {}, x)
    np.testing.assert_array_equal(y.reshape(2, 2), [[1.0, 3.0], [5.0, 4.0]])
    dy = np.array([10.0, 20.0, 30.0, 40.0]).reshape(1, 2, 2, 1)
    dx, grads = pool.backward(core64, {}, cache, dy)
    expected = np.zeros((4, 4))
    # first maximum in row-major window order, found by a plain loop
    for wi in range(2):
        for wj in range(2):
            win = x[0, 2 * wi:2 * wi + 2, 2 * wj:2 * wj + 2, 0]
            for k in range(4):
                i, j = divmod(k, 2)
                if win[i, j] == win.max():
                    expected[2 * wi + i, 2 * wj + j] = dy[0, wi, wj, 0]
                    break
    np.testing.assert_array_equal(dx.reshape(4, 4), expected)
    assert expected[0, 0] == 10 and expected[0, 3] == 20 and expected[2, 1] == 30 and expected[2, 2] == 40
    assert dx.sum() == dy.sum() and grads == {}


def test_dropout_grads_with_fixed_mask(core64):
    x = np.random.default_rng(5).standard_normal((6, 10))
    check_layer_grads(core64, Dropout(0.4), x, training=True, seed=11)


def test_dropout_mask_statistics_and_eval_identity(core64):
    layer = Dropout(0.3)
    x = np.ones((200, 100))
    y, _ = layer.forward(core64, {}, x, training=True, rng=np.random.default_rng(0))
    kept = y != 0
    assert abs(kept.mean() - 0.7) < 0.01
    np.testing.assert_allclose(y[kept], 1 / 0.7)                          # inverted dropout
    y_eval, _ = layer.forward(core64, {}, x, training=False)
    assert y_eval is x
    with pytest.raises(ValueError, match="rate"):
        Dropout(1.0)


def test_flatten_roundtrip(core64):
    x = np.arange(24.0).reshape(2, 3, 2, 2)
    y, cache = Flatten().forward(core64, {}, x)
    assert y.shape == (2, 12)
    dx, _ = Flatten().backward(core64, {}, cache, y)
    np.testing.assert_array_equal(dx, x)


def test_flatten_grads(core64):
    x = np.random.default_rng(12).standard_normal((2, 3, 2, 2))
    check_layer_grads(core64, Flatten(), x)


def test_softmax_cross_entropy_value_grad_and_stability(core64):
    rng = np.random.default_rng(6)
    logits = rng.standard_normal((5, 4)) * 3
    labels = np.array([0, 3, 1, 1, 2])
    loss, dlogits = softmax_cross_entropy(core64, logits, labels)
    p = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)      # naive, fine here
    assert loss == pytest.approx(-np.mean(np.log(p[np.arange(5), labels])), rel=1e-12)
    np.testing.assert_allclose(
        dlogits, numeric_grad(lambda: softmax_cross_entropy(core64, logits, labels)[0], logits),
        rtol=1e-6, atol=1e-9)
    # huge logits: no overflow, exact answer known
    big = np.array([[1000.0, 0.0], [0.0, 1000.0]])
    loss, d = softmax_cross_entropy(core64, big, np.array([0, 0]))
    assert loss == pytest.approx(500.0) and np.all(np.isfinite(d))
    with pytest.raises(ValueError):
        softmax_cross_entropy(core64, logits, np.array([0, 1, 2, 3, 4]))


# --------------------------------------------------------------------------- convolution

def direct_conv(x, w, b, stride, pads):
    """Reference: explicit zero padding and a loop over output pixels."""
    (top, bottom), (left, right) = pads
    xp = np.pad(x, ((0, 0), (top, bottom), (left, right), (0, 0)))
    kh, kw, _, f = w.shape
    ho = (xp.shape[1] - kh) // stride + 1
    wo = (xp.shape[2] - kw) // stride + 1
    out = np.zeros((x.shape[0], ho, wo, f))
    for i in range(ho):
        for j in range(wo):
            patch = xp[:, i * stride:i * stride + kh, j * stride:j * stride + kw, :]
            out[:, i, j, :] = np.tensordot(patch, w, axes=([1, 2, 3], [0, 1, 2])) + b
    return out


@pytest.mark.parametrize("shape,kernel,stride,padding,pads", [
    ((2, 5, 6, 3), 2, 1, "same", ((0, 1), (0, 1))),                      # TF/XLA: extra pad after
    ((2, 5, 5, 2), 3, 1, "same", ((1, 1), (1, 1))),
    ((1, 6, 7, 2), 3, 2, "same", ((0, 1), (1, 1))),
    ((1, 6, 7, 2), 3, 2, "valid", ((0, 0), (0, 0))),
])
def test_conv_forward_matches_direct_loop(core64, shape, kernel, stride, padding, pads):
    rng = np.random.default_rng(7)
    x = rng.standard_normal(shape)
    conv = Conv2D(5, kernel, stride=stride, padding=padding)
    params = {k: rng.standard_normal(v.shape) for k, v in conv.init_params(rng, shape[1:]).items()}
    y, _ = conv.forward(core64, params, x)
    expected = direct_conv(x, params["kernel"], params["bias"], stride, pads)
    assert y.shape == expected.shape == (shape[0], *conv.output_shape(shape[1:]))
    np.testing.assert_allclose(y, expected, rtol=1e-12, atol=1e-12)


def test_same_padding_convention():
    assert same_padding(8, 2, 1) == (8, 0, 1)
    assert same_padding(7, 3, 2) == (4, 1, 1)
    assert same_padding(6, 3, 2) == (3, 0, 1)
    assert same_padding(5, 1, 1) == (5, 0, 0)


# --------------------------------------------------------------------------- models

def _float64_params(model, seed):
    """Params in float64 with small random biases (so no pre-activation is
    exactly 0 at a ReLU kink)."""
    rng = np.random.default_rng(seed)
    params = {k: v.astype(np.float64) for k, v in model.init_params(seed).items()}
    for k in params:
        if k.endswith("/bias"):
            params[k] = rng.uniform(-0.1, 0.1, params[k].shape)
    return params


def test_cnn_loss_and_grads_match_finite_differences(core64):
    model = build_model("cnn", (8, 8, 1), 10)                            # dropout on (0.3, 0.3, 0.5)
    params = _float64_params(model, 0)
    rng = np.random.default_rng(8)
    x = rng.standard_normal((4, 8, 8, 1))
    y = np.array([1, 7, 3, 0])

    def loss():
        return model.loss_and_grads(core64, params, x, y, rng=np.random.default_rng(42))[0]

    value, grads = model.loss_and_grads(core64, params, x, y, rng=np.random.default_rng(42))
    assert list(grads) == list(params)
    assert value == pytest.approx(loss(), rel=0, abs=0)
    for k, p in params.items():
        entries = rng.choice(p.size, size=min(p.size, 5), replace=False)
        fd = numeric_grad(loss, p, entries=entries).reshape(-1)[entries]
        np.testing.assert_allclose(grads[k].reshape(-1)[entries], fd, rtol=1e-5, atol=1e-8,
                                   err_msg=k)


def test_mlp_loss_and_grads_match_finite_differences(core64):
    model = build_model("mlp", (4, 3), 5, hidden=[6, 7], dropout=0.25)
    params = _float64_params(model, 1)
    rng = np.random.default_rng(9)
    x, y = rng.standard_normal((5, 4, 3)), np.array([0, 4, 2, 2, 1])

    def loss():
        return model.loss_and_grads(core64, params, x, y, rng=np.random.default_rng(3))[0]

    _, grads = model.loss_and_grads(core64, params, x, y, rng=np.random.default_rng(3))
    for k, p in params.items():
        np.testing.assert_allclose(grads[k], numeric_grad(loss, p), rtol=1e-5, atol=1e-8, err_msg=k)


def test_bf16_path_differs_from_float64_by_a_bf16_sized_error(core, core64, digits):
    model = build_model("cnn", digits.example_shape, 10, dropout=False)
    params32 = model.init_params(0)
    params64 = {k: v.astype(np.float64) for k, v in params32.items()}
    x, y = digits.x_train[:32], digits.y_train[:32]
    loss32, g32 = model.loss_and_grads(core, params32, x, y, rng=None)
    loss64, g64 = model.loss_and_grads(core64, params64, x.astype(np.float64), y, rng=None)
    assert all(g.dtype == np.float32 for g in g32.values())
    assert 1e-7 < abs(loss32 - loss64) / loss64 < 1e-3
    for k in params32:
        rel = np.linalg.norm(g32[k] - g64[k]) / np.linalg.norm(g64[k])
        # bf16 keeps 8 significant bits (unit roundoff 2**-9 ~ 2e-3); every
        # MXU product rounds its inputs, and batch sums cancel, so errors grow
        # layer by layer going back (measured 0.03-0.08 for the convs). Far
        # above float32's ~3e-7: proves the inputs were rounded.
        assert 1e-4 < rel < 0.15, (k, rel)
        cosine = np.vdot(g32[k], g64[k]) / (np.linalg.norm(g32[k]) * np.linalg.norm(g64[k]))
        assert cosine > 0.99, (k, cosine)
    # one bf16 product away from the loss: the error is a few roundoffs
    rel = np.linalg.norm(g32["dense2/kernel"] - g64["dense2/kernel"]) / np.linalg.norm(g64["dense2/kernel"])
    assert rel < 1e-2


def test_weights_rounded_once_per_call(core, monkeypatch, digits):
    import pod.workloads.model as models_module  # where Model.prepare_params rounds
    calls = []
    real = models_module.to_bf16
    monkeypatch.setattr(models_module, "to_bf16", lambda v: calls.append(v.shape) or real(v))
    model = build_model("cnn", digits.example_shape, 10)
    params = model.init_params(0)
    model.loss_and_grads(core, params, digits.x_train[:8], digits.y_train[:8],
                         rng=np.random.default_rng(0))
    assert sorted(calls) == sorted(v.shape for k, v in params.items() if k.endswith("/kernel"))


def test_cnn_shapes_flops_and_summary(core, digits):
    model = build_model("cnn", (8, 8, 1), 10)
    expected_shapes = {"conv1/kernel": (2, 2, 1, 64), "conv1/bias": (64,),
                       "conv2/kernel": (2, 2, 64, 32), "conv2/bias": (32,),
                       "dense1/kernel": (128, 256), "dense1/bias": (256,),
                       "dense2/kernel": (256, 10), "dense2/bias": (10,)}
    params = model.init_params(0)
    assert {k: v.shape for k, v in params.items()} == expected_shapes
    assert list(params) == list(expected_shapes)
    assert all(v.dtype == np.float32 for v in params.values())
    assert all(np.all(params[k] == 0) for k in params if k.endswith("/bias"))
    limit = math.sqrt(6 / (128 + 256))                                    # Glorot uniform
    assert np.abs(params["dense1/kernel"]).max() <= limit
    assert np.abs(params["dense1/kernel"]).max() > 0.9 * limit
    np.testing.assert_array_equal(model.init_params(0)["conv2/kernel"], params["conv2/kernel"])
    assert not np.array_equal(model.init_params(1)["conv2/kernel"], params["conv2/kernel"])

    forward = (2 * 8 * 8 * (2 * 2 * 1) * 64 + 2 * 4 * 4 * (2 * 2 * 64) * 32
               + 2 * 128 * 256 + 2 * 256 * 10)
    assert model.flops_per_example() == 3 * forward
    # the MXU records of a forward pass agree with the shape-derived count
    core.take_records()
    model.predict(core, params, digits.x_test[:16])
    mxu_flops = sum(r.flops for r in core.take_records() if r.unit == "mxu")
    assert mxu_flops == 16 * forward

    rows = model.summary_rows(32)
    assert rows[0] == ("conv1", (32, 8, 8, 64), 2 * 2 * 64 + 64, 2 * 8 * 8 * 4 * 64)
    assert ("pool2", (32, 2, 2, 32), 0, 0) in rows
    assert rows[-1][:3] == ("dense2", (32, 10), 256 * 10 + 10)
    assert sum(r[2] for r in rows) == sum(v.size for v in params.values())
    assert model.activation_bytes(64) == 2 * model.activation_bytes(32) > 0


def test_cnn_dropout_option():
    def rates(m):
        return [layer.rate for layer in m.layers if isinstance(layer, Dropout)]
    assert rates(build_model("cnn", (8, 8, 1), 10)) == [0.3, 0.3, 0.5]
    assert rates(build_model("cnn", (8, 8, 1), 10, dropout=False)) == []
    assert rates(build_model("cnn", (8, 8, 1), 10, dropout=0)) == []
    assert rates(build_model("cnn", (8, 8, 1), 10, dropout=0.1)) == [0.1, 0.1, 0.1]
    assert build_model("cnn", (28, 28, 1), 10).summary_rows()[-1][1] == (None, 10)


def test_unknown_names_and_options_raise_listing_choices():
    with pytest.raises(ValueError, match="cnn, mlp, lstm_classifier, char_lstm"):
        build_model("vgg", (8, 8, 1), 10)
    with pytest.raises(ValueError, match="'width'.*allowed: dropout"):
        build_model("cnn", (8, 8, 1), 10, width=3)
    with pytest.raises(ValueError, match="dropout"):
        build_model("cnn", (8, 8, 1), 10, dropout=1.5)
    with pytest.raises(ValueError, match="hidden"):
        build_model("mlp", (8, 8, 1), 10, hidden=[0])
    with pytest.raises(ValueError, match="sgd, adam"):
        build_optimizer("rmsprop")
    with pytest.raises(ValueError, match="'beta3'.*allowed: learning_rate, beta1, beta2, eps"):
        build_optimizer("adam", beta3=0.1)
    with pytest.raises(ValueError, match="learning_rate"):
        build_optimizer("sgd", learning_rate=-1)
    with pytest.raises(ValueError, match="digits, synthetic, mnist, cifar10, imdb, text"):
        load_dataset("mnist_png")
    with pytest.raises(ValueError, match="'shape'"):
        load_dataset("digits", shape=(8, 8, 1))
    assert MODEL_NAMES == ("cnn", "mlp", "lstm_classifier", "char_lstm", "transformer", "resnet")
    assert OPTIMIZER_NAMES == ("sgd", "adam", "adamw")
    assert DATASET_NAMES == ("digits", "synthetic", "mnist", "cifar10", "imdb", "text",
                             "synthetic_text")


# --------------------------------------------------------------------------- optimizers

def test_adam_first_step_closed_form(core):
    rng = np.random.default_rng(10)
    params = {"w": rng.standard_normal((3, 4)).astype(np.float32), "b": np.zeros(4, np.float32)}
    grads = {"w": rng.standard_normal((3, 4)).astype(np.float32),
             "b": np.array([1e-3, -2.0, 0.0, 5.0], np.float32)}
    lr, eps = 0.01, 1e-7
    opt = build_optimizer("adam", learning_rate=lr)
    state = opt.init(params)
    assert opt.state_bytes(params) == 2 * 16 * 4 == sum(v.nbytes for v in state.values())
    new, new_state = opt.update(core, grads, state, params, 1)
    for k in params:
        g = grads[k].astype(np.float64)
        # step 1: m_hat = g, v_hat = g^2  ->  p - lr * g / (|g| + eps)
        expected = params[k] - lr * g / (np.abs(g) + eps)
        np.testing.assert_allclose(new[k], expected, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(new_state[f"{k}/m"], 0.1 * g, rtol=1e-6)
        np.testing.assert_allclose(new_state[f"{k}/v"], 0.001 * g * g, rtol=1e-5)
        assert new[k].dtype == np.float32
    # inputs untouched
    assert all(np.all(v == 0) for v in state.values())


def test_sgd_momentum_two_steps(core):
    p = {"w": np.array([1.0, -2.0], np.float32)}
    g1, g2 = {"w": np.array([0.5, 1.0], np.float32)}, {"w": np.array([-1.0, 2.0], np.float32)}
    opt = build_optimizer("sgd", learning_rate=0.1, momentum=0.9)
    s = opt.init(p)
    p1, s = opt.update(core, g1, s, p, 1)
    p2, s = opt.update(core, g2, s, p1, 2)
    v2 = 0.9 * np.array([0.5, 1.0]) + np.array([-1.0, 2.0])
    np.testing.assert_allclose(p2["w"], [1.0, -2.0] - 0.1 * np.array([0.5, 1.0]) - 0.1 * v2, rtol=1e-6)
    plain = build_optimizer("sgd", learning_rate=0.5)
    assert plain.init(p) == {} and plain.state_bytes(p) == 0
    np.testing.assert_allclose(plain.update(core, g1, {}, p, 1)[0]["w"], [0.75, -2.5])


# --------------------------------------------------------------------------- determinism

def _read_only(d):
    out = {}
    for k, v in d.items():
        v = v.copy()
        v.flags.writeable = False
        out[k] = v
    return out


def test_determinism_and_read_only_inputs(core, digits):
    model = build_model("cnn", digits.example_shape, 10)
    params = _read_only(model.init_params(3))
    x, y = digits.x_train[:32], digits.y_train[:32]
    runs = [model.loss_and_grads(core, params, x, y, rng=np.random.default_rng(5)) for _ in range(2)]
    assert runs[0][0] == runs[1][0]
    for k in params:
        assert np.array_equal(runs[0][1][k], runs[1][1][k]), k
    opt = build_optimizer("adam", learning_rate=1e-3)
    state = _read_only(opt.init(params))
    grads = _read_only(runs[0][1])
    ups = [opt.update(core, grads, state, params, 7) for _ in range(2)]
    for k in params:
        assert np.array_equal(ups[0][0][k], ups[1][0][k])
        assert not np.array_equal(ups[0][0][k], params[k])
    for k in state:
        assert np.array_equal(ups[0][1][k], ups[1][1][k])
    # a different dropout stream gives different gradients
    other = model.loss_and_grads(core, params, x, y, rng=np.random.default_rng(6))
    assert not np.array_equal(other[1]["dense1/kernel"], runs[0][1]["dense1/kernel"])


def test_costed_ops(core, digits):
    model = build_model("cnn", digits.example_shape, 10)
    params = model.init_params(0)
    core.take_records()
    model.loss_and_grads(core, params, digits.x_train[:8], digits.y_train[:8],
                         rng=np.random.default_rng(0))
    names = {r.name: r.unit for r in core.take_records()}
    assert names["conv1/fwd"] == names["dense1/dW"] == names["conv2/dx"] == "mxu"
    assert "conv1/dx" not in names                                       # input gradient not needed
    for vpu in ("relu1/fwd", "pool1/bwd", "dropout3/fwd", "dense2/bias_add", "xent/log_softmax"):
        assert names[vpu] == "vpu", vpu


# --------------------------------------------------------------------------- datasets

def test_digits_dataset(digits):
    assert digits.x_train.shape[1:] == (8, 8, 1) and digits.x_train.dtype == np.float32
    assert len(digits.x_train) + len(digits.x_test) == 1797
    assert digits.y_train.dtype == np.int64 and digits.num_classes == 10 and not digits.synthetic
    assert digits.x_train.min() == 0.0 and digits.x_train.max() == 1.0
    assert np.all((digits.x_train * 16) == np.round(digits.x_train * 16))  # steps of 1/16
    assert abs(len(digits.x_test) / 1797 - 0.2) < 0.01
    counts = np.bincount(digits.y_test, minlength=10)
    assert counts.min() >= 34 and counts.max() <= 38                     # stratified
    again = load_dataset("digits")
    np.testing.assert_array_equal(again.x_test, digits.x_test)
    assert not np.array_equal(load_dataset("digits", seed=1).y_test, digits.y_test)
    with pytest.raises(ValueError):
        digits.x_train[0, 0, 0, 0] = 5.0                                  # read-only


def test_synthetic_dataset_is_learnable(core):
    ds = load_dataset("synthetic", shape=[6], num_classes=3, num_examples=600, seed=2)
    assert ds.synthetic and ds.x_train.shape == (480, 6) and ds.num_classes == 3
    assert set(np.unique(ds.y_train)) == {0, 1, 2}
    model = build_model("mlp", ds.example_shape, 3, hidden=[16])
    opt = build_optimizer("adam", learning_rate=1e-2)
    params = model.init_params(0)
    state = opt.init(params)
    first = model.evaluate(core, params, ds.x_test, ds.y_test)[0]
    for step in range(1, 101):
        _, g = model.loss_and_grads(core, params, ds.x_train, ds.y_train)
        params, state = opt.update(core, g, state, params, step)
    loss, acc = model.evaluate(core, params, ds.x_test, ds.y_test)
    assert loss < 0.5 * first and acc > 0.8


# --------------------------------------------------------------------------- training

def test_cnn_trains_on_digits(core, digits):
    model = build_model("cnn", digits.example_shape, digits.num_classes)
    opt = build_optimizer("adam", learning_rate=3e-3)
    params = model.init_params(0)
    state = opt.init(params)
    rng = np.random.default_rng(0)
    losses = []
    for step in range(1, 151):
        idx = rng.choice(len(digits.x_train), 64, replace=False)
        loss, grads = model.loss_and_grads(core, params, digits.x_train[idx], digits.y_train[idx],
                                           rng=rng)
        params, state = opt.update(core, grads, state, params, step)
        core.take_records()
        losses.append(loss)
    _, accuracy = model.evaluate(core, params, digits.x_test, digits.y_test)
    assert np.mean(losses[-20:]) < 0.5 * np.mean(losses[:10])
    assert accuracy >= 0.90


def test_model_and_optimizer_pickle_for_ray_actors(core, digits):
    import pickle
    model = build_model("cnn", digits.example_shape, 10)
    clone = pickle.loads(pickle.dumps(model))
    params = model.init_params(0)
    x, y = digits.x_train[:8], digits.y_train[:8]
    a = model.loss_and_grads(core, params, x, y, rng=np.random.default_rng(1))
    b = clone.loss_and_grads(core, params, x, y, rng=np.random.default_rng(1))
    assert a[0] == b[0] and all(np.array_equal(a[1][k], b[1][k]) for k in params)
    assert pickle.loads(pickle.dumps(build_optimizer("adam"))) == build_optimizer("adam")


def test_synthetic_text_is_a_next_token_stream():
    """synthetic_text: ids in [0, V), labels the next id of the same stream."""
    data = load_dataset("synthetic_text", vocabulary=50, sequence_length=12, num_examples=20,
                        test_fraction=0.25)
    assert data.x_train.shape == (15, 12) and data.y_train.shape == (15, 12)
    assert data.num_classes == 50 and data.synthetic
    assert 0 <= data.x_train.min() and data.x_train.max() < 50
    np.testing.assert_array_equal(data.x_train[:, 1:], data.y_train[:, :-1])
    with pytest.raises(ValueError, match="synthetic_text: option vocabulary"):
        load_dataset("synthetic_text", vocabulary=1)

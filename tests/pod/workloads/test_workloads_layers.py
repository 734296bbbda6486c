"""The seed-material layers added for issue 8: average pooling, tanh,
sigmoid, softmax, batch normalization, embedding, LSTM, Dense over
sequences, binary cross-entropy, and the models built from them.

Every backward is checked against central finite differences in float64
(numerics off); forwards against small independent references. No Ray.
"""

from __future__ import annotations

import numpy as np
import pytest

from pod.workloads import (LSTM, AveragePooling2D, BatchNormalization, Dense, Embedding, Sigmoid,
                           Softmax, Tanh, build_model, sigmoid_binary_cross_entropy)
from tests.pod.workloads.test_workloads import check_layer_grads, numeric_grad

pytestmark = pytest.mark.usefixtures("one_blas_thread")


# --------------------------------------------------------------------------- layers

def test_average_pool_forward_and_grads(core64):
    x = np.random.default_rng(1).standard_normal((2, 5, 7, 3))            # odd: cropped edge
    pool = AveragePooling2D(2)
    y, _ = pool.forward(core64, {}, x)
    assert y.shape == (2, 2, 3, 3)
    assert y[1, 1, 2, 0] == pytest.approx(x[1, 2:4, 4:6, 0].mean())
    check_layer_grads(core64, pool, x)


@pytest.mark.parametrize("layer", [Tanh(), Sigmoid(), Softmax()], ids=["tanh", "sigmoid", "softmax"])
def test_activation_grads(core64, layer):
    x = np.random.default_rng(2).standard_normal((3, 4, 5)) * 2
    check_layer_grads(core64, layer, x)


def test_activation_forwards_against_closed_forms(core64):
    x = np.array([[-800.0, -3.0, 0.0, 2.5, 800.0]])
    np.testing.assert_allclose(Sigmoid().forward(core64, {}, x)[0],
                               [[0.0, 1 / (1 + np.exp(3.0)), 0.5, 1 / (1 + np.exp(-2.5)), 1.0]],
                               rtol=1e-12)
    np.testing.assert_allclose(Tanh().forward(core64, {}, x)[0], np.tanh(x))
    p = Softmax().forward(core64, {}, x[:, 1:4])[0]
    e = np.exp([-3.0, 0.0, 2.5])
    np.testing.assert_allclose(p, [e / e.sum()], rtol=1e-12)


@pytest.mark.parametrize("shape", [(6, 4), (3, 2, 3, 4)])
def test_batchnorm_training_grads(core64, shape):
    x = np.random.default_rng(3).standard_normal(shape) * 3 + 1
    check_layer_grads(core64, BatchNormalization(), x, training=True, rtol=1e-5, atol=1e-7)


def test_batchnorm_eval_grads_and_running_averages(core64):
    bn = BatchNormalization(momentum=0.9, epsilon=1e-3)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((8, 3)) * np.array([1.0, 2.0, 0.5]) + np.array([0.0, 5.0, -1.0])
    params = {"gamma": np.array([1.0, 2.0, 0.5]), "beta": np.array([0.0, 1.0, -1.0])}
    state = bn.init_state((3,))
    assert np.all(state["moving_mean"] == 0) and np.all(state["moving_variance"] == 1)
    y, cache = bn.forward(core64, params, x, training=True)
    # the batch's own statistics: per feature, mean beta and std ~ |gamma|
    np.testing.assert_allclose(y.mean(axis=0), params["beta"], atol=1e-12)
    np.testing.assert_allclose(y.std(axis=0), np.abs(params["gamma"]) * np.sqrt(
        x.var(axis=0) / (x.var(axis=0) + 1e-3)), rtol=1e-10)
    new = bn.update_state(core64, state, cache)
    np.testing.assert_allclose(new["moving_mean"], 0.1 * x.mean(axis=0), rtol=1e-6)
    np.testing.assert_allclose(new["moving_variance"], 0.9 + 0.1 * x.var(axis=0), rtol=1e-6)
    # eval mode normalises with the running averages, not the batch's
    y_eval, _ = bn.forward(core64, params, x, training=False, state=new)
    expected = (x - new["moving_mean"]) / np.sqrt(new["moving_variance"] + 1e-3) * params["gamma"] \
        + params["beta"]
    np.testing.assert_allclose(y_eval, expected, rtol=1e-6)
    # eval-mode gradients
    r = rng.standard_normal(y.shape)
    _, cache_eval = bn.forward(core64, params, x, training=False, state=new)
    dx, grads = bn.backward(core64, params, cache_eval, r)

    def loss():
        return float(np.sum(r * bn.forward(core64, params, x, training=False, state=new)[0]))
    np.testing.assert_allclose(dx, numeric_grad(loss, x), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(grads["gamma"], numeric_grad(loss, params["gamma"]), rtol=1e-6)
    with pytest.raises(ValueError, match="running averages"):
        bn.forward(core64, params, x, training=False)


def test_embedding_gather_and_scatter_add_grads(core64):
    emb = Embedding(7, 3)
    ids = np.array([[0, 3, 3, 6], [6, 1, 0, 3]])                          # repeats accumulate
    table = np.random.default_rng(5).standard_normal((7, 3))
    y, cache = emb.forward(core64, {"embeddings": table}, ids)
    assert y.shape == (2, 4, 3)
    np.testing.assert_array_equal(y[1, 3], table[3])
    r = np.random.default_rng(6).standard_normal(y.shape)
    dx, grads = emb.backward(core64, {"embeddings": table}, cache, r)
    assert dx is None

    def loss():
        return float(np.sum(r * emb.forward(core64, {"embeddings": table}, ids)[0]))
    np.testing.assert_allclose(grads["embeddings"], numeric_grad(loss, table), rtol=1e-7, atol=1e-9)
    assert np.all(grads["embeddings"][[2, 4, 5]] == 0)                   # unused rows
    with pytest.raises(ValueError, match=r"\[0, 7\).*\[0, 7\]"):
        emb.forward(core64, {"embeddings": table}, np.array([[0, 7]]))


def _lstm_reference(x, kernel, recurrent, bias, units):
    """Keras' LSTM equations, step by step, written independently."""
    def sig(v):
        return 1 / (1 + np.exp(-v))
    b, t, _ = x.shape
    h, c = np.zeros((b, units)), np.zeros((b, units))
    out = []
    for s in range(t):
        z = x[:, s] @ kernel + h @ recurrent + bias
        i, f = sig(z[:, :units]), sig(z[:, units:2 * units])
        g, o = np.tanh(z[:, 2 * units:3 * units]), sig(z[:, 3 * units:])
        c = f * c + i * g
        h = o * np.tanh(c)
        out.append(h)
    return np.stack(out, axis=1)


@pytest.mark.parametrize("return_sequences", [False, True])
def test_lstm_forward_matches_reference_and_bptt_matches_finite_differences(core64,
                                                                             return_sequences):
    lstm = LSTM(3, return_sequences=return_sequences)
    x = np.random.default_rng(7).standard_normal((2, 4, 2))
    init = lstm.init_params(np.random.default_rng(0), (4, 2))
    assert {k: v.shape for k, v in init.items()} == {"kernel": (2, 12), "recurrent_kernel": (3, 12),
                                                      "bias": (12,)}
    np.testing.assert_array_equal(init["bias"], [0] * 3 + [1] * 3 + [0] * 6)  # forget bias 1
    np.testing.assert_allclose(init["recurrent_kernel"] @ init["recurrent_kernel"].T, np.eye(3),
                               atol=1e-6)                                 # orthogonal rows
    params = {k: v.astype(np.float64) for k, v in init.items()}
    y, _ = lstm.forward(core64, params, x)
    ref = _lstm_reference(x, params["kernel"], params["recurrent_kernel"], params["bias"], 3)
    np.testing.assert_allclose(y, ref if return_sequences else ref[:, -1], rtol=1e-12)
    check_layer_grads(core64, lstm, x, rtol=1e-5, atol=1e-8)


def test_dense_over_sequences_grads(core64):
    x = np.random.default_rng(8).standard_normal((2, 3, 4))
    dense = Dense(5)
    assert dense.output_shape((3, 4)) == (3, 5)
    assert dense.forward_flops((3, 4)) == 2 * 3 * 4 * 5
    check_layer_grads(core64, dense, x)


def test_binary_cross_entropy_value_and_grad(core64):
    z = np.array([[-30.0], [-1.0], [0.0], [2.0], [40.0]])
    y = np.array([1, 0, 1, 1, 0])
    loss, dz = sigmoid_binary_cross_entropy(core64, z, y)
    p = 1 / (1 + np.exp(-z[:, 0]))
    naive = -(y * np.log(np.maximum(p, 1e-300)) + (1 - y) * np.log(np.maximum(1 - p, 1e-300)))
    # the last entry: log(1 - p) underflows naively; the stable form gives 40
    assert loss == pytest.approx((naive[:4].sum() + 40.0) / 5, rel=1e-12)
    zz = z.copy()
    fd = numeric_grad(lambda: sigmoid_binary_cross_entropy(core64, zz, y)[0], zz)
    np.testing.assert_allclose(dz, fd, rtol=1e-6, atol=1e-10)
    with pytest.raises(ValueError, match="0 or 1"):
        sigmoid_binary_cross_entropy(core64, z, np.array([0, 1, 2, 0, 1]))


# --------------------------------------------------------------------------- models

def _fd_model(core64, model, x, y, seed, *, entries_per_param=6, rtol=1e-5):
    rng = np.random.default_rng(seed)
    params = {k: v.astype(np.float64) for k, v in model.init_params(seed).items()}
    for k in params:
        if k.endswith("/bias") or k.endswith("/beta"):
            params[k] = rng.uniform(-0.1, 0.1, params[k].shape)

    def loss():
        return model.loss_and_grads(core64, params, x, y, rng=np.random.default_rng(3))[0]

    _, grads = model.loss_and_grads(core64, params, x, y, rng=np.random.default_rng(3))
    assert list(grads) == list(params)
    for k, p in params.items():
        entries = rng.choice(p.size, size=min(p.size, entries_per_param), replace=False)
        fd = numeric_grad(loss, p, entries=entries).reshape(-1)[entries]
        np.testing.assert_allclose(grads[k].reshape(-1)[entries], fd, rtol=rtol, atol=1e-8,
                                   err_msg=k)


def test_mlp_with_batchnorm_matches_finite_differences(core64):
    model = build_model("mlp", (4, 3), 5, hidden=[6, 7], dropout=0.25, batch_norm=True)
    assert [layer.kind for layer in model.layers][:5] == ["flatten", "dense", "batch_normalization",
                                                          "relu", "dropout"]
    assert set(model.init_state()) == {"bn1/moving_mean", "bn1/moving_variance",
                                       "bn2/moving_mean", "bn2/moving_variance"}
    rng = np.random.default_rng(9)
    _fd_model(core64, model, rng.standard_normal((6, 4, 3)), np.array([0, 4, 2, 2, 1, 3]), 1,
              entries_per_param=50)


def test_lstm_classifier_matches_finite_differences(core64):
    model = build_model("lstm_classifier", (5,), 2, vocabulary=9, embedding_dim=3, units=4)
    assert model.loss == "sigmoid_binary_cross_entropy" and model.output_shape == (1,)
    x = np.random.default_rng(10).integers(0, 9, size=(3, 5))
    _fd_model(core64, model, x, np.array([1, 0, 1]), 2, entries_per_param=10)


def test_char_lstm_matches_finite_differences(core64):
    model = build_model("char_lstm", (4,), 6, embedding_dim=3, units=5)
    assert model.output_shape == (4, 6)
    rng = np.random.default_rng(11)
    x = rng.integers(0, 6, size=(2, 4))
    y = rng.integers(0, 6, size=(2, 4))
    _fd_model(core64, model, x, y, 3, entries_per_param=10)


def test_seed_model_shapes_and_parameter_counts():
    cifar = build_model("mlp", (32, 32, 3), 10, hidden=[2048, 1024, 512, 256, 128, 64, 32, 16],
                        dropout=0.5, batch_norm=True)
    widths = [3072, 2048, 1024, 512, 256, 128, 64, 32, 16]
    dense = sum(a * b + b for a, b in zip(widths, widths[1:])) + 16 * 10 + 10
    assert cifar.num_params == dense + 2 * sum(widths[1:])               # + gamma, beta
    # Keras' summary of the seed IMDB model: 480,000 + 53,200 + 101 = 533,301
    imdb = build_model("lstm_classifier", (250,), 2)
    assert [r[2] for r in imdb.summary_rows()] == [480000, 53200, 101]
    assert imdb.summary_rows(32)[1][1] == (32, 100)
    with pytest.raises(ValueError, match="2 classes"):
        build_model("lstm_classifier", (250,), 3)
    with pytest.raises(ValueError, match="units"):
        build_model("char_lstm", (10,), 5, units=0)
    with pytest.raises(ValueError, match="batch_norm"):
        build_model("mlp", (4,), 3, batch_norm="yes")


def test_batchnorm_state_moves_in_training_and_is_used_in_eval(core):
    model = build_model("mlp", (5,), 3, hidden=[8], batch_norm=True)
    params, state = model.init_params(0), model.init_state()
    rng = np.random.default_rng(12)
    x, y = rng.standard_normal((16, 5)).astype(np.float32) + 3, rng.integers(0, 3, 16)
    _, _, new = model.loss_grads_and_state(core, params, x, y, state=state)
    assert all(v.dtype == np.float32 for v in new.values())
    assert not np.array_equal(new["bn1/moving_mean"], state["bn1/moving_mean"])
    assert np.all(state["bn1/moving_mean"] == 0)                         # input not modified
    assert not np.array_equal(model.predict(core, params, x, state=new),
                              model.predict(core, params, x, state=state))


def test_lstm_classifier_learns_a_token_rule(core):
    """A few Adam steps on synthetic token sequences reduce the loss (bf16 path)."""
    from pod.workloads import build_optimizer, load_dataset
    ds = load_dataset("synthetic", shape=[12], vocabulary=30, num_classes=2, num_examples=256,
                      seed=1)
    assert ds.x_train.dtype.kind == "i" and ds.synthetic
    model = build_model("lstm_classifier", ds.example_shape, 2, vocabulary=30, embedding_dim=8,
                        units=16)
    opt = build_optimizer("adam", learning_rate=0.02)
    params = model.init_params(0)
    opt_state = opt.init(params)
    first, _ = model.evaluate(core, params, ds.x_test, ds.y_test)
    for step in range(1, 41):
        _, g = model.loss_and_grads(core, params, ds.x_train, ds.y_train)
        params, opt_state = opt.update(core, g, opt_state, params, step)
    loss, acc = model.evaluate(core, params, ds.x_test, ds.y_test)
    assert loss < 0.8 * first and acc > 0.7

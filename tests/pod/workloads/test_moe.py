"""The mixture-of-experts layer (pod/workloads/moe.py) against references: a per-token
numpy loop (routing, capacity, combine), the load-balancing loss's closed form, finite
differences (float64), and its own timing-only run (record for record)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from chip import TensorCore, get_chip_spec
from pod.workloads.mlp import gelu
from pod.workloads.moe import MoE, expert_capacity, route_tokens

SPEC = get_chip_spec("v5e").core
B, T, C, F, E, K = 3, 10, 5, 6, 8, 2


def _layer(cf=0.0, k=K, activation="gated_silu", weight=0.01):
    return MoE(E, k, F, activation, capacity_factor=cf, aux_loss_weight=weight, name="moe")


def _params(layer, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    params = layer.init_params(rng, (T, C))
    params["router"] = rng.standard_normal((C, E)) * 2.0  # well separated logits
    return {k: np.asarray(v, dtype) for k, v in params.items()}


def _x(seed=1, dtype=np.float64):
    return np.random.default_rng(seed).standard_normal((B, T, C)).astype(dtype)


def reference(layer, params, x):
    """A per-token loop: top-k by logit, softmax over the chosen, capacity in token
    order (first choice first) per sequence, each expert's MLP on its token."""
    cap = expert_capacity(x.shape[1], layer.experts, layer.k, layer.capacity_factor)
    y = np.zeros_like(x)
    kept = np.zeros((x.shape[0], x.shape[1], layer.k), bool)
    for s in range(x.shape[0]):
        taken = [0] * layer.experts
        for t in range(x.shape[1]):
            logits = x[s, t] @ params["router"]
            order = sorted(range(layer.experts), key=lambda e: (-logits[e], e))[:layer.k]
            w = np.exp(logits[order] - logits[order].max())
            w /= w.sum()
            for j, e in enumerate(order):
                if cap and taken[e] >= cap:
                    continue
                taken[e] += 1
                kept[s, t, j] = True
                a, b = x[s, t] @ params["wi_0"][e], x[s, t] @ params["wi_1"][e]
                h = a / (1 + np.exp(-a)) * b
                y[s, t] += w[j] * (h @ params["wo"][e])
    return y, kept


def aux_closed_form(layer, params, x):
    """w E mean_s sum_e f_se P_se (Switch eq. 4 per sequence, MaxText's k choices)."""
    logits = x @ params["router"]                                        # (B, T, E)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    chosen = np.argsort(-logits, axis=-1, kind="stable")[..., :layer.k]
    f = np.stack([np.bincount(c.reshape(-1), minlength=layer.experts) for c in chosen]) / x.shape[1]
    return layer.aux_loss_weight * layer.experts * float((f * p.mean(axis=1)).sum(axis=1).mean())


@pytest.mark.parametrize("cf", [0.0, 1.0, 0.5])
def test_forward_equals_the_per_token_reference(cf):
    layer, core = _layer(cf), TensorCore(SPEC, numerics=False)
    params, x = _params(layer), _x()
    y, cache = layer.forward(core, params, x)
    want, kept = reference(layer, params, x)
    np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-12)
    load = cache["route"]["load"]
    assert sum(load.routed) == B * T * K
    assert sum(load.kept) == int(kept.sum())
    assert (load.dropped > 0) == (cf > 0)  # capacity 2 (1 at 0.5) of 10 tokens x 2 choices


def test_capacity_dropping_equals_the_reference_choice_by_choice():
    layer = _layer(0.75)
    params, x = _params(layer), _x()
    logits = (x @ params["router"]).reshape(-1, E)
    cap = expert_capacity(T, E, K, 0.75)
    assert cap == math.floor(T * K * 0.75 / E) == 1
    _, _, choice, slot = route_tokens(logits, B, K, cap)
    _, kept = reference(layer, params, x)
    np.testing.assert_array_equal(slot.reshape(B, T, K) >= 0, kept)
    for s in range(B):  # each kept choice has its own row of its expert's (B, cap) buffer
        rows = slot.reshape(B, T, K)[s][kept[s]]
        experts = choice.reshape(B, T, K)[s][kept[s]]
        np.testing.assert_array_equal(rows // cap, experts * B + s)
        assert len(set(rows.tolist())) == rows.size


def test_the_aux_loss_equals_its_closed_form_and_k_w_for_a_uniform_router():
    layer, core = _layer(weight=0.02), TensorCore(SPEC, numerics=False)
    params, x = _params(layer), _x()
    _, cache = layer.forward(core, params, x)
    assert cache["route"]["load"].aux_loss == pytest.approx(aux_closed_form(layer, params, x),
                                                           rel=1e-12)
    params["router"] = np.zeros((C, E))
    _, cache = layer.forward(core, params, x)
    assert cache["route"]["load"].aux_loss == pytest.approx(K * 0.02, rel=1e-12)


@pytest.mark.parametrize("cf,activation", [(0.0, "gated_silu"), (1.0, "gated_silu"),
                                           (1.25, "gelu")])
def test_gradients_match_finite_differences(cf, activation):
    """d/dθ of <y, R> + aux, every parameter and the input, float64 (no rounding)."""
    layer, core = _layer(cf, activation=activation, weight=0.5), TensorCore(SPEC, numerics=False)
    params, x = _params(layer), _x()
    probe = np.random.default_rng(2).standard_normal((B, T, C))

    def loss(p, xx):
        y, cache = layer.forward(core, p, xx)
        return float((y * probe).sum()) + cache["route"]["load"].aux_loss

    y, cache = layer.forward(core, params, x)
    dx, grads = layer.backward(core, params, cache, probe)
    eps, rng = 1e-6, np.random.default_rng(3)
    for key in [*params, "x"]:
        base = x if key == "x" else params[key]
        got = dx if key == "x" else grads[key]
        for index in [tuple(rng.integers(0, n) for n in base.shape) for _ in range(6)]:
            up, down = base.copy(), base.copy()
            up[index] += eps
            down[index] -= eps
            args = ((params, up), (params, down)) if key == "x" else \
                (({**params, key: up}, x), ({**params, key: down}, x))
            numeric = (loss(*args[0]) - loss(*args[1])) / (2 * eps)
            assert got[index] == pytest.approx(numeric, rel=1e-5, abs=1e-7), (key, index)


@pytest.mark.parametrize("cf", [0.0, 1.25])
def test_a_timing_only_pass_records_the_same_ops(cf):
    layer = _layer(cf)
    params = {k: v.astype(np.float32) for k, v in _params(layer).items()}
    x = _x(dtype=np.float32)
    records = []
    for execute in (True, False):
        core = TensorCore(SPEC, execute=execute)
        y, cache = layer.forward(core, params, x)
        layer.backward(core, params, cache, np.ones_like(y))
        records.append(core.take_records())
        if not execute:
            assert cache["route"]["load"].routed == ()
    assert records[0] == records[1]
    names = [r.name for r in records[0]]
    assert names[:3] == ["moe/router", "moe/route", "moe/dispatch"]
    assert sum(r.unit == "mxu" for r in records[0]) == 4 + 8  # router, 3 experts; backward


def test_capacity_mode_records_e_times_capacity_rows_per_sequence():
    """Static shapes: every expert computes on its capacity rows of every sequence."""
    layer, core = _layer(1.0), TensorCore(SPEC)
    params = {k: v.astype(np.float32) for k, v in _params(layer).items()}
    layer.forward(core, params, _x(dtype=np.float32))
    wi = next(r for r in core.records if r.name == "moe/wi_0")
    cap = expert_capacity(T, E, K, 1.0)
    assert wi.flops == 2 * (E * B * cap) * C * F  # E groups of B cap rows


def test_bf16_forward_is_close_to_float64():
    layer = _layer(1.0)
    p64, x64 = _params(layer), _x()
    y64, _ = layer.forward(TensorCore(SPEC, numerics=False), p64, x64)
    p32 = {k: v.astype(np.float32) for k, v in p64.items()}
    y16, _ = layer.forward(TensorCore(SPEC), p32, x64.astype(np.float32))
    assert np.max(np.abs(y16 - y64)) < 0.05 * np.max(np.abs(y64))


def test_bad_arguments_are_one_line_errors():
    with pytest.raises(ValueError, match="experts_per_token 9 .* experts 8"):
        MoE(8, 9, 4)
    with pytest.raises(ValueError, match="capacity_factor -1"):
        MoE(8, 2, 4, capacity_factor=-1)
    with pytest.raises(ValueError, match="gated_silu"):
        MoE(8, 2, 4, "swish")
    assert gelu is not None

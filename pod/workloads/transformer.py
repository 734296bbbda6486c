"""A decoder-only transformer language model, configured like MaxText.

Per token ids (B, T) -> logits (B, T, V):

    h = embed(ids) [+ learned positions]                       # (B, T, C)
    per block:  h = h + attention(norm(h))                     # causal, RoPE or not
                h = h + mlp(norm(h))                           # gated SiLU or GELU
    logits = norm(h) @ E^T (tied) or @ W_out                   # (B, T, V)

with the options of MaxText's base config (``emb_dim``, ``num_heads``,
``head_dim``, ``mlp_dim``, ``mlp_activations``, ``num_decoder_layers``,
``logits_via_embedding``, ``remat_policy``) under the names of
``build_transformer``. The loss is the per-step softmax cross-entropy of the
other sequence models. Every matmul runs on the MXU (``core.matmul`` /
``core.batch_matmul``), every elementwise step on the VPU (``core.vector``),
so the simulated time of a step is the model's.

Rematerialisation (``remat``) decides what a block keeps from forward for
backward, and so both the activation bytes the HBM plan counts and the work
recorded in backward; the numbers computed are the same in every mode
(bit-identical loss and gradients):

- ``none``: everything backward reads is kept (JAX ``everything_saveable``).
- ``minimal``: only the block input and the MXU outputs (q, k, v, the scores
  q.k^T, p.v, the attention output projection, the MLP input projections)
  are kept; backward recomputes the cheap elementwise parts from them: both
  norms, RoPE, the softmax, the MLP activation and the residual add (JAX's
  ``checkpoint_dots`` policy; MaxText's ``minimal`` also drops the two
  batched attention products, ``checkpoint_dots_with_no_batch_dims``; here
  they are kept so that the recomputation has no MXU work).
- ``full``: only the block input is kept; backward reruns the block's
  forward (JAX ``nothing_saveable``) except the MLP output projection,
  whose result backward does not need (XLA removes it as dead code).
"""

from __future__ import annotations

import dataclasses
import math
from types import MappingProxyType

import numpy as np

from chip import to_bf16
from pod.workloads.attention import CausalSelfAttention
from pod.workloads.checks import DataMismatchError, check_int, check_number, check_token_ids
from pod.workloads.layers import Layer, glorot_uniform, mxu_input, sigmoid, vector_op
from pod.workloads.model import Model

__all__ = [
    "MLP",
    "MLP_ACTIVATIONS",
    "NORMS",
    "POSITIONS",
    "REMAT_POLICIES",
    "LayerNorm",
    "TensorHooks",
    "RMSNorm",
    "TokenEmbedding",
    "TransformerBlock",
    "TransformerConfig",
    "TransformerModel",
    "Unembed",
    "build_transformer",
]

NORMS = ("rmsnorm", "layernorm")
POSITIONS = ("rotary", "learned")
MLP_ACTIVATIONS = ("gated_silu", "gelu")
REMAT_POLICIES = ("none", "minimal", "full")

EMBEDDING_INIT_STDDEV = 0.02  # GPT-2 / nanoGPT embedding init (normal, std 0.02)


def _add(core, name: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a + b on the VPU (``vector_op``: on a timing-only core only its cost)."""
    return vector_op(core, name, np.add, a, b, out=(np.broadcast_shapes(a.shape, b.shape),
                                                     np.result_type(a, b)))


def _params_of(params: dict, prefix: str) -> dict:
    """The entries "<prefix>/<local>" of a block's params, keyed by <local>."""
    n = len(prefix) + 1
    return {k[n:]: v for k, v in params.items() if k.startswith(prefix + "/")}


class _Norm(Layer):
    """Shared shape handling of RMSNorm and LayerNorm (over the last axis)."""

    dot_keys: tuple[str, ...] = ()
    backward_keys = ("xhat", "inv")

    def __init__(self, epsilon: float = 1e-6, name: str | None = None):
        super().__init__(name)
        self.epsilon = check_number(epsilon, f"{type(self).__name__} epsilon", low=0.0, low_open=True)

    def cache_elements(self, input_shape):
        # x_hat like x, plus one 1/sigma per position
        return math.prod(input_shape) + math.prod(input_shape[:-1])


class RMSNorm(_Norm):
    """y = x / sqrt(mean(x^2) + eps) * scale over the last axis (Zhang &
    Sennrich 2019; MaxText's default ``RMSNorm``, eps 1e-6, no bias).

    Params: ``scale`` (C,), ones at init.
    """

    kind = "rmsnorm"

    def param_shapes(self, input_shape):
        return {"scale": (int(input_shape[-1]),)}

    def init_params(self, rng, input_shape):
        return {"scale": np.ones(int(input_shape[-1]), np.float32)}

    def forward(self, core, params, x, *, training=False, rng=None, saved=None, need_output=True):
        eps = np.asarray(self.epsilon, x.dtype)
        stat = (x.shape[:-1] + (1,), x.dtype)
        inv = vector_op(core, f"{self.name}/rsqrt",
                        lambda v: 1.0 / np.sqrt((v * v).mean(axis=-1, keepdims=True) + eps), x,
                        out=stat, ops_per_element=2.0, transcendental=True)  # (..., 1)
        scale = params["scale"].astype(x.dtype, copy=False)
        xhat, y = vector_op(core, f"{self.name}/normalize",
                            lambda v, s: (v * s, v * s * scale), x, inv,
                            out=[(x.shape, x.dtype)] * 2, ops_per_element=2.0)
        return y, {"xhat": xhat, "inv": inv}

    def backward(self, core, params, cache, dy, *, need_dx=True):
        xhat, inv = cache["xhat"], cache["inv"]
        lead = tuple(range(dy.ndim - 1))
        scale = params["scale"].astype(dy.dtype, copy=False)
        dscale = vector_op(core, f"{self.name}/d_scale", lambda d, xh: (d * xh).sum(axis=lead),
                           dy, xhat, out=(dy.shape[-1:], dy.dtype), ops_per_element=2.0)  # (C,)
        dx = None
        if need_dx:
            # dx = inv * (g - xhat * mean(g * xhat)), g = dy * scale
            def back(d, xh, s):
                g = d * scale
                return s * (g - xh * (g * xh).mean(axis=-1, keepdims=True))
            dx = vector_op(core, f"{self.name}/dx", back, dy, xhat, inv, out=(dy.shape, dy.dtype),
                           ops_per_element=6.0)
        return dx, {"scale": dscale}


class LayerNorm(_Norm):
    """y = (x - mean) / sqrt(var + eps) * scale + bias over the last axis
    (Ba et al. 2016; eps 1e-6 as MaxText's).

    Params: ``scale`` (C,) ones and ``bias`` (C,) zeros at init.
    """

    kind = "layernorm"

    def param_shapes(self, input_shape):
        c = int(input_shape[-1])
        return {"scale": (c,), "bias": (c,)}

    def init_params(self, rng, input_shape):
        c = int(input_shape[-1])
        return {"scale": np.ones(c, np.float32), "bias": np.zeros(c, np.float32)}

    def forward(self, core, params, x, *, training=False, rng=None, saved=None, need_output=True):
        eps = np.asarray(self.epsilon, x.dtype)

        def stats(v):
            mu = v.mean(axis=-1, keepdims=True)
            return mu, 1.0 / np.sqrt(((v - mu) ** 2).mean(axis=-1, keepdims=True) + eps)

        mu, inv = vector_op(core, f"{self.name}/moments", stats, x,
                            out=[(x.shape[:-1] + (1,), x.dtype)] * 2, ops_per_element=4.0,
                            transcendental=True)                           # (..., 1) each
        scale = params["scale"].astype(x.dtype, copy=False)
        bias = params["bias"].astype(x.dtype, copy=False)
        xhat, y = vector_op(core, f"{self.name}/normalize",
                            lambda v, m, s: ((v - m) * s, (v - m) * s * scale + bias),
                            x, mu, inv, out=[(x.shape, x.dtype)] * 2, ops_per_element=4.0)
        return y, {"xhat": xhat, "inv": inv}

    def backward(self, core, params, cache, dy, *, need_dx=True):
        xhat, inv = cache["xhat"], cache["inv"]
        lead = tuple(range(dy.ndim - 1))
        scale = params["scale"].astype(dy.dtype, copy=False)
        dscale, dbias = vector_op(core, f"{self.name}/d_scale_bias",
                                  lambda d, xh: ((d * xh).sum(axis=lead), d.sum(axis=lead)),
                                  dy, xhat, out=[(dy.shape[-1:], dy.dtype)] * 2,
                                  ops_per_element=3.0)                    # (C,), (C,)
        dx = None
        if need_dx:
            # dx = inv * (g - mean(g) - xhat * mean(g * xhat)), g = dy * scale
            def back(d, xh, s):
                g = d * scale
                return s * (g - g.mean(axis=-1, keepdims=True)
                            - xh * (g * xh).mean(axis=-1, keepdims=True))
            dx = vector_op(core, f"{self.name}/dx", back, dy, xhat, inv, out=(dy.shape, dy.dtype),
                           ops_per_element=8.0)
        return dx, {"scale": dscale, "bias": dbias}


def gelu(u: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation (Hendrycks & Gimpel 2016; ``jax.nn.gelu``'s
    default, which MaxText's "gelu" uses)."""
    c = np.asarray(math.sqrt(2.0 / math.pi), u.dtype)
    return 0.5 * u * (1.0 + np.tanh(c * (u + np.asarray(0.044715, u.dtype) * u ** 3)))


def gelu_grad(u: np.ndarray) -> np.ndarray:
    """d gelu(u) / du of the tanh approximation."""
    c = np.asarray(math.sqrt(2.0 / math.pi), u.dtype)
    a = np.asarray(0.044715, u.dtype)
    th = np.tanh(c * (u + a * u ** 3))
    return 0.5 * (1.0 + th) + 0.5 * u * (1.0 - th * th) * c * (1.0 + 3.0 * a * u * u)


class MLP(Layer):
    """The block's feed-forward part over (B, T, C).

    ``gated_silu`` (SwiGLU, Shazeer 2020; MaxText ``mlp_activations:
    [silu, linear]``): y = (silu(x W0) * (x W1)) Wo, params ``wi_0``, ``wi_1``
    (C, F), ``wo`` (F, C). ``gelu``: y = gelu(x Wi) Wo, params ``wi`` (C, F),
    ``wo`` (F, C). No biases.

    Args:
        mlp_dim: F.
        activation: "gated_silu" or "gelu".
        name: layer name.
    """

    kind = "mlp"

    def __init__(self, mlp_dim: int, activation: str = "gated_silu", name: str | None = None):
        super().__init__(name)
        self.mlp_dim = check_int(mlp_dim, "MLP mlp_dim")
        if activation not in MLP_ACTIVATIONS:
            raise ValueError(f"MLP activation must be one of {', '.join(MLP_ACTIVATIONS)}, "
                             f"got {activation!r}")
        self.activation = activation
        self.gated = activation == "gated_silu"
        self.inputs = ("wi_0", "wi_1") if self.gated else ("wi",)
        self.matmul_params = (*self.inputs, "wo")
        # Megatron: hidden units split over the tensor devices (wi columns, wo rows)
        self.tensor_split = MappingProxyType({**{k: 1 for k in self.inputs}, "wo": 0})
        self.dot_keys = ("u0", "u1") if self.gated else ("u",)
        self.backward_keys = ("x", *self.dot_keys, "g")

    def param_shapes(self, input_shape):
        c, f = int(input_shape[-1]), self.mlp_dim
        return {**{k: (c, f) for k in self.inputs}, "wo": (f, c)}

    def init_params(self, rng, input_shape):
        return {k: glorot_uniform(rng, s, s[0], s[1])
                for k, s in self.param_shapes(input_shape).items()}

    def forward_flops(self, input_shape):
        return 2 * math.prod(input_shape) * self.mlp_dim * (len(self.inputs) + 1)

    def output_flops(self, input_shape) -> int:
        """FLOPs of the output projection alone (skipped when recomputing)."""
        return 2 * math.prod(input_shape) * self.mlp_dim

    def cache_elements(self, input_shape):
        t = math.prod(input_shape[:-1])
        return math.prod(input_shape) + (len(self.inputs) + 1) * t * self.mlp_dim  # x, u's, g

    def dot_elements(self, input_shape) -> int:
        return len(self.inputs) * math.prod(input_shape[:-1]) * self.mlp_dim

    def _activate(self, core, u):
        if self.gated:
            return vector_op(core, f"{self.name}/silu_gate", lambda a, b: a * sigmoid(a) * b, *u,
                             out=(u[0].shape, u[0].dtype), ops_per_element=5.0, transcendental=True)
        return vector_op(core, f"{self.name}/gelu", gelu, *u, out=(u[0].shape, u[0].dtype),
                         ops_per_element=8.0, transcendental=True)

    def forward(self, core, params, x, *, training=False, rng=None, saved=None, need_output=True):
        lead = x.shape[:-1]
        xr = mxu_input(core, x).reshape(-1, x.shape[-1])                  # (B*T, C)
        u = []
        for key, w in zip(self.dot_keys, self.inputs):
            if saved is not None and key in saved:
                u.append(saved[key])
            else:
                u.append(core.matmul(xr, params[w], name=f"{self.name}/{w}",
                                     a_rounded=True, b_rounded=True))      # (B*T, F)
        g = mxu_input(core, self._activate(core, u))                      # (B*T, F)
        cache = {"x": xr, **dict(zip(self.dot_keys, u)), "g": g}
        if not need_output:
            return None, cache
        y = core.matmul(g, params["wo"], name=f"{self.name}/wo", a_rounded=True, b_rounded=True)
        return y.reshape(*lead, y.shape[-1]), cache

    def backward(self, core, params, cache, dy, *, need_dx=True):
        xr, g = cache["x"], cache["g"]
        u = [cache[k] for k in self.dot_keys]
        lead = dy.shape[:-1]
        dyr = mxu_input(core, dy.reshape(-1, dy.shape[-1]))               # (B*T, C)
        grads = {"wo": core.matmul(g.T, dyr, name=f"{self.name}/d_wo",
                                   a_rounded=True, b_rounded=True)}       # (F, C)
        dg = core.matmul(dyr, params["wo"].T, name=f"{self.name}/d_hidden",
                         a_rounded=True, b_rounded=True)                  # (B*T, F)
        if self.gated:
            one = np.asarray(1.0, dg.dtype)

            def back(d, a, b):
                s = sigmoid(a)
                return d * b * s * (one + a * (one - s)), d * a * s       # d u0, d u1
            du = vector_op(core, f"{self.name}/silu_gate_bwd", back, dg, *u,
                           out=[(dg.shape, dg.dtype)] * 2, ops_per_element=8.0, transcendental=True)
        else:
            du = (vector_op(core, f"{self.name}/gelu_bwd", lambda d, a: d * gelu_grad(a), dg, *u,
                            out=(dg.shape, dg.dtype), ops_per_element=12.0, transcendental=True),)
        dx = None
        for w, d in zip(self.inputs, du):
            dr = mxu_input(core, d)                                       # (B*T, F)
            grads[w] = core.matmul(xr.T, dr, name=f"{self.name}/d_{w}",
                                   a_rounded=True, b_rounded=True)        # (C, F)
            if need_dx:
                part = core.matmul(dr, params[w].T, name=f"{self.name}/dx_{w}",
                                   a_rounded=True, b_rounded=True)        # (B*T, C)
                dx = part if dx is None else _add(core, f"{self.name}/dx_sum", dx, part)
        return (None if dx is None else dx.reshape(*lead, dx.shape[-1])), grads


class TensorHooks:
    """Megatron's operators around a block's tensor-parallel parts, for a
    device holding a slice of the heads and MLP units (Shoeybi et al. 2019,
    the f and g operators; Korthikanti et al. 2022 for the sequence-parallel
    variant). This class is the one-device identity; ``pod.programs.tensor``
    has the collective ones. Each takes a tag naming the place
    ("block1/attention/out") and a (B, t, C) array.

    - ``enter`` before a column-parallel layer: identity, or all-gather of the
      sequence chunks (sequence parallelism);
    - ``leave`` after a row-parallel layer: allreduce of the partial sums, or
      reduce-scatter over the sequence;
    - ``enter_grad`` / ``leave_grad``: their transposes in backward.
    """

    def enter(self, tag: str, x: np.ndarray) -> np.ndarray:
        return x

    def leave(self, tag: str, y: np.ndarray) -> np.ndarray:
        return y

    def enter_grad(self, tag: str, dx: np.ndarray) -> np.ndarray:
        return dx

    def leave_grad(self, tag: str, dy: np.ndarray) -> np.ndarray:
        return dy


_ONE_DEVICE = TensorHooks()


class TransformerBlock(Layer):
    """Pre-norm decoder block: h = x + attn(norm1(x)); y = h + mlp(norm2(h)).

    Params are the sub-layers' under their prefixes: ``norm1/scale``,
    ``attention/query``, ..., ``norm2/scale``, ``mlp/wi_0``, ... See the
    module docstring for ``remat``.

    Args:
        heads, head_dim: attention heads and their size.
        mlp_dim, mlp_activation: the MLP.
        norm: "rmsnorm" or "layernorm".
        rotary: RoPE in the attention.
        remat: "none", "minimal" or "full".
        name: layer name; sub-layer ops are recorded as "<name>/attention/...".
    """

    kind = "transformer_block"

    def __init__(self, heads: int, head_dim: int, mlp_dim: int, *, mlp_activation: str = "gated_silu",
                 norm: str = "rmsnorm", rotary: bool = True, remat: str = "none",
                 name: str | None = None):
        super().__init__(name)
        if norm not in NORMS:
            raise ValueError(f"norm must be one of {', '.join(NORMS)}, got {norm!r}")
        if remat not in REMAT_POLICIES:
            raise ValueError(f"remat must be one of {', '.join(REMAT_POLICIES)}, got {remat!r}")
        norm_cls = RMSNorm if norm == "rmsnorm" else LayerNorm
        self.remat = remat
        self.norm1 = norm_cls(name=f"{self.name}/norm1")
        self.attention = CausalSelfAttention(heads, head_dim, rotary=rotary,
                                             name=f"{self.name}/attention")
        self.norm2 = norm_cls(name=f"{self.name}/norm2")
        self.mlp = MLP(mlp_dim, mlp_activation, name=f"{self.name}/mlp")
        self.parts = {"norm1": self.norm1, "attention": self.attention,
                      "norm2": self.norm2, "mlp": self.mlp}
        self.matmul_params = tuple(f"{p}/{k}" for p, layer in self.parts.items()
                                   for k in layer.matmul_params)
        self.tensor_split = MappingProxyType({f"{p}/{k}": axis for p, layer in self.parts.items()
                                              for k, axis in layer.tensor_split.items()})

    def _check(self, input_shape):
        if len(input_shape) != 2:
            raise ValueError(f"{self.name}: a transformer block expects (steps, features) inputs, "
                             f"got {tuple(input_shape)}")
        return tuple(int(v) for v in input_shape)

    def param_shapes(self, input_shape):
        shape = self._check(input_shape)
        return {f"{p}/{k}": s for p, layer in self.parts.items()
                for k, s in layer.param_shapes(shape).items()}

    def init_params(self, rng, input_shape):
        shape = self._check(input_shape)
        return {f"{p}/{k}": v for p, layer in self.parts.items()
                for k, v in layer.init_params(rng, shape).items()}

    def forward_flops(self, input_shape):
        shape = self._check(input_shape)
        return self.attention.forward_flops(shape) + self.mlp.forward_flops(shape)

    def recompute_flops(self, input_shape) -> int:
        """MXU FLOPs the backward pass redoes per example under ``remat``:
        0 for none and minimal; the forward less the MLP output projection
        for full."""
        shape = self._check(input_shape)
        if self.remat != "full":
            return 0
        return self.forward_flops(shape) - self.mlp.output_flops(shape)

    def cache_elements(self, input_shape):
        """Elements kept per example for backward, by ``remat`` (see the module docstring)."""
        shape = self._check(input_shape)
        x = math.prod(shape)
        if self.remat == "full":
            return x
        if self.remat == "minimal":
            return x + self.attention.dot_elements(shape) + self.mlp.dot_elements(shape)
        return sum(layer.cache_elements(shape) for layer in self.parts.values())

    def _run(self, core, params, x, saved, need_output, tensor=None):
        """The block's forward; ``saved`` MXU outputs are reused, not recomputed."""
        saved = saved or {}
        tp = tensor or _ONE_DEVICE
        n1, c1 = self.norm1.forward(core, _params_of(params, "norm1"), x)
        kept = saved.get("attention_sum")                                 # minimal remat, tensor
        a, ca = self.attention.forward(core, _params_of(params, "attention"),
                                       tp.enter(f"{self.name}/attention/in", n1),
                                       saved=saved.get("attention"), need_output=kept is None)
        a = kept if kept is not None else tp.leave(f"{self.name}/attention/out", a)
        h = _add(core, f"{self.name}/residual1", x, a)
        n2, c2 = self.norm2.forward(core, _params_of(params, "norm2"), h)
        m, cm = self.mlp.forward(core, _params_of(params, "mlp"), tp.enter(f"{self.name}/mlp/in", n2),
                                 saved=saved.get("mlp"), need_output=need_output)
        y = None
        if need_output:
            m = tp.leave(f"{self.name}/mlp/wo", m)
            y = _add(core, f"{self.name}/residual2", h, m)
        caches = {"norm1": c1, "attention": ca, "norm2": c2, "mlp": cm}
        if tensor is not None:
            caches["attention_sum"] = a
        return y, caches

    def forward(self, core, params, x, *, training=False, rng=None, tensor=None):
        """As ``Layer.forward``. ``tensor`` (None on one device): the
        :class:`TensorHooks` of a tensor-parallel device whose params are its
        slice (``tensor_split``), put around the attention and the MLP."""
        self._check(x.shape[1:])
        y, caches = self._run(core, params, x, None, True, tensor)
        if self.remat == "full":
            return y, {"x": x}
        if self.remat == "minimal":
            dots = {p: {k: caches[p][k] for k in layer.dot_keys}
                    for p, layer in self.parts.items() if layer.dot_keys}
            if tensor is not None:  # keep the attention output summed over tensor, not a part
                dots["attention"].pop("out")
                dots["attention_sum"] = caches["attention_sum"]
            return y, {"x": x, "dots": dots}
        return y, {"parts": {p: {k: caches[p][k] for k in layer.backward_keys}
                             for p, layer in self.parts.items()}}

    def backward(self, core, params, cache, dy, *, need_dx=True, tensor=None):
        """As ``Layer.backward``; ``tensor`` as in ``forward`` (its ``*_grad``
        operators here, and the forward ones when remat recomputes)."""
        if "parts" in cache:
            caches = cache["parts"]
        else:  # remat: recompute what was not kept, costed as any forward work
            _, caches = self._run(core, params, cache["x"], cache.get("dots"), False, tensor)
        grads = {}
        tp = tensor or _ONE_DEVICE

        def part(p, d, need=True):
            layer = self.parts[p]
            dx, g = layer.backward(core, _params_of(params, p), caches[p], d, need_dx=need)
            grads.update({f"{p}/{k}": v for k, v in g.items()})
            return dx

        dm = tp.leave_grad(f"{self.name}/mlp/dout", dy)
        dn2 = tp.enter_grad(f"{self.name}/mlp/dx", part("mlp", dm))
        dh = _add(core, f"{self.name}/residual2_bwd", dy, part("norm2", dn2))
        da = tp.leave_grad(f"{self.name}/attention/dout", dh)
        dn1 = tp.enter_grad(f"{self.name}/attention/dx", part("attention", da))
        dxn = part("norm1", dn1, need_dx)                                 # scale grad always
        dx = _add(core, f"{self.name}/residual1_bwd", dh, dxn) if need_dx else None
        return dx, grads


class TokenEmbedding(Layer):
    """Token ids (B, T) -> (B, T, C): a table lookup, plus a learned position
    vector per step when ``max_steps`` is given (GPT-2 style).

    Params: ``embedding`` (V, C) and, with learned positions, ``position``
    (T_max, C); both N(0, 0.02^2) at init. The lookup is a gather on the VPU;
    the table gradient a scatter-add. Inputs shorter than T_max use the first
    positions.

    Args:
        vocabulary: V.
        embed_dim: C.
        max_steps: T_max for learned positions, or None (rotary models).
        name: layer name.
    """

    kind = "embedding"
    backward_reads_params = False  # the gradient is a scatter-add of dy

    def __init__(self, vocabulary: int, embed_dim: int, max_steps: int | None = None,
                 name: str | None = None):
        super().__init__(name)
        self.vocabulary = check_int(vocabulary, "TokenEmbedding vocabulary")
        self.embed_dim = check_int(embed_dim, "TokenEmbedding embed_dim")
        self.max_steps = None if max_steps is None else check_int(max_steps, "TokenEmbedding max_steps")

    def param_shapes(self, input_shape):
        shapes = {"embedding": (self.vocabulary, self.embed_dim)}
        if self.max_steps is not None:
            shapes["position"] = (self.max_steps, self.embed_dim)
        return shapes

    def init_params(self, rng, input_shape):
        return {k: (rng.standard_normal(s) * EMBEDDING_INIT_STDDEV).astype(np.float32)
                for k, s in self.param_shapes(input_shape).items()}

    def check_inputs(self, x) -> None:
        check_token_ids(x, self.vocabulary, self.name)

    def output_shape(self, input_shape):
        if len(input_shape) != 1:
            raise ValueError(f"{self.name}: expects (steps,) token ids, got {tuple(input_shape)}")
        if self.max_steps is not None and input_shape[0] > self.max_steps:
            raise ValueError(f"{self.name}: {input_shape[0]} steps, more than the {self.max_steps} "
                             f"learned positions")
        return (int(input_shape[0]), self.embed_dim)

    def cache_elements(self, input_shape):
        return math.prod(input_shape)  # the ids

    def forward(self, core, params, x, *, training=False, rng=None):
        ids = check_token_ids(x, self.vocabulary, self.name)              # (B, T)
        self.output_shape(ids.shape[1:])
        table = params["embedding"]                                       # (V, C)
        out = (ids.shape + (self.embed_dim,), table.dtype)
        if self.max_steps is None:
            y = vector_op(core, f"{self.name}/gather", lambda i: table[i], ids, out=out)
        else:
            pos = params["position"][:ids.shape[1]]                       # (T, C)
            y = vector_op(core, f"{self.name}/gather", lambda i: table[i] + pos, ids, out=out)
        return y, ids

    def backward(self, core, params, cache, dy, *, need_dx=True):
        ids = cache

        def scatter(d):
            dtable = np.zeros((self.vocabulary, self.embed_dim), d.dtype)  # (V, C)
            np.add.at(dtable, ids.reshape(-1), d.reshape(-1, self.embed_dim))
            return dtable

        grads = {"embedding": vector_op(core, f"{self.name}/scatter_add", scatter, dy,
                                        out=((self.vocabulary, self.embed_dim), dy.dtype))}
        if self.max_steps is not None:
            def positions(d):
                dpos = np.zeros((self.max_steps, self.embed_dim), d.dtype)  # (T_max, C)
                dpos[:d.shape[1]] = d.sum(axis=0)
                return dpos
            grads["position"] = vector_op(core, f"{self.name}/d_position", positions, dy,
                                          out=((self.max_steps, self.embed_dim), dy.dtype))
        return None, grads


class Unembed(Layer):
    """(B, T, C) -> logits (B, T, V): h @ W_out, or h @ E^T with the token
    embedding table E (V, C) when ``tied`` (Press & Wolf 2017; MaxText
    ``logits_via_embedding``). No bias.

    Params: ``kernel`` (C, V), or ``embedding`` (V, C) when tied (the model
    maps it onto the embedding layer's table).
    """

    kind = "unembed"

    def __init__(self, vocabulary: int, *, tied: bool = True, name: str | None = None):
        super().__init__(name)
        self.vocabulary = check_int(vocabulary, "Unembed vocabulary")
        self.tied = bool(tied)
        self.matmul_params = ("embedding",) if self.tied else ("kernel",)

    def param_shapes(self, input_shape):
        c = int(input_shape[-1])
        return {"embedding": (self.vocabulary, c)} if self.tied else {"kernel": (c, self.vocabulary)}

    def init_params(self, rng, input_shape):
        if self.tied:
            return {}  # the embedding layer's table
        c = int(input_shape[-1])
        return {"kernel": glorot_uniform(rng, (c, self.vocabulary), c, self.vocabulary)}

    def output_shape(self, input_shape):
        return (*tuple(input_shape)[:-1], self.vocabulary)

    def forward_flops(self, input_shape):
        return 2 * math.prod(input_shape) * self.vocabulary

    def cache_elements(self, input_shape):
        return math.prod(input_shape)

    def _weights(self, params):
        return params["embedding"].T if self.tied else params["kernel"]  # (C, V)

    def forward(self, core, params, x, *, training=False, rng=None):
        lead = x.shape[:-1]
        xr = mxu_input(core, x).reshape(-1, x.shape[-1])                  # (B*T, C)
        y = core.matmul(xr, self._weights(params), name=f"{self.name}/fwd",
                        a_rounded=True, b_rounded=True)                   # (B*T, V)
        return y.reshape(*lead, self.vocabulary), xr

    def backward(self, core, params, cache, dy, *, need_dx=True):
        xr = cache
        lead = dy.shape[:-1]
        dyr = mxu_input(core, dy.reshape(-1, self.vocabulary))            # (B*T, V)
        if self.tied:
            grads = {"embedding": core.matmul(dyr.T, xr, name=f"{self.name}/dW",
                                              a_rounded=True, b_rounded=True)}  # (V, C)
        else:
            grads = {"kernel": core.matmul(xr.T, dyr, name=f"{self.name}/dW",
                                           a_rounded=True, b_rounded=True)}     # (C, V)
        dx = None
        if need_dx:
            dx = core.matmul(dyr, self._weights(params).T, name=f"{self.name}/dx",
                             a_rounded=True, b_rounded=True).reshape(*lead, xr.shape[1])
        return dx, grads


TRANSFORMER_OPTIONS = ("embed_dim", "heads", "head_dim", "mlp_dim", "mlp_activation", "layers",
                       "norm", "positions", "tied_embeddings", "remat")


def _choice(field: str, value, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"transformer: option {field} must be one of {', '.join(choices)}, "
                         f"got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """The shape of a decoder-only transformer; validated on construction.

    Attributes:
        vocabulary: V, tokens (the dataset's num_classes).
        sequence_length: T, tokens per example (from the data).
        embed_dim: C, the residual stream width (MaxText ``emb_dim``).
        heads: H, attention heads (``num_query_heads``).
        head_dim: Dh (``head_dim``); None: embed_dim // heads.
        mlp_dim: F, the MLP hidden width (``mlp_dim``); None: 4 * embed_dim.
        mlp_activation: "gated_silu" (SwiGLU) or "gelu".
        layers: L, transformer blocks (``num_decoder_layers``).
        norm: "rmsnorm" or "layernorm" (pre-norm in every block, and final).
        positions: "rotary" (RoPE in attention) or "learned" (added to the
            token embeddings).
        tied_embeddings: logits through the token embedding table
            (``logits_via_embedding``) instead of a separate (C, V) kernel.
        remat: "none", "minimal" or "full" (module docstring).

    Raises:
        ValueError: one line naming the option: "transformer: option heads
            must be a positive integer, got 0".
    """

    vocabulary: int
    sequence_length: int
    embed_dim: int = 64
    heads: int = 4
    head_dim: int | None = None
    mlp_dim: int | None = None
    mlp_activation: str = "gated_silu"
    layers: int = 2
    norm: str = "rmsnorm"
    positions: str = "rotary"
    tied_embeddings: bool = True
    remat: str = "none"

    def __post_init__(self):
        for field in ("vocabulary", "sequence_length", "embed_dim", "heads", "layers"):
            check_int(getattr(self, field), f"transformer: option {field}")
        if self.head_dim is None:
            if self.embed_dim % self.heads:
                raise ValueError(f"transformer: option head_dim is needed: embed_dim "
                                 f"{self.embed_dim} is not a multiple of heads {self.heads}")
            object.__setattr__(self, "head_dim", self.embed_dim // self.heads)
        check_int(self.head_dim, "transformer: option head_dim")
        if self.mlp_dim is None:
            object.__setattr__(self, "mlp_dim", 4 * self.embed_dim)
        check_int(self.mlp_dim, "transformer: option mlp_dim")
        _choice("mlp_activation", self.mlp_activation, MLP_ACTIVATIONS)
        _choice("norm", self.norm, NORMS)
        _choice("positions", self.positions, POSITIONS)
        _choice("remat", self.remat, REMAT_POLICIES)
        if not isinstance(self.tied_embeddings, bool):
            raise ValueError(f"transformer: option tied_embeddings must be true or false, "
                             f"got {self.tied_embeddings!r}")
        if self.positions == "rotary" and self.head_dim % 2:
            raise ValueError(f"transformer: option head_dim must be even for rotary positions, "
                             f"got {self.head_dim}")

    @property
    def inner_dim(self) -> int:
        """D = H * Dh, the width of q, k, v."""
        return self.heads * self.head_dim

    def param_count(self) -> int:
        """Parameters in closed form: per block the norms (C each, 2C for
        layernorm), q, k, v, out (4 C D), the MLP (3 C F gated, 2 C F gelu);
        the final norm; the table V C; learned positions T C; an untied
        output kernel C V."""
        c, d, f, v = self.embed_dim, self.inner_dim, self.mlp_dim, self.vocabulary
        norm = c * (2 if self.norm == "layernorm" else 1)
        mlp = (3 if self.mlp_activation == "gated_silu" else 2) * c * f
        block = 2 * norm + 4 * c * d + mlp
        return (self.layers * block + norm + v * c
                + (self.sequence_length * c if self.positions == "learned" else 0)
                + (0 if self.tied_embeddings else c * v))

    def matmul_param_count(self) -> int:
        """N of the 6 N T formula: the weights that take part in a matmul per
        token (PaLM, Chowdhery et al. 2022, app. B; MaxText
        ``calculate_tflops_training_per_device``): the projections and the
        output layer (V C, tied or not); not the norms, not the embedding
        lookup (a gather) and not learned positions."""
        c, d, f, v = self.embed_dim, self.inner_dim, self.mlp_dim, self.vocabulary
        mlp = (3 if self.mlp_activation == "gated_silu" else 2) * c * f
        return self.layers * (4 * c * d + mlp) + c * v


class TransformerModel(Model):
    """The transformer language model: ``Model`` with a tied embedding table
    and the model / hardware FLOPs of MFU accounting.

    Layers: ``embed`` (TokenEmbedding), ``block1`` .. ``blockL``
    (TransformerBlock), ``final_norm``, ``unembed``. With tied embeddings the
    one parameter ``embed/embedding`` serves the lookup and the logits; its
    gradient is the sum of both uses.

    Args:
        config: the TransformerConfig.
    """

    def __init__(self, config: TransformerConfig):
        self.config = config
        cfg = config
        norm_cls = RMSNorm if cfg.norm == "rmsnorm" else LayerNorm
        layers: list[Layer] = [TokenEmbedding(
            cfg.vocabulary, cfg.embed_dim,
            cfg.sequence_length if cfg.positions == "learned" else None, name="embed")]
        layers += [TransformerBlock(cfg.heads, cfg.head_dim, cfg.mlp_dim,
                                    mlp_activation=cfg.mlp_activation, norm=cfg.norm,
                                    rotary=cfg.positions == "rotary", remat=cfg.remat,
                                    name=f"block{i}")
                   for i in range(1, cfg.layers + 1)]
        layers += [norm_cls(name="final_norm"), Unembed(cfg.vocabulary, tied=cfg.tied_embeddings,
                                                        name="unembed")]
        super().__init__("transformer", layers, (cfg.sequence_length,), cfg.vocabulary)
        if cfg.tied_embeddings:
            del self.param_shapes["unembed/embedding"]
            self._layer_keys[-1] = [("embed/embedding", "embedding")]

    def __repr__(self) -> str:
        return f"TransformerModel({self.config!r})"

    def prepare_params(self, core, params) -> list[dict[str, np.ndarray]]:
        """Per layer local param dicts; the weights a layer feeds to the MXU
        rounded to bf16 once when ``core.numerics`` (the tied table is
        rounded for the logits, not for the lookup), except on a timing-only core
        (``core.execute`` False), which computes no product (as ``Model.prepare_params``)."""
        self._check_params(params)
        rounding = core.numerics and core.execute
        return [{local: (to_bf16(params[key]) if rounding and local in layer.matmul_params
                         else params[key])
                 for key, local in keys}
                for layer, keys in zip(self.layers, self._layer_keys)]

    def gradient_buckets(self) -> tuple[tuple[str, int], ...]:
        """As ``Model.gradient_buckets``; the tied table counts once, in the
        embedding layer's bucket (its gradient is complete only there)."""
        first_use = {}
        for i, keys in enumerate(self._layer_keys):
            for key, _ in keys:
                first_use.setdefault(key, i)
        out = []
        for i in range(len(self.layers) - 1, -1, -1):
            n = sum(math.prod(self.param_shapes[k]) for k, _ in self._layer_keys[i]
                    if first_use[k] == i)
            if n:
                out.append((self.layers[i].name, n))
        return tuple(out)

    def loss_grads_and_state(self, core, params, x, y, *, state=None, rng=None):
        """As ``Model.loss_grads_and_state`` (no model state, no dropout);
        a parameter used by two layers gets the sum of their gradients."""
        self._check_x(x)
        local = self.prepare_params(core, params)
        out, caches = self.forward(core, local, x, training=True, rng=rng)
        loss, dy = self._loss(core, out, y)
        grads: dict[str, np.ndarray] = {}
        for i in range(len(self.layers) - 1, -1, -1):
            layer = self.layers[i]
            dy, g = layer.backward(core, local[i], caches[i], dy, need_dx=i > 0)
            for key, name in self._layer_keys[i]:
                grads[key] = g[name] if key not in grads else _add(
                    core, f"{layer.name}/tied_grad_sum", grads[key], g[name])
        grads = {k: grads[k].astype(params[k].dtype, copy=False) for k in params}
        return loss, grads, {}

    def summary_rows(self, batch: int | None = None):
        """As ``Model.summary_rows``; a tied output layer shows 0 parameters."""
        rows = super().summary_rows(batch)
        if self.config.tied_embeddings:
            name, shape, _, flops = rows[-1]
            rows[-1] = (name, shape, 0, flops)
        return rows

    def model_flops_per_example(self) -> int:
        """Model FLOPs of one training example (forward + backward, T tokens),
        without recomputation: 6 N T + 12 L T^2 D.

        6 N per token: a weight does 2 FLOPs per token forward and 4 backward
        (dX and dW), N = ``config.matmul_param_count()``. 12 L T D per token:
        q.k^T and p.v are 2 T D FLOPs each forward, twice that backward, in
        each of the L layers. The PaLM formula (Chowdhery et al. 2022,
        appendix B, "6N + 12LHQT" per token with H Q = D) as MaxText counts
        it (``maxtext_utils.calculate_tflops_training_per_device``, the full
        T x T attention, not halved for the causal mask, which is what this
        emulator's MXU computes). This is the numerator of MFU.
        """
        cfg = self.config
        t = cfg.sequence_length
        return 6 * cfg.matmul_param_count() * t + 12 * cfg.layers * t * t * cfg.inner_dim

    def hardware_flops_per_example(self) -> int:
        """MXU FLOPs actually run per training example: the model FLOPs plus
        the forward work ``remat`` redoes in backward (``full``: each block's
        forward less its MLP output projection; none for ``none`` and
        ``minimal``, whose recomputation is VPU work only). The numerator of
        hardware FLOPs utilisation (HFU, Korthikanti et al. 2022)."""
        return self.model_flops_per_example() + sum(
            layer.recompute_flops(s) for layer, s in zip(self.layers, self._shapes)
            if isinstance(layer, TransformerBlock))

    def next_token_logits(self, core, params, ids) -> np.ndarray:
        """Eval-mode logits of the token after the last of ``ids``.

        Args:
            core: the ``chip.TensorCore``.
            params: the model's parameters.
            ids: (B, t) token ids, 1 <= t; only the last ``sequence_length``
                are used (the context window).

        Returns:
            (B, V) logits.
        """
        ids = np.asarray(ids)[:, -self.config.sequence_length:]
        x = ids
        for layer, p in zip(self.layers, self.prepare_params(core, params)):
            x, _ = layer.forward(core, p, x, training=False)
        return x[:, -1]

    def sample(self, core, params, prompt_ids, *, length: int, temperature: float = 1.0,
               seed: int = 0) -> list[int]:
        """Continues ``prompt_ids`` with ``length`` sampled tokens.

        Each new token runs the model on the last ``sequence_length`` tokens
        (no key/value cache: the cost of a token is one window's forward).

        Args:
            core: the ``chip.TensorCore`` that runs (and costs) the forwards.
            params: the model's parameters.
            prompt_ids: at least one token id to start from.
            length: tokens to generate (>= 1).
            temperature: > 0; the logits are divided by it.
            seed: seed of the sampling generator.

        Returns:
            The generated token ids (without the prompt).

        Raises:
            ValueError: an empty prompt, a bad length or temperature.
        """
        check_int(length, "length")
        check_number(temperature, "temperature", low=0.0, low_open=True)
        ids = [int(i) for i in prompt_ids]
        if not ids:
            raise ValueError("sample needs at least one prompt token")
        rng = np.random.default_rng(seed)
        start = len(ids)
        for _ in range(length):
            z = self.next_token_logits(core, params, np.array([ids]))[0].astype(np.float64)
            z = z / temperature
            p = np.exp(z - z.max())
            ids.append(int(rng.choice(p.size, p=p / p.sum())))
        return ids[start:]


def build_transformer(input_shape, num_classes: int, **options) -> TransformerModel:
    """Builds the ``transformer`` model from ``build_model`` arguments.

    Args:
        input_shape: (T,) token ids per example.
        num_classes: V, the vocabulary.
        **options: the ``TransformerConfig`` fields in ``TRANSFORMER_OPTIONS``.

    Raises:
        ValueError: a bad input shape or option, in one line.
    """
    if len(input_shape) != 1:
        raise DataMismatchError(f"transformer: input_shape must be (steps,) token ids, "
                         f"got {tuple(input_shape)}")
    return TransformerModel(TransformerConfig(vocabulary=num_classes,
                                              sequence_length=int(input_shape[0]), **options))

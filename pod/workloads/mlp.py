"""The transformer block's feed-forward part (MLP) and its activations.

Gated MLPs (SwiGLU, GeGLU) have two input projections and an output one;
plain ones (relu, gelu) one input projection. Products on the MXU
(``core.matmul``), activations on the VPU (``core.vector``).
"""

from __future__ import annotations

import math
from types import MappingProxyType

import numpy as np

from pod.workloads.checks import check_int
from pod.workloads.fusion import after, epilogue
from pod.workloads.layers import Layer, glorot_uniform, mxu_input, sigmoid, vector_op

__all__ = ["MLP", "MLP_ACTIVATIONS", "gelu", "gelu_grad", "relu", "add"]

#: MLP activations: "gated_silu" (SwiGLU, MaxText [silu, linear]), "gated_gelu"
#: (GeGLU, [gelu, linear]), "gelu" (GPT-2 / GPT-3), "relu" (the MaxText 2023 base config).
MLP_ACTIVATIONS = ("gated_silu", "gated_gelu", "gelu", "relu")


def add(core, name: str, a: np.ndarray, b: np.ndarray, fused: str | None = None) -> np.ndarray:
    """a + b on the VPU (``vector_op``: on a timing-only core only its cost; ``fused``
    as ``chip.TensorCore.vector``)."""
    return vector_op(core, name, np.add, a, b, out=(np.broadcast_shapes(a.shape, b.shape),
                                                    np.result_type(a, b)), fused=fused)


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


def relu(u: np.ndarray) -> np.ndarray:
    """max(u, 0)."""
    return np.maximum(u, np.asarray(0, u.dtype))


#: Per activation: (forward fn of the MLP input products, its VPU element-ops,
#: transcendental, backward element-ops). Gated ones take (a, b) and return
#: act(a) * b; the others take u.
_ACTIVATIONS = {
    "gated_silu": (lambda a, b: a * sigmoid(a) * b, 5.0, True, 8.0),
    "gated_gelu": (lambda a, b: gelu(a) * b, 9.0, True, 13.0),
    "gelu": (gelu, 8.0, True, 12.0),
    "relu": (relu, 1.0, False, 2.0),
}


def _activation_grads(activation: str, d, u):
    """Gradients of the MLP input products from d = dL/d act-output."""
    if activation == "gated_silu":
        a, b = u
        one = np.asarray(1.0, d.dtype)
        s = sigmoid(a)
        return d * b * s * (one + a * (one - s)), d * a * s              # d u0, d u1
    if activation == "gated_gelu":
        a, b = u
        return d * b * gelu_grad(a), d * gelu(a)
    if activation == "gelu":
        return d * gelu_grad(u[0])
    return d * (u[0] > 0)


def activation_backward(core, name: str, activation: str, gated: bool, fusion: bool,
                        dg: np.ndarray, u: list[np.ndarray]) -> tuple[np.ndarray, ...]:
    """The MLP activation's backward on the VPU, fused per ``fusion`` as the forward:
    ``dg`` (..., F) the gradient of the activation's output, ``u`` its inputs (one, or
    gate and up when ``gated``); returns one gradient per input. Shared by
    :class:`MLP` and the MoE's experts."""
    out = [(dg.shape, dg.dtype)] * len(u)
    du = vector_op(core, f"{name}/{activation}_bwd",
                   lambda d, *a: _activation_grads(activation, d, a), dg, *u,
                   out=out if gated else out[0], ops_per_element=_ACTIVATIONS[activation][3],
                   transcendental=activation != "relu", fused=epilogue(fusion))
    return du if gated else (du,)


class MLP(Layer):
    """The block's feed-forward part over (B, T, C).

    Gated (MaxText ``mlp_activations: [<act>, linear]``): y = (act(x W0) *
    (x W1)) Wo, params ``wi_0``, ``wi_1`` (C, F), ``wo`` (F, C); ``gated_silu``
    is SwiGLU (Shazeer 2020), ``gated_gelu`` GeGLU. Not gated (``[<act>]``):
    y = act(x Wi) Wo, params ``wi`` (C, F), ``wo`` (F, C); ``relu`` is the
    MaxText 2023 base config's, ``gelu`` GPT-2 / GPT-3's. With ``use_bias``
    the input projections have biases ``<wi>_bias`` (F,) (the output bias is
    the block's, added after the tensor-parallel sum).

    Args:
        mlp_dim: F.
        activation: one of ``MLP_ACTIVATIONS``.
        use_bias: biases on the input projections.
        fusion: fuse the elementwise work into the matmuls (``pod.workloads.fusion``).
        quantized: AQT int8 products, forward and backward (``pod.workloads.quantization``).
        name: layer name.
    """

    kind = "mlp"

    def __init__(self, mlp_dim: int, activation: str = "gated_silu", *, use_bias: bool = False,
                 fusion: bool = False, quantized: bool = False, name: str | None = None):
        super().__init__(name)
        self.fusion = bool(fusion)
        self.q8 = {"quantized": True} if quantized else {}  # AQT int8 products
        self.mlp_dim = check_int(mlp_dim, "MLP mlp_dim")
        if activation not in MLP_ACTIVATIONS:
            raise ValueError(f"MLP activation must be one of {', '.join(MLP_ACTIVATIONS)}, "
                             f"got {activation!r}")
        self.activation = activation
        self.gated = activation.startswith("gated_")
        self.use_bias = bool(use_bias)
        self.inputs = ("wi_0", "wi_1") if self.gated else ("wi",)
        self.matmul_params = (*self.inputs, "wo")
        # Megatron: hidden units split over the tensor devices (wi columns and
        # their biases, wo rows)
        biases = {f"{k}_bias": 0 for k in self.inputs} if self.use_bias else {}
        self.tensor_split = MappingProxyType({**{k: 1 for k in self.inputs}, **biases, "wo": 0})
        self.dot_keys = ("u0", "u1") if self.gated else ("u",)
        self.backward_keys = ("x", *self.dot_keys, "g")

    def param_shapes(self, input_shape):
        c, f = int(input_shape[-1]), self.mlp_dim
        shapes = {**{k: (c, f) for k in self.inputs}, "wo": (f, c)}
        if self.use_bias:
            shapes.update({f"{k}_bias": (f,) for k in self.inputs})
        return shapes

    def init_params(self, rng, input_shape):
        return {k: (glorot_uniform(rng, s, s[0], s[1]) if len(s) == 2 else np.zeros(s, np.float32))
                for k, s in self.param_shapes(input_shape).items()}

    def forward_flops(self, input_shape):
        return 2 * math.prod(input_shape) * self.mlp_dim * (len(self.inputs) + 1)

    def input_flops(self, input_shape) -> int:
        """FLOPs of one input projection (``wi``, ``wi_0`` or ``wi_1``) per example."""
        return 2 * math.prod(input_shape) * self.mlp_dim

    def output_flops(self, input_shape) -> int:
        """FLOPs of the output projection alone (skipped when recomputing)."""
        return 2 * math.prod(input_shape) * self.mlp_dim

    def cache_elements(self, input_shape):
        t = math.prod(input_shape[:-1])
        return math.prod(input_shape) + (len(self.inputs) + 1) * t * self.mlp_dim  # x, u's, g

    def dot_elements(self, input_shape) -> int:
        return len(self.inputs) * math.prod(input_shape[:-1]) * self.mlp_dim

    def _activate(self, core, u, ran):
        """act(u); fused into the input projection when it ran, else into the next matmul."""
        fn, ops, transcendental, _ = _ACTIVATIONS[self.activation]
        return vector_op(core, f"{self.name}/{self.activation}", fn, *u,
                         out=(u[0].shape, u[0].dtype), ops_per_element=ops,
                         transcendental=transcendental, fused=after(self.fusion, ran))

    def _product(self, core, params, xr, w):
        z = core.matmul(xr, params[w], name=f"{self.name}/{w}", a_rounded=True,
                        b_rounded=True, **self.q8)                                   # (B*T, F)
        if self.use_bias:
            z = vector_op(core, f"{self.name}/{w}_bias", np.add, z, params[f"{w}_bias"],
                          out=(z.shape, z.dtype), fused=epilogue(self.fusion))
        return z

    def forward(self, core, params, x, *, training=False, rng=None, saved=None, need_output=True):
        lead = x.shape[:-1]
        xr = mxu_input(core, x).reshape(-1, x.shape[-1])                  # (B*T, C)
        kept = [saved is not None and key in saved for key in self.dot_keys]
        u = [saved[key] if was_kept else self._product(core, params, xr, w)
             for key, w, was_kept in zip(self.dot_keys, self.inputs, kept,
                                         strict=True)]            # (B*T, F) each
        g = mxu_input(core, self._activate(core, u, not kept[-1]))        # (B*T, F)
        cache = {"x": xr, **dict(zip(self.dot_keys, u, strict=True)), "g": g}
        if not need_output:
            return None, cache
        y = core.matmul(g, params["wo"], name=f"{self.name}/wo", a_rounded=True, b_rounded=True,
                        **self.q8)
        return y.reshape(*lead, y.shape[-1]), cache

    def backward(self, core, params, cache, dy, *, need_dx=True):
        xr, g = cache["x"], cache["g"]
        u = [cache[k] for k in self.dot_keys]
        lead = dy.shape[:-1]
        dyr = mxu_input(core, dy.reshape(-1, dy.shape[-1]))               # (B*T, C)
        grads = {"wo": core.matmul(g.T, dyr, name=f"{self.name}/d_wo",
                                   a_rounded=True, b_rounded=True, **self.q8)}       # (F, C)
        dg = core.matmul(dyr, params["wo"].T, name=f"{self.name}/d_hidden",
                         a_rounded=True, b_rounded=True, **self.q8)                  # (B*T, F)
        du = activation_backward(core, self.name, self.activation, self.gated, self.fusion,
                                 dg, u)
        dx = None
        for w, d in zip(self.inputs, du, strict=True):
            dr = mxu_input(core, d)                                       # (B*T, F)
            grads[w] = core.matmul(xr.T, dr, name=f"{self.name}/d_{w}",
                                   a_rounded=True, b_rounded=True, **self.q8)        # (C, F)
            if self.use_bias:  # a reduction across tokens: never fused
                grads[f"{w}_bias"] = vector_op(core, f"{self.name}/d_{w}_bias",
                                               lambda z: z.sum(axis=0), d,
                                               out=(d.shape[1:], d.dtype))
            if need_dx:
                part = core.matmul(dr, params[w].T, name=f"{self.name}/dx_{w}",
                                   a_rounded=True, b_rounded=True, **self.q8)        # (B*T, C)
                dx = part if dx is None else add(core, f"{self.name}/dx_sum", dx, part,
                                                 epilogue(self.fusion))
        return (None if dx is None else dx.reshape(*lead, dx.shape[-1])), grads

"""The transformer's normalizations: RMSNorm and LayerNorm over the last axis.

Both keep, for backward, the normalized input x_hat and one 1 / sigma per
position; their work runs on the VPU (``core.vector``; the rsqrt as
transcendental work). Pre-norm blocks (``pod.workloads.block``) and the final
norm of ``TransformerModel`` use them.
"""

from __future__ import annotations

import math

import numpy as np

from pod.workloads.checks import check_number
from pod.workloads.fusion import prologue
from pod.workloads.layers import Layer, vector_op

__all__ = ["NORMS", "RMSNorm", "LayerNorm", "norm_class"]

NORMS = ("rmsnorm", "layernorm")
_OWN = "own"  # forward / backward keyword default: the norm's own fusion (its constructor's)


class _Norm(Layer):
    """Shared shape handling of RMSNorm and LayerNorm (over the last axis)."""

    dot_keys: tuple[str, ...] = ()
    backward_keys = ("xhat", "inv")

    def __init__(self, epsilon: float = 1e-6, name: str | None = None, *, fusion: bool = False):
        super().__init__(name)
        self.epsilon = check_number(epsilon, f"{type(self).__name__} epsilon", low=0.0,
                                    low_open=True)
        # fused into the matmul that consumes the output (pod.workloads.fusion); the
        # scale (and bias) gradients, reductions across tokens, never are
        self.fused = prologue(fusion)

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

    def forward(self, core, params, x, *, training=False, rng=None, saved=None, need_output=True,
                fused: str | None = _OWN):
        """As ``Layer.forward``; ``fused`` overrides where the VPU work is fused
        (``chip.FUSIONS``; default: the constructor's ``fusion``, a prologue)."""
        fused = self.fused if fused == _OWN else fused
        eps = np.asarray(self.epsilon, x.dtype)
        stat = (x.shape[:-1] + (1,), x.dtype)
        inv = vector_op(core, f"{self.name}/rsqrt",
                        lambda v: 1.0 / np.sqrt((v * v).mean(axis=-1, keepdims=True) + eps), x,
                        out=stat, ops_per_element=2.0, transcendental=True,
                        fused=fused)                                       # (..., 1)
        scale = params["scale"].astype(x.dtype, copy=False)
        xhat, y = vector_op(core, f"{self.name}/normalize",
                            lambda v, s: (v * s, v * s * scale), x, inv,
                            out=[(x.shape, x.dtype)] * 2, ops_per_element=2.0, fused=fused)
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
                           ops_per_element=6.0, fused=self.fused)
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
                            transcendental=True, fused=self.fused)         # (..., 1) each
        scale = params["scale"].astype(x.dtype, copy=False)
        bias = params["bias"].astype(x.dtype, copy=False)
        xhat, y = vector_op(core, f"{self.name}/normalize",
                            lambda v, m, s: ((v - m) * s, (v - m) * s * scale + bias),
                            x, mu, inv, out=[(x.shape, x.dtype)] * 2, ops_per_element=4.0,
                            fused=self.fused)
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
                           ops_per_element=8.0, fused=self.fused)
        return dx, {"scale": dscale, "bias": dbias}


def norm_class(norm: str) -> type[_Norm]:
    """RMSNorm for "rmsnorm", LayerNorm for "layernorm".

    Raises:
        ValueError: another name, listing ``NORMS``.
    """
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {', '.join(NORMS)}, got {norm!r}")
    return RMSNorm if norm == "rmsnorm" else LayerNorm

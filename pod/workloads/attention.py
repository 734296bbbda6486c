"""Causal multi-head self-attention with rotary position embeddings (RoPE).

The layer follows the decoder attention of the open TPU stacks (MaxText's
``Attention`` with ``attention_type: global``): separate query, key and value
projections without biases (C, H*Dh), rotary embeddings on queries and keys,
softmax(q k^T / sqrt(Dh)) v under a causal mask, and an output projection
(H*Dh, C). The projections are 2-D GEMMs on the MXU (``core.matmul``); the
score and value products are batched over (batch x heads) with per-example
operands (``core.batch_matmul``); RoPE and the softmax run on the VPU
(``core.vector``, the softmax and the RoPE tables as transcendental work).

Sub-layers of a transformer block share one small protocol beyond ``Layer``:
``forward(..., saved=None, need_output=True)`` returns a cache dict;
``dot_keys`` names the cache entries that are MXU outputs (what a
"save the dots" rematerialisation policy keeps), ``backward_keys`` the
entries backward reads. Given ``saved`` (a dict of dot outputs), forward
reuses them instead of recomputing the products, so only the elementwise
work is redone (and costed).
"""

from __future__ import annotations

import math
from types import MappingProxyType

import numpy as np

from pod.workloads.checks import check_int
from pod.workloads.layers import Layer, glorot_uniform, mxu_input, timing_zeros, vector_op

ROPE_MAX_TIMESCALE = 10_000.0
"""RoPE wavelength base (Su et al. 2021, "RoFormer"; MaxText ``max_timescale``)."""


def rope_tables(steps: int, head_dim: int, dtype=np.float64) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of the rotary angles, position p and frequency i:
    angle = p / 10000^(2i / head_dim), i in [0, head_dim / 2).

    Args:
        steps: T, positions 0 .. T-1.
        head_dim: Dh, even.
        dtype: dtype of the tables.

    Returns:
        (cos, sin), each (T, Dh/2).
    """
    half = head_dim // 2
    timescale = ROPE_MAX_TIMESCALE ** (2.0 * np.arange(half) / head_dim)  # (Dh/2,)
    angle = np.arange(steps, dtype=np.float64)[:, None] / timescale       # (T, Dh/2)
    return np.cos(angle).astype(dtype), np.sin(angle).astype(dtype)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, *, inverse: bool = False) -> np.ndarray:
    """Rotates pairs (x[..., i], x[..., i + Dh/2]) by the angle of their position.

    The half-split layout of GPT-NeoX and MaxText (not interleaved pairs):
    out1 = x1 cos - x2 sin, out2 = x2 cos + x1 sin. ``inverse`` rotates by
    minus the angle, which is also the transpose (the rotation is orthogonal),
    i.e. the backward pass.

    Args:
        x: (..., T, Dh).
        cos, sin: (T, Dh/2) from ``rope_tables``.
        inverse: rotate by -angle.

    Returns:
        (..., T, Dh), x's dtype.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    s = -sin if inverse else sin
    return np.concatenate([x1 * cos - x2 * s, x2 * cos + x1 * s], axis=-1)


def causal_softmax(scores: np.ndarray, scale: float) -> np.ndarray:
    """softmax over the last axis of scale * scores, future keys (j > i) masked.

    Args:
        scores: (N, T, T) raw q.k products, query i on axis 1, key j on axis 2.
        scale: 1 / sqrt(Dh).

    Returns:
        (N, T, T) probabilities; zero above the diagonal.
    """
    t = scores.shape[-1]
    future = np.triu(np.ones((t, t), bool), k=1)                           # (T, T), j > i
    z = np.where(future, -np.inf, scores * np.asarray(scale, scores.dtype))
    e = np.exp(z - z.max(axis=-1, keepdims=True))                          # diagonal is finite
    return e / e.sum(axis=-1, keepdims=True)


def _dot(saved, key, compute):
    """A saved MXU output if there is one (no cost), else ``compute()``."""
    if saved is not None and key in saved:
        return saved[key]
    return compute()


class CausalSelfAttention(Layer):
    """Multi-head causal self-attention over (B, T, C) inputs.

    Params: ``query``, ``key``, ``value`` (C, H*Dh) and ``out`` (H*Dh, C),
    no biases. Output (B, T, C). Shorter sequences than the configured one
    work (the RoPE tables follow the input), which sampling uses.

    Args:
        heads: H.
        head_dim: Dh (even when ``rotary``).
        rotary: apply RoPE to queries and keys (else positions must come from
            elsewhere, e.g. learned position embeddings).
        name: layer name.

    Raises:
        ValueError: non-positive sizes, or an odd head_dim with rotary.
    """

    kind = "attention"
    matmul_params = ("query", "key", "value", "out")
    # Megatron: heads split over the tensor devices (q, k, v columns; out rows)
    tensor_split = MappingProxyType({"query": 1, "key": 1, "value": 1, "out": 0})
    dot_keys = ("q", "k", "v", "scores", "attn", "out")
    backward_keys = ("x", "qh", "kh", "vh", "probs", "o")

    def __init__(self, heads: int, head_dim: int, *, rotary: bool = True, name: str | None = None):
        super().__init__(name)
        self.heads = check_int(heads, "attention heads")
        self.head_dim = check_int(head_dim, "attention head_dim")
        if rotary and self.head_dim % 2:
            raise ValueError(f"attention head_dim must be even for rotary positions, got {head_dim!r}")
        self.rotary = bool(rotary)
        self.scale = 1.0 / math.sqrt(self.head_dim)

    @property
    def inner_dim(self) -> int:
        """H * Dh."""
        return self.heads * self.head_dim

    def _check(self, input_shape) -> tuple[int, int]:
        if len(input_shape) != 2:
            raise ValueError(f"{self.name}: attention expects (steps, features) inputs, "
                             f"got {tuple(input_shape)}")
        return int(input_shape[0]), int(input_shape[1])

    def param_shapes(self, input_shape):
        _, c = self._check(input_shape)
        d = self.inner_dim
        return {"query": (c, d), "key": (c, d), "value": (c, d), "out": (d, c)}

    def init_params(self, rng, input_shape):
        return {k: glorot_uniform(rng, s, s[0], s[1])
                for k, s in self.param_shapes(input_shape).items()}

    def forward_flops(self, input_shape):
        """Projections 2*T*C*D x 4, plus q.k^T and p.v, 2*T*T*D each (the
        full T x T products are computed, then masked, as on the MXU)."""
        t, c = self._check(input_shape)
        d = self.inner_dim
        return 8 * t * c * d + 4 * t * t * d

    def cache_elements(self, input_shape):
        """Per example, what backward reads: x, q, k, v after RoPE, the
        probabilities (H, T, T) and the merged heads (T, D)."""
        t, c = self._check(input_shape)
        d = self.inner_dim
        return t * c + 4 * t * d + self.heads * t * t

    def dot_elements(self, input_shape) -> int:
        """Per example, the MXU outputs ``dot_keys``: q, k, v, scores, p.v, out."""
        t, c = self._check(input_shape)
        d = self.inner_dim
        return 4 * t * d + self.heads * t * t + t * c

    def _heads(self, core, z, b, t):
        """(B*T, H*Dh) -> (B*H, T, Dh) (zeros, without a copy, on a timing-only core)."""
        if not core.execute:
            return timing_zeros((b * self.heads, t, self.head_dim), z.dtype)
        return z.reshape(b, t, self.heads, self.head_dim).transpose(0, 2, 1, 3).reshape(
            b * self.heads, t, self.head_dim)

    def _merge(self, core, z, b, t):
        """(B*H, T, Dh) -> (B*T, H*Dh) (zeros, without a copy, on a timing-only core)."""
        if not core.execute:
            return timing_zeros((b * t, self.inner_dim), z.dtype)
        return z.reshape(b, self.heads, t, self.head_dim).transpose(0, 2, 1, 3).reshape(
            b * t, self.inner_dim)

    def _rope(self, core, name, z, t, *, inverse=False):
        if not self.rotary:
            return z
        cos, sin = vector_op(core, f"{self.name}/rope_tables",
                             lambda: rope_tables(t, self.head_dim, z.dtype),
                             out=[((t, self.head_dim // 2), z.dtype)] * 2,
                             transcendental=True)                         # (T, Dh/2) each
        return vector_op(core, f"{self.name}/{name}",
                         lambda v: apply_rope(v, cos, sin, inverse=inverse), z,
                         out=(z.shape, z.dtype), ops_per_element=3.0)

    def forward(self, core, params, x, *, training=False, rng=None, saved=None, need_output=True):
        b, t, c = x.shape
        xr = mxu_input(core, x).reshape(b * t, c)                         # (B*T, C)

        def project(key):
            return core.matmul(xr, params[key], name=f"{self.name}/{key}",
                               a_rounded=True, b_rounded=True)            # (B*T, D)

        q = _dot(saved, "q", lambda: project("query"))
        k = _dot(saved, "k", lambda: project("key"))
        v = _dot(saved, "v", lambda: project("value"))
        qh = self._rope(core, "rope_q", self._heads(core, q, b, t), t)         # (B*H, T, Dh)
        kh = self._rope(core, "rope_k", self._heads(core, k, b, t), t)
        vh = self._heads(core, v, b, t)
        scores = _dot(saved, "scores", lambda: core.batch_matmul(
            qh, kh.transpose(0, 2, 1), name=f"{self.name}/scores"))        # (B*H, T, T)
        probs = vector_op(core, f"{self.name}/softmax", lambda s: causal_softmax(s, self.scale),
                          scores, out=(scores.shape, scores.dtype), ops_per_element=5.0,
                          transcendental=True)
        attn = _dot(saved, "attn", lambda: core.batch_matmul(
            probs, vh, name=f"{self.name}/context"))                      # (B*H, T, Dh)
        o = mxu_input(core, self._merge(core, attn, b, t))                      # (B*T, D)
        out = None
        if need_output:
            out = _dot(saved, "out", lambda: core.matmul(o, params["out"], name=f"{self.name}/out",
                                                         a_rounded=True, b_rounded=True))
        cache = {"x": xr, "q": q, "k": k, "v": v, "qh": qh, "kh": kh, "vh": vh,
                 "scores": scores, "probs": probs, "attn": attn, "o": o, "out": out}
        y = None if out is None else out.reshape(b, t, c)                  # (B, T, C)
        return y, cache

    def backward(self, core, params, cache, dy, *, need_dx=True):
        xr, qh, kh, vh, probs, o = (cache[k] for k in self.backward_keys)
        b, t, c = dy.shape
        dyr = mxu_input(core, dy.reshape(b * t, c))                       # (B*T, C)
        grads = {"out": core.matmul(o.T, dyr, name=f"{self.name}/d_out",
                                    a_rounded=True, b_rounded=True)}      # (D, C)
        do = core.matmul(dyr, params["out"].T, name=f"{self.name}/d_context",
                         a_rounded=True, b_rounded=True)                  # (B*T, D)
        doh = self._heads(core, do, b, t)                                       # (B*H, T, Dh)
        dprobs = core.batch_matmul(doh, vh.transpose(0, 2, 1), name=f"{self.name}/d_probs")
        dvh = core.batch_matmul(probs.transpose(0, 2, 1), doh, name=f"{self.name}/d_value")
        scale = np.asarray(self.scale, dprobs.dtype)
        ds = vector_op(core, f"{self.name}/softmax_bwd",
                       lambda dp, p: p * (dp - (dp * p).sum(axis=-1, keepdims=True)) * scale,
                       dprobs, probs, out=(dprobs.shape, dprobs.dtype),
                       ops_per_element=4.0)                               # (B*H, T, T)
        dqh = core.batch_matmul(ds, kh, name=f"{self.name}/d_query")      # (B*H, T, Dh)
        dkh = core.batch_matmul(ds.transpose(0, 2, 1), qh, name=f"{self.name}/d_key")
        dqh = self._rope(core, "rope_q_bwd", dqh, t, inverse=True)
        dkh = self._rope(core, "rope_k_bwd", dkh, t, inverse=True)
        dx = None
        for key, dz in (("query", dqh), ("key", dkh), ("value", dvh)):
            dzr = mxu_input(core, self._merge(core, dz, b, t))                  # (B*T, D)
            grads[key] = core.matmul(xr.T, dzr, name=f"{self.name}/d_{key}",
                                     a_rounded=True, b_rounded=True)      # (C, D)
            if need_dx:
                part = core.matmul(dzr, params[key].T, name=f"{self.name}/dx_{key}",
                                   a_rounded=True, b_rounded=True)        # (B*T, C)
                dx = part if dx is None else vector_op(core, f"{self.name}/dx_sum", np.add, dx, part,
                                                       out=(part.shape, part.dtype))
        return (None if dx is None else dx.reshape(b, t, c)), grads

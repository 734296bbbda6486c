"""Causal self-attention (multi-head or grouped-query) with rotary position embeddings (RoPE).

The layer follows the decoder attention of the open TPU stacks (MaxText's
``Attention`` with ``attention_type: global``): separate query, key and value
projections without biases (C, H*Dh), rotary embeddings on queries and keys,
softmax(q k^T / sqrt(Dh)) v under a causal mask, and an output projection
(H*Dh, C). The projections are 2-D GEMMs on the MXU (``core.matmul``); the
score and value products are batched over (batch x heads) with per-example
operands (``core.batch_matmul``); RoPE and the softmax run on the VPU
(``core.vector``, the softmax and the RoPE tables as transcendental work).

Two kernels for the score, softmax and value products (``attention``):
``dot_product`` (the T x T scores and probabilities as tensors of their own,
the probabilities kept for backward; MaxText ``attention: dot_product``) and
``flash`` (the blocked kernel of ``pod.workloads.flash``: no T x T tensor in
HBM, causal blocks skipped, scores recomputed in backward).

Sub-layers of a transformer block share one small protocol beyond ``Layer``:
``forward(..., saved=None, need_output=True)`` returns a cache dict;
``dot_keys`` names the cache entries that are MXU outputs (what a
"save the dots" rematerialisation policy keeps), ``backward_keys`` the
entries backward reads. Given ``saved`` (a dict of dot outputs), forward
reuses them instead of recomputing the products, so only the elementwise
work is redone (and costed).
"""

from __future__ import annotations

import functools
import math
from types import MappingProxyType

import numpy as np

from pod.workloads.checks import check_int
from pod.workloads.flash import (
    FLASH_BLOCK_SIZE,
    FORWARD_PRODUCTS,
    KERNEL_PRODUCTS,
    BackwardBlocks,
    causal_blocks,
    flash_backward,
    flash_forward,
    record_flash_backward,
    record_flash_forward,
)
from pod.workloads.fusion import after, epilogue, prologue
from pod.workloads.layers import Layer, glorot_uniform, mxu_input, timing_zeros, vector_op
from pod.workloads.norms import RMSNorm

ATTENTION_KERNELS = ("flash", "dot_product")

RELPOS_BUCKETS = 32
"""Buckets of the T5 relative position bias (Raffel et al. 2020, sec. 2.1; t5x
``RelativePositionBiases(num_buckets=32, max_distance=128)``, the values MaxText's
decoder of April 2023 built its per-layer bias with)."""
RELPOS_MAX_DISTANCE = 128
"""Distance from which every key falls into the last bucket (t5x's default, as above)."""

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


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, *,
               inverse: bool = False) -> np.ndarray:
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


def causal_mask(rows: int, steps: int) -> np.ndarray:
    """Where a query row may not see a key: key j after the row's position.

    Rows hold the positions of ``rows // steps`` query heads of one key /
    value head one after another (grouped-query layout, ``CausalSelfAttention``),
    so row r is position ``r % steps``.

    Args:
        rows: G * T query rows.
        steps: T, the keys.

    Returns:
        (rows, T) bool, True where key j > position of row r.
    """
    position = np.arange(rows) % steps                                    # (rows,)
    return np.arange(steps)[None, :] > position[:, None]


def relative_position_buckets(steps: int, buckets: int = RELPOS_BUCKETS,
                              max_distance: int = RELPOS_MAX_DISTANCE) -> np.ndarray:
    """The T5 relative position bucket of every (query, key) pair of a decoder:
    causal (unidirectional: t5x's ``bidirectional=False``, the decoder's), so only
    keys at or before the query are told apart. With n = query - key clipped at 0:
    n itself below ``buckets // 2``, then logarithmic up to ``max_distance``, the
    last bucket beyond (t5x ``RelativePositionBiases._relative_position_bucket``).

    Args:
        steps: T.
        buckets, max_distance: as above.

    Returns:
        (T, T) int32, query on axis 0, key on axis 1, values 0 .. buckets - 1.
    """
    position = np.arange(steps)
    n = np.maximum(position[:, None] - position[None, :], 0)            # (T, T)
    exact = buckets // 2
    with np.errstate(divide="ignore"):
        large = exact + (np.log(n.astype(np.float32) / exact + np.finfo(np.float32).eps)
                         / np.log(max_distance / exact) * (buckets - exact)).astype(np.int32)
    return np.where(n < exact, n, np.minimum(large, buckets - 1)).astype(np.int32)


def causal_softmax(scores: np.ndarray, scale: float, bias: np.ndarray | None = None
                   ) -> np.ndarray:
    """softmax over the last axis of scale * scores (+ bias), future keys masked.

    Args:
        scores: (N, G*T, T) raw q.k products, query row r (position r % T) on
            axis 1, key j on axis 2 (G = 1: plain multi-head attention).
        scale: 1 / sqrt(Dh).
        bias: None, or (K, G*T, T) added to the scaled scores of every example
            (N = B K: row n takes bias n % K; a relative position bias).

    Returns:
        (N, G*T, T) probabilities; zero for keys after the row's position.
    """
    future = causal_mask(scores.shape[-2], scores.shape[-1])             # (G*T, T)
    z = scores * np.asarray(scale, scores.dtype)
    if bias is not None:
        z = (z.reshape(-1, *bias.shape) + bias.astype(z.dtype)).reshape(scores.shape)
    z = np.where(future, -np.inf, z)
    e = np.exp(z - z.max(axis=-1, keepdims=True))                          # key 0 is finite
    return e / e.sum(axis=-1, keepdims=True)


def _dot(saved, key, compute):
    """A saved MXU output if there is one (no cost), else ``compute()``."""
    if saved is not None and key in saved:
        return saved[key]
    return compute()


class CausalSelfAttention(Layer):
    """Causal self-attention over (B, T, C) inputs, multi-head or grouped-query.

    H query heads share K key / value heads (grouped-query attention, Ainslie
    et al. 2023; MaxText ``num_kv_heads``): query head ``h`` reads kv head
    ``h // (H / K)``; K = H is multi-head attention, K = 1 multi-query.

    Params: ``query`` (C, H*Dh), ``key`` and ``value`` (C, K*Dh), ``out``
    (H*Dh, C). With ``fused_qkv`` one ``qkv`` (C, (H+2K)*Dh) instead of the
    three, its columns grouped per kv head: for kv head k, its G = H / K query
    heads, then its key head, then its value head (so splitting the columns
    into ``tensor`` equal chunks gives each device whole groups; MaxText
    ``fused_qkv``). With ``use_bias``: ``query_bias`` (H*Dh,), ``key_bias``,
    ``value_bias`` (K*Dh,) or ``qkv_bias`` ((H+2K)*Dh,); the bias of the output
    projection is the block's (``TransformerBlock``: it is added once, after
    the tensor-parallel sum of the row-parallel output). Output (B, T, C);
    shorter sequences than the configured one work (the RoPE tables follow
    the input), which sampling uses.

    Heads are laid out per kv head: queries (B*K, G*T, Dh), the G query heads
    of a group one after another (row r is position r % T), keys and values
    (B*K, T, Dh); the score and value products are then one batched matmul per
    kv head (no copy of a key per query head), as XLA's grouped einsum.

    With ``qk_norm`` (MaxText ``use_qk_norm``; every layer of MaxText's April 2023
    decoder, "query_layer_norm" / "key_layer_norm"): each head's query and key are
    RMS-normalised over Dh after their projection, before RoPE, with params
    ``query_norm`` and ``key_norm`` (Dh,) (one scale shared by the heads). With
    ``relative_bias`` (the T5 relative position bias of that decoder): a learned
    ``relpos_bias`` (H, 32) per layer, looked up by each (query, key) pair's bucket
    (:func:`relative_position_buckets`) and added to the scaled scores before the
    softmax, as t5x computes it: the (H, 32) table times a (32, T, T) one-hot of the
    buckets on the MXU (one product per layer and step, shared by the examples);
    in backward the bias gradient is the sum over the examples of the scores'
    gradient (a VPU reduction) and the table's is that times the one-hot again.
    Only the ``dot_product`` kernel takes the bias (a flash kernel reading an
    (B, H, T, T) bias from HBM is not modelled).

    Args:
        heads: H.
        head_dim: Dh (even when ``rotary``).
        kv_heads: K, dividing H; None: H.
        rotary: apply RoPE to queries and keys (else positions must come from
            elsewhere, e.g. learned position embeddings).
        qk_norm: RMS-normalise each head's queries and keys.
        relative_bias: the T5 relative position bias (``dot_product`` only).
        quantized: AQT int8 products for the q, k, v and output projections, forward
            and backward (``pod.workloads.quantization``); the attention kernel's
            score and value products stay bf16.
        use_bias: biases on the q, k, v projections.
        fused_qkv: one (C, (H+2K)*Dh) projection instead of three.
        attention: the kernel, "flash" or "dot_product" (module docstring).
        block_size: the flash kernel's query block (``FLASH_BLOCK_SIZE``; MaxText
            ``sa_block_q``).
        block_kv: its key / value block (``sa_block_kv``); None: ``block_size``.
        backward_blocks: the flash backward's kernels and blocks
            (``pod.workloads.flash.BackwardBlocks``: MaxText's ``sa_block_q_dkv``, ...,
            ``sa_use_fused_bwd_kernel``); None: two kernels on the forward's blocks.
        fusion: fuse the elementwise work into the matmuls (``pod.workloads.fusion``).
        name: layer name.

    Raises:
        ValueError: non-positive sizes, K not dividing H, an odd head_dim
            with rotary, or an unknown kernel.
    """

    kind = "attention"

    def __init__(self, heads: int, head_dim: int, *, kv_heads: int | None = None,
                 rotary: bool = True, use_bias: bool = False, fused_qkv: bool = False,
                 attention: str = "dot_product", block_size: int = FLASH_BLOCK_SIZE,
                 block_kv: int | None = None, backward_blocks: BackwardBlocks | None = None,
                 fusion: bool = False, qk_norm: bool = False, relative_bias: bool = False,
                 quantized: bool = False, name: str | None = None):
        super().__init__(name)
        self.fusion = bool(fusion)
        # AQT int8 (pod.workloads.quantization): the projections' products, forward and
        # backward; the attention kernel's stay bf16
        self.q8 = {"quantized": True} if quantized else {}
        if attention not in ATTENTION_KERNELS:
            raise ValueError(f"attention kernel must be one of {', '.join(ATTENTION_KERNELS)}, "
                             f"got {attention!r}")
        self.flash = attention == "flash"
        if relative_bias and self.flash:
            raise ValueError("attention: a relative position bias needs the dot_product kernel "
                             "(the flash kernel takes no bias here)")
        self.qk_norm, self.relative_bias = bool(qk_norm), bool(relative_bias)
        self.norms = ({"query": RMSNorm(name=f"{self.name}/query_norm", fusion=fusion),
                       "key": RMSNorm(name=f"{self.name}/key_norm", fusion=fusion)}
                      if self.qk_norm else {})
        self.block_size = check_int(block_size, "attention block_size")
        self.block_kv = check_int(self.block_size if block_kv is None else block_kv,
                                  "attention block_kv")
        self.backward_blocks = backward_blocks or BackwardBlocks()
        for kernel, *blocks in self.backward_blocks.kernels(self.block_size, self.block_kv):
            for size in blocks:
                check_int(size, f"attention {kernel} backward block")
        self.heads = check_int(heads, "attention heads")
        self.head_dim = check_int(head_dim, "attention head_dim")
        self.kv_heads = (self.heads if kv_heads is None
                         else check_int(kv_heads, "attention kv_heads"))
        if self.heads % self.kv_heads:
            raise ValueError(f"attention kv_heads {kv_heads!r} must divide heads {heads!r}")
        if rotary and self.head_dim % 2:
            raise ValueError(f"attention head_dim must be even for rotary positions, "
                             f"got {head_dim!r}")
        self.rotary, self.use_bias, self.fused_qkv = bool(rotary), bool(use_bias), bool(fused_qkv)
        self.group = self.heads // self.kv_heads  # G query heads per kv head
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.projections = ("qkv",) if self.fused_qkv else ("query", "key", "value")
        self.matmul_params = (*self.projections, "out",
                              *(("relpos_bias",) if self.relative_bias else ()))
        # Megatron: heads split over the tensor devices (q, k, v columns and their
        # biases; out rows; a relative bias table's heads); the qk norms' scales
        # (over Dh) are replicated
        split = {k: 1 for k in self.projections}
        if self.use_bias:
            split.update({f"{k}_bias": 0 for k in self.projections})
        if self.relative_bias:
            split["relpos_bias"] = 0
        self.tensor_split = MappingProxyType({**split, "out": 0})
        self.tensor_partial = ("query_norm", "key_norm") if self.qk_norm else ()
        # the MXU outputs a "save the dots" policy can keep (the flash kernel's output
        # comes with its row statistics); what backward reads
        core = ("attn", "stats") if self.flash else ("scores", "attn")
        self.dot_keys = ("qkv" if self.fused_qkv else "q", *(() if self.fused_qkv else ("k", "v")),
                         *core, "out")
        self.backward_keys = ("x", "qh", "kh", "vh", *(("attn", "stats") if self.flash
                                                       else ("probs",)), "o",
                              *(("norms",) if self.qk_norm else ()))

    @property
    def inner_dim(self) -> int:
        """H * Dh, the width of the queries and of the context."""
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """K * Dh, the width of the keys and of the values."""
        return self.kv_heads * self.head_dim

    def _check(self, input_shape) -> tuple[int, int]:
        if len(input_shape) != 2:
            raise ValueError(f"{self.name}: attention expects (steps, features) inputs, "
                             f"got {tuple(input_shape)}")
        return int(input_shape[0]), int(input_shape[1])

    def _widths(self) -> dict[str, int]:
        """Output columns of each projection."""
        if self.fused_qkv:
            return {"qkv": self.inner_dim + 2 * self.kv_dim}
        return {"query": self.inner_dim, "key": self.kv_dim, "value": self.kv_dim}

    def param_shapes(self, input_shape):
        _, c = self._check(input_shape)
        shapes = {k: (c, n) for k, n in self._widths().items()}
        shapes["out"] = (self.inner_dim, c)
        if self.use_bias:
            shapes.update({f"{k}_bias": (n,) for k, n in self._widths().items()})
        if self.qk_norm:
            shapes.update({"query_norm": (self.head_dim,), "key_norm": (self.head_dim,)})
        if self.relative_bias:
            shapes["relpos_bias"] = (self.heads, RELPOS_BUCKETS)
        return shapes

    def init_params(self, rng, input_shape):
        """Glorot-uniform kernels (the bias table too: t5x's variance scaling, fan_avg,
        uniform), zero biases, unit norm scales."""
        return {k: (glorot_uniform(rng, s, s[0], s[1]) if len(s) == 2
                    else np.ones(s, np.float32) if k.endswith("_norm")
                    else np.zeros(s, np.float32))
                for k, s in self.param_shapes(input_shape).items()}

    def projection_flops(self, input_shape, key: str | None = None) -> int:
        """MXU FLOPs of q, k, v per example: 2 T C (H + 2K) Dh; of one of them
        with ``key`` (a cache key: "q" 2 T C H Dh, "k" or "v" 2 T C K Dh, "qkv"
        all three)."""
        t, c = self._check(input_shape)
        width = {None: self.inner_dim + 2 * self.kv_dim, "qkv": self.inner_dim + 2 * self.kv_dim,
                 "q": self.inner_dim, "k": self.kv_dim, "v": self.kv_dim}[key]
        return 2 * t * c * width

    def output_flops(self, input_shape) -> int:
        """MXU FLOPs of the output projection per example: 2 T H Dh C."""
        t, c = self._check(input_shape)
        return 2 * t * self.inner_dim * c

    def core_flops(self, input_shape) -> int:
        """Model FLOPs of q.k^T and p.v per example, 2 T T H Dh each: the full T x
        T products, as MaxText and PaLM count them (``core_mxu_flops``: what the
        kernel runs)."""
        t, _ = self._check(input_shape)
        return 4 * t * t * self.inner_dim

    def core_mxu_flops(self, input_shape, products: int) -> int:
        """MXU FLOPs per example of ``products`` score-sized block products as the
        forward kernel runs them: 2 T T Dh per head each for ``dot_product`` (every
        block computed, then masked); for ``flash`` 2 Dh per score element of
        the computed causal blocks (``flash.causal_blocks``)."""
        t, _ = self._check(input_shape)
        scores = (causal_blocks(t, self.block_size, self.block_kv).score_elements if self.flash
                  else t * t)
        return products * 2 * self.head_dim * self.heads * scores

    def backward_core_mxu_flops(self, input_shape) -> int:
        """MXU FLOPs per example of the kernel's backward: ``dot_product`` 4 score-sized
        products (dP, dV, dQ, dK); ``flash`` each backward kernel's products
        (``flash.KERNEL_PRODUCTS``: 4 + 3, both recompute S and dP; splash's fused
        kernel 5) over the causal blocks of its own block sizes."""
        if not self.flash:
            return self.core_mxu_flops(input_shape, 4)
        t, _ = self._check(input_shape)
        return sum(len(KERNEL_PRODUCTS[kernel]) * 2 * self.head_dim * self.heads
                   * causal_blocks(t, rows, cols).score_elements
                   for kernel, rows, cols in self.backward_blocks.kernels(self.block_size,
                                                                          self.block_kv))

    def hardware_flops(self, input_shape) -> int:
        """MXU FLOPs per example of forward and backward (dX and dW of the
        projections, the kernel's backward), without recomputation."""
        weights = self.projection_flops(input_shape) + self.output_flops(input_shape)
        return (3 * weights + self.core_mxu_flops(input_shape, FORWARD_PRODUCTS)
                + self.backward_core_mxu_flops(input_shape))

    def recompute_core_flops(self, input_shape, kept) -> int:
        """MXU FLOPs per example of rerunning the kernel's forward when ``kept``
        (cache keys) lacks its outputs: flash reruns the whole kernel unless
        "attn" (with its statistics) is kept; dot_product reruns q.k^T unless
        "scores" is kept and p.v unless "attn" is."""
        if self.flash:
            missing = 0 if "attn" in kept else FORWARD_PRODUCTS
        else:
            missing = ("scores" not in kept) + ("attn" not in kept)
        return self.core_mxu_flops(input_shape, missing)

    def forward_flops(self, input_shape):
        """Projections, output projection and the two attention products
        (``core_flops``: the model's count)."""
        return (self.projection_flops(input_shape) + self.output_flops(input_shape)
                + self.core_flops(input_shape))

    def cache_elements(self, input_shape):
        """Per example, what backward reads: x, q after RoPE, k after RoPE, v,
        the merged heads (T, H Dh), and the probabilities (H, T, T) or, with
        flash, the output in heads layout (T, H Dh) and its row statistics (H, T)."""
        t, c = self._check(input_shape)
        core = t * self.inner_dim + self.heads * t if self.flash else self.heads * t * t
        return t * c + 2 * t * self.inner_dim + 2 * t * self.kv_dim + core + self.norm_elements(t)

    def norm_elements(self, steps: int) -> int:
        """Per example, what the qk norms keep for backward: the normalised queries
        and keys (T H Dh + T K Dh) and one 1 / sigma per head and position (T (H +
        K)); 0 without ``qk_norm``."""
        if not self.qk_norm:
            return 0
        return steps * (self.inner_dim + self.kv_dim) + steps * (self.heads + self.kv_heads)

    def dot_elements(self, input_shape) -> int:
        """Per example, the MXU outputs ``dot_keys``: q, k, v, the scores (not with
        flash), p.v (with flash its statistics), out."""
        t, c = self._check(input_shape)
        core = self.heads * t if self.flash else self.heads * t * t
        return t * (self.inner_dim + 2 * self.kv_dim) + core + t * self.inner_dim + t * c

    # ------------------------------------------------------------ layouts

    def _q_heads(self, core, z, b, t):
        """(B*T, H*Dh) -> (B*K, G*T, Dh) (zeros, without a copy, on a timing-only core)."""
        shape = (b * self.kv_heads, self.group * t, self.head_dim)
        if not core.execute:
            return timing_zeros(shape, z.dtype)
        return z.reshape(b, t, self.kv_heads, self.group, self.head_dim).transpose(
            0, 2, 3, 1, 4).reshape(shape)

    def _kv_heads(self, core, z, b, t):
        """(B*T, K*Dh) -> (B*K, T, Dh)."""
        shape = (b * self.kv_heads, t, self.head_dim)
        if not core.execute:
            return timing_zeros(shape, z.dtype)
        return z.reshape(b, t, self.kv_heads, self.head_dim).transpose(0, 2, 1, 3).reshape(shape)

    def _merge(self, core, z, b, t):
        """(B*K, G*T, Dh) -> (B*T, H*Dh), the inverse of ``_q_heads``."""
        if not core.execute:
            return timing_zeros((b * t, self.inner_dim), z.dtype)
        return z.reshape(b, self.kv_heads, self.group, t, self.head_dim).transpose(
            0, 3, 1, 2, 4).reshape(b * t, self.inner_dim)

    def _kv_merge(self, core, z, b, t):
        """(B*K, T, Dh) -> (B*T, K*Dh), the inverse of ``_kv_heads``."""
        if not core.execute:
            return timing_zeros((b * t, self.kv_dim), z.dtype)
        return z.reshape(b, self.kv_heads, t, self.head_dim).transpose(0, 2, 1, 3).reshape(
            b * t, self.kv_dim)

    def _split_qkv(self, core, qkv):
        """Fused (B*T, (H+2K)*Dh) -> q (B*T, H*Dh), k, v (B*T, K*Dh), per the group layout."""
        n, kv, g, dh = qkv.shape[0], self.kv_heads, self.group, self.head_dim
        if not core.execute:
            return (timing_zeros((n, self.inner_dim), qkv.dtype),
                    *(timing_zeros((n, self.kv_dim), qkv.dtype),) * 2)
        z = qkv.reshape(n, kv, g + 2, dh)
        return (z[:, :, :g].reshape(n, self.inner_dim), z[:, :, g].reshape(n, self.kv_dim),
                z[:, :, g + 1].reshape(n, self.kv_dim))

    def _join_qkv(self, core, dq, dk, dv):
        """The inverse of ``_split_qkv``: (B*T, (H+2K)*Dh)."""
        n, kv, g, dh = dq.shape[0], self.kv_heads, self.group, self.head_dim
        if not core.execute:
            return timing_zeros((n, self.inner_dim + 2 * self.kv_dim), dq.dtype)
        return np.concatenate([dq.reshape(n, kv, g, dh), dk.reshape(n, kv, 1, dh),
                               dv.reshape(n, kv, 1, dh)], axis=2).reshape(n, -1)

    def _rope(self, core, name, z, t, *, inverse=False, fused=None):
        """RoPE on (N, R*T, Dh) heads (R = G for queries, 1 for keys)."""
        if not self.rotary:
            return z
        cos, sin = vector_op(core, f"{self.name}/rope_tables",
                             lambda: rope_tables(t, self.head_dim, z.dtype),
                             out=[((t, self.head_dim // 2), z.dtype)] * 2,
                             transcendental=True, fused=fused)            # (T, Dh/2) each

        def rotate(v):
            return apply_rope(v.reshape(v.shape[0], -1, t, v.shape[-1]), cos, sin,
                              inverse=inverse).reshape(v.shape)
        return vector_op(core, f"{self.name}/{name}", rotate, z, out=(z.shape, z.dtype),
                         ops_per_element=3.0, fused=fused)

    # ------------------------------------------------------------ passes

    def _product(self, core, params, xr, key):
        """x W (+ bias, fused into the product) for projection ``key``."""
        z = core.matmul(xr, params[key], name=f"{self.name}/{key}", a_rounded=True, b_rounded=True,
                        **self.q8)
        if not self.use_bias:
            return z
        return vector_op(core, f"{self.name}/{key}_bias", np.add, z, params[f"{key}_bias"],
                         out=(z.shape, z.dtype), fused=epilogue(self.fusion))

    def _heads_with_rope(self, core, params, xr, saved, b, t):
        """The projections, each followed by its qk norm and RoPE (fused into it when
        it ran): qh (B*K, G*T, Dh), kh, vh (B*K, T, Dh), the cache entries of the
        products and the qk norms' caches ({} without ``qk_norm``)."""
        norms: dict = {}

        def project(key, cache_key):
            ran = saved is None or cache_key not in saved
            return (self._product(core, params, xr, key) if ran else saved[cache_key]), ran

        def position(which, z, ran):
            # after a projection that did not run: its own op before the flash kernel,
            # a prologue of the scores product
            fused = after(self.fusion, ran, None if self.flash else "next")
            if self.qk_norm:
                z, norms[which] = self.norms[which].forward(
                    core, {"scale": params[f"{which}_norm"]}, z, fused=fused)
            return self._rope(core, f"rope_{which[0]}", z, t, fused=fused)

        if self.fused_qkv:
            qkv, ran = project("qkv", "qkv")                              # (B*T, (H+2K)*Dh)
            q, k, v = self._split_qkv(core, qkv)
            qh = position("query", self._q_heads(core, q, b, t), ran)
            kh = position("key", self._kv_heads(core, k, b, t), ran)
            return qh, kh, self._kv_heads(core, v, b, t), {"qkv": qkv}, norms
        q, ran = project("query", "q")
        qh = position("query", self._q_heads(core, q, b, t), ran)         # (B*K, G*T, Dh)
        k, ran = project("key", "k")
        kh = position("key", self._kv_heads(core, k, b, t), ran)          # (B*K, T, Dh)
        v, _ = project("value", "v")
        return qh, kh, self._kv_heads(core, v, b, t), {"q": q, "k": k, "v": v}, norms

    def _relpos_bias(self, core, params, t: int) -> np.ndarray:
        """The relative position bias of every head, (K, G*T, T) (head k G + g's rows
        at [k, g T:(g + 1) T]): the (H, 32) table times the buckets' one-hot on the
        MXU, once per layer and step (a gather of the table here)."""
        h, g = self.heads, self.group
        core.account_matmul(h, RELPOS_BUCKETS, t * t, name=f"{self.name}/relpos_bias")
        if not core.execute:
            return timing_zeros((self.kv_heads, g * t, t), np.float32)
        table = params["relpos_bias"]                                     # (H, 32)
        return table[:, _buckets(t)].reshape(self.kv_heads, g * t, t)     # (H, T, T) -> (K, G T, T)

    def _relpos_bias_grad(self, core, ds, t: int) -> np.ndarray:
        """The table's gradient (H, 32) from the scores' gradient ds (B*K, G*T, T) (of
        the scaled scores times the scale): the bias's gradient is ds / scale summed
        over the examples (a VPU reduction), the table's that times the one-hot
        (an MXU product, a scatter-add over the buckets here)."""
        k, g = self.kv_heads, self.group
        scale = np.asarray(self.scale, ds.dtype)
        dbias = vector_op(core, f"{self.name}/relpos_bias_bwd/sum",
                          lambda d: (d / scale).reshape(-1, k, g * t, t).sum(axis=0), ds,
                          out=((k, g * t, t), ds.dtype), ops_per_element=2.0)  # (K, G T, T)
        core.account_matmul(self.heads, t * t, RELPOS_BUCKETS,
                            name=f"{self.name}/relpos_bias_bwd/d_table")
        if not core.execute:
            return timing_zeros((self.heads, RELPOS_BUCKETS), ds.dtype)
        buckets = _buckets(t).reshape(-1)
        flat = dbias.reshape(self.heads, t * t)
        return np.stack([np.bincount(buckets, weights=row, minlength=RELPOS_BUCKETS)
                         for row in flat]).astype(ds.dtype)

    def _dot_product(self, core, params, qh, kh, vh, saved, t) -> dict:
        """Scores, probabilities and context as tensors of their own (the relative
        position bias added to the scaled scores in the softmax)."""
        ran = saved is None or "scores" not in saved
        scores = _dot(saved, "scores", lambda: core.batch_matmul(
            qh, kh.transpose(0, 2, 1), name=f"{self.name}/scores"))        # (B*K, G*T, T)
        bias = (self._relpos_bias(core, params, t),) if self.relative_bias else ()
        probs = vector_op(core, f"{self.name}/softmax",
                          lambda s, *b: causal_softmax(s, self.scale, *b), scores, *bias,
                          out=(scores.shape, scores.dtype), ops_per_element=5.0 + len(bias),
                          transcendental=True, fused=after(self.fusion, ran))
        attn = _dot(saved, "attn", lambda: core.batch_matmul(
            probs, vh, name=f"{self.name}/context"))                      # (B*K, G*T, Dh)
        return {"scores": scores, "probs": probs, "attn": attn}

    def _flash(self, core, qh, kh, vh, saved, b, t) -> dict:
        """The flash kernel's output and row statistics (reused when saved)."""
        if saved is not None and "attn" in saved:
            return {"attn": saved["attn"], "stats": saved["stats"]}
        record_flash_forward(core, self.name, b, self.heads, self.kv_heads, t, self.head_dim,
                             self.block_size, self.block_kv)
        if not core.execute:
            return {"attn": timing_zeros(qh.shape, qh.dtype),
                    "stats": timing_zeros(qh.shape[:2], qh.dtype)}
        attn, stats = flash_forward(qh, kh, vh, self.scale, self.block_size, core.numerics)
        return {"attn": attn, "stats": stats}  # (B*K, G*T, Dh), (B*K, G*T)

    def forward(self, core, params, x, *, training=False, rng=None, saved=None, need_output=True):
        b, t, c = x.shape
        xr = mxu_input(core, x).reshape(b * t, c)                         # (B*T, C)
        qh, kh, vh, dots, norms = self._heads_with_rope(core, params, xr, saved, b, t)
        kernel = (self._flash(core, qh, kh, vh, saved, b, t) if self.flash
                  else self._dot_product(core, params, qh, kh, vh, saved, t))
        o = mxu_input(core, self._merge(core, kernel["attn"], b, t))      # (B*T, H*Dh)
        out = None
        if need_output:
            out = _dot(saved, "out", lambda: core.matmul(o, params["out"], name=f"{self.name}/out",
                                                         a_rounded=True, b_rounded=True, **self.q8))
        cache = {"x": xr, **dots, "qh": qh, "kh": kh, "vh": vh, **kernel, "o": o, "out": out,
                 **({"norms": norms} if self.qk_norm else {})}
        y = None if out is None else out.reshape(b, t, c)                  # (B, T, C)
        return y, cache

    def _input_grads(self, core, params, xr, dzs, grads, need_dx):
        """Weight (and bias) gradients of the projections from their output
        gradients ``dzs`` (projection -> (B*T, width)); their input gradient."""
        dx = None
        for key, dz in dzs.items():
            dzr = mxu_input(core, dz)
            grads[key] = core.matmul(xr.T, dzr, name=f"{self.name}/d_{key}",
                                     a_rounded=True, b_rounded=True, **self.q8)      # (C, width)
            if self.use_bias:  # a reduction across tokens: never fused
                grads[f"{key}_bias"] = vector_op(core, f"{self.name}/d_{key}_bias",
                                                 lambda d: d.sum(axis=0), dz,
                                                 out=(dz.shape[1:], dz.dtype))
            if need_dx:
                part = core.matmul(dzr, params[key].T, name=f"{self.name}/dx_{key}",
                                   a_rounded=True, b_rounded=True, **self.q8)        # (B*T, C)
                dx = part if dx is None else vector_op(core, f"{self.name}/dx_sum", np.add, dx,
                                                       part, out=(part.shape, part.dtype),
                                                       fused=epilogue(self.fusion))
        return dx

    def _dot_product_backward(self, core, cache, doh, grads, t):
        """dq (B*K, G*T, Dh), dk, dv (B*K, T, Dh) from the kept probabilities (and the
        relative position bias table's gradient into ``grads``)."""
        qh, kh, vh, probs = cache["qh"], cache["kh"], cache["vh"], cache["probs"]
        dprobs = core.batch_matmul(doh, vh.transpose(0, 2, 1), name=f"{self.name}/d_probs")
        dvh = core.batch_matmul(probs.transpose(0, 2, 1), doh, name=f"{self.name}/d_value")
        scale = np.asarray(self.scale, dprobs.dtype)
        ds = vector_op(core, f"{self.name}/softmax_bwd",
                       lambda dp, p: p * (dp - (dp * p).sum(axis=-1, keepdims=True)) * scale,
                       dprobs, probs, out=(dprobs.shape, dprobs.dtype),
                       ops_per_element=4.0, fused=prologue(self.fusion))  # (B*K, G*T, T)
        if self.relative_bias:
            grads["relpos_bias"] = self._relpos_bias_grad(core, ds, t)
        dqh = core.batch_matmul(ds, kh, name=f"{self.name}/d_query")      # (B*K, G*T, Dh)
        dkh = core.batch_matmul(ds.transpose(0, 2, 1), qh,
                                name=f"{self.name}/d_key")                # (B*K, T, Dh)
        return dqh, dkh, dvh

    def _flash_backward(self, core, cache, doh, b, t):
        """The flash kernels' dq, dk, dv (scores recomputed by blocks)."""
        qh, kh, vh = cache["qh"], cache["kh"], cache["vh"]
        record_flash_backward(core, self.name, b, self.heads, self.kv_heads, t, self.head_dim,
                              self.block_size, self.block_kv, self.backward_blocks)
        if not core.execute:
            return (timing_zeros(qh.shape, qh.dtype), timing_zeros(kh.shape, kh.dtype),
                    timing_zeros(vh.shape, vh.dtype))
        return flash_backward(qh, kh, vh, cache["attn"], cache["stats"], doh, self.scale,
                              self.block_size, core.numerics)

    def _position_grad(self, core, params, cache, grads, which: str, dz, t: int):
        """The gradient through ``which``'s RoPE and qk norm (the scale's gradient into
        ``grads``), fused into the weight-gradient product."""
        dz = self._rope(core, f"rope_{which[0]}_bwd", dz, t, inverse=True,
                        fused=prologue(self.fusion))
        if not self.qk_norm:
            return dz
        dz, g = self.norms[which].backward(core, {"scale": params[f"{which}_norm"]},
                                           cache["norms"][which], dz)
        grads[f"{which}_norm"] = g["scale"]
        return dz

    def backward(self, core, params, cache, dy, *, need_dx=True):
        xr, o = cache["x"], cache["o"]
        b, t, c = dy.shape
        dyr = mxu_input(core, dy.reshape(b * t, c))                       # (B*T, C)
        grads = {"out": core.matmul(o.T, dyr, name=f"{self.name}/d_out",
                                    a_rounded=True, b_rounded=True, **self.q8)}      # (H*Dh, C)
        do = core.matmul(dyr, params["out"].T, name=f"{self.name}/d_context",
                         a_rounded=True, b_rounded=True, **self.q8)                  # (B*T, H*Dh)
        doh = self._q_heads(core, do, b, t)                               # (B*K, G*T, Dh)
        dqh, dkh, dvh = (self._flash_backward(core, cache, doh, b, t) if self.flash
                         else self._dot_product_backward(core, cache, doh, grads, t))
        dq = self._merge(core, self._position_grad(core, params, cache, grads, "query", dqh, t),
                         b, t)
        dk = self._kv_merge(core, self._position_grad(core, params, cache, grads, "key", dkh, t),
                            b, t)
        dv = self._kv_merge(core, dvh, b, t)
        dzs = ({"qkv": self._join_qkv(core, dq, dk, dv)} if self.fused_qkv
               else {"query": dq, "key": dk, "value": dv})
        dx = self._input_grads(core, params, xr, dzs, grads, need_dx)
        return (None if dx is None else dx.reshape(b, t, c)), grads


@functools.lru_cache(maxsize=16)
def _buckets(steps: int) -> np.ndarray:
    """:func:`relative_position_buckets` of ``steps`` positions, kept (read-only)."""
    out = relative_position_buckets(steps)
    out.flags.writeable = False
    return out

"""A JAX reference of the project's transformer, written the way MaxText writes its decoder.

This is what the oracle compiles: a decoder-only language model with the options of
``pod.workloads.transformer.TransformerConfig`` (and the few the project does not have yet:
``weight_dtype``, T5 relative position bias, QK norm), built as MaxText builds it, so that
what XLA keeps in HBM is what MaxText's step keeps:

- layers under ``jax.lax.scan`` (MaxText ``scan_layers: true``), their parameters stacked on
  axis ``param_scan_axis`` (MaxText's default 1: flax's scan moves it to the front);
- every layer wrapped in ``jax.checkpoint`` with MaxText's policy for ``remat_policy``
  (``layers/decoders.py`` ``get_remat_policy``), the tensors named with
  ``checkpoint_name`` as MaxText names them (``decoder_layer_input``, ``query_proj``,
  ``key_proj``, ``value_proj``, ``qkv_proj``, ``context``, ``out_proj``, ``mlpwi``,
  ``mlpwi_0``, ``mlpwi_1``, ``mlpwo``);
- parameters in ``weight_dtype`` (float32 by default), cast to bfloat16 at each matmul
  (``jnp.asarray(kernel, dtype)`` in MaxText's ``DenseGeneral``); activations bfloat16;
- sharding constraints on the activations at MaxText's places, with MaxText's logical axis
  names (``tools.xla_oracle.sharding``);
- flash attention as MaxText's ``tpu_flash_attention``: the Pallas TPU kernel inside
  ``shard_map`` (splash attention for the 2025 era; the Pallas ``flash_attention`` kernel,
  causal, for 2023); ``dot_product`` as MaxText's ``apply_attention_dot``;
- a mixture of experts as MaxText's ``moe.py`` with ``megablox: false``: a capacity factor
  > 0 is the dense einsum dispatch with token dropping (``generate_masks``, dispatch and
  combine one-hot tensors); dropless (0) is ``dense_matmul`` without masks (every expert
  computes every token, weighted by the router's top-k; the products constrained to the
  tokens' sharding, the experts whole, as ``dense_matmul`` constrains them);
- the loss MaxText's ``cross_entropy_with_logits`` (a custom VJP saving the logits, the
  one-hot targets, the shifted exponentials and the log-softmax), logits cast to float32
  (2025 ``cast_logits_to_fp32``) or kept bfloat16 (2023).

Not modelled (stated): dropout (MaxText's rows ran with ``dropout_rate: 0``), packing and
segment masks beyond the all-ones segment ids the kernels take, MaxText's megablox grouped
matmul (``sparse_matmul: true``), pipeline stages, quantization (AQT int8).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tools.xla_oracle.sharding import logical_to_mesh

__all__ = ["OracleModel", "ModelOptions", "remat_policy", "REMAT_NAMES", "REMAT_POLICIES"]

#: MaxText's checkpoint names in a decoder layer
REMAT_NAMES = ("decoder_layer_input", "query_proj", "key_proj", "value_proj", "qkv_proj",
               "context", "out_proj", "mlpwi", "mlpwi_0", "mlpwi_1", "mlpwo")
_QKV = ("query_proj", "value_proj", "key_proj", "qkv_proj")

#: MaxText ``remat_policy`` values this reference knows (``layers/decoders.py``)
REMAT_POLICIES = ("none", "full", "minimal", "save_dot_with_context_except_mlp",
                  "save_dot_except_mlpwi", "save_dot_except_mlp", "save_qkv_proj",
                  "qkv_proj_offloaded", "minimal_offloaded", "custom")


def remat_policy(name: str, custom: Mapping[str, str] | None = None) -> Callable | None | bool:
    """MaxText's ``jax.checkpoint`` policy for ``remat_policy`` ``name``.

    Returns:
        False for ``none`` (the layer is not wrapped in ``jax.checkpoint``; MaxText at
        76bd53b0f wraps only when the policy is not "none"), None for ``full`` (nothing
        saveable), else a ``jax.checkpoint_policies`` policy.

    Raises:
        ValueError: an unknown name, or a custom choice other than remat / device /
            offload.
    """
    cp = jax.checkpoint_policies
    if name == "none":
        return False
    if name == "full":
        return None
    if name == "minimal":
        return cp.checkpoint_dots_with_no_batch_dims
    if name == "minimal_offloaded":
        return cp.offload_dot_with_no_batch_dims(offload_src="device", offload_dst="pinned_host")
    saved = {
        "save_dot_with_context_except_mlp": (*_QKV, "context", "out_proj"),
        "save_dot_except_mlpwi": (*_QKV, "out_proj", "mlpwo"),
        "save_dot_except_mlp": (*_QKV, "out_proj"),
        "save_qkv_proj": _QKV,
    }
    if name in saved:
        return cp.save_only_these_names(*saved[name])
    if name == "qkv_proj_offloaded":
        return cp.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=["query_proj", "value_proj", "key_proj"],
            offload_src="device", offload_dst="pinned_host")
    if name == "custom":
        choices = {n: "remat" for n in REMAT_NAMES}
        choices["decoder_layer_input"] = "device"  # MaxText's default for it
        for key, value in (custom or {}).items():
            if key not in choices or value not in ("remat", "device", "offload"):
                raise ValueError(f"remat_custom: {key}={value!r}; tensors {REMAT_NAMES}, "
                                 "choices remat | device | offload")
            choices[key] = value
        return cp.save_and_offload_only_these_names(
            names_which_can_be_saved=[n for n, c in choices.items() if c == "device"],
            names_which_can_be_offloaded=[n for n, c in choices.items() if c == "offload"],
            offload_src="device", offload_dst="pinned_host")
    raise ValueError(f"remat policy {name!r} is not one of {', '.join(REMAT_POLICIES)}")


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    """The reference's options: ``TransformerConfig``'s (resolved: head_dim, kv_heads and
    mlp_dim are ints) plus the oracle's own.

    Attributes (beyond TransformerConfig's, whose docstring has them):
        remat: a MaxText ``remat_policy`` (``REMAT_POLICIES``).
        remat_custom: with ``custom``, tensor name -> remat | device | offload.
        era: "2023" or "2025": which MaxText the step follows (mesh axes, rules, the
            flash kernel, the logits dtype).
        weight_dtype: the parameters' (and AdamW moments') dtype, "float32" or "bfloat16".
        relative_position_buckets: T5 relative position bias buckets per layer; 0: none.
        qk_norm: a norm on each query and key head (MaxText 2023-04's QK layer norm).
        param_scan_axis: the stacked layers' axis in each parameter (MaxText's 1).
        flash_block: the flash kernel's block size along the sequence (capped at T).
        flash_fused_bwd: splash's fused backward kernel (``sa_use_fused_bwd_kernel``).
    """

    vocabulary: int
    sequence_length: int
    embed_dim: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp_dim: int
    mlp_activation: str
    layers: int
    norm: str = "rmsnorm"
    positions: str = "rotary"
    tied_embeddings: bool = True
    block: str = "sequential"
    use_bias: bool = False
    fused_qkv: bool = False
    attention: str = "flash"
    remat: str = "full"
    remat_custom: tuple[tuple[str, str], ...] = ()
    experts: int = 0
    experts_per_token: int = 1
    capacity_factor: float = 0.0
    era: str = "2025"
    weight_dtype: str = "float32"
    relative_position_buckets: int = 0
    qk_norm: bool = False
    param_scan_axis: int = 1
    flash_block: int = 512
    flash_fused_bwd: bool = False

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> ModelOptions:
        """From a resolved spec's ``model`` mapping (unknown keys are an error)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - fields)
        if unknown:
            raise ValueError(f"model options {unknown} are not modelled by the oracle")
        kw = dict(values)
        if isinstance(kw.get("remat_custom"), Mapping):
            kw["remat_custom"] = tuple(sorted(kw["remat_custom"].items()))
        elif kw.get("remat_custom") is None:
            kw["remat_custom"] = ()
        else:
            kw["remat_custom"] = tuple(tuple(p) for p in kw["remat_custom"])
        return cls(**kw)

    @property
    def gated(self) -> bool:
        return self.mlp_activation.startswith("gated_")


_ACTIVATIONS = {"relu": jax.nn.relu, "gelu": jax.nn.gelu, "silu": jax.nn.silu,
                "gated_silu": jax.nn.silu, "gated_gelu": jax.nn.gelu}


class OracleModel:
    """The reference model on a mesh: parameter shapes and shardings, the forward pass, the
    loss.

    Args:
        options: the model.
        mesh: a ``jax.sharding.Mesh`` with the era's MaxText axis names.
    """

    def __init__(self, options: ModelOptions, mesh: Mesh):
        self.o = options
        self.mesh = mesh
        self.sizes = dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))
        self.dtype = jnp.bfloat16
        self.wdtype = jnp.dtype(options.weight_dtype)

    # -- sharding ------------------------------------------------------------------------
    def spec(self, names) -> P:
        """The PartitionSpec of logical ``names`` under the era's rules."""
        return P(*logical_to_mesh(tuple(names), self.o.era, self.sizes))

    def constrain(self, x, names):
        """``nn.with_logical_constraint``."""
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, self.spec(names)))

    def _act(self, kind: str) -> tuple[str, ...]:
        """MaxText's activation logical axes per era."""
        e23 = self.o.era == "2023"
        table = {
            "residual": ("activation_batch", "activation_length" if e23 else
                         "activation_norm_length", "activation_embed"),
            "query": ("activation_batch", "activation_length", "activation_heads",
                      "activation_kv"),
            "kv": ("activation_batch", "activation_length",
                   "activation_heads" if e23 else "activation_kv_heads",
                   "activation_kv" if e23 else "activation_kv_head_dim"),
            "mlp": ("activation_batch", "activation_length", "activation_mlp"),
            "logits": ("activation_batch" if e23 else "activation_embed_and_logits_batch",
                       "activation_length", "activation_vocab"),
            "embed_out": ("activation_batch" if e23 else "activation_embed_and_logits_batch",
                          "activation_length", "activation_embed"),
            "xent": ("activation_batch" if e23 else "activation_embed_and_logits_batch",
                     "activation_length"),
        }
        return table[kind]

    # -- parameters ----------------------------------------------------------------------
    def param_defs(self) -> dict[str, tuple[tuple[int, ...], tuple[str | None, ...]]]:
        """Parameter path -> (shape, logical axes), MaxText's names and axes; a layer's
        parameters carry the stacked ``layers`` axis at ``param_scan_axis``."""
        o = self.o
        E, H, K, D, F, V, L = (o.embed_dim, o.heads, o.kv_heads, o.head_dim, o.mlp_dim,
                               o.vocabulary, o.layers)
        q_heads = "heads" if o.era == "2023" else "q_heads"
        kv_heads = "heads" if o.era == "2023" else "kv_heads"
        kv_dim = "kv" if o.era == "2023" else "kv_head_dim"
        layer: dict[str, tuple[tuple[int, ...], tuple[str | None, ...]]] = {}
        norms = ["pre_self_attention_norm"] + (["post_self_attention_norm"]
                                               if o.block == "sequential" else [])
        for n in norms:
            layer[f"{n}/scale"] = ((E,), ("norm",))
            if o.norm == "layernorm":
                layer[f"{n}/bias"] = ((E,), ("norm",))
        if o.fused_qkv:
            layer["attention/qkv/kernel"] = ((E, 3, H, D), ("embed", None, q_heads, "kv"))
        else:
            layer["attention/query/kernel"] = ((E, H, D), ("embed", q_heads, "kv"))
            layer["attention/key/kernel"] = ((E, K, D), ("embed", kv_heads, kv_dim))
            layer["attention/value/kernel"] = ((E, K, D), ("embed", kv_heads, kv_dim))
        layer["attention/out/kernel"] = ((H, D, E), ("heads", "kv", "embed"))
        if o.use_bias:
            layer["attention/query/bias"] = ((H, D), (q_heads, "kv"))
            layer["attention/key/bias"] = ((K, D), (kv_heads, kv_dim))
            layer["attention/value/bias"] = ((K, D), (kv_heads, kv_dim))
            layer["attention/out/bias"] = ((E,), ("embed",))
        if o.qk_norm:
            layer["attention/query_norm/scale"] = ((D,), ("norm",))
            layer["attention/key_norm/scale"] = ((D,), ("norm",))
        if o.relative_position_buckets:
            layer["attention/relpos_bias/rel_embedding"] = (
                (H, o.relative_position_buckets), ("heads", None))
        inputs = ("wi_0", "wi_1") if o.gated else ("wi",)
        if o.experts:
            X = o.experts
            layer["mlp/gate/kernel"] = ((E, X), ("embed", None))
            for w in inputs:
                layer[f"mlp/{w}"] = ((X, E, F), ("exp", "embed_no_exp", "mlp"))
            layer["mlp/wo"] = ((X, F, E), ("exp", "mlp", "embed_no_exp"))
        else:
            for w in inputs:
                layer[f"mlp/{w}/kernel"] = ((E, F), ("embed", "mlp"))
                if o.use_bias:
                    layer[f"mlp/{w}/bias"] = ((F,), ("mlp",))
            layer["mlp/wo/kernel"] = ((F, E), ("mlp", "embed"))
            if o.use_bias:
                layer["mlp/wo/bias"] = ((E,), ("embed",))
        out: dict[str, tuple[tuple[int, ...], tuple[str | None, ...]]] = {
            "token_embedder/embedding": ((V, E), ("vocab", "embed")),
            "decoder_norm/scale": ((E,), ("norm",)),
        }
        if o.norm == "layernorm":
            out["decoder_norm/bias"] = ((E,), ("norm",))
        if o.positions == "learned":
            out["position_embedder/embedding"] = ((o.sequence_length, E), (None, "embed"))
        if not o.tied_embeddings:
            out["logits_dense/kernel"] = ((E, V), ("embed", "vocab"))
        a = o.param_scan_axis
        for path, (shape, names) in layer.items():
            axis = min(a, len(shape))
            out[f"layers/{path}"] = ((*shape[:axis], L, *shape[axis:]),
                                     (*names[:axis], "layers", *names[axis:]))
        return out

    def param_shardings(self) -> dict[str, NamedSharding]:
        return {k: NamedSharding(self.mesh, self.spec(names))
                for k, (_, names) in self.param_defs().items()}

    def abstract_params(self) -> dict[str, jax.ShapeDtypeStruct]:
        shard = self.param_shardings()
        return {k: jax.ShapeDtypeStruct(shape, self.wdtype, sharding=shard[k])
                for k, (shape, _) in self.param_defs().items()}

    # -- layers --------------------------------------------------------------------------
    def _w(self, w):
        return jnp.asarray(w, self.dtype)

    def _norm(self, x, p, prefix):
        """RMSNorm / LayerNorm in float32, scale cast to the activation dtype."""
        xf = x.astype(jnp.float32)
        if self.o.norm == "layernorm":
            mean = jnp.mean(xf, axis=-1, keepdims=True)
            xf = xf - mean
        y = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + 1e-6)
        y = y.astype(self.dtype) * self._w(p[f"{prefix}/scale"])
        if self.o.norm == "layernorm":
            y = y + self._w(p[f"{prefix}/bias"])
        return y

    def _rope(self, x, positions):
        """LLaMA rotary embedding on (B, T, N, D)."""
        d = x.shape[-1]
        fraction = 2 * jnp.arange(0, d // 2) / d
        timescale = 10_000.0 ** fraction
        sinusoid = positions[:, :, None, None].astype(jnp.float32) / timescale
        sin, cos = jnp.sin(sinusoid).astype(self.dtype), jnp.cos(sinusoid).astype(self.dtype)
        first, second = jnp.split(x, 2, axis=-1)
        return jnp.concatenate([first * cos - second * sin, second * cos + first * sin],
                               axis=-1)

    def _attention_kernel(self, q, k, v, bias):
        """(B, T, H, D) x (B, T, K, D) -> (B, T, H, D)."""
        if self.o.attention == "flash" and bias is None:
            return self._flash(q, k, v)
        return self._dot_attention(q, k, v, bias)

    def _dot_attention(self, q, k, v, bias):
        """MaxText ``apply_attention_dot`` with grouped heads; the softmax in float32."""
        B, T, H, D = q.shape
        K = k.shape[2]
        q = q.reshape(B, T, K, H // K, D)
        scores = jnp.einsum("btkgd,bskd->bkgts", q, k)
        if bias is not None:
            scores = scores + bias.reshape(1, K, H // K, T, T).astype(scores.dtype)
        causal = jnp.tril(jnp.ones((T, T), dtype=bool))
        scores = jnp.where(causal, scores, jnp.asarray(-0.7 * float(jnp.finfo(self.dtype).max),
                                                       scores.dtype))
        weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(self.dtype)
        out = jnp.einsum("bkgts,bskd->btkgd", weights, v)
        return out.reshape(B, T, H, D)

    def _flash(self, q, k, v):
        """MaxText ``tpu_flash_attention``: the Pallas TPU kernel per shard under
        ``shard_map``, on (B, H, T, D)."""
        from jax.experimental.shard_map import shard_map

        B, T, H, D = q.shape
        blk = min(self.o.flash_block, T)
        qn = self.spec(("activation_batch", "activation_heads", "activation_length",
                        "activation_kv"))
        kvn = qn if self.o.era == "2023" else self.spec(
            ("activation_batch", "activation_kv_heads", "activation_length",
             "activation_kv_head_dim"))
        seg = self.spec(("activation_batch", "activation_length"))
        q, k, v = (jnp.transpose(t, (0, 2, 1, 3)) for t in (q, k, v))
        segment_ids = jnp.ones((B, T), jnp.int32)
        if self.o.era == "2023":
            from jax.experimental.pallas.ops.tpu import flash_attention as fa

            sizes = fa.BlockSizes(block_q=blk, block_k_major=blk, block_k=blk,
                                  block_b=min(2, B), block_q_major_dkv=blk,
                                  block_k_major_dkv=blk, block_k_dkv=blk, block_q_dkv=blk,
                                  block_k_major_dq=blk, block_k_dq=blk, block_q_dq=blk)

            def kernel(q, k, v, s):
                # the kernel is given its batch shard's sequences whole (block_b per shard)
                sizes_here = dataclasses.replace(sizes, block_b=min(sizes.block_b, q.shape[0]))
                # the 2023 kernel takes as many key / value heads as query heads: grouped
                # query attention repeats each of the shard's kv heads over its group
                # (heads split over tensor alike, so a shard's groups are its own)
                if k.shape[1] != q.shape[1]:
                    group = q.shape[1] // k.shape[1]
                    k, v = (jnp.repeat(t, group, axis=1) for t in (k, v))
                return fa.flash_attention(q, k, v, segment_ids=fa.SegmentIds(s, s), causal=True,
                                          sm_scale=1.0, block_sizes=sizes_here)
        else:
            from jax.experimental.pallas.ops.tpu.splash_attention import (
                splash_attention_kernel as sk,
            )
            from jax.experimental.pallas.ops.tpu.splash_attention import (
                splash_attention_mask as sm,
            )

            fused = self.o.flash_fused_bwd
            sizes = sk.BlockSizes(block_q=blk, block_kv=blk, block_kv_compute=blk,
                                  block_q_dkv=blk, block_kv_dkv=blk, block_kv_dkv_compute=blk,
                                  block_q_dq=None if fused else blk,
                                  block_kv_dq=None if fused else blk,
                                  use_fused_bwd_kernel=fused)

            def kernel(q, k, v, s):
                heads = q.shape[1]
                mask = sm.MultiHeadMask([sm.CausalMask((T, T)) for _ in range(heads)])
                splash = sk.make_splash_mha(mask=mask, head_shards=1, q_seq_shards=1,
                                            block_sizes=sizes)
                return jax.vmap(splash)(q, k, v, segment_ids=sk.SegmentIds(s, s))

        wrapped = shard_map(kernel, mesh=self.mesh, in_specs=(qn, kvn, kvn, seg),
                            out_specs=qn, check_rep=False)
        out = wrapped(q, k, v, segment_ids)
        return jnp.transpose(out, (0, 2, 1, 3))

    def _relpos_bias(self, p, T):
        """T5 relative position bias (causal buckets, max distance 128): (H, T, T)."""
        nb = self.o.relative_position_buckets
        rel = jnp.arange(T)[None, :] - jnp.arange(T)[:, None]          # key - query
        n = jnp.maximum(-rel, 0)
        max_exact = nb // 2
        large = max_exact + (jnp.log(jnp.maximum(n, 1).astype(jnp.float32) / max_exact)
                             / math.log(128 / max_exact) * (nb - max_exact)).astype(jnp.int32)
        bucket = jnp.where(n < max_exact, n, jnp.minimum(large, nb - 1))
        table = self._w(p["attention/relpos_bias/rel_embedding"])      # (H, nb)
        return jnp.take(table, bucket, axis=1)                         # (H, T, T)

    def _dense(self, x, w, spec_in: str):
        return jnp.einsum(spec_in, x, self._w(w))

    def _attention(self, x, p, positions):
        o = self.o
        if o.fused_qkv:
            qkv = self._dense(x, p["attention/qkv/kernel"], "bte,ecnd->btcnd")
            qkv = checkpoint_name(qkv, "qkv_proj")
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        else:
            q = self._dense(x, p["attention/query/kernel"], "bte,end->btnd")
            k = self._dense(x, p["attention/key/kernel"], "bte,end->btnd")
            v = self._dense(x, p["attention/value/kernel"], "bte,end->btnd")
        if o.use_bias:
            q = q + self._w(p["attention/query/bias"])
            k = k + self._w(p["attention/key/bias"])
            v = v + self._w(p["attention/value/bias"])
        if o.qk_norm:
            q = self._norm(q, p, "attention/query_norm")
            k = self._norm(k, p, "attention/key_norm")
        if o.positions == "rotary":
            q = self._rope(q, positions)
            k = self._rope(k, positions)
        q = q / jnp.sqrt(jnp.asarray(o.head_dim, q.dtype))  # MaxText folds this into init
        q = self.constrain(q, self._act("query"))
        k = self.constrain(k, self._act("kv"))
        v = self.constrain(v, self._act("kv"))
        if not o.fused_qkv:
            q = checkpoint_name(q, "query_proj")
            k = checkpoint_name(k, "key_proj")
            v = checkpoint_name(v, "value_proj")
        bias = self._relpos_bias(p, x.shape[1]) if o.relative_position_buckets else None
        ctx = self._attention_kernel(q, k, v, bias)
        ctx = checkpoint_name(self.constrain(ctx, self._act("query")), "context")
        out = self._dense(ctx, p["attention/out/kernel"], "btnd,nde->bte")
        if o.use_bias:
            out = out + self._w(p["attention/out/bias"])
        return checkpoint_name(out, "out_proj")

    def _mlp(self, x, p):
        o = self.o
        act = _ACTIVATIONS[o.mlp_activation]
        if o.gated:
            h0 = checkpoint_name(self._dense(x, p["mlp/wi_0/kernel"], "bte,ef->btf"), "mlpwi_0")
            h1 = checkpoint_name(self._dense(x, p["mlp/wi_1/kernel"], "bte,ef->btf"), "mlpwi_1")
            if o.use_bias:
                h0, h1 = h0 + self._w(p["mlp/wi_0/bias"]), h1 + self._w(p["mlp/wi_1/bias"])
            h = act(h0) * h1
        else:
            h = checkpoint_name(self._dense(x, p["mlp/wi/kernel"], "bte,ef->btf"), "mlpwi")
            if o.use_bias:
                h = h + self._w(p["mlp/wi/bias"])
            h = act(h)
        h = self.constrain(h, self._act("mlp"))
        out = self._dense(h, p["mlp/wo/kernel"], "btf,fe->bte")
        if o.use_bias:
            out = out + self._w(p["mlp/wo/bias"])
        return checkpoint_name(out, "mlpwo")

    def _moe(self, x, p):
        """MaxText ``moe.py`` with ``megablox: false``; returns (out, load balance loss)."""
        o = self.o
        X, k = o.experts, o.experts_per_token
        B, S, M = x.shape
        logits = jnp.einsum("bsm,mx->bsx", x, self._w(p["mlp/gate/kernel"]))
        top_w, top_i = jax.lax.top_k(logits, k)
        weights = jax.nn.softmax(top_w.astype(jnp.float32), axis=-1).astype(self.dtype)
        act = _ACTIVATIONS[o.mlp_activation]
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        # load balance loss (Switch): X * sum_x fraction routed to x * mean prob of x
        routed = jnp.sum(jax.nn.one_hot(top_i, X, dtype=jnp.float32), axis=2)  # (B, S, X)
        lb = X * jnp.mean(jnp.mean(routed, axis=(0, 1)) / k * jnp.mean(probs, axis=(0, 1)))
        w_in = [self._w(p[f"mlp/{w}"]) for w in (("wi_0", "wi_1") if o.gated else ("wi",))]
        w_out = self._w(p["mlp/wo"])
        if o.capacity_factor > 0:
            cap = max(1, int(S * k / X * o.capacity_factor))
            mask = jax.nn.one_hot(top_i, X, dtype=jnp.int32)             # (B, S, k, X)
            fused = mask.reshape(B, S * k, X)
            priority = (jnp.cumsum(fused, axis=1) * fused).reshape(B, S, k, X) - 1
            keep = (priority < cap) & (mask > 0)
            slot = jax.nn.one_hot(jnp.where(keep, priority, -1), cap, dtype=self.dtype)
            dispatch = checkpoint_name(jnp.sum(slot, axis=2), "dispatch")  # (B, S, X, C)
            combine = checkpoint_name(
                jnp.sum(slot * weights[..., None, None], axis=2), "combine")
            xe = jnp.einsum("bsm,bsxc->xbcm", x, dispatch)
            xe = self.constrain(xe, ("activation_exp", "activation_batch_no_exp", None,
                                     "activation_embed"))
            hs = [jnp.einsum("xbcm,xmf->xbcf", xe, w) for w in w_in]
            names = ("mlpwi_0", "mlpwi_1") if o.gated else ("mlpwi",)
            hs = [checkpoint_name(h, n) for h, n in zip(hs, names, strict=True)]
            h = act(hs[0]) * hs[1] if o.gated else act(hs[0])
            y = checkpoint_name(jnp.einsum("xbcf,xfm->xbcm", h, w_out), "mlpwo")
            out = jnp.einsum("xbcm,bsxc->bsm", y, combine)
        else:
            full = jnp.sum(jax.nn.one_hot(top_i, X, dtype=self.dtype) * weights[..., None],
                           axis=2)                                      # (B, S, X)
            # MaxText's dense_matmul without capacity constrains the products to the
            # tokens' sharding, every expert on each device's tokens (the expert weights
            # gathered over expert): the batch over activation_batch (expert included),
            # the experts whole. Unconstrained, XLA split the experts over expert as well
            # and needed 475 GiB of temporaries for Mixtral on {fsdp: 8, expert: 8}.
            tokens = ("activation_batch", "activation_length", None)
            hs = [self.constrain(jnp.einsum("bsm,xmf->bsxf", x, w), (*tokens, "activation_mlp"))
                  for w in w_in]
            names = ("mlpwi_0", "mlpwi_1") if o.gated else ("mlpwi",)
            hs = [checkpoint_name(h, n) for h, n in zip(hs, names, strict=True)]
            h = act(hs[0]) * hs[1] if o.gated else act(hs[0])
            y = self.constrain(jnp.einsum("bsxf,xfm->bsxm", h, w_out), (*tokens,
                                                                        "activation_embed"))
            y = checkpoint_name(y, "mlpwo")
            out = jnp.einsum("bsxm,bsx->bsm", y, full)
        return out, lb

    def layer(self, x, p, positions):
        """One decoder layer (MaxText's decoder layer for the block kind): (B, T, E)."""
        o = self.o
        x = self.constrain(x, self._act("residual"))
        x = checkpoint_name(x, "decoder_layer_input")
        h = self._norm(x, p, "pre_self_attention_norm")
        h = self.constrain(h, self._act("residual"))
        attn = self.constrain(self._attention(h, p, positions), self._act("residual"))
        lb = jnp.zeros((), jnp.float32)
        if o.block == "parallel":
            mlp_in = h
        else:
            x = x + attn
            mlp_in = self.constrain(self._norm(x, p, "post_self_attention_norm"),
                                    self._act("residual"))
        if o.experts:
            mlp, lb = self._moe(mlp_in, p)
        else:
            mlp = self._mlp(mlp_in, p)
        mlp = self.constrain(mlp, self._act("residual"))
        y = x + attn + mlp if o.block == "parallel" else x + mlp
        return self.constrain(y, self._act("residual")), lb

    # -- the model -----------------------------------------------------------------------
    def logits(self, params, tokens, positions):
        """(B, T) int32 tokens -> ((B, T, V) logits, the MoE load balance loss)."""
        o = self.o
        table = self._w(params["token_embedder/embedding"])
        y = table[tokens]
        if o.positions == "learned":
            y = y + self._w(params["position_embedder/embedding"])[None, :tokens.shape[1]]
        y = self.constrain(y.astype(self.dtype), self._act("embed_out"))
        layer_params = {k[len("layers/"):]: v for k, v in params.items()
                        if k.startswith("layers/")}
        a = o.param_scan_axis
        # flax's scan moves the stacked axis to the front (axes_scan.transpose_to_front)
        stacked = {k: (jnp.moveaxis(v, min(a, v.ndim - 1), 0) if a else v)
                   for k, v in layer_params.items()}

        def body(carry, p):
            y, lb = carry
            y, lb_layer = self.layer(y, p, positions)
            return (y, lb + lb_layer), None

        policy = remat_policy(o.remat, dict(o.remat_custom))
        if policy is not False:
            body = jax.checkpoint(body, policy=policy, prevent_cse=False)
        (y, lb), _ = jax.lax.scan(body, (y, jnp.zeros((), jnp.float32)), stacked)
        y = self._norm(y, params, "decoder_norm")
        if o.tied_embeddings:
            logits = jnp.einsum("bte,ve->btv", y, table)
            if o.era != "2023":
                logits = logits / jnp.sqrt(jnp.asarray(o.embed_dim, logits.dtype))
        else:
            logits = self._dense(y, params["logits_dense/kernel"], "bte,ev->btv")
        logits = self.constrain(logits, self._act("logits"))
        if o.era != "2023":  # cast_logits_to_fp32 (tpu-recipes-v0.1.4 default)
            logits = logits.astype(jnp.float32)
        return logits, lb / o.layers


@jax.custom_vjp
def cross_entropy_with_logits(logits, targets):
    """MaxText's (t5x's) ``cross_entropy_with_logits`` with z_loss 0: (B, T, V) -> (B, T)."""
    shifted = logits - jax.lax.stop_gradient(logits.max(axis=-1, keepdims=True))
    log_softmax = shifted - jnp.log(jnp.sum(jnp.exp(shifted), axis=-1, keepdims=True))
    return -jnp.sum(targets * log_softmax, axis=-1)


def _xent_fwd(logits, targets):
    max_logit = logits.max(axis=-1, keepdims=True)
    shifted = logits - max_logit
    exp_shifted = jnp.exp(shifted)
    sum_exp = jnp.sum(exp_shifted, axis=-1, keepdims=True)
    log_softmax = shifted - jnp.log(sum_exp)
    loss = -jnp.sum(targets * log_softmax, axis=-1)
    return loss, (targets, exp_shifted, sum_exp, log_softmax)


def _xent_bwd(res, g):
    targets, exp_shifted, sum_exp, log_softmax = res
    dtype = exp_shifted.dtype  # the logits' dtype
    deriv = exp_shifted / sum_exp - targets
    g_logits = jnp.expand_dims(g, axis=-1) * deriv
    g_targets = -jnp.expand_dims(g, axis=-1) * log_softmax
    return jnp.asarray(g_logits, dtype), jnp.asarray(g_targets, targets.dtype)


cross_entropy_with_logits.defvjp(_xent_fwd, _xent_bwd)


def loss_fn(model: OracleModel, params, batch, moe_weight: float = 0.01):
    """MaxText ``train.py`` ``loss_fn``: mean cross entropy over the non-padding targets
    (+ the load balance loss of an MoE)."""
    logits, lb = model.logits(params, batch["inputs"], batch["inputs_position"])
    one_hot = jax.nn.one_hot(batch["targets"], model.o.vocabulary)  # float32, as MaxText
    xent = cross_entropy_with_logits(logits, one_hot)
    xent = model.constrain(xent, model._act("xent"))
    weights = (batch["targets_segmentation"] != 0)
    xent = xent * weights
    loss = jnp.sum(xent) / (jnp.sum(weights) + 1e-8)
    if model.o.experts:
        loss = loss + moe_weight * lb
    return loss


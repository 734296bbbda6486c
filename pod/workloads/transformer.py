"""A decoder-only transformer language model, configured like MaxText.

Per token ids (B, T) -> logits (B, T, V):

    h = embed(ids) [+ learned positions]                       # (B, T, C)
    per block (pod.workloads.block), sequential:
                h = h + attention(norm(h))                     # causal, RoPE or not
                h = h + mlp(norm(h))                           # gated or not; or an MoE
              or parallel:
                h = h + attention(norm(h)) + mlp(norm(h))      # one norm
    logits = norm(h) @ E^T (tied) or @ W_out                   # (B, T, V)

with the options of MaxText's base config (``emb_dim``, ``num_query_heads``,
``num_kv_heads``, ``head_dim``, ``mlp_dim``, ``mlp_activations``,
``num_decoder_layers``, ``logits_via_embedding``, ``decoder_block``,
``fused_qkv``, ``remat_policy``) under the names of ``build_transformer``
(``TRANSFORMER_OPTIONS``). The loss is the per-step softmax cross-entropy of
the other sequence models. Every matmul runs on the MXU (``core.matmul`` /
``core.batch_matmul``), every elementwise step on the VPU (``core.vector``),
so the simulated time of a step is the model's. The block, its layouts and
its rematerialisation policies are ``pod.workloads.block``'s; the
attention ``pod.workloads.attention``'s; the MLP ``pod.workloads.mlp``'s.

The TFLOP/s per device MaxText prints (``maxtext_tflops_2023``,
``maxtext_tflops_2025``) are here too, beside the model's own FLOP counts.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from chip import to_bf16
from pod.workloads.attention import ATTENTION_KERNELS, RELPOS_BUCKETS
from pod.workloads.block import BLOCKS, REMAT_POLICIES, STATS_BYTES, TensorHooks, TransformerBlock
from pod.workloads.checks import DataMismatchError, check_int, check_number, check_token_ids
from pod.workloads.flash import FLASH_BLOCK_SIZE, BackwardBlocks
from pod.workloads.layers import Layer, glorot_uniform, mxu_input, vector_op
from pod.workloads.mlp import MLP, MLP_ACTIVATIONS, add
from pod.workloads.model import ActivationMemory, Model, activation_bytes_per_element
from pod.workloads.norms import NORMS, LayerNorm, RMSNorm, norm_class
from pod.workloads.quantization import QUANTIZATIONS
from pod.workloads.remat import (
    LAYER_INPUT_OFFLOADED,
    LAYER_INPUT_OFFLOADED_VARIANT,
    check_remat_custom,
)
from pod.workloads.weights import WEIGHT_DTYPES, computed, weight_dtype

__all__ = [
    "check_expert_split",
    "check_tensor_split",
    "BLOCKS",
    "MLP",
    "MLP_ACTIVATIONS",
    "NORMS",
    "POSITIONS",
    "QUANTIZATIONS",
    "REMAT_POLICIES",
    "TRANSFORMER_OPTIONS",
    "LayerNorm",
    "TensorHooks",
    "RMSNorm",
    "TokenEmbedding",
    "TransformerBlock",
    "TransformerConfig",
    "TransformerModel",
    "shared_transformer",
    "Unembed",
    "build_transformer",
    "maxtext_tflops_2023",
    "maxtext_tflops_2025",
    "moe_aux_loss",
    "router_loads",
]

#: positions: RoPE in the attention, learned vectors added to the token embeddings, or
#: the T5 relative position bias in every layer's attention (MaxText's April 2023 decoder)
POSITIONS = ("rotary", "learned", "relative")

EMBEDDING_INIT_STDDEV = 0.02  # GPT-2 / nanoGPT embedding init (normal, std 0.02)


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
        self.max_steps = (None if max_steps is None
                          else check_int(max_steps, "TokenEmbedding max_steps"))

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
        return ({"embedding": (self.vocabulary, c)} if self.tied
                else {"kernel": (c, self.vocabulary)})

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


#: The splash backward kernels' block options (MaxText's names; ``TransformerConfig``).
SPLASH_BACKWARD_BLOCKS = ("sa_block_q_dkv", "sa_block_kv_dkv", "sa_block_q_dq", "sa_block_kv_dq")

#: The ``model.options`` of the transformer (``build_transformer``).
TRANSFORMER_OPTIONS = ("embed_dim", "heads", "kv_heads", "head_dim", "mlp_dim", "mlp_activation",
                       "layers", "norm", "positions", "tied_embeddings", "block", "use_bias",
                       "fused_qkv", "attention", "fusion", "remat", "remat_custom", "experts",
                       "experts_per_token", "capacity_factor", "moe_aux_loss_weight",
                       "sparse_matmul", "weight_dtype", "quantization", "use_qk_norm",
                       "sa_block_q", "sa_block_kv", *SPLASH_BACKWARD_BLOCKS,
                       "sa_use_fused_bwd_kernel", "num_vocab_tiling")


def _choice(field: str, value, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"transformer: option {field} must be one of {', '.join(choices)}, "
                         f"got {value!r}")
    return value


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


#: Upper bounds of the transformer's sizes, checked before anything is built per layer,
#: head or expert (a ``layers: 1000000000`` scenario built a block per layer for minutes
#: before any size check); each is far above any published model (MaxText's largest
#: configs: 126 layers, 256 experts, 256k vocabularies, 128k-token contexts).
MAX_TRANSFORMER_OPTION = {"vocabulary": 1 << 24, "sequence_length": 1 << 20,
                          "embed_dim": 1 << 20, "heads": 1 << 14, "head_dim": 1 << 14,
                          "kv_heads": 1 << 14, "mlp_dim": 1 << 22, "layers": 1 << 12,
                          "experts": 1 << 14}


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """The shape of a decoder-only transformer; validated on construction.

    Attributes:
        vocabulary: V, tokens (the dataset's num_classes).
        sequence_length: T, tokens per example (from the data).
        embed_dim: C, the residual stream width (MaxText ``emb_dim``).
        heads: H, query heads (``num_query_heads``).
        kv_heads: K, key / value heads (``num_kv_heads``; grouped-query
            attention), dividing H; None: H (multi-head attention).
        head_dim: Dh (``head_dim``); None: embed_dim // heads.
        mlp_dim: F, the MLP hidden width (``mlp_dim``); None: 4 * embed_dim.
        mlp_activation: one of ``MLP_ACTIVATIONS`` ("gated_silu" SwiGLU,
            "gated_gelu", "gelu", "relu").
        layers: L, transformer blocks (``num_decoder_layers``).
        norm: "rmsnorm" or "layernorm" (pre-norm in every block, and final).
        positions: "rotary" (RoPE in attention), "learned" (added to the
            token embeddings) or "relative" (the T5 relative position bias, a
            (H, 32) table per layer added to the attention scores; MaxText's
            decoder of April 2023, training-steps.md T9; needs ``attention:
            dot_product``).
        tied_embeddings: logits through the token embedding table
            (``logits_via_embedding``) instead of a separate (C, V) kernel.
        block: "sequential" or "parallel" (``pod.workloads.block``).
        use_bias: biases on every projection (GPT-3; MaxText's models have none).
        fused_qkv: one (C, (H+2K)*Dh) projection for q, k and v (``fused_qkv``).
        attention: the attention kernel, "flash" (default; the blocked kernel
            of ``pod.workloads.flash``, MaxText ``attention: flash``) or
            "dot_product" (the T x T scores as tensors).
        fusion: elementwise work fused into the matmuls as XLA does (default;
            ``pod.workloads.fusion`` has the rule), or every elementwise op
            costed with its own HBM round trip (false).
        remat: one of ``REMAT_POLICIES`` (MaxText's names; ``pod.workloads.remat``).
        remat_custom: with ``remat: custom``, MaxText's per-tensor choices: a
            mapping of tensor name (``REMAT_TENSORS``: decoder_layer_input,
            query_proj, ...) to remat | device | offload; kept as sorted
            (name, choice) pairs.
        experts: E, experts of a mixture-of-experts MLP in every block
            (``pod.workloads.moe``; MaxText ``num_experts``); 0: the dense MLP.
        experts_per_token: k, experts per token (``num_experts_per_tok``; MaxText's
            default 1, Mixtral's 2).
        capacity_factor: cf >= 0, token choices an expert takes per sequence as a
            multiple of the even share (Switch; ``capacity_factor``); 0: dropless
            (MaxText's -1).
        moe_aux_loss_weight: w >= 0, the load-balancing loss's weight
            (``load_balance_loss_weight``, 0.01).
        sparse_matmul: with experts, MaxText's ``sparse_matmul``: true (default) the
            tokens sorted by expert and the experts run as a grouped matmul
            (megablox); false the dense einsum dispatch of ``pod.workloads.moe``:
            (tokens, experts, capacity) one-hot masks multiplied on the MXU, or with
            capacity_factor 0 dense dropless (MaxText's ``dense_matmul`` without a
            capacity: every expert computes every token).
        weight_dtype: "float32" (master weights, MaxText's default) or "bfloat16":
            the dtype parameters, their gradients and the optimizer state are
            stored in (``pod.workloads.weights``).
        quantization: "" or "int8": MaxText's ``quantization``, AQT int8 training of
            the projections (``pod.workloads.quantization``).
        use_qk_norm: an RMSNorm over each head's query and key before their product
            (MaxText ``use_qk_norm``; every layer of MaxText 2023's decoder).
        sa_block_q, sa_block_kv: the flash kernel's query and key / value blocks
            (MaxText's splash attention ``sa_block_q``, ``sa_block_kv``; 512 each,
            ``pod.workloads.flash.FLASH_BLOCK_SIZE``): larger blocks skip less of
            the causal triangle.
        sa_block_q_dkv, sa_block_kv_dkv, sa_block_q_dq, sa_block_kv_dq: the blocks of
            the flash backward's ``dkv`` and ``dq`` kernels (MaxText's names; None: the
            forward's ``sa_block_q`` / ``sa_block_kv``).
        sa_use_fused_bwd_kernel: splash's fused backward kernel (MaxText's
            ``sa_use_fused_bwd_kernel``): one kernel of 5 block products on the dkv
            blocks instead of ``dkv`` and ``dq`` with 7 (``pod.workloads.flash``).
        num_vocab_tiling: the loss is computed over this many chunks of the tokens,
            each chunk's logits made and dropped in turn (MaxText's
            ``num_vocab_tiling``); 1: all the logits at once.

    Raises:
        ValueError: one line naming the option: "transformer: option heads
            must be a positive integer, got 0".
    """

    vocabulary: int
    sequence_length: int
    embed_dim: int = 64
    heads: int = 4
    # head_dim, mlp_dim and kv_heads: None derives them (__post_init__), so once built
    # they are ints; the type checker sees them as ints and the constructor's
    # signature below (at run time: the dataclass's own __init__, default None)
    if TYPE_CHECKING:
        head_dim: int = dataclasses.field(init=False)
        mlp_dim: int = dataclasses.field(init=False)
    else:
        head_dim: int | None = None
        mlp_dim: int | None = None
    mlp_activation: str = "gated_silu"
    layers: int = 2
    norm: str = "rmsnorm"
    positions: str = "rotary"
    tied_embeddings: bool = True
    remat: str = "none"
    if TYPE_CHECKING:
        kv_heads: int = dataclasses.field(init=False)
    else:
        kv_heads: int | None = None
    block: str = "sequential"
    use_bias: bool = False
    fused_qkv: bool = False
    attention: str = "flash"
    fusion: bool = True
    remat_custom: tuple[tuple[str, str], ...] | None = None
    experts: int = 0
    experts_per_token: int = 1
    capacity_factor: float = 0.0
    moe_aux_loss_weight: float = 0.01
    sparse_matmul: bool = True
    weight_dtype: str = "float32"
    quantization: str = ""
    use_qk_norm: bool = False
    sa_block_q: int = FLASH_BLOCK_SIZE
    sa_block_kv: int = FLASH_BLOCK_SIZE
    sa_block_q_dkv: int | None = None
    sa_block_kv_dkv: int | None = None
    sa_block_q_dq: int | None = None
    sa_block_kv_dq: int | None = None
    sa_use_fused_bwd_kernel: bool = False
    num_vocab_tiling: int = 1

    if TYPE_CHECKING:
        def __init__(self, vocabulary: int, sequence_length: int, embed_dim: int = ...,
                     heads: int = ..., head_dim: int | None = ..., mlp_dim: int | None = ...,
                     mlp_activation: str = ..., layers: int = ..., norm: str = ...,
                     positions: str = ..., tied_embeddings: bool = ..., remat: str = ...,
                     kv_heads: int | None = ..., block: str = ..., use_bias: bool = ...,
                     fused_qkv: bool = ..., attention: str = ..., fusion: bool = ...,
                     remat_custom: tuple[tuple[str, str], ...] | None = ..., experts: int = ...,
                     experts_per_token: int = ..., capacity_factor: float = ...,
                     moe_aux_loss_weight: float = ..., sparse_matmul: bool = ...,
                     weight_dtype: str = ..., quantization: str = ...,
                     use_qk_norm: bool = ..., sa_block_q: int = ...,
                     sa_block_kv: int = ..., sa_block_q_dkv: int | None = ...,
                     sa_block_kv_dkv: int | None = ..., sa_block_q_dq: int | None = ...,
                     sa_block_kv_dq: int | None = ..., sa_use_fused_bwd_kernel: bool = ...,
                     num_vocab_tiling: int = ...) -> None: ...

    def __post_init__(self):
        for field in ("vocabulary", "sequence_length", "embed_dim", "heads", "layers",
                      "sa_block_q", "sa_block_kv"):
            check_int(getattr(self, field), f"transformer: option {field}",
                      maximum=MAX_TRANSFORMER_OPTION.get(field))
        for field in SPLASH_BACKWARD_BLOCKS:
            if getattr(self, field) is not None:
                check_int(getattr(self, field), f"transformer: option {field}")
        if self.head_dim is None:
            if self.embed_dim % self.heads:
                raise ValueError(f"transformer: option head_dim is needed: embed_dim "
                                 f"{self.embed_dim} is not a multiple of heads {self.heads}")
            object.__setattr__(self, "head_dim", self.embed_dim // self.heads)
        check_int(self.head_dim, "transformer: option head_dim",
                  maximum=MAX_TRANSFORMER_OPTION["head_dim"])
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        check_int(self.kv_heads, "transformer: option kv_heads",
                  maximum=MAX_TRANSFORMER_OPTION["kv_heads"])
        if self.heads % self.kv_heads:
            raise ValueError(f"transformer: option kv_heads must divide heads {self.heads} "
                             f"({_divisors(self.heads)}), got {self.kv_heads}")
        if self.mlp_dim is None:
            object.__setattr__(self, "mlp_dim", 4 * self.embed_dim)
        check_int(self.mlp_dim, "transformer: option mlp_dim",
                  maximum=MAX_TRANSFORMER_OPTION["mlp_dim"])
        _choice("mlp_activation", self.mlp_activation, MLP_ACTIVATIONS)
        _choice("norm", self.norm, NORMS)
        _choice("positions", self.positions, POSITIONS)
        _choice("block", self.block, BLOCKS)
        _choice("attention", self.attention, ATTENTION_KERNELS)
        _choice("remat", self.remat, REMAT_POLICIES)
        _choice("weight_dtype", self.weight_dtype, tuple(WEIGHT_DTYPES))
        if self.quantization is None:  # YAML's empty value: MaxText's default ""
            object.__setattr__(self, "quantization", "")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"transformer: option quantization must be \"\" (bf16 matmuls) or "
                             f"int8 (AQT), got {self.quantization!r}")
        if self.remat_custom is not None:
            given = self.remat_custom
            custom = check_remat_custom(dict(given) if isinstance(given, tuple) else given)
            if self.remat != "custom":
                raise ValueError(f"transformer: option remat_custom needs remat: custom, got "
                                 f"remat: {self.remat}")
            object.__setattr__(self, "remat_custom", custom)
        check_int(self.num_vocab_tiling, "transformer: option num_vocab_tiling")
        for field in ("tied_embeddings", "use_bias", "fused_qkv", "fusion", "sparse_matmul",
                      "use_qk_norm", "sa_use_fused_bwd_kernel"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"transformer: option {field} must be true or false, "
                                 f"got {getattr(self, field)!r}")
        if self.positions == "relative" and self.attention != "dot_product":
            raise ValueError(f"transformer: option positions relative needs attention: "
                             f"dot_product (the flash kernel takes no bias here), got "
                             f"attention: {self.attention}")
        if self.positions == "rotary" and self.head_dim % 2:
            raise ValueError(f"transformer: option head_dim must be even for rotary positions, "
                             f"got {self.head_dim}")
        self._check_experts()

    @property
    def backward_blocks(self) -> BackwardBlocks:
        """The flash backward's kernels and blocks (``pod.workloads.flash.BackwardBlocks``)
        from the ``sa_block_*_dkv``, ``sa_block_*_dq`` and ``sa_use_fused_bwd_kernel``
        options, each block None falling back to the forward's."""
        def blocks(q: int | None, kv: int | None) -> tuple[int, int]:
            return (self.sa_block_q if q is None else q, self.sa_block_kv if kv is None else kv)
        return BackwardBlocks(blocks(self.sa_block_q_dkv, self.sa_block_kv_dkv),
                              blocks(self.sa_block_q_dq, self.sa_block_kv_dq),
                              self.sa_use_fused_bwd_kernel)

    def _check_experts(self) -> None:
        """The mixture-of-experts options (one line each, naming the option)."""
        e, k, cf, w = (self.experts, self.experts_per_token, self.capacity_factor,
                       self.moe_aux_loss_weight)
        if isinstance(e, bool) or not isinstance(e, int) or e < 0 or e == 1:
            raise ValueError(f"transformer: option experts must be 0 (a dense MLP) or an integer "
                             f">= 2, got {e!r}")
        check_int(e, "transformer: option experts", 0, MAX_TRANSFORMER_OPTION["experts"])
        check_int(k, "transformer: option experts_per_token")
        for field, value in (("capacity_factor", cf), ("moe_aux_loss_weight", w)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"transformer: option {field} must be a number >= 0 (capacity "
                                 f"0: dropless), got {value!r}")
        if not e:
            return
        if k > e:
            raise ValueError(f"transformer: option experts_per_token must be 1 .. experts {e}, "
                             f"got {k}")
        if self.use_bias:
            raise ValueError("transformer: option use_bias must be false with experts (the "
                             "experts have no biases)")
        t = self.sequence_length
        if cf and t * k * cf < e:
            raise ValueError(f"transformer: option capacity_factor {cf} leaves an expert no "
                             f"token of a sequence (floor(T k cf / E) = floor({t} x {k} x {cf} / "
                             f"{e}) = 0); use at least {e / (t * k):.3g}, or 0 for dropless")

    @property
    def inner_dim(self) -> int:
        """H * Dh, the width of the queries and of the attention context."""
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """K * Dh, the width of the keys and of the values."""
        return self.kv_heads * self.head_dim

    @property
    def weight_bytes(self) -> int:
        """Bytes of one stored parameter, of its gradient and of one optimizer slot
        element: 4 (float32 masters) or 2 (``weight_dtype: bfloat16``)."""
        return weight_dtype(self.weight_dtype).itemsize

    @property
    def mlp_inputs(self) -> int:
        """Input projections of the MLP: 2 when gated, else 1."""
        return 2 if self.mlp_activation.startswith("gated_") else 1

    def tensor_local(self, tensor: int) -> TransformerConfig:
        """The config of one of ``tensor`` devices: H / tensor query heads, K /
        tensor kv heads, F / tensor hidden units (``pod.programs.transformer``;
        ``check_tensor_split`` checks that they divide)."""
        return dataclasses.replace(self, heads=self.heads // tensor,
                                   kv_heads=self.kv_heads // tensor, mlp_dim=self.mlp_dim // tensor)

    def block_matmul_params(self, *, active: bool = False) -> int:
        """Weights of one block's projections: C (H + 2K) Dh for q, k, v,
        H Dh C for the output, (1 + MLP inputs) C F for the MLP; with experts the
        router C E and E such MLPs (``active``: the k experts a token uses)."""
        c, f = self.embed_dim, self.mlp_dim
        mlp = (self.mlp_inputs + 1) * c * f
        if self.experts:
            mlp = c * self.experts + (self.experts_per_token if active else self.experts) * mlp
        return c * (self.inner_dim + 2 * self.kv_dim) + self.inner_dim * c + mlp

    def param_count(self, *, active: bool = False) -> int:
        """Parameters in closed form: per block the norms (C each, 2C for
        layernorm; two norms in a sequential block, one in a parallel one; with
        ``use_qk_norm`` two Dh scales; with relative positions the (H, 32) bias
        table), the projections (``block_matmul_params``) and with ``use_bias`` their
        biases ((H + 2K) Dh + C + MLP inputs x F + C); the final norm; the
        table V C; learned positions T C; an untied output kernel C V. ``active``:
        with experts, only the k experts a token uses (Mixtral 8x7B: 46.7B total,
        12.9B active [Mixtral] Jiang et al. 2024, sec. 2)."""
        c, f, v = self.embed_dim, self.mlp_dim, self.vocabulary
        norm = c * (2 if self.norm == "layernorm" else 1)
        norms = ((1 if self.block == "parallel" else 2) * norm
                 + (2 * self.head_dim if self.use_qk_norm else 0)          # qk norms (Dh,) each
                 + (self.heads * RELPOS_BUCKETS if self.positions == "relative" else 0))
        bias = ((self.inner_dim + 2 * self.kv_dim + c + self.mlp_inputs * f + c) if self.use_bias
                else 0)
        block = norms + self.block_matmul_params(active=active) + bias
        return (self.layers * block + norm + v * c
                + (self.sequence_length * c if self.positions == "learned" else 0)
                + (0 if self.tied_embeddings else c * v))

    def matmul_param_count(self) -> int:
        """N of the 6 N T formula: the weights that take part in a matmul per
        token (PaLM, Chowdhery et al. 2022, app. B; MaxText
        ``calculate_tflops_training_per_device``): the projections and the
        output layer (V C, tied or not); not the norms, not biases, not the
        embedding lookup (a gather) and not learned positions. With experts the
        active weights: the router and k experts' MLPs per token."""
        return (self.layers * self.block_matmul_params(active=True)
                + self.embed_dim * self.vocabulary)


class TransformerModel(Model):
    """The transformer language model: ``Model`` with a tied embedding table
    and the model / hardware FLOPs of MFU accounting.

    Layers: ``embed`` (TokenEmbedding), ``block1`` .. ``blockL``
    (TransformerBlock), ``final_norm``, ``unembed``. With tied embeddings the
    one parameter ``embed/embedding`` serves the lookup and the logits; its
    gradient is the sum of both uses.

    Args:
        config: the TransformerConfig.
        expert_shards: with experts, the devices they are split over: each block's
            MoE holds E / expert_shards experts (a device program's local model;
            ``pod.programs.transformer``).
    """

    def __init__(self, config: TransformerConfig, *, expert_shards: int = 1):
        self.config = config
        cfg = config
        moe = None if not cfg.experts else {
            "experts": cfg.experts, "experts_per_token": cfg.experts_per_token,
            "capacity_factor": cfg.capacity_factor, "aux_loss_weight": cfg.moe_aux_loss_weight,
            "expert_shards": int(expert_shards), "sparse_matmul": cfg.sparse_matmul}
        layers: list[Layer] = [TokenEmbedding(
            cfg.vocabulary, cfg.embed_dim,
            cfg.sequence_length if cfg.positions == "learned" else None, name="embed")]
        layers += [TransformerBlock(cfg.heads, cfg.head_dim, cfg.mlp_dim, kv_heads=cfg.kv_heads,
                                    mlp_activation=cfg.mlp_activation, norm=cfg.norm,
                                    rotary=cfg.positions == "rotary", remat=cfg.remat,
                                    remat_custom=cfg.remat_custom,
                                    block=cfg.block, use_bias=cfg.use_bias,
                                    fused_qkv=cfg.fused_qkv, attention=cfg.attention,
                                    fusion=cfg.fusion, moe=moe, qk_norm=cfg.use_qk_norm,
                                    relative_bias=cfg.positions == "relative",
                                    quantized=cfg.quantization == "int8",
                                    flash_blocks=(cfg.sa_block_q, cfg.sa_block_kv),
                                    backward_blocks=cfg.backward_blocks,
                                    name=f"block{i}")
                   for i in range(1, cfg.layers + 1)]
        layers += [norm_class(cfg.norm)(name="final_norm", fusion=cfg.fusion),
                   Unembed(cfg.vocabulary, tied=cfg.tied_embeddings, name="unembed")]
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
        (``core.execute`` False), which computes no product (as ``Model.prepare_params``);
        bf16-stored parameters (``weight_dtype``) widened to float32 (exact)."""
        self._check_params(params)
        rounding = core.numerics and core.execute
        return [{local: (to_bf16(params[key]) if rounding and local in layer.matmul_params
                         else _widened(core, params[key]))
                 for key, local in keys}
                for layer, keys in zip(self.layers, self._layer_keys, strict=True)]

    @property
    def storage_dtype(self) -> np.dtype:
        """float32, or bf16 under ``weight_dtype: bfloat16`` (``pod.workloads.weights``)."""
        return weight_dtype(self.config.weight_dtype)

    def init_params(self, seed: int) -> dict[str, np.ndarray]:
        """As ``Model.init_params``, stored in ``config.weight_dtype`` (bf16: rounded
        to nearest even, ``ml_dtypes.bfloat16`` arrays; ``pod.workloads.weights``)."""
        params = super().init_params(seed)
        dtype = self.storage_dtype
        if dtype == np.float32:
            return params
        return {k: v.astype(dtype) for k, v in params.items()}

    def gradient_buckets(self) -> tuple[tuple[str, int], ...]:
        """As ``Model.gradient_buckets``; the tied table counts once, in the
        embedding layer's bucket (its gradient is complete only there)."""
        first_use: dict[str, int] = {}
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
        a parameter used by two layers gets the sum of their gradients. With
        experts the loss includes every block's load-balancing loss
        (``moe_aux_loss``; MaxText adds it to the training loss too)."""
        self._check_x(x)
        local = self.prepare_params(core, params)
        out, caches = self.forward(core, local, x, training=True, rng=rng)
        loss, dy = self._loss(core, out, y)
        loss = loss + moe_aux_loss(caches)
        grads: dict[str, np.ndarray] = {}
        for i in range(len(self.layers) - 1, -1, -1):
            layer = self.layers[i]
            dy, g = layer.backward(core, local[i], caches[i], dy, need_dx=i > 0)
            for key, name in self._layer_keys[i]:
                grads[key] = g[name] if key not in grads else add(
                    core, f"{layer.name}/tied_grad_sum", grads[key], g[name])
        grads = {k: grads[k].astype(params[k].dtype, copy=False) for k in params}
        return loss, grads, {}

    # ------------------------------------------------------------ memory

    def _local(self, tensor: int) -> TransformerModel | None:
        """The model one of ``tensor`` devices runs (its heads and MLP units), or
        None when tensor does not split them."""
        cfg = self.config
        if any(n % tensor for n in (cfg.heads, cfg.kv_heads, cfg.mlp_dim)):
            return None
        if tensor == 1:
            return self
        cache = self.__dict__.setdefault("_local_models", {})
        if tensor not in cache:
            cache[tensor] = shared_transformer(cfg.tensor_local(tensor))
        return cache[tensor]

    def activation_bytes(self, batch: int, *, bytes_per_element: int = 4) -> int:
        """HBM bytes ``batch`` examples keep for backward on one device (no tensor
        split), ``bytes_per_element`` per activation element (float32 by
        default): ``activation_memory``'s device bytes."""
        return self._activation_bytes(self, int(batch), bytes_per_element, 1)[0]

    def activation_memory(self, batch: int, *, precision: str = "bf16", tensor: int = 1
                          ) -> ActivationMemory | None:
        """One device's activations for ``batch`` examples on a mesh with this tensor
        size, as XLA lays them out for MaxText (training-steps.md; the logical
        axis rules of MaxText's base.yml: ``activation_embed`` -> tensor).

        Kept (HBM or host, by ``remat``): per block what its policy keeps
        (``TransformerBlock.activation_bytes``): the attention and MLP tensors
        with the device's heads and MLP units, the residual stream's split over
        tensor; the token ids (int32) and the output layer's inputs
        (:meth:`output_kept_bytes`). In the activation dtype of ``precision``
        (bf16: 2 bytes), statistics float32. No T x T tensor with flash
        attention. (The emulator's device program keeps the residual stream
        whole on every tensor device, or with sequence parallelism a sequence
        chunk each, which is the same bytes; the plan is the hardware's.)

        Transient: one block's whole backward working set (its remat ``none``
        set, recomputed: ``TransformerBlock.transient_bytes``). The logits are the
        device program's to count (``pod.programs``: their vocabulary's split and
        when they live depend on the program).

        Returns:
            The bytes, or None when ``tensor`` does not split the heads, kv heads
            and MLP units.
        """
        key = ("activation_memory", int(batch), precision, int(tensor))
        memo = self.__dict__.setdefault("_memo", {})  # a shared model asks it of every point
        if key not in memo:
            local = self._local(int(tensor))
            memo[key] = None if local is None else ActivationMemory(*self._activation_bytes(
                local, int(batch), activation_bytes_per_element(precision), int(tensor)))
        return memo[key]

    def output_kept_bytes(self, bytes_per_element: int, tensor: int = 1) -> int:
        """Bytes per example the output layer keeps for backward: the final norm's input
        and its 1 / sigma, the output layer's input, split over tensor as the residual
        stream."""
        t, c = self.config.sequence_length, self.config.embed_dim
        return 2 * -(-t * c * bytes_per_element // tensor) + -(-t * STATS_BYTES // tensor)

    def _activation_bytes(self, local: TransformerModel, batch: int, bpe: int,
                          shards: int) -> tuple[int, int, int]:
        device = 4 * self.config.sequence_length + self.output_kept_bytes(bpe, shards)
        host, transient = 0, 0
        for layer, shape in zip(local.layers, local._shapes, strict=False):
            if isinstance(layer, TransformerBlock):
                d, h = layer.activation_bytes(shape, bpe, shards)
                device, host = device + d, host + h
                transient = max(transient, layer.transient_bytes(shape, bpe, shards))
        return batch * device, batch * host, batch * transient

    def largest_layer_params(self, tensor: int = 1) -> int:
        """Parameters of the largest layer on one of ``tensor`` devices, what an FSDP
        all-gather brings at once, as MaxText shards them (its logical axis
        rules: heads, MLP units and the vocabulary over tensor): a block's with
        the device's heads and MLP units, the token table's (or the output
        kernel's) V C / tensor. (The emulator's program keeps the tables whole
        on every tensor device; the plan is the hardware's.)"""
        key = ("largest_layer_params", int(tensor))
        memo = self.__dict__.setdefault("_memo", {})
        if key not in memo:
            local = self._local(int(tensor))
            if local is None:
                memo[key] = super().largest_layer_params(tensor)
            else:
                blocks = max(layer.param_count(shape)
                             for layer, shape in zip(local.layers, local._shapes, strict=False)
                             if isinstance(layer, TransformerBlock))
                memo[key] = max(blocks, -(-self.config.vocabulary * self.config.embed_dim
                                          // int(tensor)))
        return memo[key]

    def remat_variants(self) -> dict[str, TransformerModel]:
        """The same model under each other named remat policy, and under ``custom`` with
        the layer input offloaded and every other tensor recomputed (the least HBM a
        layer's activations can take: MaxText's v6e recipes offload the layer input, e.g.
        T5's and T6's), for an HBM plan that looks for one that fits; keyed by what to
        write for the policy."""
        variants = {p: shared_transformer(dataclasses.replace(self.config, remat=p,
                                                              remat_custom=None))
                    for p in REMAT_POLICIES if p not in (self.config.remat, "custom")}
        if self.config.remat_custom != LAYER_INPUT_OFFLOADED:
            variants[LAYER_INPUT_OFFLOADED_VARIANT] = shared_transformer(dataclasses.replace(
                self.config, remat="custom", remat_custom=LAYER_INPUT_OFFLOADED))
        return variants

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
        """MXU FLOPs actually run per training example: forward and backward as
        the kernels run them (flash attention computes only the causal blocks
        and recomputes its scores in backward, ``TransformerBlock.hardware_flops``)
        plus the forward work ``remat`` redoes in backward (``recompute_flops``);
        the other layers three times their forward (dX and dW). The numerator
        of hardware FLOPs utilisation (HFU, Korthikanti et al. 2022). Counted once per
        model (an HBM plan asks it of every remat variant of every point it plans)."""
        kept = self.__dict__.get("_hardware_flops")
        if kept is None:
            kept = self.__dict__["_hardware_flops"] = sum(
                layer.hardware_flops(s) if isinstance(layer, TransformerBlock)
                else 3 * layer.forward_flops(s)
                for layer, s in zip(self.layers, self._shapes, strict=False))
        return kept

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
        for layer, p in zip(self.layers, self.prepare_params(core, params), strict=True):
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


def _widened(core, a: np.ndarray) -> np.ndarray:
    """A bf16-stored parameter as the float32 the layers compute with (exact);
    anything else as it is."""
    return computed(core, a) if a.dtype == WEIGHT_DTYPES["bfloat16"] else a


def router_loads(caches) -> tuple:
    """The ``RouterLoad`` of every MoE block among a forward pass's layer caches, in
    layer order (empty for a dense model)."""
    return tuple(c["moe"] for c in caches if isinstance(c, dict) and "moe" in c)


def moe_aux_loss(caches) -> float:
    """The sum of the MoE blocks' load-balancing losses of a forward pass (0.0 dense)."""
    return float(sum(load.aux_loss for load in router_loads(caches)))


def maxtext_tflops_2023(config: TransformerConfig, batch: int, *,
                        causal_halving: bool = False) -> float:
    """Training FLOPs of one step on one device as MaxText 2023 counts them.

    ``MaxText/train.py calculate_training_tflops`` (training-steps.md, "The
    metric"): 6 N T B + 12 H L Dh T^2 B, N the whole parameter count
    (``config.param_count()``: embedding included, a tied output layer once; with
    experts the active count, ``param_count(active=True)``,
    norms and biases too), H query heads, L layers, Dh the head dimension, T
    the sequence length, B the sequences per device; with ``causal_halving``
    the attention term is halved (MaxText from 64ee4e938, 2023-11-08: the v5p
    rows T1, T2 were measured with it, the v5e rows T3, T4 without). No
    recomputation, no optimizer work.

    Args:
        config: the model.
        batch: B, sequences per device per step.
        causal_halving: halve the attention term.

    Returns:
        FLOPs per device per step (divide by the step's seconds for the
        TFLOP/s per device MaxText prints, times 1e-12).
    """
    cfg, t, b = config, config.sequence_length, int(batch)
    attention = 12 * cfg.heads * cfg.layers * cfg.head_dim * t * t * b
    n = cfg.param_count(active=True)  # with experts the k a token uses (2023 had no MoE)
    return float(6 * n * t * b + (attention / 2 if causal_halving else attention))


def maxtext_tflops_2025(config: TransformerConfig, batch: int) -> float:
    """Training FLOPs of one step on one device as MaxText counts them at
    tpu-recipes-v0.1.4 (``maxtext_utils.calculate_tflops_training_per_device``;
    training-steps.md, "The metric"), the T5 row's figure.

    Per layer: ffn = 2 B T F E x (MLP input matrices: 2 gated, 1 not) + 2 B T
    F E, with experts k times that plus the router's 2 B T E X (X experts; the
    dropless count MaxText makes for every MoE decoder but DeepSeek's and
    Llama 4's); qkv = 2 B T E (H + 2K) Dh; projection = 2 B T E H Dh; attention =
    4 B T^2 H Dh (not halved for causality); once: embedding = 2 B T E V.
    Total = 3 ((ffn + qkv + projection) L + embedding) + 3 attention L (3:
    forward and the two backward products). No recomputation, no optimizer.

    Args:
        config: the model (E = embed_dim, F = mlp_dim, H heads, K kv_heads).
        batch: B, sequences per device per step.

    Returns:
        FLOPs per device per step.
    """
    cfg, t, b = config, config.sequence_length, int(batch)
    e, f, dh = cfg.embed_dim, cfg.mlp_dim, cfg.head_dim
    ffn = 2 * b * t * f * e * cfg.mlp_inputs + 2 * b * t * f * e
    if cfg.experts:
        ffn = 2 * b * t * e * cfg.experts + cfg.experts_per_token * ffn
    qkv = 2 * b * t * e * (cfg.heads + 2 * cfg.kv_heads) * dh
    projection = 2 * b * t * e * cfg.heads * dh
    attention = 4 * b * t * t * cfg.heads * dh
    embedding = 2 * b * t * e * cfg.vocabulary
    return float(3 * ((ffn + qkv + projection) * cfg.layers + embedding)
                 + 3 * attention * cfg.layers)


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
    return shared_transformer(TransformerConfig(vocabulary=num_classes,
                                                sequence_length=int(input_shape[0]), **options))


@functools.lru_cache(maxsize=64)
def shared_transformer(config: TransformerConfig, expert_shards: int = 1) -> TransformerModel:
    """The ``TransformerModel`` of ``config`` (and ``expert_shards``), built once per process
    and shared: a model is stateless (one object serves every device), and building one
    is a few milliseconds per block, which a layout search (``tpu-pod plan``) and an HBM
    plan that tries every remat policy and tensor split would pay again for every point.
    At most 64 are kept (least recently used go)."""
    return TransformerModel(config, expert_shards=int(expert_shards))


def check_tensor_split(config: TransformerConfig, tensor: int) -> None:
    """Checks that ``tensor`` devices can split the query heads, the key / value
    heads and the MLP hidden units.

    Raises:
        ValueError: one line, e.g. ``tensor 3 does not divide the transformer's
            heads 4, kv_heads 4 and mlp_dim 32; tensor must divide all three: 1,
            2, 4``.
    """
    sizes = (config.heads, config.kv_heads, config.mlp_dim)
    if all(n % tensor == 0 for n in sizes):
        return
    common = math.gcd(*sizes)
    choices = ", ".join(str(d) for d in range(1, common + 1) if common % d == 0)
    raise ValueError(f"tensor {tensor} does not divide the transformer's heads {config.heads}, "
                     f"kv_heads {config.kv_heads} and mlp_dim {config.mlp_dim}; tensor must "
                     f"divide all three: {choices}")


def check_expert_split(config: TransformerConfig, sizes: Mapping[str, int]) -> None:
    """Checks that a mesh's ``expert`` axis can split the transformer's experts.

    Raises:
        ValueError: one line: the expert size does not divide ``experts``; experts
            with tensor > 1 (an expert is not split over tensor); sparse dropless
            routing (capacity_factor 0, sparse_matmul true: a ragged all-to-all) with
            expert > 1 (dense dropless, every expert on every token, splits evenly).
    """
    expert, tensor = int(sizes.get("expert", 1)), int(sizes.get("tensor", 1))
    e = config.experts
    if not e:
        return
    if e % expert:
        choices = ", ".join(str(d) for d in range(1, e + 1) if e % d == 0)
        raise ValueError(f"expert {expert} does not divide the transformer's {e} experts; "
                         f"expert must divide them: {choices}")
    if tensor > 1:
        raise ValueError(f"tensor {tensor} with experts: the MoE program splits experts over "
                         f"expert and chunks them over fsdp, not over tensor; use tensor 1 "
                         f"(e.g. the expert or fsdp axis instead)")
    if expert > 1 and not config.capacity_factor and config.sparse_matmul:
        raise ValueError(f"expert {expert} with dropless routing (capacity_factor 0): the "
                         f"all-to-all of a sparse dropless MoE is ragged, which is not "
                         f"modelled; give capacity_factor > 0 (e.g. 1.25), sparse_matmul "
                         f"false (dense dropless: every expert on every token) or expert 1")

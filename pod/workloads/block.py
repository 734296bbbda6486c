"""The transformer's decoder block: sequential or parallel, with remat and tensor hooks.

Two layouts (MaxText ``decoder_block``; training-steps.md, "The MaxText 2023
model"):

- ``sequential`` (GPT-2, Llama): h = x + attn(norm1(x)); y = h + mlp(norm2(h)).
- ``parallel`` (GPT-J, PaLM, the MaxText 2023 decoder layer): one norm, the
  attention and the MLP read the same normed input and their outputs are
  summed with the residual: y = x + attn(norm(x)) + mlp(norm(x)).

With tensor parallelism (``TensorHooks``, Megatron's f and g operators) the
sequential block sums its row-parallel partial outputs twice per pass (after
the attention and after the MLP); the parallel block once (the attention and
MLP partial outputs are added first, then summed over the tensor devices), and
its input gradient is summed once in backward. The output projections'
biases are the block's (``attention/out_bias``, ``mlp/wo_bias``): replicated
over tensor and added once, after the sum.

Rematerialisation (``remat``, ``pod.workloads.remat``: MaxText's policies
and tensor names) decides what a block keeps from forward for backward, and
where (HBM or host memory), and so both the activation bytes the HBM plan
counts and the work recorded in backward; the numbers computed are the same
under every policy (bit-identical loss and gradients). The block's input is
always kept (the checkpoint remat restarts from). Backward reruns, from it
and the kept tensors, the part of the forward it needs (``_run`` with
``saved``): the norms, RoPE and the activations always (cheap, fused), the
projections and attention kernel whose outputs were not kept; never the MLP
output projection (backward does not need its result; XLA removes it as
dead code), nor, in the parallel block, the attention's output projection
(both outputs only feed the residual sum). Offloaded tensors are copied to
host memory at the end of the block's forward and back at the start of its
backward (``TensorCore.account_host_transfer``, records "<block>/offload/<name>"
and "<block>/reload/<name>").
"""

from __future__ import annotations

from types import MappingProxyType

import numpy as np

from pod.workloads.attention import CausalSelfAttention
from pod.workloads.flash import BackwardBlocks
from pod.workloads.fusion import epilogue, prologue
from pod.workloads.layers import Layer, vector_op
from pod.workloads.mlp import MLP, add
from pod.workloads.model import activation_bytes_per_element
from pod.workloads.moe import MoE
from pod.workloads.norms import norm_class
from pod.workloads.remat import REMAT_POLICIES, TENSOR_KEYS, remat_cache_keys, remat_choices

__all__ = ["BLOCKS", "REMAT_POLICIES", "TensorHooks", "TransformerBlock", "STATS_BYTES"]

BLOCKS = ("sequential", "parallel")
STATS_BYTES = 4  # a float32 per-row statistic (a norm's 1 / sigma, flash's log-sum-exp)
_NAME_OF = {key: name for name, keys in TENSOR_KEYS.items() for key in keys}


def params_of(params: dict, prefix: str) -> dict:
    """The entries "<prefix>/<local>" of a block's params, keyed by <local>."""
    n = len(prefix) + 1
    return {k[n:]: v for k, v in params.items() if k.startswith(prefix + "/")}


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

    ``TransformerBlock.tensor_hook_calls`` lists the calls a pass makes.
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


def _bias_grad(core, name: str, d: np.ndarray) -> np.ndarray:
    """sum of d (B, T, C) over batch and positions: (C,), a reduction on the VPU
    (across tokens: never fused)."""
    return vector_op(core, name, lambda z: z.sum(axis=(0, 1)), d, out=(d.shape[-1:], d.dtype))


class TransformerBlock(Layer):
    """A pre-norm decoder block (module docstring: layouts, remat, tensor hooks).

    Params are the sub-layers' under their prefixes: ``norm1/scale``
    (``norm/scale`` in the parallel block), ``attention/query``, ...,
    ``norm2/scale``, ``mlp/wi_0``, ...; with ``use_bias`` also
    ``attention/out_bias`` and ``mlp/wo_bias`` (C,).

    Args:
        heads, head_dim: attention heads and their size.
        mlp_dim, mlp_activation: the MLP.
        kv_heads: key / value heads (grouped-query attention); None: heads.
        norm: "rmsnorm" or "layernorm".
        rotary: RoPE in the attention.
        remat: one of ``REMAT_POLICIES`` (``pod.workloads.remat``).
        remat_custom: with ``remat="custom"``, MaxText tensor name -> remat |
            device | offload (``remat.check_remat_custom``).
        block: "sequential" or "parallel".
        use_bias: biases on every projection.
        fused_qkv: one q/k/v projection.
        attention: the attention kernel, "flash" or "dot_product".
        qk_norm: RMS-normalise each head's queries and keys (``CausalSelfAttention``).
        relative_bias: the T5 relative position bias in the attention (per layer).
        quantized: AQT int8 training of the projections (attention q / k / v / out, the
            MLP or the MoE's experts; ``pod.workloads.quantization``).
        flash_blocks: the flash kernel's (query, key / value) blocks; None: its default.
        backward_blocks: the flash backward's kernels and blocks
            (``pod.workloads.flash.BackwardBlocks``); None: two on the forward's blocks.
        fusion: fuse the elementwise work into the matmuls (``pod.workloads.fusion``).
        moe: None, or the mixture-of-experts options (``pod.workloads.moe.MoE``'s
            keywords but ``mlp_dim``, ``activation`` and ``fusion``: ``experts``,
            ``experts_per_token``, ``capacity_factor``, ``aux_loss_weight``,
            ``expert_shards``, ``sparse_matmul``): an MoE layer in place of the MLP, under the same
            name ("mlp"); its routing of a pass is the forward cache's "moe".
        name: layer name; sub-layer ops are recorded as "<name>/attention/...".

    Raises:
        ValueError: an unknown norm, remat or block, or bad sizes.
    """

    kind = "transformer_block"

    def __init__(self, heads: int, head_dim: int, mlp_dim: int, *, kv_heads: int | None = None,
                 mlp_activation: str = "gated_silu", norm: str = "rmsnorm", rotary: bool = True,
                 remat: str = "none", remat_custom=None, block: str = "sequential",
                 use_bias: bool = False, fused_qkv: bool = False, attention: str = "flash",
                 fusion: bool = True, moe: dict | None = None, qk_norm: bool = False,
                 relative_bias: bool = False, quantized: bool = False,
                 flash_blocks: tuple[int, int] | None = None,
                 backward_blocks: BackwardBlocks | None = None, name: str | None = None):
        super().__init__(name)
        if block not in BLOCKS:
            raise ValueError(f"block must be one of {', '.join(BLOCKS)}, got {block!r}")
        norm_cls = norm_class(norm)
        # MaxText name -> remat | device | offload
        self.choices = remat_choices(remat, remat_custom)
        self.remat, self.parallel, self.use_bias = remat, block == "parallel", bool(use_bias)
        self.fusion = bool(fusion)
        self.attention = CausalSelfAttention(heads, head_dim, kv_heads=kv_heads, rotary=rotary,
                                             use_bias=use_bias, fused_qkv=fused_qkv,
                                             attention=attention, fusion=fusion,
                                             qk_norm=qk_norm, relative_bias=relative_bias,
                                             quantized=quantized,
                                             backward_blocks=backward_blocks,
                                             **({} if flash_blocks is None else
                                                {"block_size": flash_blocks[0],
                                                 "block_kv": flash_blocks[1]}),
                                             name=f"{self.name}/attention")
        self.mlp = (MoE(mlp_dim=mlp_dim, activation=mlp_activation, fusion=fusion,
                        quantized=quantized, name=f"{self.name}/mlp", **moe) if moe else
                    MLP(mlp_dim, mlp_activation, use_bias=use_bias, fusion=fusion,
                        quantized=quantized, name=f"{self.name}/mlp"))
        self.moe = isinstance(self.mlp, MoE)
        if self.parallel:
            self.parts = {"norm": norm_cls(name=f"{self.name}/norm", fusion=fusion),
                          "attention": self.attention, "mlp": self.mlp}
        else:
            self.parts = {"norm1": norm_cls(name=f"{self.name}/norm1", fusion=fusion),
                          "attention": self.attention,
                          "norm2": norm_cls(name=f"{self.name}/norm2", fusion=fusion),
                          "mlp": self.mlp}
        self.biases = ("attention/out_bias", "mlp/wo_bias") if self.use_bias else ()
        self.matmul_params = tuple(f"{p}/{k}" for p, layer in self.parts.items()
                                   for k in layer.matmul_params)
        self.tensor_split = MappingProxyType({f"{p}/{k}": axis for p, layer in self.parts.items()
                                              for k, axis in layer.tensor_split.items()})
        self.tensor_partial = tuple(f"{p}/{k}" for p, layer in self.parts.items()
                                    for k in layer.tensor_partial)
        #: params split over the mesh's expert axis (an MoE's experts), and on which dimension
        self.expert_split = MappingProxyType({f"mlp/{k}": axis for k, axis in
                                              getattr(self.mlp, "expert_split", {}).items()})

    def _check(self, input_shape):
        if len(input_shape) != 2:
            raise ValueError(f"{self.name}: a transformer block expects (steps, features) inputs, "
                             f"got {tuple(input_shape)}")
        return tuple(int(v) for v in input_shape)

    def param_shapes(self, input_shape):
        shape = self._check(input_shape)
        out = {f"{p}/{k}": s for p, layer in self.parts.items()
               for k, s in layer.param_shapes(shape).items()}
        return {**out, **{k: (shape[-1],) for k in self.biases}}

    def init_params(self, rng, input_shape):
        shape = self._check(input_shape)
        out = {f"{p}/{k}": v for p, layer in self.parts.items()
               for k, v in layer.init_params(rng, shape).items()}
        return {**out, **{k: np.zeros(shape[-1], np.float32) for k in self.biases}}

    def forward_flops(self, input_shape):
        shape = self._check(input_shape)
        return self.attention.forward_flops(shape) + self.mlp.forward_flops(shape)

    # ------------------------------------------------------------ remat

    def kept(self) -> frozenset[str] | None:
        """What ``remat`` keeps, on the device or offloaded, as cache keys ("x" the
        block input; attention "q", "k", "v", "qkv", "attn" with flash's "stats";
        "out_proj", the summed attention output of the sequential block; MLP "u",
        "u0", "u1"); None: everything backward reads (``none``); ``minimal`` keeps no
        expert product of an MoE block (``remat.remat_cache_keys``)."""
        return remat_cache_keys(self.choices, self.remat, self.moe)[0]

    def offloaded(self) -> frozenset[str]:
        """The cache keys kept in host memory (``offload``)."""
        return remat_cache_keys(self.choices, self.remat, self.moe)[1]

    def _keeps(self, key: str) -> bool:
        kept = self.kept()
        return kept is None or key in kept

    def _sizes(self, shape) -> dict[str, tuple[int, int, bool]]:
        """Per example, each tensor a policy can keep that backward reads in this
        block: cache key -> (elements, bytes per element (0: the activation
        dtype's), in the residual stream (outside the attention and MLP))."""
        t, c = shape
        att = self.attention
        # per token (an MoE's slots)
        f = self.mlp.dot_elements(shape) // len(self.mlp.dot_keys) // t
        sizes = {"x": (t * c, 0, True), "q": (t * att.inner_dim, 0, False),
                 "k": (t * att.kv_dim, 0, False), "v": (t * att.kv_dim, 0, False),
                 "qkv": (t * (att.inner_dim + 2 * att.kv_dim), 0, False),
                 "attn": (t * att.inner_dim, 0, False),
                 "stats": (att.heads * t, STATS_BYTES, False),
                 "out_proj": (t * c, 0, True), "u": (t * f, 0, False), "u0": (t * f, 0, False),
                 "u1": (t * f, 0, False)}
        present = {"x", *att.dot_keys, *self.mlp.dot_keys,
                   *(() if self.parallel else ("out_proj",))}
        return {k: v for k, v in sizes.items() if k in present}

    def _everything(self, shape) -> list[tuple[int, int, bool]]:
        """Per example, every tensor backward reads without remat, each once (a
        tensor two parts read counts once): (elements, bytes per element, in the
        residual stream)."""
        t, c = shape
        att = self.attention
        # x_hat, 1/sigma
        norms = [(t * c, 0, True), (t, STATS_BYTES, True)] * (1 if self.parallel else 2)
        core = ([(t * att.inner_dim, 0, False), (att.heads * t, STATS_BYTES, False)] if att.flash
                else [(att.heads * t * t, 0, False), (t * att.inner_dim, 0, False)])  # o / probs, o
        attention = [(t * c, 0, False), (t * att.inner_dim, 0, False), (t * att.kv_dim, 0, False),
                     (t * att.kv_dim, 0, False), *core]                   # normed x, qh, kh, vh
        if att.qk_norm:  # the qk norms' x_hat and 1 / sigma per head and position
            attention += [(t * (att.inner_dim + att.kv_dim), 0, False),
                          (t * (att.heads + att.kv_heads), STATS_BYTES, False)]
        mlp = [(self.mlp.cache_elements(shape) - t * c, 0, False)]  # u's, g (an MoE's routing)
        return norms + attention + mlp + ([] if self.parallel else [(t * c, 0, False)])  # MLP's x

    def activation_bytes(self, input_shape, bytes_per_element: int, residual_shards: int = 1
                         ) -> tuple[int, int]:
        """(HBM bytes, host bytes) one example keeps for backward under ``remat``.

        Args:
            input_shape: (T, C) of the block (of one tensor device's model: its
                heads and MLP units).
            bytes_per_element: the activation dtype's (2 for bf16).
            residual_shards: devices the residual stream's tensors (the block
                input, the norms' x_hat, the summed attention output) are split
                over: the tensor size as XLA shards them under MaxText's rules
                (``activation_embed`` -> tensor), 1 on one device.
        """
        shape = self._check(input_shape)
        kept = self.kept()
        if kept is None:
            return self.transient_bytes(shape, bytes_per_element, residual_shards), 0
        device = host = 0
        offloaded = self.offloaded()
        for key, (n, b, residual) in self._sizes(shape).items():
            if key in kept:
                nbytes = -(-n * (b or bytes_per_element) // (residual_shards if residual else 1))
                host, device = ((host + nbytes, device) if key in offloaded
                                else (host, device + nbytes))
        return device, host

    def transient_bytes(self, input_shape, bytes_per_element: int, residual_shards: int = 1) -> int:
        """Bytes per example of every tensor this block's backward reads (the remat
        ``none`` set): what the block holds while its backward runs, recomputed."""
        return sum(-(-n * (b or bytes_per_element) // (residual_shards if residual else 1))
                   for n, b, residual in self._everything(self._check(input_shape)))

    def recompute_flops(self, input_shape) -> int:
        """MXU FLOPs the backward pass redoes per example under ``remat``: the
        projections, attention kernel products and MLP input products whose
        outputs were not kept, and the sequential block's attention output
        projection when the summed output was not kept (never the MLP output
        projection)."""
        shape = self._check(input_shape)
        kept = self.kept()
        if kept is None:
            return 0
        att, mlp = self.attention, self.mlp
        flops = sum(att.projection_flops(shape, k) for k in att.dot_keys
                    if k in ("q", "k", "v", "qkv") and k not in kept)
        flops += att.recompute_core_flops(shape, kept)
        if not self.parallel and "out_proj" not in kept:
            flops += att.output_flops(shape)
        extra = mlp.recompute_extra_flops(shape) if isinstance(mlp, MoE) else 0  # router, wo
        return flops + extra + sum(mlp.input_flops(shape) for k in mlp.dot_keys
                                   if k not in kept)

    def hardware_flops(self, input_shape) -> int:
        """MXU FLOPs per example of forward and backward as run: the attention's
        (``CausalSelfAttention.hardware_flops``), three times the MLP's forward
        (an MoE's: its router and its k experts per token, without its capacity's
        padding, and its dense dispatch's products, ``MoE.dispatch_flops``), and
        remat's recomputation."""
        shape = self._check(input_shape)
        dispatch = self.mlp.dispatch_flops(shape) if isinstance(self.mlp, MoE) else 0
        return (self.attention.hardware_flops(shape) + 3 * self.mlp.forward_flops(shape)
                + dispatch + self.recompute_flops(shape))

    def cache_elements(self, input_shape):
        """Elements of the arrays kept per example for backward, by ``remat`` (on the
        device or offloaded)."""
        shape = self._check(input_shape)
        kept = self.kept()
        if kept is None:
            return sum(layer.cache_elements(shape) for layer in self.parts.values())
        return sum(n for key, (n, _, _) in self._sizes(shape).items() if key in kept | {"x"})

    def _saved(self, caches) -> dict:
        """The kept tensors of a forward's caches, by part (``kept``)."""
        kept = self.kept()
        assert kept is not None  # forward saves tensors only under a remat that keeps some
        saved = {p: {k: caches[p][k] for k in getattr(layer, "dot_keys", ()) if k in kept}
                 for p, layer in self.parts.items() if getattr(layer, "dot_keys", ())}
        if "out_proj" in kept and not self.parallel:
            saved["out_proj"] = caches["out_proj"]
        return saved

    def _transfer(self, core, direction: str, x, saved) -> None:
        """Records the host transfers of the offloaded tensors (``direction``:
        "offload" after forward, "reload" before backward), one per MaxText name."""
        offloaded = self.offloaded()
        if not offloaded:
            return
        bpe = activation_bytes_per_element(core.precision)
        arrays = {"x": x, "out_proj": saved.get("out_proj"),
                  **{k: v for part in ("attention", "mlp") for k, v in saved.get(part, {}).items()}}
        nbytes: dict[str, int] = {}
        for key, a in arrays.items():
            if key in offloaded and a is not None:
                name = _NAME_OF[key]
                nbytes[name] = (nbytes.get(name, 0)
                                + a.size * (STATS_BYTES if key == "stats" else bpe))
        for name, n in nbytes.items():
            core.account_host_transfer(f"{self.name}/{direction}/{name}", n)

    def tensor_hook_calls(self, phase: str) -> list[tuple[str, str]]:
        """The ``TensorHooks`` calls of one pass, in order: (hook, place) with the
        tag "<block>/<place>"; ``phase`` "fwd" (or "eval") or "bwd" (remat's
        recomputation, then the gradients)."""
        if self.parallel:
            forward = [("enter", "parallel/in"), ("leave", "parallel/out")]
            grads = [("leave_grad", "parallel/dout"), ("enter_grad", "parallel/dx")]
        else:
            forward = [("enter", "attention/in"), ("leave", "attention/out"), ("enter", "mlp/in"),
                       ("leave", "mlp/wo")]
            grads = [("leave_grad", "mlp/dout"), ("enter_grad", "mlp/dx"),
                     ("leave_grad", "attention/dout"), ("enter_grad", "attention/dx")]
        if phase != "bwd":
            return forward
        if self.kept() is None:
            return grads
        if self.parallel:
            return forward[:1] + grads
        redo = [forward[0]] + ([] if self._keeps("out_proj") else [forward[1]]) + [forward[2]]
        return redo + grads

    # ------------------------------------------------------------ passes

    def _bias(self, core, params, key, y):
        """y + the block's bias ``key`` (none without ``use_bias``), after the tensor
        sum: fused into the next matmul."""
        if not self.use_bias:
            return y
        return vector_op(core, f"{self.name}/{key}", np.add, y, params[key], out=(y.shape, y.dtype),
                         fused=prologue(self.fusion))

    def _mlp_hooks(self, experts) -> dict:
        """The MLP part's keywords: an MoE's expert hooks (None: one device)."""
        return {"experts": experts} if self.moe else {}

    def _sequential(self, core, params, x, saved, need_output, tp, ex=None):
        n1, c1 = self.parts["norm1"].forward(core, params_of(params, "norm1"), x)
        kept = saved.get("out_proj")                                      # summed over tensor
        a, ca = self.attention.forward(core, params_of(params, "attention"),
                                       tp.enter(f"{self.name}/attention/in", n1),
                                       saved=saved.get("attention"), need_output=kept is None)
        if kept is None:
            a = self._bias(core, params, "attention/out_bias",
                           tp.leave(f"{self.name}/attention/out", a))
        else:
            a = kept
        h = add(core, f"{self.name}/residual1", x, a, prologue(self.fusion))
        n2, c2 = self.parts["norm2"].forward(core, params_of(params, "norm2"), h)
        m, cm = self.mlp.forward(core, params_of(params, "mlp"),
                                 tp.enter(f"{self.name}/mlp/in", n2),
                                 saved=saved.get("mlp"), need_output=need_output,
                                 **self._mlp_hooks(ex))
        y = None
        if need_output:
            m = self._bias(core, params, "mlp/wo_bias", tp.leave(f"{self.name}/mlp/wo", m))
            y = add(core, f"{self.name}/residual2", h, m, prologue(self.fusion))
        return y, {"norm1": c1, "attention": ca, "norm2": c2, "mlp": cm, "out_proj": a}

    def _parallel(self, core, params, x, saved, need_output, tp, ex=None):
        n, cn = self.parts["norm"].forward(core, params_of(params, "norm"), x)
        n_in = tp.enter(f"{self.name}/parallel/in", n)
        a, ca = self.attention.forward(core, params_of(params, "attention"), n_in,
                                       saved=saved.get("attention"), need_output=need_output)
        m, cm = self.mlp.forward(core, params_of(params, "mlp"), n_in, saved=saved.get("mlp"),
                                 need_output=need_output, **self._mlp_hooks(ex))
        y = None
        if need_output:
            s = tp.leave(f"{self.name}/parallel/out",
                         add(core, f"{self.name}/parallel_sum", a, m, epilogue(self.fusion)))
            s = self._bias(core, params, "mlp/wo_bias",
                           self._bias(core, params, "attention/out_bias", s))
            y = add(core, f"{self.name}/residual", x, s, prologue(self.fusion))
        return y, {"norm": cn, "attention": ca, "mlp": cm}

    def _run(self, core, params, x, saved, need_output, tensor=None, experts=None):
        """The block's forward; ``saved`` tensors are reused, not recomputed."""
        run = self._parallel if self.parallel else self._sequential
        return run(core, params, x, saved or {}, need_output, tensor or _ONE_DEVICE, experts)

    def forward(self, core, params, x, *, training=False, rng=None, tensor=None, experts=None):
        """As ``Layer.forward``. ``tensor`` (None on one device): the
        :class:`TensorHooks` of a tensor-parallel device whose params are its
        slice (``tensor_split``), put around the attention and the MLP.
        ``experts`` (None on one device): an MoE's ``ExpertHooks``; the cache's
        "moe" is then the MoE's ``RouterLoad`` (whatever ``remat`` keeps)."""
        self._check(x.shape[1:])
        y, caches = self._run(core, params, x, None, True, tensor, experts)
        if self.kept() is None:
            out = {"parts": {p: {k: caches[p][k] for k in layer.backward_keys}
                             for p, layer in self.parts.items()}}
        else:
            saved = self._saved(caches)
            self._transfer(core, "offload", x, saved)
            out = {"x": x, "saved": saved}
        if self.moe:
            out["moe"] = caches["mlp"]["route"]["load"]
        return y, out

    def backward(self, core, params, cache, dy, *, need_dx=True, tensor=None, experts=None):
        """As ``Layer.backward``; ``tensor`` and ``experts`` as in ``forward`` (their
        ``*_grad`` operators here, and the forward ones when remat recomputes)."""
        if "parts" in cache:
            caches = cache["parts"]
        else:  # remat: reload what was offloaded, recompute what was not kept
            self._transfer(core, "reload", cache["x"], cache["saved"])
            _, caches = self._run(core, params, cache["x"], cache["saved"], False, tensor,
                                  experts)
        grads: dict[str, np.ndarray] = {}
        tp = tensor or _ONE_DEVICE

        def part(p, d, need=True):
            hooks = self._mlp_hooks(experts) if p == "mlp" else {}
            dx, g = self.parts[p].backward(core, params_of(params, p), caches[p], d, need_dx=need,
                                           **hooks)
            grads.update({f"{p}/{k}": v for k, v in g.items()})
            return dx

        if self.parallel:
            if self.use_bias:
                grads["attention/out_bias"] = _bias_grad(core, f"{self.name}/d_out_bias", dy)
                grads["mlp/wo_bias"] = grads["attention/out_bias"].copy()
            ds = tp.leave_grad(f"{self.name}/parallel/dout", dy)
            dn = add(core, f"{self.name}/parallel_dx_sum", part("mlp", ds), part("attention", ds),
                     epilogue(self.fusion))
            dxn = part("norm", tp.enter_grad(f"{self.name}/parallel/dx", dn), need_dx)
            return (add(core, f"{self.name}/residual_bwd", dy, dxn, prologue(self.fusion))
                    if need_dx else None), grads
        if self.use_bias:
            grads["mlp/wo_bias"] = _bias_grad(core, f"{self.name}/d_wo_bias", dy)
        dm = tp.leave_grad(f"{self.name}/mlp/dout", dy)
        dn2 = tp.enter_grad(f"{self.name}/mlp/dx", part("mlp", dm))
        dh = add(core, f"{self.name}/residual2_bwd", dy, part("norm2", dn2), prologue(self.fusion))
        if self.use_bias:
            grads["attention/out_bias"] = _bias_grad(core, f"{self.name}/d_out_bias", dh)
        da = tp.leave_grad(f"{self.name}/attention/dout", dh)
        dn1 = tp.enter_grad(f"{self.name}/attention/dx", part("attention", da))
        dxn = part("norm1", dn1, need_dx)                                 # scale grad always
        return (add(core, f"{self.name}/residual1_bwd", dh, dxn, prologue(self.fusion))
                if need_dx else None), grads

"""Rematerialisation policies by MaxText's names: what a block keeps for backward, and where.

MaxText (``remat_policy``, ``layers/decoders.py`` ``get_remat_policy``; the
per-tensor names of ``MaxText/configs/base.yml`` at tpu-recipes-v0.1.4,
../shared/reference/maxtext/base-tpu-recipes-v0.1.4.yml) names the tensors a
decoder layer can keep with ``jax.ad_checkpoint.checkpoint_name``:

- ``decoder_layer_input``: the layer's input, the checkpoint recomputation
  restarts from (always kept: "this tensor cannot be rematerialized"; remat
  and device are the same for it);
- ``query_proj``, ``key_proj``, ``value_proj`` (``qkv_proj`` when fused): the
  projections' outputs, before RoPE;
- ``context``: the attention kernel's output before the output projection
  (with flash attention, with its per-row statistics);
- ``out_proj``: the output projection's result (summed over tensor);
- ``mlpwi`` (``mlpwi_0``, ``mlpwi_1`` when gated): the MLP input products;
- ``mlpwo``: the MLP output product.

Each is recomputed in backward (``remat``), kept in HBM (``device``) or kept
in host memory (``offload``: copied out after forward and back before its
backward over the host link, ``TensorCore.account_host_transfer``). A name
only costs memory where backward reads it: ``mlpwo`` never (nothing in
backward reads the MLP output), nor ``out_proj`` in the parallel block (its
output only feeds the residual sum).

The policies (``save_only_these_names`` unless said):

- ``none``: no remat; every intermediate backward reads stays (JAX
  ``everything_saveable``), the elementwise ones too.
- ``full``: nothing but the layer input (``nothing_saveable``).
- ``minimal``: ``checkpoint_dots_with_no_batch_dims``: the outputs of the
  weight matmuls (q, k, v, out_proj, mlpwi*, mlpwo), not the batched attention
  products: the attention kernel reruns in backward.
- ``save_dot_except_mlp``: q, k, v (qkv) and out_proj.
- ``save_dot_except_mlpwi``: those and mlpwo.
- ``save_qkv_proj``: q, k, v (qkv).
- ``save_dot_with_context_except_mlp``: q, k, v (qkv), the attention's
  context and out_proj.
- ``save_out_proj``: out_proj alone.
- ``qkv_proj_offloaded``: q, k, v to host memory (``save_and_offload_only_these_names``,
  nothing saved on the device; a fused ``qkv_proj`` is not among its names).
- ``minimal_offloaded``: what ``minimal`` keeps, to host memory instead of HBM
  (``offload_dot_with_no_batch_dims``, the same dots by their shape).
- ``custom``: per name from ``remat_custom`` (MaxText's per-tensor keys);
  names not given are ``remat`` (MaxText's defaults), the layer input
  ``device``.

These are the ten policies ``base.yml`` at tpu-recipes-v0.1.4 lists, and ``none``.
Their tensor sets are those of MaxText's ``get_remat_policy`` as the maxtext 0.2.5
wheel of the package index writes it (``layers/nnx_decoders.py``); ``minimal`` and
``minimal_offloaded`` are read by shape, as the XLA oracle's reference compiles them
(``checkpoint_dots_with_no_batch_dims`` / ``offload_dot_with_no_batch_dims``,
``tools/xla_oracle/model.py``), which names the same tensors in a dense block (0.2.5
names them; an MoE's expert products: :func:`remat_cache_keys`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

__all__ = ["REMAT_POLICIES", "REMAT_TENSORS", "REMAT_CHOICES", "TENSOR_KEYS", "remat_choices",
           "LAYER_INPUT_OFFLOADED", "LAYER_INPUT_OFFLOADED_VARIANT", "remat_label",
           "check_remat_custom", "remat_cache_keys", "remat_effect", "twin_policies"]

REMAT_POLICIES = ("none", "full", "minimal", "save_dot_except_mlp", "save_dot_except_mlpwi",
                  "save_qkv_proj", "save_dot_with_context_except_mlp", "save_out_proj",
                  "qkv_proj_offloaded", "minimal_offloaded", "custom")
REMAT_TENSORS = ("decoder_layer_input", "query_proj", "key_proj", "value_proj", "qkv_proj",
                 "out_proj", "mlpwi", "mlpwi_0", "mlpwi_1", "mlpwo", "context")
REMAT_CHOICES = ("remat", "device", "offload")
#: The custom choice that keeps the least of a layer in HBM: its input offloaded to host
#: memory, every other tensor recomputed (MaxText's v6e recipes offload the layer input,
#: T5's and T6's), and how a refusal names it as a version of the model that fits
#: (``TransformerModel.remat_variants``, ``pod.config.fit``).
LAYER_INPUT_OFFLOADED = (("decoder_layer_input", "offload"),)
LAYER_INPUT_OFFLOADED_VARIANT = "custom with remat_custom {decoder_layer_input: offload}"


def remat_label(policy: str) -> str:
    """How a refusal names the model under another remat policy (or a ``remat_variants``
    key) that fits: "remat full" (``pod.config.fit``'s hints, ``HBMPlanError.fits_with``)."""
    return f"remat {policy}"

#: MaxText tensor name -> the block's cache keys holding it (``TransformerBlock``)
TENSOR_KEYS = {"decoder_layer_input": ("x",), "query_proj": ("q",), "key_proj": ("k",),
               "value_proj": ("v",), "qkv_proj": ("qkv",), "context": ("attn", "stats"),
               "out_proj": ("out_proj",), "mlpwi": ("u",), "mlpwi_0": ("u0",), "mlpwi_1": ("u1",),
               "mlpwo": ()}

_PROJECTIONS = ("query_proj", "key_proj", "value_proj", "qkv_proj")
#: the MLP's products by MaxText name (an MoE's are batched over its experts)
_MLP_TENSORS = ("mlpwi", "mlpwi_0", "mlpwi_1", "mlpwo")
_SAVED = {
    "full": (),
    "minimal": (*_PROJECTIONS, "out_proj", "mlpwi", "mlpwi_0", "mlpwi_1", "mlpwo"),
    "save_dot_except_mlp": (*_PROJECTIONS, "out_proj"),
    "save_dot_except_mlpwi": (*_PROJECTIONS, "out_proj", "mlpwo"),
    "save_qkv_proj": _PROJECTIONS,
    "save_dot_with_context_except_mlp": (*_PROJECTIONS, "context", "out_proj"),
    "save_out_proj": ("out_proj",),
}
#: the policies that keep their tensors in host memory (``save_and_offload_only_these_names``
#: / ``offload_dot_with_no_batch_dims`` with ``offload_dst="pinned_host"``): policy -> names
_OFFLOADED = {
    "qkv_proj_offloaded": ("query_proj", "key_proj", "value_proj"),  # not a fused qkv_proj
    "minimal_offloaded": _SAVED["minimal"],
}
#: the policies that choose a block's dots by their shape, not their name (an MoE's expert
#: products are batched over the experts: :func:`remat_cache_keys`)
_BY_SHAPE = ("minimal", "minimal_offloaded")


def check_remat_custom(value: object, what: str = "transformer: option remat_custom"
                       ) -> tuple[tuple[str, str], ...]:
    """``remat_custom`` as given (a mapping of tensor name to remat | device | offload)
    as sorted pairs (hashable, in ``REMAT_TENSORS`` order).

    Raises:
        ValueError: one line naming the option, the value and what is allowed.
    """
    if not isinstance(value, Mapping):
        raise ValueError(f"{what} must be a mapping of tensor name to "
                         f"{' | '.join(REMAT_CHOICES)}, got {value!r:.60}")
    for name, choice in value.items():
        if name not in REMAT_TENSORS:
            raise ValueError(f"{what}: unknown tensor {name!r}; tensors: "
                             f"{', '.join(REMAT_TENSORS)}")
        if choice not in REMAT_CHOICES:
            raise ValueError(f"{what}.{name} must be one of {', '.join(REMAT_CHOICES)}, "
                             f"got {choice!r}")
    return tuple((name, value[name]) for name in REMAT_TENSORS if name in value)


def remat_choices(policy: str, custom: tuple[tuple[str, str], ...] | Mapping | None = None
                  ) -> dict[str, str] | None:
    """Per MaxText tensor name, remat | device | offload under ``policy`` (None for
    ``none``, which keeps everything on the device, not just named tensors).

    Raises:
        ValueError: an unknown policy, or a bad ``custom`` mapping.
    """
    if policy not in REMAT_POLICIES:
        raise ValueError(f"remat must be one of {', '.join(REMAT_POLICIES)}, got {policy!r}")
    if policy == "none":
        return None
    choices = dict.fromkeys(REMAT_TENSORS, "remat")
    if policy == "custom":
        choices.update(dict(check_remat_custom(dict(custom or {}))))
    elif policy in _OFFLOADED:
        choices.update(dict.fromkeys(_OFFLOADED[policy], "offload"))
    else:
        choices.update(dict.fromkeys(_SAVED[policy], "device"))
    if choices["decoder_layer_input"] == "remat":  # the checkpoint itself: always kept
        choices["decoder_layer_input"] = "device"
    return choices


def remat_cache_keys(choices: Mapping[str, str] | None, policy: str = "", moe: bool = False
                     ) -> tuple[frozenset[str] | None, frozenset[str]]:
    """What per-tensor ``choices`` (:func:`remat_choices` of ``policy``) keep as a block's
    cache keys (``TENSOR_KEYS``): (kept on the device or offloaded, None for everything
    backward reads under ``none``; offloaded to host memory).

    ``minimal`` is JAX's ``checkpoint_dots_with_no_batch_dims`` (``minimal_offloaded``
    its ``offload_dot_with_no_batch_dims``): it saves a dot by its shape, not its name,
    and an MoE's (``moe``) expert products are batched over the experts
    (``EBCM,EMH->EBCH``; megablox's grouped matmul is a kernel, no dot at all), so under
    it an MoE block keeps its attention's products but not its experts' (XLA: Mixtral
    8x7B at 8 x 4096 on v5p-128 holds 61.6 GiB, where keeping the expert products would
    need 194 GiB; ``tools/xla_oracle/results/mixtral-v5p-128-b8.json``)."""
    if choices is None:
        return None, frozenset()
    kept = frozenset(k for name, choice in choices.items() if choice != "remat"
                     for k in TENSOR_KEYS[name])
    if moe and policy in _BY_SHAPE:
        kept -= frozenset(k for name in _MLP_TENSORS for k in TENSOR_KEYS[name])
    offloaded = frozenset(k for name, choice in choices.items() if choice == "offload"
                          for k in TENSOR_KEYS[name])
    return kept, offloaded


def remat_effect(policy: str) -> tuple[tuple[frozenset[str] | None, frozenset[str]], ...]:
    """What a named policy (not ``custom``) does to a block: :func:`remat_cache_keys` of
    its choices in a dense block and in an MoE block. A block reads its policy only
    through them (``TransformerBlock.kept`` / ``offloaded``), so two policies with the
    same effect run the same ops and keep the same bytes: ``save_dot_except_mlp`` and
    ``save_dot_except_mlpwi`` (``mlpwo`` is read by no backward pass, so keeping it
    keeps nothing).

    Raises:
        ValueError: an unknown policy.
    """
    choices = remat_choices(policy)
    return tuple(remat_cache_keys(choices, policy, moe) for moe in (False, True))


@functools.lru_cache(maxsize=1)
def twin_policies() -> frozenset[str]:
    """The named policies (not ``custom``) that do to a block what another one does
    (:func:`remat_effect`): a step under one is a step under the other."""
    named = [p for p in REMAT_POLICIES if p != "custom"]
    effects = [remat_effect(p) for p in named]
    return frozenset(p for p, e in zip(named, effects, strict=True) if effects.count(e) > 1)

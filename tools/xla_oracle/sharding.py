"""MaxText's mesh axes and logical axis rules, and flax's rule resolution (no jax).

Two generations of MaxText are modelled, because the calibration rows ran on both:

- ``"2023"``: ``MaxText/configs/base.yml`` at 76bd53b0f (2023-12-15): mesh axes
  ``data, fsdp, sequence, tensor``; the residual stream sharded over ``tensor`` on its
  embedding dimension (``activation_embed: tensor``); the batch of the input data over
  every axis (``data_sharding``).
- ``"2025"``: ``MaxText/configs/base.yml`` at tag tpu-recipes-v0.1.4: twelve mesh axes,
  the residual stream replicated over ``tensor`` (``activation_embed`` is
  ``tensor_transpose``), ``fsdp_transpose`` on the MLP dimension, ``expert`` on the
  experts and on the batch.

The rule tables below are the ``logical_axis_rules`` of those files, in their order
(the order matters: flax resolves an array's logical names rule by rule, see
:func:`logical_to_mesh`). Only the names this reference uses are listed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["MESH_AXES", "RULES", "DATA_SHARDING", "logical_to_mesh", "mesh_shape",
           "ERAS"]

ERAS = ("2023", "2025")

MESH_AXES: dict[str, tuple[str, ...]] = {
    "2023": ("data", "fsdp", "sequence", "tensor"),
    "2025": ("data", "stage", "fsdp", "fsdp_transpose", "sequence", "context",
             "context_autoregressive", "tensor", "tensor_transpose", "tensor_sequence",
             "expert", "autoregressive"),
}

Rule = tuple[str, tuple[str, ...]]


def _rules(pairs: Sequence[tuple[str, str | Sequence[str]]]) -> tuple[Rule, ...]:
    return tuple((name, (axes,) if isinstance(axes, str) else tuple(axes))
                 for name, axes in pairs)


RULES: dict[str, tuple[Rule, ...]] = {
    # base.yml at 76bd53b0f, logical_axis_rules (all of them)
    "2023": _rules([
        ("activation_batch", ["data", "fsdp"]),
        ("activation_heads", ["tensor", "sequence"]),
        ("activation_length", "sequence"),
        ("activation_embed", "tensor"),
        ("activation_mlp", "tensor"),
        ("activation_kv", "tensor"),
        ("activation_vocab", ["tensor", "sequence"]),
        ("mlp", "tensor"),
        ("vocab", "tensor"),
        ("embed", ["fsdp", "sequence"]),
        ("heads", "tensor"),
    ]),
    # base.yml at tpu-recipes-v0.1.4, logical_axis_rules (those of the names used here,
    # in the file's order)
    "2025": _rules([
        ("activation_batch", ["data", "fsdp", "fsdp_transpose", "expert"]),
        ("activation_batch_no_exp", ["data", "fsdp", "fsdp_transpose"]),
        ("activation_embed_and_logits_batch", ["data", "stage", "fsdp", "fsdp_transpose",
                                               "expert"]),
        ("activation_heads", ["tensor", "tensor_transpose", "sequence", "tensor_sequence",
                              "autoregressive"]),
        ("activation_kv_heads", ["tensor", "tensor_transpose", "sequence", "tensor_sequence"]),
        ("activation_length", ["sequence", "context"]),
        ("activation_length", ["context"]),
        ("activation_norm_length", ["tensor_sequence", "context", "sequence"]),
        ("activation_q_length", ["context"]),
        ("activation_kv_length", []),
        ("activation_embed", ["tensor", "tensor_transpose"]),
        ("activation_mlp", ["tensor", "tensor_transpose", "tensor_sequence"]),
        ("activation_kv", ["tensor", "tensor_transpose", "tensor_sequence"]),
        ("activation_kv_batch", ["data", "fsdp", "fsdp_transpose", "expert"]),
        ("activation_kv_head_dim", ["tensor", "tensor_transpose", "tensor_sequence"]),
        ("activation_vocab", ["tensor", "tensor_transpose", "sequence", "tensor_sequence"]),
        ("activation_vocab", ["tensor", "tensor_transpose"]),
        ("activation_vocab", "tensor_sequence"),
        ("activation_vocab", ["sequence", "context"]),
        ("activation_stage", "stage"),
        ("activation_exp", ["expert"]),
        ("mlp", ["fsdp_transpose", "tensor", "tensor_sequence", "autoregressive"]),
        ("vocab", ["tensor", "tensor_transpose", "tensor_sequence", "autoregressive"]),
        ("heads", ["tensor", "tensor_transpose", "tensor_sequence", "autoregressive"]),
        ("q_heads", ["tensor", "tensor_transpose", "tensor_sequence", "autoregressive"]),
        ("kv_heads", ["tensor", "tensor_transpose", "tensor_sequence", "autoregressive"]),
        ("embed", ["fsdp", "fsdp_transpose", "sequence", "tensor_transpose", "context",
                   "expert"]),
        ("embed", ["fsdp", "sequence", "tensor_transpose", "context", "expert"]),
        ("embed", ["fsdp", "fsdp_transpose", "sequence", "context", "expert"]),
        ("embed", ["fsdp", "sequence", "context", "expert"]),
        ("embed_no_exp", ["fsdp", "fsdp_transpose", "sequence", "tensor_transpose",
                          "context"]),
        ("embed_no_exp", ["fsdp", "sequence", "tensor_transpose", "context"]),
        ("embed_no_exp", ["fsdp", "fsdp_transpose", "sequence", "context"]),
        ("embed_no_exp", ["fsdp", "sequence", "context"]),
        ("norm", ["tensor", "tensor_transpose", "tensor_sequence"]),
        ("layers", "stage"),
        ("kv", []),
        ("kv_head_dim", []),
        ("exp", "expert"),
    ]),
}

#: The input batch's logical axes: 2023 ``data_sharding`` (the batch over every mesh
#: axis); 2025 ``input_data_sharding_logical_axes``.
DATA_SHARDING: dict[str, tuple[str, ...] | None] = {
    "2023": None,  # None: the batch dimension over all of MESH_AXES["2023"]
    "2025": ("activation_embed_and_logits_batch", "activation_norm_length"),
}


def logical_to_mesh(names: Sequence[str | None], era: str,
                    sizes: Mapping[str, int]) -> tuple[tuple[str, ...] | None, ...]:
    """An array's logical axis names -> its mesh axes per dimension, as flax's
    ``logical_to_mesh_axes`` resolves them: rules are taken in order; a rule assigns its
    mesh axes to the dimension of its logical name when that dimension is still free and
    none of the rule's mesh axes is taken by another dimension. Mesh axes of size 1 are
    dropped from the result (they shard nothing).

    Args:
        names: one logical name (or None: replicated) per dimension.
        era: "2023" or "2025" (``RULES``).
        sizes: mesh axis -> size.

    Returns:
        Per dimension a tuple of mesh axes (outermost first), or None.

    Raises:
        KeyError: an unknown era.
    """
    assigned: list[tuple[str, ...] | None] = [None] * len(names)
    free = [True] * len(names)
    taken: set[str] = set()
    for logical, mesh_axes in RULES[era]:
        if logical not in names:
            continue
        pos = list(names).index(logical)
        if not free[pos] or taken & set(mesh_axes):
            continue
        assigned[pos] = mesh_axes
        free[pos] = False
        taken |= set(mesh_axes)
    out: list[tuple[str, ...] | None] = []
    for axes in assigned:
        kept = tuple(a for a in axes or () if sizes.get(a, 1) > 1)
        out.append(kept or None)
    return tuple(out)


def mesh_shape(era: str, ici: Mapping[str, int], dcn: Mapping[str, int]
               ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """MaxText's ``ici_parallelism`` and ``dcn_parallelism`` lists, in ``MESH_AXES[era]``
    order, from a scenario's ``pod.mesh`` and ``pod.dcn_mesh``.

    Raises:
        ValueError: an axis the era's mesh does not have, named.
    """
    axes = MESH_AXES[era]
    for name in (*ici, *dcn):
        if name not in axes:
            raise ValueError(f"mesh axis {name!r} is not a MaxText {era} mesh axis "
                             f"({', '.join(axes)})")
    return (tuple(int(ici.get(a, 1)) for a in axes), tuple(int(dcn.get(a, 1)) for a in axes))

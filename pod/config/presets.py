"""Models by name: ``model: {preset: llama3.1-8b}`` and MaxText's ``global_parameter_scale``.

Sources:
    [MT-2023] AI-Hypercomputer/maxtext ``MaxText/configs/base.yml`` and
        ``MaxText/pyconfig.py`` (``get_individual_scales``) at 76bd53b0f (2023-12-15).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pod.errors import ScenarioError

__all__ = ["ParameterScale", "parameter_scale"]


@dataclass(frozen=True)
class ParameterScale:
    """The multipliers MaxText applies to its ``base_*`` dimensions for a
    ``global_parameter_scale`` s [MT-2023].

    With log2(s) = 3 b + r (0 <= r < 3), one doubling in three goes to each of
    (heads and MLP), (embedding), (layers), in that order: heads and MLP grow by
    2^(b + [r > 0]), the embedding by 2^(b + [r > 1]), the layers by 2^b; the
    head dimension and the vocabulary stay. A cycle of three is a near-perfect 8x.

    Attributes:
        embed: multiplier of ``base_emb_dim``.
        heads: multiplier of ``base_num_heads`` (query and key / value heads).
        mlp: multiplier of ``base_mlp_dim``.
        layers: multiplier of ``base_num_decoder_layers``.
    """

    embed: int
    heads: int
    mlp: int
    layers: int


def parameter_scale(scale: int) -> ParameterScale:
    """MaxText's ``get_individual_scales`` [MT-2023].

    Raises:
        ScenarioError: ``scale`` is not a power of two >= 1 (as MaxText refuses it).
    """
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale < 1 or \
            scale != int(scale) or 2 ** int(math.log2(scale)) != scale:
        raise ScenarioError(f"global_parameter_scale: must be a power of two such as 1, 2, 4 or "
                            f"32, as MaxText requires (got {scale!r})")
    base, rest = divmod(int(math.log2(scale)), 3)
    heads = 2 ** (base + (rest > 0))
    return ParameterScale(embed=2 ** (base + (rest > 1)), heads=heads, mlp=heads, layers=2 ** base)

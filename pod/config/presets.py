"""Models by name: ``model: {preset: llama3.1-8b}`` and MaxText's ``global_parameter_scale``.

A preset is a published decoder's dimensions as options of the ``transformer``
model, with its source and its published parameter count (tests compare the
transformer's ``TransformerConfig.param_count()`` with it). In a scenario::

    model: {preset: llama2-7b}                         # the published model
    model: {preset: llama2-7b, options: {layers: 4}}   # any option overridden
    model: {preset: maxtext-2023, global_parameter_scale: 32}   # = maxtext-2023-s32

The preset also sets the vocabulary and, unless the scenario gives ``data``,
the data: random token ids (``synthetic_text``) of the preset's vocabulary and
training context, as the shipped large scenarios use for timing-only runs.
``data.options`` given in the scenario win (a preset model trained on other
data takes that data's vocabulary).

Cost-relevant specifics only. Not modelled, and said per preset in
``approximations``: Gemma's logit soft caps, sliding-window (local) layers
(costed as global attention, an overestimate of their attention work) and the
norms after attention and the MLP (E parameters each per layer: 0.003% of
Gemma 2 9B); Gemma's sqrt(E) embedding scale (no parameters); Gemma 3's
query / key norms. Mixtral is a mixture of experts (``pod.workloads.moe``): 8
experts, 2 per token, dropless as released (``capacity_factor`` 0; give one, e.g.
1.25, to split its experts over an ``expert`` mesh axis).

Sources:
    [LLAMA2] Touvron et al. 2023, "Llama 2: Open Foundation and Fine-Tuned Chat
        Models", Table 1 and section 2.2; the released configs
        (meta-llama/Llama-2-{7b,13b,70b}-hf config.json).
    [LLAMA3] Llama Team 2024, "The Llama 3 Herd of Models", Table 3; the released
        configs (meta-llama/Llama-3.1-{8B,70B,405B} config.json).
    [GPT3] Brown et al. 2020, "Language Models are Few-Shot Learners", Table 2.1
        (175.0B; d_model 12288, 96 layers, 96 heads of 128, context 2048) and
        section 2.1 (GPT-2's architecture: pre-LayerNorm, learned positions,
        biases, dense 4 d_model GELU MLP, tied embeddings; GPT-2's BPE, 50257 tokens).
    [GEMMA2] Gemma Team 2024, "Gemma 2: Improving Open Language Models at a
        Practical Size", Table 1 (architecture) and Table 2 (parameters).
    [GEMMA3] Gemma Team 2025, "Gemma 3 Technical Report", Table 1 (parameters)
        and section 2 (architecture, 32K pre-training sequences).
    [MISTRAL] Jiang et al. 2023, "Mistral 7B", Table 1; mistralai/Mistral-7B-v0.1
        config.json.
    [MIXTRAL] Jiang et al. 2024, "Mixtral of Experts", Table 1 and section 2 (46.7B
        parameters, 12.9B active per token).
    [MT-MODELS] AI-Hypercomputer/maxtext ``configs/models/<name>.yml`` at e591f30c
        (../shared/reference/maxtext/models/): the same dimensions as MaxText uses.
    [MT-2023] AI-Hypercomputer/maxtext ``MaxText/configs/base.yml`` and
        ``MaxText/pyconfig.py`` (``get_individual_scales``) at 76bd53b0f (2023-12-15);
        ../shared/reference/training-steps.md (T1: s = 32 is 32.5B).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any

from pod.errors import ScenarioError

__all__ = ["ParameterScale", "parameter_scale", "Preset", "PRESETS", "MAXTEXT_2023", "maxtext_2023",
           "closest_preset",
           "preset_names", "get_preset", "is_preset_name", "expand_model", "preset_data",
           "candidate_slices", "describe_scenario", "synthetic_examples", "DESCRIBE_MAX_SEQUENCE",
           "DESCRIBE_LAYOUTS"]


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


@dataclass(frozen=True)
class Preset:
    """A published decoder's dimensions (E = embedding, H query heads, K kv heads, D head
    dimension, F MLP hidden units, L layers, V vocabulary) and where they come from.

    Attributes:
        name: the preset's name.
        source: the paper and the published config the figures come from.
        embed_dim, heads, kv_heads, head_dim, mlp_dim, layers: E, H, K, D, F, L.
        vocabulary: V, tokens.
        mlp_activation, norm, positions, tied_embeddings, block, use_bias, fused_qkv,
            attention: the transformer's options of the same names.
        sequence_length: the published training context, tokens (the default data's).
        published_params: the published parameter count.
        published_tolerance: how far a count may be from it and still round to the
            published figure (half its last digit), parameters.
        experts, experts_per_token: a mixture of experts (1: a dense MLP); the
            transformer's ``experts`` and ``experts_per_token``.
        approximations: what the emulator does not model of it ("" if nothing).
    """

    name: str
    source: str
    embed_dim: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp_dim: int
    layers: int
    vocabulary: int
    mlp_activation: str
    sequence_length: int
    published_params: float
    published_tolerance: float
    norm: str = "rmsnorm"
    positions: str = "rotary"
    tied_embeddings: bool = False
    block: str = "sequential"
    use_bias: bool = False
    fused_qkv: bool = False
    attention: str = "flash"
    experts: int = 1
    experts_per_token: int = 1
    approximations: str = ""

    #: the fields that are the transformer's options
    OPTIONS = ("embed_dim", "heads", "kv_heads", "head_dim", "mlp_dim", "mlp_activation",
               "layers", "norm", "positions", "tied_embeddings", "block", "use_bias",
               "fused_qkv", "attention")

    def options(self) -> dict[str, Any]:
        """The transformer's options, those it takes today (``attention`` once branch
        model's flash attention is in; until then its attention is costed as it is);
        a mixture of experts adds ``experts`` and ``experts_per_token``."""
        from pod.workloads.transformer import TRANSFORMER_OPTIONS

        moe = ({"experts": self.experts, "experts_per_token": self.experts_per_token}
               if self.experts > 1 else {})
        return {k: getattr(self, k) for k in self.OPTIONS if k in TRANSFORMER_OPTIONS} | moe

    def dimensions(self) -> str:
        """``E 4096, 32 heads (8 kv) x 128, F 14336 gated_silu, 32 layers, V 128256``."""
        kv = f" ({self.kv_heads} kv)" if self.kv_heads != self.heads else ""
        experts = (f" x {self.experts} experts (top {self.experts_per_token})"
                   if self.experts > 1 else "")
        return (f"E {self.embed_dim}, {self.heads} heads{kv} x {self.head_dim}, F {self.mlp_dim} "
                f"{self.mlp_activation}{experts}, {self.layers} layers, V {self.vocabulary}")


_LLAMA2 = ("[LLAMA2] Touvron et al. 2023, Table 1; meta-llama/Llama-2-{}-hf config.json; "
           "[MT-MODELS] llama2-{}.yml")
_LLAMA3 = ("[LLAMA3] Llama Team 2024, Table 3; meta-llama/Llama-3.1-{}/config.json; "
           "[MT-MODELS] llama3.1-{}.yml")
_GEMMA = ("logit soft caps, sliding-window layers (costed as global attention) and the norms "
          "after attention and the MLP are not modelled")

PRESETS: dict[str, Preset] = {p.name: p for p in (
    # 6,738,415,616 in the released checkpoint: "6.74B"
    Preset("llama2-7b", _LLAMA2.format("7b", "7b"), 4096, 32, 32, 128, 11008, 32, 32000,
           "gated_silu", 4096, 6.74e9, 0.005e9),
    Preset("llama2-13b", _LLAMA2.format("13b", "13b"), 5120, 40, 40, 128, 13824, 40, 32000,
           "gated_silu", 4096, 13.0e9, 0.05e9),
    # grouped-query attention, 8 kv heads [LLAMA2] section 2.2; 68,976,648,192: "68.98B"
    Preset("llama2-70b", _LLAMA2.format("70b", "70b"), 8192, 64, 8, 128, 28672, 80, 32000,
           "gated_silu", 4096, 68.98e9, 0.005e9),
    Preset("llama3.1-8b", _LLAMA3.format("8B", "8b"), 4096, 32, 8, 128, 14336, 32, 128256,
           "gated_silu", 8192, 8.03e9, 0.005e9),
    Preset("llama3.1-70b", _LLAMA3.format("70B", "70b"), 8192, 64, 8, 128, 28672, 80, 128256,
           "gated_silu", 8192, 70.55e9, 0.005e9),
    Preset("llama3.1-405b", _LLAMA3.format("405B", "405b"), 16384, 128, 8, 128, 53248, 126,
           128256, "gated_silu", 8192, 405.85e9, 0.005e9),
    # MaxText pads the vocabulary to 50304 [MT-MODELS]; the paper's BPE has 50257
    Preset("gpt3-175b", "[GPT3] Brown et al. 2020, Table 2.1 and section 2.1; [MT-MODELS] "
           "gpt3-175b.yml", 12288, 96, 96, 128, 49152, 96, 50257, "gelu", 2048, 175.0e9,
           0.005 * 175.0e9, norm="layernorm", positions="learned", tied_embeddings=True,
           use_bias=True, fused_qkv=True),
    # MaxText counts a (local, global) pair as one layer: 21 there, 42 here
    Preset("gemma2-9b", "[GEMMA2] Gemma Team 2024, Tables 1 and 2 (917,504,000 embedding + "
           "8,324,201,984 non-embedding parameters); [MT-MODELS] gemma2-9b.yml", 3584, 16, 8,
           256, 14336, 42, 256000, "gated_gelu", 8192, 9.24e9, 0.005e9, tied_embeddings=True,
           approximations=_GEMMA),
    Preset("gemma2-27b", "[GEMMA2] Gemma Team 2024, Tables 1 and 2 (1,179,648,000 embedding + "
           "26,047,480,320 non-embedding parameters); [MT-MODELS] gemma2-27b.yml", 4608, 32, 16,
           128, 36864, 46, 256000, "gated_gelu", 8192, 27.23e9, 0.005e9, tied_embeddings=True,
           approximations=_GEMMA),
    # text model only: 1,416M embedding + 25,600M non-embedding (the 417M vision encoder
    # is not a decoder layer)
    Preset("gemma3-27b", "[GEMMA3] Gemma Team 2025, Table 1 and section 2; [MT-MODELS] "
           "gemma3-27b.yml", 5376, 32, 16, 128, 21504, 62, 262144, "gated_gelu", 32768,
           27.016e9, 0.005 * 27.016e9, tied_embeddings=True,
           approximations=_GEMMA + "; so are its query / key norms and its vision encoder"),
    Preset("mistral-7b", "[MISTRAL] Jiang et al. 2023, Table 1; mistralai/Mistral-7B-v0.1 "
           "config.json (7,241,732,096 parameters); [MT-MODELS] mistral-7b.yml", 4096, 32, 8,
           128, 14336, 32, 32000, "gated_silu", 8192, 7.24e9, 0.005e9,
           approximations="the sliding window (4096) is costed as global attention"),
    Preset("mixtral-8x7b", "[MIXTRAL] Jiang et al. 2024, Table 1 and section 2; [MT-MODELS] "
           "mixtral-8x7b.yml", 4096, 32, 8, 128, 14336, 32, 32000, "gated_silu", 32768, 46.7e9,
           0.05e9, experts=8, experts_per_token=2),
)}

#: The MaxText 2023 decoder at global_parameter_scale 1 [MT-2023]: parallel block, relu MLP
#: of two matrices, no biases, tied embeddings, flash attention; T1 (s = 32) is 32.5B.
MAXTEXT_2023 = Preset("maxtext-2023", "[MT-2023] MaxText/configs/base.yml and pyconfig.py at "
                      "76bd53b0f; training-steps.md T1 (s = 32: 32.5B)", 2560, 8, 8, 256, 8192,
                      16, 32768, "relu", 2048, math.nan, math.nan, tied_embeddings=True,
                      block="parallel")
_MAXTEXT_RE = re.compile(r"^maxtext-2023(?:-s(\d+))?$")


def maxtext_2023(scale: int = 1) -> Preset:
    """The MaxText 2023 decoder at ``global_parameter_scale`` ``scale`` (published: s = 32,
    32.5B, training-steps.md T1)."""
    f = parameter_scale(scale)
    p = MAXTEXT_2023
    published = {32: (32.5e9, 0.05e9)}.get(int(scale), (math.nan, math.nan))
    return replace(p, name=f"maxtext-2023-s{int(scale)}", embed_dim=p.embed_dim * f.embed,
                   heads=p.heads * f.heads, kv_heads=p.kv_heads * f.heads,
                   mlp_dim=p.mlp_dim * f.mlp, layers=p.layers * f.layers,
                   published_params=published[0], published_tolerance=published[1])


def preset_names() -> list[str]:
    """Every name ``get_preset`` takes (the MaxText family as maxtext-2023-s<N>)."""
    return [*PRESETS, "maxtext-2023", "maxtext-2023-s<N>"]


def get_preset(name: Any, global_parameter_scale: Any = None) -> Preset:
    """The preset called ``name`` (``maxtext-2023-s32`` = ``maxtext-2023`` at scale 32).

    Raises:
        ScenarioError: an unknown name (the message lists them, and the closest).
    """
    text = str(name).strip().lower()
    match = _MAXTEXT_RE.match(text)
    if match:
        if match.group(1) and global_parameter_scale is not None:
            raise ScenarioError(f"global_parameter_scale: {name} already says s = "
                                f"{match.group(1)}; give one of them")
        return maxtext_2023(int(match.group(1) or global_parameter_scale or 1))
    if global_parameter_scale is not None:
        raise ScenarioError(f"global_parameter_scale: belongs to the maxtext-2023 preset, not "
                            f"{name!r}")
    if text not in PRESETS:
        close = closest_preset(text)
        hint = f"did you mean {close}? " if close else ""
        raise ScenarioError(f"preset: unknown preset {name!r}; {hint}presets: "
                            f"{', '.join(preset_names())}")
    return PRESETS[text]


def synthetic_examples(batch: int, test_fraction: float = 0.2) -> int:
    """Random sequences whose train split holds ``batch`` (and whose test split one)."""
    n = max(2, math.ceil(batch / (1 - test_fraction)))
    while n - round(test_fraction * n) < batch or round(test_fraction * n) < 1:
        n += 1
    return n


def expand_model(model: Any) -> Any:
    """A scenario's ``model`` mapping with its preset expanded: ``{preset: X, options: {...}}``
    -> ``{name: transformer, preset: <X's full name>, options: X's options, then the given}``.
    Anything else is returned as it is (the scenario's checks report it).

    Raises:
        ScenarioError: ``preset: ...`` (unknown), ``name: ...`` (a model other than the
            transformer), ``global_parameter_scale: ...``.
    """
    if not isinstance(model, dict) or model.get("preset") is None:
        return model
    preset = get_preset(model["preset"], model.get("global_parameter_scale"))
    if model.get("name") not in (None, "transformer"):
        raise ScenarioError(f"name: a preset is a transformer (got {model['name']!r}); drop name")
    options = model.get("options") or {}
    if not isinstance(options, dict):
        return model
    return {**model, "name": "transformer", "preset": preset.name, "global_parameter_scale": None,
            "options": {**preset.options(), **options}}


def preset_data(model: Any, data: Any, training: Any) -> Any:
    """The ``data`` of a scenario whose model is a preset: random token ids of the preset's
    vocabulary and training context (``synthetic_text``) when no data is given, or those
    options filled in a ``synthetic_text`` data that does not give them. Returns ``data``
    as it is otherwise (or when the preset is unknown: ``expand_model`` reports it)."""
    if not isinstance(model, dict) or model.get("preset") is None:
        return data
    try:
        preset = get_preset(model["preset"], model.get("global_parameter_scale"))
    except ScenarioError:
        return data
    batch = training.get("global_batch") if isinstance(training, dict) else None
    defaults = {"vocabulary": preset.vocabulary, "sequence_length": preset.sequence_length}
    if isinstance(batch, int) and not isinstance(batch, bool) and batch > 0:
        defaults["num_examples"] = synthetic_examples(batch)
    if data is None:
        return {"name": "synthetic_text", "test_fraction": 0.2, "options": defaults}
    if isinstance(data, dict) and data.get("name") == "synthetic_text" and \
            isinstance(data.get("options", {}), dict):
        return {**data, "options": {**defaults, **data.get("options", {})}}
    return data


#: The context ``describe`` costs a preset at (at most): its mesh has no sequence axis, so a
#: 32K context of one sequence per device would not fit any slice.
DESCRIBE_MAX_SEQUENCE = 8192


def candidate_slices(preset: Preset) -> list[str]:
    """v5p slices, smallest first, from the first whose HBM holds the preset's parameters,
    gradients and Adam state (16 bytes a parameter) with FSDP over every chip."""
    from chip import get_chip_spec
    from pod.config.slices import SLICE_SHAPES
    from pod.workloads.transformer import TransformerConfig

    params = TransformerConfig(vocabulary=preset.vocabulary,
                               sequence_length=preset.sequence_length,
                               **preset.options()).param_count()
    hbm = get_chip_spec("v5p").hbm_available_bytes
    counts = sorted(SLICE_SHAPES["v5p"])
    fits = [c for c in counts if 16 * params <= hbm * math.prod(SLICE_SHAPES["v5p"][c])]
    return [f"v5p-{c}" for c in (counts[counts.index(fits[0]):] if fits else counts[-1:])]


#: Layouts ``describe`` tries on each slice, in order: FSDP over every chip; then tensor
#: parallelism over 8 chips with Megatron sequence parallelism (Llama 3 405B trained with
#: tensor parallelism 8 [LLAMA3] section 3.3.2), when the heads split 8 ways.
DESCRIBE_LAYOUTS = ({"fsdp": -1}, {"fsdp": -1, "tensor": 8})


def describe_scenario(name: str, slice_name: str | None = None,
                      mesh: dict[str, int] | None = None) -> dict[str, Any]:
    """The scenario ``tpu-pod describe <preset>`` describes: the preset on ``slice_name``
    (default: the first of ``candidate_slices``) with ``mesh`` (default FSDP over every
    chip; a tensor axis adds sequence parallelism), one sequence per device of its
    training context (at most ``DESCRIBE_MAX_SEQUENCE`` tokens), full remat, a timing-only
    one-point sweep; any of it can be overridden.

    Raises:
        ScenarioError: an unknown preset (one line).
    """
    preset = get_preset(name)
    slice_name = slice_name or candidate_slices(preset)[0]
    mesh = dict(mesh or DESCRIBE_LAYOUTS[0])
    chips = int(slice_name.split("-")[1]) // 2  # v5p slices count TensorCores, 2 per chip
    length = min(preset.sequence_length, DESCRIBE_MAX_SEQUENCE)
    return {"name": preset.name, "description": f"{preset.name} ({preset.dimensions()}) on "
            f"{slice_name}, {length:,}-token sequences.",
            "pod": {"slice": slice_name, "mesh": mesh},
            "model": {"preset": preset.name, "options": {"remat": "full"}},
            # a timing-only plan reads one chip's share of the batch: a few sequences
            "data": {"name": "synthetic_text", "test_fraction": 0.2,
                     "options": {"sequence_length": length, "num_examples": 10}},
            "training": {"global_batch": chips // mesh.get("tensor", 1), "steps": 2,
                         "optimizer": {"name": "adamw"},
                         "sequence_parallel": mesh.get("tensor", 1) > 1},
            "metrics": {"port": 0}, "sweep": {"mode": "timing", "steps": 2}}


def closest_preset(text: str) -> str | None:
    """The preset whose name is nearest ``text`` (``llama2_7b``: ``llama2-7b``), or None
    when none is near (``difflib``'s 0.6 similarity)."""
    import difflib

    close = difflib.get_close_matches(str(text).strip().lower(), list(PRESETS), n=1)
    return close[0] if close else None


def is_preset_name(text: str) -> bool:
    """Whether ``text`` names a preset (``llama3.1-8b``, ``maxtext-2023-s32``)."""
    try:
        get_preset(text)
    except ScenarioError:
        return False
    return True

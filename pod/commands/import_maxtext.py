"""``tpu-pod import-maxtext base.yml [model.yml] key=value ...``: a MaxText config as a scenario.

MaxText's precedence: the base config, then the model file's keys over it, then
``key=value`` overrides over both (an override of a key neither file has is
refused, as MaxText refuses it). The result is a timing-only scenario (the
shipped large scenarios' form: random token ids that only set the shapes,
``sweep: {mode: timing, steps: 2}``) of the ``transformer`` model:

- model: ``base_emb_dim``, ``base_num_query_heads`` (2023: ``base_num_heads``),
  ``base_num_kv_heads``, ``base_mlp_dim``, ``base_num_decoder_layers`` scaled by
  ``global_parameter_scale`` (``pod.config.presets.parameter_scale``),
  ``head_dim``, ``mlp_activations``, ``logits_via_embedding``, ``vocab_size``,
  ``decoder_block`` (block, norm, positions, biases), ``fused_qkv``,
  ``trainable_position_size``, ``attention`` (April 2023: ``enable_flash_attention``,
  whose presence also marks that MaxText's decoder: the T5 relative position bias and
  the QK norm in every layer, ``positions: relative``, ``use_qk_norm``), ``use_qk_norm``,
  ``sa_block_q`` / ``sa_block_kv`` (the splash kernel's blocks; its backward kernels'
  ``sa_block_q_dkv``, ``sa_block_kv_dkv``, ``sa_block_q_dq``, ``sa_block_kv_dq`` where
  they differ, and ``sa_use_fused_bwd_kernel``), ``weight_dtype``,
  ``quantization`` (``int8``, or 2023's ``int8_training``: AQT int8) and
  ``remat_policy`` (``custom``: the per-tensor keys ``decoder_layer_input``,
  ``query_proj``, ... as ``remat_custom``; the other policies by their names,
  ``pod.workloads.remat``); a mixture of experts (``decoder_block: mixtral``, or
  ``num_experts`` > 1 on a dense decoder): ``num_experts``,
  ``num_experts_per_tok``, ``capacity_factor`` (-1, dropless: 0),
  ``load_balance_loss_weight`` and ``sparse_matmul`` (false, or ``megablox: false``
  where the config has no ``sparse_matmul``, as MaxText before it had the key: the
  dense einsum dispatch) (DeepSeek's and Llama 4's MoE decoders, with
  shared experts and dense layers, are refused);
- mesh: ``ici_{data,pipeline,fsdp,fsdp_transpose,expert,tensor}_parallelism`` (-1: the
  devices the other axes leave, as MaxText fills it; MaxText's pipeline axis is
  ``stage``; ``fsdp_transpose`` runs as part of fsdp, ``pod.config.mesh.FOLDED_AXES``);
- slices: ``num_slices`` or ``compile_topology_num_slices`` (else the product of the
  DCN axes) as ``pod.slices``, ``dcn_{data,fsdp,fsdp_transpose,tensor}_parallelism`` as
  ``pod.dcn_mesh`` (-1: the slices the other DCN axes leave; the base's
  ``dcn_data_parallelism: -1`` takes every slice); an expert or pipeline axis across
  slices is refused (not modelled);
- pipeline (``ici_pipeline_parallelism`` > 1): ``num_pipeline_microbatches`` as
  ``training.microbatches`` (-1: the stages, MaxText's default and ours),
  ``num_pipeline_repeats`` (-1: layers / (stages x ``num_layers_per_pipeline_stage``),
  as MaxText sets it) as ``training.pipeline_repeats``, the schedule MaxText runs:
  ``circular`` with repeats, else ``gpipe``; ``pipeline_fsdp_ag_once`` as
  ``training.pipeline_fsdp_ag_once`` (written when true);
- batch: ``per_device_batch_size`` x every slice's devices = the global batch;
  ``max_target_length`` = the sequence length; ``dtype`` = the precision; ``opt_type``,
  ``learning_rate``, ``adam_*`` = the optimizer;
- the slice: ``--slice`` or ``compile_topology`` (``v5p-128``).

Every other key is named, one line each (``Note``): an **error** when it
changes the step and the emulator cannot model it (a sequence or context axis,
experts or stages across slices, gradient accumulation, ...); a
**warning** when the step is approximated (soft caps, sliding windows, extra
norms) or when the model file or the command line sets a key the scenario
does not carry; otherwise it does not change the simulated step (logging,
dataset paths, checkpoints, profiling, decoding, the learning-rate schedule)
and is listed in the written scenario's header (``--all-warnings`` prints
those too).

Sources: [MT-2023] AI-Hypercomputer/maxtext ``MaxText/configs/base.yml``,
``pyconfig.py``, ``layers/models.py`` at 76bd53b0f; [MT-2025] the same files
(``src/MaxText/configs/base.yml``, ``layers/decoders.py``) at tpu-recipes-v0.1.4.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pod.config.mesh import devices_per_chip
from pod.config.overrides import parse_override
from pod.config.presets import get_preset, parameter_scale, synthetic_examples
from pod.config.scenario import MAX_SCENARIO_BYTES, load_yaml
from pod.config.slices import resolve_pod
from pod.errors import ScenarioError
from pod.safe_io import read_text

__all__ = ["MaxTextConfig", "Note", "ImportResult", "read_maxtext", "to_scenario",
           "import_maxtext", "scenario_yaml", "MESH_AXES", "maxtext_int", "dcn_mesh"]


@dataclass(frozen=True)
class MaxTextConfig:
    """A merged MaxText config.

    Attributes:
        values: key -> value, after MaxText's precedence.
        origin: key -> where its value came from (a file name or "command line").
        base: the base file's name (its keys are MaxText's defaults).
    """

    values: dict[str, Any]
    origin: dict[str, str]
    base: str


@dataclass(frozen=True)
class Note:
    """What became of one MaxText key that is not mapped one to one.

    Attributes:
        key: the MaxText key.
        level: "error" (changes the step, not modelled), "warning" (approximated, or set
            by the model file or the command line and not carried), "ignored" (no
            effect on the simulated step).
        text: one line: the key, its value, and why.
    """

    key: str
    level: str
    text: str


@dataclass(frozen=True)
class ImportResult:
    """The scenario mapping and the notes of every key not mapped one to one."""

    scenario: dict[str, Any]
    notes: tuple[Note, ...] = field(default=())

    def of(self, level: str) -> list[Note]:
        """The notes of one level."""
        return [n for n in self.notes if n.level == level]


def _read(path: Path) -> dict[str, Any]:
    try:  # a regular file of at most MAX_SCENARIO_BYTES: a FIFO or /dev/zero is one line
        text = read_text(path, MAX_SCENARIO_BYTES, "MaxText configs")
    except ValueError as err:
        raise ScenarioError(str(err)) from None
    data = load_yaml(text, source=str(path))
    if not isinstance(data, dict):
        raise ScenarioError(f"{path}: a MaxText config is a mapping of keys (got "
                            f"{type(data).__name__})")
    return data


def read_maxtext(files: Sequence[str | Path], overrides: Sequence[str] = ()) -> MaxTextConfig:
    """Merge MaxText configs as MaxText does: base, then the model file, then ``key=value``.

    Raises:
        ScenarioError: an unreadable file, bad YAML, or an override of a key no file has
            (one line, with the closest key).
    """
    if not 1 <= len(files) <= 2:
        raise ScenarioError(f"import-maxtext: give the base config and at most one model config "
                            f"(got {len(files)} files)")
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for path in map(Path, files):
        for key, value in _read(path).items():
            values[str(key)], origin[str(key)] = value, path.name
    for text in overrides:
        item = parse_override(text)
        if item.key not in values:
            close = difflib.get_close_matches(item.key, list(values), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            if item.key in OTHER_VERSIONS:  # a key of another MaxText: this base's name for it
                hint = f"; {OTHER_VERSIONS[item.key]}"
            raise ScenarioError(f"{item.key}: not a key of "
                                f"{' or '.join(Path(f).name for f in files)} "
                                f"(got {item.text}){hint}")
        values[item.key], origin[item.key] = item.value, "command line"
    return MaxTextConfig(values, origin, Path(files[0]).name)


# --------------------------------------------------------------------------- model

#: mlp_activations -> the transformer's mlp_activation.
ACTIVATIONS = {("relu",): "relu", ("gelu",): "gelu", ("silu", "linear"): "gated_silu",
               ("gelu", "linear"): "gated_gelu"}
#: decoder_block -> block, norm, positions, biases [MT-2025] layers/decoders.py; the 2023
#: base has no decoder_block: its one DecoderLayer is the parallel block [MT-2023].
DECODER_BLOCKS = {
    "default": ("parallel", "rmsnorm", "rotary", False),
    "llama2": ("sequential", "rmsnorm", "rotary", False),
    "mistral": ("sequential", "rmsnorm", "rotary", False),
    "qwen3": ("sequential", "rmsnorm", "rotary", False),
    "gemma": ("sequential", "rmsnorm", "rotary", False),
    "gemma2": ("sequential", "rmsnorm", "rotary", False),
    "gemma3": ("sequential", "rmsnorm", "rotary", False),
    "gpt3": ("sequential", "layernorm", "learned", True),
    "mixtral": ("sequential", "rmsnorm", "rotary", False),
}
#: decoder blocks of mixture-of-experts models the emulator does not model: shared
#: experts, dense first layers, sigmoid routing (DeepSeek), interleaved MoE (Llama 4)
MOE_BLOCKS = ("deepseek", "llama4")
#: attention -> the transformer's attention kernel (TPU: "autoselected" picks flash for training)
ATTENTIONS = {"flash": "flash", "autoselected": "flash", "dot_product": "dot_product",
              "mha": "dot_product"}
#: weight_dtype -> the transformer's weight_dtype
WEIGHT_DTYPES = {"float32": "float32", "bfloat16": "bfloat16"}
#: keys of other MaxText versions than the base given: key -> what this base calls it
OTHER_VERSIONS = {
    "enable_flash_attention": "the attention kernel is the key attention (flash, mha, "
                              "dot_product, autoselected) from late 2023 on: e.g. attention=mha",
    "int8_training": "AQT int8 training is quantization=int8 from 2024 on",
    "quantization": "AQT int8 training is int8_training=true in 2023's MaxText",
}
#: remat_policy "custom": the tensors it names, each "device", "remat" or "offload" [MT-2025]
REMAT_CUSTOM_KEYS = ("decoder_layer_input", "context", "mlpwi", "mlpwi_0", "mlpwi_1", "mlpwo",
                     "query_proj", "key_proj", "value_proj", "qkv_proj", "out_proj")
#: dtype -> training.precision
DTYPES = {"bfloat16": "bf16", "float32": "fp32"}
#: opt_type -> training.optimizer.name (adam_pax: Adam with decoupled weight decay, as AdamW)
OPTIMIZERS = {"adamw": "adamw", "adam_pax": "adamw", "sgd": "sgd"}


def _int(config: MaxTextConfig, key: str, default: Any = None) -> int:
    """A whole-number key of ``config`` (``default`` when it is not set).

    Raises:
        ScenarioError: not a whole number (one line naming the key and where it came from).
    """
    value = config.values.get(key, default)
    if isinstance(value, str):
        value = value.replace("_", "")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ScenarioError(f"{key}: must be a number (got {value!r}, from "
                            f"{config.origin.get(key, 'the default')})") from None
    if number != int(number):
        raise ScenarioError(f"{key}: must be a whole number (got {value!r})")
    return int(number)


def _choice(config: MaxTextConfig, key: str, table: dict, default: Any) -> Any:
    raw = config.values.get(key, default)
    value = tuple(raw) if isinstance(raw, list) else raw
    if value not in table:
        shown = ", ".join(str(list(k)) if isinstance(k, tuple) else str(k) for k in table)
        raise ScenarioError(f"{key}: {raw!r} is not modelled; the emulator maps {shown} "
                            f"(from {config.origin.get(key, 'the default')})")
    return table[value]


def _model_options(config: MaxTextConfig) -> tuple[dict[str, Any], int]:
    """The transformer's options and the vocabulary."""
    v = config.values
    scale = parameter_scale(_int(config, "global_parameter_scale", 1))
    heads = "base_num_query_heads" if "base_num_query_heads" in v else "base_num_heads"
    kv = "base_num_kv_heads" if "base_num_kv_heads" in v else heads
    if v.get("decoder_block") in MOE_BLOCKS:
        raise ScenarioError(f"decoder_block: {v.get('decoder_block')!r} ({v.get('num_experts', 1)} "
                            f"experts): its mixture of experts (shared experts, dense layers, "
                            f"its routing) is not modelled; mixtral's is")
    block, norm, positions, bias = _choice(config, "decoder_block", DECODER_BLOCKS, "default")
    layers = _int(config, "base_num_decoder_layers") * scale.layers
    if v.get("decoder_block") == "gemma2":  # MaxText merges a local and a global layer into one
        layers *= 2
    options = {
        "embed_dim": _int(config, "base_emb_dim") * scale.embed,
        "heads": _int(config, heads) * scale.heads,
        "kv_heads": _int(config, kv) * scale.heads,
        "head_dim": _int(config, "head_dim"),
        "mlp_dim": _int(config, "base_mlp_dim") * scale.mlp,
        "mlp_activation": _choice(config, "mlp_activations", ACTIVATIONS, ["silu", "linear"]),
        "layers": layers, "norm": norm, "positions": positions,
        "tied_embeddings": bool(v.get("logits_via_embedding", False)),
        "block": block, "attention": _attention(config),
        "use_bias": bias, "fused_qkv": bool(v.get("fused_qkv", False)),
        "remat": str(v.get("remat_policy", "full")),
    }
    if options["remat"] == "custom":
        options["remat_custom"] = {k: v[k] for k in REMAT_CUSTOM_KEYS if k in v}
    if "enable_flash_attention" in v:  # MaxText's April 2023 decoder (281e04bf3)
        options |= {"positions": "relative", "use_qk_norm": True}
    return options | _other_options(config) | _moe_options(config), _int(config, "vocab_size")


def _attention(config: MaxTextConfig) -> str:
    """``attention``; in the April 2023 base ``enable_flash_attention`` (false: dot product)."""
    v = config.values
    if "attention" not in v and "enable_flash_attention" in v:
        return "flash" if _true(v["enable_flash_attention"]) else "dot_product"
    return _choice(config, "attention", ATTENTIONS, "flash")


def _true(value: Any) -> bool:
    return value is True or str(value).lower() == "true"


def _other_options(config: MaxTextConfig) -> dict[str, Any]:
    """The options written only away from their defaults (so an import of a config that
    does not use them is what it was): ``weight_dtype`` bfloat16, ``quantization`` int8
    (``int8_training`` in 2023), ``use_qk_norm``, the splash blocks, ``num_vocab_tiling``
    (the loss over chunks of the tokens: the logits' memory)."""
    from pod.workloads.flash import FLASH_BLOCK_SIZE
    from pod.workloads.transformer import SPLASH_BACKWARD_BLOCKS

    v = config.values
    out: dict[str, Any] = {}
    if _choice(config, "weight_dtype", WEIGHT_DTYPES, "float32") == "bfloat16":
        out["weight_dtype"] = "bfloat16"
    quantization = str(v.get("quantization") or "")
    if quantization not in ("", "int8"):
        raise ScenarioError(f"quantization: {quantization!r} is not modelled; the emulator maps "
                            f"\"\" (bf16) and int8 (AQT) (from {config.origin['quantization']})")
    if quantization == "int8" or _true(v.get("int8_training", False)):
        out["quantization"] = "int8"
    if _true(v.get("use_qk_norm", False)):
        out["use_qk_norm"] = True
    for key in ("sa_block_q", "sa_block_kv"):
        if key in v and _int(config, key) != FLASH_BLOCK_SIZE:
            out[key] = _int(config, key)
    fused = _true(v.get("sa_use_fused_bwd_kernel", False))
    if fused:
        out["sa_use_fused_bwd_kernel"] = True
    for key in SPLASH_BACKWARD_BLOCKS:  # kept where they differ from the forward's blocks
        forward = out.get("sa_block_kv" if "_kv_" in key else "sa_block_q", FLASH_BLOCK_SIZE)
        if key in v and not (fused and key.endswith("_dq")) and _int(config, key) != forward:
            out[key] = _int(config, key)
    if _int(config, "num_vocab_tiling", 1) != 1:
        out["num_vocab_tiling"] = _int(config, "num_vocab_tiling")
    return out


def _moe_options(config: MaxTextConfig) -> dict[str, Any]:
    """The mixture-of-experts options (none for a dense model): MaxText's ``num_experts``,
    ``num_experts_per_tok``, ``capacity_factor`` (-1: dropless, our 0) and
    ``load_balance_loss_weight``."""
    experts = _int(config, "num_experts", 1)
    if experts <= 1:
        return {}
    v = config.values
    factor = float(str(v.get("capacity_factor", -1.0)))
    dense = (not _true(v["sparse_matmul"]) if "sparse_matmul" in v
             else "megablox" in v and not _true(v["megablox"]))
    return {"experts": experts, "experts_per_token": _int(config, "num_experts_per_tok", 1),
            "capacity_factor": max(0.0, factor),
            "moe_aux_loss_weight": float(str(v.get("load_balance_loss_weight", 0.01))),
            **({"sparse_matmul": False} if dense else {})}


# --------------------------------------------------------------------------- pod and batch

#: MaxText's mesh axes the emulator has -> its name for them (MaxText's order)
_MESH_AXES = {"data": "data", "pipeline": "stage", "fsdp": "fsdp",
              "fsdp_transpose": "fsdp_transpose", "expert": "expert", "tensor": "tensor"}
#: MaxText's ICI axis (``ici_<axis>_parallelism``) -> the mesh axis (``tpu-pod plan`` too)
MESH_AXES = _MESH_AXES
#: MaxText's DCN axes the emulator runs across slices (an axis of ``pod.dcn_mesh``)
_DCN_AXES = ("data", "fsdp", "fsdp_transpose", "tensor")


def _slice_name(config: MaxTextConfig, slice_name: str | None) -> str:
    name = slice_name or str(config.values.get("compile_topology") or "")
    if not name:
        raise ScenarioError("import-maxtext needs the target slice: --slice v5p-128, or "
                            "compile_topology=v5p-128 as MaxText's AOT compiler takes it")
    return name


def _mesh(config: MaxTextConfig, devices: int) -> dict[str, int]:
    """``ici_*_parallelism`` as the scenario's mesh (MaxText's pipeline axis as ``stage``),
    -1 filled as MaxText fills it."""
    sizes = {axis: _int(config, f"ici_{axis}_parallelism", 1) for axis in _MESH_AXES}
    rest = [a for a, s in sizes.items() if s == -1]
    if len(rest) > 1:
        raise ScenarioError(f"ici_{rest[1]}_parallelism: -1 for both {rest[0]} and {rest[1]}; "
                            f"MaxText fills at most one ICI axis")
    known = math.prod(s for s in sizes.values() if s != -1)
    if any(s == 0 or s < -1 for s in sizes.values()) or devices % known:
        raise ScenarioError(f"ici_*_parallelism: {sizes} does not divide the slice's "
                            f"{devices} devices")
    if rest:
        sizes[rest[0]] = devices // known
    if math.prod(sizes.values()) != devices:
        raise ScenarioError(f"ici_*_parallelism: data x pipeline x fsdp x fsdp_transpose x expert "
                            f"x tensor = "
                            f"{math.prod(sizes.values())}, the slice has {devices} devices")
    return {_MESH_AXES[a]: s for a, s in sizes.items() if s != 1} or {"data": 1}


def dcn_mesh(config: MaxTextConfig) -> tuple[int, dict[str, int]]:
    """(the slices, ``pod.dcn_mesh``): ``num_slices`` or ``compile_topology_num_slices``
    when set (> 0), else the product of the DCN axes; ``dcn_{data,fsdp,tensor}_parallelism``
    with one -1 filled by the slices the others leave, as MaxText fills it.

    Raises:
        ScenarioError: two -1 axes, sizes that do not divide or multiply to the slices,
            a slice count that is not a whole number >= 1 (one line).
    """
    counts = [(k, _int(config, k, -1)) for k in ("num_slices", "compile_topology_num_slices")]
    given = [(k, n) for k, n in counts if n != -1]
    for key, n in given:
        if n < 1:
            raise ScenarioError(f"{key}: {n} is not a number of slices; a whole number >= 1, "
                                "or -1 (MaxText's: from the DCN axes)")
    if len({n for _, n in given}) > 1:
        raise ScenarioError(f"num_slices: {given[0][1]} and compile_topology_num_slices: "
                            f"{given[1][1]} disagree; give one")
    every = {m.group(1): _int(config, key) for key in config.values
             if (m := re.fullmatch(r"dcn_(\w+)_parallelism", key))}
    # every DCN axis counts in the slices (MaxText's); axes other than _DCN_AXES are
    # refused by their notes (STEP_KEYS) when > 1
    sizes = {a: every.get(a, 1) for a in _DCN_AXES} | every
    rest = [a for a, n in sizes.items() if n == -1]
    if len(rest) > 1:
        raise ScenarioError(f"dcn_{rest[1]}_parallelism: -1 for both {rest[0]} and {rest[1]}; "
                            "MaxText fills at most one DCN axis")
    known = math.prod(n for n in sizes.values() if n != -1)
    if any(n == 0 or n < -1 for n in sizes.values()):
        raise ScenarioError(f"dcn_*_parallelism: {sizes}: sizes are whole numbers >= 1, or -1")
    slices = given[0][1] if given else known
    if slices % known or (not rest and known != slices):
        shown = " x ".join(f"{a} {n}" for a, n in sizes.items() if n != 1)
        raise ScenarioError(f"dcn_*_parallelism: {shown or 'every axis 1'} across slices does "
                            f"not make the {slices} slices of {given[0][0]} = {slices}")
    if rest:
        sizes[rest[0]] = slices // known
    return slices, {a: n for a, n in sizes.items() if n > 1 and a in _DCN_AXES}


def _pipeline(config: MaxTextConfig, stages: int, layers: int) -> dict[str, Any]:
    """``training``'s pipeline fields for ``stages`` pipeline stages (none for one):
    ``num_pipeline_microbatches`` (-1: the stages, our default too),
    ``num_pipeline_repeats`` (-1: layers / (stages x ``num_layers_per_pipeline_stage``)),
    the circular schedule with repeats (MaxText's pipeline), else GPipe;
    ``pipeline_fsdp_ag_once: true`` as ``pipeline_fsdp_ag_once`` (without stages
    MaxText has no pipeline to apply it to: nothing is written).

    Raises:
        ScenarioError: repeats that do not cut the layers into stages x repeats chunks of
            ``num_layers_per_pipeline_stage`` layers (one line).
    """
    if stages == 1:
        return {}
    per_stage = _int(config, "num_layers_per_pipeline_stage", 1)
    repeats = _int(config, "num_pipeline_repeats", -1)
    if repeats == -1:
        if per_stage < 1 or layers % (stages * per_stage):
            raise ScenarioError(f"num_layers_per_pipeline_stage: {per_stage} x "
                                f"ici_pipeline_parallelism {stages} does not divide the "
                                f"{layers} decoder layers")
        repeats = layers // (stages * per_stage)
    elif repeats < 1 or repeats * stages * per_stage != layers:
        raise ScenarioError(f"num_pipeline_repeats: {repeats} x ici_pipeline_parallelism "
                            f"{stages} x num_layers_per_pipeline_stage {per_stage} is not the "
                            f"{layers} decoder layers")
    micro = _int(config, "num_pipeline_microbatches", -1)
    out: dict[str, Any] = {"microbatches": micro} if micro > 0 else {}
    if repeats > 1:
        out |= {"pipeline_schedule": "circular", "pipeline_repeats": repeats}
    ag_once = config.values.get("pipeline_fsdp_ag_once", False)
    if ag_once is True or str(ag_once).lower() == "true":
        out["pipeline_fsdp_ag_once"] = True
    return out


maxtext_int = _int


def _batch(config: MaxTextConfig, devices: int) -> int:
    per_device = float(config.values.get("per_device_batch_size", 1))
    batch = per_device * devices
    if batch < 1 or batch != int(batch):
        raise ScenarioError(f"per_device_batch_size: {per_device:g} x {devices} devices = "
                            f"{batch:g} sequences, not a whole global batch")
    return int(batch)


def _optimizer(config: MaxTextConfig) -> dict[str, Any]:
    v = config.values
    name = _choice(config, "opt_type", OPTIMIZERS, "adamw")
    out: dict[str, Any] = {"name": name, "learning_rate": float(str(v.get("learning_rate", 3e-5)))}
    if name == "adamw":
        for ours, theirs in (("beta1", "adam_b1"), ("beta2", "adam_b2"), ("eps", "adam_eps"),
                             ("weight_decay", "adam_weight_decay")):
            if theirs in v:
                out[ours] = float(str(v[theirs]))
    return out


def _num_examples(per_device_examples: int, tensorcores: int) -> int:
    """Random sequences enough for one chip's share of the batch (a timing-only plan
    reads one chip's) with a test split of 20%, as the shipped large scenarios."""
    return max(10, synthetic_examples(per_device_examples * tensorcores))


def to_scenario(config: MaxTextConfig, *, slice_name: str | None = None,
                name: str | None = None) -> ImportResult:
    """The scenario a merged MaxText config describes, and the notes of the other keys.

    Raises:
        ScenarioError: a key the scenario needs is missing or not modelled (one line).
    """
    config = _with_model_name(config)
    target = _slice_name(config, slice_name)
    try:
        pod = resolve_pod(slice_name=target)
    except ScenarioError as err:
        raise ScenarioError(str(err).replace("pod.slice:", "--slice:", 1)) from None
    devices = pod.chips * devices_per_chip(pod.chip)                   # one slice's
    options, vocabulary = _model_options(config)
    pending = _not_taken_yet(options) + _inferred(config, options)
    mesh = _mesh(config, devices)
    slices, dcn = dcn_mesh(config)
    batch = _batch(config, devices * slices)
    length = _int(config, "max_target_length")
    shards = math.prod(mesh.get(a, 1) * dcn.get(a, 1)
                       for a in ("data", "fsdp", "fsdp_transpose", "expert"))
    precision = _precision(config)
    where = f"{slices} x {target}" if slices > 1 else target
    label = name or _default_name(config, target if slices == 1 else f"{slices}x-{target}")
    multislice = {"slices": slices, "dcn_mesh": dcn} if slices > 1 else {}
    scenario = {
        "name": label,
        "description": f"Imported from MaxText ({', '.join(dict.fromkeys(config.origin.values()))})"
                       f" for {where}; timing-only.",
        "pod": {"slice": target, **multislice, "mesh": mesh},
        "model": {"name": "transformer", "options": options},
        "data": {"name": "synthetic_text", "test_fraction": 0.2,
                 "options": {"vocabulary": vocabulary, "sequence_length": length,
                             "num_examples": _num_examples(-(-batch // shards),
                                                           pod.chip.tensorcores)}},
        "training": {"global_batch": batch, "steps": 2, "precision": precision,
                     **_pipeline(config, mesh.get("stage", 1), options["layers"]),
                     "optimizer": _optimizer(config), "seed": 0},
        "metrics": {"port": 0},
        "sweep": {"mode": "timing", "steps": 2},
    }
    return ImportResult(scenario, tuple(pending + _notes(config, target)))


#: Options the transformer may not take yet (branch model): without them the scenario is
#: still the model, costed as the transformer does today; carried once it takes them.
LATER_OPTIONS = ("attention",)


def _not_taken_yet(options: dict[str, Any]) -> list[Note]:
    """Drop (in place) the ``LATER_OPTIONS`` the transformer does not take; a note each."""
    from pod.workloads.transformer import TRANSFORMER_OPTIONS

    notes = []
    for key in LATER_OPTIONS:
        if key in options and key not in TRANSFORMER_OPTIONS:
            notes.append(Note(key, "warning", f"{key}: {options.pop(key)!r}: not carried, the "
                                              f"transformer has no {key} option yet; costed as "
                                              f"it computes today"))
    return notes


def _inferred(config: MaxTextConfig, options: dict[str, Any]) -> list[Note]:
    """Notes of options read from what a key implies rather than from a key of their own."""
    notes = []
    if "enable_flash_attention" in config.values:
        notes.append(Note("enable_flash_attention", "warning", (
            f"enable_flash_attention: {_shown(config.values['enable_flash_attention'])} "
            f"({config.origin['enable_flash_attention']}): MaxText's April 2023 base "
            f"(281e04bf3), whose decoder has a T5 relative position bias and a QK norm in "
            f"every layer and no key for them: imported as positions: relative, use_qk_norm: "
            f"true, attention: {options['attention']}")))
    v = config.values
    if options.get("experts") and "sparse_matmul" in v and _true(v["sparse_matmul"]) \
            and "megablox" in v and not _true(v["megablox"]):
        notes.append(Note("megablox", "warning", (
            "megablox: False with sparse_matmul: True: MaxText's jax ragged_dot path, costed "
            "as the grouped matmul (megablox) is")))
    return notes


def _with_model_name(config: MaxTextConfig) -> MaxTextConfig:
    """``model_name: llama3.1-8b`` without a model file: MaxText reads
    ``configs/models/llama3.1-8b.yml``; here the preset of that name gives the same keys
    (``pod.config.presets``), below the command line's."""
    name = config.values.get("model_name")
    files = {o for o in config.origin.values() if o != "command line"}
    if name in (None, "", "default") or len(files) > 1:
        return config
    try:
        preset = get_preset(name)
    except ScenarioError:
        raise ScenarioError(f"model_name: {name!r} is not a preset here; give its model file "
                            f"(configs/models/{name}.yml) after the base") from None
    keys = {"base_emb_dim": preset.embed_dim, "base_num_query_heads": preset.heads,
            "base_num_kv_heads": preset.kv_heads, "head_dim": preset.head_dim,
            "base_mlp_dim": preset.mlp_dim, "vocab_size": preset.vocabulary,
            "base_num_decoder_layers": preset.layers,
            "mlp_activations": {v: list(k) for k, v in ACTIVATIONS.items()}[preset.mlp_activation],
            "logits_via_embedding": preset.tied_embeddings, "fused_qkv": preset.fused_qkv,
            "decoder_block": "gpt3" if preset.use_bias else
            "default" if preset.block == "parallel" else "llama2"}
    values, origin = dict(config.values), dict(config.origin)
    if preset.approximations:  # named as the step keys of a model file are
        keys["sliding_window_size"] = 1 if "sliding" in preset.approximations else 0
    for key, value in keys.items():
        if origin.get(key) != "command line":
            values[key], origin[key] = value, f"preset {preset.name}"
    return MaxTextConfig(values, origin, config.base)


def _precision(config: MaxTextConfig) -> str:
    """``dtype``; AQT int8 is the model's ``quantization`` (``_other_options``)."""
    return _choice(config, "dtype", DTYPES, "bfloat16")


def _default_name(config: MaxTextConfig, target: str) -> str:
    v = config.values
    model = v.get("model_name") if v.get("model_name") not in (None, "", "default") else None
    files = [o for o in dict.fromkeys(config.origin.values()) if o != "command line"]
    if model is None and len(files) > 1:
        model = Path(files[1]).stem
    if model is None:
        model = f"maxtext-s{_int(config, 'global_parameter_scale', 1)}"
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{model}-{target}")


# --------------------------------------------------------------------------- notes

#: Keys the mapping reads.
MAPPED = frozenset({
    "global_parameter_scale", "base_emb_dim", "base_num_heads", "base_num_query_heads",
    "base_num_kv_heads", "base_mlp_dim", "base_num_decoder_layers", "head_dim", "mlp_activations",
    "logits_via_embedding", "vocab_size", "remat_policy", "attention", "dtype", "decoder_block",
    "fused_qkv", "per_device_batch_size", "max_target_length", "compile_topology", "opt_type",
    "learning_rate", "adam_b1", "adam_b2", "adam_eps", "adam_weight_decay", "int8_training",
    "quantization", "model_name", "ici_data_parallelism", "ici_fsdp_parallelism",
    "ici_tensor_parallelism", "ici_expert_parallelism", "ici_pipeline_parallelism",
    "num_pipeline_microbatches", "num_pipeline_repeats", "num_layers_per_pipeline_stage",
    "pipeline_fsdp_ag_once",
    "num_slices", "compile_topology_num_slices", "dcn_data_parallelism",
    "dcn_fsdp_parallelism", "dcn_tensor_parallelism", "num_experts", "num_experts_per_tok",
    "capacity_factor", "load_balance_loss_weight", *REMAT_CUSTOM_KEYS,
    "weight_dtype", "use_qk_norm", "enable_flash_attention", "sparse_matmul", "megablox",
    "sa_block_q", "sa_block_kv", "sa_block_q_dkv", "sa_block_kv_dkv", "sa_block_q_dq",
    "sa_block_kv_dq", "sa_use_fused_bwd_kernel",
    "ici_fsdp_transpose_parallelism",
    "dcn_fsdp_transpose_parallelism", "num_vocab_tiling",
})

#: Keys that change the step unless at their neutral value: key -> (neutral values, level,
#: why). "error": not modelled; "warning": approximated.
STEP_KEYS: dict[str, tuple[tuple, str, str]] = {
    "dcn_expert_parallelism": ((1,), "error", "an expert axis across slices (its all-to-alls "
                               "over the DCN) is not modelled; keep expert in the slice"),
    "dcn_pipeline_parallelism": ((1,), "error", "pipeline stages in different slices are not "
                                 "modelled; keep the pipeline in the slice"),
    "pipeline_parallel_layers": ((-1,), "error", "a pipeline of some layers only (the others "
                                 "data parallel over stage) is not modelled"),
    "pipeline_delay_activation_forwarding": ((False,), "error", "delayed activation forwarding "
                                             "(twice the bubble) is not modelled"),
    "gradient_accumulation_steps": ((1,), "error", "gradient accumulation is not modelled"),
    "attention_type": (("global", "local_sliding"), "error", "only global (and sliding-window) "
                       "attention are modelled"),
    "first_num_dense_layers": ((0,), "error", "mixed dense / MoE layers are not modelled"),
    "shared_experts": ((1,), "warning", "shared experts are not modelled (DeepSeek's; MaxText "
                       "adds them to its deepseek decoder only)"),
    "use_random_routing": ((False,), "error", "random routing is not modelled"),
    "parameter_memory_host_offload": ((False,), "error", "parameter host offload is not modelled"),
    "optimizer_memory_host_offload": ((False,), "error", "optimizer host offload is not modelled"),
    "hardware": (("tpu",), "error", "the emulator is a TPU pod"),
    "sliding_window_size": ((0, None), "warning", "sliding-window layers are costed as full "
                            "causal attention (an overestimate of their attention work)"),
    "attn_logits_soft_cap": ((0, 0.0, None), "warning", "the tanh soft cap of the attention "
                             "logits is not modelled (a VPU op per score)"),
    "final_logits_soft_cap": ((0, 0.0, None), "warning", "the tanh soft cap of the output "
                              "logits is not modelled (a VPU op per logit)"),
    "use_post_attn_norm": ((False,), "warning", "the norm after attention is not modelled (E "
                           "parameters and a VPU pass per layer)"),
    "use_post_ffw_norm": ((False,), "warning", "the norm after the MLP is not modelled (E "
                          "parameters and a VPU pass per layer)"),
    "dropout_rate": ((0, 0.0), "warning", "dropout is not costed (a VPU mask per activation)"),
    "activations_in_float32": ((False,), "warning", "activations are costed in bf16"),
    "trainable_position_size": ((-1, None), "warning", "learned positions are sized by the "
                                "sequence length"),
}
for _axis in ("sequence", "context", "context_autoregressive", "tensor_transpose",
              "tensor_sequence", "autoregressive"):
    STEP_KEYS[f"ici_{_axis}_parallelism"] = ((1,), "error", f"the mesh has no {_axis} axis "
                                             "(data, pipeline, fsdp, fsdp_transpose, expert "
                                             "and tensor only)")
    STEP_KEYS[f"dcn_{_axis}_parallelism"] = ((1,), "error", f"the mesh has no {_axis} axis "
                                             "(across slices: data, fsdp, fsdp_transpose and "
                                             "tensor only)")

#: What a key that does not change the simulated step is about, by name.
NO_STEP_EFFECT = (
    ("the dataset and tokenizer", r"dataset|tokeniz|vocab_relative_path|assets_path|corpus|"
     r"^add_(bos|eos)$|packing|^hf_|^grain_|_split$|_columns$|shuffl|expansion_factor|"
     r"reuse_example_batch|^num_epoch$|^eval_|max_eval_target_length|use_chat_template|^eos_id$"),
    ("the run's logging and metrics", r"^run_name$|output_dir|^log_|metrics|tensorboard|goodput|"
     r"monitor|heartbeat|report_|stack_trace|^jax_|checkify|step_deviation|save_config"),
    ("checkpoints", r"checkpoint|^load_|^save_|lora|replicator|restor|force_unroll"),
    ("profiling and compilation", r"profil|dump_|compiled_trainstep_file"),
    ("inference and decoding", r"prompt|decode|sampling|predict|inference|prefill|generate_slice|"
     r"paged|kv_quant|kvcache|ragged|_axis_order$|reshape_q|multi_sampling|log_prob|"
     r"llm_inference|prefix_caching|padding_causal_mask|model_warmup|autoregressive_decode"),
    ("the splash attention kernel's other settings: its layouts and compute sub-blocks (its "
     "blocks sa_block_q, sa_block_kv, sa_block_q_dkv, sa_block_kv_dkv, sa_block_q_dq, "
     "sa_block_kv_dq and sa_use_fused_bwd_kernel are mapped)", r"^sa_"),
    ("the optimizer's schedule and seeds", r"learning_rate|warmup|cosine|clipping|eps_root|seed|"
     r"^steps$|target_eval_loss|mu_dtype"),
    ("numerics with no cost in the model", r"epsilon|^rope_|rope_|timescale|position_embeddings|"
     r"^beta_(fast|slow)$|^mscale$|iota_embed|scan|float32_(qk_product|logits)|logits_dot_in_fp32|"
     r"cast_logits_to_fp32|normalize_embedding_logits|enable_dropout|matmul_precision"),
    ("sharding rules (the emulator shards as MaxText's defaults: parameters over fsdp on the "
     "embedding, over tensor on heads, MLP and vocabulary)", r"logical_axis_rules|mesh_axes|"
     r"data_sharding|sharding_tolerance|custom_mesh|allow_split_physical_axes|optimize_mesh"),
)


def _about(key: str) -> str:
    for label, pattern in NO_STEP_EFFECT:
        if re.search(pattern, key):
            return label
    return "assumed not to change the simulated step"


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _notes(config: MaxTextConfig, target: str) -> list[Note]:
    """A note per key that is not mapped one to one."""
    notes = []
    remat_custom = config.values.get("remat_policy") == "custom"
    for key, value in config.values.items():
        where = config.origin[key]
        if key in MAPPED and (remat_custom or key not in REMAT_CUSTOM_KEYS):
            continue
        if key in STEP_KEYS:
            neutral, level, why = STEP_KEYS[key]
            if value in neutral or (isinstance(value, str) and value.lower() in map(str, neutral)):
                continue
            notes.append(Note(key, level, f"{key}: {_shown(value)} ({where}): {why}"))
            continue
        level = "ignored" if where == config.base else "warning"
        notes.append(Note(key, level, f"{key}: {_shown(value)} ({where}): not mapped, "
                                      f"{_about(key)}"))
    return notes


def import_maxtext(files: Sequence[str | Path], overrides: Sequence[str] = (), *,
                   slice_name: str | None = None, name: str | None = None) -> ImportResult:
    """``read_maxtext`` then ``to_scenario``."""
    return to_scenario(read_maxtext(files, overrides), slice_name=slice_name, name=name)


def scenario_yaml(result: ImportResult, command: str) -> str:
    """The scenario as YAML, headed by the command and the notes that matter (what is not
    modelled, approximated or not carried: one line each); the keys that do not change the
    simulated step (most of a MaxText base.yml: a few hundred) are listed after the
    scenario, so that the file opens with what it says."""
    head = [f"# Written by: {command}",
            "# Timing-only: random token ids set the shapes; cost a step with `tpu-pod sweep "
            "<this file>`."]
    for title, level in (("Not modelled", "error"), ("Approximated or not carried", "warning")):
        lines = [n.text for n in result.of(level)]
        if lines:
            head += [f"# {title}:"] + [f"#   {line}" for line in lines]
    ignored = [n.text for n in result.of("ignored")]
    if ignored:
        head.append(f"# {len(ignored):,} keys not mapped, with no effect on the simulated step: "
                    "listed at the end.")
    body = yaml.dump(_flowed(result.scenario), Dumper=_Dumper, sort_keys=False,
                     default_flow_style=False, width=100)
    tail = (["", "# Not mapped, no effect on the simulated step:"]
            + [f"#   {line}" for line in ignored]) if ignored else []
    return "\n".join(head) + "\n" + body + "".join(f"{line}\n" for line in tail)


class _Flow(dict):
    """A mapping written on one line (``{fsdp: 16, tensor: 4}``)."""


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(_Flow, lambda dumper, data: dumper.represent_mapping(
    "tag:yaml.org,2002:map", data, flow_style=True))


def _flowed(node: Any, depth: int = 0) -> Any:
    """Small mappings of scalars below the sections on one line, as the shipped scenarios."""
    if not isinstance(node, dict):
        return node
    items = {k: _flowed(v, depth + 1) for k, v in node.items()}
    small = len(node) <= 6 and not any(isinstance(v, (dict, list)) for v in node.values())
    return _Flow(items) if depth >= 1 and small else items

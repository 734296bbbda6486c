"""What ``tpu-pod plan MODEL`` plans: a preset, a scenario file or MaxText configs, as the
scenario mapping every point starts from; the slices; counts such as ``4Mi`` tokens.

The mapping's ``pod``, ``model.options.remat`` and ``training.global_batch`` are
the search's (``pod.commands.plan``): an override of them in the scenario's keys is
refused with the option that sets them. Everything else (the model, its data, the
optimizer, precision) is the source's, with the command line's ``KEY=VALUE``
overrides (scenario keys for a preset or a scenario; MaxText keys for MaxText
configs).

MaxText's own keys for what the plan searches are taken with any model
(``search_keys``), read as ``import-maxtext`` reads them: ``ici_<axis>_parallelism``
fixes that mesh axis (``pipeline``: stage; -1 or absent: searched),
``dcn_data_parallelism`` / ``num_slices`` the slices, ``per_device_batch_size`` the
batch, ``remat_policy`` the remat policy, ``compile_topology`` the slice, and for a
preset or a scenario ``capacity_factor`` and ``max_target_length``; MaxText's
per-tensor remat keys (``decoder_layer_input=offload``, ``query_proj=offload``, ...)
are the ``custom`` policy's choices (``model.options.remat_custom``), searched beside
the named policies. With MaxText configs, the keys the model file or the command line
sets count (the base file's are MaxText's defaults, not a choice).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pod.config.mesh import devices_per_chip
from pod.config.overrides import apply_overrides, as_overrides
from pod.config.presets import describe_scenario, get_preset, is_preset_name
from pod.config.scenario import MAX_SCENARIO_BYTES, load_yaml
from pod.config.slices import SLICE_SHAPES, Topology, resolve_pod
from pod.errors import ScenarioError
from pod.safe_io import read_text

__all__ = ["ModelSource", "model_source", "parse_count", "plan_slices", "devices_of",
           "MAXTEXT_KEYS", "SearchKeys", "search_keys"]

#: Keys that make a YAML file a MaxText config rather than a scenario.
MAXTEXT_KEYS = frozenset({"base_emb_dim", "base_num_decoder_layers", "global_parameter_scale",
                          "model_name", "ici_fsdp_parallelism", "per_device_batch_size"})

#: Overrides of what the search sets, and the option that sets it instead.
_SEARCHED = (("pod", "--slice, --chips, --num-slices and --mesh-axes (or MaxText's "
                     "ici_<axis>_parallelism)"),
             ("model.options.remat", "--remat (or MaxText's remat_policy)"),
             ("training.global_batch", "--global-batch or --tokens-per-step (or MaxText's "
                                       "per_device_batch_size)"))

#: MaxText's keys that set what the plan searches, with any model (``search_keys``)
_ICI_RE = re.compile(r"ici_(\w+)_parallelism")
_DCN_RE = re.compile(r"dcn_(\w+)_parallelism")
_LAYOUT_KEYS = ("num_slices", "compile_topology_num_slices", "per_device_batch_size",
                "remat_policy", "compile_topology")
#: ... and those a preset or a scenario takes too (MaxText configs map them to the model)
_MODEL_KEYS = ("capacity_factor", "max_target_length")


@dataclass(frozen=True)
class SearchKeys:
    """What MaxText's keys set of the search (``search_keys``); None: not set.

    Attributes:
        mesh: mesh axis -> its fixed size (``ici_<axis>_parallelism``; {}: every axis
            searched).
        num_slices: slices (``num_slices`` or the DCN axes' product; data across them).
        per_device_batch: sequences per device (``per_device_batch_size``).
        remat: the remat policy (``remat_policy``).
        slice_name: the slice (``compile_topology``).
        capacity_factor: a mixture of experts' capacity (``capacity_factor``; -1: 0).
        seq_len: tokens per sequence (``max_target_length``).
        given: the ``KEY=VALUE`` texts (or ``key: value`` of a file) that set them.
    """

    mesh: dict[str, int] = field(default_factory=dict)
    num_slices: int | None = None
    per_device_batch: int | None = None
    remat: str | None = None
    slice_name: str | None = None
    capacity_factor: float | None = None
    seq_len: int | None = None
    given: dict[str, str] = field(default_factory=dict)

_COUNT_RE = re.compile(r"^\s*([0-9][0-9_,]*(?:\.[0-9]+)?(?:e[0-9]+)?)\s*([kmgtb]i?)?\s*$",
                       re.IGNORECASE)
_SCALE = {"k": 1e3, "m": 1e6, "g": 1e9, "b": 1e9, "t": 1e12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


@dataclass(frozen=True)
class ModelSource:
    """The scenario mapping every point of a plan starts from.

    Attributes:
        name: the model's name (the preset's, the scenario's, MaxText's ``model_name``).
        scenario: the mapping (a timing-only scenario: ``sweep: {mode: timing}``); the
            search sets ``pod``, the remat policy and the global batch of each point.
        preset: a preset whose overrides leave ``training.sequence_parallel`` alone: its
            meshes with a tensor axis get sequence parallelism, as ``describe`` plans
            them; otherwise the source's own setting stands.
    """

    name: str
    scenario: dict[str, Any]
    preset: bool


def parse_count(value: Any, option: str) -> int:
    """A whole count written as people write it: ``4194304``, ``4,194,304``, ``4Mi``
    (2^20), ``4M`` (10^6), ``1e12``, ``2T``.

    Raises:
        ScenarioError: not a positive whole number (one line naming ``option``).
    """
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    match = _COUNT_RE.match(str(value))
    number = None
    if match:
        number = float(match.group(1).replace(",", "").replace("_", ""))
        number *= _SCALE[match.group(2).lower()] if match.group(2) else 1
    if number is None or not 1 <= number < 2**63 or number != int(number):
        raise ScenarioError(f"{option}: {str(value)[:40]!r} is not a positive whole number "
                            "(below 2^63); give e.g. 4194304, 4Mi (2^20 x 4) or 4M (4 x 10^6)")
    return int(number)


def plan_slices(slices: Sequence[str], chips: int | None) -> list[Topology]:
    """The slices a plan searches: each ``--slice`` (a slice, ``v5e-256``), or with
    ``--chips N`` every generation's slice of N chips (the generations given as
    ``--slice v5e``, or all).

    Raises:
        ScenarioError: an unknown slice or generation, no slice of N chips, neither
            option (one line).
    """
    if chips is None:
        if not slices:
            raise ScenarioError("--slice: give the slice to plan for, e.g. --slice v5e-256 "
                                "(repeat it to compare slices), or --chips N")
        return [_slice(name) for name in slices]
    generations = [s.strip().lower() for s in slices] or list(SLICE_SHAPES)
    for gen in generations:
        if gen not in SLICE_SHAPES:
            raise ScenarioError(f"--slice: {gen!r} with --chips is a generation; give one of "
                                f"{', '.join(SLICE_SHAPES)}")
    out = []
    for gen in generations:
        for count, shape in SLICE_SHAPES[gen].items():
            if math.prod(shape) == chips:
                out.append(resolve_pod(slice_name=f"{gen}-{count}"))
    if not out:
        raise ScenarioError(f"--chips: no {' or '.join(generations)} slice has {chips:,} chips; "
                            f"{chips_hint(generations)}")
    return out


def chips_hint(generations: Sequence[str]) -> str:
    """The chip counts of the generations' slices: ``v5e slices have 1, 4, 8, ... or
    256 chips``."""
    def counts(gen: str) -> str:
        sizes = sorted({math.prod(shape) for shape in SLICE_SHAPES[gen].values()})
        return f"{', '.join(f'{n:,}' for n in sizes[:-1])} or {sizes[-1]:,}" if len(sizes) > 1 \
            else f"{sizes[0]:,}"
    return "; ".join(f"{gen} slices have {counts(gen)} chips" for gen in generations)


def _slice(name: str) -> Topology:
    try:
        return resolve_pod(slice_name=name)
    except ScenarioError as err:
        raise ScenarioError(f"--slice: {str(err).removeprefix('pod.slice: ')}") from None


def model_source(model: str, files: Sequence[str] = (), overrides: Any = (), *,
                 slice_name: str, seq_len: int | None = None) -> ModelSource:
    """The mapping a plan of ``model`` starts from (see the module docstring).

    Args:
        model: a preset's name, a scenario file, or MaxText's base.yml.
        files: MaxText's model.yml after base.yml.
        overrides: ``KEY=VALUE`` (scenario keys; MaxText keys for MaxText configs).
        slice_name: the first slice searched (MaxText's import needs one).
        seq_len: tokens per sequence (default: the source's; a preset's training
            context, at most ``DESCRIBE_MAX_SEQUENCE``).

    Raises:
        ScenarioError: an unknown preset, an unreadable file, an override of what the
            search sets, a MaxText key that is not modelled (one line).
    """
    _check_searched(overrides)
    path = Path(model)
    if not path.exists() and not model.endswith((".yaml", ".yml")):
        if not is_preset_name(model):
            get_preset(model)  # the unknown-preset line, with the closest name
        if files:
            raise ScenarioError(f"MODEL: {model} is a preset; {files[0]} is not needed")
        items = as_overrides(overrides)
        data = apply_overrides(describe_scenario(model), items)
        own = any(o.key in ("training", "training.sequence_parallel") for o in items)
        return _finish(get_preset(model).name, data, not own, seq_len)
    try:  # a regular file of at most MAX_SCENARIO_BYTES: a FIFO or /dev/zero is one line
        text = read_text(path, MAX_SCENARIO_BYTES, "scenarios and MaxText configs")
    except ValueError as err:
        raise ScenarioError(f"MODEL: {err}") from None
    data = load_yaml(text, source=model)
    if isinstance(data, dict) and MAXTEXT_KEYS & set(data) and "pod" not in data:
        return _maxtext(model, files, overrides, slice_name, seq_len)
    if files:
        raise ScenarioError(f"MODEL: {model} is a scenario; {files[0]} is not needed (a second "
                            "file goes with MaxText's base.yml)")
    if not isinstance(data, dict):
        raise ScenarioError(f"{model}: a scenario is a mapping (got {type(data).__name__})")
    data = apply_overrides(data, as_overrides(overrides))
    return _finish(str(data.get("name") or path.stem), data, False, seq_len)


def search_keys(model: str, files: Sequence[str] = (), overrides: Any = ()
                ) -> tuple[SearchKeys, tuple[Any, ...]]:
    """MaxText's keys for what the plan searches (the module docstring), and the overrides
    left for the model's scenario.

    Raises:
        ScenarioError: a key's value is not what MaxText allows, an axis the mesh does not
            have, an axis across slices other than data (one line).
    """
    from pod.commands.import_maxtext import MaxTextConfig, read_maxtext

    items = as_overrides(overrides)
    if _is_maxtext(model):
        merged = read_maxtext([model, *files], [o.text for o in items])
        chosen = {k: v for k, v in merged.values.items()
                  if merged.origin.get(k) != merged.base and _is_search_key(k, model=False)}
        given = {k: f"{k}={v}" if merged.origin[k] == "command line"
                 else f"{k}: {v} ({merged.origin[k]})" for k, v in chosen.items()}
        # the search sets them per point: the import reads the model's keys only (and
        # remat_policy=custom, under which it maps the per-tensor keys to remat_custom)
        rest = tuple(o for o in items if not _is_search_key(o.key, model=False)
                     or (o.key == "remat_policy" and str(o.value) == "custom"))
    else:
        chosen = {o.key: o.value for o in items if _is_search_key(o.key, model=True)}
        given = {o.key: o.text for o in items if o.key in chosen}
        rest = _tensor_keys_as_remat_custom(tuple(o for o in items if o.key not in chosen))
    config = MaxTextConfig(chosen, {k: "the command line" for k in chosen}, "")
    return _read_search_keys(config, given), rest


def _tensor_keys_as_remat_custom(items: tuple[Any, ...]) -> tuple[Any, ...]:
    """MaxText's per-tensor remat keys (``decoder_layer_input=offload``, ``query_proj=...``)
    given with a preset or a scenario, as the one ``model.options.remat_custom`` override
    they make (the ``custom`` policy's choices), after the other items.

    Raises:
        ScenarioError: a choice other than remat, device or offload (one line).
    """
    from pod.commands.import_maxtext import REMAT_CUSTOM_KEYS
    from pod.workloads.remat import REMAT_CHOICES

    tensors = [o for o in items if o.key in REMAT_CUSTOM_KEYS]
    if not tensors:
        return items
    for o in tensors:
        if o.value not in REMAT_CHOICES:
            raise ScenarioError(f"{o.text}: a tensor's remat choice is one of "
                                f"{', '.join(REMAT_CHOICES)}")
    choices = {o.key: str(o.value) for o in tensors}
    return (*(o for o in items if o.key not in REMAT_CUSTOM_KEYS),
            *as_overrides({"model.options.remat_custom": choices}))


def _is_search_key(key: str, *, model: bool) -> bool:
    return bool(_ICI_RE.fullmatch(key) or _DCN_RE.fullmatch(key) or key in _LAYOUT_KEYS
                or (model and key in _MODEL_KEYS))


def _read_search_keys(config: Any, given: dict[str, str]) -> SearchKeys:
    """``SearchKeys`` from the chosen keys, by ``import-maxtext``'s reading of them."""
    from pod.commands.import_maxtext import MESH_AXES, dcn_mesh, maxtext_int

    values, mesh = config.values, {}
    for key in values:
        match = _ICI_RE.fullmatch(key)
        if match is None:
            continue
        axis = MESH_AXES.get(match.group(1))
        size = maxtext_int(config, key)
        if axis == "fsdp_transpose" and size not in (1, -1):
            raise ScenarioError(f"{given[key]}: the plan searches fsdp (fsdp_transpose runs as "
                                "FSDP over fsdp x fsdp_transpose: give ici_fsdp_parallelism "
                                "their product)")
        if axis is None:
            raise ScenarioError(f"{given[key]}: the mesh has no {match.group(1)} axis; MaxText's "
                                f"axes the emulator runs: {', '.join(MESH_AXES)}")
        if size == 0 or size < -1:
            raise ScenarioError(f"{given[key]}: a mesh axis has a whole number of devices >= 1, "
                                "or -1 (the plan searches it)")
        if size != -1 and axis != "fsdp_transpose":
            mesh[axis] = size
    slices = None
    if any(_DCN_RE.fullmatch(k) or k in ("num_slices", "compile_topology_num_slices")
           for k in values):
        # MaxText's base: dcn_data_parallelism -1, data takes the slices the others leave
        slices, dcn = dcn_mesh(dataclasses.replace(
            config, values={"dcn_data_parallelism": -1, **values}))
        across = [a for a in dcn if a != "data"]
        if across:
            raise ScenarioError(f"dcn_{across[0]}_parallelism: the plan puts the data axis "
                                "across slices (MaxText's default, --num-slices); "
                                f"{across[0]} across slices: tpu-pod import-maxtext and sweep")
    batch = None
    if "per_device_batch_size" in values:
        number = float(values["per_device_batch_size"])
        if number < 1 or number != int(number):
            raise ScenarioError(f"{given['per_device_batch_size']}: the plan tries whole "
                                "sequences per device; give 1 or more (or --global-batch)")
        batch = int(number)
    capacity = None
    if "capacity_factor" in values:
        capacity = max(0.0, float(values["capacity_factor"]))  # MaxText's -1: dropless
    return SearchKeys(
        mesh=mesh, num_slices=slices, per_device_batch=batch,
        remat=str(values["remat_policy"]) if "remat_policy" in values else None,
        slice_name=str(values["compile_topology"]) if values.get("compile_topology") else None,
        capacity_factor=capacity,
        seq_len=(maxtext_int(config, "max_target_length") if "max_target_length" in values
                 else None),
        given=given)


def _is_maxtext(model: str) -> bool:
    """Whether MODEL is a MaxText config file (its keys are MaxText's, not a scenario's)."""
    path = Path(model)
    if not path.is_file():
        return False
    try:  # bounded: a file past a scenario's size is refused by the scenario's own reader
        data = load_yaml(read_text(path, MAX_SCENARIO_BYTES, "scenario files"), source=model)
    except (OSError, ValueError):  # ScenarioError is a ValueError
        return False
    return isinstance(data, dict) and bool(MAXTEXT_KEYS & set(data)) and "pod" not in data


def _check_searched(overrides: Any) -> None:
    for item in as_overrides(overrides):
        for key, option in _SEARCHED:
            if item.key == key or item.key.startswith(key if key.endswith("_") else key + "."):
                raise ScenarioError(f"{item.text}: the plan searches {item.key}; use {option}")


def _maxtext(base: str, files: Sequence[str], overrides: Any, slice_name: str,
             seq_len: int | None) -> ModelSource:
    """MaxText configs through ``import-maxtext``'s mapping (its errors refused)."""
    from pod.commands.import_maxtext import import_maxtext

    keys = [o.text for o in as_overrides(overrides)]
    result = import_maxtext([base, *files], keys, slice_name=slice_name)
    errors = result.of("error")
    if errors:
        more = f" (and {len(errors) - 1} more: tpu-pod import-maxtext lists them)" if len(
            errors) > 1 else ""
        raise ScenarioError(f"{errors[0].text}{more}")
    data = result.scenario
    name = str(data["model"].get("preset") or data["name"]).rsplit("-v", 1)[0]
    return _finish(name, data, False, seq_len)


def _finish(name: str, data: dict[str, Any], preset: bool, seq_len: int | None) -> ModelSource:
    """The mapping as every point starts from it: timing-only, two steps, no metrics port,
    the sequence length set."""
    data = dict(data)
    data["name"] = re.sub(r"[^A-Za-z0-9_.-]", "-", f"{name}-plan")
    data["training"] = {k: v for k, v in dict(data.get("training") or {}).items()
                        if k != "epochs"} | {"steps": 2}
    data["metrics"] = {**dict(data.get("metrics") or {}), "port": 0}
    data["sweep"] = {"mode": "timing", "steps": 2}
    if seq_len is not None:
        _set_sequence_length(data, seq_len)
    return ModelSource(name, data, preset)


def _set_sequence_length(data: dict[str, Any], seq_len: int) -> None:
    """Set ``data.options.sequence_length`` to ``seq_len``.

    Raises:
        ScenarioError: --seq-len for data whose examples have a fixed shape.
    """
    block = dict(data.get("data") or {})
    if block.get("name") not in ("synthetic_text", "text"):
        raise ScenarioError(f"--seq-len: the data {block.get('name')!r} has examples of a "
                            "fixed shape; --seq-len sets synthetic_text or text data's "
                            "sequence_length")
    data["data"] = {**block, "options": {**dict(block.get("options") or {}),
                                         "sequence_length": int(seq_len)}}


def devices_of(pod: Topology) -> int:
    """The JAX devices of a slice (a chip, or a TensorCore on v2 / v3)."""
    return pod.chips * devices_per_chip(pod.chip)

"""Resolve the oracle's configurations into compile specs, with the project's own loader.

No jax here: this side runs in the project's environment (and in the fast tests). A
configuration in ``configs.yaml`` names a scenario and overrides, exactly as ``tpu-pod``
takes them; :func:`resolve` loads it with ``pod.config.overrides.load_with_overrides``,
resolves the slice (``resolve_pod``) and the mesh (``build_mesh``), and builds the model's
``TransformerConfig`` (which validates the options and derives head_dim, kv_heads and
mlp_dim) *without* the HBM check of ``build_plan``: the oracle asks XLA whether it fits.

Options the project's transformer does not have yet (``weight_dtype``, T5 relative position
bias, QK norm, MaxText's ``qkv_proj_offloaded`` remat name, the ``fsdp_transpose`` axis) and
the choice of MaxText generation (``era``) are the configuration's ``oracle`` block.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from pod.config.mesh import build_mesh, device_hbm_bytes
from pod.config.overrides import load_with_overrides
from pod.config.plan import training_sections
from pod.config.slices import resolve_pod
from pod.errors import ScenarioError
from pod.workloads.transformer import TransformerConfig
from tools.xla_oracle.flags import XLA_FLAG_SETS

__all__ = ["ROOT", "CONFIGS", "RESULTS", "HLO_DIR", "HLO_CACHE", "MODEL_VERSION",
           "OracleConfigError",
           "load_configs", "resolve", "cache_key"]

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
CONFIGS = HERE / "configs.yaml"
RESULTS = HERE / "results"
HLO_DIR = HERE / "hlo"
HLO_CACHE = HERE / ".hlo-cache"   # the other configs' HLO, local and ignored by git

#: Bumped whenever the reference model or the step changes what XLA compiles; part of
#: every cache key, so results of an older reference are compiled again.
MODEL_VERSION = 1

#: Bumped when only the dense dropless MoE path (experts, ``capacity_factor`` 0) changes:
#: part of those configs' cache keys alone. 2: its products constrained to the tokens'
#: sharding, as MaxText's ``dense_matmul`` does.
DENSE_DROPLESS_VERSION = 2

#: The ``oracle`` block's keys: name -> what they set
ORACLE_KEYS = {
    "era": "MaxText generation the step follows: '2023' (base.yml at 76bd53b0f) or '2025' "
           "(tpu-recipes-v0.1.4)",
    "remat": "a MaxText remat_policy name overriding the scenario's (e.g. qkv_proj_offloaded)",
    "remat_custom": "with remat custom: tensor -> remat | device | offload",
    "weight_dtype": "parameters' dtype: float32 (default) or bfloat16",
    "relative_position_buckets": "T5 relative position bias buckets per layer (0: none)",
    "qk_norm": "a norm on each query and key head",
    "rename_axes": "scenario mesh axis -> MaxText mesh axis (e.g. {fsdp: fsdp_transpose})",
    "flash_block": "flash kernel block size along the sequence",
    "flash_fused_bwd": "splash attention's fused backward kernel",
    "param_scan_axis": "the stacked layers' axis in each parameter (MaxText's 1)",
}

#: TransformerConfig fields the reference takes (``fusion`` and the MoE loss weight are
#: cost-model or loss options with no bearing on what XLA keeps)
_MODEL_FIELDS = ("vocabulary", "sequence_length", "embed_dim", "heads", "kv_heads", "head_dim",
                 "mlp_dim", "mlp_activation", "layers", "norm", "positions", "tied_embeddings",
                 "block", "use_bias", "fused_qkv", "attention", "remat", "experts",
                 "experts_per_token", "capacity_factor")


class OracleConfigError(ValueError):
    """A configuration the oracle cannot resolve; the message names the id and field."""


def load_configs(path: Path = CONFIGS) -> dict[str, dict[str, Any]]:
    """``configs.yaml``: id -> {scenario, overrides, oracle, calibration, hlo, note,
    xla_flags}.

    Raises:
        OracleConfigError: not a mapping of ids to mappings with a ``scenario``.
    """
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict):
        raise OracleConfigError(f"{path.name}: expected a mapping of id -> configuration")
    for cid, entry in data.items():
        if not isinstance(entry, dict) or "scenario" not in entry:
            raise OracleConfigError(f"{path.name}: {cid}: needs a 'scenario' path")
        unknown = set(entry) - {"scenario", "overrides", "oracle", "calibration", "hlo", "note",
                                "xla_flags"}
        if unknown:
            raise OracleConfigError(f"{path.name}: {cid}: unknown keys {sorted(unknown)}")
        flags = entry.get("xla_flags")
        if flags is not None and flags not in XLA_FLAG_SETS:
            raise OracleConfigError(f"{path.name}: {cid}.xla_flags: {flags!r}; known: "
                                    f"{', '.join(XLA_FLAG_SETS)}")
        bad = set(entry.get("oracle") or {}) - set(ORACLE_KEYS)
        if bad:
            raise OracleConfigError(f"{path.name}: {cid}.oracle: unknown keys {sorted(bad)}; "
                                    f"known: {', '.join(ORACLE_KEYS)}")
    return data


def _topology_name(chip: str, shape: tuple[int, ...]) -> str:
    """``v5e:16x16``, ``v5p:4x4x4``: the name ``get_topology_desc`` takes."""
    return f"{chip}:{'x'.join(str(s) for s in shape)}"


def resolve(cid: str, entry: Mapping[str, Any], root: Path = ROOT) -> dict[str, Any]:
    """One configuration -> the compile spec (plain JSON data).

    Raises:
        OracleConfigError: a scenario that does not load, is not the transformer on
            synthetic text, or a bad oracle option; the message names ``cid``.
    """
    oracle = dict(entry.get("oracle") or {})
    overrides = list(entry.get("overrides") or [])
    path = root / entry["scenario"]
    try:
        scenario = load_with_overrides(path, overrides)
        model_section, training = training_sections(scenario)
    except (ScenarioError, OSError) as err:
        raise OracleConfigError(f"{cid}: {err}") from None
    if model_section.name != "transformer":
        raise OracleConfigError(f"{cid}: model.name {model_section.name!r}: the oracle models "
                                "the transformer only")
    data = scenario.data
    if data.name != "synthetic_text":
        raise OracleConfigError(f"{cid}: data.name {data.name!r}: the oracle takes the "
                                "vocabulary and sequence length of synthetic_text")
    cfg = scenario.pod
    try:
        pod = resolve_pod(slice_name=cfg.slice, chip=cfg.chip, chips=cfg.chips,
                          topology=cfg.topology, wraparound=cfg.wraparound, slices=cfg.slices)
        mesh = build_mesh(cfg.mesh, pod, cfg.dcn_mesh)
        tc = TransformerConfig(vocabulary=int(data.options["vocabulary"]),
                               sequence_length=int(data.options["sequence_length"]),
                               **model_section.options)
    except (ScenarioError, ValueError, KeyError) as err:
        raise OracleConfigError(f"{cid}: {err}") from None
    rename = dict(oracle.pop("rename_axes", None) or {})
    ici = {rename.get(a, a): int(mesh.in_slice.axis_size(a)) for a in mesh.axis_names
           if mesh.in_slice.axis_size(a) > 1}
    dcn = {rename.get(a, a): int(mesh.dcn_size(a)) for a in mesh.axis_names
           if mesh.dcn_size(a) > 1}
    model: dict[str, Any] = {f: getattr(tc, f) for f in _MODEL_FIELDS}
    model["remat_custom"] = dict(tc.remat_custom or ())
    for key in ("era", "remat", "remat_custom", "weight_dtype", "relative_position_buckets",
                "qk_norm", "flash_block", "flash_fused_bwd", "param_scan_axis"):
        if key in oracle:
            model[key] = oracle[key]
    model.setdefault("era", "2025")
    devices = int(mesh.size)
    opt = training.optimizer.options()
    spec = {
        "id": cid,
        "scenario": entry["scenario"],
        "overrides": overrides,
        "oracle": entry.get("oracle") or {},
        "calibration": entry.get("calibration"),
        "note": entry.get("note"),
        "slice": pod.slice_name,
        "slices": int(pod.slices),
        "chip": pod.chip.name,
        "topology": {"name": _topology_name(pod.chip.name, pod.torus.shape),
                     "shape": list(pod.torus.shape),
                     "wraparound": [bool(w) for w in pod.torus.wraparound],
                     "slices": int(pod.slices)},
        "mesh": {"ici": ici, "dcn": dcn},
        "devices": devices,
        "global_batch": int(training.global_batch),
        "per_device_batch": training.global_batch / devices,
        "sequence_length": int(tc.sequence_length),
        "model": model,
        "moe_aux_loss_weight": float(tc.moe_aux_loss_weight),
        "optimizer": {"name": training.optimizer.name,
                      "learning_rate": float(opt.get("learning_rate", 3e-5)),
                      "beta1": float(opt.get("beta1", 0.9)),
                      "beta2": float(opt.get("beta2", 0.95)),
                      "eps": float(opt.get("eps", 1e-8)),
                      "weight_decay": float(opt.get("weight_decay", 0.1))},
        "hbm_bytes_per_device": int(device_hbm_bytes(pod.chip)),
    }
    if entry.get("xla_flags"):
        # the named flag set and its LIBTPU_INIT_ARGS (tools/xla_oracle/flags.py)
        spec["xla_flags"] = {"name": entry["xla_flags"],
                             "libtpu_args": XLA_FLAG_SETS[entry["xla_flags"]]}
    if training.optimizer.name != "adamw":
        raise OracleConfigError(f"{cid}: training.optimizer {training.optimizer.name!r}: the "
                                "oracle compiles MaxText's AdamW step")
    return spec


def cache_key(spec: Mapping[str, Any], versions: Mapping[str, str]) -> str:
    """sha256 of what decides the compiled program: the spec's model, mesh, slice, batch and
    optimizer, its XLA flags if it names any, the library versions and ``MODEL_VERSION`` (not
    the id, note or paths)."""
    keep = {k: spec[k] for k in ("topology", "chip", "mesh", "global_batch", "model",
                                 "moe_aux_loss_weight", "optimizer")}
    if spec.get("xla_flags"):
        keep["libtpu_args"] = spec["xla_flags"]["libtpu_args"]
    model = spec["model"]
    blob = {"spec": keep, "versions": dict(sorted(versions.items())),
            "model_version": MODEL_VERSION}
    if model.get("experts") and not model.get("capacity_factor"):
        blob["dense_dropless_version"] = DENSE_DROPLESS_VERSION
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:16]

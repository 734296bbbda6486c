"""MaxText's own training step as the oracle: ``train_compile`` for a row, deviceless.

    python -m tools.xla_oracle.maxtext_step --only T2          # compile, write hlo-maxtext/
    python -m tools.xla_oracle.maxtext_step --only T2 --args   # print the arguments only
    python -m tools.xla_oracle.maxtext_step --only T5 --host-offload-flags

The oracle (``python -m tools.xla_oracle``) compiles a JAX *reference* of the project's
transformer written the way MaxText writes it. This tool compiles MaxText's own step
instead: the ``maxtext`` package (:data:`MAXTEXT_VERSION`, Python >= 3.12, in its own
environment ``.venv-maxtext``: ``make maxtext-venv``) and its
``maxtext.trainers.pre_train.train_compile`` (``compile_topology``,
``compile_topology_num_slices``), with arguments written from the oracle's own row spec
(``tools/xla_oracle/configs.yaml`` resolved by :func:`tools.xla_oracle.spec.resolve`: slice,
mesh, per-device batch, sequence length, model dimensions, remat, attention) and the row's
``LIBTPU_INIT_ARGS`` (``tools/xla_oracle/flags.py``).

Two processes, as the oracle: this one (the project's environment) resolves the row and
writes MaxText's arguments (:func:`maxtext_args`, no jax); a child in ``.venv-maxtext``
(``--child``, which imports no ``pod``) runs ``train_compile.main`` unchanged, keeping the
compiled step it builds (``jit_and_compile`` is wrapped to keep its result) and the mesh
(``get_topology_mesh``), and writes

- ``hlo-maxtext/<row>.hlo.txt.gz``: the optimized (scheduled, partitioned) HLO text;
- ``hlo-maxtext/<row>.json``: ``memory_analysis()`` in bytes, the arguments, the flags,
  the versions, the compile time and the physical device of each of the module's device
  ids (``device_order``, for ``pod.jax.cost_hlo``'s ``devices``).

Everything XLA is asked here is about a TPU that is not attached: figures are XLA's, not
measured.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["MAXTEXT_VERSION", "MAXTEXT_MESH_AXES", "OUT_DIR", "VENV_PYTHON",
           "REFUSED_FLAGS", "MaxTextArgsError", "maxtext_args", "libtpu_args", "portable_paths",
           "main"]

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
OUT_DIR = HERE / "hlo-maxtext"
VENV_PYTHON = ROOT / ".venv-maxtext" / "bin" / "python"

#: The MaxText release compiled (the package index's ``maxtext``; its ``tpu`` extra asks
#: for jax >= 0.11.1 and libtpu >= 0.0.46).
MAXTEXT_VERSION = "0.2.5"

#: ``mesh_axes`` of maxtext 0.2.5's ``configs/base.yml``, in its order: each has an
#: ``ici_<axis>_parallelism`` and a ``dcn_<axis>_parallelism`` option.
MAXTEXT_MESH_AXES = ("diloco", "data", "stage", "fsdp", "fsdp_transpose", "context",
                     "context_usp_ulysses", "context_autoregressive", "tensor",
                     "tensor_sequence", "expert", "autoregressive")

#: a mesh axis whose ``*_parallelism`` option has another name
_OPTION_STEM = {"stage": "pipeline"}

#: the project's ``mlp_activation`` -> MaxText's ``mlp_activations`` (a gated MLP is the
#: activation times a ``linear`` branch)
_ACTIVATIONS = {"relu": ["relu"], "gelu": ["gelu"], "silu": ["silu"],
                "gated_silu": ["silu", "linear"], "gated_gelu": ["gelu", "linear"],
                "gated_relu": ["relu", "linear"]}

#: the project's ``attention`` -> MaxText's ``attention``
_ATTENTION = {"flash": "flash", "dot": "dot_product", "dot_product": "dot_product"}

#: the oracle's ``flash_block`` sets every splash-attention block size of MaxText
_SPLASH_BLOCKS = ("sa_block_q", "sa_block_kv", "sa_block_kv_compute", "sa_block_q_dkv",
                  "sa_block_kv_dkv", "sa_block_kv_dkv_compute", "sa_block_q_dq",
                  "sa_block_kv_dq")


class MaxTextArgsError(ValueError):
    """A row MaxText 0.2.5 cannot express; the message names the row, the field and the
    value."""


def _yaml_list(items: list[str]) -> str:
    return "[" + ",".join(f"'{i}'" for i in items) + "]"


def _decoder_block(cid: str, model: Mapping[str, Any]) -> str:
    """MaxText's ``decoder_block`` for the row's block: ``default`` is 0.2.5's
    ``NNXDecoderLayer``, the parallel block of MaxText 2023 (attention and MLP read one
    RMS-normed input, both added to the residual); ``llama2`` the sequential pre-norm block
    (RMSNorm, rotary, no bias)."""
    if model["block"] == "parallel":
        return "default"
    if model["block"] == "sequential" and model["norm"] == "rmsnorm":
        return "llama2"
    raise MaxTextArgsError(f"{cid}: model.block {model['block']!r} with norm "
                           f"{model['norm']!r}: MaxText {MAXTEXT_VERSION} has the parallel "
                           "block (default) and the RMSNorm sequential block (llama2)")


def _unsupported(cid: str, model: Mapping[str, Any]) -> None:
    """Refuse options of the row that maxtext 0.2.5's default / llama2 blocks cannot say."""
    checks = [
        ("relative_position_buckets", bool(model.get("relative_position_buckets")),
         "T5 relative position bias is not in MaxText 0.2.5's default or llama2 block"),
        ("qk_norm", bool(model.get("qk_norm")),
         "QK norm is not in MaxText 0.2.5's default or llama2 block"),
        ("use_bias", bool(model.get("use_bias")), "the default and llama2 blocks have no bias"),
        ("positions", model.get("positions") != "rotary",
         "the default and llama2 blocks use rotary positions"),
        ("experts", int(model.get("experts") or 0) > 0,
         "mixtures of experts are not mapped by this tool yet"),
    ]
    for field, bad, why in checks:
        if bad:
            raise MaxTextArgsError(f"{cid}: model.{field} {model.get(field)!r}: {why}")


def _mesh_args(cid: str, spec: Mapping[str, Any]) -> list[str]:
    """``ici_<axis>_parallelism`` / ``dcn_<axis>_parallelism`` of the row's axes (the
    ``stage`` axis's option is ``*_pipeline_parallelism``), and ``ici_fsdp_parallelism`` /
    ``dcn_data_parallelism`` 1 where the row has none (base.yml's -1 would auto-size them)."""
    out = []
    for level, auto in (("ici", "fsdp"), ("dcn", "data")):
        sizes = {axis: int(n) for axis, n in dict(spec["mesh"][level]).items()}
        unknown = set(sizes) - set(MAXTEXT_MESH_AXES)
        if unknown:
            raise MaxTextArgsError(f"{cid}: mesh.{level} axes {sorted(unknown)}: MaxText "
                                   f"{MAXTEXT_VERSION}'s mesh axes are "
                                   f"{', '.join(MAXTEXT_MESH_AXES)}")
        sizes.setdefault(auto, 1)
        out += [f"{level}_{_OPTION_STEM.get(axis, axis)}_parallelism={n}"
                for axis, n in sorted(sizes.items(), key=lambda kv:
                                      MAXTEXT_MESH_AXES.index(kv[0]))]
    return out


def maxtext_args(spec: Mapping[str, Any], allow_split_physical_axes: bool = False) -> list[str]:
    """``train_compile``'s ``KEY=VALUE`` arguments (after ``base.yml``) for a resolved row.

    Args:
        spec: ``tools.xla_oracle.spec.resolve``'s compile spec of the row.
        allow_split_physical_axes: MaxText's option of that name (the oracle's own mesh of
            the row needed it when ``create_device_mesh`` could not lay the mesh whole).

    Returns:
        ``["compile_topology=v5p-1024", ..., "remat_policy=full", ...]``: the slice and slice
        count, every mesh axis's ICI / DCN size, the per-device batch and sequence length,
        the model's dimensions (``global_parameter_scale`` 1 and the ``base_*`` dimensions
        the row resolved to), its activation, block, tied embedding, attention, remat (with
        each tensor of a ``custom`` policy), splash blocks, weight dtype, AdamW's settings.

    Raises:
        MaxTextArgsError: an option MaxText 0.2.5 cannot express (T5 relative position
            bias, QK norm, biases, learned positions, mixtures of experts, a mesh axis it
            has not), named with the row.
    """
    cid = spec["id"]
    model = spec["model"]
    _unsupported(cid, model)
    activation = _ACTIVATIONS.get(model["mlp_activation"])
    if activation is None:
        raise MaxTextArgsError(f"{cid}: model.mlp_activation {model['mlp_activation']!r}; "
                               f"mapped: {', '.join(_ACTIVATIONS)}")
    attention = _ATTENTION.get(model["attention"])
    if attention is None:
        raise MaxTextArgsError(f"{cid}: model.attention {model['attention']!r}; mapped: "
                               f"{', '.join(_ATTENTION)}")
    opt = spec["optimizer"]
    per_device = float(spec["per_device_batch"])
    args = [
        f"run_name=xla-oracle-{cid}",
        f"compile_topology={spec['slice']}",
        f"compile_topology_num_slices={int(spec['slices'])}",
        *_mesh_args(cid, spec),
        f"per_device_batch_size={per_device:g}",
        f"max_target_length={int(spec['sequence_length'])}",
        f"vocab_size={int(model['vocabulary'])}",
        "global_parameter_scale=1",
        f"base_emb_dim={int(model['embed_dim'])}",
        f"base_num_query_heads={int(model['heads'])}",
        f"base_num_kv_heads={int(model['kv_heads'])}",
        f"head_dim={int(model['head_dim'])}",
        f"base_mlp_dim={int(model['mlp_dim'])}",
        f"base_num_decoder_layers={int(model['layers'])}",
        f"decoder_block={_decoder_block(cid, model)}",
        f"mlp_activations={_yaml_list(activation)}",
        f"logits_via_embedding={str(bool(model['tied_embeddings'])).lower()}",
        f"fused_qkv={str(bool(model.get('fused_qkv'))).lower()}",
        f"attention={attention}",
        "dtype=bfloat16",
        f"weight_dtype={model.get('weight_dtype', 'float32')}",
        "scan_layers=true",
        f"param_scan_axis={int(model.get('param_scan_axis', 1))}",
        "opt_type=adamw",
        f"learning_rate={opt['learning_rate']:g}",
        f"adam_b1={opt['beta1']:g}",
        f"adam_b2={opt['beta2']:g}",
        f"adam_eps={opt['eps']:g}",
        f"adam_weight_decay={opt['weight_decay']:g}",
        "gradient_clipping_threshold=1.0",
        "dataset_type=synthetic",
        "enable_checkpointing=false",
        f"allow_split_physical_axes={str(bool(allow_split_physical_axes)).lower()}",
    ]
    remat = str(model["remat"])
    args.append(f"remat_policy={remat}")
    if remat == "custom":
        args += [f"{tensor}={where}" for tensor, where
                 in sorted(dict(model.get("remat_custom") or {}).items())]
    if model.get("flash_block"):
        args += [f"{name}={int(model['flash_block'])}" for name in _SPLASH_BLOCKS]
    if "flash_fused_bwd" in model:
        args.append(f"sa_use_fused_bwd_kernel={str(bool(model['flash_fused_bwd'])).lower()}")
    return args


#: flags libtpu 0.0.50 refuses outside a v5e (FAILED_PRECONDITION: "Continuation fusion for
#: AllGather ... not supported/recommended on platforms other than TPU v5e"), which 0.0.42.1
#: (the oracle's) accepted: chip -> flags dropped from the row's set
REFUSED_FLAGS = {chip: ("--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true",)
                 for chip in ("v4", "v5p", "v6e")}


def libtpu_args(spec: Mapping[str, Any], host_offload: bool = False) -> tuple[str, list[str]]:
    """The row's ``LIBTPU_INIT_ARGS`` and the flags dropped from it.

    The row's named flag set (``xla_flags`` of configs.yaml), empty for XLA's defaults; with
    ``host_offload`` MaxText's 2023 flags and the host-offload scheduler flags
    (``tools.xla_oracle.flags``) whatever the row names. Flags this libtpu refuses on the
    row's chip (:data:`REFUSED_FLAGS`) are dropped and returned as the second item.
    """
    from tools.xla_oracle.flags import MAXTEXT_2023_LIBTPU_ARGS, MAXTEXT_HOST_OFFLOAD_LIBTPU_ARGS

    if host_offload:
        flags = MAXTEXT_2023_LIBTPU_ARGS + MAXTEXT_HOST_OFFLOAD_LIBTPU_ARGS
    else:
        flags = str((spec.get("xla_flags") or {}).get("libtpu_args", ""))
    refused = REFUSED_FLAGS.get(str(spec["chip"]), ())
    kept = [f for f in flags.split() if f not in refused]
    return " ".join(kept), [f for f in flags.split() if f in refused]


# ---- the child: .venv-maxtext, imports maxtext and jax, never pod --------------------------

def _child(out_dir: Path, request: Mapping[str, Any]) -> int:
    """Run ``train_compile.main`` on ``request["args"]`` and write ``out_dir/module.hlo.txt``
    and ``out_dir/outcome.json``."""
    for key, value in (("JAX_PLATFORMS", "cpu"), ("TPU_SKIP_MDS_QUERY", "1"),
                       ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")):
        os.environ.setdefault(key, value)
    import numpy as np
    from maxtext.trainers.pre_train import train_compile

    kept: dict[str, Any] = {}
    jit_and_compile = train_compile.jit_and_compile
    get_topology_mesh = train_compile.get_topology_mesh

    def keep_compiled(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        compiled = jit_and_compile(*args, **kwargs)
        kept["compile_seconds"] = round(time.perf_counter() - start, 1)
        kept["compiled"] = compiled
        return compiled

    def keep_mesh(config: Any) -> Any:
        mesh = get_topology_mesh(config)
        kept["mesh"] = mesh
        return mesh

    train_compile.jit_and_compile = keep_compiled
    train_compile.get_topology_mesh = keep_mesh
    base = Path(train_compile.__file__).resolve().parents[2] / "configs" / "base.yml"
    outcome: dict[str, Any] = {"args": list(request["args"])}
    try:
        train_compile.main(["train_compile", str(base), *request["args"]])
    except Exception as err:  # XLA's verdict (RESOURCE_EXHAUSTED) or MaxText's refusal
        outcome.update(ok=False, error=f"{type(err).__name__}: {err}"[:4000])
    compiled = kept.get("compiled")
    if compiled is not None:
        stats = compiled.memory_analysis()
        outcome["memory"] = {
            name.removesuffix("_size_in_bytes").removesuffix("_in_bytes") + "_bytes":
            int(getattr(stats, name)) for name in sorted(dir(stats))
            if name.endswith("_in_bytes") and isinstance(getattr(stats, name), int)}
        (out_dir / "module.hlo.txt").write_text(compiled.as_text())
        outcome.setdefault("ok", True)
        outcome["compile_seconds"] = kept["compile_seconds"]
    mesh = kept.get("mesh")
    if mesh is not None:
        shape = tuple(request["topology_shape"])
        outcome["mesh_axes"] = {str(k): int(v) for k, v in mesh.shape.items()}
        if int(request["slices"]) == 1:
            outcome["device_order"] = [
                int(np.ravel_multi_index(tuple(d.coords)[:len(shape)], shape))
                for d in mesh.devices.flat]
    import jax

    outcome["versions"] = {"maxtext": _version("maxtext"), "jax": jax.__version__,
                           "jaxlib": _version("jaxlib"), "libtpu": _version("libtpu"),
                           "python": sys.version.split()[0]}
    (out_dir / "outcome.json").write_text(json.dumps(outcome, indent=1))
    return 0


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "missing"


# ---- the parent: the project's environment ------------------------------------------------

def _missing(python: Path) -> str | None:
    """One line when the MaxText environment, maxtext or libtpu is missing, else None."""
    if not python.exists():
        return (f"maxtext_step: no MaxText environment at {python}; make it with `make "
                f"maxtext-venv` (Python >= 3.12, maxtext=={MAXTEXT_VERSION} and jax[tpu])")
    probe = subprocess.run([str(python), "-c", "import importlib.util as u; print(' '.join("
                            "m for m in ('maxtext', 'libtpu', 'jax') if u.find_spec(m) is None))"],
                           capture_output=True, text=True)
    missing = probe.stdout.strip()
    if probe.returncode != 0 or missing:
        return (f"maxtext_step: {missing or 'python'} not installed in {python}; run `make "
                "maxtext-venv`")
    return None


def portable_paths(hlo_text: str, root: Path) -> str:
    """The module's ``FileNames`` table without this machine's paths: a package's file from
    its ``site-packages/`` on (``maxtext/layers/linears.py``), a file of the repository
    relative to ``root`` (``tools/xla_oracle/maxtext_step.py``). Only quoted file names
    change; the HLO's ops and stack frame ids are untouched."""
    text = re.sub(r'"[^"\n]*/site-packages/([^"\n]*)"', r'"\1"', hlo_text)
    return text.replace(f'"{root}/', '"')


def _oracle_split_axes(cid: str) -> bool:
    """Whether the oracle's own compile of the row needed ``allow_split_physical_axes``."""
    from tools.xla_oracle.spec import RESULTS

    path = RESULTS / f"{cid}.json"
    if not path.exists():
        return False
    layout = json.loads(path.read_text()).get("mesh", {}).get("layout", {})
    return bool(layout.get("allow_split_physical_axes"))


def compile_row(cid: str, python: Path, out_dir: Path, host_offload: bool) -> dict[str, Any]:
    """Resolve row ``cid``, compile MaxText's step for it in ``python``'s environment and
    write ``out_dir/<cid>.hlo.txt.gz`` and ``out_dir/<cid>.json``; returns the record."""
    import tempfile

    from tools.xla_oracle.spec import load_configs, resolve

    spec = resolve(cid, load_configs()[cid])
    args = maxtext_args(spec, _oracle_split_axes(cid))
    flags, dropped = libtpu_args(spec, host_offload)
    request = {"args": args, "topology_shape": spec["topology"]["shape"],
               "slices": spec["slices"]}
    with tempfile.TemporaryDirectory(prefix="maxtext-step-") as tmp:
        env = {**os.environ, "LIBTPU_INIT_ARGS": flags}
        log = Path(tmp) / "log.txt"
        start = time.monotonic()
        with log.open("w") as err:
            proc = subprocess.run([str(python), "-m", "tools.xla_oracle.maxtext_step",
                                   "--child", tmp], cwd=ROOT, input=json.dumps(request),
                                  text=True, stdout=err, stderr=err, env=env)
        outcome_path = Path(tmp) / "outcome.json"
        if not outcome_path.exists():
            tail = log.read_text()[-3000:]
            raise RuntimeError(f"{cid}: the MaxText compile exited with {proc.returncode}: "
                               f"{tail}")
        outcome = json.loads(outcome_path.read_text())
        hlo = Path(tmp) / "module.hlo.txt"
        out_dir.mkdir(parents=True, exist_ok=True)
        if hlo.exists():
            text = portable_paths(hlo.read_text(), ROOT)
            (out_dir / f"{cid}.hlo.txt.gz").write_bytes(gzip.compress(text.encode(), mtime=0))
    memory = outcome.get("memory") or {}
    record = {
        "id": cid, "tool": "tools.xla_oracle.maxtext_step",
        "scenario": spec["scenario"], "calibration": spec.get("calibration"),
        "slice": spec["slice"], "slices": spec["slices"], "chip": spec["chip"],
        "topology": spec["topology"], "devices": spec["devices"],
        "mesh": {"ici": spec["mesh"]["ici"], "dcn": spec["mesh"]["dcn"]},
        "mesh_axes": outcome.get("mesh_axes"), "device_order": outcome.get("device_order"),
        "model": {"era": spec["model"]["era"]},
        "libtpu_args": flags, "dropped_flags": dropped, "host_offload_flags": host_offload,
        "maxtext_args": args, "ok": bool(outcome.get("ok")), "error": outcome.get("error"),
        "memory": memory, "peak_bytes_per_device": memory.get("peak_memory_bytes"),
        "compile_seconds": outcome.get("compile_seconds"),
        "wall_seconds": round(time.monotonic() - start, 1),
        "versions": outcome.get("versions"),
    }
    (out_dir / f"{cid}.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring); exit 2 on a bad row or a missing MaxText."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="rows of configs.yaml, comma-separated (e.g. T2,T5)")
    parser.add_argument("--args", action="store_true", help="print train_compile's arguments")
    parser.add_argument("--host-offload-flags", action="store_true",
                        help="compile with MaxText's 2023 and the host-offload scheduler "
                             "flags (tools/xla_oracle/flags.py) instead of the row's")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="default: hlo-maxtext/ (hlo-maxtext/host-offload-flags/ with "
                             "--host-offload-flags)")
    parser.add_argument("--python", type=Path, default=VENV_PYTHON,
                        help="the MaxText environment's interpreter")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return _child(args.child, json.loads(sys.stdin.read()))
    if not args.only:
        print("maxtext_step: --only: name the rows (e.g. --only T2)", file=sys.stderr)
        return 2
    from tools.xla_oracle.spec import OracleConfigError, load_configs, resolve

    configs = load_configs()
    rows = [r for r in args.only.split(",") if r]
    unknown = [r for r in rows if r not in configs]
    if unknown:
        print(f"maxtext_step: --only {','.join(unknown)}: not in configs.yaml", file=sys.stderr)
        return 2
    try:
        if args.args:
            for cid in rows:
                print(cid, " ".join(maxtext_args(resolve(cid, configs[cid]),
                                                 _oracle_split_axes(cid))))
            return 0
    except (MaxTextArgsError, OracleConfigError) as err:
        print(f"maxtext_step: {err}", file=sys.stderr)
        return 2
    missing = _missing(args.python)
    if missing:
        print(missing, file=sys.stderr)
        return 2
    out_dir = args.out_dir or (OUT_DIR / "host-offload-flags" if args.host_offload_flags
                               else OUT_DIR)
    for cid in rows:
        print(f"{cid}: compiling MaxText {MAXTEXT_VERSION}'s train step ...", flush=True)
        try:
            rec = compile_row(cid, args.python, out_dir, args.host_offload_flags)
        except (MaxTextArgsError, OracleConfigError) as err:
            print(f"maxtext_step: {err}", file=sys.stderr)
            return 2
        peak = rec["peak_bytes_per_device"]
        status = (f"peak {peak / 2**30:.2f} GiB" if peak else "") if rec["ok"] \
            else f"failed: {(rec['error'] or '')[:300]}"
        print(f"{cid}: {status}; compile {rec['compile_seconds']} s, wall "
              f"{rec['wall_seconds']} s", flush=True)
    return 0


if __name__ == "__main__":
    if importlib.util.find_spec("tools") is None:
        sys.path.insert(0, str(ROOT))
    raise SystemExit(main())

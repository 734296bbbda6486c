"""MaxText's training step on a deviceless TPU topology: build, lower, compile.

``compile_spec(spec)`` takes a resolved spec (``tools.xla_oracle.spec.resolve``), makes the
TPU topology with ``jax.experimental.topologies.get_topology_desc`` (as MaxText's
``train_compile.py`` does), lays MaxText's mesh on it with ``mesh_utils``
(``create_device_mesh``, or ``create_hybrid_device_mesh`` for several slices, as MaxText's
``max_utils.create_device_mesh``), and compiles ``train_step(state, batch) -> (state,
metrics)`` with the state donated (``donate_argnums=0``), parameters and AdamW moments
sharded by the logical axis rules, the batch by ``data_sharding``.

The state is ``{"step", "params", "opt_state"}``; the optimizer is optax's AdamW (MaxText's
``opt_type: adamw``: ``optax.adamw(schedule, b1, b2, eps, eps_root, weight_decay)``) after
``clip_by_global_norm(1.0)`` (``gradient_clipping_threshold``); the moments in the weight
dtype (``mu_dtype`` inherits it).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

for _key, _value in (("JAX_PLATFORMS", "cpu"), ("TPU_SKIP_MDS_QUERY", "1"),
                     # libtpu takes a machine-wide lock file; compiling needs no chip, so
                     # several processes (other users' compiles) may load it at once
                     ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")):
    os.environ.setdefault(_key, _value)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import mesh_utils, topologies  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from tools.xla_oracle.model import ModelOptions, OracleModel, loss_fn  # noqa: E402
from tools.xla_oracle.record import versions  # noqa: E402,F401 (re-exported)
from tools.xla_oracle.sharding import DATA_SHARDING, MESH_AXES, mesh_shape  # noqa: E402

__all__ = ["build_mesh", "compile_spec", "CompileOutcome", "versions"]

#: MaxText's ``accelerator_to_spec_map``: one device per chip (megacore) on v4 and v5p
_CHIP_CONFIG = {"v4": "megacore", "v5p": "megacore", "v5e": "default", "v6e": "default"}


def build_mesh(spec: Mapping[str, Any]) -> tuple[Mesh, dict[str, Any]]:
    """The TPU topology of ``spec["topology"]`` and MaxText's mesh on it.

    Returns:
        (mesh, notes): notes say how the devices were laid out.
    """
    topo = spec["topology"]
    wrap = tuple(topo["wraparound"]) + (False,) * (3 - len(topo["wraparound"]))
    desc = topologies.get_topology_desc(
        topology_name=topo["name"], platform="tpu",
        chip_config_name=_CHIP_CONFIG[spec["chip"]], chips_per_host_bounds=(2, 2, 1),
        num_slices=int(topo["slices"]), wrap=wrap)
    devices = desc.devices
    era = spec["model"]["era"]
    ici, dcn = mesh_shape(era, spec["mesh"]["ici"], spec["mesh"]["dcn"])
    notes: dict[str, Any] = {"devices": len(devices), "device_kind": devices[0].device_kind}
    if int(topo["slices"]) > 1:
        try:
            grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices)
        except (NotImplementedError, ValueError):
            grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices,
                                                        allow_split_physical_axes=True)
            notes["allow_split_physical_axes"] = True
    else:
        try:
            grid = mesh_utils.create_device_mesh(ici, devices)
        except (NotImplementedError, ValueError):
            grid = mesh_utils.create_device_mesh(ici, devices, allow_split_physical_axes=True)
            notes["allow_split_physical_axes"] = True
    return Mesh(grid, MESH_AXES[era]), notes


def _batch_specs(model: OracleModel, spec: Mapping[str, Any]) -> dict[str, jax.ShapeDtypeStruct]:
    """MaxText's input batch: int32 (global batch, T) arrays, sharded by data_sharding."""
    era = spec["model"]["era"]
    names = DATA_SHARDING[era]
    if names is None:
        axes = tuple(a for a in MESH_AXES[era] if model.sizes[a] > 1)
        pspec = P(axes or None, None)
    else:
        pspec = model.spec(names)
    sharding = NamedSharding(model.mesh, pspec)
    shape = (int(spec["global_batch"]), int(spec["model"]["sequence_length"]))
    return {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)
            for k in ("inputs", "inputs_position", "inputs_segmentation", "targets",
                      "targets_position", "targets_segmentation")}


def _optimizer(spec: Mapping[str, Any]) -> optax.GradientTransformation:
    opt = spec["optimizer"]
    schedule = optax.warmup_cosine_decay_schedule(0.0, float(opt["learning_rate"]),
                                                  warmup_steps=100, decay_steps=10_000)
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=float(opt["beta1"]), b2=float(opt["beta2"]),
                    eps=float(opt["eps"]), eps_root=0.0,
                    weight_decay=float(opt["weight_decay"]),
                    mu_dtype=jnp.dtype(spec["model"].get("weight_dtype", "float32"))))


def _state_shardings(model: OracleModel, tx, params_abstract):
    """The abstract train state and its shardings: the moments shard as the params (optax's
    state mirrors the param tree), scalars replicated."""
    state_shape = jax.eval_shape(tx.init, params_abstract)
    param_shard = model.param_shardings()
    replicated = NamedSharding(model.mesh, P())

    def shard_like(path, leaf):
        key = path[-1].key if path and hasattr(path[-1], "key") else None
        if key in param_shard and tuple(leaf.shape) == tuple(params_abstract[key].shape):
            return param_shard[key]
        return replicated

    opt_shard = jax.tree_util.tree_map_with_path(shard_like, state_shape)
    state = {"step": jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated),
             "params": params_abstract,
             "opt_state": jax.tree.map(
                 lambda leaf, s: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=s),
                 state_shape, opt_shard)}
    shardings = jax.tree.map(lambda leaf: leaf.sharding, state)
    return state, shardings


class CompileOutcome(dict):
    """What a compile produced: ``ok``, ``error``, ``memory``, ``hlo_text``, timings."""


def compile_spec(spec: Mapping[str, Any]) -> CompileOutcome:
    """Lower and compile MaxText's train step for ``spec`` on its deviceless topology.

    Returns:
        A ``CompileOutcome``: ``ok`` False with ``error`` (the compiler's message, e.g.
        RESOURCE_EXHAUSTED) when XLA refuses it; else ``memory`` (``memory_analysis()``
        fields in bytes) and ``hlo_text`` (the scheduled, partitioned module).
    """
    t0 = time.perf_counter()
    mesh, notes = build_mesh(spec)
    model = OracleModel(ModelOptions.from_dict(spec["model"]), mesh)
    tx = _optimizer(spec)
    params = model.abstract_params()
    state, state_shardings = _state_shardings(model, tx, params)
    batch = _batch_specs(model, spec)
    moe_weight = float(spec.get("moe_aux_loss_weight", 0.01))

    def train_step(state, batch):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(model, p, batch, moe_weight))(
            state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        new_params = optax.apply_updates(state["params"], updates)
        metrics = {"loss": loss, "grad_norm": optax.global_norm(grads),
                   "param_norm": optax.global_norm(new_params)}
        return {"step": state["step"] + 1, "params": new_params, "opt_state": opt_state}, metrics

    replicated = NamedSharding(mesh, P())
    jitted = jax.jit(train_step,
                     in_shardings=(state_shardings, jax.tree.map(lambda b: b.sharding, batch)),
                     out_shardings=(state_shardings, replicated),
                     donate_argnums=0)
    out = CompileOutcome(notes=notes)
    try:
        lowered = jitted.lower(state, batch)
    except Exception as err:  # a model the reference cannot trace: the caller reports it
        out.update(ok=False, stage="lower", error=f"{type(err).__name__}: {err}"[:4000])
        return out
    out["lower_seconds"] = round(time.perf_counter() - t0, 1)
    t1 = time.perf_counter()
    try:
        compiled = lowered.compile()
    except Exception as err:  # XLA's verdict, e.g. RESOURCE_EXHAUSTED
        out.update(ok=False, stage="compile", error=f"{type(err).__name__}: {err}"[:4000],
                   compile_seconds=round(time.perf_counter() - t1, 1))
        return out
    out["compile_seconds"] = round(time.perf_counter() - t1, 1)
    stats = compiled.memory_analysis()
    # every byte count the jaxlib reports (argument, output, alias, temp, generated code,
    # their host_* twins, and peak_memory in newer jaxlibs), named *_bytes
    out["memory"] = {name.removesuffix("_size_in_bytes").removesuffix("_in_bytes") + "_bytes":
                     int(getattr(stats, name))
                     for name in sorted(dir(stats))
                     if name.endswith("_in_bytes") and isinstance(getattr(stats, name), int)}
    out["hlo_text"] = compiled.as_text()
    out["param_count"] = int(sum(np.prod(s) for s, _ in model.param_defs().values()))
    out.update(ok=True)
    return out

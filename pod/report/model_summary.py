"""A Keras-like model summary with the simulated cost of every layer.

Keras prints layer, output shape and parameters; this adds, per layer, the
FLOPs and the simulated time of one training step (forward + backward) on
one TensorCore of the chosen chip, measured by running one step of the
real layers on a ``chip.TensorCore`` (numerics off: the costs are the same)
and adding up the op records of each layer.
"""

from __future__ import annotations

import numpy as np
from rich.table import Table

from pod.report.console import titled_table

from chip import TensorCore, TensorCoreSpec
from pod.workloads.models import Model
from pod.workloads.optimizers import OPTIMIZER_NAMES

__all__ = ["layer_costs", "layer_rows", "LAYER_COLUMNS", "model_summary_table"]


def layer_costs(model: Model, core_spec: TensorCoreSpec, batch: int, *,
                optimizer=None, mxu_model: str = "pipelined") -> dict[str, dict[str, float]]:
    """Simulated cost per layer of one training step on one TensorCore.

    Args:
        model: the model.
        core_spec: the TensorCore that runs it.
        batch: examples per TensorCore.
        optimizer: if given, its update is costed as a row "optimizer".

    Returns:
        {layer name | "loss" | "optimizer": {"flops", "mxu_flops", "hbm_bytes",
        "seconds", "mxu_seconds", "vpu_seconds", "scalar_seconds"}} in layer
        order; seconds are simulated (per unit: the ops each unit runs, each op
        the larger of its compute and its HBM traffic, ``chip.OpRecord``).
    """
    core = TensorCore(core_spec, numerics=False, name="summary", mxu_model=mxu_model)
    integer_inputs = model.layers and model.layers[0].kind == "embedding"
    x = np.zeros((batch, *model.input_shape), np.int32 if integer_inputs else np.float32)
    label_shape = (batch,) if len(model.output_shape) == 1 else (batch, model.output_shape[0])
    y = np.zeros(label_shape, np.int64)
    params = model.init_params(0)
    _, grads, _ = model.loss_grads_and_state(core, params, x, y, state=model.init_state(),
                                             rng=np.random.default_rng(0))
    if optimizer is not None:
        optimizer.update(core, grads, optimizer.init(params), params, 1)
    names = {layer.name for layer in model.layers}
    keys = [layer.name for layer in model.layers] + ["loss"]
    keys += ["optimizer"] if optimizer is not None else []
    costs = {key: dict.fromkeys(_COST_FIELDS, 0.0) for key in keys}
    for rec in core.take_records():
        prefix = rec.name.split("/", 1)[0]
        key = prefix if prefix in names else ("optimizer" if prefix in OPTIMIZER_NAMES else "loss")
        costs[key]["flops"] += rec.flops
        costs[key]["hbm_bytes"] += rec.hbm_bytes
        costs[key]["seconds"] += rec.seconds
        costs[key][f"{rec.unit}_seconds"] += rec.seconds
        if rec.unit == "mxu":
            costs[key]["mxu_flops"] += rec.flops
    return costs


_COST_FIELDS = ("flops", "mxu_flops", "hbm_bytes", "seconds", "mxu_seconds", "vpu_seconds",
                "scalar_seconds")

#: layers.csv's columns (``layer_rows``).
LAYER_COLUMNS = ("layer", "type", "input_shape", "output_shape", "parameters", "flops",
                 "mxu_flops", "hbm_bytes", "simulated_seconds", "simulated_mxu_seconds",
                 "simulated_vpu_seconds", "simulated_scalar_seconds")


def layer_rows(model: Model, core_spec: TensorCoreSpec, batch: int, *,
               mxu_model: str = "pipelined") -> list[dict[str, object]]:
    """One row per layer (then "loss") for layers.csv: shapes, parameters, FLOPs,
    HBM bytes and simulated seconds of one training step (forward + backward) on
    one TensorCore, in total and per unit (MXU, vector unit, scalar unit).

    Args:
        model: the model.
        core_spec: the TensorCore that runs it.
        batch: examples per TensorCore; shapes have it first.

    Returns:
        Dicts with the keys of ``LAYER_COLUMNS``; FLOPs and bytes are counts for
        one step of one TensorCore, seconds simulated.
    """
    costs = layer_costs(model, core_spec, batch, mxu_model=mxu_model)
    summary = model.summary_rows(batch)
    shape_in = (batch, *model.input_shape)
    rows = []
    for layer, (name, out, nparams, _) in zip(model.layers, summary):
        rows.append(_layer_row(name, layer.kind, _shape(shape_in), _shape(out), nparams,
                               costs[name]))
        shape_in = out
    rows.append(_layer_row("loss", "loss", _shape(shape_in), "", 0, costs["loss"]))
    return rows


def _layer_row(name: str, kind: str, shape_in: str, shape_out: str, nparams: int,
               cost: dict[str, float]) -> dict[str, object]:
    return {"layer": name, "type": kind, "input_shape": shape_in, "output_shape": shape_out,
            "parameters": nparams, "flops": int(cost["flops"]), "mxu_flops": int(cost["mxu_flops"]),
            "hbm_bytes": int(cost["hbm_bytes"]), "simulated_seconds": cost["seconds"],
            "simulated_mxu_seconds": cost["mxu_seconds"],
            "simulated_vpu_seconds": cost["vpu_seconds"],
            "simulated_scalar_seconds": cost["scalar_seconds"]}


def _shape(shape) -> str:
    return "(" + ", ".join("None" if v is None else str(v) for v in shape) + ")"


def model_summary_table(model: Model, core_spec: TensorCoreSpec, batch: int, *,
                        optimizer=None, chip_name: str = "", mxu_model: str = "pipelined") -> Table:
    """The summary as a rich Table: layer (type), output shape, parameters,
    FLOPs per step and simulated time per step on one TensorCore.

    Args:
        model: the model.
        core_spec: the TensorCore of the chosen chip.
        batch: examples per TensorCore per step.
        optimizer: optional; adds the update's row.
        chip_name: shown in the title.
    """
    costs = layer_costs(model, core_spec, batch, optimizer=optimizer, mxu_model=mxu_model)
    total_seconds = sum(c["seconds"] for c in costs.values()) or 1.0
    on = f" on one {chip_name} TensorCore" if chip_name else " on one TensorCore"
    table = titled_table(f"Model: {model.name} (batch {batch} per core{on}; "
                        f"time is simulated, forward + backward)")
    for col, justify in (("layer (type)", "left"), ("output shape", "left"), ("params", "right"),
                         ("FLOPs / step", "right"), ("sim time / step", "right"), ("share", "right")):
        table.add_column(col, justify=justify)
    for (name, out, nparams, _), layer in zip(model.summary_rows(batch), model.layers):
        c = costs[name]
        table.add_row(f"{name} ({layer.kind})", _shape(out), f"{nparams:,}", f"{c['flops']:,.0f}",
                      f"{c['seconds'] * 1e6:,.2f} us", f"{c['seconds'] / total_seconds:.1%}")
    for extra in ("loss", "optimizer"):
        if extra in costs:
            c = costs[extra]
            table.add_row(extra, "", "", f"{c['flops']:,.0f}", f"{c['seconds'] * 1e6:,.2f} us",
                          f"{c['seconds'] / total_seconds:.1%}")
    n_state = sum(int(np.prod(s)) for s in model.state_shapes.values())
    state_note = f" (+ {n_state:,} non-trainable)" if n_state else ""
    table.add_row("total", "", f"{model.num_params:,}{state_note}",
                  f"{sum(c['flops'] for c in costs.values()):,.0f}",
                  f"{total_seconds * 1e6:,.2f} us", "100.0%", style="bold")
    return table

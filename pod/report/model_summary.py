"""A Keras-like model summary with the simulated cost of every layer.

Keras prints layer, output shape and parameters; this adds, per layer, the
FLOPs and the simulated time of one training step (forward + backward) on
one TensorCore of the chosen chip, measured by running one step of the
real layers on a timing-only ``chip.TensorCore`` (products skipped: the costs
depend on shapes only and equal an executing core's, tested) and adding up
the op records of each layer, with its MXU utilisation and what bounds it.
``layer_detail_table`` splits composite layers (ResNet and transformer
blocks) into their convs, norms and adds.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from rich.console import Console, ConsoleOptions, JustifyMethod, RenderResult
from rich.measure import Measurement
from rich.table import Table

from chip import TensorCore, TensorCoreSpec
from pod.programs.transformer import ParamLayout, param_layout
from pod.report.console import titled_table
from pod.report.stats import OP_BOUNDS, op_bound
from pod.workloads.layers import timing_zeros
from pod.workloads.models import Model
from pod.workloads.optimizers import OPTIMIZER_NAMES
from pod.workloads.transformer import TransformerModel

__all__ = ["BOUNDS", "LAYER_COLUMNS", "layer_costs", "layer_rows", "model_summary_table",
           "op_bound", "layer_detail_table", "plan_model_tables", "plan_sharding_table",
           "sharding_groups", "sharding_table", "FitWidth"]

BOUNDS = OP_BOUNDS


def _empty() -> dict[str, float]:
    return {"flops": 0.0, "mxu_flops": 0.0, "hbm_bytes": 0.0, "seconds": 0.0,
            "mxu_seconds": 0.0, "vpu_seconds": 0.0, "scalar_seconds": 0.0,
            **{f"{b}_bound_seconds": 0.0 for b in BOUNDS}}


def _records(model: Model, core_spec: TensorCoreSpec, batch: int, optimizer, mxu_model: str):
    """The op records of one training step (and the update) on a timing-only core:
    the same records an executing core makes (tested), in a fraction of the wall time."""
    core = TensorCore(core_spec, numerics=True, name="summary", mxu_model=mxu_model,
                      execute=False)
    integer_inputs = model.layers and model.layers[0].kind == "embedding"
    x = np.zeros((batch, *model.input_shape), np.int32 if integer_inputs else np.float32)
    label_shape = (batch,) if len(model.output_shape) == 1 else (batch, model.output_shape[0])
    y = np.zeros(label_shape, np.int64)
    # zero views (no memory) stand in for the parameters: the costs depend on shapes
    # only, and a 33B model's float32 parameters alone would be 130 GB
    params = {key: timing_zeros(shape, np.float32) for key, shape in model.param_shapes.items()}
    _, grads, _ = model.loss_grads_and_state(core, params, x, y, state=model.init_state(),
                                             rng=np.random.default_rng(0))
    if optimizer is not None:
        optimizer.update(core, grads, optimizer.init(params), params, 1)
    return core.take_records()


def _group(model: Model, rec, detail: bool) -> str:
    prefix = rec.name.split("/", 1)[0]
    if prefix not in {layer.name for layer in model.layers}:
        return "optimizer" if prefix in OPTIMIZER_NAMES else "loss"
    return rec.name.rsplit("/", 1)[0] if detail and "/" in rec.name else prefix


def layer_costs(model: Model, core_spec: TensorCoreSpec, batch: int, *,
                optimizer=None, mxu_model: str = "pipelined",
                detail: bool = False) -> dict[str, dict[str, float]]:
    """Simulated cost per layer of one training step on one TensorCore.

    Args:
        model: the model.
        core_spec: the TensorCore that runs it.
        batch: examples per TensorCore.
        optimizer: if given, its update is costed as a row "optimizer".
        mxu_model: the MXU cycle model ("pipelined" or "scalesim").
        detail: split composite layers (a ResNet block, a transformer block)
            into their parts: one row per op name less its last component
            ("stage1_block1/conv2" gathers that conv's fwd, dW and dx).

    Returns:
        {layer name | "loss" | "optimizer": {"flops", "mxu_flops", "seconds",
        "mxu_bound_seconds", "vpu_bound_seconds", "scalar_bound_seconds",
        "hbm_bound_seconds"}} in the order the forward pass first meets them;
        seconds are simulated, ``<b>_bound_seconds`` the seconds of the ops
        that ``b`` bounds (``op_bound``).
    """
    costs: dict[str, dict[str, float]] = {}
    if not detail:
        costs = {layer.name: _empty() for layer in model.layers}
    records = _records(model, core_spec, batch, optimizer, mxu_model)
    for rec in records:
        c = costs.setdefault(_group(model, rec, detail), _empty())
        c["flops"] += rec.flops
        c["seconds"] += rec.seconds
        c["hbm_bytes"] += rec.hbm_bytes
        for key in (f"{rec.unit}_seconds", f"{op_bound(rec)}_bound_seconds"):  # "host" too
            c[key] = c.get(key, 0.0) + rec.seconds
        if rec.unit == "mxu":
            c["mxu_flops"] += rec.flops
    costs.setdefault("loss", _empty())
    if optimizer is not None:
        costs.setdefault("optimizer", _empty())
    for extra in ("loss", "optimizer"):  # last, as in the summary
        if extra in costs:
            costs[extra] = costs.pop(extra)
    return costs


def _utilization(cost: dict[str, float], core_spec: TensorCoreSpec) -> str:
    """MXU FLOPs / (simulated seconds x the core's peak bf16 FLOP/s), as TPU profilers
    show per op ("-" for a row without MXU work)."""
    if not cost["mxu_flops"] or not cost["seconds"]:
        return "-"
    return f"{cost['mxu_flops'] / (cost['seconds'] * core_spec.peak_bf16_flops_per_s):.1%}"


def _bound(cost: dict[str, float]) -> str:
    """The bound holding the largest share of the row's time, e.g. "HBM 71%"."""
    if not cost["seconds"]:
        return "-"
    best = max(BOUNDS, key=lambda b: cost[f"{b}_bound_seconds"])
    return f"{best.upper()} {cost[f'{best}_bound_seconds'] / cost['seconds']:.0%}"


#: A table's columns: (header, justify) pairs.
_Columns = tuple[tuple[str, JustifyMethod], ...]

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
    for layer, (name, out, nparams, _) in zip(model.layers, summary, strict=True):
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
    if len(shape) == 1:
        return f"({'None' if shape[0] is None else shape[0]},)"
    return "(" + ", ".join("None" if v is None else str(v) for v in shape) + ")"


def model_summary_table(model: Model, core_spec: TensorCoreSpec, batch: int, *,
                        optimizer=None, chip_name: str = "", mxu_model: str = "pipelined",
                        compact: bool = False) -> Table:
    """The summary as a rich Table: layer (type), output shape, parameters,
    FLOPs per step and simulated time per step on one TensorCore.

    Args:
        model: the model.
        core_spec: the TensorCore of the chosen chip.
        batch: examples per TensorCore per step.
        optimizer: optional; adds the update's row.
        chip_name: shown in the title.
        compact: the form for 80 columns: layer names without their type, no output
            shape and no FLOPs, the time in microseconds without its unit.
    """
    costs = layer_costs(model, core_spec, batch, optimizer=optimizer, mxu_model=mxu_model)
    columns: _Columns  # (header, justify) pairs
    columns = ((("layer", "left"), ("params", "right"), ("sim us / step", "right"),
                ("share", "right"), ("MXU", "right"), ("bound", "left")) if compact else
               (("layer (type)", "left"), ("output shape", "left"), ("params", "right"),
                ("FLOPs / step", "right"), ("sim time / step", "right"), ("share", "right"),
                ("MXU util", "right"), ("bound", "left")))
    total_seconds, table = _cost_table("Model", model, batch, chip_name, costs, columns,
                                       compact=compact)

    def add(label: str, kind: str, shape: str, params: str, c: dict[str, float],
            style: str | None = None) -> None:
        time = f"{c['seconds'] * 1e6:,.2f}"
        tail = (f"{c['seconds'] / total_seconds:.1%}", _utilization(c, core_spec), _bound(c))
        if compact:
            table.add_row(label, params, time, *tail, style=style)
        else:
            table.add_row(f"{label} ({kind})" if kind else label, shape, params,
                          f"{c['flops']:,.0f}", f"{time} us", *tail, style=style)

    for (name, out, nparams, _), layer in zip(model.summary_rows(batch), model.layers, strict=True):
        add(name, layer.kind, _shape(out), f"{nparams:,}", costs[name])
    for extra in ("loss", "optimizer"):
        if extra in costs:
            add(extra, "", "", "", costs[extra])
    n_state = sum(int(np.prod(s)) for s in model.state_shapes.values())
    state_note = f" (+ {n_state:,} non-trainable)" if n_state and not compact else ""
    add("total", "", "", f"{model.num_params:,}{state_note}", _sum(costs), style="bold")
    return table


def _cost_table(kind: str, model: Model, batch: int, chip_name: str,
                costs: dict[str, dict[str, float]],
                columns: _Columns,
                compact: bool = False) -> tuple[float, Table]:
    """The total simulated seconds of ``costs`` (1.0 when zero, a share's divisor) and an
    empty titled table with ``columns`` ((name, justify) pairs); ``compact``: a short
    title."""
    total_seconds = sum(c["seconds"] for c in costs.values()) or 1.0
    on = f" on one {chip_name} TensorCore" if chip_name else " on one TensorCore"
    title = (f"{kind}: {model.name}, batch {batch}{on} (simulated, fwd + bwd)" if compact
             else f"{kind}: {model.name} (batch {batch} per core{on}; "
                  f"time is simulated, forward + backward)")
    table = titled_table(title)
    for col, justify in columns:
        table.add_column(col, justify=justify)
    return total_seconds, table


def _sum(costs: dict[str, dict[str, float]]) -> dict[str, float]:
    """The rows' figures added up (a figure only some rows have, such as the host link's
    ``host_seconds`` of offloaded tensors, counts from 0)."""
    total = _empty()
    for c in costs.values():
        for k, v in c.items():
            total[k] = total.get(k, 0.0) + v  # "host_seconds" of offloading layers too
    return total


def layer_detail_table(model: Model, core_spec: TensorCoreSpec, batch: int, *,
                       chip_name: str = "", mxu_model: str = "pipelined",
                       compact: bool = False) -> Table:
    """Every part of every layer (``layer_costs(..., detail=True)``) as a rich Table:
    FLOPs, simulated time and share of one training step on one TensorCore, MXU
    utilisation (MXU FLOPs / (time x peak)) and what bounds the part's ops
    (MXU, VPU, scalar issue or HBM, with its share of the part's time).

    Args:
        model: the model.
        core_spec: the TensorCore of the chosen chip.
        batch: examples per TensorCore per step.
        chip_name: shown in the title.
        mxu_model: the MXU cycle model.
        compact: the form for 80 columns: no FLOPs, the time in microseconds.
    """
    costs = layer_costs(model, core_spec, batch, mxu_model=mxu_model, detail=True)
    columns: _Columns  # (header, justify) pairs
    columns = ((("part", "left"), ("sim us / step", "right"), ("share", "right"),
                ("MXU", "right"), ("bound", "left")) if compact else
               (("part", "left"), ("FLOPs / step", "right"), ("sim time / step", "right"),
                ("share", "right"), ("MXU util", "right"), ("bound", "left")))
    total_seconds, table = _cost_table("Layer parts", model, batch, chip_name, costs, columns,
                                       compact=compact)
    rows = [(name, c, None) for name, c in costs.items()] + [("total", _sum(costs), "bold")]
    for name, c, style in rows:
        time = f"{c['seconds'] * 1e6:,.2f}"
        cells = (name, time) if compact else (name, f"{c['flops']:,.0f}", f"{time} us")
        table.add_row(*cells, f"{c['seconds'] / total_seconds:.1%}", _utilization(c, core_spec),
                      _bound(c), style=style)
    return table


def sharding_groups(layouts: list[ParamLayout]) -> list[tuple[list[str], list[ParamLayout]]]:
    """``ShardedTransformer.param_layout()`` grouped by layer, consecutive layers
    with the same parameters (names after the layer's, shapes, splits) merged:
    [(layer names, the first layer's layouts)], so 60 identical blocks are one group."""
    by_layer: list[tuple[str, list[ParamLayout]]] = []
    for p in layouts:
        if not by_layer or by_layer[-1][0] != p.layer:
            by_layer.append((p.layer, []))
        by_layer[-1][1].append(p)

    def signature(layer: str, params: list[ParamLayout]) -> tuple:
        return tuple((p.key[len(layer):], p.shape, p.tensor_dim, p.device_elements) for p in params)

    groups: list[tuple[list[str], list[ParamLayout]]] = []
    for layer, params in by_layer:
        if groups and signature(groups[-1][0][0], groups[-1][1]) == signature(layer, params):
            groups[-1][0].append(layer)
        else:
            groups.append(([layer], params))
    return groups


def sharding_table(layouts: list[ParamLayout], sizes: dict[str, int], *,
                   compact: bool = False) -> Table:
    """Each layer's sharding on a mesh as a rich Table: per parameter, its whole
    shape, the dimension split over ``tensor`` (Megatron: column-parallel splits
    the output dimension, row-parallel the input one), its shape on one tensor
    device, the chunk one device keeps after the ``fsdp`` split (ZeRO-3: flattened,
    then split) and its float32 bytes; an MoE's expert weights say their split over
    ``expert`` (E / expert experts a device) in the split column. Identical
    consecutive layers are one group ("block1 .. block60 (x60)", bytes per layer).

    Args:
        layouts: ``ShardedTransformer.param_layout()``.
        sizes: the mesh, axis -> size (``{"data", "fsdp", "tensor"}``).
        compact: the form for 80 columns: the split as "col 1" / "row 0" / "-", the
            shape on a tensor device and its bytes per device (the whole shape and
            the fsdp chunk left out).
    """
    mesh = ", ".join(f"{a}: {n}" for a, n in sizes.items())
    table = titled_table(f"Sharding on {{{mesh}}}: parameters (gradients, optimizer "
                         f"state alike)" if compact else
                         f"Sharding on the mesh {{{mesh}}} (parameters; gradients and "
                         f"optimizer slots are split alike)")
    columns: _Columns  # (header, justify) pairs
    columns = ((("layer", "left"), ("parameter", "left"), ("tensor", "left"),
                ("tensor shard", "left"), ("bytes / device", "right")) if compact else
               (("layer", "left"), ("parameter", "left"), ("shape", "left"),
                ("tensor split", "left"), ("per tensor device", "left"),
                ("fsdp chunk / device", "right"), ("bytes / device", "right")))
    for col, justify in columns:
        table.add_column(col, justify=justify)
    fsdp = int(sizes.get("fsdp", 1))
    whole = device = 0
    for names, params in sharding_groups(layouts):
        label = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} (x{len(names)})"
        for i, p in enumerate(params):
            kind = "column" if p.tensor_dim == len(p.shape) - 1 else "row"
            name, nbytes = p.key[len(p.layer) + 1:], f"{4 * p.device_elements:,}"
            expert_dim = getattr(p, "expert_dim", None)  # an MoE's experts, over expert
            if compact:
                split = "-" if p.tensor_dim is None else f"{kind[:3]} {p.tensor_dim}"
                split = split if expert_dim is None else f"exp {expert_dim}"
                table.add_row(label if i == 0 else "", name, split, _shape(p.local_shape), nbytes)
            else:
                split = "replicated" if p.tensor_dim is None else f"dim {p.tensor_dim} ({kind})"
                if expert_dim is not None:
                    split = f"experts: dim {expert_dim} over expert"
                chunk = f"{p.device_elements:,}" + (f" (1/{fsdp})" if fsdp > 1 else "")
                table.add_row(label if i == 0 else "", name, _shape(p.shape), split,
                              _shape(p.local_shape), chunk, nbytes)
            whole += len(names) * int(np.prod(p.shape))
            device += len(names) * p.device_elements
    total = (("total", f"{whole:,} params", "", "", f"{4 * device:,}") if compact else
             ("total", "", f"{whole:,} parameters", "", "", f"{device:,}", f"{4 * device:,}"))
    table.add_row(*total, style="bold")
    return table


def plan_sharding_table(plan) -> FitWidth | None:
    """The sharding table of a plan's mesh (``sharding_table``), or None for a data
    parallel mesh, or a model that is not the transformer (a timing-only plan of
    another model on a mesh), or a tensor size the model does not split by.

    Args:
        plan: a ``pod.config.plan.TrainingPlan``.
    """
    if plan.mesh.axis_names == ("data",) or not isinstance(plan.model, TransformerModel):
        return None
    try:
        layouts = param_layout(plan.model, plan.mesh.sizes)
    except ValueError:
        return None
    return FitWidth(sharding_table(layouts, dict(plan.mesh.sizes)),
                    sharding_table(layouts, dict(plan.mesh.sizes), compact=True))


def plan_model_tables(plan, *, detail: bool = False) -> list[FitWidth]:
    """What ``describe`` shows of a plan's model: the summary table, with ``detail``
    the per-part table, and on a mesh with fsdp / tensor axes the sharding table; each
    in its wide form where the console has the columns, else its compact one
    (``FitWidth``: 80 columns read without cells wrapped letter by letter).

    Args:
        plan: a ``pod.config.plan.TrainingPlan``.
        detail: add ``layer_detail_table``.
    """
    from pod.config.sharding import device_chip_spec

    core, chip = device_chip_spec(plan.topology.chip).core, plan.topology.chip.name
    options = {"chip_name": chip, "mxu_model": plan.scenario.pod.mxu_model}
    makers: list[Callable[..., Table]] = [model_summary_table]
    if detail:
        makers.append(layer_detail_table)
    tables = [FitWidth(*(make(plan.model, core, plan.per_device_batch, compact=compact,
                              **options) for compact in (False, True)))
              for make in makers]
    sharding = plan_sharding_table(plan)
    return tables if sharding is None else [*tables, sharding]


class FitWidth:
    """A table in two forms, rendered by rich as the wide one where it fits the
    console's width and as the compact one otherwise.

    Args:
        wide: the full table.
        compact: the same figures in fewer, narrower columns.
    """

    def __init__(self, wide: Table, compact: Table) -> None:
        self.wide, self.compact = wide, compact

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        natural = Measurement.get(console, options.update(width=10**6), self.wide).maximum
        yield self.wide if natural <= options.max_width else self.compact

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement.get(console, options, self.wide)

"""``tpu-pod plan``: which layout trains a model fastest on a slice?

Given a model (a preset, a scenario file or MaxText configs:
``pod.commands.plan_source``), one or more slices (or a chip count) and the
tokens per step (or a range of per-device batches), the plan searches every
mesh of each slice's devices over the axes the runtime runs, every remat
policy of the transformer and the batches (``pod.commands.plan_search``). Each
point is planned (``pod.config.plan.build_plan``, the check ``tpu-pod
validate`` runs) and, when it plans, costed by one timing-only step
(``pod.runtime.timing.TimingPod``) in this process; a point that does not plan
is dropped with its one-line reason (an ``HBMPlanError`` says what it needs
per device). With ``--num-slices``, a point may also span K identical slices
joined by the data-centre network, data parallel across them (``pod.slices: K``,
``pod.dcn_mesh: {data: K}``, MaxText's multislice default). Points rank by
simulated tokens/s, or by the simulated time to a token budget.

One process costs every point, so start-up and imports are paid once; the
data is loaded once (``build_plan(dataset=...)``); the points of one mesh
share its collective costs (``MeshCollectiveCosts``, which depend on the mesh
and the links only: the same object the first point's plan built).

Outputs (with an output directory): ``results.csv`` (every point, ranked; the
dropped ones with their reason), ``layouts.png`` (a bar per layout, the best
ones: the sweep's layout plot) and ``best.yaml`` (the best point as a
timing-only scenario: ``tpu-pod sweep best.yaml`` costs it again).
"""

from __future__ import annotations

import csv
import dataclasses
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pod.commands.plan_bound import pipeline_bound
from pod.commands.plan_cost import Scoring, cost_points, default_workers
from pod.commands.plan_search import (
    DEFAULT_REMATS,
    Candidate,
    candidates,
    capacity_factors,
    compared_batch,
    family,
    model_axes,
    remat_policies,
)
from pod.commands.plan_source import (
    ModelSource,
    SearchKeys,
    devices_of,
    model_source,
    parse_count,
    plan_slices,
    search_keys,
)
from pod.commands.sweep import csv_row, is_missing, plot_layouts, step_row
from pod.config.mesh import AXIS_NAMES, device_hbm_bytes, format_axes
from pod.config.plan import TrainingPlan, build_plan
from pod.config.presets import synthetic_examples
from pod.config.scenario import MAX_GLOBAL_BATCH, MAX_SLICES, Scenario, parse_scenario
from pod.config.slices import resolve_pod
from pod.errors import USER_ERRORS, HBMPlanError, ScenarioError
from pod.programs.replay import LayerTape, UnsignableError, signature
from pod.workloads import Dataset, build_model, load_dataset
from pod.workloads.block import TransformerBlock
from pod.workloads.remat import (
    LAYER_INPUT_OFFLOADED_VARIANT,
    remat_effect,
    remat_label,
    twin_policies,
)

__all__ = ["PlanRequest", "PlanResult", "Planner", "run_plan", "PLAN_COLUMNS",
           "DEFAULT_PER_DEVICE_BATCHES", "write_outputs", "layout_label", "slices_text"]

#: Per-device batches tried when neither the tokens per step nor the global batch is given.
DEFAULT_PER_DEVICE_BATCHES = (1, 2, 4, 8)
#: The fastest points drawn in layouts.png (a bar each).
PLOTTED = 30
#: Bound runs a planner keeps for costing their points later (a few hundred kB each), and
#: steps it keeps for their twins.
_BOUNDED = 512
#: A bound of a step is shrunk by this share: its sum of records and the step's sum of
#: figures (``StepStats.step_seconds``) round differently in the last bits.
_BOUND_MARGIN = 1e-9

PLAN_COLUMNS = (
    "rank", "point", "status", "reason", "slice", "generation", "chips", "devices", "mesh",
    *AXIS_NAMES, "remat", "per_device_batch", "global_batch", "sequence_length",
    "tokens_per_step", "simulated_tokens_per_second", "simulated_examples_per_second",
    "simulated_seconds_to_budget", "simulated_step_seconds", "compute_seconds",
    "exposed_collective_seconds", *(f"exposed_{a}_seconds" for a in AXIS_NAMES),
    "update_seconds", "collective_seconds", *(f"collective_{a}_seconds" for a in AXIS_NAMES),
    "hbm_per_device_bytes", "hbm_capacity_bytes", "fits", "mfu", "hfu", "bound",
    "bound_fraction", "wall_seconds", "slices", "dcn_mesh", "dcn_collective_seconds",
    "pipeline_bubble_seconds", "microbatches", "capacity_factor", "fits_with",
)


@dataclass(frozen=True)
class PlanRequest:
    """What to plan (``tpu-pod plan``'s arguments).

    Attributes:
        model: a preset's name, a scenario file, or MaxText's base.yml.
        files: MaxText's model.yml (after base.yml).
        slices: slices (``v5e-256``), or generations with ``chips``.
        chips: every generation's slice of this many chips (a chip budget).
        tokens_per_step: tokens per step over the pod (a whole number of sequences).
        global_batch: sequences (examples) per step (instead of the tokens).
        per_device_batches: without either: the per-device batches tried on every mesh.
        seq_len: tokens per sequence (default: the model's).
        remat: remat policies searched (default: every one the transformer has).
        mesh_axes: mesh axes searched (default: every one the runtime runs).
        token_budget: rank by the simulated time to train on this many tokens.
        num_slices: the numbers of identical slices searched, joined by the DCN and data
            parallel across them (default: 1).
        overrides: ``KEY=VALUE`` strings (or a mapping of dotted keys) for the model's
            scenario (MaxText's keys for MaxText configs).
        top: the points the table shows: the plan costs at least the ``max(top,
            PLOTTED)`` best (``plan_cost``).
        exhaustive: cost every point that plans (else those a bound of their step puts
            below what the outputs show are pruned: ``plan_cost``).
        workers: processes that cost points (None: one per core).
        capacity_factors: a mixture of experts' capacity factors searched (MaxText's
            ``capacity_factor``, 0: dropless; default: the model's own, and 1.25 too
            for a dropless one searched over expert: ``plan_search.capacity_factors``).
    """

    model: str
    files: tuple[str, ...] = ()
    slices: tuple[str, ...] = ()
    chips: int | None = None
    tokens_per_step: int | str | None = None
    global_batch: int | str | None = None
    per_device_batches: tuple[int | str, ...] = ()
    seq_len: int | None = None
    remat: tuple[str, ...] = ()
    mesh_axes: tuple[str, ...] = ()
    token_budget: int | str | None = None
    overrides: Any = ()
    num_slices: tuple[int | str, ...] = ()
    top: int = 10
    exhaustive: bool = False
    workers: int | None = None
    capacity_factors: tuple[float | str, ...] = ()


@dataclass(frozen=True)
class PlanResult:
    """A finished plan.

    Attributes:
        name: the model's name.
        rows: one per point: the costed ones ranked (``rank`` 1 first), then the dropped
            and failed ones in search order; keys ``PLAN_COLUMNS`` (NaN: no number).
        slices: the slices searched.
        axes: the mesh axes searched.
        remats: the remat policies searched ("" for a model without them).
        sequence_length: tokens per sequence (0: a model without tokens).
        global_batch: the global batch asked for (None: ``per_device_batches``).
        per_device_batches: the per-device batches tried without a global batch.
        token_budget: the budget the points rank by (None: tokens/s).
        wall_seconds: this process's time for the whole plan (wall clock).
        best_scenario: the best point's scenario mapping (None if nothing fits).
        num_slices: the numbers of slices searched ((1,): one slice).
        kept: the best points costed whatever their bound (the rest may be pruned).
        capacities: a mixture of experts' capacity factors searched (0: dropless);
            ``(None,)``: a dense model.
        fixed: mesh axis -> the size MaxText's ``ici_<axis>_parallelism`` fixed it at.
        output_dir: where the files went (None: nowhere).
    """

    name: str
    rows: list[dict[str, Any]]
    slices: tuple[str, ...]
    axes: tuple[str, ...]
    remats: tuple[str, ...]
    sequence_length: int
    global_batch: int | None
    per_device_batches: tuple[int, ...]
    token_budget: int | None
    wall_seconds: float
    best_scenario: dict[str, Any] | None
    num_slices: tuple[int, ...] = (1,)
    kept: int = PLOTTED
    capacities: tuple[float | None, ...] = (None,)
    fixed: dict[str, int] = dataclasses.field(default_factory=dict)
    output_dir: Path | None = None

    @property
    def multislice(self) -> bool:
        """Whether some point spans several slices."""
        return any(k > 1 for k in self.num_slices)

    def count(self, status: str) -> int:
        """Points of a status: "ok" (costed), "pruned" (planned, a bound of their step
        below what the outputs show: ``plan_cost``), "dropped", "failed"."""
        return sum(r["status"] == status for r in self.rows)

    @property
    def ranked(self) -> list[dict[str, Any]]:
        """The costed points, best first."""
        return [r for r in self.rows if r["status"] == "ok"]

    def summary(self) -> str:
        """``540 points: 212 costed, 40 pruned (slower than the 30 best by their compute
        alone), 288 dropped (270 do not fit in HBM); 41.2 s wall (13.1 points/s)``."""
        hbm = sum(r["fits"] is False for r in self.rows)
        dropped = self.count("dropped")
        why = (f" ({hbm} {'does' if hbm == 1 else 'do'} not fit in HBM"
               f"{self._fit_elsewhere()})" if hbm else "")
        pruned = (f", {self.count('pruned')} pruned (slower than the {self.kept} best by "
                  "their compute alone)" if self.count("pruned") else "")
        failed = f", {self.count('failed')} failed" if self.count("failed") else ""
        rate = len(self.rows) / max(self.wall_seconds, 1e-9)
        return (f"{len(self.rows)} point{'' if len(self.rows) == 1 else 's'}: "
                f"{self.count('ok')} costed{pruned}, {dropped} "
                f"dropped{why}{failed}; {self.wall_seconds:.1f} s wall ({rate:.1f} points/s)")

    def _fit_elsewhere(self) -> str:
        """What would fit the points that do not, under a policy this plan did not
        search (their refusals' ``fits_with``): "; 312 of them fit with the layer input
        offloaded: remat_policy=custom decoder_layer_input=offload", "" for none."""
        offloaded = other = 0
        searched = {remat_label(p) for p in self.remats}
        for r in self.rows:
            label = str(r.get("fits_with") or "")
            if label == remat_label(LAYER_INPUT_OFFLOADED_VARIANT):
                offloaded += 1
            elif label and label not in searched:
                other += 1
        parts = ([f"{offloaded} of them fit with the layer input offloaded: remat_policy="
                  "custom decoder_layer_input=offload"] if offloaded else [])
        parts += [f"{other} fit under a remat policy --remat all searches"] if other else []
        return "".join(f"; {p}" for p in parts)


class Planner:
    """Plans and costs the points of one model: its data loaded once, the points of a
    mesh sharing its collective costs.

    Args:
        source: the model's scenario mapping (``plan_source.model_source``).

    Raises:
        ScenarioError: the source's scenario, data or model options are wrong (one line).
    """

    def __init__(self, source: ModelSource) -> None:
        self.source = source
        base = parse_scenario(source.scenario, source=source.name)
        if base.model is None or base.training is None:
            raise ScenarioError(f"MODEL: {source.name} is a benchmark scenario; plan takes a "
                                "model (a preset, a training scenario or MaxText configs)")
        self.model_name: str = base.model.name
        self.dataset = _load(base, base.training.seed)
        self._views: dict[int, Dataset] = {}
        options = dict(base.model.options)
        #: the source's own per-tensor choices (``remat_custom``), the ``custom`` policy's
        self.remat_custom: dict[str, str] | None = dict(options.get("remat_custom") or {}) or None
        if self.remat_custom:  # the model as the custom policy builds it (any policy would do)
            options["remat"] = "custom"
        self.model = _model(base.model.name, options, self.dataset)
        self.config = getattr(self.model, "config", None)
        self.sequence_length = (int(self.dataset.x_train[0].size)
                                if self.model_name == "transformer" else 0)
        self._costs: dict[tuple, Any] = {}
        self.tape = LayerTape()
        self._bounded: dict[int, tuple[Any, ...]] = {}  # point -> its bound's run
        # twin key (``_twin_key``) -> (its step's StepStats or None, its passes' seconds)
        self._twins: dict[tuple[Any, ...], tuple[Any, float | None]] = {}
        self.twin_steps = 0  # steps taken from a twin (remat_effect) instead of run
        # id(a local model) -> (it, its blocks' indices, or None: not one signature)
        self._blocks: dict[int, tuple[Any, Any]] = {}

    def scenario_mapping(self, c: Candidate) -> dict[str, Any]:
        """The scenario of a point: the source's with its slice, mesh, remat and batch."""
        data = dict(self.source.scenario)
        pod = {k: v for k, v in dict(data.get("pod") or {}).items()
               if k in ("allreduce", "mxu_model")}
        data["pod"] = {**pod, "slice": c.slice_name, "mesh": dict(c.mesh)}
        if c.dcn_mesh is not None:  # data parallel across the slices, over the DCN
            data["pod"] |= {"slices": c.slices, "dcn_mesh": c.dcn_mesh}
        data.pop("faults", None)  # chip ranks of another pod
        # the source's description names the slice it was written for (a preset's: v5p-8)
        across = f" x {c.slices} slices" if c.slices > 1 else ""
        data["description"] = (f"{self.source.name} on {c.slice_name}{across}: mesh "
                               f"{format_axes(c.mesh)}, remat {c.remat or 'none'}, global batch "
                               f"{c.global_batch:,} (a layout of tpu-pod plan)")
        training = dict(data["training"]) | {"global_batch": c.global_batch}
        if self.source.preset:  # as describe plans a preset: sequence parallel with tensor
            tensor = c.mesh.get("tensor", 1)
            training["sequence_parallel"] = tensor > 1 and self.sequence_length % tensor == 0
        data["training"] = training
        settings = {**({"remat": c.remat} if c.remat else {}),
                    **({"capacity_factor": c.capacity_factor}
                       if c.capacity_factor is not None else {})}
        if settings:
            model = dict(data["model"])
            options = {**dict(model.get("options") or {}), **settings}
            if c.remat and c.remat != "custom":  # a named policy's tensors are its own
                options.pop("remat_custom", None)
            data["model"] = {**model, "options": options}
        block = dict(data.get("data") or {})
        if block.get("name") == "synthetic_text":  # enough sequences for a device's share
            options = dict(block.get("options") or {})
            need = synthetic_examples(self._per_chip(c), float(block.get("test_fraction", 0.2)))
            data["data"] = {**block, "options": {**options, "num_examples": max(
                need, int(options.get("num_examples", 0)))}}
        return data

    def plan(self, c: Candidate, *, shared: bool = True) -> TrainingPlan:
        """The point's checked plan (the data and, with ``shared``, its mesh's collective
        costs shared with the other points of the mesh).

        Raises:
            HBMPlanError, ScenarioError, ShardingError: the point does not plan.
        """
        scenario = parse_scenario(self.scenario_mapping(c), source=c.label)
        plan = build_plan(scenario, dataset=self._data(c), timing_only=True)
        if not shared or len(plan.collective_costs_by_step) != 1:  # link faults: their own
            return plan
        key = (c.slice_name, c.slices, tuple(sorted(c.mesh.items())))
        costs = self._costs.setdefault(key, plan.collective_costs)
        return dataclasses.replace(plan, collective_costs=costs,
                                   collective_costs_by_step=((0, costs),))

    def cost(self, c: Candidate) -> dict[str, Any]:
        """The point's row: costed by one timing-only step, or dropped with the reason. The
        points share their mesh's collective costs and the layers' passes
        (``LayerTape``): the same figures as :meth:`cost_alone`, bit for bit."""
        return self.point(c)[0]

    def cost_alone(self, c: Candidate) -> dict[str, Any]:
        """The point's row as a plan of it alone costs it: its own plan and collective
        costs, every op of its step run (the reference :meth:`cost` is checked against)."""
        return self._point(c, fast=False, mode="cost")[0]

    def point(self, c: Candidate, *, mode: str = "cost") -> tuple[dict[str, Any], float | None]:
        """The point's row and the simulated seconds of the forward and backward passes of
        its representative device with the most parameters (``_heaviest``: a lower bound
        of its step; None when its step did not run).

        Args:
            c: the point.
            mode: "cost": costed by one timing-only step; "plan": planned only; "bound":
                planned and that device's step run, not clocked (its passes' seconds).
                Without "cost" the row says whether it is dropped, or ``pruned`` (it
                plans; ``plan_cost`` gives the reason).
        """
        return self._point(c, fast=True, mode=mode)

    def _point(self, c: Candidate, *, fast: bool, mode: str
               ) -> tuple[dict[str, Any], float | None]:
        from pod.runtime.timing import TimingPod  # no Ray in timing-only mode

        row = self._labels(c)
        t0 = time.perf_counter()
        passes = None
        twin = self._twin_key(c) if fast else None
        hit = self._twins.get(twin) if twin is not None else None
        if hit is not None and mode == "cost" and hit[0] is None:
            hit = None  # its twin's bound only
        try:
            bounded = self._bounded.pop(c.index, None) if fast and mode == "cost" else None
            plan = bounded[0].plan if bounded else self.plan(c, shared=fast)
            if mode == "plan":  # the runtime's HBM allocation, as costing it would meet it
                TimingPod(plan)
            elif hit is not None:  # its twin's step: the same ops
                stats, passes = hit
                self.twin_steps += 1
            elif mode == "cost" and bounded:  # its bound's run: the plan, a device's report
                pod, heaviest, report, passes = bounded
                stats = pod.step(0, known={heaviest: report})
            elif mode != "plan":
                pod = TimingPod(plan, tape=self.tape if fast else None)
                self.tape.clear_passes()
                heaviest = _heaviest(pod)
                if mode == "cost":
                    stats = pod.step(0)
                else:  # one device's passes bound the step: a pipeline's other stages aside
                    (report,) = pod.device_reports(0, only=heaviest)
                comm = pod.last_comms[heaviest if mode == "cost" else 0]
                passes = self._bound_seconds(pod, heaviest, comm) if fast else None
                self.tape.clear_passes()
                if mode == "bound":  # kept for costing it later: the same plan and report
                    self._keep_bounded(c.index, (pod, heaviest, report, passes))
            if twin is not None and hit is None and mode != "plan":
                self._keep_twin(twin, (stats if mode == "cost" else None, passes))
            if mode != "cost":
                row.update(status="pruned", fits=True,
                           hbm_per_device_bytes=int(plan.memory["total"]))
        except HBMPlanError as err:
            need = (err.memory_plan or {}).get("total", math.nan)
            row.update(status="dropped", reason=str(err), fits=False, hbm_per_device_bytes=need,
                       fits_with=err.fits_with)
        except USER_ERRORS as err:
            row.update(status="dropped", reason=str(err))
        except ValueError as err:  # the runtime refused a point the plan accepted
            row.update(status="failed", reason=f"{c.label}: {err}")
        if row["status"]:
            row["wall_seconds"] = time.perf_counter() - t0
            return row, (passes if row["status"] == "pruned" else None)
        costed = step_row(plan, [stats], time.perf_counter() - t0)
        row.update({k: v for k, v in costed.items() if k in row})
        row.update(status="ok", reason="", point=c.index)
        if c.mesh.get("stage", 1) == 1:  # no pipeline, no bubble
            row["pipeline_bubble_seconds"] = 0.0
        if c.slices > 1:  # pod.mesh, the axes within a slice (dcn_mesh: those across)
            row["mesh"] = format_axes(c.mesh)
        return row, passes

    def _twin_key(self, c: Candidate) -> tuple[Any, ...] | None:
        """What a point's step depends on, its remat policy by what it does to a block
        (``remat_effect``): points with the same key run the same ops (their rows differ
        in the policy's name only); None for a point whose policy has no twin among the
        named ones (then nothing is kept)."""
        if c.remat not in twin_policies():
            return None
        return (c.slice_name, c.slices, tuple(sorted(c.mesh.items())), c.global_batch,
                c.per_device_batch, c.capacity_factor, remat_effect(c.remat))

    def _keep_twin(self, key: tuple[Any, ...], step: tuple[Any, float | None]) -> None:
        """Keep a step for its twins (at most ``_BOUNDED``, the oldest go first)."""
        if len(self._twins) >= _BOUNDED:
            del self._twins[next(iter(self._twins))]
        self._twins[key] = step

    def _keep_bounded(self, index: int, run: tuple[Any, ...]) -> None:
        """Keep a bound's run (its pod, device, report and passes' seconds) for costing
        the point later (at most ``_BOUNDED`` are kept, the oldest go first)."""
        if len(self._bounded) >= _BOUNDED:
            del self._bounded[next(iter(self._bounded))]
        self._bounded[index] = run

    def _passes_seconds(self, comm: Any) -> float:
        """The forward and backward passes' seconds of the device of collectives ``comm``
        in the last step (``LayerTape.pass_seconds``): part of its compute, so a lower
        bound of the step (whose slowest device's clock is at least any device's)."""
        return sum(seconds for (device, method), seconds in self.tape.pass_seconds.items()
                   if device is comm and method in ("forward", "backward"))

    def _bound_seconds(self, pod: Any, heaviest: int, comm: Any) -> float:
        """A lower bound of the point's step from the last step of its representative
        device ``heaviest`` (collectives ``comm``), times ``1 - _BOUND_MARGIN``: its
        passes' seconds; of one device, at least its passes' cycle-bound MXU seconds at
        the chip's sustained budget (``clock.sustained_clocks`` holds the step to them);
        in a pipeline, the fill before its first op and the drain after its last
        (``plan_bound.pipeline_bound``, when every block of the model has one
        signature)."""
        passes = self._passes_seconds(comm)
        schedule = getattr(pod.program, "schedule", None)
        blocks = self._chunk_blocks(pod.program) if schedule is not None else None
        if len(pod.devices) == 1:
            mxu = sum(s for (device, method), s in self.tape.pass_mxu_bound_seconds.items()
                      if device is comm and method in ("forward", "backward"))
            fraction = pod.context.sustained_mxu_fraction
            budget = mxu / fraction if 0 < fraction < 1 else 0.0
            return max(passes, budget) * (1.0 - _BOUND_MARGIN)
        if schedule is None or schedule.stages <= 1 or blocks is None:
            return passes * (1.0 - _BOUND_MARGIN)
        stage = pod.devices[heaviest].groups.ring_index("stage")
        mine = [i for v, chunk in enumerate(pod.program.chunks) if v % schedule.stages == stage
                for i in chunk if i in blocks[1]]
        per_pass = self.tape.pass_mxu_seconds
        if not mine or any((comm, m, i) not in per_pass for i in mine
                           for m in ("forward", "backward")):
            return passes * (1.0 - _BOUND_MARGIN)
        forward = min(per_pass[(comm, "forward", i)] for i in mine)
        backward = min(per_pass[(comm, "backward", i)] for i in mine)
        return pipeline_bound(schedule, stage, blocks[0], forward, backward,
                              passes) * (1.0 - _BOUND_MARGIN)

    def _chunk_blocks(self, program: Any) -> tuple[list[int], frozenset[int]] | None:
        """A pipelined program's blocks per virtual stage (their number) and the blocks'
        layer indices, or None when its blocks do not all share one signature
        (``replay.signature``: a block of another kind may cost less on another stage);
        the signatures compared once per local model."""
        local = program.local_model
        kept = self._blocks.get(id(local))
        if kept is None or kept[0] is not local:
            found = frozenset(i for i, layer in enumerate(local.layers)
                              if isinstance(layer, TransformerBlock))
            try:
                same = len({signature(local.layers[i]) for i in found}) == 1
            except UnsignableError:  # a layer the signature cannot describe
                same = False
            if len(self._blocks) >= _BOUNDED:
                self._blocks.clear()
            kept = self._blocks[id(local)] = (local, found if same else None)
        index: frozenset[int] | None = kept[1]  # a local model serves any number of stages
        if index is None:
            return None
        return [sum(i in index for i in chunk) for chunk in program.chunks], index

    def _labels(self, c: Candidate) -> dict[str, Any]:
        """A point's row before it is costed: what it is (NaN for the figures). ``mesh``
        is the mesh within a slice, ``dcn_mesh`` the one across slices, the axis columns
        each axis's whole length (as the sweep's); chips and devices count every slice's."""
        pod = resolve_pod(slice_name=c.slice_name, slices=c.slices)
        dcn = c.dcn_mesh or {}
        row: dict[str, Any] = {k: math.nan for k in PLAN_COLUMNS}
        row.update(point=c.index, status="", reason="", fits_with="", slice=c.slice_name,
                   generation=pod.chip.name, chips=pod.chips, devices=devices_of(pod),
                   mesh=format_axes(c.mesh), slices=c.slices,
                   dcn_mesh=format_axes(dcn) if dcn else "",
                   **{a: c.mesh.get(a, 1) * dcn.get(a, 1) for a in AXIS_NAMES},
                   remat=c.remat, per_device_batch=(c.per_device_batch or math.nan),
                   capacity_factor=(math.nan if c.capacity_factor is None
                                    else c.capacity_factor),
                   global_batch=c.global_batch, fits="", bound="",
                   sequence_length=self.sequence_length or math.nan,
                   tokens_per_step=(c.global_batch * self.sequence_length
                                    if self.sequence_length else math.nan),
                   hbm_capacity_bytes=device_hbm_bytes(pod.chip))
        return row

    @staticmethod
    def _per_chip(c: Candidate) -> int:
        """Examples one chip holds at the point (its devices' shares)."""
        pod = resolve_pod(slice_name=c.slice_name)
        return (c.per_device_batch or 1) * devices_of(pod) // pod.chips

    def _data(self, c: Candidate) -> Dataset:
        """The data, with enough training examples for the point's per-device share (a
        timing-only plan reads one device's: shapes only). More than the loaded split
        holds are its first example repeated (a read-only view: no memory)."""
        need = self._per_chip(c)
        have = int(self.dataset.x_train.shape[0])
        if need <= have:
            return self.dataset
        n = 1 << (need - 1).bit_length()
        if n not in self._views:
            d = self.dataset
            self._views[n] = dataclasses.replace(
                d, x_train=np.broadcast_to(d.x_train[:1], (n, *d.x_train.shape[1:])),
                y_train=np.broadcast_to(d.y_train[:1], (n, *d.y_train.shape[1:])))
        return self._views[n]


def _heaviest(pod: Any) -> int:
    """The representative device (of a ``TimingPod``) with the most parameters: the
    pipeline stage with the most work (the last, with the output layer), the one device
    without a pipeline; the first of equals."""
    sizes = [sum(int(np.size(v)) for v in d.state.params.values()) for d in pod.devices]
    return sizes.index(max(sizes))


def _load(scenario: Scenario, seed: int) -> Dataset:
    """The scenario's data, as ``build_plan`` loads it (``seed``: its training seed).

    Raises:
        ScenarioError: the loader refuses its options (one line).
    """
    data = scenario.data
    try:
        return load_dataset(data.name, test_fraction=data.test_fraction, seed=seed,
                            path=data.path, **data.options)
    except (TypeError, ValueError) as err:
        raise ScenarioError(f"data: {err}") from None


def _model(name: str, options: dict[str, Any], dataset: Dataset):
    """The scenario's model (for its configuration: the axes it splits).

    Raises:
        ScenarioError: a bad model option (one line).
    """
    try:
        return build_model(name, input_shape=tuple(dataset.x_train.shape[1:]),
                           num_classes=dataset.num_classes, **options)
    except (TypeError, ValueError) as err:
        raise ScenarioError(f"model.options: {err}") from None


def _remats(planner: Planner, asked: Sequence[str]) -> tuple[str, ...]:
    """The remat policies searched: those asked (``all``: every one the transformer has),
    or ``DEFAULT_REMATS``; ``custom`` where the model gives its choices (``remat_custom``:
    a scenario's, or MaxText's per-tensor keys), by default too whenever it gives them
    (a published run's policy, e.g. T5's and T6's).

    Raises:
        ScenarioError: a policy the transformer does not have, ``custom`` without its
            choices, or remat for a model without it.
    """
    if planner.config is None:
        if asked:
            raise ScenarioError(f"--remat: {planner.model_name} has no remat policies "
                                "(the transformer has them)")
        return ("",)
    custom = ("custom",) if planner.remat_custom else ()
    known = remat_policies() + custom
    if tuple(asked) == ("all",):
        return known
    for policy in asked:
        if policy == "custom" and not custom:
            raise ScenarioError("--remat: custom needs the model's choices per tensor: "
                                "model.options.remat_custom={decoder_layer_input: offload, "
                                "...} (or MaxText's decoder_layer_input=offload ... keys)")
        if policy not in known:
            raise ScenarioError(f"--remat: {policy!r} is not a remat policy; policies: "
                                f"{', '.join(known)} (or all)")
    return tuple(asked) or DEFAULT_REMATS + custom


def _axes(planner: Planner, asked: Sequence[str], keys: SearchKeys) -> tuple[str, ...]:
    """The mesh axes searched: those asked, or every one the runtime runs on this model;
    with an axis MaxText's ``ici_<axis>_parallelism`` fixes above 1.

    Raises:
        ScenarioError: an axis that is not a mesh axis, or one this model cannot use.
    """
    available = model_axes(planner.config)
    for axis in asked:
        if axis not in AXIS_NAMES:
            raise ScenarioError(f"--mesh-axes: {axis!r} is not a mesh axis; axes: "
                                f"{', '.join(AXIS_NAMES)}")
        if axis not in available:
            raise ScenarioError(f"--mesh-axes: {axis} is not an axis the runtime runs "
                                f"{planner.source.name} on; axes: {', '.join(available)}")
    fixed = [a for a, size in keys.mesh.items() if size > 1]
    for axis in fixed:
        if axis not in available:
            key = f"ici_{'pipeline' if axis == 'stage' else axis}_parallelism"
            raise ScenarioError(f"{keys.given[key]}: {axis} is not an axis the runtime runs "
                                f"{planner.source.name} on; axes: {', '.join(available)}")
    chosen = set(asked or available) | set(fixed)
    return tuple(a for a in AXIS_NAMES if a in chosen)


def _with_search_keys(request: PlanRequest, keys: SearchKeys) -> PlanRequest:
    """The request with what MaxText's keys set (``plan_source.search_keys``).

    Raises:
        ScenarioError: a key and the option that sets the same thing, both given (one line).
    """
    changes: dict[str, Any] = {}

    def take(key: str, value: Any, field: str, option: str, given: bool) -> None:
        if value is None:
            return
        if given:
            raise ScenarioError(f"{keys.given[key]} and {option} set the same; give one")
        changes[field] = value

    take("compile_topology", keys.slice_name and (keys.slice_name,), "slices", "--slice",
         bool(request.slices or request.chips))
    count_key = next((k for k in keys.given if k not in ("compile_topology",)
                      and (k.startswith("dcn_") or k.endswith("num_slices"))), "num_slices")
    take(count_key, keys.num_slices and (keys.num_slices,), "num_slices", "--num-slices",
         bool(request.num_slices))
    take("per_device_batch_size", keys.per_device_batch and (keys.per_device_batch,),
         "per_device_batches", "--per-device-batch (or --global-batch, --tokens-per-step)",
         bool(request.per_device_batches or request.global_batch or request.tokens_per_step))
    take("remat_policy", keys.remat and (keys.remat,), "remat", "--remat", bool(request.remat))
    take("capacity_factor", None if keys.capacity_factor is None else (keys.capacity_factor,),
         "capacity_factors", "--capacity-factor", bool(request.capacity_factors))
    take("max_target_length", keys.seq_len, "seq_len", "--seq-len", request.seq_len is not None)
    return dataclasses.replace(request, **changes)


def _global_batch(planner: Planner, request: PlanRequest) -> int | None:
    """The global batch asked for (None: the per-device batches).

    Raises:
        ScenarioError: both options, or tokens that are not whole sequences (one line).
    """
    if request.tokens_per_step is not None and request.global_batch is not None:
        raise ScenarioError("--tokens-per-step: give it or --global-batch, not both")
    if request.per_device_batches and (request.tokens_per_step or request.global_batch):
        raise ScenarioError("--per-device-batch: the tokens per step (or the global batch) set "
                            "each mesh's per-device batch; give one or the other")
    if request.global_batch is not None:
        return _at_most(parse_count(request.global_batch, "--global-batch"), "--global-batch")
    if request.tokens_per_step is None:
        return None
    tokens = parse_count(request.tokens_per_step, "--tokens-per-step")
    length = planner.sequence_length
    if not length:
        raise ScenarioError(f"--tokens-per-step: {planner.model_name} takes no token "
                            "sequences; give --global-batch")
    if tokens % length:
        low = tokens // length * length
        near = f"{low:,} or {low + length:,}" if low else f"{length:,}"
        raise ScenarioError(f"--tokens-per-step: {tokens:,} is not a whole number of "
                            f"{length:,}-token sequences; use a multiple of {length:,} such "
                            f"as {near}")
    return _at_most(tokens // length, "--tokens-per-step", f" ({tokens:,} tokens)")


def _at_most(batch: int, option: str, what: str = "") -> int:
    """A global batch (or per-device batch) of at most ``MAX_GLOBAL_BATCH`` sequences.

    Raises:
        ScenarioError: a larger one (one line).
    """
    if batch > MAX_GLOBAL_BATCH:
        raise ScenarioError(f"{option}: {batch:,} sequences{what}, more than the "
                            f"{MAX_GLOBAL_BATCH:,} a batch may have")
    return batch


def _per_device(batches: Sequence[Any]) -> tuple[int, ...]:
    """The per-device batches tried (default ``DEFAULT_PER_DEVICE_BATCHES``).

    Raises:
        ScenarioError: one that is not a positive whole number.
    """
    return tuple(_at_most(parse_count(b, "--per-device-batch"), "--per-device-batch")
                 for b in batches) or DEFAULT_PER_DEVICE_BATCHES


def _capacities(values: Sequence[Any]) -> tuple[float, ...]:
    """The capacity factors asked for, as numbers.

    Raises:
        ScenarioError: one that is not a number (one line).
    """
    out = []
    for value in values:
        try:
            out.append(float(str(value).strip()))
        except ValueError:
            raise ScenarioError(f"--capacity-factor: {value!r} is not a number; give e.g. "
                                "0 (dropless) or 1.25, or both: 0,1.25") from None
    return tuple(out)


def _num_slices(counts: Sequence[Any]) -> tuple[int, ...]:
    """The numbers of slices searched (default 1), each once, in the order given.

    Raises:
        ScenarioError: one that is not a positive whole number (one line).
    """
    out: list[int] = []
    for value in counts:
        text = str(value).strip()
        if isinstance(value, bool) or not text.isdigit() or not 1 <= int(text) <= MAX_SLICES:
            raise ScenarioError(f"--num-slices: {value!r} is not a whole number of slices "
                                f"from 1 to {MAX_SLICES}; give e.g. 1,2,4")
        if int(text) not in out:
            out.append(int(text))
    return tuple(out) or (1,)


def _rank(rows: list[dict[str, Any]], budget: int | None) -> list[dict[str, Any]]:
    """The costed rows best first (most tokens/s, or least time to the budget; examples/s
    for a model without tokens), numbered; then the others in search order."""
    ok = [r for r in rows if r["status"] == "ok"]
    for r in ok:
        if budget:
            steps = math.ceil(budget / (r["tokens_per_step"] if not is_missing(
                r["tokens_per_step"]) else r["global_batch"]))
            r["simulated_seconds_to_budget"] = steps * r["simulated_step_seconds"]
    if budget:
        ok.sort(key=lambda r: r["simulated_seconds_to_budget"])
    else:
        rate = ("simulated_tokens_per_second" if any(
            not is_missing(r["simulated_tokens_per_second"]) for r in ok)
            else "simulated_examples_per_second")
        ok.sort(key=lambda r: -r[rate])
    for i, r in enumerate(ok):
        r["rank"] = i + 1
    return ok + [r for r in rows if r["status"] != "ok"]


def run_plan(request: PlanRequest, *, output_dir: Path | None = None,
             on_point: Callable[[dict[str, Any], int], None] | None = None,
             default_output: bool = False) -> PlanResult:
    """Search, cost and rank every point of ``request`` (module docstring).

    Args:
        request: what to plan.
        output_dir: write results.csv, layouts.png and best.yaml there (None: nothing,
            or with ``default_output`` :func:`default_output_dir`; nothing either when no
            point is costed: the CLI then ends in an error, and an earlier plan's files
            there are left as they were).
        on_point: called with each point's row and the number of points (progress).

    Returns:
        The ranked rows and what was searched.

    Raises:
        ScenarioError and the other user errors: a bad option, model or override (one
            line, before any point is costed). OutputError, DirectoryInUseError: the
            output directory cannot be written.
    """
    t0 = time.perf_counter()
    keys, overrides = search_keys(request.model, request.files, request.overrides)
    request = _with_search_keys(request, keys)
    pods = plan_slices(request.slices, request.chips)
    source = model_source(request.model, request.files, overrides,
                          slice_name=pods[0].slice_name, seq_len=request.seq_len)
    planner = Planner(source)
    budget = (parse_count(request.token_budget, "--token-budget")
              if request.token_budget is not None else None)
    batch = _global_batch(planner, request)
    axes = _axes(planner, request.mesh_axes, keys)
    remats = _remats(planner, request.remat)
    per_device = () if batch else _per_device(request.per_device_batches)
    counts = _num_slices(request.num_slices)
    capacities = capacity_factors(planner.config, axes,
                                  _capacities(request.capacity_factors))
    points = candidates([(p.slice_name, devices_of(p)) for p in pods], axes, remats,
                        global_batch=batch, per_device_batches=per_device, num_slices=counts,
                        capacities=capacities, fixed=keys.mesh,
                        dropless_expert=not getattr(planner.config, "sparse_matmul", True))
    if not points and keys.mesh:
        axis, size = next(iter(keys.mesh.items()))
        key = f"ici_{'pipeline' if axis == 'stage' else axis}_parallelism"
        raise ScenarioError(f"{keys.given[key]}: no mesh of {', '.join(p.slice_name for p in pods)}"
                            f" over {', '.join(axes)} has " + ", ".join(
                                f"{a} {n}" for a, n in keys.mesh.items())
                            + f" ({devices_of(pods[0]):,} devices: sizes that divide it)")
    if output_dir is None and default_output:
        output_dir = default_output_dir(source.name, [p.slice_name for p in pods])
    if output_dir is not None:
        from pod.report.files import check_writable

        check_writable(output_dir)  # before the first point, not after the last
    rows = cost_points(planner, points, scoring=Scoring(planner.sequence_length, budget),
                       keep=max(PLOTTED, request.top), exhaustive=request.exhaustive,
                       family_of=lambda r: family(r, axes),
                       compared_batch=lambda rows: compared_batch(rows, axes),
                       workers=request.workers or (default_workers() if len(points) >= 64
                                                   else 1),  # a pool is not worth it
                       on_point=on_point,
                       beside=_warm_up_plot if output_dir is not None else None)
    rows = _rank(rows, budget)
    best = next((c for c in points if rows and rows[0]["status"] == "ok"
                 and c.index == rows[0]["point"]), None)
    result = PlanResult(source.name, rows, tuple(p.slice_name for p in pods), axes, remats,
                        planner.sequence_length, batch, per_device, budget,
                        time.perf_counter() - t0,
                        planner.scenario_mapping(best) if best is not None else None, counts,
                        max(PLOTTED, request.top), capacities, dict(keys.mesh),
                        output_dir if rows and rows[0]["status"] == "ok" else None)
    if result.output_dir is not None:  # a plan that costs nothing writes nothing
        write_outputs(result, result.output_dir)
    return dataclasses.replace(result, wall_seconds=time.perf_counter() - t0)


def _warm_up_plot() -> None:
    """layouts.png's modules and fonts loaded ahead (``figures.warm_up``), while the
    workers cost the points."""
    from pod.report.figures import warm_up

    warm_up()


def default_output_dir(name: str, slices: Sequence[str]) -> Path:
    """``runs/plan-<model>-<slice>[-<slice>...]``: where ``tpu-pod plan`` writes by
    default, named after what was planned."""
    return Path("runs") / re.sub(r"[^A-Za-z0-9_.-]+", "-", f"plan-{name}-{'-'.join(slices)}")


def layout_label(row: dict[str, Any], with_slice: bool) -> str:
    """A point's mesh as the plot and the table name it: ``{fsdp: 8}``, ``{data: 2} x
    {fsdp: 8}`` across 2 slices (the DCN mesh, then one slice's), the slice first when
    ``with_slice``."""
    mesh = f"{row['dcn_mesh']} x {row['mesh']}" if row.get("slices", 1) > 1 else row["mesh"]
    return f"{row['slice']} {mesh}" if with_slice else mesh


def slices_text(result: PlanResult) -> str:
    """`` x 1, 2 slices`` when the plan searched several slices; "" otherwise."""
    if not result.multislice:
        return ""
    return f" x {', '.join(map(str, result.num_slices))} slices"


def write_outputs(result: PlanResult, output_dir: Path) -> list[Path]:
    """results.csv (every row, ranked), layouts.png (the ``PLOTTED`` best) and best.yaml
    (the best point's scenario) in ``output_dir``, each whole or not at all."""
    import yaml

    from pod.safe_io import lock_directories, write_atomic

    with lock_directories(output_dir):
        def write_rows(f) -> None:
            writer = csv.DictWriter(f, fieldnames=PLAN_COLUMNS, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(map(csv_row, result.rows))

        written = [write_atomic(output_dir / "results.csv", write_rows, newline="")]
        best = result.ranked[:PLOTTED]
        if best:
            many = len(set(result.slices)) > 1
            rows = [{**r, "error": r["reason"], "mesh": layout_label(r, many)} for r in best]
            title = (f"{result.name}: the {len(best)} fastest of {len(result.rows)} layouts on "
                     f"{', '.join(result.slices)}{slices_text(result)} (simulated)")
            written.append(plot_layouts(rows, output_dir, title))
        else:
            (output_dir / "layouts.png").unlink(missing_ok=True)  # an earlier plan's
        if result.best_scenario is None:
            (output_dir / "best.yaml").unlink(missing_ok=True)
        else:
            pruned = result.count("pruned")
            of = (f"{result.count('ok') + pruned} that plan, {result.count('ok')} costed"
                  if pruned else f"{result.count('ok')} costed")
            text = (f"# The best layout of `tpu-pod plan` for {result.name} (rank 1 of {of}); "
                    "cost it again: tpu-pod sweep best.yaml\n"
                    + yaml.safe_dump(result.best_scenario, sort_keys=False))
            written.append(write_atomic(output_dir / "best.yaml", lambda f: f.write(text)))
    return written

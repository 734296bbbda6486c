"""The search space of ``tpu-pod plan``: every mesh, remat policy and batch of a model.

A **mesh** of a slice's ``n`` devices over the searched axes ``a_1 .. a_k`` is
an ordered factorisation ``n = s_1 x ... x s_k`` (sizes >= 1, the mesh axes in
``pod.config.mesh.AXIS_NAMES`` order); every one is laid out on the torus by
``pod.config.mesh.layout_mesh``, so the search never misses or repeats one.
For ``n = p_1^e_1 ... p_r^e_r`` there are ``prod_i C(e_i + k - 1, k - 1)`` of
them (stars and bars, prime by prime): 45 meshes of a v5e-256 over data, fsdp
and tensor.

Which axes are searched is one table, ``SEARCH_AXES``: an axis is searched
when the runtime runs it for this kind of model (``runtime_axes``: a device
program is built on a tiny transformer with the axis at 2, as a run builds it,
a mixture of experts for a mixture of experts: its pipeline stages and tensor
splits are not modelled) and the model has something for it to split (a
pipeline stage needs layers, an expert axis a mixture of experts). A new axis is
one entry.

A mixture of experts is also searched over its **capacity factor** (MaxText's
``capacity_factor``; 0: dropless): the model's own, and, for a dropless model
whose expert axis is searched, ``DEFAULT_CAPACITY_FACTOR`` too, since the runtime
splits a sparse MoE's experts over an ``expert`` axis only with a capacity (a sparse
dropless MoE's all-to-all is ragged, which is not modelled): a point with expert > 1
takes the capacities other than 0, one with expert 1 every capacity; a dense dropless
MoE (``sparse_matmul`` false: every expert on every token) runs over expert at 0 too.

The **remat policies** are the transformer's own (``pod.workloads.block.
REMAT_POLICIES``): by default ``DEFAULT_REMATS``, every one with ``all``; the
**batch** is the global batch asked for (each mesh's per-device share follows, or the
point is dropped when it does not split), or every per-device batch of a list. Each
point may span several identical **slices** joined by the data-centre network
(``--num-slices``), data parallel across them (MaxText's ``num_slices`` with
``dcn_data_parallelism``): its mesh is searched within one slice, and its batch splits
over every slice's devices.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pod.config.mesh import AXIS_NAMES, format_axes
from pod.errors import ScenarioError

__all__ = ["SearchAxis", "SEARCH_AXES", "runtime_axes", "model_axes", "ordered_factorisations",
           "factorisation_count", "meshes", "remat_policies", "DEFAULT_REMATS", "Candidate",
           "candidates",
           "DEFAULT_CAPACITY_FACTOR", "capacity_factors", "capacity_text", "family",
           "compared_batch", "check_search_size", "MAX_PLAN_POINTS"]

#: The capacity factor a dropless mixture of experts is also searched at: Switch
#: Transformer's (Fedus et al. 2022, section 2.2 and Table 1: 1.0 and 1.25 trained as
#: well, 1.25 the one its expert-parallel runs use), and the MoE layout sweep's
#: (``scenarios/layouts-mixtral-8x7b-v5p-128.yaml``).
DEFAULT_CAPACITY_FACTOR = 1.25


@dataclass(frozen=True)
class SearchAxis:
    """A mesh axis ``tpu-pod plan`` may search.

    Attributes:
        name: the mesh axis (``pod.config.mesh.AXIS_NAMES``).
        splits: (the transformer's config) -> whether the model has something for the
            axis to split; None: always (data, fsdp, tensor).
        probe: transformer options of the tiny model the runtime is asked to run with
            the axis at 2 (``runtime_axes``).
    """

    name: str
    splits: Callable[[Any], bool] | None = None
    probe: Mapping[str, Any] = field(default_factory=dict)


#: The axes, outermost first. An axis joins the search when the runtime runs it.
SEARCH_AXES: tuple[SearchAxis, ...] = (
    SearchAxis("data"),
    SearchAxis("stage", splits=lambda cfg: cfg.layers > 1, probe={"layers": 2}),
    SearchAxis("fsdp"),
    SearchAxis("expert", splits=lambda cfg: getattr(cfg, "experts", 1) > 1,
               probe={"experts": 2}),
    SearchAxis("tensor"),
)


@functools.cache
def runtime_axes(experts: bool = False) -> tuple[str, ...]:
    """The mesh axes the runtime runs a transformer on (with ``experts``: a mixture of
    experts with a capacity): for each axis, the device program of a tiny such
    transformer on ``{axis: 2}`` (``pod.programs.build_program``, what every back-end
    runs) is built; an axis whose program refuses it is left out."""
    from pod.programs import build_program
    from pod.workloads import build_optimizer
    from pod.workloads.transformer import TransformerConfig, TransformerModel

    moe = {"experts": 2, "capacity_factor": DEFAULT_CAPACITY_FACTOR} if experts else {}
    found = ["data"]
    for axis in SEARCH_AXES[1:]:
        try:
            config = TransformerConfig(vocabulary=16, sequence_length=4, embed_dim=8, heads=2,
                                       mlp_dim=8, **{**axis.probe, **moe})
            build_program(TransformerModel(config), {axis.name: 2}, build_optimizer("sgd"))
        except (TypeError, ValueError):  # an option or an axis the code does not have yet
            continue
        found.append(axis.name)
    return tuple(found)


def _is_moe(config: Any | None) -> bool:
    return getattr(config, "experts", 1) > 1


def model_axes(config: Any | None) -> tuple[str, ...]:
    """The axes searched for a model: the runtime's for its kind (dense or a mixture of
    experts) that split it. ``config`` is the transformer's ``TransformerConfig``; None
    (another model, trained data parallel by the replicated program): data only."""
    if config is None:
        return ("data",)
    runs = runtime_axes(_is_moe(config))
    return tuple(a.name for a in SEARCH_AXES
                 if a.name in runs and (a.splits is None or a.splits(config)))


def capacity_factors(config: Any | None, axes: Sequence[str],
                     asked: Sequence[float] = ()) -> tuple[float | None, ...]:
    """The capacity factors searched (module docstring): those ``asked``, or the model's
    own and, for a dropless mixture of experts searched over expert,
    ``DEFAULT_CAPACITY_FACTOR``; ``(None,)`` for a dense model (nothing to set).

    Raises:
        ScenarioError: capacities asked of a dense model, or one below 0.
    """
    if not _is_moe(config):
        if asked:
            raise ScenarioError("--capacity-factor: the model has no mixture of experts "
                                "(model.options.experts); the capacity factor is an MoE's")
        return (None,)
    for value in asked:
        if not value >= 0:
            raise ScenarioError(f"--capacity-factor: {value!r} is not a capacity factor: 0 "
                                "(dropless) or more, e.g. 1.25")
    if asked:
        return tuple(dict.fromkeys(float(v) for v in asked))
    own = float(getattr(config, "capacity_factor", 0.0))
    if own == 0 and "expert" in axes:
        return (0.0, DEFAULT_CAPACITY_FACTOR)
    return (own,)


def capacity_text(capacity: float | None) -> str:
    """``dropless``, ``capacity 1.25``, or "" (a dense model)."""
    if capacity is None:
        return ""
    return "dropless" if capacity == 0 else f"capacity {capacity:g}"


def ordered_factorisations(n: int, k: int) -> list[tuple[int, ...]]:
    """Every ``k``-tuple of whole numbers >= 1 whose product is ``n``, each once, in
    lexicographic order.

    Raises:
        ValueError: n < 1 or k < 1.
    """
    if n < 1 or k < 1:
        raise ValueError(f"ordered factorisations need n >= 1 and k >= 1, got n={n}, k={k}")
    if k == 1:
        return [(n,)]
    return [(d, *rest) for d in range(1, n + 1) if n % d == 0
            for rest in ordered_factorisations(n // d, k - 1)]


def factorisation_count(n: int, k: int) -> int:
    """How many ``ordered_factorisations(n, k)`` there are, in closed form: for
    ``n = prod p^e``, ``prod C(e + k - 1, k - 1)``."""
    count, rest, p = 1, n, 2
    while p * p <= rest:
        e = 0
        while rest % p == 0:
            rest, e = rest // p, e + 1
        count *= math.comb(e + k - 1, k - 1)
        p += 1
    return count * (k if rest > 1 else 1)  # what is left is a prime, e = 1


def meshes(devices: int, axes: Sequence[str]) -> list[dict[str, int]]:
    """Every mesh of ``devices`` devices over ``axes`` (``pod.mesh`` values, size-1 axes
    left out; the first axis kept when every size is 1), each once.

    Raises:
        ScenarioError: an axis that is not a mesh axis.
    """
    unknown = [a for a in axes if a not in AXIS_NAMES]
    if unknown or not axes:
        raise ScenarioError(f"--mesh-axes: {', '.join(unknown) or '(none)'} is not a mesh axis; "
                            f"axes: {', '.join(AXIS_NAMES)}")
    ordered = [a for a in AXIS_NAMES if a in axes]
    out = []
    for sizes in ordered_factorisations(devices, len(ordered)):
        mesh = {a: s for a, s in zip(ordered, sizes, strict=True) if s > 1}
        out.append(mesh or {ordered[0]: 1})
    return out


def remat_policies() -> tuple[str, ...]:
    """The transformer's remat policies, read from the code (``REMAT_POLICIES``); a
    policy that needs settings of its own (``custom``) is left out."""
    from pod.workloads.block import REMAT_POLICIES

    return tuple(p for p in REMAT_POLICIES if p != "custom")


#: The remat policies searched when none are asked: the whole trade-off from keeping every
#: intermediate (``none``) to keeping nothing but the layer input (``full``), through
#: MaxText's on-device presets between them. The other four (the attention context kept,
#: ``out_proj`` alone, and the two that keep their tensors in host memory) are searched by
#: name or with ``all``: all ten take 1.7x the points and the time (``tpu-pod plan
#: llama2-7b --slice v5e-256``: 6,600 points, 27.6 s, against 3,960 and 15 s, 2026-11-29).
DEFAULT_REMATS = ("none", "full", "minimal", "save_dot_except_mlp", "save_dot_except_mlpwi",
                  "save_qkv_proj")


@dataclass(frozen=True)
class Candidate:
    """One point of the search: a slice, a mesh, a remat policy and a batch.

    Attributes:
        index: 1-based, in search order.
        slice_name: the slice (``v5e-256``).
        mesh: ``pod.mesh`` (size-1 axes left out).
        remat: the remat policy ("" for a model without one).
        global_batch: sequences (examples) per step over the pod.
        per_device_batch: what each device of data x fsdp gets (every slice's); None
            when the global batch does not split over the mesh (the plan says why).
        slices: identical slices joined by the DCN (``pod.slices``), the data axis
            across them (``pod.dcn_mesh: {data: slices}``); 1: one slice.
        capacity_factor: a mixture of experts' capacity factor (0: dropless); None: a
            dense model's point (nothing to set).
    """

    index: int
    slice_name: str
    mesh: dict[str, int]
    remat: str
    global_batch: int
    per_device_batch: int | None
    slices: int = 1
    capacity_factor: float | None = None

    @property
    def dcn_mesh(self) -> dict[str, int] | None:
        """``pod.dcn_mesh``: ``{data: slices}`` (MaxText's dcn_data_parallelism); None in
        one slice."""
        return {"data": self.slices} if self.slices > 1 else None

    @property
    def label(self) -> str:
        """``v5e-256 {fsdp: 64, tensor: 4} full b=2``; ``2 x v5e-256 ...`` for 2 slices."""
        batch = f" b={self.per_device_batch}" if self.per_device_batch else ""
        where = f"{self.slices} x {self.slice_name}" if self.slices > 1 else self.slice_name
        capacity = f" {capacity_text(self.capacity_factor)}" if self.capacity_factor is not None \
            else ""
        return f"{where} {format_axes(self.mesh)} {self.remat or 'none'}{batch}{capacity}"


#: Most points one plan searches (about 6 KB of row each: 300 MB at the cap), counted
#: before any is built; the default search of a v5p-1024 (5 axes, 6 remat policies, 4
#: batches) is 17,160.
MAX_PLAN_POINTS = 50_000


def check_search_size(slices: Sequence[tuple[str, int]], axes: Sequence[str],
                      remats: Sequence[str], global_batch: int | None,
                      per_device_batches: Sequence[int], num_slices: Sequence[int],
                      capacities: Sequence[float | None] = (None,)) -> int:
    """The number of points ``candidates`` would build at most (in closed form:
    ``factorisation_count`` meshes per slice; each capacity factor of a mixture of experts,
    ``capacities``, counted on every mesh), refused past ``MAX_PLAN_POINTS``.

    Raises:
        ScenarioError: too many points; one line saying what multiplies to them.
    """
    meshes_of = {devices: factorisation_count(devices, len(axes)) for _, devices in slices}
    batches = 1 if global_batch is not None else len(per_device_batches)
    total = (sum(meshes_of[d] for _, d in slices) * max(len(num_slices), 1)
             * max(len(remats), 1) * batches * max(len(capacities), 1))
    if total > MAX_PLAN_POINTS:
        terms = [f"{sum(meshes_of[d] for _, d in slices):,} meshes",
                 f"{len(remats)} remat policies", f"{batches:,} per-device batches",
                 f"{len(num_slices)} numbers of slices",
                 *([f"{len(capacities)} capacity factors"] if len(capacities) > 1 else [])]
        raise ScenarioError(f"plan: the search has {total:,} points ({' x '.join(terms)}), more "
                            f"than the {MAX_PLAN_POINTS:,} allowed; search fewer (--remat, "
                            "--mesh-axes, --per-device-batch, --num-slices)")
    return total


def _batch_shards(mesh: Mapping[str, int]) -> int:
    """The devices among which the batch splits: data x fsdp x expert (the devices along
    tensor share their examples; ``pod.config.mesh.Mesh.batch_shards``)."""
    return mesh.get("data", 1) * mesh.get("fsdp", 1) * mesh.get("expert", 1)


def candidates(slices: Sequence[tuple[str, int]], axes: Sequence[str], remats: Sequence[str],
               *, global_batch: int | None = None,
               per_device_batches: Sequence[int] = (),
               num_slices: Sequence[int] = (1,),
               capacities: Sequence[float | None] = (None,),
               fixed: Mapping[str, int] | None = None,
               dropless_expert: bool = False) -> list[Candidate]:
    """Every point: slices x numbers of slices x meshes x remat policies x capacity
    factors x batches, in that order (a mesh with expert > 1 without the dropless
    capacity 0 unless ``dropless_expert``: the runtime does not run a sparse dropless
    MoE over expert, ``transformer.check_expert_split``).

    Args:
        slices: (slice name, devices of one slice) per slice.
        axes: the mesh axes searched.
        remats: remat policies ("" for a model without remat).
        global_batch: the batch asked for; each mesh's per-device batch follows.
        per_device_batches: without ``global_batch``: the per-device batches tried on
            every mesh (global batch = per-device batch x data x fsdp x slices).
        num_slices: the numbers of identical slices joined by the DCN, data parallel
            across them (``Candidate.slices``).
        capacities: a mixture of experts' capacity factors (``capacity_factors``);
            ``(None,)``: a dense model.
        fixed: mesh axis -> the size every mesh has (MaxText's ``ici_<axis>_parallelism``);
            the other axes are searched.
        dropless_expert: the model's dropless routing runs over expert (a dense dropless
            MoE, ``sparse_matmul`` false: every expert on every token,
            ``pod.workloads.moe``): capacity 0 is searched on every mesh.
    """
    check_search_size(slices, axes, remats, global_batch, per_device_batches, num_slices,
                      capacities or (None,))
    out: list[Candidate] = []
    for (name, devices), count in itertools.product(slices, num_slices or (1,)):
        layouts = [m for m in meshes(devices, axes)
                   if all(m.get(a, 1) == size for a, size in (fixed or {}).items())]
        for mesh, remat, capacity in itertools.product(layouts, remats or ("",),
                                                       capacities or (None,)):
            if capacity == 0 and mesh.get("expert", 1) > 1 and not dropless_expert:
                continue  # sparse dropless over expert: a ragged all-to-all, not modelled
            shards = _batch_shards(mesh) * count
            if global_batch is not None:
                batches = [(global_batch, global_batch // shards if global_batch % shards == 0
                            else None)]
            else:
                batches = [(b * shards, b) for b in per_device_batches]
            for batch, per_device in batches:
                out.append(Candidate(len(out) + 1, name, mesh, remat, batch, per_device,
                                     count, capacity))
    return out


def family(row: Mapping[str, Any], axes: Sequence[str]) -> str:
    """A point's mesh family: the axes it splits over within a slice ("fsdp+tensor"; "one
    device"), and across how many slices ("fsdp x 2 slices"). ``row``: a plan row (its
    axis columns, ``slices``)."""
    slices = row.get("slices", 1)
    split = [a for a in axes if row[a] // (slices if a == "data" else 1) > 1]
    name = "+".join(split) or "one device"
    return f"{name} x {slices} slices" if slices > 1 else name


def compared_batch(rows: Sequence[Mapping[str, Any]], axes: Sequence[str]) -> int | None:
    """The global batch mesh families are compared at: of the points that run (costed or
    pruned), the one the most families run, the largest of those (the work per step
    must be the same for a comparison: with per-device batches searched, a mesh's global
    batch is its per-device batch x data x fsdp, and {fsdp: 256} at 1 per device runs 256
    sequences where {fsdp: 128, tensor: 2} runs 128). None when no point runs."""
    families: dict[int, set[str]] = {}
    for r in rows:
        if r["status"] in ("ok", "pruned"):
            families.setdefault(int(r["global_batch"]), set()).add(family(r, axes))
    if not families:
        return None
    return max(families, key=lambda b: (len(families[b]), b))

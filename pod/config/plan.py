"""Turn a ``Scenario`` into a checked ``TrainingPlan``, without Ray.

Everything that can be found wrong before a single actor starts is found
here: the pod shape, the split of the global batch over the TensorCores, the
number of steps, and whether parameters, gradients, optimizer state and
activations fit in one TensorCore's HBM. ``tpu-pod validate`` runs exactly
this; ``tpu-pod run`` runs it first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from chip import HBM, HBMOutOfMemoryError, check_precision
from interconnect import ScheduleCost, calibrated_link
from pod.config.faults import FaultPlan
from pod.config.ici import IciPlan, choose_algorithm, combine_buckets
from pod.config.links import check_links, link_faults
from pod.config.mesh import Mesh, build_mesh, device_hbm_bytes, format_axes, mesh_memory_plan
from pod.config.scenario import Scenario
from pod.config.sharding import (SHARDED_MODELS, MeshCollectiveCosts, check_sharded_mesh,
                                 on_chip_bandwidth)
from pod.config.slices import PodShape, resolve_pod
from pod.errors import HBMPlanError, ScenarioError, ShardingError
from pod.workloads import Dataset, Model, build_model, build_optimizer, load_dataset
from pod.workloads.checks import DataMismatchError, TokenIdError
from pod.workloads.models import MODEL_NAMES, MODEL_OPTIONS

__all__ = ["TrainingPlan", "build_plan", "memory_plan", "shard_batch_size", "batch_indices",
           "plan_ici"]


@dataclass(frozen=True)
class TrainingPlan:
    """A scenario resolved against the chip, the dataset and the model.

    Attributes:
        scenario: the scenario it came from.
        pod: chip preset and ICI topology.
        dataset: the loaded dataset (train and test splits).
        model: the model (stateless; one object serves every replica).
        per_core_batch: examples per TensorCore per step (on a mesh with fsdp or
            tensor axes: per device, the global batch over data x fsdp).
        steps: optimizer steps to run.
        steps_per_epoch: full global batches in one pass over the train split.
        memory: per TensorCore HBM plan in bytes: params, grads,
            optimizer_state, activations, workspace, and their total.
        ici: the allreduce algorithm and its cost at every step (link
            faults included).
        faults: the scenario's faults checked against the pod.
        mesh: the device mesh (``pod.mesh``; default ``{data: every device}``).
            With fsdp or tensor above 1, ``memory`` is one device's
            sharded plan (``pod.config.mesh.mesh_memory_plan``).
        mesh_costs: with fsdp or tensor above 1, the cost of a collective over
            every group of a mesh axis, cached per (axis, op, bytes)
            (``pod.config.sharding.MeshCollectiveCosts``), with the links of step 0
            (``pod.links``); None for data parallel.
        mesh_costs_by_step: (first zero-based step, costs) each time the link
            faults change (``collective_costs_at``); empty for data parallel.
    """

    scenario: Scenario
    pod: PodShape
    dataset: Dataset
    model: Model
    per_core_batch: int
    steps: int
    steps_per_epoch: int
    memory: dict[str, int]
    ici: IciPlan
    faults: FaultPlan
    mesh: Mesh | None = None
    mesh_costs: MeshCollectiveCosts | None = None
    mesh_costs_by_step: tuple[tuple[int, MeshCollectiveCosts], ...] = ()

    @property
    def collective_costs(self) -> MeshCollectiveCosts:
        """``mesh_costs``, or for a data-parallel mesh costs built the same way (a sharded
        pod of the transformer runs on ``{data: N}`` too)."""
        return self.mesh_costs or _mesh_costs(self.mesh, self.ici.link, self.pod.chip,
                                              link_faults(self.faults.base_links))

    def collective_costs_at(self, step: int) -> MeshCollectiveCosts:
        """The mesh's collective costs with the link faults in force at zero-based
        ``step`` (``collective_costs`` when no link fault starts later)."""
        later = [c for s, c in self.mesh_costs_by_step if s <= step]
        return later[-1] if later else self.collective_costs

    @property
    def global_batch(self) -> int:
        """Examples per step over the whole pod."""
        return self.scenario.training.global_batch

    @property
    def per_chip_batch(self) -> int:
        """Examples per chip per step."""
        return self.per_core_batch * self.pod.chip.tensorcores

    @property
    def num_params(self) -> int:
        """Number of trainable parameters of the model."""
        return int(self.model.num_params)


def shard_batch_size(global_batch: int, tensorcores: int) -> int:
    """Examples per TensorCore for an even data-parallel split.

    Args:
        global_batch: examples per step over the pod.
        tensorcores: TensorCores in the pod.

    Returns:
        global_batch // tensorcores.

    Raises:
        ShardingError: the batch does not split evenly, as on a real pod
            ("batch_size must be divisible by the number of TPU cores").
    """
    if global_batch % tensorcores:
        lower = (global_batch // tensorcores) * tensorcores
        upper = lower + tensorcores
        nearby = f"{lower} or {upper}" if lower > 0 else f"{upper}"
        raise ShardingError(
            f"training.global_batch: global batch {global_batch} is not divisible by "
            f"{tensorcores} TensorCores; use a multiple of {tensorcores} such as {nearby}"
        )
    return global_batch // tensorcores


def memory_plan(model: Model, optimizer_state_bytes: int, per_core_batch: int,
                capacity_bytes: int, name: str = "core", precision: str = "bf16"
                ) -> dict[str, int]:
    """Allocate one TensorCore's training state against its HBM.

    Args:
        model: the model.
        optimizer_state_bytes: bytes of optimizer state for the model's params.
        per_core_batch: examples per core per step.
        capacity_bytes: the core's HBM capacity.
        name: the core's name, for the error message.
        precision: the MXU precision (sizes the workspace's weight copies).

    Returns:
        Bytes per item (params, grads, optimizer_state, activations,
        workspace) and total. activations = what forward keeps for backward
        (``Model.activation_memory``: in the activation dtype of the
        precision, bf16 2 bytes; the transformer's remat, offload and flash
        attention included). workspace = the MXU's copy of the weights
        (2 bytes per parameter in bf16, 1 in int8, none in fp32, which splits
        the float32 weights on chip) + the flat float32 gradient buffer the
        chip's cores reduce into and the allreduce sends from (4 bytes per
        parameter) + the largest working set of one layer in backward
        (``ActivationMemory.transient_bytes``).

    Raises:
        HBMPlanError: an item does not fit (an ``HBMOutOfMemoryError``); it
            names the item, the bytes asked and the bytes free, and carries the
            whole plan as ``memory_plan`` (the items' bytes and their total).
    """
    params_bytes = 4 * int(model.num_params)  # float32
    activations = model.activation_memory(per_core_batch, precision=precision)
    items = {
        "params": params_bytes,
        "grads": params_bytes,
        "optimizer_state": int(optimizer_state_bytes),
        "activations": int(activations.device_bytes),
        "workspace": ({"bf16": 2, "int8": 1}.get(precision, 0) + 4) * int(model.num_params)
                     + int(activations.transient_bytes),
    }
    hbm = HBM(capacity_bytes, name=name)
    try:
        for tag, nbytes in items.items():
            hbm.allocate(tag, nbytes)
    except HBMOutOfMemoryError as err:
        # the whole plan travels with the error, so `tpu-pod describe` can show why
        raise HBMPlanError(str(err), tag=err.tag, requested_bytes=err.requested_bytes,
                           free_bytes=err.free_bytes, capacity_bytes=err.capacity_bytes,
                           memory_plan={**items, "total": sum(items.values())}) from None
    return {**items, "total": hbm.used_bytes}


def _shape_only(model: Model) -> dict[str, np.ndarray]:
    """Zero-copy stand-ins with the parameters' shapes (no memory for big models)."""
    zero = np.zeros((), dtype=np.float32)
    out = {}
    for key, shape in model.param_shapes.items():
        try:
            out[key] = np.broadcast_to(zero, shape)
        except ValueError:  # a dimension past what numpy can index: no HBM holds it either
            raise ScenarioError(f"model.options: parameter {key} of shape {tuple(shape)!r:.80} is "
                                "too large for any chip's HBM; use smaller sizes") from None
    return out


def _data_field(message: str, path: str | None) -> str:
    """The ``data`` key a loader's ValueError is about: path, options, or the section."""
    if message.startswith("path "):
        return "data"  # "data: path '...' does not exist" reads as the field already
    if path and path in message:
        return "data.path"
    if "option" in message:
        return "data.options"
    return "data"


def _memory_plan(scenario: Scenario, pod: PodShape, mesh: Mesh, model: Model, optimizer,
                 per_core: int) -> dict[str, int]:
    """The HBM check of ``build_plan``: one TensorCore's plan (``memory_plan``), or with
    a ``pod.mesh`` that has fsdp or tensor, one device's sharded plan (pod/config/mesh.py).

    Raises:
        HBMPlanError: one line naming the field to change.
    """
    training = scenario.training
    try:
        if not mesh.is_data_parallel:  # pod.mesh with fsdp / tensor: one device's sharded plan
            memory = mesh_memory_plan(model, optimizer.state_bytes(_shape_only(model)),
                                      training.global_batch, mesh, device_hbm_bytes(pod.chip),
                                      precision=training.precision)
        else:
            memory = memory_plan(model, optimizer.state_bytes(_shape_only(model)), per_core,
                                 pod.chip.core.hbm_bytes, name=f"{pod.chip.name} TensorCore",
                                 precision=training.precision)
    except HBMPlanError as err:
        if not mesh.is_data_parallel:
            raise  # its one line names pod.mesh and a mesh that fits
        # name the field a user would change
        field = "training.global_batch" if err.tag == "activations" else "model.options"
        what = (f"{per_core} examples per TensorCore" if err.tag == "activations" else
                f"{scenario.model.name} with {int(model.num_params):,} parameters")
        raise HBMPlanError(
            f"{field}: {what} does not fit: {err}; use a smaller "
            f"{'global batch' if err.tag == 'activations' else 'model'} or a chip with more HBM "
            f"per TensorCore", tag=err.tag, requested_bytes=err.requested_bytes,
            free_bytes=err.free_bytes, capacity_bytes=err.capacity_bytes,
            memory_plan=err.memory_plan) from None
    return memory


def _training_data(scenario: Scenario, pod: PodShape, per_core: int, dataset: Dataset | None,
                   timing_only: bool) -> Dataset:
    """The scenario's dataset (loaded unless given), checked against the global batch."""
    training = scenario.training
    if dataset is None:
        # keys that are load_dataset's own arguments, set elsewhere in the scenario
        where = {"name": "data.name", "path": "data.path", "test_fraction": "data.test_fraction",
                 "seed": "training.seed"}
        for key in sorted(set(scenario.data.options) & set(where)):
            raise ScenarioError(f"data.options: {key!r} is not an option of dataset "
                                f"{scenario.data.name!r}; it is set by {where[key]}")
        try:
            dataset = load_dataset(scenario.data.name, test_fraction=scenario.data.test_fraction,
                                   seed=training.seed, path=scenario.data.path,
                                   **scenario.data.options)
        except ValueError as err:
            raise ScenarioError(f"{_data_field(str(err), scenario.data.path)}: {err}") from None
    n_train = int(dataset.x_train.shape[0])
    if training.global_batch > n_train and not (timing_only and per_core * pod.chip.tensorcores
                                                   <= n_train):
        largest = n_train // pod.tensorcores * pod.tensorcores
        raise ScenarioError(
            f"training.global_batch: {training.global_batch} is larger than the "
            f"{n_train} training examples of {dataset.name}; use at most {largest} "
            f"(a multiple of {pod.tensorcores} TensorCores), or more data"
        )
    return dataset


def _model_for_data(scenario: Scenario, dataset: Dataset) -> Model:
    """The scenario's model, built for the data and checked against every example
    (labels per example, token ids in the vocabulary), so that a model and data
    that disagree are one line from ``validate``, not an error inside a chip actor.

    Raises:
        ScenarioError: ``model.options.vocabulary`` smaller than the data's ids;
            ``model.name`` when the model cannot take this data (naming the
            models that can); ``model.options`` for a bad option.
    """
    name, options = scenario.model.name, scenario.model.options
    try:
        model = _built(name, dataset, options)
        for x, y in ((dataset.x_train, dataset.y_train), (dataset.x_test, dataset.y_test)):
            model.check_data(x, y)
        return model
    except TokenIdError as err:
        if "vocabulary" not in MODEL_OPTIONS[name]:
            raise ScenarioError(f"data: {err}") from None
        raise ScenarioError(
            f"model.options.vocabulary: {err.vocabulary} is smaller than the token ids of "
            f"{dataset.name} (up to {err.high}); use at least {err.high + 1}"
            + (", or data.options.num_words to keep fewer words" if dataset.name == "imdb"
               else "")) from None
    except DataMismatchError as err:
        fit = [m for m in MODEL_NAMES if m != name and _fits(m, dataset)]
        raise ScenarioError(f"model.name: {name} does not fit {dataset.name} data: {err}; models "
                            f"that fit it: {', '.join(fit) or 'none'}") from None
    except ValueError as err:
        raise ScenarioError(f"model.options: {err}") from None


def _custom_model_for_data(model: Any, dataset: Dataset, mesh: Mesh) -> Model:
    """A custom model given to ``build_plan``, checked as ``_model_for_data`` checks a
    named one.

    Raises:
        ScenarioError: not a ``Model``; a model that cannot take this data; a mesh
            with fsdp or tensor axes (only the named transformer is sharded).
    """
    if not isinstance(model, Model):
        raise ScenarioError(f"model: a custom model must be a pod.workloads.Model, got "
                            f"{type(model).__name__}")
    if not mesh.is_data_parallel:
        raise ScenarioError(f"pod.mesh: {format_axes(mesh.sizes)}: a custom model ({model.name}) "
                            f"trains data parallel only; use {{data: {mesh.size}}}")
    try:
        for x, y in ((dataset.x_train, dataset.y_train), (dataset.x_test, dataset.y_test)):
            model.check_data(x, y)
    except ValueError as err:  # DataMismatchError and TokenIdError are ValueErrors
        raise ScenarioError(f"model: the custom model {model.name} does not fit "
                            f"{dataset.name} data: {err}") from None
    return model


def _built(name: str, dataset: Dataset, options: dict) -> Model:
    return build_model(name, input_shape=tuple(dataset.x_train.shape[1:]),
                       num_classes=dataset.num_classes, **options)


def _fits(name: str, dataset: Dataset) -> bool:
    """Whether model ``name`` with its default options takes a sample of ``dataset``."""
    try:
        _built(name, dataset, {}).check_data(dataset.x_train[:256], dataset.y_train[:256])
    except ValueError:
        return False
    return True


def _check_runnable_mesh(scenario: Scenario, mesh: Mesh, model: Model) -> None:
    """A mesh with fsdp or tensor axes trains the transformer, one actor per device
    (``pod.runtime.sharded_pod``); a model other than the transformer is refused with
    its own line (``check_sharded_mesh``), and so is a tensor size that does not split
    the model."""
    check_sharded_mesh(mesh, scenario.model.name)
    if mesh.is_data_parallel:
        return
    axes = format_axes(mesh.sizes)
    try:
        from pod.workloads.sharded import check_tensor_split
        check_tensor_split(model.config, mesh.axis_size("tensor"))
    except ValueError as err:
        raise ScenarioError(f"pod.mesh: {axes}: {err}") from None


def _check_sequence_parallel(scenario: Scenario, mesh: Mesh, model: Model) -> None:
    """``training.sequence_parallel`` needs the transformer, and its sequence length
    split evenly over tensor.

    Raises:
        ScenarioError: one line naming the field, the value and what is allowed.
    """
    if not scenario.training.sequence_parallel:
        return
    tensor = mesh.axis_size("tensor")
    config = getattr(model, "config", None)
    if scenario.model.name not in SHARDED_MODELS or config is None:
        raise ScenarioError(f"training.sequence_parallel: true needs the transformer model on a "
                            f"mesh with a tensor axis; {scenario.model.name} has no sequence to "
                            "split: remove it")
    if tensor > 1 and config.sequence_length % tensor:
        common = math.gcd(config.heads, config.kv_heads, config.mlp_dim, config.sequence_length)
        sizes = ", ".join(str(t) for t in range(1, common + 1) if common % t == 0)
        raise ScenarioError(f"training.sequence_parallel: tensor {tensor} (pod.mesh "
                            f"{format_axes(mesh.sizes)}) does not divide the sequence length "
                            f"{config.sequence_length}; tensor sizes that split the heads, MLP "
                            f"and sequence: {sizes}; or sequence_parallel: false")


def _per_device_batch(global_batch: int, pod: PodShape, mesh: Mesh) -> int:
    """Examples per TensorCore (data parallel: ``shard_batch_size``), or on a mesh with
    fsdp / tensor axes, per device: the batch splits over data x fsdp, the devices
    along tensor share their examples.

    Raises:
        ShardingError: the batch does not split evenly, naming the mesh.
    """
    if mesh.is_data_parallel:
        return shard_batch_size(global_batch, pod.tensorcores)
    shards = mesh.axis_size("data") * mesh.axis_size("fsdp")
    if global_batch % shards:
        lower = global_batch // shards * shards
        nearby = f"{lower} or {lower + shards}" if lower else f"{shards}"
        raise ShardingError(f"training.global_batch: global batch {global_batch} does not split "
                            f"over data x fsdp = {shards} devices of pod.mesh "
                            f"{format_axes(mesh.sizes)}; use a multiple of {shards} such as "
                            f"{nearby}")
    return global_batch // shards


def is_timing_sweep(scenario: Scenario) -> bool:
    """True for a sweep scenario costed timing-only (``sweep.mode: timing``): ``tpu-pod run``
    refuses it, ``sweep`` plans its points with ``timing_only``, and so do ``validate`` and
    ``describe`` (its data only has to hold one chip's share of the batch)."""
    return scenario.sweep is not None and scenario.sweep.mode == "timing"


def build_plan(scenario: Scenario, *, dataset: Dataset | None = None,
               timing_only: bool = False, sharded_ok: bool = False,
               model: Model | None = None) -> TrainingPlan:
    """Resolve and check a scenario.

    Args:
        scenario: the validated scenario.
        dataset: an already loaded dataset to reuse (else it is loaded).
        model: a custom model (``pod.workloads.Model`` built from its layers) to train
            instead of the scenario's ``model`` block; checked against every example
            of the data like a named one. Data parallel meshes only.
        timing_only: the plan is only costed (``pod.runtime.timing``): a global batch
            larger than the train split is allowed, since one chip's share
            stands for the whole batch.
        sharded_ok: plan a ``pod.mesh`` with fsdp / tensor axes without the run's
            checks (``describe`` and timing-only sweeps plan any model / chip on it).

    Returns:
        The plan.

    Raises:
        ScenarioError, ShardingError, HBMOutOfMemoryError, ChipSpecError,
        TopologyError: with one-line messages naming the field.
    """
    if scenario.training is None:
        raise ScenarioError(f"{scenario.name}: a benchmark scenario has no training plan; "
                            "use pod.config.bench.check_benchmark")
    cfg = scenario.pod
    pod = resolve_pod(slice_name=cfg.slice, chip=cfg.chip, chips=cfg.chips,
                      topology=cfg.topology, wraparound=cfg.wraparound)
    check_links(cfg.links, pod.torus)
    mesh = build_mesh(cfg.mesh, pod)
    training = scenario.training
    try:
        check_precision(training.precision, pod.chip.core, pod.chip.name)
    except ValueError as err:
        raise ScenarioError(f"training.precision: {err}") from None
    per_core = _per_device_batch(training.global_batch, pod, mesh)
    dataset = _training_data(scenario, pod, per_core, dataset, timing_only)
    n_train = int(dataset.x_train.shape[0])
    model = (_model_for_data(scenario, dataset) if model is None
             else _custom_model_for_data(model, dataset, mesh))
    try:
        optimizer = build_optimizer(training.optimizer.name, **training.optimizer.options())
    except ValueError as err:
        raise ScenarioError(f"training.optimizer: {err}") from None
    steps_per_epoch = max(1, n_train // training.global_batch)
    steps = training.steps if training.steps is not None else training.epochs * steps_per_epoch
    for index, fault in enumerate(scenario.faults):
        if fault.step > steps:
            raise ScenarioError(f"faults.{index}.step: {fault.step} is after the last step "
                                f"({steps}); the fault would never happen")
    memory = _memory_plan(scenario, pod, mesh, model, optimizer, per_core)
    _check_sequence_parallel(scenario, mesh, model)
    if not sharded_ok:
        _check_runnable_mesh(scenario, mesh, model)
    faults = FaultPlan(scenario.faults, pod.chips, pod.chip.chips_per_host, cfg.links)
    buckets = (combine_buckets(model.gradient_buckets(), training.overlap_bucket_bytes // 4)
               if training.overlap and mesh.is_data_parallel else ())  # sharded: no DP buckets
    if mesh.is_data_parallel:
        ici = plan_ici(pod, int(model.num_params), cfg.allreduce, faults, buckets)
    else:  # gradients reduce per mesh axis (mesh_costs): no data-parallel allreduce, whose
        # algorithm choice would take minutes at pod scale for nothing
        link = calibrated_link(pod.chip.name, pod.chip.ici_link_bandwidth_bytes_per_s,
                               pod.chip.ici_latency_s)
        ici = IciPlan(algorithm=cfg.allreduce, num_elements=0, link=link,
                      costs=((0, ScheduleCost(seconds=0.0, phase_seconds=(), link_bytes={})),))
    mesh_steps = () if mesh.is_data_parallel else tuple(
        (step, _mesh_costs(mesh, ici.link, pod.chip, in_force, field))
        for step, in_force, field in _link_faults_by_step(faults, pod.torus))
    return TrainingPlan(scenario=scenario, pod=pod, dataset=dataset, model=model,
                        per_core_batch=per_core, steps=int(steps),
                        steps_per_epoch=steps_per_epoch, memory=memory, ici=ici, faults=faults,
                        mesh=mesh, mesh_costs=mesh_steps[0][1] if mesh_steps else None,
                        mesh_costs_by_step=mesh_steps)


def _mesh_costs(mesh: Mesh, link, chip, faults=None, field: str = "pod.links"
                ) -> MeshCollectiveCosts:
    """The mesh's collective costs on ``link`` with the link ``faults`` in force, on-chip
    steps at ``on_chip_bandwidth``.

    Raises:
        ScenarioError: a failed link on a mesh of a device per TensorCore (v2 / v3),
            whose rerouted collectives are not modelled; ``field`` names the entry.
    """
    if faults is not None and faults.failed and mesh.devices_per_chip > 1:
        raise ScenarioError(f"{field}: a failed link on a sharded mesh of a device per "
                            f"TensorCore (pod.mesh {format_axes(mesh.sizes)}) is not modelled "
                            "(its rerouted collectives have chip ranks only); use slowdown, a "
                            "v4 / v5e / v5p / v6e pod, or {data: N}")
    return MeshCollectiveCosts(mesh, link, on_chip_bandwidth(chip), faults)


def _link_faults_by_step(faults: FaultPlan, torus) -> list[tuple[int, Any, str]]:
    """(zero-based step, ``LinkFaults`` in force from it, the field of its first failed
    link) each time the link faults change; each set is checked against the torus
    (links it has, failed links routable around), naming the entry.

    Raises:
        TopologyError: a failed link nothing can route around, naming the entry.
    """
    out = []
    for step in faults.link_change_steps():
        entries = faults.link_entries(step)
        new = {f"faults.{f.index}" for f in faults.faults if f.link and f.step == step}
        # the faults that start at this step first: an unroutable set names them
        ordered = sorted(entries, key=lambda e: e["field"] not in new)
        check_links(ordered, torus)
        failed = [e["field"] for e in ordered if e.get("failed")]
        out.append((step, link_faults(entries), failed[0] if failed else "pod.links"))
    return out


def batch_indices(num_examples: int, global_batch: int, step: int, seed: int) -> np.ndarray:
    """Indices of the examples of one global batch.

    Each epoch is a fresh permutation drawn from ``default_rng([seed, epoch])``;
    the last incomplete batch of an epoch is dropped. Deterministic in
    (num_examples, global_batch, step, seed), so a run can be replayed.

    Args:
        num_examples: size of the train split.
        global_batch: examples per step.
        step: zero-based step number.
        seed: the scenario seed.

    Returns:
        int64 array of shape (global_batch,).
    """
    per_epoch = num_examples // global_batch
    epoch, index = divmod(step, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(num_examples)
    return order[index * global_batch:(index + 1) * global_batch]


def plan_ici(pod: PodShape, num_elements: int, algorithm: str, faults: FaultPlan,
             buckets: tuple[tuple[tuple[str, ...], int], ...] = ()) -> IciPlan:
    """Decide the allreduce of a data-parallel run and cost it at every step.

    The algorithm is chosen once over the links of step 0 (``pod.links``):
    the given one, or the fastest for this pod when ``auto``. Link faults
    that start later are costed now too, with the same algorithm, so an
    unroutable failure is an error before step 1 and the runtime costs
    nothing itself.

    Args:
        pod: chip preset and torus.
        num_elements: float32 elements of the gradient buffer (parameters).
        algorithm: ``pod.allreduce`` (a name or "auto").
        faults: the checked fault plan (its link entries per step).
        buckets: (layers, elements) of the overlapped allreduce, in backward
            order; each is costed as its own allreduce with the same algorithm
            (empty: no overlap).

    Raises:
        TopologyError: a failed link that nothing can route around, naming
            the scenario entry.
    """
    link = calibrated_link(pod.chip.name, pod.chip.ici_link_bandwidth_bytes_per_s,
                           pod.chip.ici_latency_s)
    chosen, first = choose_algorithm("allreduce", pod.torus, num_elements, link,
                                     algorithm=algorithm, faults=link_faults(faults.base_links))
    costs, bucket_costs = [], []
    for step, in_force, _ in _link_faults_by_step(faults, pod.torus):

        def cost(elements: int) -> ScheduleCost:
            return choose_algorithm("allreduce", pod.torus, elements, link, algorithm=chosen,
                                    faults=in_force)[1]

        costs.append((step, first if step == 0 else cost(num_elements)))
        if buckets:
            bucket_costs.append((step, tuple(cost(n) for _, n in buckets)))
    return IciPlan(algorithm=chosen, num_elements=num_elements, link=link, costs=tuple(costs),
                   buckets=tuple(buckets), bucket_costs=tuple(bucket_costs))

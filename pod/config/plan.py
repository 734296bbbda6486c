"""Turn a ``Scenario`` into a checked ``TrainingPlan``, without Ray.

Everything that can be found wrong before a single actor starts is found
here: the pod shape and its device mesh (data parallelism is ``{data: N}``),
the split of the global batch over the devices, the number of steps, whether
parameters, gradients, optimizer state and activations fit in one device's
HBM, and what every collective of a mesh axis costs at every step.
``tpu-pod validate`` runs exactly this; ``tpu-pod run`` runs it first.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from chip import check_precision
from interconnect import calibrated_link
from pod.config.faults import FaultPlan
from pod.config.fit import MemoryOf, fit_memory, split_evenly
from pod.config.ici import IciPlan
from pod.config.links import check_links, link_faults
from pod.config.mesh import Mesh, build_mesh, device_hbm_bytes, format_axes
from pod.config.pipeline import check_pipeline_plan, pipeline_microbatches
from pod.config.scenario import ModelConfig, Scenario, TrainingConfig
from pod.config.sharding import SHARDED_MODELS, MeshCollectiveCosts, on_chip_bandwidth
from pod.config.slices import Topology, resolve_pod
from pod.errors import HBMPlanError, ScenarioError, ShardingError
from pod.memory import DeviceMemory
from pod.program_factory import ProgramFactory, training_program
from pod.workloads import Dataset, Model, build_model, build_optimizer, load_dataset
from pod.workloads.checks import DataMismatchError, TokenIdError
from pod.workloads.models import MODEL_NAMES, MODEL_OPTIONS
from pod.workloads.quantization import check_quantization
from pod.workloads.remat import remat_label
from pod.workloads.transformer import check_expert_split, check_tensor_split

__all__ = ["TrainingPlan", "build_plan", "batch_indices", "plan_ici", "is_timing_sweep",
           "training_sections"]


@dataclass(frozen=True)
class TrainingPlan:
    """A scenario resolved against the chip, the dataset, the model and the mesh.

    Attributes:
        scenario: the scenario it came from.
        topology: the hardware the scenario's ``pod`` section resolves to: chip preset,
            the ICI torus of one slice and the number of slices (``Topology``).
        dataset: the loaded dataset (train and test splits).
        model: the model (stateless; one object serves every device).
        per_device_batch: examples per device per step: the global batch over
            data x fsdp x expert (the devices along tensor share their examples).
        steps: optimizer steps to run.
        steps_per_epoch: full global batches in one pass over the train split.
        memory: one device's HBM plan in bytes: params, grads, optimizer_state,
            activations, workspace, and their total (``device_memory.items()``).
        ici: the allreduce algorithm of a data axis that spans the whole pod
            (``pod.allreduce``, or ``torus`` when ``auto``) and whether one does
            (``IciPlan.whole_pod``); what each mesh axis runs is
            ``collective_costs.algorithms()``.
        faults: the scenario's faults checked against the pod.
        mesh: the device mesh (``pod.mesh``; default ``{data: every device}``).
        collective_costs: the cost of a collective over every group of a mesh
            axis, cached per (axis, op, bytes)
            (``pod.config.sharding.MeshCollectiveCosts``), with the links of step 0
            (``pod.links``).
        collective_costs_by_step: (first zero-based step, costs) each time the
            link faults change (``collective_costs_at``).
        bucket_elements: the replicated program's gradient buckets hold at most
            this many elements (``training.overlap_bucket_bytes`` / 4); None
            without overlap (one allreduce after the backward pass).
        device_memory: one device's memory as the plan's program reports it
            (``DeviceProgram.memory``, fitted by ``pod.config.fit``): the items with
            the workspace's parts, the host's offloaded activations and the FSDP
            prefetch depth that fits (``prefetch_layers``, read by the clock).
    """

    scenario: Scenario
    topology: Topology
    dataset: Dataset
    model: Model
    per_device_batch: int
    steps: int
    steps_per_epoch: int
    memory: dict[str, int]
    ici: IciPlan
    faults: FaultPlan
    mesh: Mesh
    collective_costs: MeshCollectiveCosts
    collective_costs_by_step: tuple[tuple[int, MeshCollectiveCosts], ...] = ()
    bucket_elements: int | None = None
    device_memory: DeviceMemory | None = None

    def collective_costs_at(self, step: int) -> MeshCollectiveCosts:
        """The mesh's collective costs with the link faults in force at zero-based
        ``step``."""
        later = [c for s, c in self.collective_costs_by_step if s <= step]
        return later[-1] if later else self.collective_costs

    @property
    def training(self) -> TrainingConfig:
        """The scenario's training section (a plan's scenario always has one)."""
        return training_sections(self.scenario)[1]

    @property
    def global_batch(self) -> int:
        """Examples per step over the whole pod."""
        return self.training.global_batch

    @property
    def num_params(self) -> int:
        """Number of trainable parameters of the model."""
        return int(self.model.num_params)

    def check_runnable(self) -> None:
        """Check that the model's device program runs on the plan's mesh (a plan built
        with ``sharded_ok`` is not checked: ``describe`` plans any model on any mesh).

        Raises:
            ScenarioError: one line naming ``pod.mesh``.
        """
        _check_runnable_mesh(self.scenario, self.mesh, self.model)

    def __repr__(self) -> str:
        """One line (a notebook cell's value): what runs where, the batch and HBM."""
        hbm = self.memory.get("total", 0)
        memory = f"{hbm / 2**30:.2f} GiB" if hbm >= 2**30 else f"{hbm / 2**20:.2f} MiB"
        return (f"<TrainingPlan {self.scenario.name}: {self.topology.name} "
                f"({self.topology.chips:,} chips), {self.model.name} "
                f"({self.num_params:,} parameters) on {self.dataset.name}, mesh "
                f"{format_axes(self.mesh.sizes)}, global batch {self.global_batch:,} = "
                f"{self.per_device_batch:,} per device, {self.steps:,} steps, HBM {memory} "
                "per device>")


def training_sections(scenario: Scenario) -> tuple[ModelConfig, TrainingConfig]:
    """A training scenario's model and training sections (``Scenario`` holds both or
    neither).

    Raises:
        ScenarioError: a benchmark scenario (it has neither).
    """
    if scenario.model is None or scenario.training is None:
        raise ScenarioError(f"{scenario.name}: a benchmark scenario has no training plan; "
                            "use pod.config.bench.check_benchmark")
    return scenario.model, scenario.training


def _check_param_shapes(model: Model) -> None:
    """Every parameter's shape is one numpy can index (a zero-copy stand-in of it, in the
    model's storage dtype).

    Raises:
        ScenarioError: a dimension past what numpy can index (no HBM holds it either).
    """
    zero = np.zeros((), dtype=model.storage_dtype)
    for key, shape in model.param_shapes.items():
        known = (zero.dtype.str, tuple(shape))
        if known in _INDEXABLE:  # checked before (a model's blocks repeat their shapes)
            continue
        try:
            np.broadcast_to(zero, shape)
        except ValueError:
            raise ScenarioError(f"model.options: parameter {key} of shape {tuple(shape)!r:.80} is "
                                "too large for any chip's HBM; use smaller sizes") from None
        if len(_INDEXABLE) >= 65_536:
            _INDEXABLE.clear()
        _INDEXABLE.add(known)


#: (dtype, shape) that ``_check_param_shapes`` found numpy can index
_INDEXABLE: set[tuple[str, tuple[int, ...]]] = set()


def _data_field(message: str, path: str | None) -> str:
    """The ``data`` key a loader's ValueError is about: path, options, or the section."""
    if message.startswith("path "):
        return "data"  # "data: path '...' does not exist" reads as the field already
    if path and path in message:
        return "data.path"
    if "option" in message:
        return "data.options"
    return "data"


def _memory_plan(scenario: Scenario, pod: Topology, mesh: Mesh, model: Model, optimizer: Any,
                 per_device: int, program: Any, programs: ProgramFactory) -> DeviceMemory:
    """The HBM check of ``build_plan``: one device's memory as the model's program reports
    it (``DeviceProgram.memory``), fitted to the device's HBM by ``pod.config.fit`` (the
    deepest FSDP prefetch that fits; else a refusal naming a remat policy and a mesh that
    fit). ``program`` is the plan's program, or None where it cannot run on ``mesh``
    (``describe`` plans any mesh): the program on ``{data: N}`` split evenly then.

    Raises:
        HBMPlanError: one line naming the field to change: ``pod.mesh`` where a
            mesh with more sharding would fit (the transformer), else the batch
            or the model.
    """
    section, training = training_sections(scenario)
    capacity = device_hbm_bytes(pod.chip)

    def memory_of(version: Model) -> MemoryOf:
        def of(sizes, batch, prefetch):
            if version is model and dict(sizes) == mesh.sizes and program is not None:
                kw = {} if prefetch is None else {"prefetch_layers": prefetch}
                return program.memory(batch, training.precision, **kw)
            return _program_memory(programs, version, sizes, optimizer, training, batch,
                                   prefetch)
        return of

    if program is None:  # the closed form of a mesh the program cannot run
        whole = programs(model, {"data": mesh.size}, optimizer, training)
        return split_evenly(whole.memory(per_device, training.precision),
                            mesh.axis_size("fsdp"), mesh.axis_size("tensor"))
    sharded = section.name in SHARDED_MODELS
    if mesh.axis_size("stage") > 1:
        micro = pipeline_microbatches(training, mesh)
        return fit_memory(memory_of(model), mesh, per_device, capacity, search=False,
                          subject=f"{format_axes(mesh.sizes)} with {micro} microbatches "
                                  f"({training.pipeline_schedule})",
                          advice="use more stages, fsdp or tensor, 1f1b with more "
                                 "microbatches, or remat")
    variants: dict[str, Any] = getattr(model, "remat_variants", dict)()  # the transformer's
    ranked = sorted(variants.items(), key=lambda kv: kv[1].hardware_flops_per_example())
    try:
        return fit_memory(memory_of(model), mesh, per_device, capacity, search=sharded,
                          alternatives=[(remat_label(p), memory_of(m)) for p, m in ranked])
    except HBMPlanError as err:
        if sharded:
            raise  # its one line names pod.mesh and a mesh that fits
        activations = err.memory_plan.get("activations", 0) if err.memory_plan else 0
        batch = activations * 2 > err.requested_bytes
        field = "training.global_batch" if batch else "model.options"
        what = (f"{training.global_batch} ({per_device} examples per device)" if batch else
                f"{section.name} with {int(model.num_params):,} parameters")
        # "<field>: <what> on {data: 8} needs 141 GiB per device (...) and does not fit 8 GiB"
        raise HBMPlanError(
            f"{field}: {what} on {str(err).removeprefix('pod.mesh: ')}; use a smaller "
            f"{'global batch' if batch else 'model'} or a chip with more HBM per device",
            tag=err.tag, requested_bytes=err.requested_bytes,
            free_bytes=err.free_bytes, capacity_bytes=err.capacity_bytes,
            memory_plan=err.memory_plan, fits_with=err.fits_with) from None


#: (factory, model config, mesh, training and optimizer options, batch, prefetch) -> the
#: program's memory: a refusal asks it of every mesh of its devices and every remat
#: policy, and a plan search (``tpu-pod plan``) asks again for every point
_MEMORY: OrderedDict[tuple, DeviceMemory | None] = OrderedDict()
_MEMORY_ENTRIES = 4096


def _program_memory(programs: ProgramFactory, model: Model, sizes: Mapping[str, int],
                    optimizer: Any, training: TrainingConfig, batch: int,
                    prefetch: int | None) -> DeviceMemory | None:
    """``programs(model, sizes, ...).memory(batch, ...)``, or None for a layout the
    model's program cannot run; kept per key for a model whose config is a value (the
    transformer's: programs of equal configs hold the same bytes)."""
    config = getattr(model, "config", None)
    key = None
    if config is not None:
        key = (programs, config, tuple(sorted(sizes.items())), training.model_dump_json(),
               batch, prefetch)
        if key in _MEMORY:
            _MEMORY.move_to_end(key)
            return _MEMORY[key]
    try:
        built = programs(model, sizes, optimizer, training)
        kw = {} if prefetch is None else {"prefetch_layers": prefetch}
        memory: DeviceMemory | None = built.memory(batch, training.precision, **kw)
    except ValueError:  # a layout this version's program cannot run
        memory = None
    if key is not None:
        _MEMORY[key] = memory
        if len(_MEMORY) > _MEMORY_ENTRIES:
            _MEMORY.popitem(last=False)
    return memory


def _training_data(scenario: Scenario, mesh: Mesh, per_device: int, dataset: Dataset | None,
                   timing_only: bool) -> Dataset:
    """The scenario's dataset (loaded unless given), checked against the global batch."""
    training = training_sections(scenario)[1]
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
    if not timing_only and int(dataset.x_test.shape[0]) == 0:  # never a test accuracy of 0.0
        raise ScenarioError(f"{'data.path' if scenario.data.path else 'data'}: the test split of "
                            f"{dataset.name} is empty (0 examples); the test loss and accuracy "
                            "need at least one (give x_test and y_test examples)")
    shards = mesh.batch_shards
    if training.global_batch > n_train and not (timing_only and per_device * mesh.devices_per_chip
                                                   <= n_train):
        largest = n_train // shards * shards
        raise ScenarioError(
            f"training.global_batch: {training.global_batch} is larger than the "
            f"{n_train} training examples of {dataset.name}; use at most {largest} "
            f"(a multiple of {_batch_axes(mesh)} = {shards} devices), or more data"
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
    section = training_sections(scenario)[0]
    name, options = section.name, section.options
    try:
        model = _built(name, dataset, options)
        for x, y in ((dataset.x_train, dataset.y_train), (dataset.x_test, dataset.y_test)):
            model.check_data(x, y)
        return model
    except TokenIdError as err:
        if err.low < 0:  # the data's fault, not the vocabulary's
            raise ScenarioError(f"{'data.path' if scenario.data.path else 'data'}: "
                                f"{dataset.name} holds negative token ids (smallest {err.low}); "
                                "token ids are 0 (padding) and up") from None
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
            with fsdp or tensor axes (a custom model is replicated).
    """
    if not isinstance(model, Model):
        raise ScenarioError(f"model: a custom model must be a pod.workloads.Model, got "
                            f"{type(model).__name__}")
    if mesh.axis_size("data") != mesh.size:
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
    """``build_model`` for the data; an option named like one of its own arguments is a
    ValueError (``model.options: ...`` from the caller; it raised TypeError: 'got multiple
    values for argument')."""
    for key in sorted({"name", "input_shape", "num_classes"} & set(options)):
        where = "model.name" if key == "name" else "the data"
        raise ValueError(f"{key!r} is not an option of model {name!r}; it is set by {where}")
    return build_model(name, input_shape=tuple(dataset.x_train.shape[1:]),
                       num_classes=dataset.num_classes, **options)


def _fits(name: str, dataset: Dataset) -> bool:
    """Whether model ``name`` with its default options takes a sample of ``dataset``."""
    try:
        _built(name, dataset, {}).check_data(dataset.x_train[:256], dataset.y_train[:256])
    except ValueError:
        return False
    return True


def _check_quantization(scenario: Scenario, pod: Topology) -> None:
    """The transformer's int8: AQT's (``model.options.quantization: int8``,
    ``pod.workloads.quantization``), on a chip whose MXU runs int8; not every matmul in
    int8 (``training.precision: int8``, the chip's mode for single ops).

    Raises:
        ScenarioError: one line naming the field.
    """
    section, training = training_sections(scenario)
    if section.name != "transformer":
        return
    if training.precision == "int8":
        raise ScenarioError("training.precision: 'int8' would run every matmul of the "
                            "transformer in int8 (attention and logits too), which no MaxText "
                            "run does; AQT int8 training as MaxText runs it is "
                            "model.options.quantization: int8 with precision bf16")
    try:
        check_quantization(section.options.get("quantization") or "", pod.chip.core,
                           pod.chip.name)
    except ValueError as err:
        raise ScenarioError(f"model.options.{err}") from None


def _plan_program(scenario: Scenario, mesh: Mesh, model: Model, optimizer: Any,
                  programs: ProgramFactory, sharded_ok: bool) -> Any:
    """The model's device program on the mesh (``programs``: ``pod.program_factory``'s
    unless ``build_plan`` was given another): a model other than the transformer is
    replicated (``{data: N}`` only), and the transformer's program refuses a tensor size
    that does not split its heads and MLP, or experts the expert axis cannot split.

    Returns:
        The program, or None where it cannot run on the mesh and ``sharded_ok``
        (``describe`` plans any model on any mesh).

    Raises:
        ScenarioError: one line naming ``pod.mesh``.
    """
    try:
        _check_runnable_sizes(scenario, mesh.sizes, model)
        return programs(model, mesh.sizes, optimizer, training_sections(scenario)[1])
    except ScenarioError:
        if sharded_ok:
            return None
        raise
    except ValueError as err:
        if sharded_ok:
            return None
        raise ScenarioError(f"pod.mesh: {format_axes(mesh.sizes)}: {err}") from None


def _check_runnable_mesh(scenario: Scenario, mesh: Mesh, model: Model) -> None:
    """The model's device program can run on the mesh: a model other than the
    transformer is replicated (``{data: N}`` only), and a tensor size must split the
    transformer's heads and MLP, an expert size its experts.

    Raises:
        ScenarioError: one line naming ``pod.mesh``.
    """
    _check_runnable_sizes(scenario, mesh.sizes, model)


def _check_runnable_sizes(scenario: Scenario, sizes: dict[str, int], model: Model | None
                          ) -> None:
    """``_check_runnable_mesh`` of a mesh of these sizes (its axes' lengths)."""
    axes = format_axes(sizes)
    sharded = [a for a in ("stage", "fsdp", "expert", "tensor") if sizes.get(a, 1) > 1]
    name = training_sections(scenario)[0].name
    if sharded and name not in SHARDED_MODELS:
        raise ScenarioError(f"pod.mesh: {axes} shards over {' and '.join(sharded)}, which only the "
                            f"{', '.join(SHARDED_MODELS)} model does; {name} trains "
                            f"data-parallel: use {{data: {math.prod(sizes.values())}}} or leave "
                            "pod.mesh out")
    config = getattr(model, "config", None)
    if config is None or name not in SHARDED_MODELS:
        return
    try:
        check_tensor_split(config, sizes.get("tensor", 1))
        check_expert_split(config, sizes)
    except ValueError as err:
        raise ScenarioError(f"pod.mesh: {axes}: {err}") from None


def _mesh_accepts(scenario: Scenario) -> Callable[[dict[str, int]], bool]:
    """Whether the scenario's model runs on a mesh of these sizes, as far as its options
    say (``_check_runnable_sizes``; the meshes a mesh error suggests are such)."""
    section = training_sections(scenario)[0]
    try:  # the options' shapes on a stand-in sequence (only heads, MLP, experts matter)
        model = build_model(section.name, (8,), 16, **section.options)
    except (TypeError, ValueError):
        model = None  # bad options: their own error comes later

    def accepts(sizes: dict[str, int]) -> bool:
        try:
            _check_runnable_sizes(scenario, sizes, model)
        except ScenarioError:
            return False
        return True

    return accepts


def _check_sequence_parallel(scenario: Scenario, mesh: Mesh, model: Model) -> None:
    """``training.sequence_parallel`` needs the transformer, and its sequence length
    split evenly over tensor.

    Raises:
        ScenarioError: one line naming the field, the value and what is allowed.
    """
    section, training = training_sections(scenario)
    if not training.sequence_parallel:
        return
    tensor = mesh.axis_size("tensor")
    config = getattr(model, "config", None)
    if section.name not in SHARDED_MODELS or config is None:
        raise ScenarioError(f"training.sequence_parallel: true needs the transformer model on a "
                            f"mesh with a tensor axis; {section.name} has no sequence to "
                            "split: remove it")
    if tensor > 1 and config.sequence_length % tensor:
        common = math.gcd(config.heads, config.kv_heads, config.mlp_dim, config.sequence_length)
        sizes = ", ".join(str(t) for t in range(1, common + 1) if common % t == 0)
        raise ScenarioError(f"training.sequence_parallel: tensor {tensor} (pod.mesh "
                            f"{format_axes(mesh.sizes)}) does not divide the sequence length "
                            f"{config.sequence_length}; tensor sizes that split the heads, MLP "
                            f"and sequence: {sizes}; or sequence_parallel: false")


def _per_device_batch(global_batch: int, mesh: Mesh) -> int:
    """Examples per device: the batch splits over data x fsdp x expert, the devices along
    tensor share their examples (on ``{data: N}``, the batch over every device).

    Raises:
        ShardingError: the batch does not split evenly, naming the mesh (as on a
            real pod: "batch_size must be divisible by the number of devices").
    """
    shards = mesh.batch_shards
    if global_batch % shards:
        lower = global_batch // shards * shards
        nearby = f"{lower} or {lower + shards}" if lower else f"{shards}"
        raise ShardingError(f"training.global_batch: global batch {global_batch} does not split "
                            f"over {_batch_axes(mesh)} = {shards} devices of pod.mesh "
                            f"{format_axes(mesh.sizes)}; use a multiple of {shards} such as "
                            f"{nearby}")
    return global_batch // shards


def _batch_axes(mesh: Mesh) -> str:
    """The axes that split the batch, as a product: "data x fsdp" (and "x expert")."""
    return "data x fsdp" + (" x expert" if mesh.axis_size("expert") > 1 else "")


def is_timing_sweep(scenario: Scenario) -> bool:
    """True for a sweep scenario costed timing-only (``sweep.mode: timing``): ``tpu-pod run``
    refuses it, ``sweep`` plans its points with ``timing_only``, and so do ``validate`` and
    ``describe`` (its data only has to hold one chip's share of the batch)."""
    return scenario.sweep is not None and scenario.sweep.mode == "timing"


def build_plan(scenario: Scenario, *, dataset: Dataset | None = None,
               timing_only: bool = False, sharded_ok: bool = False,
               model: Model | None = None,
               programs: ProgramFactory | None = None) -> TrainingPlan:
    """Resolve and check a scenario.

    Args:
        scenario: the validated scenario.
        dataset: an already loaded dataset to reuse (else it is loaded).
        model: a custom model (``pod.workloads.Model`` built from its layers) to train
            instead of the scenario's ``model`` block; checked against every example
            of the data like a named one. Data parallel meshes only.
        timing_only: the plan is only costed (``pod.runtime.timing``): a global batch
            larger than the train split is allowed, since one device's share
            stands for the whole batch.
        sharded_ok: plan a ``pod.mesh`` without checking that the model's program
            runs on it (``describe`` plans any model on any mesh).
        programs: builds the model's device program, whose memory the plan fits
            (``pod.program_factory.training_program`` unless given; config never
            imports a program).

    Returns:
        The plan.

    Raises:
        ScenarioError, ShardingError, HBMOutOfMemoryError, ChipSpecError,
        TopologyError: with one-line messages naming the field.
    """
    training = training_sections(scenario)[1]
    cfg = scenario.pod
    pod = resolve_pod(slice_name=cfg.slice, chip=cfg.chip, chips=cfg.chips,
                      topology=cfg.topology, wraparound=cfg.wraparound, slices=cfg.slices)
    check_links(cfg.links, pod.torus)
    mesh = build_mesh(cfg.mesh, pod, cfg.dcn_mesh,
                      accepts=None if sharded_ok else _mesh_accepts(scenario))
    if mesh.dcn_size("expert") > 1:
        raise ScenarioError(f"pod.dcn_mesh: expert {mesh.dcn_size('expert')} puts a mixture of "
                            "experts' all-to-alls across slices, which is not modelled; keep "
                            "expert in pod.mesh (one slice) and data or fsdp over the DCN")
    try:
        check_precision(training.precision, pod.chip.core, pod.chip.name)
    except ValueError as err:
        raise ScenarioError(f"training.precision: {err}") from None
    _check_quantization(scenario, pod)
    per_device = _per_device_batch(training.global_batch, mesh)
    dataset = _training_data(scenario, mesh, per_device, dataset, timing_only)
    n_train = int(dataset.x_train.shape[0])
    model = (_model_for_data(scenario, dataset) if model is None
             else _custom_model_for_data(model, dataset, mesh))
    try:
        optimizer = build_optimizer(training.optimizer.name, **training.optimizer.options())
    except ValueError as err:
        raise ScenarioError(f"training.optimizer: {err}") from None
    check_pipeline_plan(scenario, mesh, model)
    steps, steps_per_epoch = _steps(scenario, n_train)
    _check_param_shapes(model)
    _check_sequence_parallel(scenario, mesh, model)
    # before the HBM plan: a mesh the model cannot run is the first fix
    programs = training_program if programs is None else programs
    program = _plan_program(scenario, mesh, model, optimizer, programs, sharded_ok)
    memory = _memory_plan(scenario, pod, mesh, model, optimizer, per_device, program, programs)
    faults = FaultPlan(scenario.faults, pod.chips, pod.chip.chips_per_host, cfg.links,
                       slices=pod.slices)
    ici = plan_ici(pod, mesh, int(model.num_params), cfg.data_allreduce)
    by_step = tuple((step, _mesh_costs(mesh, ici, pod.chip, in_force, field,
                                       faults.dcn_slowdown(step), cfg.collective_algorithms))
                    for step, in_force, field in _link_faults_by_step(faults, pod.torus))
    return TrainingPlan(scenario=scenario, topology=pod, dataset=dataset, model=model,
                        per_device_batch=per_device, steps=int(steps),
                        steps_per_epoch=steps_per_epoch, memory=memory.items(), ici=ici,
                        faults=faults, mesh=mesh, collective_costs=by_step[0][1],
                        collective_costs_by_step=by_step,
                        bucket_elements=(training.overlap_bucket_bytes // 4 if training.overlap
                                         else None), device_memory=memory)


def _steps(scenario: Scenario, n_train: int) -> tuple[int, int]:
    """(optimizer steps to run, full global batches in one pass over ``n_train``
    examples): ``training.steps``, or ``training.epochs`` passes.

    Raises:
        ScenarioError: a fault after the last step (it would never happen).
    """
    training = training_sections(scenario)[1]
    steps_per_epoch = max(1, n_train // training.global_batch)
    if training.steps is not None:
        steps = training.steps
    else:
        assert training.epochs is not None  # TrainingConfig holds steps or epochs
        steps = training.epochs * steps_per_epoch
    for index, fault in enumerate(scenario.faults):
        if fault.step > steps:
            raise ScenarioError(f"faults.{index}.step: {fault.step} is after the last step "
                                f"({steps}); the fault would never happen")
    return int(steps), steps_per_epoch


def _mesh_costs(mesh: Mesh, ici: IciPlan, chip, faults=None, field: str = "pod.links",
                dcn_slowdown: float = 1.0, algorithms: dict[str, str] | None = None
                ) -> MeshCollectiveCosts:
    """The mesh's collective costs on the plan's link with the link ``faults`` in force,
    on-chip steps at ``on_chip_bandwidth``, an axis over the whole pod allreduced by
    the plan's algorithm, every other axis by ``algorithms`` (``pod.collective_algorithms``;
    torus where not named), the DCN at the chip's bandwidth / ``dcn_slowdown`` (a
    slow_dcn fault).

    Raises:
        ScenarioError: a failed link on a mesh of a device per TensorCore (v2 / v3),
            whose rerouted collectives are not modelled; ``field`` names the entry.
    """
    sharded = mesh.in_slice.axis_size("data") != mesh.in_slice.size
    if faults is not None and faults.failed and mesh.devices_per_chip > 1 and sharded:
        raise ScenarioError(f"{field}: a failed link on a sharded mesh of a device per "
                            f"TensorCore (pod.mesh {format_axes(mesh.sizes)}) is not modelled "
                            "(its rerouted collectives have chip ranks only); use slowdown, a "
                            "v4 / v5e / v5p / v6e pod, or {data: N}")
    return MeshCollectiveCosts(mesh, ici.link, on_chip_bandwidth(chip), faults,
                               torus_algorithm=ici.algorithm if ici.whole_pod else None,
                               axis_algorithms=dict(algorithms or {}),
                               dcn_bytes_per_s=chip.dcn_bytes_per_s / dcn_slowdown,
                               dcn_latency_s=chip.dcn_latency_s)


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


def plan_ici(pod: Topology, mesh: Mesh, num_elements: int, algorithm: str) -> IciPlan:
    """Decide the allreduce of a data axis that spans the whole pod.

    The algorithm is decided once: the given one, or with ``auto`` the one XLA
    runs on a TPU slice, ``torus`` (every torus axis at once, both directions:
    ``interconnect.chains``; the calibration of VALIDATION.md reads the published
    collective rows with it, and the fastest of the textbook algorithms
    underestimates small slices without wraparound by up to 68%: C8 / C10). Every
    step's collectives are then costed with it where a data axis spans the slice
    (``MeshCollectiveCosts``, link faults in force); nothing is costed here.

    Args:
        pod: chip preset and torus.
        mesh: the device mesh.
        num_elements: float32 elements of the gradient buffer (parameters).
        algorithm: ``pod.allreduce`` (a name or "auto").
    """
    link = calibrated_link(pod.chip.name, pod.chip.ici_link_bandwidth_bytes_per_s,
                           pod.chip.ici_latency_s)
    one = mesh.in_slice
    whole = "data" in one.axis_names and one.axis_size("data") == one.size and one.size > 1
    return IciPlan(algorithm="torus" if algorithm == "auto" else algorithm,
                   num_elements=num_elements, link=link, whole_pod=whole)

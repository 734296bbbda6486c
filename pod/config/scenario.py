"""Scenario files: the one place YAML becomes a typed, frozen ``Scenario``.

A scenario says which pod to emulate, what to train on it and how. The file
is parsed with ``yaml.safe_load`` (no object construction) and validated with
pydantic; unknown keys and bad values are rejected with the field's path, the
value received and what is allowed, in one line (``ScenarioError``).

Everything is bounded, so a small hostile file costs milliseconds: the file
(``MAX_SCENARIO_BYTES``), its nesting (``MAX_YAML_DEPTH``), its aliases
(``MAX_YAML_ALIASES``, ``MAX_YAML_NODES`` once expanded), every number (the
``MAX_*`` constants below, far above real use) and every value quoted in a
message (a bounded ``repr``).

Format (every key but ``pod``, ``model`` and ``training.global_batch`` has a
default)::

    name: quickstart                 # used for the output directory
    description: free text
    pod:
      slice: v2-8                    # a Google slice name, or:
      chip: v2                       #   a chip preset ...
      chips: 4                       #   ... and a chip count
      topology: 2x2                  # torus shape (default: from the slice)
      wraparound: true               # default: the generation's rules
      allreduce: auto                # auto | torus | bidirectional_ring | ring |
                                     # halving_doubling | tree (auto: torus, what XLA runs)
      mesh: {data: 2, tensor: 2}     # device mesh, axes data | stage | fsdp | expert | tensor, -1:
                                     # the rest (pod/config/mesh.py; default {data: every
                                     # device}); stage: pipeline stages (the transformer)
      collective_algorithms: {tensor: ring}  # per mesh axis: torus (default, what XLA
                                     # runs) | bidirectional_ring | ring (interconnect/
                                     # registry.py); data's is also allreduce's
      links:                         # slowed or failed directed ICI links
        - {link: "0->1", slowdown: 2.0}
        - {link: "1->2", failed: true}
    model:
      name: cnn                      # cnn | mlp | lstm_classifier | char_lstm | transformer
                                     # | resnet (pod.workloads.models.MODEL_NAMES)
      options: {dropout: true}       # model-specific options
    data:
      name: digits                   # digits | synthetic | mnist | cifar10 | imdb | text
                                     # | synthetic_text (pod.workloads datasets)
      test_fraction: 0.2
      options: {}
    training:
      global_batch: 256              # split over the mesh's data and fsdp axes
      steps: 200                     # or epochs: N (exactly one of them)
      optimizer: {name: adam, learning_rate: 0.002}
      precision: bf16
      seed: 0
      eval_every_steps: 0            # 0: evaluate at the end only
      microbatches: 8                # pipeline (pod.mesh stage > 1): microbatches per step
                                     # (default: the stages)
      pipeline_schedule: gpipe       # gpipe | 1f1b | circular
      pipeline_repeats: 1            # circular: chunks of layers per stage
      pipeline_fsdp_ag_once: false   # gather a stage's fsdp shards once per step
    metrics:
      port: 9188                     # 0 disables the Prometheus endpoint
      host: 127.0.0.1
    ray:
      address: null                  # join this cluster; else RAY_ADDRESS; else local
      dashboard: false               # a local cluster keeps Ray's dashboard (127.0.0.1:8265)
    checkpoint:                      # optional: periodic checkpoints (pod/state/)
      every_steps: 50                # a checkpoint after every 50th step, and at the end
      dir: checkpoints               # relative to the scenario file; default <output>/checkpoints
      keep: 3                        # the newest 3 are kept
    faults:                          # optional: faults injected into the run (pod/faults.py);
                                     # step is 1-based, as in the progress lines
      - {kind: kill_chip, chip: 2, step: 30}
      - {kind: kill_host, host: 1, step: 60}
      - {kind: slow_chip, chip: 1, factor: 3.0, step: 1}
      - {kind: slow_link, link: "0->1", slowdown: 4.0, step: 10}
      - {kind: fail_link, link: "1->3", step: 20}
"""

from __future__ import annotations

import difflib
import ipaddress
import math
import re
import reprlib
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails

from chip import MXU_MODELS
from chip import PRECISIONS as CHIP_PRECISIONS
from interconnect import ALLREDUCE_ALGORITHMS, MESH_ALGORITHMS
from pod.errors import ScenarioError
from pod.safe_io import read_regular
from pod.workloads import DATASET_NAMES, MODEL_NAMES, OPTIMIZER_NAMES

#: ``pod.allreduce`` values: an interconnect algorithm, or auto (torus: what XLA runs).
ALLREDUCE_CHOICES = ("auto", *ALLREDUCE_ALGORITHMS)

__all__ = [
    "Scenario",
    "scenario_from_text",
    "PodConfig",
    "ModelConfig",
    "DataConfig",
    "OptimizerConfig",
    "TrainingConfig",
    "MetricsConfig",
    "RayConfig",
    "load_scenario",
    "load_yaml",
    "parse_scenario",
    "PRECISIONS",
    "BenchmarkConfig",
    "BENCHMARK_KINDS",
    "CheckpointConfig",
    "FaultConfig",
    "FAULT_KINDS",
]

PRECISIONS = CHIP_PRECISIONS  # bf16 | fp32 | int8 (chip.PRECISIONS; int8 not on v2 / v3)

# Upper bounds on every number of a scenario, so that no value can overflow the
# cost model or ask for absurd work; each is far above any real use.
#: chips in a pod: the largest Google slice, v5p-17920, has 8,960 chips
MAX_CHIPS = 16384
#: multislice: slices joined by the DCN (the largest published job: 199 v5e-256 slices,
#: 50,944 chips)
MAX_SLICES = 256
#: examples per global batch (2**24; the largest published TPU batches are ~65k)
MAX_GLOBAL_BATCH = 1 << 24
#: optimizer steps (or steps between checkpoints / evaluations) of one run
MAX_STEPS = 100_000_000
#: passes over the train split
MAX_EPOCHS = 1_000_000
#: a slowed link's bandwidth divisor or a straggler's compute factor
MAX_SLOWDOWN = 1e6
#: the seed (numpy's generators take any non-negative int; 2**32 - 1 is plenty)
MAX_SEED = 2**32 - 1
#: checkpoints kept
MAX_KEEP = 10_000
#: a learning rate (any real one is below 10)
MAX_LEARNING_RATE = 1e3
#: matrix size n of a benchmark (an n x n matrix; costs only above a few thousand)
MAX_BENCH_N = 1 << 17
#: iterations of a benchmark
MAX_BENCH_ITERATIONS = 1_000_000
#: matrix size and iterations of the host numpy measurement
MAX_CPU_N, MAX_CPU_ITERATIONS = 8192, 10_000
#: floating-point operations of the host numpy measurement, all iterations: 2^38 is
#: seconds of numpy (this 2-core host: 30-60 GFLOP/s; the default 1,024 x 10 is 2^34)
MAX_CPU_FLOPS = 1 << 38
#: characters of a scenario's name and description
MAX_NAME_CHARS, MAX_DESCRIPTION_CHARS = 128, 10_000
#: chunks of layers per pipeline stage (the circular schedule's repeats)
MAX_PIPELINE_REPEATS = 1024
#: points of one sweep (the product of its lists), counted before any is built: a point
#: takes 0.1-1 s timing-only, its row about 2 KB in the journal
MAX_SWEEP_POINTS = 10_000
BENCHMARK_KINDS = ("matmul", "matrix_add")
HOST_DISPATCH = ("device_loop", "per_step")


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_number(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic's lax mode reads true as 1 and false as 0; in a scenario that is a mistake
        if isinstance(value, bool) and info.field_name in cls.model_fields:
            annotation = cls.model_fields[info.field_name].annotation
            kinds = typing.get_args(annotation) or (annotation,)
            if bool not in kinds and (int in kinds or float in kinds):
                raise ValueError("must be a number, not true/false")
        return value


class LinkConfig(_Frozen):
    """One slowed or failed directed ICI link, e.g. ``{link: "0->1", slowdown: 2.0}``."""

    link: str = Field(pattern=r"^\s*\d+\s*->\s*\d+\s*$", description="src->dst chip ranks")
    slowdown: float | None = Field(default=None, ge=1.0, le=MAX_SLOWDOWN, allow_inf_nan=False,
                                   description="the link runs at bandwidth / slowdown")
    failed: bool = False

    @model_validator(mode="after")
    def _slow_or_failed(self) -> LinkConfig:
        if (self.slowdown is not None) == self.failed:
            raise ValueError("give either slowdown: <factor >= 1> or failed: true")
        return self


class PodConfig(_Frozen):
    """Which pod: a slice name, or a chip preset with a count or a shape."""

    slice: str | None = Field(default=None, description="Google slice name, e.g. v2-8")
    chip: str | None = Field(default=None, description="chip preset: v2 v3 v4 v5e v5p v6e")
    chips: int | None = Field(default=None, gt=0, le=MAX_CHIPS, description="number of chips")
    topology: str | None = Field(default=None, max_length=64,
                                 description="torus shape, e.g. 2x2 or 4x4x4")
    wraparound: bool | None = None
    allreduce: str = Field(default="auto", description="allreduce algorithm or auto")
    links: tuple[LinkConfig, ...] = ()
    # pipelined: weights double-buffered, one pipeline bubble per op (the hardware [SB]);
    # scalesim: SCALE-Sim's weight-stationary count, a weight load and fill/drain per fold
    mxu_model: str = "pipelined"
    # pod.mesh: axis name -> size within a slice (pod/config/mesh.py, MaxText's
    # ici_*_parallelism); None: {data: every device of a slice}
    mesh: dict[str, int] | None = None
    # multislice: identical slices joined by the data-centre network; pod.dcn_mesh: each
    # axis's factor across them (MaxText's dcn_*_parallelism); None: {data: slices}
    slices: int = Field(default=1, ge=1, le=MAX_SLICES, description="slices over the DCN")
    dcn_mesh: dict[str, int] | None = None
    # pod.collective_algorithms: mesh axis -> the algorithm of its allreduces, reduce-
    # scatters and all-gathers, by the registry's names (interconnect.MESH_ALGORITHMS);
    # an axis not named runs torus, as XLA does (every torus axis of its block at once,
    # both directions). data's also sets pod.allreduce's (a data axis over the slice).
    collective_algorithms: dict[str, str] = Field(default_factory=dict)

    @field_validator("mesh", mode="before")
    @classmethod
    def _mesh_axes(cls, value: Any) -> Any:
        # ScenarioError is a ValueError: pydantic reports it
        from pod.config.mesh import parse_mesh_axes

        return None if value is None else parse_mesh_axes(value)

    @field_validator("dcn_mesh", mode="before")
    @classmethod
    def _dcn_axes(cls, value: Any) -> Any:
        from pod.config.mesh import parse_mesh_axes

        return None if value is None else parse_mesh_axes(value)

    @field_validator("allreduce")
    @classmethod
    def _known_allreduce(cls, value: str) -> str:
        return _one_of(value, ALLREDUCE_CHOICES)

    @field_validator("collective_algorithms", mode="before")
    @classmethod
    def _known_collective_algorithms(cls, value: Any) -> Any:
        from pod.config.mesh import AXIS_NAMES

        if not isinstance(value, dict):
            raise ValueError(f"must be a mapping of mesh axis to algorithm such as "
                             f"{{fsdp: torus, data: ring}}; axes: {', '.join(AXIS_NAMES)}")
        for axis, algorithm in value.items():
            if axis not in AXIS_NAMES:
                raise ValueError(f"unknown mesh axis {axis!r}; allowed: {', '.join(AXIS_NAMES)}")
            if algorithm not in MESH_ALGORITHMS:
                raise ValueError(f"{axis}: {algorithm!r} is not an algorithm of a mesh axis; "
                                 f"allowed: {', '.join(MESH_ALGORITHMS)}")
        return value

    @field_validator("mxu_model")
    @classmethod
    def _known_mxu_model(cls, value: str) -> str:
        return _one_of(value, MXU_MODELS)

    @field_validator("topology", mode="before")
    @classmethod
    def _shape_is_text(cls, value: Any) -> Any:
        # YAML reads 8 as a number and 0x4 as the hexadecimal number 4: refuse rather than guess
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            raise ValueError("must be a shape in quotes such as \"8\", \"4x4\" or \"4x4x4\" "
                             "(YAML reads an unquoted 8 as a number and 0x4 as hexadecimal 4)")
        return value

    @field_validator("topology")
    @classmethod
    def _not_too_many_chips(cls, value: str | None) -> str | None:
        dims = re.findall(r"\d+", value or "")
        if dims and math.prod(int(d) for d in dims) > MAX_CHIPS:
            raise ValueError(f"holds {math.prod(int(d) for d in dims):,} chips; at most "
                             f"{MAX_CHIPS:,} (the largest Google slice has 8,960)")
        return value

    @model_validator(mode="after")
    def _one_way(self) -> PodConfig:
        if not self.slice and not self.chip:
            raise ValueError("give either slice (e.g. v2-8) or chip (e.g. v2) with chips")
        if self.dcn_mesh is not None:
            sizes = dict(self.dcn_mesh)
            rest = [a for a, n in sizes.items() if n == -1]
            given = math.prod(n for n in sizes.values() if n != -1)
            if (rest and self.slices % given) or (not rest and given != self.slices):
                from pod.config.mesh import format_axes

                raise ValueError(f"dcn_mesh: {format_axes(sizes)} must multiply to pod.slices "
                                 f"{self.slices} (one size may be -1: the rest), e.g. "
                                 f"{{data: {self.slices}}}")
            if rest:
                sizes[rest[0]] = self.slices // given
            object.__setattr__(self, "dcn_mesh", sizes)
        data = self.collective_algorithms.get("data")
        if data is not None and self.allreduce not in ("auto", data):
            raise ValueError(f"collective_algorithms: data: {data} contradicts allreduce: "
                             f"{self.allreduce} (the data axis's allreduce); give one of them")
        return self

    @property
    def data_allreduce(self) -> str:
        """The allreduce of a data axis over a whole slice: ``collective_algorithms``'
        data, else ``allreduce`` (``auto``: torus, what XLA runs)."""
        return self.collective_algorithms.get("data", self.allreduce)


def _one_of(value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"must be one of {', '.join(allowed)}")
    return value


class ModelConfig(_Frozen):
    """The model to train, by name (``pod.workloads.MODEL_NAMES``), with its options; or a
    published model by ``preset`` (``pod.config.presets``: the transformer with the preset's
    options, then ``options`` over them)."""

    name: str
    options: dict[str, Any] = Field(default_factory=dict)
    preset: str | None = Field(default=None, description="a published model, e.g. llama3.1-8b")
    global_parameter_scale: int | None = Field(default=None, ge=1, le=1 << 20,
                                               description="the maxtext-2023 preset's scale")

    @model_validator(mode="before")
    @classmethod
    def _expand_preset(cls, value: Any) -> Any:
        from pod.config.presets import expand_model  # ScenarioError is a ValueError

        return expand_model(value)

    @field_validator("options")
    @classmethod
    def _not_an_argument(cls, value: dict[str, Any]) -> dict[str, Any]:
        # build_model(name, input_shape, num_classes, **options): these are set elsewhere
        # (a TypeError traceback before; `model.options.name=x` on the command line reaches it)
        where = {"name": "model.name", "input_shape": "the data's example shape",
                 "num_classes": "the data's classes (the vocabulary for token models)"}
        for key in sorted(set(value) & set(where)):
            raise ValueError(f"{key!r} is not a model option; it is set by {where[key]}")
        return value

    @field_validator("name")
    @classmethod
    def _known_model(cls, value: str) -> str:
        return _one_of(value, MODEL_NAMES)


class DataConfig(_Frozen):
    """The dataset, by name (``pod.workloads.DATASET_NAMES``), and the test share."""

    name: str = "digits"

    @field_validator("name")
    @classmethod
    def _known_dataset(cls, value: str) -> str:
        return _one_of(value, DATASET_NAMES)

    test_fraction: float = Field(default=0.2, gt=0.0, lt=1.0)
    options: dict[str, Any] = Field(default_factory=dict)
    path: str | None = Field(default=None, min_length=1,
                             description="file or directory of a file-backed dataset; relative "
                                         "to the scenario file")


class OptimizerConfig(_Frozen):
    """Optimizer name and hyper-parameters."""

    name: str = "adam"
    learning_rate: float = Field(default=1e-3, gt=0.0, le=MAX_LEARNING_RATE, allow_inf_nan=False)
    momentum: float | None = Field(default=None, ge=0.0, lt=1.0)
    beta1: float | None = Field(default=None, ge=0.0, lt=1.0)
    beta2: float | None = Field(default=None, ge=0.0, lt=1.0)
    eps: float | None = Field(default=None, gt=0.0, le=1.0)
    weight_decay: float | None = Field(default=None, ge=0.0, le=1.0, allow_inf_nan=False)

    @field_validator("name")
    @classmethod
    def _known_optimizer(cls, value: str) -> str:
        return _one_of(value, OPTIMIZER_NAMES)

    @model_validator(mode="after")
    def _options_fit(self) -> OptimizerConfig:
        # "<key>: ..." names the sub-field in the one-line message (see _describe_error)
        for key in ("beta1", "beta2", "eps", "weight_decay"):
            if self.name == "sgd" and getattr(self, key) is not None:
                raise ValueError(f"{key}: belongs to adam / adamw, not sgd (got "
                                 f"{getattr(self, key)!r}); sgd takes learning_rate and momentum")
        if self.name in ("adam", "adamw") and self.momentum is not None:
            raise ValueError(f"momentum: belongs to sgd, not {self.name} (got {self.momentum!r}); "
                             f"{self.name} takes learning_rate, beta1, beta2 and eps"
                             + (" and weight_decay" if self.name == "adamw" else ""))
        if self.name == "adam" and self.weight_decay is not None:
            raise ValueError(f"weight_decay: belongs to adamw, not adam "
                             f"(got {self.weight_decay!r}); "
                             "use name: adamw for decoupled weight decay")
        return self

    def options(self) -> dict[str, float]:
        """The hyper-parameters that were given, as keyword arguments."""
        fields = ("learning_rate", "momentum", "beta1", "beta2", "eps", "weight_decay")
        return {k: getattr(self, k) for k in fields if getattr(self, k) is not None}


class TrainingConfig(_Frozen):
    """How to train: batch, length, optimizer, numerics, seed."""

    global_batch: int = Field(gt=0, le=MAX_GLOBAL_BATCH)
    steps: int | None = Field(default=None, gt=0, le=MAX_STEPS)
    epochs: int | None = Field(default=None, gt=0, le=MAX_EPOCHS)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    precision: str = "bf16"
    seed: int = Field(default=0, ge=0, le=MAX_SEED)
    eval_every_steps: int = Field(default=0, ge=0, le=MAX_STEPS)
    # XLA's async collectives: each layer's gradients are allreduced as the backward
    # pass produces them and infeed is double-buffered; false: one allreduce after the
    # backward pass, everything in sequence (the sum, an upper bound)
    overlap: bool = True
    # the overlapped allreduce combines consecutive layers' gradients into buckets of up
    # to this many bytes (as XLA's all-reduce combiner does; a larger layer is a bucket
    # of its own): fewer fixed costs per collective, less overlap
    overlap_bucket_bytes: int = Field(default=32 * 2**20, gt=0, le=2**40)
    # device_loop: steps looped on the device (no host call per step, as training loops
    # run); per_step: one host dispatch per step (about 100 us [PALLAS] C3)
    host_dispatch: str = "device_loop"
    # Megatron sequence parallelism over the mesh's tensor axis (transformer): between
    # blocks the activations are split over the sequence, so each tensor allreduce
    # becomes a reduce-scatter and an all-gather; no effect without a tensor axis
    sequence_parallel: bool = False
    # a step whose loss is NaN or infinite stops the run (exit 2, the checkpoints of the
    # steps before kept); true: go on training (what a diverging run does on hardware)
    continue_on_nonfinite_loss: bool = False
    # pipeline parallelism over pod.mesh's stage axis (the transformer;
    # pod/programs/pipeline.py): microbatches per step (MaxText num_pipeline_microbatches;
    # default: the stages, as MaxText's -1), the schedule (gpipe | 1f1b | circular) and
    # the circular schedule's repeats (num_pipeline_repeats: chunks of layers per stage)
    microbatches: int | None = Field(default=None, gt=0, le=MAX_GLOBAL_BATCH)
    pipeline_schedule: str = "gpipe"
    pipeline_repeats: int = Field(default=1, gt=0, le=MAX_PIPELINE_REPEATS)
    # MaxText pipeline_fsdp_ag_once: a stage all-gathers its layers' fsdp shards once
    # per step (per repeat), not once per microbatch, and holds them for the step
    pipeline_fsdp_ag_once: bool = False

    @field_validator("precision")
    @classmethod
    def _known_precision(cls, value: str) -> str:
        return _one_of(value, PRECISIONS)

    @field_validator("host_dispatch")
    @classmethod
    def _known_dispatch(cls, value: str) -> str:
        return _one_of(value, HOST_DISPATCH)

    @field_validator("pipeline_schedule")
    @classmethod
    def _known_schedule(cls, value: str) -> str:
        from pod.program_factory import PIPELINE_SCHEDULES

        return _one_of(value, PIPELINE_SCHEDULES)

    @model_validator(mode="after")
    def _steps_or_epochs(self) -> TrainingConfig:
        if self.steps is not None and self.epochs is not None:
            raise ValueError(f"give steps or epochs, not both (got steps {self.steps} and "
                             f"epochs {self.epochs})")
        if self.steps is None and self.epochs is None:
            raise ValueError("give steps (optimizer steps) or epochs (passes over the train "
                             "split) (got neither)")
        return self


def is_loopback(host: str) -> bool:
    """True for a loopback address (127.0.0.0/8, ::1) or ``localhost``; no name is
    looked up (a lookup could wait on DNS without bound)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


class MetricsConfig(_Frozen):
    """The Prometheus endpoint: on loopback unless ``expose`` says otherwise.

    Serving metrics beyond loopback (``host: 0.0.0.0``, a LAN address) lets
    anyone who reaches the machine read them: it needs ``expose: true``, and the
    run prints a warning.
    """

    port: int = Field(default=9188, ge=0, le=65535)
    host: str = Field(default="127.0.0.1", min_length=1, max_length=253)
    expose: bool = Field(default=False, description="serve on a host beyond loopback (0.0.0.0, "
                                                    "a network address): a deliberate choice")

    @model_validator(mode="after")
    def _exposure_is_a_choice(self) -> MetricsConfig:
        if not is_loopback(self.host) and not self.expose:
            raise ValueError(f"host: {self.host!r} is beyond loopback: anyone who reaches this "
                             "machine could read the metrics; set metrics.expose: true to serve "
                             "them there, or use 127.0.0.1")
        return self


class RayConfig(_Frozen):
    """Where the chip actors run, and whether a local cluster keeps Ray's dashboard."""

    address: str | None = None
    dashboard: bool = Field(default=False, description="a local cluster started for the run "
                                                       "serves Ray's dashboard on 127.0.0.1:8265 "
                                                       "(needs 'ray[default]')")


class CheckpointConfig(_Frozen):
    """Periodic checkpoints: every ``every_steps`` steps (and at the end), the newest
    ``keep`` kept, in ``dir`` (relative to the scenario file; None: <output dir>/checkpoints)."""

    every_steps: int = Field(gt=0, le=MAX_STEPS, description="steps between checkpoints")
    dir: str | None = Field(default=None, min_length=1, description="checkpoint directory")
    keep: int = Field(default=3, ge=1, le=MAX_KEEP, description="checkpoints kept, newest first")


#: ``faults[].kind`` values and the fields each one needs.
FAULT_KINDS = {"kill_chip": ("chip",), "kill_host": ("host",), "slow_chip": ("chip", "factor"),
               "slow_link": ("link", "slowdown"), "fail_link": ("link",),
               "slow_dcn": ("slice", "slowdown")}
_FAULT_FIELDS = ("chip", "host", "factor", "link", "slowdown", "slice")


class FaultConfig(_Frozen):
    """One injected fault. ``step`` is 1-based (as the progress lines count): a kill
    happens during that step; a slowdown or a failed link holds from that step on.

    kill_chip {chip}: the chip's actor is killed (``ray.kill``); kill_host {host}:
    every chip actor of that TPU host; slow_chip {chip, factor}: the chip's simulated
    compute seconds x factor (a straggler); slow_link {link, slowdown}: the directed
    ICI link runs at bandwidth / slowdown; fail_link {link}: it carries nothing, the
    allreduce is routed around it; slow_dcn {slice, slowdown}: the slice's data-centre
    network interfaces run at bandwidth / slowdown (multislice), so every collective
    across slices does (a ring runs at its slowest member's pace).
    """

    kind: str
    step: int = Field(default=1, gt=0, le=MAX_STEPS,
                      description="1-based step the fault starts at")
    chip: int | None = Field(default=None, ge=0, lt=MAX_CHIPS, description="chip rank")
    host: int | None = Field(default=None, ge=0, lt=MAX_CHIPS, description="TPU host index")
    factor: float | None = Field(default=None, ge=1.0, le=MAX_SLOWDOWN, allow_inf_nan=False,
                                 description="compute slowdown factor of a straggler")
    link: str | None = Field(default=None, pattern=r"^\s*\d+\s*->\s*\d+\s*$",
                             description="src->dst chip ranks")
    slowdown: float | None = Field(default=None, ge=1.0, le=MAX_SLOWDOWN, allow_inf_nan=False,
                                   description="link bandwidth divisor")
    slice: int | None = Field(default=None, ge=0, lt=MAX_SLICES,
                              description="slice index (multislice: 0 .. pod.slices - 1)")

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, value: str) -> str:
        return _one_of(value, tuple(FAULT_KINDS))

    @model_validator(mode="after")
    def _fields_of_kind(self) -> FaultConfig:
        needed = FAULT_KINDS[self.kind]
        missing = [f for f in needed if getattr(self, f) is None]
        if missing:
            raise ValueError(f"{self.kind} needs {' and '.join(needed)}; {missing[0]} is missing")
        extra = [f for f in _FAULT_FIELDS if f not in needed and getattr(self, f) is not None]
        if extra:
            raise ValueError(f"{extra[0]} does not belong to {self.kind} "
                             f"(it takes {', '.join(needed)} and step)")
        return self


class BenchmarkConfig(_Frozen):
    """A seed benchmark instead of training (see ``pod.commands.bench``).

    kind: matmul (x <- x . y on each TensorCore) or matrix_add (c = a + b on
    the VPU); n: matrix size; iterations; precision of the MXU (matmul);
    functional: really compute (False: costs only, for full size); cpu_n and
    cpu_iterations: the host numpy measurement, scaled down to take seconds.
    """

    kind: str
    n: int = Field(default=4096, gt=0, le=MAX_BENCH_N)
    iterations: int = Field(default=100, gt=0, le=MAX_BENCH_ITERATIONS)
    precision: str = "bf16"
    functional: bool = False
    seed: int = Field(default=0, ge=0, le=MAX_SEED)
    cpu_n: int = Field(default=1024, gt=0, le=MAX_CPU_N)
    cpu_iterations: int = Field(default=10, gt=0, le=MAX_CPU_ITERATIONS)

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, value: str) -> str:
        return _one_of(value, BENCHMARK_KINDS)

    @model_validator(mode="after")
    def _host_work(self) -> BenchmarkConfig:
        per = 2 * self.cpu_n ** 3 if self.kind == "matmul" else self.cpu_n ** 2
        if per * self.cpu_iterations > MAX_CPU_FLOPS:
            raise ValueError(f"cpu_n {self.cpu_n:,} x cpu_iterations {self.cpu_iterations:,} is "
                             f"{per * self.cpu_iterations:.3g} FLOPs of host numpy, more than "
                             f"the {MAX_CPU_FLOPS:.3g} allowed (minutes to hours); the host "
                             "measurement is scaled down to take seconds: lower cpu_n or "
                             "cpu_iterations")
        return self

    @field_validator("precision")
    @classmethod
    def _known_precision(cls, value: str) -> str:
        return _one_of(value, PRECISIONS)


class SweepConfig(_Frozen):
    """A scaling experiment: the scenario run at every combination of these values.

    ``scaling: weak`` keeps ``per_core_batch`` fixed (one value or a list, a
    series each; the global batch grows
    with the TensorCores); ``strong`` keeps the global batch fixed (the
    scenario's, or each of ``global_batch``). Pods come from ``slices``, or
    ``chips`` (with ``pod.chip``), or ``topologies`` (shapes, with ``pod.chip``).
    """

    mode: Literal["timing", "functional"] = "timing"
    scaling: Literal["weak", "strong"] = "strong"
    per_core_batch: tuple[Annotated[int, Field(gt=0, le=MAX_GLOBAL_BATCH)], ...] | None = Field(
        default=None, min_length=1)

    @field_validator("per_core_batch", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, int) and not isinstance(value, bool) else value
    slices: tuple[str, ...] | None = Field(default=None, min_length=1)
    chips: tuple[Annotated[int, Field(gt=0, le=MAX_CHIPS)], ...] | None = Field(default=None,
                                                                             min_length=1)
    topologies: tuple[str, ...] | None = Field(default=None, min_length=1)
    allreduce: tuple[str, ...] | None = Field(default=None, min_length=1)
    global_batch: tuple[Annotated[int, Field(gt=0, le=MAX_GLOBAL_BATCH)], ...] | None = Field(
        default=None, min_length=1)
    precision: tuple[str, ...] | None = Field(default=None, min_length=1)
    # sharded layouts (pod/config/mesh.py): a list of pod.mesh values, transformer remat
    # policies, and examples per device (the global batch is that x data x fsdp)
    mesh: tuple[dict[str, int], ...] | None = Field(default=None, min_length=1)
    remat: tuple[Literal["none", "full", "minimal", "save_dot_except_mlp",  # pod.workloads.remat
                         "save_dot_except_mlpwi", "save_qkv_proj",
                         "save_dot_with_context_except_mlp", "save_out_proj",
                         "qkv_proj_offloaded", "minimal_offloaded"], ...] | None = Field(
        default=None, min_length=1)
    per_device_batch: tuple[Annotated[int, Field(gt=0, le=MAX_GLOBAL_BATCH)], ...] | None = Field(
        default=None, min_length=1)
    # multislice: pod.slices per point (MaxText's num_slices), the DCN axis of
    # pod.dcn_mesh ({data: K} by default) as long as the slices
    num_slices: tuple[Annotated[int, Field(gt=0, le=MAX_SLICES)], ...] | None = Field(
        default=None, min_length=1)
    # pipelines (a mesh with a stage axis): training.microbatches per point
    microbatches: tuple[Annotated[int, Field(gt=0, le=MAX_GLOBAL_BATCH)], ...] | None = Field(
        default=None, min_length=1)
    steps: int = Field(default=2, gt=0, le=MAX_STEPS,
                       description="steps per point; the first is not timed")
    epoch_examples: int | None = Field(default=None, gt=0, le=MAX_GLOBAL_BATCH * MAX_STEPS,
                                       description="examples per epoch for the epoch-time "
                                                   "column (default: the train split)")

    @model_validator(mode="after")
    def _consistent(self) -> SweepConfig:
        given = [k for k in ("slices", "chips", "topologies") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"give one of slices, chips or topologies, not {' and '.join(given)}")
        if self.scaling == "weak" and self.per_core_batch is None and self.per_device_batch is None:
            raise ValueError("per_core_batch: weak scaling needs per_core_batch, the examples "
                             "per TensorCore, or per_device_batch on a sharded mesh (got none)")
        if self.per_device_batch is not None and (self.per_core_batch or self.global_batch):
            raise ValueError("per_device_batch sets the global batch (x data x fsdp of each "
                             "mesh); drop per_core_batch and global_batch")
        if self.scaling == "weak" and self.global_batch is not None:
            raise ValueError("weak scaling sets the global batch from per_core_batch; "
                             "drop global_batch or use scaling: strong")
        if self.scaling == "strong" and self.per_core_batch is not None:
            raise ValueError("per_core_batch belongs to weak scaling")
        for algorithm in self.allreduce or ():
            if algorithm not in ALLREDUCE_CHOICES:
                raise ValueError(f"allreduce: {algorithm!r} is not an algorithm; must be one of "
                                 f"{', '.join(ALLREDUCE_CHOICES)}")
        lists = {k: len(v) for k in ("slices", "chips", "topologies", "num_slices", "mesh",
                                     "remat", "allreduce", "per_device_batch", "per_core_batch",
                                     "global_batch", "precision", "microbatches")
                 if (v := getattr(self, k)) is not None and len(v) > 1}
        if math.prod(lists.values()) > MAX_SWEEP_POINTS:
            terms = " x ".join(f"{n:,} {k}" for k, n in lists.items())
            raise ValueError(f"the sweep has {math.prod(lists.values()):,} points ({terms}), more "
                             f"than the {MAX_SWEEP_POINTS:,} allowed; sweep fewer values")
        return self

    @field_validator("mesh", mode="before")
    @classmethod
    def _meshes(cls, value: Any) -> Any:
        # ScenarioError is a ValueError: pydantic reports it
        from pod.config.mesh import parse_mesh_axes

        return value if value is None else [parse_mesh_axes(m) for m in value]

    @field_validator("per_device_batch", mode="before")
    @classmethod
    def _one_or_many_devices(cls, value: Any) -> Any:
        return [value] if isinstance(value, int) and not isinstance(value, bool) else value

    @field_validator("slices", mode="before")
    @classmethod
    def _names_not_counts(cls, value: Any) -> Any:
        numbers = [v for v in (value if isinstance(value, (list, tuple)) else ())
                   if isinstance(v, int) and not isinstance(v, bool)]
        if numbers:
            raise ValueError(f"{numbers[0]} is a number; sweep.slices lists slice names "
                             f"(e.g. [v5e-256, v5e-512]); to sweep the number of slices "
                             f"(pod.slices) give sweep.num_slices: {list(numbers)}")
        return value

    @field_validator("slices")
    @classmethod
    def _known_slices(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        # ScenarioError is a ValueError: pydantic reports it
        from pod.config.slices import parse_slice

        for name in value or ():
            parse_slice(name)
        return value

    @field_validator("topologies")
    @classmethod
    def _valid_shapes(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        from interconnect import parse_shape  # TopologyError is a ValueError: pydantic reports it

        for shape in value or ():
            parse_shape(shape)
        return value


class Scenario(_Frozen):
    """A validated, frozen scenario. Build it with ``load_scenario``."""

    name: str = Field(default="scenario", min_length=1, max_length=MAX_NAME_CHARS,
                      pattern=r"^[A-Za-z0-9_.-]+$")
    description: str = Field(default="", max_length=MAX_DESCRIPTION_CHARS)
    pod: PodConfig
    model: ModelConfig | None = None
    data: DataConfig = Field(default_factory=DataConfig)
    training: TrainingConfig | None = None
    benchmark: BenchmarkConfig | None = None
    sweep: SweepConfig | None = None
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    checkpoint: CheckpointConfig | None = None
    faults: tuple[FaultConfig, ...] = ()

    @field_validator("name")
    @classmethod
    def _not_a_directory_step(cls, value: str) -> str:
        # runs/<name> must be a directory inside runs/: "." is runs/ itself, ".." its parent
        if set(value) == {"."}:
            raise ValueError("must name a directory inside runs/, not '.' or '..' (it names the "
                             "output directory runs/<name>)")
        return value

    @model_validator(mode="before")
    @classmethod
    def _preset_data(cls, value: Any) -> Any:
        # a preset model brings its vocabulary and context (pod.config.presets.preset_data)
        from pod.config.presets import preset_data

        if isinstance(value, dict) and isinstance(value.get("model"), dict):
            data = preset_data(value["model"], value.get("data"), value.get("training"))
            if data is not None:
                return {**value, "data": data}
        return value

    @model_validator(mode="after")
    def _one_kind(self) -> Scenario:
        if self.benchmark is not None:
            if self.model is not None or self.training is not None:
                given = " and ".join(k for k in ("model", "training") if getattr(self, k))
                raise ValueError(f"benchmark: a scenario has either benchmark or model + "
                                 f"training, not both (got benchmark and {given}); remove one")
        elif self.model is None or self.training is None:
            missing = "model" if self.model is None else "training"
            raise ValueError(f"{missing}: required key is missing (a training scenario needs "
                             f"model and training; a benchmark scenario needs benchmark)")
        return self

    @property
    def kind(self) -> str:
        """"training" (model + training) or "benchmark"."""
        return "benchmark" if self.benchmark is not None else "training"

    def with_overrides(self, **changes: Any) -> Scenario:
        """A copy with dotted-path overrides, validated again.

        Args:
            changes: e.g. ``{"training.steps": 5, "metrics.port": 0}`` passed as
                keyword arguments with ``__`` for dots
                (``training__steps=5``).

        Raises:
            ScenarioError: an override makes the scenario invalid.
        """
        data = self.model_dump()
        for key, value in changes.items():
            node = data
            parts = key.split("__")
            for part in parts[:-1]:
                node = node[part]
            node[parts[-1]] = value
            if parts == ["training", "steps"] and value is not None:
                data["training"]["epochs"] = None
        return parse_scenario(data, source="<overrides>")


#: What a pattern-checked key allows, by key (pydantic's own text would quote the regex).
_PATTERN_HELP = {
    "name": "must be letters, digits, '_', '.' or '-' only (it names the output directory "
            "runs/<name>)",
    "link": "must be a directed ICI link \"src->dst\" of chip ranks, e.g. \"0->1\"",
}


#: ``repr`` with every container and string cut short: a message about a huge
#: (or alias-expanded) value costs microseconds, not the size of the value.
_BOUNDED_REPR = reprlib.Repr()
_BOUNDED_REPR.maxlevel = 4
_BOUNDED_REPR.maxtuple = _BOUNDED_REPR.maxlist = _BOUNDED_REPR.maxdict = 8
_BOUNDED_REPR.maxset = _BOUNDED_REPR.maxfrozenset = _BOUNDED_REPR.maxdeque = 8
_BOUNDED_REPR.maxstring = _BOUNDED_REPR.maxother = 80
_BOUNDED_REPR.maxlong = 40


def _show(value: Any, limit: int = 80) -> str:
    """A bounded ``repr(value)``, shortened to ``limit`` characters for a one-line message."""
    text = _BOUNDED_REPR.repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The scenario section class inside an annotation (``X | None``, ``tuple[X, ...]``)."""
    for arg in (annotation, *typing.get_args(annotation)):
        for candidate in (arg, *typing.get_args(arg)):
            if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                return candidate
    return None


def _section_at(loc: tuple) -> type[BaseModel] | None:
    """The section class holding the keys at ``loc`` (``()`` is the scenario itself)."""
    model: type[BaseModel] | None = Scenario
    for part in loc:
        if isinstance(part, int):
            continue  # an index into a list of sections (pod.links.0)
        if model is None or part not in model.model_fields:
            return None
        model = _model_of(model.model_fields[part].annotation)
    return model


def _describe_error(error: ErrorDetails) -> str:
    """One pydantic error as ``<field.path>: <what is wrong> (got <value>); <allowed>``."""
    loc = tuple(error["loc"])
    kind = error["type"]
    message = error["msg"]
    if message.startswith("Value error, "):
        message = message[len("Value error, "):]
    message = message.replace("Input should be", "must be")
    section = _section_at(loc)
    if kind == "value_error" and section is not None:
        # a section's validator may start its message with "<key>: " to name the key
        match = re.match(r"^([a-z_0-9]+): (.*)$", message)
        if match and match.group(1) in section.model_fields:
            loc, message = (*loc, match.group(1)), match.group(2)
            if not error["loc"]:
                return f"{'.'.join(str(p) for p in loc)}: {message}"
    path = ".".join(str(p) for p in loc) or "<top level>"
    value = error.get("input")
    if kind == "extra_forbidden":
        parent = _section_at(loc[:-1])
        allowed = list(parent.model_fields) if parent is not None else []
        close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        listed = f"{' ' if close else '; '}allowed: {', '.join(allowed)}" if allowed else ""
        return f"{path}: unknown key (got {_show(value)}){hint}{listed}"
    if kind == "missing":
        return f"{path}: required key is missing"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        keys = f"; keys: {', '.join(section.model_fields)}" if section is not None else ""
        return f"{path}: must be a mapping of keys (got {_show(value)}){keys}"
    if kind in ("tuple_type", "list_type"):
        return f"{path}: must be a list (got {_show(value)})"
    if kind == "string_pattern_mismatch":
        message = _PATTERN_HELP.get(str(loc[-1]), message)
    if "input" in error and not isinstance(value, dict):
        return f"{path}: {message} (got {_show(value)})"
    return f"{path}: {message}"


def parse_scenario(data: Any, *, source: str = "<scenario>") -> Scenario:
    """Validate a parsed YAML document into a ``Scenario``.

    Args:
        data: the document (a mapping).
        source: where it came from, used in messages.

    Returns:
        The frozen scenario.

    Raises:
        ScenarioError: one line naming the field, the value and what is allowed.
    """
    if not isinstance(data, dict):
        got = "an empty document" if data is None else \
            f"a {type(data).__name__} {_show(data)}" if not isinstance(data, list) else \
            f"a list {_show(data)}"
        raise ScenarioError(f"{source}: <top level>: a scenario is a mapping of keys (got {got}); "
                            f"keys: {', '.join(Scenario.model_fields)}")
    try:
        scenario = Scenario.model_validate(data)
    except ValidationError as err:
        # a missing key last: a typo (global_bach) leaves its key missing too, and the
        # unknown key's line names both (as an override's does)
        errors = sorted(err.errors(), key=lambda e: e["type"] == "missing")
        extra = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise ScenarioError(f"{source}: {_describe_error(errors[0])}{extra}") from None
    _check_numbers(scenario, source)
    return scenario


def _check_numbers(scenario: Scenario, source: str) -> None:
    if scenario.training is None:
        return
    lr = scenario.training.optimizer.learning_rate
    if not math.isfinite(lr):
        raise ScenarioError(f"{source}: training.optimizer.learning_rate must be finite (got {lr})")


#: Bounds on a scenario file, so that a small hostile file cannot cost minutes or
#: gigabytes (a YAML "billion laughs" alias bomb) or overflow the stack (deep
#: nesting). Real scenarios are a few kilobytes, a few levels deep, with no aliases.
MAX_SCENARIO_BYTES = 1 << 20
#: deepest nesting of mappings and lists
MAX_YAML_DEPTH = 64
#: aliases (``*name``) in one file
MAX_YAML_ALIASES = 100
#: values in the document once every alias is expanded
MAX_YAML_NODES = 100_000


class _ScenarioLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` (plain data only) that also refuses a key given twice in one
    mapping, which plain YAML loaders resolve silently by keeping the last, and
    a document deeper than ``MAX_YAML_DEPTH``, with more than ``MAX_YAML_ALIASES``
    aliases, or of more than ``MAX_YAML_NODES`` values once aliases are expanded."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._depth = 0
        self._aliases = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.events.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_YAML_ALIASES:
                raise yaml.composer.ComposerError(
                    None, None, f"more than {MAX_YAML_ALIASES} aliases (*name); a scenario "
                    "needs few or none (refused: aliases can expand a small file enormously)",
                    self.peek_event().start_mark)
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise yaml.composer.ComposerError(
                    None, None, f"nested deeper than {MAX_YAML_DEPTH} levels",
                    self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self) -> Any:
        node = super().compose_document()
        if node is not None:
            expanded, depth = _expanded_size(node, {})
            if depth > MAX_YAML_DEPTH:
                raise yaml.composer.ComposerError(
                    None, None, f"nested deeper than {MAX_YAML_DEPTH} levels once its aliases "
                    "are expanded", node.start_mark)
            if expanded > MAX_YAML_NODES:
                raise yaml.composer.ComposerError(
                    None, None, f"the document expands to more than {MAX_YAML_NODES:,} values "
                    "with its aliases", node.start_mark)
        return node

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, typing.Hashable):
                continue  # SafeLoader reports unhashable keys itself
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {_show(key)} is given twice in one mapping; keep one",
                    key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _expanded_size(node: yaml.Node, seen: dict[int, tuple[int, int]]) -> tuple[int, int]:
    """(values, depth) under ``node`` with every alias expanded, memoised per node:
    aliases share nodes, so the walk is linear in the file while the counts are
    not. Both are capped just past their limits (``MAX_YAML_NODES``,
    ``MAX_YAML_DEPTH``); a node inside itself (a recursive alias) counts as past both.
    """
    key = id(node)
    if key in seen:
        return seen[key]
    too_much = (MAX_YAML_NODES + 1, MAX_YAML_DEPTH + 1)
    seen[key] = too_much  # a cycle reaching back here is too big
    if isinstance(node, yaml.MappingNode):
        children = [c for pair in node.value for c in pair]
    elif isinstance(node, yaml.SequenceNode):
        children = list(node.value)
    else:
        children = []
    sizes = [_expanded_size(child, seen) for child in children]
    total = (min(1 + sum(n for n, _ in sizes), too_much[0]),
             min(1 + max((d for _, d in sizes), default=0), too_much[1]))
    seen[key] = total
    return total


def _read_scenario_text(path: Path) -> str:
    """The file's text, at most ``MAX_SCENARIO_BYTES`` read, from a regular file only
    (a FIFO or ``/dev/zero`` is one line, not a hang).

    Raises:
        ScenarioError: unreadable, not a regular file, too large, or not UTF-8.
    """
    try:  # a regular file only: a FIFO would block the read, /dev/zero never end
        raw = read_regular(path, MAX_SCENARIO_BYTES, "scenarios")
    except ValueError as err:
        if "larger than" in str(err):
            raise ScenarioError(f"{path}: the scenario file is larger than "
                                f"{MAX_SCENARIO_BYTES:,} bytes; a scenario is a small YAML "
                                "file") from None
        raise ScenarioError(str(err).replace(": cannot read (", ": cannot read the scenario "
                                             "file (")) from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ScenarioError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start}); a "
                            f"scenario is a UTF-8 YAML file") from None


def load_scenario(path: str | Path, *, edit: Callable[[dict], dict] | None = None) -> Scenario:
    """Read and validate a scenario file.

    Args:
        path: the YAML file.
        edit: applied to the file's mapping before it is validated (command-line
            overrides, ``pod.config.overrides``); relative paths in the file are
            already resolved against the file's folder.

    Returns:
        The frozen scenario.

    Raises:
        ScenarioError: unreadable file, bad YAML, or an invalid field; a file
            over ``MAX_SCENARIO_BYTES``, nested deeper than ``MAX_YAML_DEPTH``,
            with more than ``MAX_YAML_ALIASES`` aliases or expanding to more
            than ``MAX_YAML_NODES`` values.
    """
    path = Path(path)
    text = _read_scenario_text(path)
    return scenario_from_text(text, source=str(path), base_dir=path.resolve().parent, edit=edit)


def load_yaml(text: str, *, source: str = "<scenario>") -> Any:
    """Parse YAML text as a scenario is read: safely (plain data only), refusing a key
    given twice, and within ``MAX_YAML_DEPTH``, ``MAX_YAML_ALIASES`` and
    ``MAX_YAML_NODES``.

    Raises:
        ScenarioError: ``<source>: invalid YAML at line L, column C: <problem>``.
    """
    try:
        return yaml.load(text, Loader=_ScenarioLoader)  # a SafeLoader: no object construction
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        tag = re.search(r"for the tag '([^']*)'", problem)
        if tag:
            shown = tag.group(1).replace("tag:yaml.org,2002:", "!!")
            problem = (f"tag {shown} is not allowed; a scenario holds plain mappings, "
                       "lists, strings, numbers and booleans (YAML is read safely: no objects)")
        elif "'\\t'" in problem:
            problem = "a tab cannot indent YAML; indent with spaces"
        elif problem == "mapping values are not allowed here":
            problem += (" (a key indented deeper than the key above it, or an unquoted value "
                        "holding ': ')")
        raise ScenarioError(f"{source}: invalid YAML{where}: {problem}") from None


def scenario_from_text(text: str, *, source: str = "<scenario>", base_dir: str | Path = ".",
                       edit: Callable[[dict], dict] | None = None) -> Scenario:
    """Parse and validate a scenario given as YAML text.

    Args:
        text: the YAML document (at most ``MAX_SCENARIO_BYTES`` of UTF-8).
        source: where it came from, used in messages (a file name).
        base_dir: the directory relative ``data.path`` and ``checkpoint.dir``
            are resolved against (a file's own directory; the working
            directory for text).
        edit: applied to the document's mapping (its paths resolved) before it is
            validated; a document that is not a mapping is reported as such.

    Returns:
        The frozen scenario.

    Raises:
        ScenarioError: too large, bad YAML, or an invalid field.
    """
    if len(text.encode("utf-8", errors="replace")) > MAX_SCENARIO_BYTES:
        raise ScenarioError(f"{source}: the scenario is larger than {MAX_SCENARIO_BYTES:,} bytes; "
                            "a scenario is a small YAML document")
    base = Path(base_dir)
    data = load_yaml(text, source=source)
    data_path = data.get("data", {}).get("path") if isinstance(data, dict) and \
        isinstance(data.get("data"), dict) else None
    if isinstance(data_path, str) and data_path:
        # paths in a scenario are relative to the scenario file, not to the working directory
        data["data"]["path"] = str(base.resolve() / Path(data_path).expanduser())
    checkpoint = data.get("checkpoint") if isinstance(data, dict) else None
    if (isinstance(checkpoint, dict) and isinstance(checkpoint.get("dir"), str)
            and checkpoint["dir"]):
        # like data.path: relative to the scenario file
        checkpoint["dir"] = str(base.resolve() / Path(checkpoint["dir"]).expanduser())
    if edit is not None and isinstance(data, dict):
        data = edit(data)
    return parse_scenario(data, source=source)

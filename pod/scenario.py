"""Scenario files: the one place YAML becomes a typed, frozen ``Scenario``.

A scenario says which pod to emulate, what to train on it and how. The file
is parsed with ``yaml.safe_load`` (no object construction) and validated with
pydantic; unknown keys and bad values are rejected with the field's path, the
value received and what is allowed, in one line (``ScenarioError``).

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
                                     # halving_doubling | tree (auto: the fastest)
      links:                         # slowed or failed directed ICI links
        - {link: "0->1", slowdown: 2.0}
        - {link: "1->2", failed: true}
    model:
      name: cnn                      # cnn | mlp
      options: {dropout: true}       # model-specific options
    data:
      name: digits                   # digits | synthetic
      test_fraction: 0.2
      options: {}
    training:
      global_batch: 256              # split over every TensorCore
      steps: 200                     # or epochs: N (exactly one of them)
      optimizer: {name: adam, learning_rate: 0.002}
      precision: bf16
      seed: 0
      eval_every_steps: 0            # 0: evaluate at the end only
    metrics:
      port: 9188                     # 0 disables the Prometheus endpoint
      host: 127.0.0.1
    ray:
      address: null                  # join this cluster; else RAY_ADDRESS; else local
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (BaseModel, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)

from chip import PRECISIONS as CHIP_PRECISIONS
from interconnect import ALLREDUCE_ALGORITHMS
from pod.errors import ScenarioError
from pod.workloads import DATASET_NAMES, MODEL_NAMES, OPTIMIZER_NAMES

#: ``pod.allreduce`` values: an interconnect algorithm, or auto (the fastest for the pod).
ALLREDUCE_CHOICES = ("auto", *ALLREDUCE_ALGORITHMS)

__all__ = [
    "Scenario",
    "PodConfig",
    "ModelConfig",
    "DataConfig",
    "OptimizerConfig",
    "TrainingConfig",
    "MetricsConfig",
    "RayConfig",
    "load_scenario",
    "parse_scenario",
    "PRECISIONS",
    "BenchmarkConfig",
    "BENCHMARK_KINDS",
]

PRECISIONS = CHIP_PRECISIONS  # bf16 | fp32 | int8 (chip.PRECISIONS; int8 not on v2 / v3)
BENCHMARK_KINDS = ("matmul", "matrix_add")


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=False)


class LinkConfig(_Frozen):
    """One slowed or failed directed ICI link, e.g. ``{link: "0->1", slowdown: 2.0}``."""

    link: str = Field(pattern=r"^\s*\d+\s*->\s*\d+\s*$", description="src->dst chip ranks")
    slowdown: float | None = Field(default=None, ge=1.0, allow_inf_nan=False,
                                   description="the link runs at bandwidth / slowdown")
    failed: bool = False

    @model_validator(mode="after")
    def _slow_or_failed(self) -> "LinkConfig":
        if (self.slowdown is not None) == self.failed:
            raise ValueError("give either slowdown: <factor >= 1> or failed: true")
        return self


class PodConfig(_Frozen):
    """Which pod: a slice name, or a chip preset with a count or a shape."""

    slice: str | None = Field(default=None, description="Google slice name, e.g. v2-8")
    chip: str | None = Field(default=None, description="chip preset: v2 v3 v4 v5e v5p v6e")
    chips: int | None = Field(default=None, gt=0, description="number of chips")
    topology: str | None = Field(default=None, description="torus shape, e.g. 2x2 or 4x4x4")
    wraparound: bool | None = None
    allreduce: str = Field(default="auto", description="allreduce algorithm or auto")
    links: tuple[LinkConfig, ...] = ()

    @field_validator("allreduce")
    @classmethod
    def _known_allreduce(cls, value: str) -> str:
        return _one_of(value, ALLREDUCE_CHOICES)

    @model_validator(mode="after")
    def _one_way(self) -> "PodConfig":
        if not self.slice and not self.chip:
            raise ValueError("give either slice (e.g. v2-8) or chip (e.g. v2) with chips")
        return self


def _one_of(value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"must be one of {', '.join(allowed)}")
    return value


class ModelConfig(_Frozen):
    """The model to train, by name (``pod.workloads.MODEL_NAMES``), with its options."""

    name: str
    options: dict[str, Any] = Field(default_factory=dict)

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
    learning_rate: float = Field(default=1e-3, gt=0.0)
    momentum: float | None = Field(default=None, ge=0.0, lt=1.0)
    beta1: float | None = Field(default=None, ge=0.0, lt=1.0)
    beta2: float | None = Field(default=None, ge=0.0, lt=1.0)
    eps: float | None = Field(default=None, gt=0.0)

    @field_validator("name")
    @classmethod
    def _known_optimizer(cls, value: str) -> str:
        return _one_of(value, OPTIMIZER_NAMES)

    @model_validator(mode="after")
    def _options_fit(self) -> "OptimizerConfig":
        if self.name == "sgd" and any(v is not None for v in (self.beta1, self.beta2, self.eps)):
            raise ValueError("beta1, beta2 and eps belong to adam, not sgd")
        if self.name == "adam" and self.momentum is not None:
            raise ValueError("momentum belongs to sgd, not adam")
        return self

    def options(self) -> dict[str, float]:
        """The hyper-parameters that were given, as keyword arguments."""
        fields = ("learning_rate", "momentum", "beta1", "beta2", "eps")
        return {k: getattr(self, k) for k in fields if getattr(self, k) is not None}


class TrainingConfig(_Frozen):
    """How to train: batch, length, optimizer, numerics, seed."""

    global_batch: int = Field(gt=0)
    steps: int | None = Field(default=None, gt=0)
    epochs: int | None = Field(default=None, gt=0)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    precision: str = "bf16"
    seed: int = Field(default=0, ge=0)
    eval_every_steps: int = Field(default=0, ge=0)

    @field_validator("precision")
    @classmethod
    def _known_precision(cls, value: str) -> str:
        return _one_of(value, PRECISIONS)

    @model_validator(mode="after")
    def _steps_or_epochs(self) -> "TrainingConfig":
        if self.steps is not None and self.epochs is not None:
            raise ValueError("give steps or epochs, not both")
        if self.steps is None and self.epochs is None:
            raise ValueError("give steps or epochs")
        return self


class MetricsConfig(_Frozen):
    """The Prometheus endpoint."""

    port: int = Field(default=9188, ge=0, le=65535)
    host: str = "127.0.0.1"


class RayConfig(_Frozen):
    """Where the chip actors run."""

    address: str | None = None


class BenchmarkConfig(_Frozen):
    """A seed benchmark instead of training (see ``pod.bench``).

    kind: matmul (x <- x . y on each TensorCore) or matrix_add (c = a + b on
    the VPU); n: matrix size; iterations; precision of the MXU (matmul);
    functional: really compute (False: costs only, for full size); cpu_n and
    cpu_iterations: the host numpy measurement, scaled down to take seconds.
    """

    kind: str
    n: int = Field(default=4096, gt=0)
    iterations: int = Field(default=100, gt=0)
    precision: str = "bf16"
    functional: bool = False
    seed: int = Field(default=0, ge=0)
    cpu_n: int = Field(default=1024, gt=0)
    cpu_iterations: int = Field(default=10, gt=0)

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, value: str) -> str:
        return _one_of(value, BENCHMARK_KINDS)

    @field_validator("precision")
    @classmethod
    def _known_precision(cls, value: str) -> str:
        return _one_of(value, PRECISIONS)


class SweepConfig(_Frozen):
    """A scaling experiment: the scenario run at every combination of these values.

    ``scaling: weak`` keeps ``per_core_batch`` fixed (the global batch grows
    with the TensorCores); ``strong`` keeps the global batch fixed (the
    scenario's, or each of ``global_batch``). Pods come from ``slices``, or
    ``chips`` (with ``pod.chip``), or ``topologies`` (shapes, with ``pod.chip``).
    """

    mode: Literal["timing", "functional"] = "timing"
    scaling: Literal["weak", "strong"] = "strong"
    per_core_batch: int | None = Field(default=None, gt=0)
    slices: tuple[str, ...] | None = Field(default=None, min_length=1)
    chips: tuple[Annotated[int, Field(gt=0)], ...] | None = Field(default=None, min_length=1)
    topologies: tuple[str, ...] | None = Field(default=None, min_length=1)
    allreduce: tuple[str, ...] | None = Field(default=None, min_length=1)
    global_batch: tuple[Annotated[int, Field(gt=0)], ...] | None = Field(default=None, min_length=1)
    precision: tuple[str, ...] | None = Field(default=None, min_length=1)
    steps: int = Field(default=2, gt=0, description="steps per point; the first is not timed")

    @model_validator(mode="after")
    def _consistent(self) -> "SweepConfig":
        given = [k for k in ("slices", "chips", "topologies") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"give one of slices, chips or topologies, not {' and '.join(given)}")
        if self.scaling == "weak" and self.per_core_batch is None:
            raise ValueError("weak scaling needs per_core_batch")
        if self.scaling == "weak" and self.global_batch is not None:
            raise ValueError("weak scaling sets the global batch from per_core_batch; "
                             "drop global_batch or use scaling: strong")
        if self.scaling == "strong" and self.per_core_batch is not None:
            raise ValueError("per_core_batch belongs to weak scaling")
        for algorithm in self.allreduce or ():
            _one_of(algorithm, ALLREDUCE_CHOICES)
        return self


class Scenario(_Frozen):
    """A validated, frozen scenario. Build it with ``load_scenario``."""

    name: str = Field(default="scenario", min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str = ""
    pod: PodConfig
    model: ModelConfig | None = None
    data: DataConfig = Field(default_factory=DataConfig)
    training: TrainingConfig | None = None
    benchmark: BenchmarkConfig | None = None
    sweep: SweepConfig | None = None
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    ray: RayConfig = Field(default_factory=RayConfig)

    @model_validator(mode="after")
    def _one_kind(self) -> "Scenario":
        if self.benchmark is not None:
            if self.model is not None or self.training is not None:
                raise ValueError("a scenario has either benchmark or model + training, not both")
        elif self.model is None or self.training is None:
            missing = "model" if self.model is None else "training"
            raise ValueError(f"{missing}: required key is missing (a training scenario needs "
                             f"model and training; a benchmark scenario needs benchmark)")
        return self

    @property
    def kind(self) -> str:
        """"training" (model + training) or "benchmark"."""
        return "benchmark" if self.benchmark is not None else "training"

    def with_overrides(self, **changes: Any) -> "Scenario":
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


def _describe_error(error: dict[str, Any]) -> str:
    path = ".".join(str(p) for p in error["loc"]) or "<top level>"
    kind = error["type"]
    message = error["msg"]
    if message.startswith("Value error, "):
        message = message[len("Value error, "):]
    if kind == "extra_forbidden":
        return f"{path}: unknown key (got {error['input']!r})"
    if kind == "missing":
        return f"{path}: required key is missing"
    if "input" in error and not isinstance(error["input"], dict):
        return f"{path}: {message} (got {error['input']!r})"
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
        raise ScenarioError(f"{source}: a scenario is a mapping of keys, got {type(data).__name__}")
    try:
        scenario = Scenario.model_validate(data)
    except ValidationError as err:
        errors = err.errors()
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


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file.

    Args:
        path: the YAML file.

    Returns:
        The frozen scenario.

    Raises:
        ScenarioError: unreadable file, bad YAML, or an invalid field.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ScenarioError(f"{path}: cannot read the scenario file ({err.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ScenarioError(f"{path}: invalid YAML{where}: {problem}") from None
    data_path = data.get("data", {}).get("path") if isinstance(data, dict) and \
        isinstance(data.get("data"), dict) else None
    if isinstance(data_path, str) and data_path:
        # paths in a scenario are relative to the scenario file, not to the working directory
        data["data"]["path"] = str(path.resolve().parent / Path(data_path).expanduser())
    return parse_scenario(data, source=str(path))

"""Your own JAX step on the emulated pod: the HLO XLA compiles for a TPU slice, costed
op by op and collective by collective (``pod.hlo``).

    import jax, jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    import pod.jax

    est = pod.jax.estimate(train_step, params, batch, mesh={"fsdp": 4, "tensor": 2},
                           in_specs=(P("fsdp", "tensor"), P("fsdp")), slice="v5e-8")
    print(est.step_seconds, est.mfu, est.memory.verdict())
    est.write("runs/my-step")          # summary.json, layers.csv, collectives.csv, trace

``args`` are arrays or ``jax.ShapeDtypeStruct`` s (nothing is allocated). With
libtpu installed (``pip install 'tpu-pod-emulator[tpu-compile]'``) the step is
compiled for the slice itself (no TPU needed); with jax alone it is compiled for
fake CPU devices and the answer is labelled "approximate (CPU-compiled HLO)".
``cost_hlo`` costs any HLO text (an ``--xla_dump_to`` file, MaxText's
``dump_hlo``, PyTorch/XLA's dumps). Every figure is SIMULATED.
"""

from __future__ import annotations

import gzip
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pod.config.slices import Topology, resolve_pod
from pod.errors import HloError, HloParseError, ScenarioError

__all__ = ["Estimate", "estimate", "cost_hlo", "read_hlo", "topology_of"]


@dataclass(frozen=True)
class Estimate:
    """A step's estimate.

    Attributes:
        step: the costed step (``pod.hlo.HloStep``: figures, ops, collectives, memory).
        summary: summary.json's content.
        hlo_text: the module costed.
    """

    step: Any
    summary: dict[str, Any]
    hlo_text: str = ""

    @property
    def step_seconds(self) -> float:
        """Simulated seconds of a step (the critical path)."""
        return float(self.step.step_seconds)

    @property
    def mfu(self) -> float:
        """The HLO's MXU FLOPs / (step seconds x the pod's peak bf16 FLOP/s)."""
        return float(self.summary["mfu"])

    @property
    def memory(self) -> Any:
        """HBM per device (``pod.hlo.HloMemory``): ``.verdict()``, ``.fits``."""
        return self.step.memory

    @property
    def approximate(self) -> bool:
        """Costed from a CPU-compiled module."""
        return bool(self.step.approximate)

    def write(self, output_dir: str | Path) -> list[Path]:
        """Write summary.json, layers.csv, collectives.csv and trace.json.gz; returns the
        paths."""
        from pod.hlo.report import write_results

        return write_results(self.step, Path(output_dir), self.summary)

    def table(self) -> Any:
        """The summary as a rich table."""
        from pod.hlo.report import summary_table

        return summary_table(self.summary)

    def __repr__(self) -> str:
        s = self.summary
        return (f"Estimate({s['module']} on {self.step.topology.name}, {s['costed_from']}: "
                f"{self.step_seconds * 1e3:.3f} ms/step simulated, MFU {self.mfu:.1%}, "
                f"{self.memory.verdict()})")


def topology_of(slice_name: str, num_slices: int = 1) -> Topology:
    """The pod of ``num_slices`` slices named ``slice_name`` (``v5p-128``, ``v5e-256``, ...;
    ``pod.config.slices``).

    Raises:
        ScenarioError: an unknown slice (the message lists the valid ones).
    """
    try:
        return resolve_pod(slice_name=slice_name, slices=num_slices)
    except ScenarioError as err:
        raise ScenarioError(str(err).replace("pod.slice: ", "slice: ")
                            .replace("pod.slices: ", "num_slices: ")) from None


def estimate(step_fn: Callable, *args: Any, mesh: Mapping[str, int], slice: str = "v5p-8",
             num_slices: int = 1, in_specs: Any = None, path: str = "auto",
             sustained: bool = True, cache: bool = True,
             progress: Callable[[str], None] | None = None, libtpu_args: str = "") -> Estimate:
    """Compile ``step_fn(*args)`` for the slice and cost its HLO on the emulated pod.

    Args:
        step_fn: the step (a function, or one already ``jax.jit``-ed).
        args: its arguments, arrays or ``jax.ShapeDtypeStruct`` s (pytrees), or one
            callable ``make_args(mesh)`` returning them built over the capture's mesh
            (with ``NamedSharding`` s of it).
        mesh: axis sizes, major to minor, e.g. ``{"fsdp": 64, "tensor": 2}``; their
            product is the pod's devices.
        slice: the slice, e.g. "v5p-128", "v5e-256".
        num_slices: identical slices over the DCN (multislice).
        in_specs: one ``jax.sharding.PartitionSpec`` (or a pytree of them) per
            argument; None: the arguments' own shardings, else replicated.
        path: "auto" (the TPU compile when libtpu is installed), "tpu" or "cpu".
        sustained: MXU at its steady-state efficiency (a training step); False: from
            an idle start (a benchmarked single op).
        cache: read and write the capture cache (``~/.cache/tpu-pod/hlo``).
        progress: called with a line of text at each stage of the capture.
        libtpu_args: XLA's TPU flags for the compile (``LIBTPU_INIT_ARGS``, as set on a
            TPU VM: async collective fusion and the like change XLA's schedule); the
            TPU path only.

    Returns:
        The :class:`Estimate`.

    Raises:
        CaptureError: no jax / libtpu, a mesh that does not divide the slice, a step
            that does not trace or compile.
        HloError: an op or loop the cost model cannot cost.
        ScenarioError: an unknown slice.
    """
    from pod.frontends import capture

    topology = topology_of(slice, num_slices)
    made = args[0] if len(args) == 1 and callable(args[0]) and not hasattr(args[0], "shape") \
        else args
    found = capture(step_fn, made, mesh_axes=dict(mesh), chip_name=topology.chip.name,
                    torus_shape=topology.torus.shape, slice_label=topology.name,
                    slices=num_slices, in_specs=in_specs, path=path, use_cache=cache,
                    progress=progress, libtpu_args=libtpu_args)
    from pod.frontends.jax_capture import cache_dir

    extra = {"mesh": dict(mesh), "capture": {
        "platform": found.platform, "topology": found.topology, "cached": found.cached,
        "libtpu_args": libtpu_args,
        "cache": str(cache_dir() / f"{found.key}.hlo.txt.gz")},
        "compile_wall_seconds": found.compile_seconds, "cached": found.cached}
    return _cost(found.hlo_text, topology, devices=found.devices, mesh_axes=found.mesh_axes,
                 approximate=found.platform != "tpu", sustained=sustained,
                 xla_memory=found.memory or None, xla_platform=found.platform, extra=extra)


def _hlo_file(source: str | Path) -> Path | None:
    """The file ``source`` names, or None when it is a module's text itself."""
    text = str(source)
    return None if "\n" in text or "HloModule" in text else Path(text)


def read_hlo(source: str | Path) -> str:
    """The text of an HLO module: a path (``.txt``, ``.gz``) or the text itself.

    Raises:
        HloError: a file that cannot be read, or that holds several modules.
    """
    text, path = str(source), _hlo_file(source)
    if path is not None:
        try:
            data = path.read_bytes()
        except OSError as err:
            raise HloError(f"{path}: cannot read the HLO module ({err.strerror or err})") from None
        text = (gzip.decompress(data) if path.suffix == ".gz" else data).decode(errors="replace")
    if text.count("\nHloModule ") + text.startswith("HloModule ") > 1:
        raise HloError("the text holds several HLO modules; give one per file (XLA dumps "
                       "write one module per file)")
    return text


def cost_hlo(source: str | Path, *, slice: str, num_slices: int = 1,
             mesh: Mapping[str, int] | None = None, compiled_for: str = "auto",
             sustained: bool = True, devices: Sequence[int] = ()) -> Estimate:
    """Cost an HLO module (a file or its text) on the slice.

    Args:
        source: a path or the module's text.
        slice, num_slices: the pod (as :func:`estimate`).
        mesh: the mesh's axis sizes over the module's device ids, to name the lanes
            (None: "N groups of M").
        compiled_for: "tpu" (costed as XLA scheduled it), "cpu" (approximate), or
            "auto" (TPU when its layouts or cost estimates say so).
        sustained: as :func:`estimate`.
        devices: the module's device id -> physical device (slice x chips per slice +
            row-major torus rank; ``pod.hlo.groups.Placement``), when known (a mesh laid
            out by ``mesh_utils.create_device_mesh``); empty: the TPU's own device order,
            as ``jax.devices()`` lists them.

    Returns:
        The :class:`Estimate`.

    Raises:
        HloParseError: text that does not parse (with the line number; the file named).
        HloError: an op or loop that cannot be costed, or devices that are not the
            slice's.
    """
    from pod.hlo import is_tpu_compiled, parse_hlo

    if compiled_for not in ("auto", "tpu", "cpu"):
        raise HloError(f"compiled_for {compiled_for!r} is not one of auto, tpu, cpu")
    text = read_hlo(source)
    topology = topology_of(slice, num_slices)
    try:
        module = parse_hlo(text)
    except HloParseError as err:   # name the file, where the module came from one
        path = _hlo_file(source)
        raise (err if path is None else err.in_file(str(path))) from None
    approximate = (not is_tpu_compiled(module)) if compiled_for == "auto" \
        else compiled_for == "cpu"
    return _cost(text, topology, module=module, devices=tuple(devices), mesh_axes=mesh,
                 approximate=approximate, sustained=sustained,
                 extra={"mesh": dict(mesh) if mesh else None})


def _cost(text: str, topology: Topology, *, module: Any = None, devices: Any = (),
          mesh_axes: Mapping[str, int] | None = None, approximate: bool, sustained: bool,
          xla_memory: Mapping[str, int] | None = None, xla_platform: str = "",
          extra: dict[str, Any] | None = None) -> Estimate:
    from pod.hlo import cost_module, parse_hlo
    from pod.hlo.report import summary

    module = module if module is not None else parse_hlo(text)
    step = cost_module(module, topology, devices=devices, mesh_axes=mesh_axes,
                       approximate=approximate, sustained=sustained, xla_memory=xla_memory,
                       xla_platform=xla_platform)
    return Estimate(step, summary(step, **(extra or {})), text)

"""Capture a user's JAX step as the HLO XLA compiles for a TPU slice, on this machine.

The one module of the package that imports jax. Two paths:

- ``"tpu"``: compile for the slice with no TPU attached, as MaxText's
  ``train_compile.py`` does: with ``libtpu`` installed (``pip install
  'tpu-pod-emulator[tpu-compile]'``), ``jax.experimental.topologies.
  get_topology_desc(topology_name="v5p:4x4x4", platform="tpu")`` gives the
  slice's devices with their torus coordinates, and the step, lowered over a
  mesh of them, compiles to the scheduled, partitioned HLO XLA would run
  (fusions, async collectives, bf16 wires, real replica groups) with its buffer
  assignment (``memory_analysis()``);
- ``"cpu"``: the same step over fake CPU devices
  (``--xla_force_host_platform_device_count``, ``jax_num_cpu_devices``); its HLO
  keeps the collectives but not the TPU's fusions, wire dtypes or scheduling
  (``pod.hlo`` costs it "approximate (CPU-compiled HLO)").

``"auto"`` takes the TPU path when libtpu is installed, else the CPU path.

Compiling takes minutes for real models on a small host: a capture is cached
under ``~/.cache/tpu-pod/hlo`` (``$TPU_POD_CACHE`` overrides it), keyed by a
hash of the lowered module (StableHLO text: the function, its shapes and
shardings), the slice, the path and the jax / libtpu versions.

libtpu writes warnings to the process's stderr when it starts (no TPU
accelerator type, no worker hostnames): they are swallowed here, and shown only
when the compile fails.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import importlib.metadata
import importlib.util
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pod.errors import CaptureError

__all__ = ["PATHS", "Capture", "capture", "cache_dir", "tpu_compile_available", "make_mesh",
           "topology_name"]

#: Capture paths: "auto" (TPU when libtpu is installed), "tpu", "cpu".
PATHS = ("auto", "tpu", "cpu")

_TPU_ENV = {"TPU_SKIP_MDS_QUERY": "1", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
            "TF_CPP_MIN_LOG_LEVEL": "3", "GRPC_VERBOSITY": "ERROR"}


@dataclass(frozen=True)
class Capture:
    """A compiled step.

    Attributes:
        hlo_text: the compiled module (``compiled.as_text()``).
        platform: "tpu" (compiled for the slice) or "cpu" (over fake CPU devices).
        topology: the compile topology's name, e.g. "v5p:4x4x4".
        slices: slices compiled for.
        devices: the module's device id -> physical device (slice x chips per slice +
            chip rank in row-major torus order), read off the TPU devices'
            coordinates; empty on the CPU path (the TPU's device order,
            ``pod.hlo.groups.Placement.tpu_order``).
        mesh_axes: the mesh's axis sizes, major to minor.
        memory: XLA's ``memory_analysis()`` figures (bytes per device).
        compile_seconds: wall seconds the compile took (0 from the cache).
        cached: read from the cache.
        key: the cache key.
    """

    hlo_text: str
    platform: str
    topology: str
    slices: int
    devices: tuple[int, ...]
    mesh_axes: dict[str, int]
    memory: dict[str, int]
    compile_seconds: float
    cached: bool
    key: str


def cache_dir() -> Path:
    """Where captures are kept: ``$TPU_POD_CACHE/hlo`` or ``~/.cache/tpu-pod/hlo``."""
    root = os.environ.get("TPU_POD_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tpu-pod")
    return Path(root) / "hlo"


def tpu_compile_available() -> bool:
    """libtpu is installed (the TPU path can run)."""
    return importlib.util.find_spec("libtpu") is not None


def topology_name(chip_name: str, shape: Sequence[int]) -> str:
    """libtpu's name of a slice: "<generation>:<shape>", e.g. "v5p:4x4x4", "v5e:16x16"."""
    return f"{chip_name}:{'x'.join(str(s) for s in shape)}"


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[list[str]]:
    """Swallow what C++ libraries write to fd 2 (libtpu's start-up warnings); the text
    is handed back in the yielded list for an error message."""
    saved = os.dup(2)
    out: list[str] = []
    with tempfile.TemporaryFile(mode="w+b") as sink:
        sys.stderr.flush()
        os.dup2(sink.fileno(), 2)
        try:
            yield out
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            out.append(sink.read().decode(errors="replace"))


def _libtpu_started() -> bool:
    """libtpu was loaded and started in this process already (its flags are fixed)."""
    if "jax" not in sys.modules:
        return False
    from jax._src.lib import xla_client

    return bool(xla_client.pjrt_plugin_loaded("tpu") and xla_client.pjrt_plugin_initialized("tpu"))


def _set_libtpu_args(libtpu_args: str) -> None:
    """LIBTPU_INIT_ARGS for the compile: XLA's TPU flags, read once when libtpu starts.

    Raises:
        CaptureError: libtpu already started in this process with other flags.
    """
    current = os.environ.get("LIBTPU_INIT_ARGS", "")
    if current.split() == libtpu_args.split():
        return
    if _libtpu_started():
        raise CaptureError(f"libtpu already started in this process with LIBTPU_INIT_ARGS="
                           f"{current!r}; compile with other flags in a fresh process")
    os.environ["LIBTPU_INIT_ARGS"] = libtpu_args


def _jax(path: str, devices: int, libtpu_args: str = "") -> Any:
    """jax, set up for ``path`` (environment before the first import; CPU devices)."""
    if path == "tpu":
        for key, value in _TPU_ENV.items():
            os.environ.setdefault(key, value)
        _set_libtpu_args(libtpu_args)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    first = "jax" not in sys.modules
    if first and path == "cpu":
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}"
    try:
        with _quiet_stderr():  # libtpu, when installed, starts with warnings
            import jax
    except ImportError:
        raise CaptureError("jax is not installed: pip install 'tpu-pod-emulator[jax]' (the CPU "
                           "path) or 'tpu-pod-emulator[tpu-compile]' (the TPU path)") from None
    if path == "cpu":
        with contextlib.suppress(Exception):  # only before the CPU backend starts
            jax.config.update("jax_num_cpu_devices", max(devices, 1))
    return jax


def _check_mesh(mesh_axes: Mapping[str, int], devices: int, slice_label: str) -> None:
    if not mesh_axes or any(not isinstance(v, int) or v < 1 for v in mesh_axes.values()):
        raise CaptureError(f"mesh {dict(mesh_axes)!r} is not a mesh: give axis sizes, e.g. "
                           "{'fsdp': 64, 'tensor': 2}")
    size = math.prod(mesh_axes.values())
    if size != devices:
        axes = ", ".join(f"{k}: {v}" for k, v in mesh_axes.items())
        raise CaptureError(f"mesh {{{axes}}} has {size} devices but {slice_label} has {devices}; "
                           f"give axis sizes whose product is {devices}")


def _topology_options(topo: str, slices: int) -> dict[str, Any]:
    """libtpu's options for a topology: the slices; a host's chips clipped to a slice
    smaller than one host (``v5e:1x1``); v4 as megacore devices (one per chip, as
    MaxText compiles it: ``chip_config_name="megacore"``)."""
    from pod.hlo.groups import HOST_BOUNDS

    chip, _, shape_text = topo.partition(":")
    shape = tuple(int(s) for s in shape_text.split("x"))
    options: dict[str, Any] = {}
    if slices > 1:
        options["num_slices"] = slices
    padded = shape + (1,) * (3 - len(shape))
    if any(s % b for s, b in zip(padded, HOST_BOUNDS, strict=True)):
        options["chips_per_host_bounds"] = tuple(min(s, b) for s, b in
                                                 zip(padded, HOST_BOUNDS, strict=True))
    if chip == "v4":
        options["chip_config_name"] = "megacore"
    return options


def _devices(jax: Any, path: str, topo: str, slices: int, devices: int) -> tuple[list, str]:
    """The devices to compile for, and what libtpu printed getting them."""
    if path == "cpu":
        with _quiet_stderr():
            found = jax.devices("cpu")
        if len(found) < devices:
            raise CaptureError(f"JAX started with {len(found)} CPU devices and the mesh needs "
                               f"{devices}: call pod.jax before anything else uses JAX, or run "
                               "tpu-pod run-jax in a fresh process")
        return list(found[:devices]), ""
    from jax.experimental import topologies

    with _quiet_stderr() as printed:
        try:
            desc = topologies.get_topology_desc(topology_name=topo, platform="tpu",
                                                **_topology_options(topo, slices))
        except Exception as err:  # libtpu's errors are RuntimeErrors of many kinds
            raise CaptureError(f"libtpu could not describe topology {topo!r}: "
                               f"{str(err).splitlines()[0][:200]}") from None
    return list(desc.devices), printed[0] if printed else ""


def make_mesh(jax: Any, devices: list, mesh_axes: Mapping[str, int]) -> Any:
    """A ``jax.sharding.Mesh`` of ``devices`` with these axes, reshaped in the order the
    topology lists them (the first torus coordinate fastest, slice after slice: the
    same placement on both paths, every mesh axis a block of the torus;
    ``pod.hlo.groups.Placement.tpu_order``)."""
    import numpy as np
    from jax.sharding import Mesh

    return Mesh(np.array(devices, dtype=object).reshape(tuple(mesh_axes.values())),
                tuple(mesh_axes))


def _physical(mesh: Any, torus_shape: Sequence[int], path: str) -> tuple[int, ...]:
    """Each of the module's device ids (the mesh's devices, flattened) -> physical device
    (slice x chips per slice + row-major torus rank of its coordinates)."""
    if path == "cpu":
        return ()
    import numpy as np

    chips = math.prod(torus_shape)
    out = []
    for device in mesh.devices.flat:
        coords = tuple(device.coords)[:len(torus_shape)]
        rank = int(np.ravel_multi_index(coords, tuple(torus_shape)))
        out.append(int(getattr(device, "slice_index", 0) or 0) * chips + rank)
    return tuple(out)


def _shardings(jax: Any, mesh: Any, args: Sequence[Any], in_specs: Any) -> tuple[Any, list]:
    """(in_shardings for jit, the args as ShapeDtypeStructs) from ``in_specs`` (a pytree of
    PartitionSpecs, one per arg, None: replicated) or the args' own shardings."""
    from jax.sharding import NamedSharding, PartitionSpec

    def spec_sharding(spec: Any) -> Any:
        return NamedSharding(mesh, spec if isinstance(spec, PartitionSpec) else PartitionSpec())

    def struct(x: Any, sharding: Any) -> Any:
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    if in_specs is None:
        shardings = [jax.tree.map(lambda x: getattr(x, "sharding", None)
                                  or NamedSharding(mesh, PartitionSpec()), a) for a in args]
    else:
        if len(in_specs) != len(args):
            raise CaptureError(f"in_specs has {len(in_specs)} entries for {len(args)} arguments; "
                               "give one PartitionSpec (or pytree of them) per argument")
        shardings = []
        for arg, spec in zip(args, in_specs, strict=True):
            if isinstance(spec, PartitionSpec) or spec is None:
                shardings.append(jax.tree.map(lambda _, s=spec: spec_sharding(s), arg))
            else:
                shardings.append(jax.tree.map(lambda _, s: spec_sharding(s), arg, spec,
                                              is_leaf=lambda v: v is None))
    structs = [jax.tree.map(struct, a, s) for a, s in zip(args, shardings, strict=True)]
    return tuple(shardings), structs


def _versions(path: str) -> str:
    names = ["jax", "jaxlib"] + (["libtpu"] if path == "tpu" else [])
    out = []
    for name in names:
        try:
            out.append(f"{name}={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            out.append(f"{name}=?")
    return ",".join(out)


def _read_cache(key: str) -> Capture | None:
    meta, text = cache_dir() / f"{key}.json", cache_dir() / f"{key}.hlo.txt.gz"
    if not (meta.exists() and text.exists()):
        return None
    try:
        data = json.loads(meta.read_text())
        hlo = gzip.decompress(text.read_bytes()).decode()
    except (OSError, ValueError):
        return None
    data.update(hlo_text=hlo, devices=tuple(data["devices"]), compile_seconds=0.0, cached=True)
    return Capture(**data)


def _write_cache(found: Capture) -> None:
    directory = cache_dir()
    with contextlib.suppress(OSError):  # a cache that cannot be written is only slower
        directory.mkdir(parents=True, exist_ok=True)
        data = asdict(found)
        text = data.pop("hlo_text")
        for name in ("compile_seconds", "cached"):
            data.pop(name)
        (directory / f"{found.key}.hlo.txt.gz").write_bytes(gzip.compress(text.encode(), mtime=0))
        (directory / f"{found.key}.json").write_text(json.dumps(data, indent=1))


def _lower(jax: Any, step_fn: Callable, mesh: Any, shardings: Any, structs: list,
           name: str) -> Any:
    """``step_fn`` lowered over ``mesh`` (jitted with ``shardings`` unless it is already).

    Raises:
        CaptureError: it does not trace (one line: the error's first line).
    """
    jitted = step_fn if hasattr(step_fn, "lower") else jax.jit(step_fn, in_shardings=shardings)
    try:
        with (jax.set_mesh(mesh) if hasattr(jax, "set_mesh") else mesh):
            return jitted.lower(*structs)
    except Exception as err:  # the user's code: anything it raises while tracing
        first = (str(err).strip().splitlines() or [""])[0][:240]
        raise CaptureError(f"{name} does not trace with these arguments: "
                           f"{type(err).__name__}: {first}") from None


def _compile(lowered: Any, what: str) -> Any:
    """``lowered.compile()``, libtpu's chatter swallowed.

    Raises:
        CaptureError: XLA refused (one line: its error's first line).
    """
    error: Exception | None = None
    with _quiet_stderr():
        try:
            compiled = lowered.compile()
        except Exception as err:  # XLA's errors are of many kinds
            error = err
    if error is not None:
        first = (str(error).strip().splitlines() or [""])[0][:240]
        raise CaptureError(f"XLA could not compile {what}: {first}") from None
    return compiled


def _memory(compiled: Any) -> dict[str, int]:
    """XLA's ``memory_analysis()`` figures, bytes per device ({} when it has none)."""
    stats = compiled.memory_analysis()
    if stats is None:
        return {}
    return {k: int(getattr(stats, k)) for k in (
        "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
        "temp_size_in_bytes", "generated_code_size_in_bytes", "peak_memory_in_bytes",
        "host_argument_size_in_bytes", "host_temp_size_in_bytes")
        if hasattr(stats, k)}


def capture(step_fn: Callable, args: Sequence[Any], *, mesh_axes: Mapping[str, int],
            chip_name: str, torus_shape: Sequence[int], slice_label: str, slices: int = 1,
            in_specs: Any = None, path: str = "auto", use_cache: bool = True,
            progress: Callable[[str], None] | None = None, libtpu_args: str = "") -> Capture:
    """Lower and compile ``step_fn(*args)`` for the slice (module docstring).

    Args:
        step_fn: the step: a plain function or one already ``jax.jit``-ed.
        args: its arguments: arrays or ``jax.ShapeDtypeStruct`` s (pytrees of them),
            sharded by ``in_specs`` or by their own ``sharding``; or a callable
            ``args(mesh) -> tuple`` that builds them over the capture's mesh.
        mesh_axes: the mesh's axis sizes, major to minor (their product: the pod's
            devices).
        chip_name: the chip generation ("v5p").
        torus_shape: one slice's torus shape (``pod.config.slices``).
        slice_label: the slice's name for messages ("v5p-128").
        slices: identical slices (multislice: the TPU path compiles for all).
        in_specs: one ``PartitionSpec`` (or a pytree of them) per argument; None: the
            arguments' own shardings, else replicated.
        path: one of :data:`PATHS`.
        use_cache: read and write the cache (:func:`cache_dir`).
        progress: called with a line of text at each stage.
        libtpu_args: XLA's TPU flags for the compile, as ``LIBTPU_INIT_ARGS`` holds them
            on a TPU VM (e.g. MaxText's ``--xla_tpu_enable_async_collective_fusion=true
            ...``); the TPU path only, read when libtpu starts (once per process).

    Returns:
        The :class:`Capture`.

    Raises:
        CaptureError: jax or libtpu missing for the path; a mesh that does not match
            the slice; a step that does not trace or compile (one line each).
    """
    if path not in PATHS:
        raise CaptureError(f"path {path!r} is not a capture path; choose one of {', '.join(PATHS)}")
    if path == "auto":
        path = "tpu" if tpu_compile_available() else "cpu"
        libtpu_args = libtpu_args if path == "tpu" else ""  # TPU flags: nothing on a CPU
    if path == "tpu" and not tpu_compile_available():
        raise CaptureError("the TPU path needs libtpu: pip install 'tpu-pod-emulator[tpu-compile]' "
                           "(or use the CPU path: --path cpu)")
    say = progress or (lambda _: None)
    devices = math.prod(torus_shape) * slices
    _check_mesh(mesh_axes, devices, slice_label)
    if libtpu_args and path != "tpu":
        raise CaptureError("libtpu_args are XLA's TPU flags: they apply to the TPU path only")
    jax = _jax(path, devices, libtpu_args)
    topo = topology_name(chip_name, torus_shape)
    say(f"getting {devices} {'TPU ' + topo if path == 'tpu' else 'CPU'} devices")
    found, _ = _devices(jax, path, topo, slices, devices)
    mesh = make_mesh(jax, found, mesh_axes)
    if callable(args) and not isinstance(args, (tuple, list)):
        args = tuple(args(mesh))
    shardings, structs = _shardings(jax, mesh, list(args), in_specs)
    name = getattr(step_fn, "__name__", "the step")
    say(f"tracing {name}")
    lowered = _lower(jax, step_fn, mesh, shardings, structs, name)
    key = hashlib.sha256("\n".join((lowered.as_text(), slice_label, str(slices), path,
                                    json.dumps(dict(mesh_axes)), _versions(path),
                                    " ".join(libtpu_args.split()))).encode()
                         ).hexdigest()[:32]
    if use_cache:
        hit = _read_cache(key)
        if hit is not None:
            say(f"from the cache {cache_dir() / key}.hlo.txt.gz")
            return hit
    say(f"compiling {name} for {topo if path == 'tpu' else f'{devices} CPU devices'}"
        f"{' x ' + str(slices) + ' slices' if slices > 1 else ''} (this can take minutes)")
    start = time.perf_counter()
    compiled = _compile(lowered, f"{name} for {slice_label} ({path} path)")
    memory = _memory(compiled)
    result = Capture(hlo_text=compiled.as_text(), platform=path, topology=topo, slices=slices,
                     devices=_physical(mesh, torus_shape, path), mesh_axes=dict(mesh_axes),
                     memory=memory, compile_seconds=time.perf_counter() - start, cached=False,
                     key=key)
    if use_cache:
        _write_cache(result)
    return result

"""``tpu-pod run-jax`` and ``tpu-pod cost-hlo``: the user's own step on the emulated pod.

Thin over ``pod.jax``: find the step and its arguments in the user's file, parse
the options, print the tables, write the files.

``run-jax FILE.py:FUNCTION``: ``FUNCTION`` is a module-level function of the
file (plain or ``jax.jit``-ed); its arguments come from the file's args factory,
``<FUNCTION>_args(mesh)`` unless ``--args NAME`` names another: a module-level
function taking the capture's ``jax.sharding.Mesh`` and returning the tuple of
arguments (arrays or ``jax.ShapeDtypeStruct`` s, with ``NamedSharding`` s of the
mesh for the sharded ones). The mesh is ``--mesh``, else the file's ``MESH``
dict, else ``{data: <devices>}``.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pod.errors import CaptureError

__all__ = ["parse_mesh", "load_step", "default_output_dir"]


def parse_mesh(text: str) -> dict[str, int]:
    """``fsdp=64,tensor=2`` (or ``fsdp:64 tensor:2``) -> {"fsdp": 64, "tensor": 2}.

    Raises:
        CaptureError: text that is not NAME=SIZE pairs of positive sizes.
    """
    flat = re.sub(r"\s*([=:])\s*", r"\1", (text or "").strip().strip("{}"))
    mesh: dict[str, int] = {}
    for token in (t for t in re.split(r"[,\s]+", flat) if t):
        match = re.fullmatch(r"([A-Za-z_]\w*)[=:](\d+)", token)
        if match is None or match.group(1) in mesh or int(match.group(2)) < 1:
            raise CaptureError(f"--mesh {text!r} is not a mesh: give NAME=SIZE pairs, each axis "
                               "once, sizes >= 1, e.g. fsdp=64,tensor=2")
        mesh[match.group(1)] = int(match.group(2))
    if not mesh:
        raise CaptureError(f"--mesh {text!r} is not a mesh: give NAME=SIZE pairs, e.g. "
                           "fsdp=64,tensor=2")
    return mesh


def _import_file(path: Path) -> Any:
    if not path.is_file():
        raise CaptureError(f"{path}: no such file (give FILE.py:FUNCTION)")
    name = f"_tpu_pod_user_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise CaptureError(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent.resolve()))
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # the user's file: anything it raises is theirs
        first = (str(err).strip().splitlines() or [""])[0][:200]
        raise CaptureError(f"{path} does not import: {type(err).__name__}: {first}") from None
    finally:
        sys.path.pop(0)
    return module


def load_step(target: str, args_name: str | None
              ) -> tuple[Callable, Callable, dict[str, int] | None, str]:
    """(the step, its args factory, the file's MESH or None, the step's name) of
    ``FILE.py:FUNCTION`` (module docstring).

    Raises:
        CaptureError: a target not of that form, a file that does not import, a name
            it does not define or that is not a function.
    """
    path_text, sep, name = target.rpartition(":")
    if not sep or not path_text or not name.isidentifier():
        raise CaptureError(f"{target!r} is not FILE.py:FUNCTION (e.g. my_train.py:train_step)")
    module = _import_file(Path(path_text))
    step = getattr(module, name, None)
    if not callable(step):
        raise CaptureError(f"{path_text} defines no function {name!r}")
    factory_name = args_name or f"{name}_args"
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise CaptureError(f"{path_text} defines no args factory {factory_name}(mesh) returning "
                           f"the arguments of {name}; define it or name it with --args")
    mesh = getattr(module, "MESH", None)
    if mesh is not None and not (isinstance(mesh, dict)
                                 and all(isinstance(v, int) for v in mesh.values())):
        raise CaptureError(f"{path_text}: MESH must be a dict of axis sizes, got {mesh!r}")
    return step, factory, mesh, name


def default_output_dir(name: str, slice_name: str) -> Path:
    """runs/<name>-<slice>."""
    return Path("runs") / f"{re.sub(r'[^A-Za-z0-9_.-]+', '-', name)}-{slice_name}"

"""Where an HLO op sits in the user's program: the module's source tables read as stack
frames, and the one rule that tells the user's own code from the frameworks' under it.

Newer XLA (jax >= 0.11) prints four tables after the computations and puts a
``stack_frame_id=N`` in each instruction's metadata::

    FileNames
    1 "maxtext/layers/linears.py"
    FunctionNames
    1 "DenseGeneral.__call__"
    FileLocations
    1 {file_name_id=1 function_name_id=1 line=476 end_line=476 column=10 end_column=10}
    StackFrames
    1 {file_location_id=1 parent_frame_id=1}

A frame's ``parent_frame_id`` is its caller's id plus one, a root's is 1 (jax 0.12's
modules chain that way: in MaxText's T1, frame 157 at ``linears.py:162`` prints 157 and is
called from frame 156 at ``linears.py:476``, that one from 155, ...).

jax writes an op inside a nested computation (a ``scan`` body, a ``checkpoint``, a
gradient) with the frames of each enclosing call repeated once per level: T1's MLP matmul
walks ``_apply_layers_sequentially > NNXDecoder.__call__ > ... > train_step`` three times
before ``jit_and_compile``. :func:`stack` keeps each call site (``FileLocations`` entry)
once, where it first appears from the innermost frame.

Pure Python: no jax, no ray.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["LIBRARY_PACKAGES", "StackFrame", "is_library_file", "read_frames", "stack",
           "call_chain", "user_frame"]

#: Top-level packages whose code is the frameworks' the user builds on, not the user's own
#: (:func:`is_library_file`). Model libraries (MaxText, a fork of it) are not here: their
#: lines are what their users read and edit.
LIBRARY_PACKAGES = frozenset({
    "jax", "jaxlib", "flax", "optax", "orbax", "chex", "equinox", "haiku", "einops",
    "numpy", "scipy", "ml_dtypes", "torch", "torch_xla"})

_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
_SITE = re.compile(r"/(?:site|dist)-packages/")
_STDLIB = re.compile(r"/lib/python\d+(?:\.\d+)?/")


def is_library_file(path: str) -> bool:
    """Whether a source file is library code rather than the user's: the rule
    :meth:`pod.hlo.HloModule.source_of` skips frames by.

    Library code is: Python's own (a name such as ``<frozen runpy>``; a file under
    ``lib/pythonX.Y/`` outside ``site-packages``); a file of one of
    :data:`LIBRARY_PACKAGES` (the first directory after the last ``site-packages/`` or
    ``dist-packages/``, or of a relative path, as dumps made portable write them:
    ``optax/_src/transform.py``); any file under ``jax/_src/`` (a source checkout of jax).
    Everything else, other installed packages included, is the user's.

    Args:
        path: the file as the module's ``FileNames`` table gives it.

    >>> is_library_file("/v/lib/python3.12/site-packages/optax/_src/transform.py")
    True
    >>> is_library_file("maxtext/layers/linears.py"), is_library_file("my_model.py")
    (False, False)
    """
    path = path.replace("\\", "/")
    if path.startswith("<") or "/jax/_src/" in f"/{path}":
        return True
    parts = _SITE.split(path)
    if len(parts) > 1:
        return parts[-1].split("/", 1)[0] in LIBRARY_PACKAGES
    if _STDLIB.search(path):
        return True
    return not path.startswith("/") and path.split("/", 1)[0] in LIBRARY_PACKAGES


@dataclass(frozen=True)
class StackFrame:
    """One frame of a module's ``StackFrames`` table, with its file location.

    Attributes:
        file: the source file as ``FileNames`` gives it (a full path, or a portable one
            such as "maxtext/layers/linears.py").
        line: its line number ("?" when the table does not say).
        function: the function's qualified name, e.g. "Decoder.__call__".
        location: its ``FileLocations`` id (two frames at one location are one call site).
        parent: the caller's frame id; "" at the root.
    """

    file: str
    line: str
    function: str
    location: str
    parent: str

    @property
    def is_library(self) -> bool:
        """Library code, not the user's (:func:`is_library_file`)."""
        return is_library_file(self.file)

    def describe(self) -> str:
        """"file:line (function)", the file without its directory."""
        return f"{self.file.rsplit('/', 1)[-1]}:{self.line} ({self.function})"


def read_frames(lines: Iterable[tuple[int, str]]) -> dict[str, StackFrame]:
    """The module's stack frames by id, from its source tables (numbered lines of the
    module's text: lines outside the tables are skipped). {} without the tables; a frame
    whose location is not in the table is left out."""
    files: dict[str, str] = {}
    functions: dict[str, str] = {}
    locations: dict[str, dict[str, str]] = {}
    stack_fields: dict[str, dict[str, str]] = {}
    tables = {"FileNames": files, "FunctionNames": functions}
    table = ""
    for _, text in lines:
        if text in _TABLES:
            table = text
            continue
        match = re.match(r"^(\d+)\s+(.*)$", text)
        if not match:
            continue
        key, value = match.groups()
        if table in tables:
            tables[table][key] = value.strip('"')
        elif table == "FileLocations":
            locations[key] = dict(re.findall(r"(\w+)=(\d+)", value))
        elif table == "StackFrames":
            stack_fields[key] = dict(re.findall(r"(\w+)=(\d+)", value))
    frames: dict[str, StackFrame] = {}
    for key, fields in stack_fields.items():
        location = fields.get("file_location_id", "")
        if location not in locations:
            continue
        where = locations[location]
        parent = int(fields.get("parent_frame_id", "1") or 1) - 1
        frames[key] = StackFrame(files.get(where.get("file_name_id", ""), "?"),
                                 where.get("line", "?"),
                                 functions.get(where.get("function_name_id", ""), "?"),
                                 location, str(parent) if parent > 0 else "")
    return frames


def stack(frames: dict[str, StackFrame], frame_id: str) -> tuple[StackFrame, ...]:
    """The frame ``frame_id`` and its callers, innermost first, each call site once (the
    first time it appears: module docstring). () for an id not in ``frames``."""
    out: list[StackFrame] = []
    seen: set[str] = set()
    visited: set[str] = set()
    while frame_id in frames and frame_id not in visited:
        visited.add(frame_id)
        frame = frames[frame_id]
        if frame.location not in seen:
            seen.add(frame.location)
            out.append(frame)
        frame_id = frame.parent
    return tuple(out)


def call_chain(frames: tuple[StackFrame, ...], module_name: str) -> str:
    """The function names of a :func:`stack`, outermost to innermost, joined by " > ",
    starting at the function jax compiled: a module jax names ``jit_<function>`` starts
    at the outermost frame of that function (its name, or a qualified name ending in
    ``.<function>``), leaving out the frames that called ``jax.jit``; any other module, or
    one whose frames do not hold the function, keeps every frame. "" for no frames.

    >>> f = [StackFrame("m.py", "3", n, n, "") for n in ("Block.__call__", "loss", "main")]
    >>> call_chain(tuple(f), "jit_loss")
    'loss > Block.__call__'
    """
    names = [f.function for f in reversed(frames)]
    jitted = re.fullmatch(r"p?jit_(.+)", module_name)
    if jitted:
        name = jitted.group(1)
        start = next((i for i, n in enumerate(names)
                      if n == name or n.endswith(f".{name}")), 0)
        names = names[start:]
    return " > ".join(names)


def user_frame(frames: tuple[StackFrame, ...]) -> StackFrame | None:
    """The innermost frame of a :func:`stack` that is the user's own code
    (:func:`is_library_file`), else its innermost frame; None for no frames."""
    return next((f for f in frames if not f.is_library), frames[0] if frames else None)

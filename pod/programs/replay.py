"""Replaying a layer's timing-only pass: cost a layer once, reuse it for every layer and
every step like it.

On a timing-only core (``core.execute`` False) a layer's forward or backward pass
leaves op records (``chip.OpRecord``) and collective calls (``CollectiveCall``)
that depend only on what the pass is given: the layer (its type and settings),
the shapes of its parameters and inputs, its tensor and expert hooks (their axis
sizes and phase), the core (chip, precision, MXU model) and the core's fusion
state at the start (``chip.TensorCore.fusion_state``: the MXU record an epilogue
joins, the prologue ops waiting for the next one). The blocks of a decoder are
identical, so a step of an L-block model runs the same pass L times, and the
points of a layout search that share their per-device shapes run it again.

A :class:`LayerTape` keeps each pass's records and calls the first time it runs
(the **segment**), keyed by a signature of all of the above, and replays it the
next time: the records appended to the core with their names moved to the layer
that runs (``block7/attention/q`` for ``block3/attention/q``; a name that starts
with another layer's name, such as the previous block's residual add fused into
this one's first matmul, moves by the same offset), the calls appended with
``after_record`` moved to where the segment now starts, the core's fusion state
set to what the pass left. The outputs are the first run's: on a timing-only
core they are read-only zero views of the same shapes.

A replayed step's records and calls equal a step run op by op, record for record
(``tests/pod/programs/test_replay.py``); ``tpu-pod plan`` costs with a tape
(``pod.runtime.timing.TimingPod(tape=...)``) and is compared against costing
each point alone. A pass whose signature cannot be taken (an attribute of a type
this module does not know) simply runs, every time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import itertools
import operator
import re
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from chip.core import OpRecord
from pod.programs.collectives import CollectiveCall

__all__ = ["LayerTape", "UnsignableError", "signature"]

#: attributes that name an object or hold the device's core and collectives: not what a
#: pass computes (names move with the layer; the core's figures are keyed separately)
_UNKEYED = frozenset({"name", "core", "comm"})


#: the fields of a record and of a call, in constructor order, and where the ones a replay
#: moves sit among them
_RECORD_FIELDS = tuple(f.name for f in dataclasses.fields(OpRecord))
_NAME_AT, _FUSED_AT = _RECORD_FIELDS.index("name"), _RECORD_FIELDS.index("fused_into")
_CALL_FIELDS = tuple(f.name for f in dataclasses.fields(CollectiveCall))
_TAG_AT, _AFTER_AT, _WAIT_AT = (_CALL_FIELDS.index(k) for k in ("tag", "after_record",
                                                                 "wait_record"))


#: where a name splits into parts (a layer's name is one part)
_PARTS = re.compile(r"([/ ])")


class UnsignableError(Exception):
    """An object :func:`signature` cannot describe (the pass is then not replayed)."""


_ARRAY_TYPE = frozenset({np.ndarray})
_SHAPE, _DTYPE = operator.attrgetter("shape"), operator.attrgetter("dtype")


def signature(value: Any, known: dict[int, tuple[Any, Any]] | None = None) -> Any:
    """A hashable description of what ``value`` contributes to a timing-only pass: arrays
    by shape and dtype (their values are zeros there), mappings and sequences item by
    item, objects by type and attributes (not their ``name``, ``core`` or ``comm``),
    functions by their qualified name. ``known``: id -> (object, its signature) of
    objects described before (a replayed pass's outputs, which nothing changes).

    Raises:
        UnsignableError: a value of a kind it does not know.
    """
    if type(value) is np.ndarray:
        return ("array", value.shape, value.dtype)
    if known is not None:
        hit = known.get(id(value))
        if hit is not None and hit[0] is value:
            return hit[1]
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, (dict, types.MappingProxyType)):
        values = tuple(value.values())
        if set(map(type, values)) <= _ARRAY_TYPE:  # most often: shapes and dtypes in C loops
            return ("arrays", tuple(value), tuple(map(_SHAPE, values)),
                    tuple(map(_DTYPE, values)))
        return ("map", tuple((k, signature(v, known)) for k, v in value.items()))
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(signature(v, known) for v in value))
    if isinstance(value, np.ndarray):
        return ("array", value.shape, value.dtype)
    if isinstance(value, (np.generic, np.dtype)):
        return ("np", repr(value))
    if isinstance(value, (set, frozenset)):
        return ("set", tuple(sorted(repr(v) for v in value)))
    if isinstance(value, enum.Enum):
        return ("enum", type(value).__qualname__, value.name)
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, np.ufunc, type)):
        return ("fn", getattr(value, "__module__", ""), getattr(value, "__qualname__",
                                                                 getattr(value, "__name__", "")))
    if dataclasses.is_dataclass(value):
        fields = tuple((f.name, signature(getattr(value, f.name), known))
                       for f in dataclasses.fields(value) if f.name not in _UNKEYED)
        return (type(value).__module__, type(value).__qualname__, fields)
    attrs = getattr(value, "__dict__", None)
    if attrs is not None and type(value).__module__.startswith(("pod.", "chip.")):
        return (type(value).__module__, type(value).__qualname__,
                tuple((k, signature(v, known)) for k, v in sorted(attrs.items())
                      if k not in _UNKEYED))
    raise UnsignableError(type(value).__qualname__)


@dataclass(frozen=True)
class _Segment:
    """One pass as recorded: its records and calls with names relative to the layer that
    ran it (``_Names``), ``after_record`` / ``wait_record`` relative to its start, the
    fusion state it left (the host as an index into its records, or the entry's), and
    its outputs."""

    seconds: float  # its records' on the compute stream (host transfers aside)
    mxu_seconds: float  # its MXU records' (what no fusion state changes)
    mxu_bound_seconds: float  # its MXU records' bound by their cycles (not their HBM bytes)
    records: tuple[tuple[Any, ...], ...]  # (field values, relative name, relative fused_into)
    calls: tuple[tuple[Any, ...], ...]  # (field values, relative tag, after, wait)
    host: int | None
    host_vpu_seconds: float
    pending: tuple[tuple[Any, ...], ...]
    result: Any


class _Names:
    """Names relative to a layer: every part of a name (split at "/" and " ") that is a
    layer's name becomes its offset from the layer that runs the pass:
    ``block5/attention/q`` run by layer 5 is (0, "/", "attention", "/", "q"),
    ``adamw/block4/mlp/wo/m`` (0 for layer 4); a name with no layer's name in it stays
    as it is."""

    def __init__(self, layer_names: Sequence[str]) -> None:
        self.names = tuple(layer_names)
        self.index = {n: i for i, n in enumerate(self.names)}
        self._relative: dict[tuple[str, int], str | tuple[int | str, ...]] = {}
        self._absolute: dict[tuple[tuple[int | str, ...], int], str] = {}

    def relative(self, name: str, layer: int) -> str | tuple[int | str, ...]:
        kept = self._relative.get((name, layer))
        if kept is None:
            if len(self._relative) > 100_000:
                self._relative.clear()
            kept = self._relative[(name, layer)] = self._relative_name(name, layer)
        return kept

    def _relative_name(self, name: str, layer: int) -> str | tuple[int | str, ...]:
        parts = _PARTS.split(name)
        if not any(p in self.index for p in parts):
            return name
        out: list[int | str] = []
        for p in parts:  # offsets, and the text between them in one piece
            at = self.index.get(p)
            last = out[-1] if out else None
            if at is not None:
                out.append(at - layer)
            elif isinstance(last, str):
                out[-1] = last + p
            else:
                out.append(p)
        return tuple(out)

    def absolute(self, rel: str | tuple[int | str, ...], layer: int) -> str:
        if isinstance(rel, str):
            return rel
        kept = self._absolute.get((rel, layer))
        if kept is None:
            if len(self._absolute) > 100_000:
                self._absolute.clear()
            kept = self._absolute[(rel, layer)] = self._absolute_name(rel, layer)
        return kept

    def _absolute_name(self, rel: tuple[int | str, ...], layer: int) -> str:
        names, n = self.names, len(self.names)
        out: list[str] = []
        for p in rel:
            if isinstance(p, int):
                if not 0 <= layer + p < n:
                    raise IndexError(layer + p)
                out.append(names[layer + p])
            else:
                out.append(p)
        return "".join(out)


class LayerTape:
    """Segments of timing-only passes, kept across steps and programs (module docstring).

    Args:
        max_segments: segments kept at most (the oldest go first).
        max_records: records kept named for the layers they were replayed at, at most
            (then they are named again as needed): a few hundred bytes each.

    Attributes:
        hits, misses: passes replayed, passes run (and kept when their signature could
            be taken).
        pass_seconds: (a device's collectives, method) -> simulated seconds of the
            compute-stream records (host transfers aside) of the passes run or replayed
            with them since it was last cleared: a device's forward and backward passes
            are part of its compute, a lower bound of its step (``tpu-pod plan`` prunes
            with it).
        pass_mxu_seconds: (a device's collectives, method, layer index) -> the least
            simulated seconds of the MXU records of one such pass since it was last
            cleared. An MXU record's seconds depend on the op's shapes and the core only
            (``chip.TensorCore``: never on the fusion state, which only moves VPU work),
            so a pass of a layer with the same signature on the same shapes elsewhere
            (another pipeline stage's block) takes at least as long (``tpu-pod plan``'s
            pipeline bound).
        pass_mxu_bound_seconds: (a device's collectives, method) -> seconds of the MXU
            records bound by their cycles (``pod.report.stats.op_bound`` "mxu") of the
            passes since it was last cleared: what the chip's sustained MXU budget holds
            a step to (``pod.report.clock.sustained_clocks``).
    """

    def __init__(self, max_segments: int = 4096, max_records: int = 600_000) -> None:
        self.max_segments, self.max_records = int(max_segments), int(max_records)
        # (segment, names, layer) -> the segment's records named for that layer, ...
        self._placed: dict[tuple[int, int, int], tuple[Any, ...]] = {}
        self._placed_records = 0
        # key -> its segment, or (a pass that fuses into the MXU record before it) a dict of
        # them by that record's seconds and name and the VPU seconds already fused into it
        self._segments: dict[Any, _Segment | dict[Any, _Segment]] = {}
        self._layer_keys: dict[int, tuple[Any, Any]] = {}  # id(layer) -> (layer, signature)
        self._names: dict[tuple[str, ...], _Names] = {}
        self._known: dict[int, tuple[Any, Any]] = {}  # id -> (a pass's output, signature)
        self._signed: dict[int, tuple[Any, Any]] = {}  # id -> (an argument, its signature)
        # a container's or a layer's signature -> its number (``_token``); never reused
        self._tokens: dict[Any, int] = {}
        self._next_token = itertools.count()
        self._specs: dict[int, tuple[Any, int]] = {}  # id(a core's spec) -> (it, its token)
        self.pass_seconds: dict[tuple[Any, str], float] = {}
        self.pass_mxu_seconds: dict[tuple[Any, str, int], float] = {}
        self.pass_mxu_bound_seconds: dict[tuple[Any, str], float] = {}
        self.hits = self.misses = 0

    def run(self, core: Any, comm: Any, layer_names: Sequence[str], index: int, layer: Any,
            method: str, args: tuple[Any, ...], run: Callable[[], Any]) -> Any:
        """``run()``, the pass ``method`` of ``layer`` (the program's layer ``index`` of
        ``layer_names``) on ``args`` (its inputs and keywords, hooks included; a string
        among them, such as the parameter an optimizer's update is named after, counts
        relative to the layer); replayed when a pass with the same signature ran before.

        Returns:
            What ``run()`` returns (the first run's outputs when replayed).
        """
        names = self._names.get(tuple(layer_names))
        if names is None:
            names = self._names[tuple(layer_names)] = _Names(layer_names)
        host, vpu_seconds, pending = core.fusion_state()
        try:
            key = (self._layer_key(layer), method,
                   tuple(names.relative(a, index) if isinstance(a, str) else self._sign(a)
                         for a in args),
                   self._core_key(core), host is None,
                   tuple((names.relative(p[0], index), *p[1:]) for p in pending))
        except UnsignableError:
            self.misses += 1
            start = len(core.records)
            result = run()
            done = core.records[start:]
            self._count(comm, method, index, _compute_seconds(done), *_mxu_seconds(done))
            return result
        # a pass whose VPU work joins the MXU record before it also depends on that record
        host_key = None if host is None else (host.seconds, names.relative(host.name, index),
                                              vpu_seconds)
        found = self._segments.get(key)
        segment = found.get(host_key) if isinstance(found, dict) else found
        if segment is not None:
            try:
                self._replay(core, comm, names, index, segment, host)
            except IndexError:  # a name of a layer this program does not have: run it
                pass
            else:
                self.hits += 1
                self._count(comm, method, index, segment.seconds, segment.mxu_seconds,
                            segment.mxu_bound_seconds)
                return segment.result
        self.misses += 1
        start_record, start_call = len(core.records), len(comm.calls)
        result = run()
        segment = _record(core, comm, names, index, start_record, start_call, result)
        self._count(comm, method, index, segment.seconds, segment.mxu_seconds,
                    segment.mxu_bound_seconds)
        self._know(result)
        if _joins_entry_host(core.records[start_record:]):
            found = found if isinstance(found, dict) else {}
            found[host_key] = segment
            self._keep(key, found)
        else:
            self._keep(key, segment)
        return result

    def clear_passes(self) -> None:
        """Forget the passes counted so far (``pass_seconds``, ``pass_mxu_seconds``,
        ``pass_mxu_bound_seconds``)."""
        self.pass_seconds.clear()
        self.pass_mxu_seconds.clear()
        self.pass_mxu_bound_seconds.clear()

    def _count(self, comm: Any, method: str, index: int, seconds: float,
               mxu_seconds: float, mxu_bound_seconds: float) -> None:
        key = (comm, method)  # the object, not its id: kept alive, its id is not reused
        self.pass_seconds[key] = self.pass_seconds.get(key, 0.0) + seconds
        bound = self.pass_mxu_bound_seconds
        bound[key] = bound.get(key, 0.0) + mxu_bound_seconds
        at = (comm, method, index)
        self.pass_mxu_seconds[at] = min(self.pass_mxu_seconds.get(at, mxu_seconds), mxu_seconds)

    def _sign(self, value: Any) -> Any:
        """:func:`signature` of a pass's argument; containers are remembered by identity
        (kept alive while remembered, so an id is not reused): a pass reads its
        arguments and nothing changes them between passes (a step's hooks serve every
        layer, a program's zero parameters every step)."""
        if type(value) is np.ndarray or value is None or isinstance(value, (bool, int, float)):
            return signature(value)
        kept = self._signed.get(id(value))
        if kept is not None and kept[0] is value:
            return kept[1]
        sig = self._token(signature(value, self._known))
        if len(self._signed) >= 4 * self.max_segments:
            self._signed.clear()
        self._signed[id(value)] = (value, sig)
        return sig

    def _token(self, sig: Any) -> Any:
        """A container's signature as a small stand-in, ("token", its number): equal
        signatures get the same number, and a number is never given to another signature
        (so a key built of them is the same key), while a key holding it hashes and
        compares at once (a layer's or an optimizer state's signature is a deep tuple,
        hashed at every lookup otherwise). Other values are returned as they are."""
        if type(sig) is not tuple:
            return sig
        number = self._tokens.get(sig)
        if number is None:
            if len(self._tokens) >= 16 * self.max_segments:
                self._tokens.clear()  # later ones get new numbers: those kept just miss
            number = self._tokens[sig] = next(self._next_token)
        return ("token", number)

    def _core_key(self, core: Any) -> tuple[Any, ...]:
        """``_core_key`` with the core's spec as a token (``_token``; kept per spec)."""
        spec = core.spec
        kept = self._specs.get(id(spec))
        if kept is None or kept[0] is not spec:
            if len(self._specs) >= 1024:
                self._specs.clear()
            kept = self._specs[id(spec)] = (spec, self._token(("spec", spec)))
        return (kept[1], *_core_key(core)[1:])

    def _know(self, result: Any) -> None:
        """Keep the signatures of a pass's outputs (and of each, for a tuple): what the
        next pass is given (a forward's cache, its backward's input) is often one."""
        if len(self._known) > 4 * self.max_segments:
            self._known.clear()
        parts = result if isinstance(result, tuple) else ()
        for value in (result, *parts):
            if not isinstance(value, (np.ndarray, str, int, float, type(None))):
                with contextlib.suppress(UnsignableError):
                    self._known[id(value)] = (value, signature(value, self._known))

    def _layer_key(self, layer: Any) -> Any:
        kept = self._layer_keys.get(id(layer))
        if kept is None or kept[0] is not layer:
            kept = self._layer_keys[id(layer)] = (layer, self._token(signature(layer)))
        return kept[1]

    def _keep(self, key: Any, segment: _Segment | dict[Any, _Segment]) -> None:
        if len(self._segments) >= self.max_segments:
            del self._segments[next(iter(self._segments))]
        self._segments[key] = segment

    def _replay(self, core: Any, comm: Any, names: _Names, index: int, segment: _Segment,
                entry_host: OpRecord | None) -> None:
        """Append the segment's records and calls as layer ``index``'s (module docstring).

        Raises:
            IndexError: a name moves past the program's layers (nothing appended).
        """
        records, calls, pending = self._placed_at(names, index, segment)
        base = len(core.records)
        placed = []
        for row, after, wait in calls:
            values = list(row)
            values[_AFTER_AT] = base + after
            values[_WAIT_AT] = None if wait is None else base + wait
            placed.append(CollectiveCall(*values))
        host = entry_host if segment.host is None else records[segment.host]
        core.append_records(records, (host, segment.host_vpu_seconds, pending))
        comm.calls.extend(placed)

    def _placed_at(self, names: _Names, index: int, segment: _Segment) -> tuple[Any, ...]:
        """The segment's records named for layer ``index`` (records are frozen: the same
        objects serve every replay there), its calls' fields with their tags, its pending
        prologue ops; kept until ``max_records`` records are."""
        key = (id(segment), id(names), index)
        kept = self._placed.get(key)
        if kept is not None and kept[0] is segment:
            return kept[1:]
        records = []
        for values, name, fused in segment.records:
            row = list(values)
            row[_NAME_AT] = names.absolute(name, index)
            row[_FUSED_AT] = names.absolute(fused, index) if fused else ""
            records.append(_op_record(row))
        calls = []
        for values, tag, after, wait in segment.calls:
            row = list(values)
            row[_TAG_AT] = names.absolute(tag, index)
            calls.append((row, after, wait))
        pending = tuple((names.absolute(p[0], index), *p[1:]) for p in segment.pending)
        self._placed_records += len(records)
        if self._placed_records > self.max_records:
            self._placed.clear()
            self._placed_records = len(records)
        self._placed[key] = (segment, records, calls, pending)
        return records, calls, pending


_NEW_RECORD = object.__new__
_SET_FIELDS = tuple(getattr(OpRecord, f).__set__ for f in _RECORD_FIELDS)


def _op_record(values: Sequence[Any]) -> OpRecord:
    """``OpRecord(*values)`` (the fields in constructor order), without the frozen
    dataclass's ``__init__`` and its per-field ``object.__setattr__``: the values are a
    record's that was made by ``__init__`` (it has no ``__post_init__``); equal to it."""
    record = _NEW_RECORD(OpRecord)
    for set_field, value in zip(_SET_FIELDS, values, strict=True):
        set_field(record, value)
    return record


def _joins_entry_host(records: Sequence[OpRecord]) -> bool:
    """Whether a pass's VPU work fused into the MXU record made before it: a fused record
    before the pass's own first MXU record."""
    for r in records:
        if r.unit == "mxu":
            return False
        if r.fused_into:
            return True
    return False


def _compute_seconds(records: Sequence[OpRecord]) -> float:
    """Seconds the records take on the compute stream: host transfers run beside it
    (``pod.report.clock``)."""
    return sum(float(r.seconds) for r in records if r.unit != "host")


def _mxu_seconds(records: Sequence[OpRecord]) -> tuple[float, float]:
    """Seconds of the MXU records among ``records``, and of those bound by their cycles
    (not their HBM bytes: ``pod.report.stats.op_bound``)."""
    mxu = [r for r in records if r.unit == "mxu"]
    return (sum(float(r.seconds) for r in mxu),
            sum(float(r.seconds) for r in mxu if r.bound != "memory"))


def _core_key(core: Any) -> tuple[Any, ...]:
    """What a core contributes to an op's record besides the op: its spec and settings."""
    return (core.spec, core.precision, core.mxu_model, core.emulates_numerics, core.execute,
            core.sustained, core.double_buffered, core.host_bytes_per_s)


def _record(core: Any, comm: Any, names: _Names, index: int, start_record: int,
            start_call: int, result: Any) -> _Segment:
    """The segment of the pass that just ran from ``start_record`` / ``start_call``."""
    records = core.records[start_record:]
    rel = tuple((tuple(getattr(r, f) for f in _RECORD_FIELDS), names.relative(r.name, index),
                 names.relative(r.fused_into, index) if r.fused_into else None)
                for r in records)
    calls = tuple((tuple(getattr(c, f) for f in _CALL_FIELDS), names.relative(c.tag, index),
                   c.after_record - start_record,
                   None if c.wait_record is None else c.wait_record - start_record)
                  for c in comm.calls[start_call:])
    host, vpu_seconds, pending = core.fusion_state()
    at = next((k for k in range(len(records) - 1, -1, -1) if records[k] is host), None)
    return _Segment(_compute_seconds(records), *_mxu_seconds(records), rel, calls, at, vpu_seconds,
                    tuple((names.relative(p[0], index), *p[1:]) for p in pending), result)

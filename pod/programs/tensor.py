"""Tensor parallelism's collectives around a block's parallel parts (Megatron's f and g).

A transformer block calls four operators around its attention and MLP
(``pod.workloads.transformer.TensorHooks``; [MEG] Shoeybi et al. 2019, the f
and g operators; [SP] Korthikanti et al. 2022 for sequence parallelism). On a
device holding a slice of the heads and MLP units, :class:`TensorCollectives`
runs them over the ``tensor`` axis of the device's collectives (kind
"activation", tags "<place> <phase>"):

- ``enter`` (before a column-parallel part): identity, or with sequence
  parallelism the all-gather of the sequence chunks;
- ``leave`` (after a row-parallel part): the allreduce of the partial sums, or
  with sequence parallelism their reduce-scatter over the sequence;
- ``enter_grad`` / ``leave_grad``: their transposes in backward.

The device at position i of its tensor group holds chunk i of the sequence.
On a timing-only core (``core.execute`` False) the calls are issued with
buffers of the right sizes and the results are zero views: no copy of a
(B, T, C) activation.

What the clock is told (``CollectiveCall``): the activations move in the
dtype of the activations (bf16 under bf16 precision: :func:`wire_itemsize`),
and each collective is overlapped with its matmul as XLA's collective matmul
(windowed einsum) does: a ``leave`` / ``enter_grad`` with the matmuls that
produce it (the trailing MXU records of its sub-layer), an ``enter`` all-gather
with the matmul that consumes it.
"""

from __future__ import annotations

import numpy as np

from pod.programs.collectives import DeviceCollectives
from pod.workloads.layers import timing_zeros
from pod.workloads.transformer import TensorHooks

__all__ = ["TensorCollectives", "wire_itemsize", "producing_records"]

_F32 = np.float32
#: bytes per element of the activations and the weights an MXU of this precision
#: reads: what XLA moves after hoisting the convert ([SB] training.md: bf16)
_WIRE_BYTES = {"bf16": 2, "int8": 1, "fp32": 4}


def wire_itemsize(core) -> int:
    """Bytes per element of the activations and gathered weights on ``core``'s wire:
    bf16 (2) under bf16 precision, 4 under fp32, 1 under int8."""
    return _WIRE_BYTES.get(getattr(core, "precision", "bf16"), 4)


def producing_records(records, prefix: str) -> int:
    """How many trailing op records produced a tensor-parallel collective's input:
    the MXU records of its block (names starting with ``prefix``) at the end of
    ``records``, and the adds that sum their parts ("..._sum"): the matmuls XLA's
    collective matmul decomposes the collective into."""
    count = 0
    for rec in reversed(records):
        if not rec.name.startswith(prefix) or not (rec.unit == "mxu"
                                                    or rec.name.endswith("_sum")):
            break
        count += 1
    return count


class TensorCollectives(TensorHooks):
    """``TensorHooks`` over the tensor axis of ``comm`` (module docstring).

    Args:
        core: the device's TensorCore (``after_record`` of each call; ``execute``).
        comm: the device's collectives.
        phase: "fwd", "bwd" or "eval" (the tags' suffix).
        sequence: sequence parallelism.
    """

    def __init__(self, core, comm: DeviceCollectives, phase: str, sequence: bool):
        self.core, self.comm, self.phase, self.sequence = core, comm, phase, sequence
        self.size = comm.axis_size("tensor")
        self.shapes_only = not core.execute

    def _kw(self, tag: str, *, produced: bool = False) -> dict:
        """The call's keywords: ``produced``: the input of the collective was just
        produced by its sub-layer's matmuls (overlapped with them); else it feeds
        the next matmul (overlapped with that one)."""
        records = self.core.records
        prefix = tag.split("/", 1)[0] + "/"                               # the block's records
        overlap = ({"overlap_before": producing_records(records, prefix)} if produced
                   else {"overlap_after": 1})
        return {"tag": f"{tag} {self.phase}", "kind": "activation",
                "after_record": len(records), "itemsize": wire_itemsize(self.core), **overlap}

    def _flat(self, v: np.ndarray) -> np.ndarray:
        if self.shapes_only:
            return timing_zeros((v.size,), _F32)
        return np.ascontiguousarray(v, dtype=_F32).reshape(-1)

    def _allreduce(self, tag: str, v: np.ndarray) -> np.ndarray:
        out = self.comm.allreduce("tensor", self._flat(v), **self._kw(tag, produced=True))
        return timing_zeros(v.shape, _F32) if self.shapes_only else out.reshape(v.shape)

    def _gather(self, tag: str, v: np.ndarray) -> np.ndarray:            # (B, t, C) -> (B, T, C)
        b, t, c = v.shape
        full = self.comm.all_gather("tensor", self._flat(v), **self._kw(tag))
        if self.shapes_only:
            return timing_zeros((b, self.size * t, c), _F32)
        return full.reshape(self.size, b, t, c).transpose(1, 0, 2, 3).reshape(b, self.size * t, c)

    def _scatter(self, tag: str, v: np.ndarray) -> np.ndarray:           # (B, T, C) -> (B, t, C)
        b, t, c = v.shape[0], v.shape[1] // self.size, v.shape[2]
        kw = self._kw(tag, produced=True)
        if self.shapes_only:
            self.comm.reduce_scatter("tensor", timing_zeros((v.size,), _F32), **kw)
            return timing_zeros((b, t, c), _F32)
        buf = np.ascontiguousarray(v.reshape(b, self.size, t, c).transpose(1, 0, 2, 3))
        return self.comm.reduce_scatter("tensor", buf.reshape(-1), **kw).reshape(b, t, c)

    def enter(self, tag, x):
        return self._gather(tag, x) if self.sequence else x

    def leave(self, tag, y):
        return self._scatter(tag, y) if self.sequence else self._allreduce(tag, y)

    def enter_grad(self, tag, dx):
        return self._scatter(tag, dx) if self.sequence else self._allreduce(tag, dx)

    def leave_grad(self, tag, dy):
        return self._gather(tag, dy) if self.sequence else dy

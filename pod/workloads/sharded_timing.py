"""The sharded transformer's device program on a timing-only core: costs from shapes alone.

At pod scale a device's step cannot hold the arrays a functional step holds:
one gathered block of a 175B-class model is GiBs, its optimizer state more.
:class:`ShapeShardedTransformer` runs the very program of
:class:`pod.workloads.sharded.ShardedTransformer` (the same layers, the same
collectives in the same order, the same optimizer) on a TensorCore with
``execute = False``, where every op is recorded from its shapes and returns
zeros (``pod.workloads.layers.vector_op``, ``timing_zeros``). What it changes
is only what moves data without costing anything on the chip:

- the shard (:meth:`ShapeShardedTransformer.shape_shard`): parameter and
  optimizer-state chunks are read-only zero views of the right sizes (no
  memory);
- the tensor operators around a block's parallel parts (``_hooks``: the
  allreduce, or with sequence parallelism the all-gather and reduce-scatter,
  of an activation): issued with buffers of their sizes, the results zero
  views (no copy);
- the fsdp all-gather of a layer (``_gather``): the call is issued with a
  buffer of the device's chunk sizes, and the layer gets zero views of its
  tensor-local shapes (no unpacking copy, no bf16 rounding);
- the gradient reduction (``_reduce``): the reduce-scatter and the data
  allreduce are issued with buffers of the sizes ``pack_chunks`` would
  build (with sequence parallelism also the tensor allreduce of the
  replicated parameters' chunks), and the scaling by the number of token
  shards is recorded from its shape.

So its op records and collective calls equal a functional device's, record
for record and call for call (``tests/pod/runtime/test_sharded_timing.py``),
while a step of a 175B-class model costs wall time in the number of ops, not
in their sizes.

Every device of a ``{data, fsdp, tensor}`` mesh runs the same ops on arrays
of the same shapes (the batch and every chunk split evenly, padding
included) and the same collectives (each costed over every group of its
axis at once), so one representative device tells the step of all of them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from pod.workloads.layers import timing_zeros, vector_op
from pod.workloads.sharded import DeviceCoords, DeviceShard, ShardedTransformer, _TensorCollectives

__all__ = ["ShapeShardedTransformer", "update_start"]

_F32 = np.float32


def update_start(records: Sequence, optimizer_name: str) -> int | None:
    """Index of a step's first optimizer record (named ``"<optimizer>/..."`` by every
    optimizer of ``pod.workloads.optimizers``), None when there is none.

    The clock (``pod.report.sharded``) starts the update there; it waits for
    every gradient collective.
    """
    prefix = optimizer_name + "/"
    return next((i for i, r in enumerate(records) if r.name.startswith(prefix)), None)


class ShapeShardedTransformer(ShardedTransformer):
    """``ShardedTransformer`` for a timing-only core (module docstring).

    Same arguments and checks as :class:`ShardedTransformer`; run
    :meth:`train_step` with a core whose ``execute`` is False, a
    ``DeviceCollectives`` that only records (``ShapeCollectives``) and the
    shard of :meth:`shape_shard`.
    """

    def _chunk_elements(self, keys) -> list[int]:
        """Elements of this device's chunk of each key (padded, ``flat_chunk``)."""
        return [-(-math.prod(self._shapes[k]) // self.fsdp) for k in keys]

    def shape_shard(self, coords: DeviceCoords = DeviceCoords()) -> DeviceShard:
        """A device's parameter and optimizer-state chunks as zero views (no memory)."""
        params = {k: timing_zeros((n,), _F32)
                  for k, n in zip(self._shapes, self._chunk_elements(self._shapes))}
        state = {f"{k}/{slot}": v for k, v in params.items() for slot in self.optimizer.slots}
        return DeviceShard(coords, params, state)

    def _hooks(self, core, comm, phase):
        if self.tensor == 1:
            return None
        return _ShapeTensorHooks(core, comm, phase, self.sequence_parallel)

    def _gather(self, core, comm, shard, i, phase):
        keys = self._keys[i]
        if not keys:
            return {}
        layer = self.local_model.layers[i]
        mine = timing_zeros((sum(self._chunk_elements(k for k, _ in keys)),), _F32)
        comm.all_gather("fsdp", mine, tag=f"{layer.name} {phase}", kind="param_gather",
                        after_record=len(core.records))
        return {local: timing_zeros(self._shapes[key], _F32) for key, local in keys}

    def _reduce(self, core, comm, name, grads):
        if not grads:
            return {}
        widths = self._chunk_elements(grads)
        buf = timing_zeros((self.fsdp * sum(widths),), _F32)
        comm.reduce_scatter("fsdp", buf, tag=f"{name} grads", kind="grad_reduce",
                            after_record=len(core.records))
        part = comm.allreduce("data", timing_zeros((sum(widths),), _F32), tag=f"{name} grads",
                              kind="grad_reduce", after_record=len(core.records))
        if self.sequence_parallel and self.tensor > 1:  # replicated params: a chunk each
            mine = sum(w for key, w in zip(grads, widths) if self._split[key] is None)
            if mine:
                comm.allreduce("tensor", timing_zeros((mine,), _F32),
                               tag=f"{name} replicated grads", kind="grad_reduce",
                               after_record=len(core.records))
        if self.token_shards > 1:
            scale = np.float32(1.0 / self.token_shards)
            vector_op(core, f"{name}/grad_mean", np.multiply, part, scale,
                      out=(part.shape, _F32))
        return {key: timing_zeros((n,), _F32) for key, n in zip(grads, widths)}


class _ShapeTensorHooks(_TensorCollectives):
    """The tensor operators of the functional program (same calls, same tags and
    sizes), the exchanged activations zero views: no copy of a (B, T, C) array."""

    def _call(self, op, tag, size):
        getattr(self.comm, op)("tensor", timing_zeros((size,), _F32), **self._kw(tag))

    def _allreduce(self, tag, v):
        self._call("allreduce", tag, v.size)
        return timing_zeros(v.shape, _F32)

    def _gather(self, tag, v):                                            # (B, t, C) -> (B, T, C)
        b, t, c = v.shape
        self._call("all_gather", tag, v.size)
        return timing_zeros((b, self.size * t, c), _F32)

    def _scatter(self, tag, v):                                           # (B, T, C) -> (B, t, C)
        b, t, c = v.shape
        self._call("reduce_scatter", tag, v.size)
        return timing_zeros((b, t // self.size, c), _F32)

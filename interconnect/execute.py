"""Runs a collective :class:`~interconnect.collectives.Schedule` on in-memory buffers.

The pure reference the distributed run (``pod/collective.py``) is tested
against: same schedule, same arithmetic, no Ray.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from interconnect.collectives import Schedule
from interconnect.errors import ScheduleError

__all__ = ["execute"]


def execute(schedule: Schedule, buffers: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Applies every phase of ``schedule`` to copies of ``buffers``.

    Within a phase every transfer reads its source chunk as it was at the
    start of the phase (all sends of a phase happen at once); then, in the
    order the transfers are listed, the receiver either reduces,
    ``dst[d] = dst[d] + incoming``, or copies, ``dst[d] = incoming``, where
    ``d`` is the transfer's ``dst_chunk`` (its ``chunk`` except in an
    all-to-all). Chunk ``c`` is the element range
    ``schedule.chunk_bounds[c]`` of the flattened buffer. Arithmetic stays in the
    buffers' dtype (float32 stays float32).

    Args:
        schedule: the collective to run.
        buffers: ``schedule.num_ranks`` arrays, one per rank, all with the
            same shape and dtype and ``schedule.num_elements`` elements
            (any shape; chunks index the row-major flattening).

    Returns:
        New arrays, one per rank, with the shapes and dtype of the inputs.
        The inputs are not modified.

    Raises:
        ScheduleError: wrong number of buffers, or buffers whose size,
            shape or dtype do not match.
    """
    if len(buffers) != schedule.num_ranks:
        raise ScheduleError(
            f"execute got {len(buffers)} buffers; schedule {schedule.name!r} needs "
            f"num_ranks={schedule.num_ranks}"
        )
    outputs = [np.array(buffer, copy=True, order="C") for buffer in buffers]
    first = outputs[0]
    for rank, out in enumerate(outputs):
        if out.size != schedule.num_elements:
            raise ScheduleError(
                f"buffer of rank {rank} has {out.size} elements; schedule {schedule.name!r} "
                f"needs num_elements={schedule.num_elements}"
            )
        if out.shape != first.shape or out.dtype != first.dtype:
            raise ScheduleError(
                f"buffer of rank {rank} has shape {out.shape} and dtype {out.dtype}; rank 0's "
                f"are {first.shape} and {first.dtype}: all buffers must match"
            )
    flat = [out.reshape(-1) for out in outputs]  # views of the fresh copies
    bounds = schedule.chunk_bounds
    for phase in schedule.phases:
        incoming = []
        for t in phase:
            start, stop = bounds[t.chunk]
            incoming.append(flat[t.src][start:stop].copy())  # the value at phase start
        for t, data in zip(phase, incoming, strict=True):
            start, stop = bounds[t.dst_chunk]
            target = flat[t.dst]
            if t.reduce:
                target[start:stop] = target[start:stop] + data
            else:
                target[start:stop] = data
    return outputs

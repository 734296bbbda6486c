"""FSDP (ZeRO-3) bookkeeping: how a parameter is cut into per-device chunks and put back.

Every parameter's tensor-local array is flattened, zero-padded to a multiple
of the fsdp size and split into equal chunks; device ``f`` of an fsdp group
keeps chunk ``f`` ([ZeRO] Rajbhandari et al. 2020, stage 3). A layer's
all-gather concatenates every device's chunks of the layer's parameters
(:func:`unpack_gathered` cuts them back into arrays); its gradient
reduce-scatter sends chunk ``j`` of every array to device ``j``
(:func:`pack_chunks` lays the buffer out so). The collectives themselves are
issued by the device program (``pod.programs.transformer``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["flat_chunk", "pack_chunks", "unpack_gathered", "chunk_elements"]


def chunk_elements(size: int, parts: int) -> int:
    """Elements of one device's chunk of an array of ``size`` elements split over
    ``parts`` devices: ``ceil(size / parts)`` (the last chunk zero-padded)."""
    return -(-int(size) // int(parts))


def flat_chunk(x: np.ndarray, parts: int, index: int) -> np.ndarray:
    """Chunk ``index`` of x flattened and zero-padded to ``parts * ceil(x.size / parts)``.

    Returns:
        (ceil(x.size / parts),) float32, a new array.
    """
    c = -(-x.size // parts)
    padded = np.zeros(parts * c, np.float32)
    padded[:x.size] = np.asarray(x, np.float32).reshape(-1)
    return padded[index * c:(index + 1) * c].copy()


def pack_chunks(arrays: Sequence[np.ndarray], parts: int) -> np.ndarray:
    """The reduce-scatter buffer of several arrays: for j in 0 .. parts-1, chunk j
    (:func:`flat_chunk`) of each array in turn, so that chunk j of the buffer
    is device j's piece of every array.

    Returns:
        (parts * sum(ceil(a.size / parts)),) float32.
    """
    chunks = [[flat_chunk(a, parts, j) for a in arrays] for j in range(parts)]
    return np.concatenate([c for row in chunks for c in row]) if arrays else np.zeros(0, np.float32)


def unpack_gathered(buffer: np.ndarray, shapes: Sequence[tuple[int, ...]],
                    parts: int) -> list[np.ndarray]:
    """Inverse of :func:`pack_chunks`: the arrays of ``shapes`` from ``parts``
    concatenated pieces (an all-gather of every device's chunks).

    Args:
        buffer: (parts * sum(c_i),) float32, c_i = ceil(prod(shape_i) / parts).
        shapes: the arrays' shapes.
        parts: devices the arrays are split over.

    Returns:
        The arrays, float32, padding dropped.
    """
    sizes = [math.prod(s) for s in shapes]
    widths = [-(-n // parts) for n in sizes]
    rows = buffer.reshape(parts, sum(widths))                            # (parts, sum c)
    out, start = [], 0
    for shape, n, c in zip(shapes, sizes, widths, strict=True):
        out.append(rows[:, start:start + c].reshape(-1)[:n].reshape(shape))
        start += c
    return out

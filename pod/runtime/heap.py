"""``keep_freed_memory``: a chip actor keeps the heap its step frees for the next step.

A device's step allocates and frees the same temporaries every step (im2col
columns, activations, gradients: the quick start's largest are 512 KiB). glibc
serves blocks above its mmap threshold (128 KiB, raised on the fly up to the
largest block freed) by fresh ``mmap`` and returns the top of the heap to the
system once more than its trim threshold (twice the mmap threshold) is free, so
every step faulted its temporaries' pages in again: 570-3,400 minor page faults
per quick-start step over the 4 chip actors, 18-19 with the thresholds below
(``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` in the environment, the
same knobs; three runs each, alternated, on the 2-core machine of
BENCHMARKS.md's step section: the actors' CPU per step 67 / 76 / 78 ms without,
56 / 60 / 67 ms with). The values bound what an actor keeps: blocks up to
32 MiB come from the heap, and at most 64 MiB of freed heap stays mapped.
"""

from __future__ import annotations

import ctypes

__all__ = ["keep_freed_memory", "MMAP_THRESHOLD_BYTES", "TRIM_THRESHOLD_BYTES"]

#: blocks below this come from the heap (glibc's own ceiling for its moving threshold)
MMAP_THRESHOLD_BYTES = 32 << 20
#: freed memory at the top of the heap kept mapped, up to this
TRIM_THRESHOLD_BYTES = 64 << 20

# mallopt's parameters (glibc malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_freed_memory() -> bool:
    """Fix glibc's mmap and trim thresholds for this process (``MMAP_THRESHOLD_BYTES``,
    ``TRIM_THRESHOLD_BYTES``), so a step's temporaries reuse the heap instead of
    faulting in fresh pages every step. The numbers computed do not change.

    Returns:
        True if set; False where the C library has no ``mallopt`` (not glibc).
    """
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
                and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))

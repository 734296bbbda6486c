"""``one_blas_thread``: every back-end computes with BLAS on one thread, by construction.

Two reasons, one setting:

- Bits. A float32 matmul's bits depend on how many threads BLAS splits it over:
  OpenBLAS's Haswell / Zen sgemm kernels (what an AMD EPYC runs) give other bits
  on 1 and 2 threads (measured here with ``OPENBLAS_CORETYPE=Haswell``: 14 of the
  quick start's 8,192 conv2 kernel values after 3 steps), while its SkylakeX
  kernels happen not to. A Ray chip actor and the same device code in this
  process (``LocalPod``, the tests' in-process chips) are bit-identical only if
  both run BLAS on the same number of threads; one is what an actor can afford.
- Speed. Several chip actors (or a pod's device threads) share few cores, and a
  BLAS thread pool per device oversubscribes them: a sharded step on 2 cores took
  4.6 s with OpenBLAS's two threads, 0.2 s with one (pitfalls.md).

Every place that computes a device's numbers calls this: ``ChipActor``,
``BufferActor``, ``BenchmarkChipActor`` (for the actor's life) and ``LocalPod``
(from ``start`` to ``shutdown``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["one_blas_thread"]


def one_blas_thread() -> Any:
    """Limit BLAS (and an OpenMP runtime BLAS may use) in this process to one thread.

    Returns:
        threadpoolctl's limiter: ``restore_original_limits()`` undoes it, and it is
        a context manager (the limit inside the ``with`` block only).
    """
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=1)

"""The dtype parameters are stored in: float32 master weights or bf16 (MaxText ``weight_dtype``).

MaxText keeps its parameters in ``weight_dtype`` (``MaxText/configs/base.yml``
at tpu-recipes-v0.1.4, ../shared/reference/maxtext/base-tpu-recipes-v0.1.4.yml:
``weight_dtype: "float32"``, "bfloat16" the other choice). The gradients come
out in the parameters' dtype, and optax's AdamW keeps its moments in it too
(``mu_dtype: ""`` inherits from ``weight_dtype``; "nu_dtype is always inherited
from weights", the same file). So under ``bfloat16`` a parameter, its gradient
and its optimizer state take 2 bytes each, an FSDP all-gather moves the same
bf16 bytes it moves under float32 masters (XLA converts a float32 master to
bf16 before gathering it [SB]), the gradient reduce-scatter moves bf16, and the
optimizer update reads and writes bf16.

Numerics here: a bf16-stored array is a numpy array of ``ml_dtypes.bfloat16``
(2 bytes per element, so the optimizer's VPU records count bf16 HBM traffic);
the optimizer computes its update in float32 from the stored values and rounds
the result back to bf16 (round to nearest even), as an XLA fusion of the update
does ([SB] "How to Scale Your Model", training chapter).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from pod.workloads.layers import timing_zeros

__all__ = ["WEIGHT_DTYPES", "BFLOAT16", "weight_dtype", "weight_bytes", "stored", "computed"]

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
#: MaxText's weight_dtype names -> the numpy dtype parameters are stored in
WEIGHT_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": BFLOAT16}


def weight_dtype(name: str) -> np.dtype:
    """The numpy dtype of a ``weight_dtype`` name.

    Raises:
        ValueError: a name not in ``WEIGHT_DTYPES`` (one line, the choices).
    """
    if name not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {name!r}")
    return WEIGHT_DTYPES[name]


def weight_bytes(name: str) -> int:
    """Bytes of one stored parameter (and of its gradient, and of one optimizer slot):
    4 for float32, 2 for bfloat16."""
    return weight_dtype(name).itemsize


def stored(core, a: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``a`` in the storage ``dtype`` (rounded to nearest even for bf16); on a
    timing-only core (``core.execute`` False) zeros of that dtype (a view, no copy)."""
    a = np.asarray(a)
    if a.dtype == dtype:
        return a
    if not core.execute:
        return timing_zeros(a.shape, dtype)
    return a.astype(dtype)


def computed(core, a: np.ndarray) -> np.ndarray:
    """``a`` as float32 for arithmetic (exact from bf16); zeros on a timing-only core."""
    return stored(core, a, np.dtype(np.float32))

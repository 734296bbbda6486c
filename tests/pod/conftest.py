"""Fixtures shared by the pod tests that run layers and models in-process."""

from __future__ import annotations

import pytest
from chip import TensorCore, get_chip_spec
from pod.runtime.blas import one_blas_thread as _one_blas_thread


@pytest.fixture(scope="module")
def one_blas_thread():
    """One BLAS thread, as in a chip actor (``pod.runtime.blas``): the chip actors' bits,
    and two OpenBLAS threads on a busy 2-core machine run ~10x slower (pitfalls.md)."""
    with _one_blas_thread():
        yield


@pytest.fixture
def core64():
    """Numerics off: plain numpy in the inputs' dtype (float64 here)."""
    return TensorCore(get_chip_spec("v2").core, numerics=False)


@pytest.fixture
def core():
    """MXU numerics on: bf16 inputs, float32 accumulation."""
    return TensorCore(get_chip_spec("v2").core, numerics=True)

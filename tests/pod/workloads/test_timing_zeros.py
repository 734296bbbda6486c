"""``timing_zeros``: what a timing-only core returns for work it only costs."""

from __future__ import annotations

import numpy as np
import pytest


def test_timing_zeros_are_read_only_views_one_per_shape():
    """A timing-only core returns zeros that take no memory; one read-only view serves every
    caller of a shape and dtype (nothing writes into them), numpy-int shapes alike."""
    from pod.workloads.layers import timing_zeros

    a = timing_zeros((4, 1 << 20, 1 << 20), np.float32)
    assert a.shape == (4, 1 << 20, 1 << 20) and a.dtype == np.float32 and a[3, 5, 7] == 0
    assert not a.flags.writeable and a.strides == (0, 0, 0)
    assert timing_zeros((4, 1 << 20, 1 << 20), np.float32) is a
    b = timing_zeros((np.int64(3), 2), np.int32)
    assert b.shape == (3, 2) and b.dtype == np.int32 and not b.flags.writeable
    assert timing_zeros([3, 2], "int32").shape == (3, 2)  # a list: made afresh
    with pytest.raises(ValueError):
        a[0, 0, 0] = 1.0

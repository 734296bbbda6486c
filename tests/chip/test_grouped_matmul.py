"""The TensorCore's grouped matmul (megablox gmm / tgmm) against a per-group numpy reference."""

from __future__ import annotations

import numpy as np
import pytest

from chip import TensorCore, get_chip_spec
from chip.numerics import to_bf16

SPEC = get_chip_spec("v5e").core


def _data(sizes, k=6, n=5, seed=0):
    rng = np.random.default_rng(seed)
    m = int(sum(sizes))
    return (rng.standard_normal((m, k)).astype(np.float32),
            rng.standard_normal((len(sizes), k, n)).astype(np.float32),
            rng.standard_normal((m, n)).astype(np.float32))


@pytest.mark.parametrize("sizes", [(3, 0, 5, 2), (4, 4, 4, 4), (0, 0, 7, 0)])
def test_grouped_matmul_is_each_group_times_its_weights(sizes):
    a, b, d = _data(sizes)
    core = TensorCore(SPEC)
    out = core.grouped_matmul(a, b, np.array(sizes), name="gmm")
    grads = core.grouped_transposed_matmul(a, d, np.array(sizes), name="tgmm")
    ends = np.cumsum((0,) + sizes)
    for g in range(len(sizes)):
        rows = slice(ends[g], ends[g + 1])
        want = to_bf16(a[rows]) @ to_bf16(b[g])
        np.testing.assert_array_equal(out[rows], want.astype(np.float32))
        np.testing.assert_allclose(grads[g], to_bf16(a[rows]).T @ to_bf16(d[rows]), rtol=1e-6,
                                   atol=1e-6)


def test_the_cost_depends_on_shapes_only_and_matches_timing_only():
    a, b, d = _data((3, 0, 5, 2))
    functional, timing = TensorCore(SPEC), TensorCore(SPEC, execute=False)
    for core in (functional, timing):
        core.grouped_matmul(a, b, np.array((3, 0, 5, 2)) if core.execute else 4, name="gmm")
        core.grouped_transposed_matmul(a, d, np.array((5, 5, 0, 0)) if core.execute else 4,
                                       name="tgmm")
    assert functional.take_records() == timing.take_records()
    core = TensorCore(SPEC)
    core.grouped_matmul(a, b, np.array((1, 1, 1, 7)), name="gmm")
    rec = core.records[-1]
    # 4 groups of ceil(10 / 4) = 3 rows: the cost of 4 GEMMs (3 x 6) . (6 x 5), own weights
    ref = TensorCore(SPEC).account_matmul(3, 6, 5, name="gmm", batch=4, a_elements=60,
                                          out_elements=50)
    assert (rec.flops, rec.cycles, rec.hbm_bytes) == (ref.flops, ref.cycles, ref.hbm_bytes)
    assert rec.flops == 2 * 4 * 3 * 6 * 5


def test_bad_group_sizes_are_refused():
    a, b, _ = _data((3, 3))
    core = TensorCore(SPEC)
    with pytest.raises(ValueError, match="summing to the 6 rows"):
        core.grouped_matmul(a, b, np.array((2, 3)))
    with pytest.raises(ValueError, match="do not split into 4 equal groups"):
        core.grouped_matmul(a, np.zeros((4, 6, 5), np.float32), 4)

"""Tests of chip.mxu_gemm_cycles on hand-worked cases and invariants."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chip import MXUSpec, mxu_gemm_cycles


def brute_force_fold_cycles(m, rows, cols):
    """One fold of a weight-stationary array, cell by cell.

    Weights load one row per cycle (cycles 0 .. rows-1). Activation row i
    enters array row r at cycle rows + i + r (skewed), passes column c one
    cycle later per column, and its result leaves the last array row at
    column c after the cell (rows-1, c) fires. The fold ends one cycle after
    the last cell fires.
    """
    last = 0
    for i in range(m):
        for r in range(rows):
            for c in range(cols):
                last = max(last, rows + i + r + c)
    return last + 1


def test_two_by_two_one_fold():
    # 2 weight-load cycles, then rows enter at t=2,3; last result out after t=2+1+1+1.
    assert mxu_gemm_cycles(2, 2, 2, MXUSpec(2, 2)) == 6


def test_two_folds_over_k_and_over_n():
    mxu = MXUSpec(2, 2)
    assert mxu_gemm_cycles(2, 4, 2, mxu) == 12
    assert mxu_gemm_cycles(2, 2, 4, mxu) == 12
    assert mxu_gemm_cycles(2, 4, 4, mxu) == 24
    # Two MXUs take one fold each.
    assert mxu_gemm_cycles(2, 4, 2, mxu, mxus=2) == 6
    # Three folds on two MXUs: two rounds.
    assert mxu_gemm_cycles(2, 6, 2, mxu, mxus=2) == 12


def test_m_smaller_than_array():
    # M=1 on a 4x4 array: 4 load + (1 + 4 + 4 - 2) stream and drain.
    assert mxu_gemm_cycles(1, 4, 4, MXUSpec(4, 4)) == 4 + 7


def test_partial_fold_pays_for_whole_array():
    mxu = MXUSpec(128, 128)
    assert mxu_gemm_cycles(8, 129, 1, mxu) == 2 * mxu_gemm_cycles(8, 128, 128, mxu)


@pytest.mark.parametrize("n", [1, 2, 3, 8, 128])
def test_square_is_seed_3n_minus_2_plus_load(n):
    assert mxu_gemm_cycles(n, n, n, MXUSpec(n, n)) == (3 * n - 2) + n


@pytest.mark.parametrize("m, rows, cols", [(1, 1, 1), (2, 2, 2), (5, 3, 4), (2, 6, 3), (9, 4, 4)])
def test_one_fold_matches_cell_by_cell_count(m, rows, cols):
    assert mxu_gemm_cycles(m, rows, cols, MXUSpec(rows, cols)) == brute_force_fold_cycles(m, rows, cols)


def test_four_mxus_take_a_quarter_on_large_gemm():
    mxu = MXUSpec(128, 128)
    one = mxu_gemm_cycles(4096, 4096, 4096, mxu, mxus=1)
    four = mxu_gemm_cycles(4096, 4096, 4096, mxu, mxus=4)
    assert four / one == pytest.approx(0.25, rel=0.01)
    # And a large GEMM runs the array near its peak (streaming dominates loading).
    assert 4096**3 / (one * 128 * 128) > 0.9


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, None])
def test_rejects_bad_arguments(bad):
    mxu = MXUSpec(4, 4)
    for args in [(bad, 4, 4), (4, bad, 4), (4, 4, bad)]:
        with pytest.raises(ValueError, match="positive integer"):
            mxu_gemm_cycles(*args, mxu)
    with pytest.raises(ValueError, match="mxus"):
        mxu_gemm_cycles(4, 4, 4, mxu, mxus=bad)


dims = st.integers(1, 2000)
arrays = st.sampled_from([MXUSpec(1, 1), MXUSpec(2, 2), MXUSpec(4, 8), MXUSpec(128, 128)])


@settings(max_examples=300, deadline=None)
@given(dims, dims, dims, arrays, st.integers(1, 8))
def test_monotone_and_never_above_peak(m, k, n, mxu, mxus):
    cycles = mxu_gemm_cycles(m, k, n, mxu, mxus)
    assert mxu_gemm_cycles(m + 1, k, n, mxu, mxus) > cycles
    assert mxu_gemm_cycles(m, k + 1, n, mxu, mxus) >= cycles
    assert mxu_gemm_cycles(m, k, n + 1, mxu, mxus) >= cycles
    assert mxu_gemm_cycles(m, k, n, mxu, mxus + 1) <= cycles
    # No faster than every MAC cell busy every cycle.
    assert cycles * mxu.rows * mxu.cols * mxus >= m * k * n
    folds = math.ceil(k / mxu.rows) * math.ceil(n / mxu.cols)
    assert cycles == math.ceil(folds / mxus) * (2 * mxu.rows + mxu.cols + m - 2)

"""Tests of chip.mxu_gemm_cycles: hand-worked cases, SCALE-Sim's own numbers, invariants.

Both counts are tested: "scalesim" against SCALE-Sim's own numbers and the
per-fold closed form, "pipelined" (the default, the TPU's) against its
closed form (one bubble per op) and the array's peak rate.
"""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chip import MXU_MODELS, MXUSpec, conv2d_gemm_shape, mxu_folds, mxu_gemm_cycles

SS = "scalesim"


def last_mac_cycle(m, rows, cols):
    """One fold of a weight-stationary array, cell by cell (independent of the formula).

    Weights load one row per cycle (cycles 0 .. rows-1). Activation row i
    enters array row r at cycle rows + i + r (skewed) and reaches column c
    c cycles later. Returns the cycle in which the last MAC fires; SCALE-Sim
    reports exactly this as a one-fold GEMM's total.
    """
    last = 0
    for i in range(m):
        for r in range(rows):
            for c in range(cols):
                last = max(last, rows + i + r + c)
    return last


def test_two_by_two_one_fold():
    # Hand-worked: weights in at t=0,1; rows enter at t=2,3, skewed one cycle
    # per array row; the last MAC (row 1, array cell (1, 1)) fires at t=3+1+1=5.
    # SCALE-Sim 3.0.0 "ws" reports 5 (VALIDATION.md).
    assert mxu_gemm_cycles(2, 2, 2, MXUSpec(2, 2), mxu_model=SS) == 5
    # One fold has one bubble either way: the pipelined count agrees.
    assert mxu_gemm_cycles(2, 2, 2, MXUSpec(2, 2)) == 5


def test_two_folds_over_k_and_over_n():
    mxu = MXUSpec(2, 2)
    # Two folds, back to back: 2 x 6 cycles, the last one not counted (SCALE-Sim: 11, 11, 23).
    assert mxu_gemm_cycles(2, 4, 2, mxu, mxu_model=SS) == 11
    assert mxu_gemm_cycles(2, 2, 4, mxu, mxu_model=SS) == 11
    assert mxu_gemm_cycles(2, 4, 4, mxu, mxu_model=SS) == 23
    # Two MXUs take one fold each; three folds on two MXUs take two rounds.
    assert mxu_gemm_cycles(2, 4, 2, mxu, mxus=2, mxu_model=SS) == 5
    assert mxu_gemm_cycles(2, 6, 2, mxu, mxus=2, mxu_model=SS) == 11


def test_m_smaller_than_array():
    # M=1 on a 4x4 array: 4 load, then the row crosses 4 rows and 4 columns:
    # last MAC at 4 + 0 + 3 + 3 = 10 (SCALE-Sim: 10).
    assert mxu_gemm_cycles(1, 4, 4, MXUSpec(4, 4), mxu_model=SS) == 10


# Copied from the SCALE-Sim 3.0.0 run of benchmarks/scalesim_crosscheck.py
# (weight-stationary, bandwidth mode CALC, 0 stall cycles), see VALIDATION.md:
# (M, K, N, R, C, SCALE-Sim compute cycles).
SCALESIM_WS_CYCLES = [
    (2, 2, 2, 2, 2, 5),
    (2, 4, 2, 2, 2, 11),
    (2, 2, 4, 2, 2, 11),
    (2, 4, 4, 2, 2, 23),
    (1, 4, 4, 4, 4, 10),
    (5, 3, 4, 3, 4, 12),
    (7, 10, 9, 4, 4, 152),
    (3, 8, 8, 8, 8, 24),
    (16, 16, 16, 8, 8, 151),
    (33, 17, 40, 8, 16, 566),
    (64, 64, 64, 32, 32, 631),
    (100, 70, 50, 32, 16, 2135),
    (8, 128, 128, 128, 128, 389),
    (128, 128, 128, 128, 128, 509),
    (256, 256, 256, 128, 128, 2551),
    (300, 200, 130, 128, 128, 2727),
    (512, 512, 512, 128, 128, 14303),
    (1024, 256, 384, 128, 128, 8435),
]


@pytest.mark.parametrize("m, k, n, rows, cols, scalesim", SCALESIM_WS_CYCLES)
def test_agrees_with_scalesim_cycle_for_cycle(m, k, n, rows, cols, scalesim):
    assert mxu_gemm_cycles(m, k, n, MXUSpec(rows, cols), mxu_model=SS) == scalesim


def test_partial_fold_pays_for_whole_array():
    mxu = MXUSpec(128, 128)
    # 129 x 1 weights -> 2 folds of a full 128x128 tile each.
    assert mxu_gemm_cycles(8, 129, 1, mxu, mxu_model=SS) == 2 * (2 * 128 + 128 + 8 - 2) - 1
    # Pipelined: M = 8 < R, so the second fold waits R cycles for its weights.
    assert mxu_gemm_cycles(8, 129, 1, mxu) == 128 + (2 * 128 + 128 + 8 - 2) - 1


@pytest.mark.parametrize("n", [1, 2, 3, 8, 128])
def test_square_is_load_plus_seed_3n_minus_2_less_one(n):
    # The seed's unskewed stream + drain of an n x n product: 3n - 2 cycles;
    # plus n weight-load cycles; SCALE-Sim counts to the last MAC's cycle (-1).
    for model in MXU_MODELS:  # one fold: the models agree
        assert mxu_gemm_cycles(n, n, n, MXUSpec(n, n), mxu_model=model) == n + (3 * n - 2) - 1


@pytest.mark.parametrize("m, rows, cols", [(1, 1, 1), (2, 2, 2), (5, 3, 4), (2, 6, 3), (9, 4, 4)])
def test_one_fold_matches_cell_by_cell_count(m, rows, cols):
    for model in MXU_MODELS:
        assert mxu_gemm_cycles(m, rows, cols, MXUSpec(rows, cols), mxu_model=model) == \
            last_mac_cycle(m, rows, cols)


def test_scalesim_double_buffered_hides_all_loads_but_the_first():
    mxu = MXUSpec(2, 2)
    # One fold: nothing to overlap, same as default.
    assert mxu_gemm_cycles(2, 2, 2, mxu, double_buffered=True, mxu_model=SS) == 5
    # Hand-worked, 4 folds (K=4, N=4), M=2: first load 2 cycles, then 4 x
    # (M + R + C - 2 = 4) stream-and-drain cycles, the last not counted: 2 + 16 - 1.
    assert mxu_gemm_cycles(2, 4, 4, mxu, double_buffered=True, mxu_model=SS) == 17
    # Saves (folds - 1) * R against the default (23).
    assert mxu_gemm_cycles(2, 4, 4, mxu, mxu_model=SS) - 17 == 3 * 2
    big = MXUSpec(128, 128)
    plain = mxu_gemm_cycles(4096, 4096, 4096, big, mxu_model=SS)
    buffered = mxu_gemm_cycles(4096, 4096, 4096, big, double_buffered=True, mxu_model=SS)
    assert plain - buffered == (32 * 32 - 1) * 128
    # The pipelined model double-buffers already: the flag changes nothing.
    assert mxu_gemm_cycles(4096, 4096, 4096, big, double_buffered=True) == \
        mxu_gemm_cycles(4096, 4096, 4096, big)


def test_pipelined_is_the_default_with_one_bubble_per_op():
    mxu = MXUSpec(128, 128)
    m, k, n = 4096, 4096, 4096
    assert mxu_gemm_cycles(m, k, n, mxu) == mxu_gemm_cycles(m, k, n, mxu, mxu_model="pipelined")
    # Closed form [SB-tpus]: folds x M streaming, plus ONE bubble (weight load R,
    # skew R - 1, drain C - 1, busy-cycle count - 1): 1024 folds x 4096 + 2R + C - 3.
    assert mxu_gemm_cycles(m, k, n, mxu) == 1024 * 4096 + 2 * 128 + 128 - 3
    # The per-fold model pays that bubble 1024 times: the difference is 1023 bubbles.
    assert mxu_gemm_cycles(m, k, n, mxu, mxu_model=SS) - mxu_gemm_cycles(m, k, n, mxu) == \
        1023 * (2 * 128 + 128 - 2)


def test_pipelined_hand_worked_two_by_two():
    mxu = MXUSpec(2, 2)
    # 4 folds of M = 2 rows, M >= R: load 2, then 4 x 2 rows stream back to back;
    # the last row enters at cycle 2 + 8 - 1 = 9 and its last MAC fires
    # R - 1 + C - 1 = 2 cycles later, at cycle 11 (the count is that cycle).
    assert mxu_gemm_cycles(2, 4, 4, mxu) == 11
    # M = 1 < R = 2: each fold waits 2 cycles for its weights: 3 x 2 + one fold (4).
    assert mxu_gemm_cycles(1, 4, 4, mxu) == 3 * 2 + (2 * 2 + 2 + 1 - 2) - 1


@pytest.mark.parametrize("m", [32, 128, 1024, 8192])
def test_pipelined_reaches_the_roofline_at_large_m(m):
    mxu = MXUSpec(128, 128)
    k = n = 8192
    cycles = mxu_gemm_cycles(m, k, n, mxu, mxus=4)
    ideal = m * k * n / (4 * 128 * 128)  # every MAC of 4 MXUs busy every cycle
    bubble = 2 * 128 + 128 - 3
    if m >= 128:
        # Exactly the roofline plus one bubble.
        assert cycles == ideal + bubble
    else:
        # Below R rows the weight load (R cycles per fold) is the limit.
        assert cycles == (ideal / m) * 128 - 128 + (2 * 128 + 128 + m - 2) - 1
    if m == 8192:
        assert ideal / cycles > 0.9999
    # The per-fold count is far slower at small M: at M = 32, 414 / 32 per fold.
    if m == 32:
        assert mxu_gemm_cycles(m, k, n, mxu, mxus=4, mxu_model=SS) / ideal == \
            pytest.approx((2 * 128 + 128 + 32 - 2) / 32, rel=1e-3)


def test_unknown_mxu_model_lists_the_choices():
    with pytest.raises(ValueError, match="'pipelined', 'scalesim'"):
        mxu_gemm_cycles(4, 4, 4, MXUSpec(4, 4), mxu_model="ws")


def test_four_mxus_take_a_quarter_on_large_gemm():
    mxu = MXUSpec(128, 128)
    for model in MXU_MODELS:
        one = mxu_gemm_cycles(4096, 4096, 4096, mxu, mxus=1, mxu_model=model)
        four = mxu_gemm_cycles(4096, 4096, 4096, mxu, mxus=4, mxu_model=model)
        assert four / one == pytest.approx(0.25, rel=0.01)
        # And a large GEMM runs the array near its peak (streaming dominates loading).
        assert 4096**3 / (one * 128 * 128) > 0.9
    # 1024 folds on 4 MXUs: 256 rounds of one fold's cycles (closed form).
    assert mxu_gemm_cycles(4096, 4096, 4096, mxu, mxus=4, mxu_model=SS) == \
        256 * (2 * 128 + 128 + 4096 - 2) - 1
    assert mxu_gemm_cycles(4096, 4096, 4096, mxu, mxus=4) == 256 * 4096 + 2 * 128 + 128 - 3


def test_batched_matmul_multiplies_the_folds():
    mxu = MXUSpec(128, 128)
    # 8 GEMMs with their own weights = 8 times the folds, spread over the MXUs.
    one_fold = 2 * 128 + 128 + 64 - 2
    assert mxu_gemm_cycles(64, 256, 256, mxu, batch=8, mxu_model=SS) == 32 * one_fold - 1
    assert mxu_gemm_cycles(64, 256, 256, mxu, mxus=4, batch=8, mxu_model=SS) == 8 * one_fold - 1
    # Pipelined, M = 64 < R: each further fold costs R (the weight load).
    assert mxu_gemm_cycles(64, 256, 256, mxu, mxus=4, batch=8) == 7 * 128 + one_fold - 1


def test_conv_as_im2col_gemm():
    # 3x3 conv, 16 -> 32 channels, batch 4, 8x8 output: (4*8*8, 3*3*16, 32).
    assert conv2d_gemm_shape(4, 8, 8, 3, 3, 16, 32) == (256, 144, 32)
    m, k, n = conv2d_gemm_shape(4, 8, 8, 3, 3, 16, 32)
    assert mxu_folds(k, n, MXUSpec(128, 128)) == 2
    with pytest.raises(ValueError, match="kernel_height"):
        conv2d_gemm_shape(1, 1, 1, 0, 1, 1, 1)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, None])
def test_rejects_bad_arguments(bad):
    mxu = MXUSpec(4, 4)
    for args in [(bad, 4, 4), (4, bad, 4), (4, 4, bad)]:
        with pytest.raises(ValueError, match="positive integer"):
            mxu_gemm_cycles(*args, mxu)
    with pytest.raises(ValueError, match="mxus"):
        mxu_gemm_cycles(4, 4, 4, mxu, mxus=bad)
    with pytest.raises(ValueError, match="batch"):
        mxu_gemm_cycles(4, 4, 4, mxu, batch=bad)


dims = st.integers(1, 2000)
arrays = st.sampled_from([MXUSpec(1, 1), MXUSpec(2, 2), MXUSpec(4, 8), MXUSpec(128, 128)])


@settings(max_examples=300, deadline=None)
@given(dims, dims, dims, arrays, st.integers(1, 8), st.booleans(), st.sampled_from(MXU_MODELS))
def test_monotone_and_never_above_peak(m, k, n, mxu, mxus, buffered, model):
    kw = dict(double_buffered=buffered, mxu_model=model)
    cycles = mxu_gemm_cycles(m, k, n, mxu, mxus, **kw)
    assert mxu_gemm_cycles(m + 1, k, n, mxu, mxus, **kw) > cycles
    assert mxu_gemm_cycles(m, k + 1, n, mxu, mxus, **kw) >= cycles
    assert mxu_gemm_cycles(m, k, n + 1, mxu, mxus, **kw) >= cycles
    assert mxu_gemm_cycles(m, k, n, mxu, mxus + 1, **kw) <= cycles
    # Double buffering never costs more; the pipelined model never costs more
    # than the per-fold one.
    assert mxu_gemm_cycles(m, k, n, mxu, mxus, double_buffered=True, mxu_model=model) <= \
        mxu_gemm_cycles(m, k, n, mxu, mxus, mxu_model=model)
    assert mxu_gemm_cycles(m, k, n, mxu, mxus) <= \
        mxu_gemm_cycles(m, k, n, mxu, mxus, double_buffered=True, mxu_model=SS)
    # No faster than every MAC cell busy every cycle (within the one uncounted cycle).
    assert (cycles + 1) * mxu.rows * mxu.cols * mxus >= m * k * n
    rounds = math.ceil(math.ceil(k / mxu.rows) * math.ceil(n / mxu.cols) / mxus)
    one_fold = 2 * mxu.rows + mxu.cols + m - 2
    if model == SS and not buffered:
        assert cycles == rounds * one_fold - 1
    if model == "pipelined":
        assert cycles == (rounds - 1) * max(m, mxu.rows) + one_fold - 1

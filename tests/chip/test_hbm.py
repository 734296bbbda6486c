"""Tests of chip.HBM: budget accounting and the out-of-memory error."""

import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chip import HBM, Chip, ChipError, HBMOutOfMemoryError, get_chip_spec

GIB = 2**30


def test_allocate_free_and_peak():
    hbm = HBM(1000, name="chip0/core0")
    hbm.allocate("params", 300)
    hbm.allocate("activations", 500)
    assert (hbm.used_bytes, hbm.free_bytes, hbm.peak_bytes) == (800, 200, 800)
    assert dict(hbm.allocations) == {"params": 300, "activations": 500}
    assert hbm.free("activations") == 500
    assert (hbm.used_bytes, hbm.free_bytes, hbm.peak_bytes) == (300, 700, 800)
    hbm.reset_peak()
    assert hbm.peak_bytes == 300
    assert hbm.capacity_bytes == 1000


def test_allocate_existing_tag_resizes():
    hbm = HBM(1000)
    hbm.allocate("a", 600)
    hbm.allocate("a", 900)  # fits: the old 600 is released first
    assert hbm.used_bytes == 900
    hbm.allocate("a", 100)
    assert hbm.used_bytes == 100 and hbm.peak_bytes == 900


def test_exactly_full_fits_one_more_byte_does_not():
    hbm = HBM(1000)
    hbm.allocate("x", 1000)
    with pytest.raises(HBMOutOfMemoryError):
        hbm.allocate("y", 1)
    hbm.allocate("y", 0)


def test_out_of_memory_message_and_attributes():
    hbm = HBM(8 * GIB, name="chip0/core1")
    hbm.allocate("params", int(7.7 * GIB))
    with pytest.raises(HBMOutOfMemoryError) as info:
        hbm.allocate("activations", int(1.2 * GIB))
    err = info.value
    assert str(err) == ("HBM out of memory on chip0/core1: 'activations' needs 1.20 GiB "
                        "but only 0.30 GiB of 8.00 GiB is free")
    assert err.tag == "activations"
    assert err.requested_bytes == int(1.2 * GIB)
    assert err.free_bytes == 8 * GIB - int(7.7 * GIB)
    assert err.capacity_bytes == 8 * GIB
    assert isinstance(err, ChipError)
    # The budget is unchanged by a failed allocation.
    assert dict(hbm.allocations) == {"params": int(7.7 * GIB)}


def test_resize_that_does_not_fit_reports_what_was_available():
    hbm = HBM(1000)
    hbm.allocate("a", 400)
    hbm.allocate("b", 500)
    with pytest.raises(HBMOutOfMemoryError) as info:
        hbm.allocate("a", 600)
    assert info.value.free_bytes == 500  # 100 free + a's own 400
    assert hbm.allocations["a"] == 400


def test_error_survives_pickling():
    err = HBMOutOfMemoryError("w", 3 * GIB, GIB, 8 * GIB, "chip2/core0")
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == str(err) and back.tag == "w" and back.capacity_bytes == 8 * GIB


@pytest.mark.parametrize("bad", [-1, 1.5, "10"])
def test_bad_sizes_raise_value_error_quoting_value(bad):
    with pytest.raises(ValueError, match=repr(bad).replace(".", r"\.")):
        HBM(1000).allocate("x", bad)
    with pytest.raises(ValueError, match=repr(bad).replace(".", r"\.")):
        HBM(bad)


def test_free_unknown_tag():
    hbm = HBM(10)
    hbm.allocate("a", 1)
    with pytest.raises(KeyError, match="'b'.*'a'"):
        hbm.free("b")


def test_chip_cores_have_their_own_hbm():
    chip = Chip(get_chip_spec("v2"), chip_id=3)
    assert [c.hbm.capacity_bytes for c in chip.cores] == [8 * GIB, 8 * GIB]
    chip.cores[0].hbm.allocate("params", 6 * GIB)
    assert chip.cores[1].hbm.used_bytes == 0
    with pytest.raises(HBMOutOfMemoryError, match="on chip3/core0"):
        chip.cores[0].hbm.allocate("activations", 3 * GIB)
    assert chip.hbm_peak_bytes == [6 * GIB, 0]


ops = st.lists(st.tuples(st.sampled_from("abcd"), st.one_of(st.none(), st.integers(0, 600))),
               max_size=40)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_accounting_invariants(sequence):
    hbm = HBM(1000)
    model: dict[str, int] = {}
    peak = 0
    for tag, size in sequence:
        if size is None:
            if tag in model:
                assert hbm.free(tag) == model.pop(tag)
            continue
        fits = sum(model.values()) - model.get(tag, 0) + size <= 1000
        if fits:
            hbm.allocate(tag, size)
            model[tag] = size
        else:
            with pytest.raises(HBMOutOfMemoryError):
                hbm.allocate(tag, size)
        peak = max(peak, sum(model.values()))
        assert dict(hbm.allocations) == model
        assert hbm.used_bytes == sum(model.values()) <= hbm.capacity_bytes
        assert hbm.peak_bytes == peak

"""The step clock's sustained MXU budget and the multislice wait (issue 29).

A step runs its matmuls at a fresh op's rate and is held to its MXU work at the chip's
sustained rate (``sustained_clocks``); a job of several slices waits for its slowest
slice (``StepContext.slice_wait_fraction``). Checked against closed forms worked by hand.
"""

from __future__ import annotations

import pytest

from pod.programs.collectives import CollectiveCall
from pod.report.clock import DeviceReport, StepContext, combine_device_reports, sustained_clocks


def report(seconds, bounds, calls=(), device=0):
    return DeviceReport(device=device, loss=0.0, record_seconds=tuple(seconds),
                        record_bounds=tuple(bounds), update_start=None, calls=tuple(calls),
                        mxu_flops=1)


def cost_of(table):
    return lambda axis, op, nbytes, windowed=False: table[(axis, op)]


def test_an_all_mxu_step_runs_at_the_sustained_rate():
    # 4 s of matmuls at e0; the chip sustains e1 = 0.8 e0: the step is 4 / 0.8 = 5 s
    (clock,), _ = sustained_clocks([report([1.0] * 4, ["mxu"] * 4)], cost_of({}), 0.8)
    assert clock.step_seconds == pytest.approx(5.0)
    assert clock.compute_seconds == pytest.approx(5.0)
    assert clock.throttle_seconds == pytest.approx(1.0)


def test_a_step_with_enough_other_work_is_not_slowed():
    # 3 s of matmuls, 1 s of vector work: 3 / 0.8 = 3.75 s of budget < the 4 s step
    steps = report([1.0, 1.0, 1.0, 1.0], ["mxu", "vpu", "mxu", "mxu"])
    (clock,), _ = sustained_clocks([steps], cost_of({}), 0.8)
    assert clock.step_seconds == pytest.approx(4.0) and clock.throttle_seconds == 0.0
    # half as much vector work: 3 / 0.8 = 3.75 s against 3.5 s, stretched by 0.25 s
    steps = report([1.0, 0.5, 1.0, 1.0], ["mxu", "vpu", "mxu", "mxu"])
    (clock,), _ = sustained_clocks([steps], cost_of({}), 0.8)
    assert clock.step_seconds == pytest.approx(3.75)
    assert clock.throttle_seconds == pytest.approx(0.25)
    # no budget: the clock as it was
    (clock,), _ = sustained_clocks([steps], cost_of({}), 1.0)
    assert clock.step_seconds == pytest.approx(3.5)


def test_slower_matmuls_hide_more_of_an_overlapped_collective():
    # An activation allreduce of 1.5 s may start with the 1 s matmul that produces it and
    # is waited for before the next one: at e0 0.5 s of it shows (step 2.5 s, 2 s of
    # matmuls). At the budget 2 / 0.8 = 2.5 s the step is already there: not slowed.
    calls = [CollectiveCall("tensor", "allreduce", 8, "mlp", "activation", 1, overlap_before=1)]
    steps = report([1.0, 1.0], ["mxu", "mxu"], calls)
    costs = cost_of({("tensor", "allreduce"): 1.5})
    (clock,), _ = sustained_clocks([steps], costs, 0.8)
    assert clock.step_seconds == pytest.approx(2.5) and clock.throttle_seconds == 0.0
    # at 0.5 the budget is 4 s: the matmuls stretch to 2 s each and hide the
    # allreduce whole, so the step is the budget, not the 4.5 s a stretch on top of
    # the exposed 0.5 s would give
    (clock,), (stretched,) = sustained_clocks([steps], costs, 0.5)
    assert clock.step_seconds == pytest.approx(4.0, rel=2e-3)
    assert clock.exposed_seconds == pytest.approx(0.0, abs=1e-2)
    assert sum(stretched.record_seconds) == pytest.approx(clock.compute_seconds, rel=2e-3)


def test_a_multislice_job_waits_for_its_slowest_slice_on_the_dcn_axis():
    from interconnect.dcn import expected_max_standard_normal, slice_wait_seconds

    class Costs:
        def seconds(self, axis, op, nbytes):
            return 0.0

        def link_bytes(self, calls):
            return {}

    context = StepContext(global_batch=8, model_flops=None, device_peak_flops_per_s=1.0,
                          devices=1, devices_per_chip=1, host_to_chip_bytes_per_s=1e12,
                          slice_wait_fraction=slice_wait_seconds(1.0, 8, 0.05), slice_axis="data")
    stats = combine_device_reports(0, [report([2.0, 2.0], ["mxu", "vpu"])], Costs(), context,
                                   infeed_bytes=0, wall_seconds=0.0)
    wait = 0.05 * 4.0 * 1.4236  # E[max of 8 standard normals] = 1.4236
    assert expected_max_standard_normal(8) == pytest.approx(1.4236, abs=1e-4)
    assert stats.step_seconds == pytest.approx(4.0 + wait, rel=1e-4)
    assert stats.axis_exposed_seconds == {"data": pytest.approx(wait, rel=1e-4)}


@pytest.mark.parametrize("n, expected", [(1, 0.0), (2, 0.5641896), (3, 0.8462844),
                                         (4, 1.0293754), (16, 1.7659913)])
def test_the_expected_maximum_of_normals_is_the_textbook_order_statistic(n, expected):
    # 1/sqrt(pi) for 2, 3/(2 sqrt(pi)) for 3; 4 and 16 from the tables of order statistics
    from interconnect.dcn import expected_max_standard_normal

    assert expected_max_standard_normal(n) == pytest.approx(expected, abs=1e-6)


def test_bad_slice_counts_and_jitters_are_refused():
    from interconnect.dcn import expected_max_standard_normal, slice_wait_seconds
    from interconnect.errors import ScheduleError

    for bad in (0, -1, 2.5, True):
        with pytest.raises(ScheduleError, match="slices"):
            expected_max_standard_normal(bad)
    with pytest.raises(ScheduleError, match="jitter"):
        slice_wait_seconds(1.0, 2, -0.1)

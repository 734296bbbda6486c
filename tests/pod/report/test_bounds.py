"""What bounds a step: the critical path split by bound, against hand-worked sums."""

from __future__ import annotations

import pytest

from interconnect import Torus
from interconnect.cost import ScheduleCost
from pod.report.bounds import BOUND_CATEGORIES, busiest_axes, step_bounds
from pod.report.stats import StepStats


def stats(**kw):
    base = dict(step=1, loss=0.0, global_batch=8, infeed_seconds=0.5, compute_seconds=10.0,
                local_reduce_seconds=1.0, ici_seconds=3.0, update_seconds=2.0, model_flops=0,
                peak_flops_per_s=1.0, wall_seconds=0.0, exposed_infeed_seconds=0.5,
                exposed_allreduce_seconds=2.0,
                compute_bound_seconds={"mxu": 6.0, "hbm": 3.0, "scalar": 1.0},
                update_bound_seconds={"hbm": 2.0})
    base.update(kw)
    return StepStats(**base)


def test_the_critical_path_is_split_by_bound_and_sums_to_the_step():
    torus = Torus((4, 4))
    # the ICI schedule: 3 s, its busiest link busy 2.25 s (bandwidth 75%), on the x axis
    # (the first of "4x4": ranks 0 -> 4 -> 8 step along it)
    cost = ScheduleCost(3.0, (3.0,), {(0, 4): 100, (4, 8): 100, (0, 1): 10}, 2.25, 0.0)
    s = stats()
    b = step_bounds(s, [cost], torus)
    # exposed allreduce 2 s: 1/4 on-chip reduce (HBM), 3/4 ICI of which 75% bandwidth
    expected = {"mxu": 6.0, "vpu": 0.0, "hbm": 3.0 + 2.0 + 2.0 * 0.25,
                "ici": 2.0 * 0.75 * 0.75, "latency": 1.0 + 2.0 * 0.75 * 0.25, "host": 0.5}
    assert b.seconds == pytest.approx(expected)
    assert sum(b.seconds.values()) == pytest.approx(s.step_seconds)
    assert (b.bound, b.label, b.ici_axes) == ("mxu", "MXU", "x")
    assert b.fraction == pytest.approx(6.0 / 14.5)
    # a step whose exposed allreduce dominates reads as ICI on its busiest axis
    slow = step_bounds(stats(exposed_allreduce_seconds=40.0, ici_seconds=60.0), [cost], torus)
    assert slow.label == "ICI x" and slow.bound == "ici"


def test_busiest_axes_names_every_axis_within_tolerance():
    torus = Torus((2, 4, 4))
    a, b, c = 0, torus.rank((0, 0, 1)), torus.rank((0, 1, 0))
    assert busiest_axes({(a, b): 100, (a, c): 100}, torus) == "y+z"
    assert busiest_axes({(a, b): 100, (a, c): 50}, torus) == "z"
    assert busiest_axes({}, torus) == ""


def test_a_step_without_a_breakdown_counts_its_compute_as_memory():
    b = step_bounds(stats(compute_bound_seconds={}, update_bound_seconds={},
                          exposed_allreduce_seconds=0.0), [], Torus((2,)))
    assert b.seconds["hbm"] == pytest.approx(12.0)
    assert set(b.seconds) == set(BOUND_CATEGORIES)

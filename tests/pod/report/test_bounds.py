"""What bounds a step: the critical path split by bound, against hand-worked sums, and the
bound of a real sharded timing-only step against describe's per-layer table."""

from __future__ import annotations

from pathlib import Path

import pytest

from interconnect import Torus
from interconnect.cost import ScheduleCost
from pod.report.bounds import BOUND_CATEGORIES, busiest_axes, step_bounds
from pod.report.clock import CollectiveSpan
from pod.report.stats import StepStats

ROOT = Path(__file__).resolve().parents[3]


class Costs:
    """A stand-in for ``MeshCollectiveCosts``: one ScheduleCost per (axis, op)."""

    def __init__(self, table):
        self.table = table

    def cost(self, axis, op, nbytes):
        return self.table[(axis, op)]


def _span(axis, op, start, end):
    return CollectiveSpan(axis, op, "grad_reduce", f"{axis} {op}", 1000, start, end)


def stats(**kw):
    base = dict(step=1, loss=0.0, global_batch=8, infeed_seconds=0.5, compute_seconds=10.0,
                collective_seconds=4.0, update_seconds=2.0, model_flops=0,
                peak_flops_per_s=1.0, wall_seconds=0.0, exposed_infeed_seconds=0.5,
                exposed_collective_seconds=3.0,
                axis_exposed_seconds={"data": 2.0, "fsdp": 1.0},
                collective_spans=(_span("data", "allreduce", 0.0, 3.0),
                                  _span("fsdp", "all_gather", 3.0, 4.0)),
                ici_link_bytes={"0->4": 100, "4->8": 100, "0->1": 10},
                compute_bound_seconds={"mxu": 6.0, "hbm": 3.0, "scalar": 1.0},
                update_bound_seconds={"hbm": 2.0})
    base.update(kw)
    return StepStats(**base)


# data: 3 s, its busiest link busy 2.25 s (bandwidth 75%); fsdp: 1 s, 0.2 s of bandwidth
COSTS = Costs({("data", "allreduce"): ScheduleCost(3.0, (3.0,), {}, 2.25, 0.0),
               ("fsdp", "all_gather"): ScheduleCost(1.0, (1.0,), {}, 0.2, 0.0)})


def test_the_critical_path_is_split_by_bound_and_sums_to_the_step():
    torus = Torus((4, 4))
    s = stats()
    b = step_bounds(s, COSTS, torus)
    # exposed data 2 s: 75% ICI bandwidth, 25% latency; exposed fsdp 1 s: 20% / 80%;
    # the scalar unit's second is latency; infeed is the host
    expected = {"mxu": 6.0, "vpu": 0.0, "hbm": 3.0 + 2.0,
                "ici": 2.0 * 0.75 + 1.0 * 0.2, "latency": 1.0 + 2.0 * 0.25 + 1.0 * 0.8,
                "host": 0.5, "bubble": 0.0}
    assert b.seconds == pytest.approx(expected)
    assert sum(b.seconds.values()) == pytest.approx(s.step_seconds) == 15.5
    # the busiest links, 0 -> 4 -> 8, step along the first axis of "4x4"
    assert (b.bound, b.label, b.ici_axes) == ("mxu", "MXU", "x")
    assert b.fraction == pytest.approx(6.0 / 15.5)
    # a step whose exposed collectives dominate reads as ICI on its busiest axis
    slow = step_bounds(stats(exposed_collective_seconds=41.0, collective_seconds=45.0,
                             axis_exposed_seconds={"data": 40.0, "fsdp": 1.0}), COSTS, torus)
    assert slow.label == "ICI x" and slow.bound == "ici"
    assert slow.seconds["ici"] == pytest.approx(40.0 * 0.75 + 1.0 * 0.2)


def test_the_busy_share_of_a_collective_never_exceeds_its_time():
    """A schedule whose busiest link is busy longer than it lasts (a cost model's
    rounding) counts all of the axis's exposed time as bandwidth, never more."""
    over = Costs({("data", "allreduce"): ScheduleCost(3.0, (3.0,), {}, 5.0, 0.0),
                  ("fsdp", "all_gather"): ScheduleCost(1.0, (1.0,), {}, 0.2, 0.0)})
    b = step_bounds(stats(), over, Torus((4, 4)))
    assert b.seconds["ici"] == pytest.approx(2.0 + 0.2)
    assert sum(b.seconds.values()) == pytest.approx(15.5)


def test_busiest_axes_names_every_axis_within_tolerance():
    torus = Torus((2, 4, 4))
    a, b, c = 0, torus.rank((0, 0, 1)), torus.rank((0, 1, 0))
    assert busiest_axes({(a, b): 100, (a, c): 100}, torus) == "y+z"
    assert busiest_axes({(a, b): 100, (a, c): 50}, torus) == "z"
    assert busiest_axes({}, torus) == ""


def test_a_step_without_a_breakdown_counts_its_compute_as_memory():
    b = step_bounds(stats(compute_bound_seconds={}, update_bound_seconds={},
                          exposed_collective_seconds=0.0, axis_exposed_seconds={},
                          collective_spans=(), ici_link_bytes={}), COSTS, Torus((2,)))
    assert b.seconds["hbm"] == pytest.approx(12.0)
    assert set(b.seconds) == set(BOUND_CATEGORIES)


def test_a_sharded_timing_step_is_mxu_bound_where_describe_says_so():
    """Issue 22: the bound of a sharded sweep row named HBM (a sharded step carried no
    per-op breakdown) while describe's per-layer table said every block is MXU-bound.
    LLaMA-33B on v5p-128 {fsdp: 16, tensor: 4}, one timing-only step (about a second)."""
    from pod.config.plan import build_plan
    from pod.config.scenario import load_scenario
    from pod.config.sharding import device_chip_spec
    from pod.report.model_summary import layer_costs
    from pod.runtime.timing import TimingPod

    plan = build_plan(load_scenario(ROOT / "scenarios" / "llama-33b-v5p-128.yaml"),
                      timing_only=True)
    layers = layer_costs(plan.model, device_chip_spec(plan.topology.chip).core, plan.per_device_batch)
    blocks = {name: c for name, c in layers.items() if name.startswith("block")}
    assert len(blocks) == 60
    for name, c in blocks.items():  # describe: each block's largest bound is the MXU
        assert max(("mxu", "vpu", "scalar", "hbm"),
                   key=lambda b: c[f"{b}_bound_seconds"]) == "mxu", name
    stats = TimingPod(plan).step(0)
    assert stats.compute_bound_seconds["mxu"] > stats.compute_bound_seconds["hbm"] > 0
    bounds = step_bounds(stats, plan.collective_costs_at(0), plan.topology.torus)
    assert bounds.label == "MXU"
    assert bounds.seconds["mxu"] == pytest.approx(stats.compute_bound_seconds["mxu"]
                                                  + stats.update_bound_seconds.get("mxu", 0.0))
    assert sum(bounds.seconds.values()) == pytest.approx(stats.step_seconds)
    # the exposed collectives are split by axis into bandwidth and latency, not all latency
    assert set(stats.axis_exposed_seconds) == {"fsdp", "tensor"}
    assert bounds.seconds["ici"] > bounds.seconds["latency"] > 0

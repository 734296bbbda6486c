"""The sharded step's clock (``pod.report.sharded``): hand-worked time lines."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from pod.report.clock import step_clock as sharded_step_clock
from pod.programs.collectives import CollectiveCall


@dataclass(frozen=True)
class Rec:
    seconds: float


Call = CollectiveCall


def cost_of(table):
    return lambda axis, op, nbytes: table[(axis, op)]


def test_no_collectives_is_the_sum_of_records():
    clock = sharded_step_clock([Rec(1.0), Rec(2.0)], [], cost_of({}))
    assert clock.step_seconds == 3.0 and clock.exposed_seconds == 0 and clock.serial_seconds == 3.0


def test_an_activation_allreduce_blocks_the_compute_stream():
    calls = [Call("tensor", "allreduce", 64, "mlp", "activation", 1)]
    clock = sharded_step_clock([Rec(1.0), Rec(1.0)], calls, cost_of({("tensor", "allreduce"): 0.25}))
    assert clock.step_seconds == pytest.approx(2.25)
    assert clock.axis_exposed_seconds == {"tensor": pytest.approx(0.25)}
    assert clock.axis_bytes == {"tensor": 64} and clock.serial_seconds == pytest.approx(2.25)


def test_param_gathers_are_prefetched_one_layer_ahead():
    # gathers before layers 0, 1, 2 (0.5 s each), layers of 1 s: only the first is exposed
    calls = [Call("fsdp", "all_gather", 8, f"l{i}", "param_gather", i) for i in range(3)]
    clock = sharded_step_clock([Rec(1.0)] * 4, calls, cost_of({("fsdp", "all_gather"): 0.5}))
    assert clock.step_seconds == pytest.approx(4.5)
    assert clock.axis_exposed_seconds == {"fsdp": pytest.approx(0.5)}
    assert [(s.start, s.end) for s in clock.spans] == [(0, 0.5), (0.5, 1.0), (1.5, 2.0)]
    assert clock.serial_seconds == pytest.approx(5.5)


def test_a_slow_prefetch_is_partly_exposed():
    # 1.5 s gathers behind 1 s layers: gather 1 runs [1.5, 3.0], needed at 2.5
    calls = [Call("fsdp", "all_gather", 8, f"l{i}", "param_gather", i) for i in range(2)]
    clock = sharded_step_clock([Rec(1.0)] * 2, calls, cost_of({("fsdp", "all_gather"): 1.5}))
    assert clock.step_seconds == pytest.approx(1.5 + 0.5 + 1.0 + 1.0)
    assert clock.exposed_seconds == pytest.approx(2.0)


def test_grad_reduces_hide_behind_the_backward_pass_and_the_optimizer_waits():
    calls = [Call("fsdp", "reduce_scatter", 8, "g2", "grad_reduce", 2),
             Call("data", "allreduce", 4, "g3", "grad_reduce", 3)]
    costs = cost_of({("fsdp", "reduce_scatter"): 0.8, ("data", "allreduce"): 0.8})
    clock = sharded_step_clock([Rec(1.0)] * 4, calls, costs)  # the optimizer: record 3
    assert clock.compute_seconds == 3.0 and clock.update_seconds == 1.0
    assert clock.step_seconds == pytest.approx(4.8)
    assert clock.axis_exposed_seconds == {"data": pytest.approx(0.8)}
    assert clock.axis_seconds == {"fsdp": pytest.approx(0.8), "data": pytest.approx(0.8)}


def test_a_gap_on_the_ici_is_used_by_a_later_collective():
    # a prefetch ready at 0 fills the ICI before the blocking allreduce issued at 1
    calls = [Call("tensor", "allreduce", 4, "a", "activation", 1),
             Call("fsdp", "all_gather", 8, "p0", "param_gather", 2),
             Call("fsdp", "all_gather", 8, "p1", "param_gather", 2)]
    costs = cost_of({("tensor", "allreduce"): 1.0, ("fsdp", "all_gather"): 0.5})
    clock = sharded_step_clock([Rec(1.0)] * 3, calls, costs)
    assert [(s.start, s.end) for s in clock.spans] == [(1.0, 2.0), (0.0, 0.5), (3.0, 3.5)]
    assert clock.step_seconds == pytest.approx(1 + 1 + 1 + 0.5 + 1)


def test_bad_calls_are_refused():
    with pytest.raises(ValueError, match="kind 'x'"):
        sharded_step_clock([Rec(1.0)], [Call("data", "allreduce", 4, "t", "x", 0)], cost_of({}))
    with pytest.raises(ValueError, match="issue order"):
        sharded_step_clock([Rec(1.0)], [Call("data", "allreduce", 4, "t", "activation", 2)],
                           cost_of({("data", "allreduce"): 0.0}))


def test_an_activation_queued_behind_a_grad_reduce_charges_the_queue_to_the_grads_axis():
    # a 2 s data allreduce of gradients runs [1, 3] behind record 1; the tensor
    # allreduce issued at t = 2 waits for the ICI until 3 and runs [3, 3.5]
    calls = [Call("data", "allreduce", 8, "g", "grad_reduce", 1),
             Call("tensor", "allreduce", 4, "a", "activation", 2)]
    costs = cost_of({("data", "allreduce"): 2.0, ("tensor", "allreduce"): 0.5})
    clock = sharded_step_clock([Rec(1.0)] * 3, calls, costs, update_start=3)
    exposed, total = clock.axis_exposed_seconds, clock.axis_seconds
    assert [(s.start, s.end) for s in clock.spans] == [(1.0, 3.0), (3.0, 3.5)]
    assert exposed == {"data": pytest.approx(1.0), "tensor": pytest.approx(0.5)}
    for axis in exposed:  # what an axis exposes is part of what it costs
        assert exposed[axis] <= total[axis] + 1e-12
    assert sum(exposed.values()) == pytest.approx(clock.exposed_seconds)


def test_the_trace_lays_compute_waits_and_collectives_on_the_clocks_times():
    """The trace of a step: compute between the waits (the clock's), a wait per blocking
    collective named after its axis, each collective on its axis's lane; compute and
    waits tile [0, step] with no gap or overlap."""
    from pod.report.stats import StepStats
    from pod.report.trace import sharded_metadata_events, sharded_step_events

    calls = [Call("fsdp", "all_gather", 8, "l0", "param_gather", 0),
             Call("tensor", "allreduce", 4, "mlp", "activation", 1),
             Call("data", "allreduce", 8, "grads", "grad_reduce", 2)]
    costs = cost_of({("fsdp", "all_gather"): 0.5, ("tensor", "allreduce"): 0.25,
                     ("data", "allreduce"): 2.0})
    clock = sharded_step_clock([Rec(1.0)] * 3, calls, costs)  # optimizer: record 2
    assert clock.waits == ((0.0, 0.5, "fsdp"), (1.5, 1.75, "tensor"), (2.75, 4.75, "data"))
    stats = StepStats(step=4, loss=1.0, global_batch=8, infeed_seconds=0.0,
                      compute_seconds=clock.compute_seconds, local_reduce_seconds=0.0,
                      ici_seconds=clock.collective_seconds, update_seconds=clock.update_seconds,
                      model_flops=1, peak_flops_per_s=1.0, wall_seconds=0.0,
                      exposed_allreduce_seconds=clock.exposed_seconds, traced_device=3,
                      collective_spans=clock.spans, compute_waits=clock.waits)
    assert stats.step_seconds == pytest.approx(clock.step_seconds)
    axes = ["data", "fsdp", "tensor"]
    lanes = {e["tid"]: e["args"]["name"] for e in sharded_metadata_events("m", axes)
             if e["name"] == "thread_name"}
    events = sharded_step_events(stats, axes, start_s=10.0)
    by_lane: dict[str, list] = {}
    for e in events:
        by_lane.setdefault(lanes[e["tid"]], []).append(
            (e["name"], round(e["ts"] - 10e6, 6), round(e["ts"] + e["dur"] - 10e6, 6)))
    assert by_lane["steps"] == [("step 5", 0.0, 5.75e6)]
    assert by_lane["compute (slowest device)"] == [
        ("wait for fsdp", 0.0, 0.5e6), ("compute", 0.5e6, 1.5e6), ("wait for tensor", 1.5e6, 1.75e6),
        ("compute", 1.75e6, 2.75e6), ("wait for data", 2.75e6, 4.75e6), ("compute", 4.75e6, 5.75e6)]
    assert by_lane["ICI fsdp"] == [("all_gather l0", 0.0, 0.5e6)]
    assert by_lane["ICI tensor"] == [("allreduce mlp", 1.5e6, 1.75e6)]
    assert by_lane["ICI data"] == [("allreduce grads", 2.75e6, 4.75e6)]

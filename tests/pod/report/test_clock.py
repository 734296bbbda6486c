"""The one clock of every mesh (``pod.report.clock``): hand-worked time lines, the
overlap switch, gradient buckets on the ICI against a closed form, and how device
reports become a step's figures (infeed, MFU) through real plans."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pod.report.clock import step_clock
from pod.programs.collectives import CollectiveCall


@dataclass(frozen=True)
class Rec:
    seconds: float


Call = CollectiveCall


def cost_of(table):
    return lambda axis, op, nbytes: table[(axis, op)]


def test_no_collectives_is_the_sum_of_records():
    clock = step_clock([Rec(1.0), Rec(2.0)], [], cost_of({}))
    assert clock.step_seconds == 3.0 and clock.exposed_seconds == 0 and clock.serial_seconds == 3.0


def test_an_activation_allreduce_blocks_the_compute_stream():
    calls = [Call("tensor", "allreduce", 64, "mlp", "activation", 1)]
    clock = step_clock([Rec(1.0), Rec(1.0)], calls, cost_of({("tensor", "allreduce"): 0.25}))
    assert clock.step_seconds == pytest.approx(2.25)
    assert clock.axis_exposed_seconds == {"tensor": pytest.approx(0.25)}
    assert clock.axis_bytes == {"tensor": 64} and clock.serial_seconds == pytest.approx(2.25)


def test_param_gathers_are_prefetched_one_layer_ahead():
    # gathers before layers 0, 1, 2 (0.5 s each), layers of 1 s: only the first is exposed
    calls = [Call("fsdp", "all_gather", 8, f"l{i}", "param_gather", i) for i in range(3)]
    clock = step_clock([Rec(1.0)] * 4, calls, cost_of({("fsdp", "all_gather"): 0.5}))
    assert clock.step_seconds == pytest.approx(4.5)
    assert clock.axis_exposed_seconds == {"fsdp": pytest.approx(0.5)}
    assert [(s.start, s.end) for s in clock.spans] == [(0, 0.5), (0.5, 1.0), (1.5, 2.0)]
    assert clock.serial_seconds == pytest.approx(5.5)


def test_a_slow_prefetch_is_partly_exposed():
    # 1.5 s gathers behind 1 s layers: gather 1 runs [1.5, 3.0], needed at 2.5
    calls = [Call("fsdp", "all_gather", 8, f"l{i}", "param_gather", i) for i in range(2)]
    clock = step_clock([Rec(1.0)] * 2, calls, cost_of({("fsdp", "all_gather"): 1.5}))
    assert clock.step_seconds == pytest.approx(1.5 + 0.5 + 1.0 + 1.0)
    assert clock.exposed_seconds == pytest.approx(2.0)


@pytest.mark.parametrize("layers, compute, gather", [(6, 1.0, 0.5), (5, 1.0, 1.5), (4, 0.3, 0.2)])
def test_prefetch_depth_exposes_the_gathers_it_no_longer_hides(layers, compute, gather):
    """L layers of c seconds, each after its gather of g seconds (issue 29 item 3). One
    layer ahead, the first gather is exposed whole and each later one by max(0, g - c)
    (its gather runs behind the layer before); with none ahead (a plan too tight to
    prefetch, ``DeviceMemory.prefetch_layers`` 0) every gather is exposed whole: the
    exposed fsdp time grows by (L - 1) min(g, c)."""
    calls = [Call("fsdp", "all_gather", 8, f"l{i}", "param_gather", i) for i in range(layers)]
    records, cost = [Rec(compute)] * layers, cost_of({("fsdp", "all_gather"): gather})
    ahead = step_clock(records, calls, cost)                                 # the default: 1
    none = step_clock(records, calls, cost, prefetch_layers=0)
    two = step_clock(records, calls, cost, prefetch_layers=2)
    assert ahead.axis_exposed_seconds["fsdp"] == pytest.approx(
        gather + (layers - 1) * max(0.0, gather - compute))
    assert none.axis_exposed_seconds["fsdp"] == pytest.approx(layers * gather)
    assert (none.axis_exposed_seconds["fsdp"] - ahead.axis_exposed_seconds["fsdp"]
            == pytest.approx((layers - 1) * min(gather, compute)))
    assert none.step_seconds == pytest.approx(layers * (compute + gather))
    assert two.exposed_seconds <= ahead.exposed_seconds + 1e-12   # deeper never exposes more


def test_grad_reduces_hide_behind_the_backward_pass_and_the_optimizer_waits():
    calls = [Call("fsdp", "reduce_scatter", 8, "g2", "grad_reduce", 2),
             Call("data", "allreduce", 4, "g3", "grad_reduce", 3)]
    costs = cost_of({("fsdp", "reduce_scatter"): 0.8, ("data", "allreduce"): 0.8})
    clock = step_clock([Rec(1.0)] * 4, calls, costs)  # the optimizer: record 3
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
    clock = step_clock([Rec(1.0)] * 3, calls, costs)
    assert [(s.start, s.end) for s in clock.spans] == [(1.0, 2.0), (0.0, 0.5), (3.0, 3.5)]
    assert clock.step_seconds == pytest.approx(1 + 1 + 1 + 0.5 + 1)


def test_bad_calls_are_refused():
    with pytest.raises(ValueError, match="kind 'x'"):
        step_clock([Rec(1.0)], [Call("data", "allreduce", 4, "t", "x", 0)], cost_of({}))
    with pytest.raises(ValueError, match="issue order"):
        step_clock([Rec(1.0)], [Call("data", "allreduce", 4, "t", "activation", 2)],
                           cost_of({("data", "allreduce"): 0.0}))


def test_each_mesh_axis_has_its_own_links_and_a_queue_on_one_axis_is_charged_to_it():
    # a 2 s data allreduce of gradients runs [1, 3] behind record 1. A tensor
    # allreduce issued at t = 2 runs on the tensor axis's own links at once [2, 2.5];
    # a data-axis activation allreduce queues behind the gradients until 3 and runs
    # [3, 3.5]: its 1.5 s wait is the data axis's exposed time
    grads = Call("data", "allreduce", 8, "g", "grad_reduce", 1)
    costs = cost_of({("data", "allreduce"): 2.0, ("tensor", "allreduce"): 0.5})
    apart = step_clock([Rec(1.0)] * 3, [grads, Call("tensor", "allreduce", 4, "a", "activation",
                                                    2)], costs, update_start=3)
    assert [(s.start, s.end) for s in apart.spans] == [(1.0, 3.0), (2.0, 2.5)]
    assert apart.axis_exposed_seconds == {"tensor": pytest.approx(0.5)}
    assert apart.step_seconds == pytest.approx(3.5)

    def by_size(axis, op, nbytes):
        return 2.0 if nbytes == 8 else 0.5

    queued = step_clock([Rec(1.0)] * 3, [grads, Call("data", "allreduce", 4, "a", "activation",
                                                     2)], by_size, update_start=3)
    assert [(s.start, s.end) for s in queued.spans] == [(1.0, 3.0), (3.0, 3.5)]
    assert queued.axis_exposed_seconds == {"data": pytest.approx(1.5)}
    assert queued.step_seconds == pytest.approx(4.5)
    for clock in (apart, queued):
        exposed, total = clock.axis_exposed_seconds, clock.axis_seconds
        for axis in exposed:  # what an axis exposes is part of what it costs
            assert exposed[axis] <= total[axis] + 1e-12
        assert sum(exposed.values()) == pytest.approx(clock.exposed_seconds)


def test_the_trace_lays_compute_waits_and_collectives_on_the_clocks_times():
    """The trace of a step: compute between the waits (the clock's), a wait per blocking
    collective named after its axis, each collective on its axis's lane; compute and
    waits tile [0, step] with no gap or overlap."""
    from pod.report.stats import StepStats
    from pod.report.trace import metadata_events, step_events

    calls = [Call("fsdp", "all_gather", 8, "l0", "param_gather", 0),
             Call("tensor", "allreduce", 4, "mlp", "activation", 1),
             Call("data", "allreduce", 8, "grads", "grad_reduce", 2)]
    costs = cost_of({("fsdp", "all_gather"): 0.5, ("tensor", "allreduce"): 0.25,
                     ("data", "allreduce"): 2.0})
    clock = step_clock([Rec(1.0)] * 3, calls, costs)  # optimizer: record 2
    assert clock.waits == ((0.0, 0.5, "fsdp"), (1.5, 1.75, "tensor"), (2.75, 4.75, "data"))
    stats = StepStats(step=4, loss=1.0, global_batch=8, infeed_seconds=0.0,
                      compute_seconds=clock.compute_seconds,
                      collective_seconds=clock.collective_seconds,
                      update_seconds=clock.update_seconds, model_flops=1, peak_flops_per_s=1.0,
                      wall_seconds=0.0, exposed_collective_seconds=clock.exposed_seconds,
                      traced_device=3, collective_spans=clock.spans, compute_waits=clock.waits)
    assert stats.step_seconds == pytest.approx(clock.step_seconds)
    axes = ["data", "fsdp", "tensor"]
    lanes = {e["tid"]: e["args"]["name"] for e in metadata_events("m", axes)
             if e["name"] == "thread_name"}
    events = step_events(stats, axes, start_s=10.0)
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


# --------------------------------------------------------------------------- overlap switch

def test_without_overlap_every_collective_blocks_where_it_is_issued():
    """The time line of test_the_trace_lays_...: with overlap=False the prefetch waits
    for its own layer and the gradient allreduce blocks the compute stream."""
    calls = [Call("fsdp", "all_gather", 8, "l0", "param_gather", 0),
             Call("fsdp", "all_gather", 8, "l1", "param_gather", 1),
             Call("tensor", "allreduce", 4, "mlp", "activation", 1),
             Call("data", "allreduce", 8, "grads", "grad_reduce", 2)]
    costs = cost_of({("fsdp", "all_gather"): 0.5, ("tensor", "allreduce"): 0.25,
                     ("data", "allreduce"): 2.0})
    clock = step_clock([Rec(1.0)] * 3, calls, costs, overlap=False)
    assert [(s.start, s.end) for s in clock.spans] == [(0.0, 0.5), (1.5, 2.0), (2.0, 2.25),
                                                       (3.25, 5.25)]
    assert clock.step_seconds == pytest.approx(3.0 + 0.5 + 0.5 + 0.25 + 2.0)
    assert clock.step_seconds == pytest.approx(clock.serial_seconds)
    overlapped = step_clock([Rec(1.0)] * 3, calls, costs)
    assert overlapped.step_seconds < clock.step_seconds


_calls = st.lists(st.tuples(st.sampled_from(["data", "fsdp", "tensor"]),
                            st.sampled_from(["param_gather", "grad_reduce", "activation"]),
                            st.integers(0, 6), st.floats(0.0, 2.0)), max_size=10)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=6), _calls)
def test_without_overlap_the_step_is_the_serial_sum(seconds, spec):
    """Any records and calls: with overlap=False the step is the serial sum, and every
    axis exposes all of its seconds; with overlap it is never longer, and never shorter
    than the records alone."""
    n = len(seconds)
    spec = sorted(spec, key=lambda c: c[2])
    calls = [Call(axis, "allreduce", i, f"c{i}", kind, min(after, n))
             for i, (axis, kind, after, _) in enumerate(spec)]
    cost = {i: c[3] for i, c in enumerate(spec)}
    costs = lambda axis, op, nbytes: cost[nbytes]  # noqa: E731 - one cost per call
    records = [Rec(s) for s in seconds]
    serial = step_clock(records, calls, costs, overlap=False)
    assert serial.step_seconds == pytest.approx(sum(seconds) + sum(cost.values()), abs=1e-12)
    assert serial.step_seconds == pytest.approx(serial.serial_seconds, abs=1e-12)
    for axis, total in serial.axis_seconds.items():
        assert serial.axis_exposed_seconds.get(axis, 0.0) == pytest.approx(total, abs=1e-12)
    overlapped = step_clock(records, calls, costs)
    assert sum(seconds) - 1e-12 <= overlapped.step_seconds <= serial.step_seconds + 1e-12
    assert sum(overlapped.axis_exposed_seconds.values()) == pytest.approx(
        overlapped.exposed_seconds, abs=1e-9)


# --------------------------------------------------------------------------- gradient buckets

def back_to_back(ready, cost):
    """The reference: collectives issued in order on one ICI, each starting once its
    input is ready and the one before it is done; the end of the last."""
    t = 0.0
    for r, c in zip(ready, cost):
        t = max(t, r) + c
    return t


def _buckets(seconds, after, cost):
    """Records of ``seconds``, a grad_reduce bucket after each index of ``after``,
    the optimizer as one more 1 s record."""
    calls = [Call("data", "allreduce", i, f"b{i}", "grad_reduce", a) for i, a in enumerate(after)]
    return step_clock([Rec(s) for s in seconds] + [Rec(1.0)], calls,
                      lambda axis, op, nbytes: cost[nbytes], update_start=len(seconds))


@pytest.mark.parametrize("seconds, after, cost, end", [
    ([0.0], [0, 0, 0], [1, 2, 3], 6),              # ready at once: back to back
    ([10.0, 10.0], [0, 1, 2], [1, 1, 1], 21),      # ready long after: the last one's ready + cost
    ([1.0], [0, 1], [5, 1], 6),                    # a bucket waits for the one before it
])
def test_gradient_buckets_run_back_to_back_on_the_ici(seconds, after, cost, end):
    clock = _buckets(seconds, after, cost)
    assert clock.spans[-1].end == end
    # the optimizer starts when the last bucket is done
    assert clock.step_seconds == pytest.approx(max(end, sum(seconds)) + 1.0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.0, 1e-3), min_size=1, max_size=8),
       st.lists(st.floats(0.0, 1e-3), min_size=1, max_size=12), st.data())
def test_the_last_bucket_ends_where_the_closed_form_says(seconds, cost, data):
    after = sorted(data.draw(st.lists(st.integers(0, len(seconds)), min_size=len(cost),
                                      max_size=len(cost))))
    clock = _buckets(seconds, after, cost)
    ready = [sum(seconds[:a]) for a in after]
    end = max(s.end for s in clock.spans)  # a zero-cost bucket may take an earlier gap
    assert end == pytest.approx(back_to_back(ready, cost), abs=1e-15)
    assert end >= max(sum(cost), ready[-1] + cost[-1]) - 1e-15
    assert end <= ready[-1] + sum(cost) + 1e-15
    exposed = max(0.0, end - sum(seconds))
    assert clock.exposed_seconds == pytest.approx(exposed, abs=1e-15)


def test_a_zero_cost_collective_leaves_the_ici_one_collective_at_a_time():
    """A collective of no cost (or one below float resolution) occupies nothing: two
    collectives ready with it still run one after the other (a zero-length interval kept
    on the ICI's time line unsorted it, and the third one overlapped the second)."""
    for tiny in (0.0, 1e-300):  # 1.0 + 1e-300 == 1.0
        clock = _buckets([1.0], [1, 1, 1], [tiny, 0.7, 0.4])
        assert [(s.start, s.end) for s in clock.spans] == [
            (1.0, 1.0), (1.0, 1.7), (1.7, pytest.approx(2.1))]
        assert clock.step_seconds == pytest.approx(2.1 + 1.0)


# --------------------------------------------------------------------------- device reports

class Costs:
    """A stand-in for ``MeshCollectiveCosts``: seconds per (axis, op), no links."""

    def __init__(self, table):
        self.table = table

    def seconds(self, axis, op, nbytes):
        return self.table[(axis, op)]

    def link_bytes(self, calls):
        return {"0->1": sum(c.nbytes for c in calls)}


def _report(device, seconds, calls=(), update_start=None, mxu_flops=100, loss=1.0):
    from pod.report.clock import DeviceReport

    return DeviceReport(device=device, loss=loss, record_seconds=tuple(seconds),
                        record_bounds=("mxu",) * len(seconds), update_start=update_start,
                        calls=tuple(calls), mxu_flops=mxu_flops, hbm_used_bytes=10 * device,
                        hbm_peak_bytes=20 * device, hbm_capacity_bytes=1000)


def _context(**kw):
    from pod.report.clock import StepContext

    base = dict(global_batch=8, model_flops=None, device_peak_flops_per_s=100.0, devices=4,
                devices_per_chip=2, host_to_chip_bytes_per_s=1000.0)
    return StepContext(**{**base, **kw})


def test_the_step_is_the_slowest_devices_clock_and_the_infeed_hides_behind_it():
    from pod.report.clock import combine_device_reports

    grads = [Call("data", "allreduce", 8, "g", "grad_reduce", 2)]
    reports = [_report(0, [1.0, 1.0, 1.0], grads, 2), _report(1, [1.0, 2.0, 1.0], grads, 2, loss=3.0),
               _report(2, [0.5, 0.5, 1.0], grads, 2), _report(3, [1.0, 1.0, 1.0], grads, 2)]
    costs = Costs({("data", "allreduce"): 0.5})
    # infeed of the busiest chip: 2,500 B at 1,000 B/s = 2.5 s; the step is 3.5 s
    stats = combine_device_reports(0, reports, costs, _context(), infeed_bytes=2500,
                                   wall_seconds=0.1)
    assert stats.traced_device == 1 and stats.compute_seconds == 3.0
    assert stats.exposed_collective_seconds == pytest.approx(0.5)
    assert stats.update_seconds == 1.0 and stats.loss == pytest.approx(1.5)
    assert stats.infeed_seconds == 2.5 and stats.exposed_infeed_seconds == 0.0
    assert stats.step_seconds == pytest.approx(4.5)
    assert stats.chip_compute_seconds == {0: 3.0, 1: 2.0}    # each chip's slowest device
    assert stats.hbm_peak_bytes == {0: 0, 1: 20, 2: 40, 3: 60}
    assert stats.device_mxu_flops == {d: 100 for d in range(4)}
    # an infeed longer than the step shows beyond it; without overlap it all does
    slow = combine_device_reports(0, reports, costs, _context(), infeed_bytes=6000,
                                  wall_seconds=0.1)
    assert slow.exposed_infeed_seconds == pytest.approx(6.0 - 4.5)
    serial = combine_device_reports(0, reports, costs, _context(overlap=False),
                                    infeed_bytes=2500, wall_seconds=0.1)
    assert serial.exposed_infeed_seconds == 2.5
    assert serial.step_seconds == pytest.approx(2.5 + 3.0 + 0.5 + 1.0)
    # dispatch is added once per step
    host = combine_device_reports(0, reports, costs, _context(dispatch_seconds=0.25),
                                  infeed_bytes=2500, wall_seconds=0.1)
    assert host.step_seconds == pytest.approx(4.5 + 0.25)


def test_mfu_is_model_flops_over_the_device_peak_times_the_devices():
    from pod.report.clock import combine_device_reports

    reports = [_report(d, [1.0, 1.0]) for d in range(4)]
    costs = Costs({})
    recorded = combine_device_reports(0, reports, costs, _context(), infeed_bytes=0,
                                      wall_seconds=0.0)
    # no model FLOPs given: the recorded MXU FLOPs of every device are the model's
    assert recorded.model_flops == recorded.hardware_flops == 400
    assert recorded.peak_flops_per_s == 400.0
    assert recorded.mfu == pytest.approx(400 / (2.0 * 100.0 * 4))
    # one timing-only report standing for 4 devices
    one = combine_device_reports(0, reports[:1], costs, _context(), infeed_bytes=0,
                                 wall_seconds=0.0, replicate=4)
    assert one.model_flops == 400 and one.mfu == recorded.mfu
    given = combine_device_reports(0, reports, costs, _context(model_flops=320), infeed_bytes=0,
                                   wall_seconds=0.0)
    assert given.model_flops == 320 and given.hardware_flops == 400
    assert given.mfu == pytest.approx(320 / (2.0 * 100.0 * 4))


def _v3_plan(model, data, mesh=None, batch=16):
    from pod.config.plan import build_plan
    from pod.config.scenario import parse_scenario

    pod = {"slice": "v3-8", **({"mesh": mesh} if mesh else {})}
    return build_plan(parse_scenario({"name": "mfu", "pod": pod, "model": model, "data": data,
                                      "training": {"global_batch": batch, "steps": 1},
                                      "metrics": {"port": 0}}))


TINY_LM = {"name": "transformer", "options": {"embed_dim": 16, "heads": 2, "head_dim": 8,
                                              "mlp_dim": 32, "layers": 1}}
TEXT = {"name": "text", "options": {"sequence_length": 16}}


@pytest.mark.parametrize("backend", ["timing", "local"])
def test_a_v3_steps_mfu_counts_the_global_batch_over_every_tensorcores_peak(backend,
                                                                            one_blas_thread):
    """Issue 22's surviving mutants: a sharded MFU from the per-device batch (4x too low
    here: data x fsdp = 4) and one over the chip's peak on v3 (2x too low: a device is
    one TensorCore, half the chip). MFU = model FLOPs of the global batch / (step x the
    pod's peak), the pod's peak being its 4 chips' (get_chip_spec, not the plan)."""
    from chip import get_chip_spec
    from pod.runtime.local import LocalPod
    from pod.runtime.timing import TimingPod

    plan = _v3_plan(TINY_LM, TEXT, {"data": 2, "fsdp": 2, "tensor": 2})
    if backend == "timing":
        stats = TimingPod(plan).step(0)
    else:
        with LocalPod(plan) as pod:
            stats = pod.step(0)
    cfg = plan.model.config
    per_example = plan.model.model_flops_per_example()
    assert per_example == (6 * cfg.matmul_param_count() * 16
                           + 12 * cfg.layers * 16 * 16 * cfg.inner_dim)
    assert stats.model_flops == 16 * per_example
    chip_peak = get_chip_spec("v3").peak_bf16_flops_per_s
    assert stats.peak_flops_per_s == pytest.approx(4 * chip_peak)
    assert stats.mfu == pytest.approx(16 * per_example / (stats.step_seconds * 4 * chip_peak))
    # and each device's MXU utilisation is over one TensorCore's peak
    device, flops = next(iter(stats.device_mxu_flops.items()))
    assert stats.mxu_utilization()[device] == pytest.approx(
        flops / (stats.step_seconds * chip_peak / 2))


def test_a_replicated_models_mfu_is_the_same_timing_only_and_functional(one_blas_thread):
    """No model FLOPs formula (an MLP): the recorded MXU FLOPs of every device, the
    timing-only device's counted once per device of the mesh."""
    from pod.runtime.local import LocalPod
    from pod.runtime.timing import TimingPod

    plan = _v3_plan({"name": "mlp", "options": {"hidden": [32], "dropout": False}},
                    {"name": "digits"}, batch=64)
    timing = TimingPod(plan).step(0)
    with LocalPod(plan) as pod:
        functional = pod.step(0)
    assert timing.model_flops == functional.model_flops == sum(
        functional.device_mxu_flops.values())
    assert len(functional.device_mxu_flops) == 8                       # a device per TensorCore
    # forward + backward (dW, and dX but for the first layer) of 8 examples per device
    per_device = 2 * 8 * (64 * 32 + 32 * 10) * 2 + 2 * 8 * 32 * 10
    assert functional.device_mxu_flops[0] == per_device
    assert timing.step_seconds == pytest.approx(functional.step_seconds, rel=1e-12)
    assert timing.mfu == pytest.approx(functional.mfu, rel=1e-12)


def _stats_fields(stats):
    import dataclasses

    return {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)}


def test_a_step_that_clocks_as_the_last_takes_its_figures_and_any_change_clocks_afresh():
    """``StatsMemo``: every StepStats field equals the unmemoised combine's, step after
    step, whether the memo hit (same records and calls, new loss, wall and HBM use) or
    missed (a record's seconds, a call, the costs object or the context changed)."""
    from pod.report.clock import StatsMemo, combine_device_reports

    grads = [Call("data", "allreduce", 8, "g", "grad_reduce", 2)]
    costs, faulty = Costs({("data", "allreduce"): 0.5}), Costs({("data", "allreduce"): 2.0})
    context = _context()

    def reports(step, slow=2.0, nbytes=8):
        calls = [Call("data", "allreduce", nbytes, "g", "grad_reduce", 2)]
        return [_report(d, [1.0, slow if d == 1 else 1.0, 1.0], calls if nbytes != 8 else grads,
                        2, loss=1.0 + step + d) for d in range(4)]

    memo = StatsMemo()
    steps = [(reports(0), costs, context), (reports(1), costs, context),
             (reports(2, slow=3.0), costs, context), (reports(3, slow=3.0), faulty, context),
             (reports(4, slow=3.0, nbytes=16), faulty, context),
             (reports(5, slow=3.0, nbytes=16), faulty, _context(dispatch_seconds=0.25)),
             (reports(6, slow=3.0, nbytes=16), faulty, context)]
    for step, (rs, c, ctx) in enumerate(steps):
        for r in rs:  # HBM use moves from step to step; it is no part of the clock
            object.__setattr__(r, "hbm_used_bytes", r.hbm_used_bytes + step)
        want = combine_device_reports(step, rs, c, ctx, infeed_bytes=2500,
                                      wall_seconds=0.1 * step)
        got = combine_device_reports(step, rs, c, ctx, infeed_bytes=2500,
                                     wall_seconds=0.1 * step, memo=memo)
        assert _stats_fields(got) == _stats_fields(want), step
        assert got.step == step and got.loss == pytest.approx(2.5 + step)
        assert got.hbm_used_bytes == {d: 10 * d + step for d in range(4)}
    # the figures that changed did change (the memo did not hide them)
    first = combine_device_reports(0, steps[0][0], costs, context, infeed_bytes=2500,
                                   wall_seconds=0.0)
    assert first.compute_seconds == 3.0
    assert combine_device_reports(3, steps[3][0], faulty, context, infeed_bytes=2500,
                                  wall_seconds=0.0, memo=memo).compute_seconds == 4.0


def test_the_memo_hits_on_equal_reports_and_only_on_the_same_costs_and_context():
    from pod.report.clock import StatsMemo, combine_device_reports

    grads = [Call("data", "allreduce", 8, "g", "grad_reduce", 2)]
    costs, context = Costs({("data", "allreduce"): 0.5}), _context()
    memo = StatsMemo()
    first = combine_device_reports(0, [_report(0, [1.0, 2.0], grads, 1)], costs, context,
                                   infeed_bytes=0, wall_seconds=0.0, memo=memo)
    again = combine_device_reports(1, [_report(0, [1.0, 2.0], grads, 1)], costs, context,
                                   infeed_bytes=0, wall_seconds=0.0, memo=memo)
    assert again.collective_spans is first.collective_spans  # reused, not clocked again
    other = combine_device_reports(2, [_report(0, [1.0, 2.0], grads, 1)],
                                   Costs({("data", "allreduce"): 0.5}), context,
                                   infeed_bytes=0, wall_seconds=0.0, memo=memo)
    assert other.collective_spans is not first.collective_spans  # another costs object
    assert other.collective_spans == first.collective_spans

"""The overlapped step (issue: "a step is the critical path"): gradient buckets
reduced as the backward pass produces them, infeed behind the previous step,
host dispatch; checked against closed forms, through the one clock of a
timing-only data-parallel step."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pod.config.plan import build_plan
from pod.config.scenario import parse_scenario
from pod.programs import combine_buckets
from pod.report.stats import HOST_DISPATCH_SECONDS, StepStats
from pod.runtime.base import plan_program
from pod.runtime.timing import TimingPod


@given(st.lists(st.integers(1, 1000), min_size=1, max_size=20), st.integers(1, 2000))
def test_combine_buckets_keeps_order_and_bounds(sizes, cap):
    layers = [(f"l{i}", n) for i, n in enumerate(sizes)]
    buckets = combine_buckets(layers, cap)
    assert [name for names, _ in buckets for name in names] == [name for name, _ in layers]
    for names, total in buckets:
        assert total == sum(dict(layers)[n] for n in names)
        assert total <= cap or len(names) == 1
    # greedy: a bucket could not have taken the next bucket's first layer
    for (_, total), (names, _) in zip(buckets, buckets[1:]):
        assert total + dict(layers)[names[0]] > cap


def _stats(**parts) -> StepStats:
    base = dict(step=1, loss=1.0, global_batch=8, infeed_seconds=2e-6, compute_seconds=10e-6,
                collective_seconds=5e-6, update_seconds=3e-6, model_flops=0,
                peak_flops_per_s=1e12, wall_seconds=0.0)
    return StepStats(**{**base, **parts})


def test_without_overlap_the_step_is_the_sum():
    s = _stats()
    assert s.step_seconds == pytest.approx(2e-6 + 10e-6 + 5e-6 + 3e-6) == s.serial_step_seconds
    assert s.overlap_fraction == 0.0
    hidden = _stats(exposed_collective_seconds=1e-6, exposed_infeed_seconds=0.0,
                    dispatch_seconds=HOST_DISPATCH_SECONDS)
    assert hidden.step_seconds == pytest.approx(HOST_DISPATCH_SECONDS + 10e-6 + 1e-6 + 3e-6)
    assert hidden.serial_step_seconds == pytest.approx(HOST_DISPATCH_SECONDS + 20e-6)
    assert hidden.overlap_fraction == pytest.approx(1 - 1 / 5)


def _plan(overlap: bool, bucket_bytes: int = 32 << 20, dispatch: str = "device_loop"):
    return build_plan(parse_scenario({
        "name": "overlap", "pod": {"chip": "v4", "chips": 64},
        "model": {"name": "mlp", "options": {"hidden": [1024, 1024]}},
        "data": {"name": "synthetic", "options": {"shape": [256], "num_examples": 4096}},
        "training": {"global_batch": 4096, "steps": 2, "overlap": overlap,
                     "overlap_bucket_bytes": bucket_bytes, "host_dispatch": dispatch}}),
        timing_only=True)


def _layers(plan):
    return [layers for layers, _ in plan_program(plan).buckets]


def test_one_bucket_is_the_serial_allreduce_and_buckets_hide_communication():
    serial_plan, one_plan = _plan(False), _plan(True)
    assert serial_plan.bucket_elements is None and one_plan.bucket_elements == (32 << 20) // 4
    # without overlap: one bucket of every layer; 1.3M parameters fit one 32 MiB bucket too
    assert _layers(serial_plan) == _layers(one_plan) == [("dense3", "dense2", "dense1")]
    serial, one = TimingPod(serial_plan).step(1), TimingPod(one_plan).step(1)
    (span,) = one.collective_spans
    assert (span.axis, span.op, span.kind) == ("data", "allreduce", "grad_reduce")
    assert span.nbytes == 4 * one_plan.num_params
    # one bucket is ready only when the backward pass ends: nothing of it is hidden
    assert span.start == pytest.approx(one.compute_seconds)
    assert one.exposed_collective_seconds == pytest.approx(serial.collective_seconds)
    assert one.axis_exposed_seconds == pytest.approx({"data": serial.collective_seconds})
    assert one.compute_seconds == serial.compute_seconds
    # infeed is double-buffered: hidden behind the previous step's work
    assert serial.exposed_infeed_seconds == serial.infeed_seconds > 0
    assert one.exposed_infeed_seconds == max(
        0.0, one.infeed_seconds - (one.compute_seconds + one.exposed_collective_seconds
                                   + one.update_seconds))
    assert serial.step_seconds == pytest.approx(serial.serial_step_seconds)

    plan = _plan(True, bucket_bytes=2 << 20)
    layered = TimingPod(plan).step(1)
    assert _layers(plan) == [("dense3",), ("dense2",), ("dense1",)]
    spans = layered.collective_spans
    assert [s.tag for s in spans] == ["dense3 grads", "dense2 grads", "dense1 grads"]
    assert sum(s.nbytes for s in spans) == 4 * plan.num_params
    # each bucket starts when its layer's gradients are ready: the first runs while the
    # backward pass goes on, so the exposed part is less than the whole
    assert spans[0].start < layered.compute_seconds
    assert layered.exposed_collective_seconds < layered.collective_seconds
    assert layered.exposed_collective_seconds == pytest.approx(
        max(0.0, spans[-1].end - layered.compute_seconds))
    assert 0 < layered.overlap_fraction < 1


def test_host_dispatch_per_step_adds_the_measured_call():
    device = TimingPod(_plan(False)).step(1)
    host = TimingPod(_plan(False, dispatch="per_step")).step(1)
    assert host.step_seconds - device.step_seconds == pytest.approx(HOST_DISPATCH_SECONDS)


def _lm_plan(bucket_bytes: int, overlap: bool = True):
    return build_plan(parse_scenario({
        "name": "lm-buckets", "pod": {"slice": "v5e-8"},
        "model": {"name": "transformer", "options": {
            "embed_dim": 64, "heads": 4, "head_dim": 16, "mlp_dim": 256, "layers": 3}},
        "data": {"name": "text", "options": {"sequence_length": 32}},
        "training": {"global_batch": 64, "steps": 1, "overlap": overlap,
                     "overlap_bucket_bytes": bucket_bytes}}), timing_only=True)


@pytest.mark.parametrize("plan_of", [_lm_plan, lambda b: _plan(True, bucket_bytes=b)],
                         ids=["transformer", "mlp"])
def test_the_bucket_size_changes_every_models_data_parallel_step(plan_of):
    """Issue 31 item 2: training.overlap_bucket_bytes means the same for the transformer
    (the sharded program) as for any other model (the replicated one): 1 KiB buckets
    reduce each layer's gradients as the backward pass finishes it, one bucket of
    64 MiB all of them after the backward pass ends; the step differs."""
    small, large = plan_of(1 << 10), plan_of(64 << 20)
    order = [name for name, _ in small.model.gradient_buckets()]
    assert len(order) >= 3
    assert [b for b, _ in plan_program(small).buckets] == [(name,) for name in order]
    assert [b for b, _ in plan_program(large).buckets] == [tuple(order)]
    layered, one = TimingPod(small).step(1), TimingPod(large).step(1)
    grads = [s for s in layered.collective_spans if s.kind == "grad_reduce"]
    assert [s.tag for s in grads] == [f"{name} grads" for name in order]
    assert {(s.axis, s.op) for s in grads} == {("data", "allreduce")}
    (whole,) = [s for s in one.collective_spans if s.kind == "grad_reduce"]
    assert whole.tag == f"{order[0]} grads" and whole.nbytes == 4 * large.num_params
    assert sum(s.nbytes for s in grads) == whole.nbytes
    # the one bucket waits for the whole backward pass; the first of the layered ones
    # runs behind the rest of it
    assert grads[0].start < whole.start and grads[0].start < layered.compute_seconds
    # each collective pays its fixed cost and latency: more buckets, more time on the wire
    assert layered.collective_seconds > one.collective_seconds
    assert layered.step_seconds != one.step_seconds

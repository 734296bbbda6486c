"""The replicated program (``pod.programs.replicated``): data parallelism of any Model on
``{data: N}``, in process on a ``LocalMesh``. The gradient buckets leave in backward
order as soon as their layers are done (one bucket without overlap), the replicas stay
bit-identical, BatchNorm state is per replica and averaged for evaluation, and a
timing-only step records what a functional one does. (Numerics against one process on
the whole batch: tests/pod/workloads/test_workloads_dp.py.)"""

from __future__ import annotations

import math

import numpy as np
import pytest

from chip import TensorCore, get_chip_spec
from pod.programs import (DeviceCoords, EvalSums, LocalMesh, ReplicatedProgram,
                          ShapeCollectives, combine_buckets)
from pod.programs.collectives import sum_in_order
from pod.programs.replicated import layer_ends
from pod.workloads import build_model, build_optimizer, load_dataset

pytestmark = pytest.mark.usefixtures("one_blas_thread")

SPEC = get_chip_spec("v2").core
DATA = 4
BATCH = 32


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def _model(batch_norm=True):
    # dense1 64 x 32 + 32 = 2,080, dense2 32 x 16 + 16 = 528, dense3 16 x 10 + 10 = 170
    # (BatchNorm layers add 2 x 32 and 2 x 16)
    return build_model("mlp", (8, 8, 1), 10, hidden=[32, 16], batch_norm=batch_norm,
                       dropout=False)


def _program(model, buckets="per-layer"):
    if buckets == "per-layer":  # every layer with parameters a bucket of its own
        buckets = combine_buckets(model.gradient_buckets(), 1)
    return ReplicatedProgram(model, {"data": DATA}, build_optimizer("adam", learning_rate=0.01),
                             buckets=buckets)


def _train(program, digits, steps=3):
    """Every replica of a LocalMesh trains ``steps`` steps; per device: (shard, records of
    the last step, its calls, update_start)."""
    x, y = digits.x_train[:BATCH * steps], digits.y_train[:BATCH * steps]

    def device(comm):
        core = TensorCore(SPEC, numerics=True)
        coords = DeviceCoords.of(comm)
        shard, part = program.init_local(0, coords), program.batch_slice(BATCH, coords)
        for step in range(steps):
            comm.take_calls()
            core.take_records()
            xs, ys = x[step * BATCH:(step + 1) * BATCH], y[step * BATCH:(step + 1) * BATCH]
            result = program.train_step(core, comm, shard, xs[part], ys[part], step + 1)
            shard = result.shard
        return shard, core.take_records(), comm.take_calls(), result.update_start

    return LocalMesh({"data": DATA}).run(device)


def _last_record_of(records, layers):
    """1 + the index of the last op record of these layers (records "<layer>/<op>")."""
    return 1 + max(i for i, r in enumerate(records) if r.name.split("/")[0] in layers)


def test_buckets_leave_in_backward_order_when_their_layers_are_done(digits):
    model = _model()
    program = _program(model)
    order = [name for name, _ in model.gradient_buckets()]
    assert order[0] == "dense3" and order[-1] == "dense1"
    for shard, records, calls, update_start in _train(program, digits):
        assert [c.tag for c in calls] == [f"{name} grads" for name in order]
        assert all((c.axis, c.op, c.kind) == ("data", "allreduce", "grad_reduce") for c in calls)
        sizes = dict(model.gradient_buckets())
        assert [c.nbytes for c in calls] == [4 * sizes[name] for name in order]
        for call, name in zip(calls, order):
            assert call.after_record == _last_record_of(records[:update_start], {name})
        marks = [c.after_record for c in calls]
        assert marks == sorted(marks) and marks[0] < marks[-1] <= update_start
        # the update starts with the mean over the replicas, then the optimizer
        assert records[update_start].name == "grad_mean"
        assert all(not r.name.startswith("adam/") for r in records[:update_start])


def test_without_overlap_one_bucket_leaves_after_the_backward_pass(digits):
    model = _model(batch_norm=False)
    program = _program(model, buckets=None)
    for shard, records, calls, update_start in _train(program, digits, steps=1):
        (call,) = calls
        assert call.tag == "dense3 grads" and call.nbytes == 4 * model.num_params
        assert call.after_record == update_start == _last_record_of(
            records, {"dense1", "dense2", "dense3"})


def test_combined_buckets_wait_for_their_last_layer(digits):
    """dense3 and dense2 in one bucket (170 + 528 elements): it leaves when dense2 is done."""
    model = _model(batch_norm=False)
    program = _program(model, buckets=combine_buckets(model.gradient_buckets(), 170 + 528))
    shard, records, calls, update_start = _train(program, digits, steps=1)[0]
    assert [c.tag for c in calls] == ["dense3 grads", "dense1 grads"]
    assert [c.nbytes for c in calls] == [4 * (170 + 528), 4 * 2080]
    assert calls[0].after_record == _last_record_of(records[:update_start], {"dense2"})
    assert layer_ends(records, ["dense3", "dense2", "nothing"])["nothing"] == 0


def test_replicas_hold_the_same_bits_and_batchnorm_state_is_their_own(digits):
    devices = _train(_program(_model()), digits)
    first = devices[0][0]
    for shard, *_ in devices[1:]:
        for tree in ("params", "opt_state"):
            mine, other = getattr(first, tree), getattr(shard, tree)
            assert all(np.array_equal(mine[k], other[k]) for k in mine), tree
        # each replica's running averages saw its own quarter of every batch
        assert not np.array_equal(first.model_state["bn1/moving_mean"],
                                  shard.model_state["bn1/moving_mean"])


def test_evaluation_uses_the_mean_of_the_replicas_batchnorm_state(digits):
    """Each replica evaluates its slice on the mean of every replica's state (the
    allreduce of the state over data, / data); the sums add up to that reference,
    evaluated slice by slice here (the same code path and shapes: the same bits)."""
    model = _model()
    program = _program(model)
    trained = {s.coords: s for s, *_ in _train(program, digits)}
    x, y = digits.x_test, digits.y_test

    def device(comm):
        c = DeviceCoords.of(comm)
        part = program.eval_slice(len(x), c)
        return part, program.evaluate(TensorCore(SPEC, numerics=True), comm, trained[c], x[part],
                                      y[part])

    out = LocalMesh({"data": DATA}).run(device)
    states = [trained[DeviceCoords(d)].model_state for d in range(DATA)]
    mean = {k: sum_in_order([s[k] for s in states]) / np.float32(DATA) for k in states[0]}
    assert not np.array_equal(mean["bn1/moving_mean"], states[0]["bn1/moving_mean"])
    params = trained[DeviceCoords(0)].params
    core = TensorCore(SPEC, numerics=True)
    for part, got in out:
        want = EvalSums(*model.evaluate_sums(core, params, x[part], y[part], state=mean))
        assert got == want
        alone = EvalSums(*model.evaluate_sums(core, params, x[part], y[part], state=states[0]))
        assert alone.loss_sum != got.loss_sum                           # the mean matters
    total = EvalSums.total(sums for _, sums in out)
    assert total.count == len(x)


def test_a_timing_only_step_records_what_a_functional_step_does(digits):
    """The representative device of TimingPod: core.execute False, a shape-only shard and
    ShapeCollectives; its records (names, units, seconds, FLOPs, bytes) and calls are the
    functional device's, and it moves no data (its new shard is zero views)."""
    model = _model()
    program = _program(model)
    x, y = digits.x_train[:BATCH], digits.y_train[:BATCH]
    part = program.batch_slice(BATCH, DeviceCoords(1))

    def functional(comm):
        core = TensorCore(SPEC, numerics=True)
        result = program.train_step(core, comm, program.init_local(0, DeviceCoords.of(comm)),
                                    x[part], y[part], 1)
        return core.take_records(), list(comm.calls), result.update_start

    records, calls, update_start = LocalMesh({"data": DATA}).run(functional)[1]
    core = TensorCore(SPEC, numerics=True)
    core.execute = False
    comm = ShapeCollectives({"data": DATA}, {"data": 1})
    result = program.train_step(core, comm, program.shape_shard(DeviceCoords(1)), x[part],
                                y[part], 1)
    shaped = core.take_records()

    def row(r):
        return (r.name, r.unit, r.seconds, r.flops, r.hbm_bytes, r.bound)

    assert [row(r) for r in shaped] == [row(r) for r in records]
    assert comm.calls == calls and result.update_start == update_start
    assert all(not np.any(v) for v in result.shard.params.values())


def test_bad_meshes_and_buckets_are_refused():
    model = _model(batch_norm=False)
    adam = build_optimizer("adam")
    with pytest.raises(ValueError, match="must have every axis but data 1"):
        ReplicatedProgram(model, {"data": 2, "tensor": 2}, adam)
    with pytest.raises(ValueError, match="mesh axis 'pipe'"):
        ReplicatedProgram(model, {"pipe": 2}, adam)
    with pytest.raises(ValueError, match="cover 4 parameters of 6"):
        ReplicatedProgram(model, {"data": 2}, adam, buckets=((("dense3", "dense2"), 698),))
    program = ReplicatedProgram(model, {"data": 2}, adam)
    with pytest.raises(ValueError, match="fit this model"):
        program.load_local({"dense1/kernel": np.zeros((2, 2), np.float32)}, {}, DeviceCoords())
    assert math.prod(model.param_shapes["dense1/kernel"]) == 64 * 32

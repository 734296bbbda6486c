"""Expert parallelism (issue 24, item 3) on the in-process LocalMesh. No Ray.

The reference is the same 8-expert top-2 model trained on one TensorCore on the same
global batches (``TransformerModel.loss_and_grads`` + AdamW), in fp32 (XLA's 6-pass
products): the sharded run sums the same float32 terms in another order (the batch
split over devices; an expert's weight gradient summed over the rows of every device
of its group, source by source), so the parameters land within the sharded dense
program's tolerance (``test_sharded.FP32_ATOL``). Capacity is per sequence, so
routing and dropping are each device's own and the router loads add up exactly.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

from chip import TensorCore, get_chip_spec
from pod.programs import DeviceCoords, ShardedTransformer
from pod.programs.collectives import LocalMesh, ShapeCollectives
from pod.programs.transformer import check_expert_split, device_param_elements
from pod.workloads import TransformerConfig, TransformerModel, build_optimizer
from pod.workloads.moe import expert_capacity

pytestmark = pytest.mark.usefixtures("one_blas_thread")

SPEC = get_chip_spec("v4").core
MOE = {"vocabulary": 32, "sequence_length": 8, "embed_dim": 16, "heads": 4, "head_dim": 4,
       "mlp_dim": 16, "layers": 2, "experts": 8, "experts_per_token": 2,
       "capacity_factor": 1.0, "moe_aux_loss_weight": 0.01}
BATCH, STEPS, LR = 8, 4, 1e-2
FP32_ATOL = 5e-5


def batches(steps=STEPS):
    rng = np.random.default_rng(1)
    shape = (BATCH, MOE["sequence_length"])
    return [(rng.integers(0, 32, shape), rng.integers(0, 32, shape)) for _ in range(steps)]


@functools.lru_cache(maxsize=None)
def single(precision="fp32", option_items=()):
    """One TensorCore: (params, losses, router loads per step)."""
    model = TransformerModel(TransformerConfig(**{**MOE, **dict(option_items)}))
    core, opt = TensorCore(SPEC, precision=precision), build_optimizer("adamw", learning_rate=LR)
    params = model.init_params(0)
    state, losses, loads = opt.init(params), [], []
    for step, (x, y) in enumerate(batches(), 1):
        local = model.prepare_params(core, params)
        _, caches = model.forward(core, local, x, training=True)
        loads.append([c["moe"] for c in caches if "moe" in c])
        loss, grads = model.loss_and_grads(core, params, x, y)
        params, state = opt.update(core, grads, state, params, step)
        losses.append(loss)
        core.take_records()
    return params, losses, loads


@functools.lru_cache(maxsize=None)
def sharded(mesh_items, precision="fp32", option_items=()):
    """Every device of a LocalMesh: (program, [(shard, results, calls, records)] by device)."""
    sizes = dict(mesh_items)
    model = TransformerModel(TransformerConfig(**{**MOE, **dict(option_items)}))
    program = ShardedTransformer(model, sizes, build_optimizer("adamw", learning_rate=LR))
    data = batches()

    def device(comm):
        coords = DeviceCoords.of(comm)
        core = TensorCore(SPEC, precision=precision)
        shard, part, results, records = program.init_local(0, coords), program.batch_slice(
            BATCH, coords), [], []
        for step, (x, y) in enumerate(data, 1):
            result = program.train_step(core, comm, shard, x[part], y[part], step)
            shard = result.shard
            results.append(result)
            records.append(core.take_records())
        return shard, results, list(comm.calls), records

    return program, LocalMesh(sizes).run(device)


def max_diff(a, b):
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


@pytest.mark.parametrize("mesh", [{"data": 2, "expert": 4}, {"fsdp": 2, "expert": 2, "data": 2},
                                  {"expert": 8}], ids=["expert4-data2", "fsdp2-expert2-data2",
                                                       "expert8"])
def test_expert_parallel_training_ends_with_the_single_device_parameters(mesh):
    want, want_losses, want_loads = single()
    program, devices = sharded(tuple(mesh.items()))
    got = program.assemble(shard for shard, _, _, _ in devices)
    assert got.keys() == want.keys()
    assert max_diff(got, want) < FP32_ATOL
    losses = [program.global_loss(r.loss for r in step) for step in zip(*(d[1] for d in devices))]
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
    for step in range(STEPS):  # routing, dropping: each device's own sequences, added up
        for layer in range(MOE["layers"]):
            routed = np.sum([d[1][step].router_loads[layer].routed for d in devices], axis=0)
            kept = np.sum([d[1][step].router_loads[layer].kept for d in devices], axis=0)
            assert tuple(routed) == want_loads[step][layer].routed
            assert tuple(kept) == want_loads[step][layer].kept
    assert sum(want_loads[0][0].routed) > sum(want_loads[0][0].kept)  # some tokens dropped


def test_each_device_holds_its_experts_and_replicas_agree():
    program, devices = sharded((("data", 2), ("expert", 4)))
    by = {(d[0].coords.data, d[0].coords.expert): d[0] for d in devices}
    for e in range(4):  # data replicas of one expert position hold the same bits
        for key, value in by[(0, e)].params.items():
            np.testing.assert_array_equal(value, by[(1, e)].params[key], err_msg=key)
    c, f = MOE["embed_dim"], MOE["mlp_dim"]
    assert by[(0, 0)].params["block1/mlp/wi_0"].size == 2 * c * f   # 8 experts / 4
    assert by[(0, 0)].params["block1/mlp/router"].size == c * 8      # the router: every expert
    assert device_param_elements(program.model, 1, 1, 4) == sum(
        v.size for v in by[(0, 0)].params.values())


def test_the_all_to_all_bytes_of_a_step_equal_their_closed_form():
    """Per MoE block and device: dispatch and combine forward, their transposes
    backward, each the whole (E, b cap, C) buffer in the wire dtype (fp32: 4 bytes);
    the gradients of everything but the experts allreduced over expert."""
    mesh = {"data": 2, "expert": 4}
    program, devices = sharded(tuple(mesh.items()))
    calls = devices[0][2]
    per_step = len(calls) // STEPS
    step = calls[:per_step]
    a2a = [c for c in step if c.op == "all_to_all"]
    b = BATCH // (2 * 4)
    cap = expert_capacity(MOE["sequence_length"], 8, 2, 1.0)
    buffer = 8 * b * cap * MOE["embed_dim"] * 4
    assert [c.tag for c in a2a] == [
        "block1/mlp/dispatch fwd", "block1/mlp/combine fwd",
        "block2/mlp/dispatch fwd", "block2/mlp/combine fwd",
        "block2/mlp/combine_bwd bwd", "block2/mlp/dispatch_bwd bwd",
        "block1/mlp/combine_bwd bwd", "block1/mlp/dispatch_bwd bwd"]
    assert {(c.axis, c.kind, c.nbytes) for c in a2a} == {("expert", "activation", buffer)}
    assert sum(c.nbytes for c in a2a) == 4 * MOE["layers"] * buffer
    model = program.model
    total = model.num_params
    experts = MOE["layers"] * 8 * 3 * MOE["embed_dim"] * MOE["mlp_dim"]
    over_expert = sum(c.nbytes for c in step if c.axis == "expert" and c.op == "allreduce")
    over_data = sum(c.nbytes for c in step if c.axis == "data")
    assert over_expert == 4 * (total - experts)                        # replicated over expert
    assert over_data == 4 * (total - experts + experts // 4)           # each device's own


def test_a_timing_only_device_records_what_a_functional_one_does():
    """bf16, {expert: 4, data: 2}: a ShapeCollectives device with shapes only makes
    the records and the calls of device 0's step (the all-to-alls at 2 bytes)."""
    mesh = {"data": 2, "expert": 4}
    program, devices = sharded(tuple(mesh.items()), "bf16")
    core = TensorCore(SPEC, precision="bf16", execute=False)
    comm = ShapeCollectives(mesh, {})
    shard = program.shape_shard(DeviceCoords())
    x, y = batches()[0]
    part = program.batch_slice(BATCH, DeviceCoords())
    result = program.train_step(core, comm, shard, x[part], y[part], 1)
    assert core.take_records() == devices[0][3][0]
    first = devices[0][2][:len(devices[0][2]) // STEPS]
    assert comm.calls == first
    assert {c.nbytes % 2 for c in comm.calls if c.op == "all_to_all"} == {0}
    assert [load.routed for load in result.router_loads] == [(), ()]


def test_a_dense_model_on_an_expert_axis_is_data_parallel_over_it():
    want, _, _ = single(option_items=(("experts", 0),))
    program, devices = sharded((("expert", 2), ("fsdp", 2)), option_items=(("experts", 0),))
    assert max_diff(program.assemble(d[0] for d in devices), want) < FP32_ATOL
    assert {c.op for c in devices[0][2] if c.axis == "expert"} == {"allreduce"}


@pytest.mark.parametrize("sizes,options,message", [
    ({"expert": 3}, {}, "expert 3 does not divide the transformer's 8 experts; expert must "
                        "divide them: 1, 2, 4, 8"),
    ({"expert": 2, "tensor": 2}, {}, "tensor 2 with experts"),
    ({"expert": 2}, {"capacity_factor": 0.0}, "expert 2 with dropless routing"),
])
def test_meshes_the_moe_program_cannot_run_are_one_line_errors(sizes, options, message):
    cfg = TransformerConfig(**{**MOE, **options})
    with pytest.raises(ValueError, match=message):
        check_expert_split(cfg, sizes)
    with pytest.raises(ValueError, match=message):
        ShardedTransformer(TransformerModel(cfg), sizes, build_optimizer("sgd"))


def test_dropless_without_an_expert_axis_shards_over_data_and_fsdp():
    items = (("capacity_factor", 0.0),)
    want, _, _ = single(option_items=items)
    program, devices = sharded((("data", 2), ("fsdp", 2)), option_items=items)
    assert max_diff(program.assemble(d[0] for d in devices), want) < FP32_ATOL
    assert dataclasses.is_dataclass(devices[0][1][0].router_loads[0])


def test_load_local_is_the_inverse_of_assemble_with_experts():
    """A checkpoint's whole model shards back onto every device bit for bit (resume)."""
    program, devices = sharded((("fsdp", 2), ("expert", 2), ("data", 2)))
    shards = [d[0] for d in devices]
    params, state = program.assemble(shards), program.assemble(shards, opt_state=True)
    assert params["block1/mlp/wo"].shape == (8, MOE["mlp_dim"], MOE["embed_dim"])
    for shard in shards:
        again = program.load_local(params, state, shard.coords)
        for key, value in shard.params.items():
            np.testing.assert_array_equal(again.params[key], value, err_msg=key)
        for key, value in shard.opt_state.items():
            np.testing.assert_array_equal(again.opt_state[key], value, err_msg=key)
    with pytest.raises(ValueError, match=r"missing \(fsdp, tensor, expert\)"):
        program.assemble(s for s in shards if s.coords.expert == 0)

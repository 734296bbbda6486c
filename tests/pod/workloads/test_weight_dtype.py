"""``weight_dtype: bfloat16`` (MaxText's ``weight_dtype``): bf16 parameters, gradients and
optimizer state; the update in float32 rounded back; the bytes it changes (memory
figures, gradient reduce-scatters, the update's HBM traffic) and the ones it does not
(the FSDP gathers). No Ray."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from chip import TensorCore, get_chip_spec
from pod.config.slices import resolve_pod
from pod.programs import DeviceCoords, LocalMesh, ShapeCollectives, ShardedTransformer
from pod.workloads import TransformerConfig, TransformerModel, build_optimizer

pytestmark = pytest.mark.usefixtures("one_blas_thread")

SPEC = get_chip_spec("v4").core
BF16 = np.dtype(ml_dtypes.bfloat16)
TINY = {"vocabulary": 32, "sequence_length": 8, "embed_dim": 16, "heads": 4, "head_dim": 4,
        "mlp_dim": 32, "layers": 2}
LR, B1, B2, EPS, WD = 1e-2, 0.9, 0.95, 1e-8, 0.1


def _adamw():
    return build_optimizer("adamw", learning_rate=LR, beta1=B1, beta2=B2, eps=EPS,
                           weight_decay=WD)


def _bf16(a):
    return np.asarray(a, np.float32).astype(BF16)


def test_adamw_on_bf16_parameters_updates_in_float32_and_rounds_back():
    """Three steps of AdamW on bf16-stored arrays against numpy written here: every
    stored array (m, v, the parameter) is the float32 update of the stored bf16 values,
    rounded to nearest even; the float32 path of the same values differs (so the test
    can fail), and each op moves 2 bytes per element of its bf16 operands."""
    rng = np.random.default_rng(0)
    p0 = _bf16(rng.standard_normal(64))
    grads = [_bf16(rng.standard_normal(64) * 0.1) for _ in range(3)]
    core, opt = TensorCore(SPEC), _adamw()
    params = {"w": p0}
    state = opt.init(params)
    assert state["w/m"].dtype == state["w/v"].dtype == BF16
    p, m, v = p0.astype(np.float32), np.zeros(64, np.float32), np.zeros(64, np.float32)
    for step, g in enumerate(grads, 1):
        params, state = opt.update(core, {"w": g}, state, params, step)
        g32 = g.astype(np.float32)
        m = _bf16(np.float32(B1) * m + np.float32(1 - B1) * g32).astype(np.float32)
        v = _bf16(np.float32(B2) * v + np.float32(1 - B2) * g32 * g32).astype(np.float32)
        mhat, vhat = m * np.float32(1 / (1 - B1 ** step)), v * np.float32(1 / (1 - B2 ** step))
        p = _bf16(p - np.float32(LR) * (mhat / (np.sqrt(vhat) + np.float32(EPS))
                                        + np.float32(WD) * p)).astype(np.float32)
        assert params["w"].dtype == BF16
        np.testing.assert_array_equal(state["w/m"].astype(np.float32), m)
        np.testing.assert_array_equal(state["w/v"].astype(np.float32), v)
        np.testing.assert_array_equal(params["w"].astype(np.float32), p)
    # the float32 master path of the same start moves elsewhere (no bf16 rounding)
    p32, s32 = {"w": p0.astype(np.float32)}, opt.init({"w": p0.astype(np.float32)})
    for step, g in enumerate(grads, 1):
        p32, s32 = opt.update(core, {"w": g.astype(np.float32)}, s32, p32, step)
    assert not np.array_equal(p32["w"], p)
    records = {r.name: r.hbm_bytes for r in core.take_records()[:3]}
    # m: m and g in, m out; the parameter: p, m, v in, p out: 2 bytes each
    assert records == {"adamw/w/m": 3 * 2 * 64, "adamw/w/v": 3 * 2 * 64, "adamw/w": 4 * 2 * 64}


def test_a_bf16_model_is_stored_in_bf16_and_trains():
    """init_params stores bf16 (the float32 init rounded), the gradients come back in
    bf16, and AdamW on them lowers the loss of a repeated batch as the float32 model
    does."""
    losses = {}
    for wd in ("float32", "bfloat16"):
        model = TransformerModel(TransformerConfig(**TINY, weight_dtype=wd))
        core, opt = TensorCore(SPEC), _adamw()
        params = model.init_params(0)
        state = opt.init(params)
        rng = np.random.default_rng(3)
        x, y = rng.integers(0, 32, (4, 8)), rng.integers(0, 32, (4, 8))
        losses[wd] = []
        for step in range(1, 16):
            loss, grads = model.loss_and_grads(core, params, x, y)
            assert {g.dtype for g in grads.values()} == {model.storage_dtype}
            params, state = opt.update(core, grads, state, params, step)
            losses[wd].append(loss)
    f32 = TransformerModel(TransformerConfig(**TINY)).init_params(0)
    bf = TransformerModel(TransformerConfig(**TINY, weight_dtype="bfloat16")).init_params(0)
    assert all(bf[k].dtype == BF16 and np.array_equal(bf[k], f32[k].astype(BF16)) for k in f32)
    assert losses["bfloat16"][-1] < 0.6 * losses["bfloat16"][0]
    assert abs(losses["bfloat16"][-1] - losses["float32"][-1]) < 0.1 * losses["float32"][-1]


def _sharded_step(weight_dtype, mesh, steps=4):
    """Every device of a LocalMesh training ``steps`` steps: (program, {coords: (shard,
    losses, records of the last step, calls of the last step)})."""
    model = TransformerModel(TransformerConfig(**TINY, weight_dtype=weight_dtype))
    program = ShardedTransformer(model, mesh, _adamw())
    rng = np.random.default_rng(1)
    x, y = rng.integers(0, 32, (8, 8)), rng.integers(0, 32, (8, 8))

    def device(comm):
        coords, core = DeviceCoords.of(comm), TensorCore(SPEC)
        shard, part, losses = program.init_local(0, coords), program.batch_slice(8, coords), []
        for step in range(1, steps + 1):
            core.take_records()
            first = len(comm.calls)
            result = program.train_step(core, comm, shard, x[part], y[part], step)
            shard = result.shard
            losses.append(result.loss)
        return coords, (shard, losses, core.take_records(), comm.calls[first:])

    return program, dict(LocalMesh(program.sizes).run(device))


def test_a_sharded_bf16_run_trains_moves_bf16_gradients_and_times_as_it_runs():
    """{data: 2, fsdp: 2, tensor: 2}: bf16 shards after every step, the loss of a repeated
    batch falls; the gradient reduce-scatters and data allreduces move half the float32
    run's bytes while the parameter gathers move the same bf16 bytes; the optimizer's
    records read and write 2 bytes per element; a timing-only step records the same
    ops and issues the same calls."""
    mesh = {"data": 2, "fsdp": 2, "tensor": 2}
    program, devices = _sharded_step("bfloat16", mesh)
    _, f32 = _sharded_step("float32", mesh, steps=1)
    shard, losses, records, calls = devices[DeviceCoords()]
    assert {a.dtype for a in (*shard.params.values(), *shard.opt_state.values())} == {BF16}
    assert losses[-1] < losses[0]

    def wire(calls, kind):
        return sum(c.nbytes for c in calls if c.kind == kind)
    ref = f32[DeviceCoords()][3]
    assert wire(calls, "param_gather") == wire(ref, "param_gather") > 0
    assert 2 * wire(calls, "grad_reduce") == wire(ref, "grad_reduce") > 0
    update = next(r for r in records if r.name == "adamw/block1/mlp/wo")
    chunk = shard.params["block1/mlp/wo"].size
    assert update.hbm_bytes == 4 * 2 * chunk                      # p, m, v in; p out

    core = TensorCore(SPEC)
    core.execute = False
    comm = ShapeCollectives(program.sizes, {"data": 0, "fsdp": 0, "tensor": 0})
    x = np.zeros((2, 8), np.int64)
    program.train_step(core, comm, program.shape_shard(DeviceCoords()), x, x, 4)
    rows = [(r.name, r.seconds, r.flops, r.hbm_bytes) for r in core.take_records()]
    assert rows == [(r.name, r.seconds, r.flops, r.hbm_bytes) for r in records]
    assert [(c.op, c.nbytes, c.kind) for c in comm.calls] == [(c.op, c.nbytes, c.kind)
                                                              for c in calls]


def test_assembled_bf16_shards_are_the_whole_model_as_float32_values():
    """A checkpoint holds float32 arrays: assemble widens the bf16 chunks exactly, and
    load_local cuts them back into the same bf16 chunks."""
    program, devices = _sharded_step("bfloat16", {"fsdp": 2, "tensor": 2}, steps=2)
    shards = [d[0] for d in devices.values()]
    whole = program.assemble(shards)
    assert {a.dtype for a in whole.values()} == {np.dtype(np.float32)}
    again = program.load_local(whole, program.assemble(shards, opt_state=True), shards[0].coords)
    for key, a in shards[0].params.items():
        assert again.params[key].dtype == BF16
        np.testing.assert_array_equal(again.params[key].astype(np.float32),
                                      a.astype(np.float32))


def test_the_memory_plan_counts_two_bytes_per_parameter_gradient_and_slot():
    """On {fsdp: 8}: params, grads and AdamW's two slots at 2 bytes each (half the
    float32 masters' figures); the gathered weights stay bf16; the bf16 copy XLA keeps
    of float32 masters is not needed by bf16 weights."""
    options = {**TINY, "vocabulary": 256, "sequence_length": 64}
    memory = {}
    for wd in ("float32", "bfloat16"):
        model = TransformerModel(TransformerConfig(**options, weight_dtype=wd))
        memory[wd] = ShardedTransformer(model, {"fsdp": 8}, _adamw()).memory(1)
    f32, bf = memory["float32"], memory["bfloat16"]
    for item in ("parameters_bytes", "optimizer_state_bytes"):
        assert 2 * getattr(bf, item) == getattr(f32, item) > 0, item
    assert f32.gradients_bytes in (0, f32.parameters_bytes)           # 0 at the loss
    assert dict(f32.workspace)["gathered weights"] == dict(bf.workspace)["gathered weights"]
    assert dict(f32.workspace)["weights in compute dtype"] == f32.parameters_bytes // 2
    assert "weights in compute dtype" not in dict(bf.workspace)


def test_weight_dtype_is_checked_in_one_line():
    with pytest.raises(ValueError, match=r"^transformer: option weight_dtype must be one of "
                                         r"float32, bfloat16, got 'float16'$"):
        TransformerConfig(**TINY, weight_dtype="float16")

"""The optimizers' flat path (every parameter's op at once over one buffer) against their
per-parameter path, in the same run: the same parameter and state bits, the same op
records (the simulated clock's input), and the fallbacks where the flat path does not
apply (bf16 parameters, a timing-only core, a replay's ``each``)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from chip import TensorCore, get_chip_spec
from pod.programs import DeviceCoords, ReplicatedProgram, ShapeCollectives
from pod.workloads import build_model, build_optimizer, load_dataset
from pod.workloads.optimizers import Adam, flat_buffer
from pod.workloads.weights import BFLOAT16

#: every optimizer and option that changes its ops (SGD's momentum adds a slot and an op)
OPTIMIZERS = [("sgd", {"learning_rate": 0.1}), ("sgd", {"momentum": 0.9}), ("adam", {}),
              ("adamw", {"weight_decay": 0.01})]
#: shapes as a model's: kernels, biases, a one-element and a 0-size parameter
SHAPES = {"conv/kernel": (3, 3, 1, 4), "conv/bias": (4,), "dense/kernel": (36, 10),
          "dense/bias": (10,), "scale": (1,), "empty": (0, 3)}


def _core() -> TensorCore:
    return TensorCore(get_chip_spec("v5e").core)


def _arrays(rng: np.random.Generator, dtype=np.float32) -> dict[str, np.ndarray]:
    # gradients spanning many binades, so the updates round differently if any op differs
    return {k: (rng.standard_normal(s) * 10.0 ** rng.integers(-6, 3, s)).astype(dtype)
            for k, s in SHAPES.items()}


def _train(opt, flat: bool, steps: int = 5, dtype=np.float32):
    """``steps`` updates from the same parameters and gradients; (params, state, records
    of every step)."""
    rng = np.random.default_rng(7)
    params = _arrays(rng, dtype)
    state, core, records = opt.init(params), _core(), []
    for step in range(1, steps + 1):
        grads = _arrays(rng, dtype)
        params, state = opt.update(core, grads, state, params, step, flat=flat)
        records.append(core.take_records())
    return params, state, records


def _assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert a[k].tobytes() == b[k].tobytes(), k


@pytest.mark.parametrize("name, options", OPTIMIZERS)
def test_the_flat_update_has_the_per_parameter_bits_and_records(name, options):
    opt = build_optimizer(name, **options)
    flat, per_key = _train(opt, True), _train(opt, False)
    _assert_same(flat[0], per_key[0])
    _assert_same(flat[1], per_key[1])
    assert flat[2] == per_key[2]  # OpRecords: names, seconds, flops, bytes, bounds
    assert [r.name for r in flat[2][0]][:len(opt.slots) + 1] == (
        [f"{name}/conv/kernel/{s}" for s in opt.slots] + [f"{name}/conv/kernel"])


def test_the_update_returns_views_of_one_buffer_the_next_update_reads_without_a_copy():
    opt, core = Adam(), _core()
    rng = np.random.default_rng(3)
    params = _arrays(rng)
    state = opt.init(params)
    shapes = [params[k].shape for k in params]
    params, state = opt.update(core, _arrays(rng), state, params, 1)
    buffer = flat_buffer(list(params.values()), shapes)
    assert all(v.base is buffer for v in params.values())
    assert buffer.size == sum(int(np.prod(s)) for s in shapes)
    moments = [state[f"{k}/m"] for k in params]
    assert flat_buffer(moments, shapes) is moments[0].base
    # read-only inputs (Ray's object store hands out such views) are read, never written
    for v in (*params.values(), *state.values()):
        v.flags.writeable = False
    before = {k: v.copy() for k, v in params.items()}
    new, _ = opt.update(core, _arrays(rng), state, params, 2)
    _assert_same(params, before)
    assert all(new[k].flags.writeable for k in new)


def test_flat_buffer_copies_what_does_not_tile_one_buffer_in_order():
    base = np.arange(10, dtype=np.float32)
    views = [base[:4].reshape(2, 2), base[4:10]]
    shapes = [(2, 2), (6,)]
    assert flat_buffer(views, shapes) is base
    swapped = flat_buffer(views[::-1], shapes[::-1])
    assert swapped is not base and swapped.tolist() == [4, 5, 6, 7, 8, 9, 0, 1, 2, 3]
    assert flat_buffer([base[:4].reshape(2, 2), base[5:10]], [(2, 2), (5,)]) is not base  # a gap
    assert flat_buffer([base[:4].reshape(2, 2)], [(2, 2)]) is not base  # a part of it
    assert flat_buffer([base[::2]], [(5,)]).tolist() == [0, 2, 4, 6, 8]  # strided
    assert flat_buffer([base.astype(np.float64)], [(10,)]) is None
    assert flat_buffer([base], [(5, 2)]) is None


def test_bf16_parameters_and_timing_only_cores_take_the_per_parameter_path():
    opt = build_optimizer("adamw")
    flat, per_key = _train(opt, True, 3, BFLOAT16), _train(opt, False, 3, BFLOAT16)
    _assert_same(flat[0], per_key[0])
    assert all(v.dtype == BFLOAT16 for v in flat[0].values())
    assert flat[2] == per_key[2]
    params = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    timing = dataclasses.replace(get_chip_spec("v5e").core)
    cores = [TensorCore(timing), TensorCore(timing)]
    cores[0].execute = cores[1].execute = False
    for core, flat_path in zip(cores, (True, False), strict=True):
        opt.update(core, params, opt.init(params), params, 1, flat=flat_path)
    assert cores[0].records == cores[1].records


def test_a_replicated_step_with_either_path_gives_the_same_shard_and_records(one_blas_thread):
    """The quick start's model and Adam through ``ReplicatedProgram.train_step`` (the
    gradients come in as views of the reduced buffer, in bucket order)."""
    data = load_dataset("digits")
    model = build_model("cnn", data.example_shape, 10)

    class PerKeyAdam(Adam):
        def update(self, *args, **kwargs):
            return super().update(*args, **kwargs, flat=False)

    runs = []
    for opt in (Adam(), PerKeyAdam()):
        program = ReplicatedProgram(model, {"data": 1}, opt)
        core, comm = _core(), ShapeCollectives({"data": 1}, {"data": 0})
        shard, records = program.init_local(0, DeviceCoords()), []
        for step in range(1, 4):
            x, y = data.x_train[16 * step:16 * step + 16], data.y_train[16 * step:16 * step + 16]
            result = program.train_step(core, comm, shard, x, y, step,
                                        rng=np.random.default_rng(step))
            shard = result.shard
            records.append(core.take_records())
        runs.append((shard, records))
    (flat, flat_records), (per_key, per_key_records) = runs
    _assert_same(dict(flat.params), dict(per_key.params))
    _assert_same(dict(flat.opt_state), dict(per_key.opt_state))
    assert flat_records == per_key_records

"""The MoE's dense einsum dispatch (``sparse_matmul: false``, MaxText's ``dense_matmul`` with a
capacity factor, training-steps.md T8, and without one, dense dropless): the values of the
sparse path and of a per-token reference, finite differences, the five (tokens, experts x
capacity) products and their cost in closed form, timing-only records equal to executed
ones, expert parallelism equal to one device. No Ray."""

from __future__ import annotations

import numpy as np
import pytest

from chip import TensorCore, get_chip_spec
from pod.workloads import TransformerBlock, TransformerConfig
from pod.workloads.moe import MoE, expert_capacity
from tests.pod.workloads.test_moe import B, C, E, F, K, T, _params, _x, reference
from tests.pod.workloads.test_moe_sharded import FP32_ATOL, max_diff, sharded, single
from tests.pod.workloads.test_transformer import check_grads, small_params

pytestmark = pytest.mark.usefixtures("one_blas_thread")

SPEC = get_chip_spec("v5e").core


def _dense(cf=1.0, sparse=False):
    return MoE(E, K, F, "gated_silu", capacity_factor=cf, aux_loss_weight=0.5, name="moe",
               sparse_matmul=sparse)


def _step_records(layer, params):
    """One forward and backward's op records, executed; a timing-only pass records the
    same."""
    runs = []
    for execute in (True, False):
        core = TensorCore(SPEC, execute=execute)
        y, cache = layer.forward(core, params, _x(dtype=np.float32))
        layer.backward(core, params, cache, np.ones_like(y))
        runs.append(core.take_records())
    assert runs[0] == runs[1]
    return runs[0]


@pytest.mark.parametrize("cf", [1.0, 0.5, 2.0])
def test_the_dense_dispatch_computes_the_reference_and_the_sparse_path(cf):
    """float64, numerics off: the one-hot products select and sum exactly what the
    per-token loop and the gather / scatter path do, gradients included."""
    core = TensorCore(SPEC, numerics=False)
    params, x = _params(_dense(cf)), _x()
    y, cache = _dense(cf).forward(core, params, x)
    np.testing.assert_allclose(y, reference(_dense(cf), params, x)[0], rtol=1e-12, atol=1e-12)
    probe = np.random.default_rng(5).standard_normal(y.shape)
    dx, grads = _dense(cf).backward(core, params, cache, probe)
    ys, cs = _dense(cf, sparse=True).forward(core, params, x)
    dxs, gs = _dense(cf, sparse=True).backward(core, params, cs, probe)
    np.testing.assert_array_equal(y, ys)
    np.testing.assert_allclose(dx, dxs, rtol=1e-12, atol=1e-14)
    for key in grads:
        np.testing.assert_allclose(grads[key], gs[key], rtol=1e-12, atol=1e-14, err_msg=key)


@pytest.mark.slow
def test_a_moe_block_with_the_dense_dispatch_against_finite_differences(core64):
    x = np.random.default_rng(6).standard_normal((2, 4, 4))
    moe = {"experts": 3, "experts_per_token": 2, "capacity_factor": 1.0,
           "aux_loss_weight": 0.0, "sparse_matmul": False}
    block = TransformerBlock(2, 2, 3, moe=moe, remat="full", name="block")
    params = small_params(block, x.shape[1:], scale=1.5)
    params["mlp/router"] = np.random.default_rng(7).standard_normal((4, 3)) * 2.0
    check_grads(core64, block, x, params)


def test_five_products_of_two_t_e_cap_c_flops_per_sequence_and_the_masks_traffic():
    """Forward: the dispatch (E cap, T) x (T, C) and the combine (T, E cap) x (E cap, C);
    backward: the combine's two operand gradients and the dispatch's input gradient.
    The masks: one VPU op writing two (T, E cap) bf16 masks per sequence. A timing-only
    pass records the same ops."""
    layer = _dense(1.25)
    cap = expert_capacity(T, E, K, 1.25)
    params = {k: v.astype(np.float32) for k, v in _params(layer).items()}
    by = {r.name: r for r in _step_records(layer, params)}
    each = 2 * B * T * E * cap * C
    products = ("moe/dispatch", "moe/combine", "moe/combine_bwd", "moe/combine_bwd/d_mask",
                "moe/dispatch_bwd")
    assert {by[n].unit for n in products} == {"mxu"}
    assert [by[n].flops for n in products] == [each] * 5
    assert layer.dispatch_flops((T, C)) * B == 5 * each
    assert by["moe/masks"].unit == "vpu" and by["moe/masks"].hbm_bytes == 2 * 2 * B * T * E * cap
    # the sparse path gathers on the VPU instead
    sparse = _dense(1.25, sparse=True)
    core = TensorCore(SPEC)
    sparse.forward(core, params, _x(dtype=np.float32))
    assert {r.name: r.unit for r in core.records}["moe/dispatch"] == "vpu"


def test_the_block_counts_the_products_as_hardware_flops_not_model_flops():
    kw = {"experts": 8, "experts_per_token": 2, "capacity_factor": 1.25}
    dense = TransformerBlock(2, 4, 16, moe={**kw, "sparse_matmul": False}, name="b")
    sparse = TransformerBlock(2, 4, 16, moe=kw, name="b")
    shape = (40, 8)
    assert dense.forward_flops(shape) == sparse.forward_flops(shape)
    cap = expert_capacity(40, 8, 2, 1.25)
    assert dense.hardware_flops(shape) - sparse.hardware_flops(shape) == 5 * 2 * 40 * 8 * cap * 8


def test_bf16_dense_dispatch_is_close_to_float64():
    layer = _dense(1.0)
    p64, x64 = _params(layer), _x()
    y64, _ = layer.forward(TensorCore(SPEC, numerics=False), p64, x64)
    y16, _ = layer.forward(TensorCore(SPEC), {k: v.astype(np.float32) for k, v in p64.items()},
                           x64.astype(np.float32))
    assert np.max(np.abs(y16 - y64)) < 0.05 * np.max(np.abs(y64))


@pytest.mark.slow
@pytest.mark.parametrize("options", [(("sparse_matmul", False),),
                                     (("capacity_factor", 0.0), ("sparse_matmul", False))],
                         ids=["capacity", "dropless"])
@pytest.mark.parametrize("mesh", [{"data": 2, "expert": 4}, {"fsdp": 2, "expert": 2, "data": 2}])
def test_expert_parallel_dense_training_equals_one_device(mesh, options):
    want, want_losses, _ = single(option_items=options)
    program, devices = sharded(tuple(mesh.items()), option_items=options)
    assert max_diff(program.assemble(d[0] for d in devices), want) < FP32_ATOL
    steps = zip(*(d[1] for d in devices), strict=True)
    losses = [program.global_loss(r.loss for r in step) for step in steps]
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6)


def test_dense_dropless_computes_the_sparse_dropless_values():
    """Dense dropless (sparse_matmul false, cf 0; MaxText's dense_matmul without a
    capacity): every expert computes every token and the combine weighs the k chosen by
    their gates, so its values are the sparse dropless path's (float64, numerics off)."""
    core = TensorCore(SPEC, numerics=False)
    dense, sparse = _dense(0.0), _dense(0.0, sparse=True)
    assert dense.dense_dropless and not sparse.dense_dropless
    params, x = _params(dense), _x()
    y, cache = dense.forward(core, params, x)
    ys, cs = sparse.forward(core, params, x)
    np.testing.assert_allclose(y, ys, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(y, reference(dense, params, x)[0], rtol=1e-12, atol=1e-12)
    probe = np.random.default_rng(8).standard_normal(y.shape)
    dx, grads = dense.backward(core, params, cache, probe)
    dxs, gs = sparse.backward(core, params, cs, probe)
    np.testing.assert_allclose(dx, dxs, rtol=1e-12, atol=1e-13)
    for key in grads:
        np.testing.assert_allclose(grads[key], gs[key], rtol=1e-12, atol=1e-13, err_msg=key)


def test_dense_dropless_runs_every_expert_on_every_token_without_masks():
    """Its expert products cover E x B x T rows (E / k times the sparse path's T k per
    sequence), no masks and no dispatch product; the combine and its gradients read every
    expert's row of a token (VPU). Timing-only records equal the executed ones."""
    layer = _dense(0.0)
    params = {k: v.astype(np.float32) for k, v in _params(layer).items()}
    by = {r.name: r for r in _step_records(layer, params)}
    assert "moe/masks" not in by and "moe/dispatch" not in by
    assert by["moe/wi_0"].flops == 2 * E * B * T * C * F
    assert by["moe/combine"].unit == by["moe/combine_bwd"].unit == "vpu"
    assert layer.slots(T) == E * T and layer.mask_elements(T) == 0
    assert layer.dispatch_flops((T, C)) == 0
    assert layer.input_flops((T, C)) * B == by["moe/wi_0"].flops
    assert _dense(0.0, sparse=True).input_flops((T, C)) * E == layer.input_flops((T, C)) * K


def test_dense_dropless_splits_over_an_expert_axis_where_sparse_dropless_does_not():
    from pod.workloads.transformer import check_expert_split

    options = {"vocabulary": 8, "sequence_length": 8, "experts": 4, "experts_per_token": 2}
    check_expert_split(TransformerConfig(**options, sparse_matmul=False), {"expert": 2})
    with pytest.raises(ValueError, match="ragged"):
        check_expert_split(TransformerConfig(**options), {"expert": 2})

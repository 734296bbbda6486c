"""Fusion (issue 23, item 4): the transformer's elementwise ops fused into the matmul
that produces or consumes them (pod/workloads/fusion.py has the rule), or, with
``fusion: false``, each its own op with its HBM round trip. No Ray."""

from __future__ import annotations

import numpy as np
import pytest

from chip import TensorCore, get_chip_spec
from pod.workloads import build_model, build_optimizer

pytestmark = pytest.mark.usefixtures("one_blas_thread")

SPEC = get_chip_spec("v5e").core
SMALL = {"embed_dim": 32, "heads": 4, "head_dim": 8, "mlp_dim": 64, "layers": 2}


def step_records(execute=True, **options):
    model = build_model("transformer", (16,), 40, **{**SMALL, **options})
    core = TensorCore(SPEC, execute=execute)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 40, (4, 16)), rng.integers(0, 40, (4, 16))
    params = model.init_params(0)
    loss, grads = model.loss_and_grads(core, params, x, y)
    opt = build_optimizer("adamw")
    opt.update(core, grads, opt.init(params), params, 1)
    return loss, grads, core.take_records()


def hosts(records):
    return {r.name: r.fused_into for r in records}


@pytest.mark.parametrize("block", ["sequential", "parallel"])
def test_the_rule_fuses_each_elementwise_op_into_its_matmul(block):
    _, _, records = step_records(block=block)
    got = hosts(records)
    n1 = "norm1" if block == "sequential" else "norm"
    want = {
        f"block1/{n1}/rsqrt": "block1/attention/query",                     # prologue
        f"block1/{n1}/normalize": "block1/attention/query",
        "block1/attention/rope_q": "block1/attention/query",               # epilogues
        "block1/attention/rope_k": "block1/attention/key",
        "block1/attention/flash_fwd/exp": "block1/attention/flash_fwd",    # the kernel's own
        "block1/mlp/gated_silu": "block1/mlp/wi_1",
        "block1/mlp/gated_silu_bwd": "block1/mlp/d_hidden",
        "block1/mlp/dx_sum": "block1/mlp/dx_wi_1",
        "block1/attention/rope_q_bwd": "block1/attention/d_query",         # prologue of dW
        "block1/attention/dx_sum": "block1/attention/dx_value",
        "final_norm/normalize": "unembed/fwd",
        "final_norm/dx": "block2/mlp/d_wo",
        f"block2/{n1}/dx": "block1/mlp/d_wo",                               # next in backward
    }
    if block == "sequential":
        want.update({"block1/residual1": "block1/mlp/wi_0", "block1/norm2/normalize": "block1/mlp/wi_0",
                     "block1/residual2": "block2/attention/query", "block2/residual2": "unembed/fwd",
                     "block2/residual2_bwd": "block2/attention/d_out"})
    else:
        want.update({"block1/parallel_sum": "block1/mlp/wo", "block1/residual": "block2/attention/query",
                     "block2/parallel_dx_sum": "block2/attention/dx_value"})
    assert {k: got[k] for k in want} == want
    unfused = [n for n in got if n.startswith(("embed/", "xent/", "adamw/")) or n.endswith(
        ("/d_scale", "tied_grad_sum", "flash_bwd/di"))]
    assert unfused and all(got[n] == "" for n in unfused)
    for r in records:
        if r.fused_into:
            assert r.unit == "vpu" and r.hbm_bytes == 0 and 0 <= r.seconds <= r.compute_seconds


def test_fusion_changes_costs_not_numbers():
    """Fused or not: the same loss and gradients bit for bit, the same matmuls; the
    elementwise ops' HBM traffic gone and the step shorter."""
    loss, grads, fused = step_records()
    loss0, grads0, unfused = step_records(fusion=False)
    assert loss == loss0 and all(np.array_equal(grads[k], grads0[k]) for k in grads)
    assert [r for r in fused if r.unit == "mxu"] == [r for r in unfused if r.unit == "mxu"]
    assert sorted(r.name for r in fused) == sorted(r.name for r in unfused)
    assert {r.fused_into for r in unfused} == {"", "block1/attention/flash_fwd",
                                               "block1/attention/flash_bwd_dkv",
                                               "block1/attention/flash_bwd_dq",
                                               "block2/attention/flash_fwd",
                                               "block2/attention/flash_bwd_dkv",
                                               "block2/attention/flash_bwd_dq"}
    block_vpu_bytes = [sum(r.hbm_bytes for r in recs if r.unit == "vpu" and r.name.startswith("block"))
                       for recs in (fused, unfused)]                       # left: d_scale, di
    assert block_vpu_bytes[0] < block_vpu_bytes[1] / 4
    assert sum(r.seconds for r in fused) < sum(r.seconds for r in unfused)
    assert (sum(r.compute_seconds for r in fused if r.unit == "vpu")
            == pytest.approx(sum(r.cycles for r in fused if r.unit == "vpu") / SPEC.clock_hz))


@pytest.mark.parametrize("options", [{"remat": "full"}, {"remat": "minimal", "use_bias": True,
                                                         "attention": "dot_product"}])
def test_recomputed_ops_fuse_too_and_timing_only_records_the_same(options):
    """Remat's recomputation fuses like forward (a RoPE recomputed from a kept
    projection fuses into the next product, or with flash is an op of its own);
    a timing-only core records the same."""
    _, _, executed = step_records(**options)
    _, _, timed = step_records(execute=False, **options)
    assert executed == timed
    names = [r.name for r in executed]
    assert names.count("block1/attention/rope_q") == 2                   # forward, recomputation

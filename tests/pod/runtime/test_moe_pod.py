"""A mixture-of-experts transformer through the pod (issue 24, item 3): the in-process
LocalPod on {data: 2, expert: 4}, the timing-only pod record for record against it,
the router's load from StepResult to summary.json, steps.csv and Prometheus, and
Mixtral 8x7B's shapes costed timing-only on a v5p-128. No Ray."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pod.config.plan import build_plan
from pod.config.scenario import load_scenario, parse_scenario
from pod.report.files import summarize
from pod.report.metrics import PodMetrics
from pod.runtime.local import LocalPod
from pod.runtime.timing import TimingPod
from pod.workloads.moe import expert_capacity

pytestmark = pytest.mark.usefixtures("one_blas_thread")

ROOT = Path(__file__).resolve().parents[3]
MOE = {"embed_dim": 16, "heads": 2, "head_dim": 8, "mlp_dim": 16, "layers": 2, "experts": 8,
       "experts_per_token": 2, "capacity_factor": 1.0}
T, BATCH = 8, 16


def scenario(mesh, **options):
    return parse_scenario({
        "name": "moe-pod-test",
        "pod": {"slice": "v5e-8", "mesh": mesh},
        "model": {"name": "transformer", "options": {**MOE, **options}},
        "data": {"name": "synthetic_text",
                 "options": {"vocabulary": 32, "sequence_length": T, "num_examples": 64}},
        "training": {"global_batch": BATCH, "steps": 2,
                     "optimizer": {"name": "adamw", "learning_rate": 0.01}},
        "metrics": {"port": 0},
    })


@pytest.fixture(scope="module")
def run():
    """Two functional steps of {data: 2, expert: 4}: (plan, pod, stats)."""
    plan = build_plan(scenario({"data": 2, "expert": 4}))
    pod = LocalPod(plan)
    pod.start()
    stats = [pod.step(s) for s in range(2)]
    return plan, pod, stats


def test_a_step_routes_every_token_and_keeps_the_replicas_identical(run):
    plan, pod, stats = run
    load = stats[-1].expert_load
    assert load is not None and len(load.routed) == 2 and len(load.routed[0]) == 8
    assert all(sum(r) == BATCH * T * 2 for r in load.routed)          # every token's 2 choices
    cap = expert_capacity(T, 8, 2, 1.0)
    assert all(k <= BATCH * cap for layer in load.kept for k in layer)  # capacity per sequence
    assert pod.replicas_identical()
    params = pod.checkpoint_state()["params"]
    assert params["block1/mlp/wi_0"].shape == (8, 16, 16)
    assert np.isfinite(stats[-1].loss)


def test_the_expert_axis_bytes_of_a_step_equal_their_closed_form(run):
    """Per device: 4 all-to-alls per MoE block of the (E, b cap, C) buffer in bf16 (2
    bytes), and the float32 gradients of everything but the experts allreduced."""
    plan, _, stats = run
    b = BATCH // 8
    cap = expert_capacity(T, 8, 2, 1.0)
    a2a = 4 * MOE["layers"] * 8 * b * cap * MOE["embed_dim"] * 2
    experts = MOE["layers"] * 8 * 3 * MOE["embed_dim"] * MOE["mlp_dim"]
    replicated = 4 * (plan.model.num_params - experts)
    assert stats[-1].axis_collective_bytes["expert"] == a2a + replicated
    assert stats[-1].axis_collective_bytes["data"] == 4 * (plan.model.num_params - experts
                                                          + experts // 4)


def test_a_timing_only_step_equals_the_functional_one_record_for_record(run):
    plan, pod, stats = run
    timing = TimingPod(plan)
    figures = timing.step(1)
    want = pod.last_reports[0]
    assert timing.last_report.record_seconds == want.record_seconds
    assert timing.last_report.calls == want.calls
    assert figures.step_seconds == pytest.approx(stats[-1].step_seconds, rel=1e-12)
    assert figures.axis_collective_bytes == stats[-1].axis_collective_bytes
    assert figures.expert_load is None                                 # nothing routed


def test_the_router_load_reaches_the_summary_the_csv_row_and_prometheus(run):
    plan, _, stats = run
    moe = summarize(plan, stats, None, True, 1.0, 1.0)["moe"]
    tokens = [sum(layer[e] for layer in s.expert_load.routed) for s in stats for e in range(8)]
    assert moe["experts"] == 8 and moe["experts_per_token"] == 2 and moe["steps_routed"] == 2
    assert moe["tokens_per_expert_per_step"] == pytest.approx(
        [(tokens[e] + tokens[8 + e]) / 2 for e in range(8)])
    assert sum(moe["tokens_per_expert_per_step"]) == 2 * BATCH * T * 2  # two layers
    assert 0 <= moe["dropped_fraction"] < 1 and moe["load_max_over_mean"] >= 1
    row = stats[-1].row()
    assert row["expert_load_max_over_mean"] == stats[-1].expert_load.max_over_mean
    assert row["expert_dropped_fraction"] == stats[-1].expert_load.dropped_fraction
    assert "expert_load" not in row
    metrics = PodMetrics(scenario="t", generation="v5e", slice_name="v5e-8", topology="2x4")
    metrics.observe(stats[-1])
    got = [metrics.registry.get_sample_value("tpu_pod_expert_routed_tokens", {"expert": str(e)})
           for e in range(8)]
    assert got == list(stats[-1].expert_load.tokens_per_expert)
    assert metrics.registry.get_sample_value("tpu_pod_expert_dropped_ratio") == \
        stats[-1].expert_load.dropped_fraction
    assert "expert" in summarize(plan, stats, None, True, 1.0, 1.0)["collectives_by_axis"]


def test_a_dense_model_has_no_moe_figures():
    plan = build_plan(scenario({"data": 8}, experts=0))
    stats = TimingPod(plan).step(0)
    assert stats.expert_load is None and "expert_load_max_over_mean" not in stats.row()
    assert "moe" not in summarize(plan, [stats], None, None, 1.0, 1.0)


@pytest.mark.parametrize("mesh,options,message", [
    ({"data": 2, "expert": 4}, {"experts": 6}, "pod.mesh: {data: 2, expert: 4}: expert 4 does "
                                               "not divide the transformer's 6 experts"),
    ({"expert": 4, "tensor": 2}, {}, "pod.mesh: {expert: 4, tensor: 2}: tensor 2 with experts"),
    ({"expert": 8}, {"capacity_factor": 0}, "expert 8 with dropless routing"),
])
def test_meshes_that_do_not_fit_the_experts_are_one_line_errors(mesh, options, message):
    from pod.errors import ScenarioError
    with pytest.raises(ScenarioError, match=message.replace("{", r"\{").replace("}", r"\}")):
        build_plan(scenario(mesh, **options))


def test_mixtral_8x7b_costs_a_step_on_a_v5p_128_from_its_active_parameters():
    """Timing-only, {fsdp: 8, expert: 8}: the step finishes, fits HBM, and its model
    FLOPs are 6 N T per token with N the 12.9B active parameters' matmul weights (k
    = 2 experts of 8), not the 46.7B."""
    plan = build_plan(load_scenario(ROOT / "scenarios/mixtral-8x7b-v5p-128.yaml"),
                      timing_only=True)
    cfg = plan.model.config
    assert cfg.param_count() == pytest.approx(46.7e9, abs=0.05e9)
    assert cfg.param_count(active=True) == pytest.approx(12.9e9, abs=0.05e9)
    stats = TimingPod(plan).step(0)
    t, n_active = cfg.sequence_length, cfg.matmul_param_count()
    per_example = 6 * n_active * t + 12 * cfg.layers * t * t * cfg.inner_dim
    assert stats.model_flops == plan.global_batch * per_example
    assert n_active == pytest.approx(12.75e9, abs=0.01e9)             # less norms and table
    assert stats.hardware_flops > stats.model_flops                     # remat, capacity padding
    assert 1.0 < stats.step_seconds < 30.0 and 0.1 < stats.mfu < 0.7
    assert stats.axis_collective_bytes["expert"] > 0 and plan.memory["total"] < 95e9
    # FSDP's workspace: two weight arrays gathered, the largest a block's one expert of 8
    # (bf16, 4096 x 14336: the one in use and the one prefetched), not the 8 experts; the
    # dispatch and combine buffers of the expert axis; the backward working set
    workspace = dict(plan.device_memory.workspace)
    assert workspace["gathered weights"] == 2 * 4096 * 14336 * 2
    assert workspace["all-to-all buffers"] > 0 and workspace["layer working set"] > 0


def test_the_sharding_table_says_where_the_experts_live():
    from rich.console import Console

    from pod.report.model_summary import plan_sharding_table

    console = Console(width=200, record=True)
    console.print(plan_sharding_table(build_plan(scenario({"data": 2, "expert": 4}))))
    rows = [line for line in console.export_text().splitlines() if "mlp/" in line]
    assert len(rows) == 4 and "replicated" in rows[0]                  # the router
    assert all("experts: dim 0 over expert" in r and "(8, 16, 16)" in r and "(2, 16, 16)" in r
               for r in rows[1:])                                      # 8 experts, 2 a device

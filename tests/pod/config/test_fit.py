"""The one place that decides fit (``pod.config.fit``): the prefetch depth that fits, the
refusal's one line, the remat policy and the mesh it suggests, checked with memory
figures in closed form (a ``MemoryOf`` written here) so each rule is seen alone."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pod.config.fit import fit_memory, fitting_memory, split_evenly
from pod.config.mesh import build_mesh, device_hbm_bytes
from pod.config.plan import build_plan
from pod.config.scenario import parse_scenario
from pod.config.slices import resolve_pod
from pod.errors import HBMPlanError, ScenarioError
from pod.memory import DeviceMemory
from pod.programs import ReplicatedProgram
from pod.workloads import build_optimizer

GIB = 2**30


def closed_form(params: int, activation_bytes_per_example: int, layer_params: int,
                allowed=lambda sizes: True):
    """A ``MemoryOf`` in closed form: 16 bytes a parameter over fsdp x tensor (float32
    parameters, gradients, two AdamW slots), the activations over tensor, and with fsdp
    the gathered layer plus ``prefetch`` more in bf16 (2 bytes a parameter over tensor)."""
    def of(sizes, batch, prefetch):
        if not allowed(sizes):
            return None
        f, t = sizes.get("fsdp", 1), sizes.get("tensor", 1)
        local = math.ceil(params / (f * t))
        k = (1 if prefetch is None else prefetch) if f > 1 else 0
        layer = 2 * math.ceil(layer_params / t) if f > 1 else 0
        return DeviceMemory(4 * local, 4 * local, 8 * local,
                            math.ceil(batch * activation_bytes_per_example / t),
                            workspace=(("gathered layers", (1 + k) * layer),),
                            prefetch_layers=k, prefetch_layer_bytes=layer, peak="backward")
    return of


def v5e(axes, chips=16):
    return build_mesh(axes, resolve_pod(chip="v5e", chips=chips))


def test_a_plan_that_fits_keeps_the_programs_prefetch():
    mesh = v5e({"data": 2, "fsdp": 8})
    memory = fit_memory(closed_form(10**9, 10**6, 10**8), mesh, 4, 16 * GIB)
    assert memory.prefetch_layers == 1
    assert memory.total_bytes == 16 * 10**9 // 8 + 4 * 10**6 + 2 * 2 * 10**8


def test_a_tight_plan_prefetches_fewer_layers_down_to_none():
    """The prefetched layer is what does not fit: the plan drops it (issue 29 item 3)
    and keeps the depth that fits; one byte less HBM and nothing fits."""
    of, mesh = closed_form(10**9, 10**6, 10**8), v5e({"data": 2, "fsdp": 8})
    ahead = of(mesh.sizes, 4, 1)
    without = ahead.total_bytes - ahead.prefetch_layer_bytes
    memory, fits = fitting_memory(of, mesh.sizes, 4, without)
    assert fits and memory.prefetch_layers == 0 and memory.total_bytes == without
    assert fit_memory(of, mesh, 4, ahead.total_bytes).prefetch_layers == 1
    with pytest.raises(HBMPlanError):
        fit_memory(of, mesh, 4, without - 1)


def test_an_overflow_names_the_least_sharded_mesh_that_fits():
    """{data: 16} holds all 1.5e9 parameters (22.4 GiB) and does not fit 16 GiB; the least
    sharded mesh of the same devices that fits is {data: 8, fsdp: 2} (11.2 GiB, 61 MiB of
    activations for 64 examples, two gathered layers of 1e8 bf16 weights)."""
    mesh = v5e({"data": 16})
    with pytest.raises(HBMPlanError) as err:
        fit_memory(closed_form(1_500_000_000, 1_000_000, 100_000_000), mesh, 32, 16 * GIB)
    assert str(err.value) == (
        "pod.mesh: {data: 16} needs 22.4 GiB per device (params 5.6 GiB, grads 5.6 GiB, "
        "optimizer state 11.2 GiB, activations 30.5 MiB, workspace 0 MiB) and does not fit "
        "16 GiB; {data: 8, fsdp: 2} fits (11.6 GiB per device)")
    assert err.value.memory_plan["total"] == 16 * 1_500_000_000 + 32_000_000
    assert "\n" not in str(err.value)


def test_nothing_fits_says_so_and_a_layout_the_program_refuses_is_never_suggested():
    mesh = v5e({"data": 16})
    with pytest.raises(HBMPlanError, match="; no mesh of 16 devices fits; use a smaller model"):
        fit_memory(closed_form(10**11, 1, 10), mesh, 1, 16 * GIB)
    no_tensor = closed_form(1_500_000_000, 1_000_000, 10**8,
                            allowed=lambda sizes: sizes.get("tensor", 1) == 1)
    with pytest.raises(HBMPlanError) as err:
        fit_memory(no_tensor, mesh, 32, 5 * GIB)
    assert "tensor" not in str(err.value).split(" and does not fit ")[1]


def test_a_refusal_names_the_remat_policy_that_fits_first():
    """Another version of the model (a remat policy) that fits this mesh is named before
    any other mesh: the least recomputation first, as the caller ranks them."""
    mesh = v5e({"fsdp": 16})
    heavy = closed_form(10**9, 10**9, 10**7)
    light, lighter = closed_form(10**9, 3 * 10**8, 10**7), closed_form(10**9, 10**7, 10**7)
    with pytest.raises(HBMPlanError) as err:
        fit_memory(heavy, mesh, 16, 4 * GIB, search=False,
                   alternatives=[("remat minimal", light), ("remat full", lighter)])
    assert str(err.value).endswith("; remat full fits (1.1 GiB per device)")


def test_a_pipeline_refusal_gives_its_advice():
    mesh = v5e({"stage": 2, "fsdp": 8})
    with pytest.raises(HBMPlanError) as err:
        fit_memory(closed_form(10**11, 1, 10), mesh, 1, 16 * GIB, search=False,
                   subject="{stage: 2, fsdp: 8} with 2 microbatches (gpipe)",
                   advice="use more stages")
    assert str(err.value).startswith("pod.mesh: {stage: 2, fsdp: 8} with 2 microbatches "
                                     "(gpipe) needs ")
    assert str(err.value).endswith("; use more stages")


def test_split_evenly_spreads_the_state_over_the_shards_and_the_rest_over_tensor():
    whole = DeviceMemory(1001, 1001, 2002, 33, 7, (("MXU weight copies", 10),))
    split = split_evenly(whole, fsdp=2, tensor=2)
    assert (split.parameters_bytes, split.gradients_bytes, split.optimizer_state_bytes) == (
        251, 251, 501)
    assert (split.activations_bytes, split.host_activations_bytes) == (17, 4)
    assert split.workspace == (("MXU weight copies", 5),)


# ------------------------------------------------------------------ build_plan


BASE = {"name": "t", "pod": {"slice": "v2-8"},
        "model": {"name": "mlp", "options": {"hidden": [64], "dropout": False}},
        "data": {"name": "digits"}, "training": {"global_batch": 64, "steps": 2}}


def _plan(mesh=None, model=None, sharded_ok=True):
    pod = {"slice": "v2-8", **({"mesh": mesh} if mesh is not None else {})}
    return build_plan(parse_scenario({**BASE, "pod": pod, **({"model": model} if model else {})}),
                      sharded_ok=sharded_ok)


def test_a_replicated_model_on_a_sharded_mesh_is_refused_before_its_hbm_plan():
    """Only the transformer's program shards: validate and run refuse an MLP on an fsdp /
    tensor mesh (one line naming pod.mesh and the {data: N} to use), even one whose
    HBM plan would overflow too (the mesh is the first thing to fix); describe
    (sharded_ok) plans it."""
    with pytest.raises(ScenarioError, match=r"^pod\.mesh: \{data: 2, fsdp: 2, tensor: 2\} shards "
                                            r"over fsdp and tensor, .* use \{data: 8\}"):
        _plan({"data": 2, "fsdp": 2, "tensor": 2}, sharded_ok=False)
    big = {"name": "mlp", "options": {"hidden": [30000, 30000]}}
    with pytest.raises(ScenarioError, match=r"^pod\.mesh: \{data: 4, fsdp: 2\} shards"):
        _plan({"data": 4, "fsdp": 2}, big, sharded_ok=False)
    assert _plan({"data": 8}, sharded_ok=False).mesh.axis_names == ("data",)
    assert _plan({"data": 2, "fsdp": 2, "tensor": 2}).mesh.sizes == {"data": 2, "fsdp": 2,
                                                                     "tensor": 2}


def test_todays_scenarios_keep_their_data_parallel_plan():
    plain, data = _plan(), _plan({"data": -1})
    assert plain.mesh == data.mesh and plain.mesh.sizes == {"data": 8}
    assert plain.memory == data.memory
    np.testing.assert_array_equal(plain.mesh.devices, np.arange(8))


def test_a_sharded_mesh_checks_one_devices_sharded_plan():
    """describe plans an MLP on a mesh its program cannot run: the replicated program's
    memory on {data: 8}, spread evenly over fsdp x tensor (``split_evenly``)."""
    plan = _plan({"data": 2, "fsdp": 2, "tensor": 2})
    whole = ReplicatedProgram(plan.model, {"data": 8}, build_optimizer("adam")).memory(16)
    assert plan.device_memory == split_evenly(whole, 2, 2)
    assert plan.memory["params"] == math.ceil(4 * plan.num_params / 4)
    # 16 examples per device, bf16 activations (2 of float32's 4 bytes), split over tensor 2
    assert plan.memory["activations"] == math.ceil(16 * plan.model.activation_bytes(1) / 2 / 2)
    replicated = _plan({"data": 8}).memory                              # the same model unsharded
    assert replicated["params"] == 4 * plan.num_params
    assert replicated["activations"] == plan.model.activation_bytes(64 // 8) // 2  # bf16
    assert plan.memory["total"] < replicated["total"]


def _text_plan(mesh, options):
    return build_plan(parse_scenario({
        "name": "t", "pod": {"slice": "v2-8", "mesh": mesh},
        "model": {"name": "transformer", "options": options},
        "data": {"name": "text", "options": {"sequence_length": 64}},
        "training": {"global_batch": 64, "steps": 1}}))


def test_a_sharded_model_too_big_names_the_field_and_a_mesh_that_fits():
    options = {"embed_dim": 4096, "heads": 32, "head_dim": 128, "mlp_dim": 16384, "layers": 4}
    with pytest.raises(HBMPlanError) as err:
        _text_plan({"data": 4, "fsdp": 2}, options)
    # 1.07e9 parameters: 16 B x P / 2 = 8 GiB on fsdp 2 before the workspace (the bf16 copy
    # of the device's weights, 1 GiB; the gathered MLP array, 4096 x 16384 bf16 weights,
    # 128 MiB: a plan that does not fit is shown without prefetch); fsdp 4 halves the state
    assert str(err.value) == (
        "pod.mesh: {data: 4, fsdp: 2} needs 9.5 GiB per device (params 2 GiB, grads 2 GiB, "
        "optimizer state 4 GiB, activations 328.3 MiB, workspace 1.2 GiB) and does not fit "
        "8 GiB; {data: 2, fsdp: 4} fits (5.1 GiB per device)")
    assert _text_plan({"data": 2, "fsdp": 4}, options).memory["total"] < 8 * GIB


def test_a_replicated_model_too_big_names_the_model_and_no_mesh():
    """An MLP cannot shard: its overflow names model.options, the mesh's need per device,
    and no other mesh (more devices or sharding would not help it)."""
    big = {"name": "mlp", "options": {"hidden": [30000, 30000]}}
    with pytest.raises(HBMPlanError) as err:
        _plan({"data": 8}, big)
    # 16 B x P = 13.4 GiB, plus the MXU's bf16 copy of two of the largest layer,
    # 2 x (30000^2 + 30000) x 2 B = 3.4 GiB
    assert str(err.value) == (
        "model.options: mlp with 902,280,010 parameters on {data: 8} needs 16.8 GiB per device "
        "(params 3.4 GiB, grads 3.4 GiB, optimizer state 6.7 GiB, activations 1.8 MiB, workspace "
        "3.4 GiB) and does not fit 8 GiB; use a smaller model or a chip with more HBM per device")
    assert err.value.memory_plan["workspace"] == 2 * (30000**2 + 30000) * 2


def test_activations_that_overflow_name_the_global_batch():
    """A replicated LSTM whose float32 activations (16.9 MB per example of 512 tokens)
    fill the HBM: the line names training.global_batch and the examples per device."""
    scenario = parse_scenario({
        "name": "t", "pod": {"slice": "v2-8"},
        "model": {"name": "lstm_classifier",
                  "options": {"units": 1024, "embedding_dim": 64, "vocabulary": 100}},
        "data": {"name": "synthetic", "options": {"shape": [512], "vocabulary": 100,
                                                  "num_examples": 6000, "num_classes": 2}},
        "training": {"global_batch": 4096, "steps": 1, "precision": "fp32"}})
    with pytest.raises(HBMPlanError) as err:
        build_plan(scenario)
    message = str(err.value)
    assert message.startswith("training.global_batch: 4096 (512 examples per device) on "
                              "{data: 8} needs 8.1 GiB per device (")
    assert message.endswith("and does not fit 8 GiB; use a smaller global batch or a chip with "
                            "more HBM per device")
    plan = err.value.memory_plan
    assert plan["activations"] * 2 > plan["total"] > 8 * GIB


def test_a_tight_plan_drops_its_prefetch_and_the_step_exposes_the_gathers(monkeypatch):
    """Issue 29 item 3 end to end: a 2-block transformer 8192 wide at 34 x 1024 per v5e
    device on {fsdp: 8} needs 17.19 GB with an MLP array prefetched and 16.72 GB without,
    of the 16.91 GB XLA makes available: the plan keeps no prefetch, and its timing-only step exposes more fsdp time than
    the same plan with room to prefetch, by as much as its step grows (the closed form of
    that growth is test_clock's test_prefetch_depth_exposes_the_gathers_it_no_longer_hides)
    when the chip's sustained MXU budget is lifted; with the budget, the step is at least
    its MXU work at e1 (``pod.report.clock.sustained_clocks``), so the exposed time grows
    the step by at most as much, and only beyond the budget's slack."""
    import dataclasses

    import pod.runtime.base
    from pod.runtime.timing import TimingPod

    scenario = parse_scenario({
        "name": "tight", "pod": {"slice": "v5e-8", "mesh": {"fsdp": 8}},
        "model": {"name": "transformer", "options": {
            "embed_dim": 8192, "heads": 64, "kv_heads": 8, "head_dim": 128, "mlp_dim": 28672,
            "layers": 2, "remat": "full", "tied_embeddings": False}},
        "data": {"name": "synthetic_text", "options": {"vocabulary": 32000,
                                                        "sequence_length": 1024,
                                                        "num_examples": 48}},
        "training": {"global_batch": 272, "steps": 1}, "sweep": {"mode": "timing"}})
    plan = build_plan(scenario, timing_only=True)
    memory = plan.device_memory
    capacity_bytes = device_hbm_bytes(plan.topology.chip)
    assert memory.prefetch_layers == 0 and memory.prefetch_layer_bytes > 0
    assert memory.total_bytes <= capacity_bytes < memory.total_bytes + memory.prefetch_layer_bytes
    roomy = dataclasses.replace(plan, device_memory=dataclasses.replace(memory,
                                                                        prefetch_layers=1))
    tight, ample = TimingPod(plan).step(0), TimingPod(roomy).step(0)
    assert tight.axis_exposed_seconds["fsdp"] > ample.axis_exposed_seconds["fsdp"]
    # both steps may sit on the same MXU floor, summed in another order: equal to rounding
    assert -1e-12 * ample.step_seconds <= tight.step_seconds - ample.step_seconds <= (
        tight.axis_exposed_seconds["fsdp"] - ample.axis_exposed_seconds["fsdp"]) * (1 + 1e-9)
    monkeypatch.setattr(pod.runtime.base, "_sustained_fraction", lambda chip: 1.0)
    tight, ample = TimingPod(plan).step(0), TimingPod(roomy).step(0)   # no budget
    grown = tight.axis_exposed_seconds["fsdp"] - ample.axis_exposed_seconds["fsdp"]
    assert grown > 0
    assert tight.step_seconds - ample.step_seconds == pytest.approx(grown, rel=1e-9)
    assert tight.compute_seconds == ample.compute_seconds

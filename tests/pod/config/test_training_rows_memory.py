"""The HBM plan of every published MaxText training row (issue 29 item 5): T1-T9, M1-M3.

Each row of training-steps.md ran on real TPUs at the batch and remat policy shown, so a
plan that refuses one is wrong, not the row. Planned as ``validate`` plans them
(``build_plan``, timing-only: the device program's memory fitted by ``pod.config.fit``),
each row written here from the table (MaxText's per-device batch counts every device,
tensor ones too: global batch = B x devices).

The plausible range: each plan is at least what the row cannot do without, counted by
hand (the float32 parameters, gradients and AdamW moments of the device's share, 16
bytes a parameter, and the bf16 tensors its remat policy keeps in HBM: under ``full``
the layer inputs; under ``minimal`` also q, k, v and the MLP input product; offloaded
ones in host memory instead), and at most the chip's HBM. T1 ran near its memory
limit, as tuned MaxText configurations do: its plan is above 80% of v5p's 95 GiB.
"""

from __future__ import annotations

import pytest

from pod.config.plan import build_plan
from pod.config.scenario import parse_scenario
from pod.errors import HBMPlanError

GIB = 2**30


def maxtext_2023(embed, heads, mlp, layers, **more):
    """The MaxText 2023 decoder (training-steps.md): parallel block, relu MLP, heads of
    256, tied embeddings, flash attention."""
    return {"embed_dim": embed, "heads": heads, "head_dim": 256, "mlp_dim": mlp, "layers": layers,
            "mlp_activation": "relu", "block": "parallel", "tied_embeddings": True, **more}


def llama(embed, heads, kv, mlp, layers, **more):
    """A Llama decoder: sequential block, SwiGLU, heads of 128, untied."""
    return {"embed_dim": embed, "heads": heads, "kv_heads": kv, "head_dim": 128, "mlp_dim": mlp,
            "layers": layers, "mlp_activation": "gated_silu", "tied_embeddings": False, **more}


def offload(*names):
    return {"remat": "custom", "remat_custom": dict.fromkeys(names, "offload")}


S16, S32 = maxtext_2023(5120, 32, 32768, 32), maxtext_2023(10240, 32, 32768, 32)
SCALE3 = maxtext_2023(6144, 24, 24576, 48, attention="dot_product")
# id: (slice, slices, mesh, sequences per device, T, vocabulary, model options)
ROWS = {
    "T1": ("v5p-128", 1, {"fsdp": 16, "tensor": 4}, 8, 2048, 32768, {**S32, "remat": "minimal"}),
    "T2": ("v5p-1024", 1, {"fsdp": 32, "tensor": 16}, 2, 2048, 32768,
           {**maxtext_2023(20480, 64, 65536, 128), "remat": "full"}),
    "T3": ("v5e-256", 1, {"fsdp": 256}, 6, 2048, 32768, {**S16, "remat": "full"}),
    "T4": ("v5e-256", 1, {"fsdp": 16, "tensor": 16}, 1, 2048, 32768,
           {**maxtext_2023(10240, 64, 65536, 64), "remat": "full"}),
    "T5": ("v6e-256", 1, {"fsdp": 256}, 4, 8192, 128256,
           {**llama(4096, 32, 8, 14336, 32), **offload(
               "decoder_layer_input", "query_proj", "key_proj", "value_proj", "out_proj")}),
    "T6": ("v6e-64", 1, {"fsdp": 64}, 2, 8192, 128256,
           {**llama(8192, 64, 8, 28672, 80), **offload(
               "decoder_layer_input", "query_proj", "key_proj", "value_proj")}),
    # fsdp_transpose 256 shards the same bytes as fsdp 256
    "T7": ("v6e-256", 1, {"fsdp": 256}, 2, 4096, 32000,
           {**llama(8192, 64, 8, 28672, 80), **offload("query_proj", "key_proj", "value_proj")}),
    "T8": ("v6e-256", 1, {"fsdp": 256}, 8, 4096, 32000,
           {**llama(4096, 32, 8, 14336, 32), "remat": "full", "experts": 8,
            "experts_per_token": 2, "capacity_factor": 1.25}),
    "T9": ("v4-128", 1, {"fsdp": 64}, 16, 1024, 32768, {**SCALE3, "remat": "full"}),
    "M1": ("v5e-256", 2, {"fsdp": 256}, 6, 2048, 32768, {**S16, "remat": "full"}),
    "M2": ("v5p-128", 2, {"fsdp": 16, "tensor": 4}, 8, 2048, 32768, {**S32, "remat": "minimal"}),
    "M3": ("v4-128", 8, {"fsdp": 64}, 16, 1024, 32768, {**SCALE3, "remat": "full"}),
}


def row_scenario(row_id, **changes):
    slice_name, slices, mesh, batch, steps, vocabulary, options = ROWS[row_id]
    devices = {"v5p-128": 64, "v5p-1024": 512, "v5e-256": 256, "v6e-256": 256, "v6e-64": 64,
               "v4-128": 64}[slice_name] * slices
    pod = {"slice": slice_name, "mesh": mesh,
           **({"slices": slices, "dcn_mesh": {"data": slices}} if slices > 1 else {})}
    return parse_scenario({
        "name": row_id, "pod": pod,
        "model": {"name": "transformer", "options": {**options, **changes}},
        "data": {"name": "synthetic_text", "options": {"vocabulary": vocabulary,
                                                        "sequence_length": steps,
                                                        "num_examples": 48}},
        "training": {"global_batch": batch * devices, "steps": 1},
        "sweep": {"mode": "timing"}})


def kept_by_hand(row_id):
    """bf16 bytes per device the row's remat keeps in HBM, by hand (per layer, per
    token of the B x tensor sequences of a tensor group; the residual over tensor)."""
    _, _, mesh, b, t, _, o = ROWS[row_id]
    tensor, e = mesh.get("tensor", 1), o["embed_dim"]
    kept = {k for k, v in o.get("remat_custom", {}).items() if v == "device"}
    per_token = 0 if "decoder_layer_input" in o.get("remat_custom", {}) else e // tensor
    if o["remat"] == "minimal":                                           # q, k, v; relu: one wi
        per_token += 3 * o["heads"] * o["head_dim"] // tensor + o["mlp_dim"] // tensor
    assert not kept
    return 2 * b * tensor * t * per_token * o["layers"]


@pytest.mark.parametrize("row_id", list(ROWS))
def test_every_calibration_row_fits_at_its_published_batch_and_remat(row_id):
    plan = build_plan(row_scenario(row_id), timing_only=True)
    memory, capacity = plan.device_memory, plan.topology.chip.hbm_bytes // plan.mesh.devices_per_chip
    assert memory is not None
    state = 16 * plan.model.num_params / plan.mesh.size * plan.mesh.dcn_size("data")
    print(f"{row_id}: {memory.total_bytes / GIB:.1f} of {capacity / GIB:.1f} GiB at its "
          f"{memory.peak}: " + ", ".join(f"{k.strip()} {v / GIB:.2f}" for k, v in memory.rows()))
    assert 0.9 * state + kept_by_hand(row_id) <= memory.total_bytes <= capacity
    assert memory.activations_bytes >= kept_by_hand(row_id)
    if row_id in ("T1", "M2"):
        assert memory.total_bytes > 0.80 * capacity


def test_t5_offloads_its_layer_inputs_and_projections_to_the_host():
    """Llama 3.1 8B at 4 x 8192 per v6e: the layer inputs and the q, k, v, out
    projections of 32 layers (28 GiB in bf16) live in host memory, not in HBM."""
    memory = build_plan(row_scenario("T5"), timing_only=True).device_memory
    per_layer = 2 * 4 * 8192 * (4096 + 4096 + 1024 + 1024 + 4096)       # x, q, k, v, out_proj
    assert memory.host_activations_bytes == 32 * per_layer
    assert memory.activations_bytes < 2**30                               # the output layer's


def test_a_refusal_names_the_remat_policy_that_fits():
    """T3 (16 GiB v5e) keeping everything (remat none) does not fit; the one line names
    a remat policy that fits, and no larger mesh (fsdp is all 256)."""
    with pytest.raises(HBMPlanError) as err:
        build_plan(row_scenario("T3", remat="none"), timing_only=True)
    message = str(err.value)
    assert message.startswith("pod.mesh: {fsdp: 256} needs ")
    assert "does not fit 14.9 GiB; remat " in message and " fits (" in message
    assert "\n" not in message

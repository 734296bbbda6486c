"""The HBM plan of the published MaxText training rows (issue 23, item 5).

Each row of ../shared/reference/training-steps.md ran on real TPUs at the batch and
remat policy shown, so a plan that refuses one is wrong, not the row. Planned per
device with the real functions (``mesh_memory_plan`` on the row's model, mesh and
chip; AdamW's two float32 slots), no Ray, no step run.

The plausible range: each plan is at least what the row cannot do without, counted
here by hand (the float32 parameters, gradients and AdamW state of the device's
share, 16 bytes a parameter, and the bf16 tensors its remat policy keeps: under
``full`` the layer inputs; under ``minimal`` also q, k, v and the MLP input
product; T5's offloaded ones in host memory instead), and at most the chip's HBM.
For T1 that floor is 77% of v5p's 95 GiB (66 GiB of kept activations: MaxText's
per-device batch counts the tensor devices, so a group of 4 holds 32 sequences),
so a plan under 40% of HBM would have lost the activations: T1 ran near its
memory limit, as tuned MaxText configurations do. The plan follows MaxText's
sharding (the residual stream, the logits and the vocabulary split over tensor).
"""

from __future__ import annotations

import pytest

from pod.config.mesh import build_mesh, device_hbm_bytes, mesh_memory_plan
from pod.config.slices import resolve_pod
from pod.errors import HBMPlanError
from pod.workloads import build_model

GIB = 2**30


def maxtext_2023(embed, heads, mlp, layers):
    """The MaxText 2023 decoder (training-steps.md): parallel block, relu MLP, heads of
    256, tied embeddings, vocabulary 32768, flash attention."""
    return {"embed_dim": embed, "heads": heads, "head_dim": 256, "mlp_dim": mlp, "layers": layers,
            "mlp_activation": "relu", "block": "parallel", "tied_embeddings": True}


LLAMA_31_8B = {"embed_dim": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128, "mlp_dim": 14336,
               "layers": 32, "mlp_activation": "gated_silu", "tied_embeddings": False}
T5_OFFLOAD = {"decoder_layer_input": "offload", "query_proj": "offload", "key_proj": "offload",
              "value_proj": "offload", "out_proj": "offload"}

# id: (slice, mesh, sequences per device, T, vocabulary, model options)
ROWS = {
    "T1": ("v5p-128", {"fsdp": 16, "tensor": 4}, 8, 2048, 32768,
           {**maxtext_2023(10240, 32, 32768, 32), "remat": "minimal"}),
    "T2": ("v5p-1024", {"fsdp": 32, "tensor": 16}, 2, 2048, 32768,
           {**maxtext_2023(20480, 64, 65536, 128), "remat": "full"}),
    "T3": ("v5e-256", {"fsdp": 256}, 6, 2048, 32768,
           {**maxtext_2023(5120, 32, 32768, 32), "remat": "full"}),
    "T4": ("v5e-256", {"fsdp": 16, "tensor": 16}, 1, 2048, 32768,
           {**maxtext_2023(10240, 64, 65536, 64), "remat": "full"}),
    "T5": ("v6e-256", {"fsdp": 256}, 4, 8192, 128256,
           {**LLAMA_31_8B, "remat": "custom", "remat_custom": T5_OFFLOAD}),
}


def row_plan(row_id, **changes):
    """The row's plan. MaxText's per-device batch counts every device, tensor ones too
    (global batch = B x devices); the devices of a tensor group share their examples,
    so each holds B x tensor sequences with its 1 / tensor of the heads and MLP."""
    slice_name, axes, batch, steps, vocabulary, options = ROWS[row_id]
    pod = resolve_pod(slice_name=slice_name)
    mesh = build_mesh(axes, pod)
    model = build_model("transformer", (steps,), vocabulary, **{**options, **changes})
    plan = mesh_memory_plan(model, 8 * model.num_params, batch * mesh.size, mesh,
                            device_hbm_bytes(pod.chip))
    return plan, model, mesh, device_hbm_bytes(pod.chip)


def kept_by_hand(row_id):
    """bf16 bytes per device the row's remat keeps in HBM, by hand (per layer, per
    token of the B x tensor sequences; the residual stream over tensor)."""
    _, axes, b, t, _, o = ROWS[row_id]
    tensor, e = axes.get("tensor", 1), o["embed_dim"]
    b *= tensor
    per_token = e // tensor                                               # the layer input
    if o["remat"] == "minimal":                                           # q, k, v; relu: one wi
        per_token += 3 * o["heads"] * o["head_dim"] // tensor + o["mlp_dim"] // tensor
    if o["remat"] == "custom":                                            # all offloaded or remat
        per_token = 0
    return 2 * b * t * per_token * o["layers"]


@pytest.mark.parametrize("row_id", list(ROWS))
def test_every_calibration_row_fits_at_its_published_batch_and_remat(row_id):
    plan, model, mesh, capacity = row_plan(row_id)
    state = 16 * model.num_params / mesh.size                             # params, grads, m, v
    floor = state + kept_by_hand(row_id)
    print(f"{row_id}: {plan['total'] / GIB:.1f} of {capacity / GIB:.1f} GiB "
          f"({plan['total'] / capacity:.0%}): " + ", ".join(
              f"{k} {v / GIB:.2f}" for k, v in plan.items() if k != "total"))
    assert floor <= plan["total"] <= capacity
    assert plan["activations"] >= kept_by_hand(row_id)
    if row_id == "T1":
        assert plan["total"] > 0.40 * capacity


def test_t5_offloads_its_layer_inputs_and_projections_to_the_host():
    """Llama 3.1 8B at 4 x 8192 per v6e: the layer inputs and the q, k, v, out
    projections of 32 layers (28 GiB in bf16) live in host memory, not in HBM."""
    _, model, mesh, _ = row_plan("T5")
    memory = model.activation_memory(4)
    per_layer = 2 * 4 * 8192 * (4096 + 4096 + 1024 + 1024 + 4096)       # x, q, k, v, out_proj
    assert memory.host_bytes == 32 * per_layer
    assert memory.device_bytes < 2**30                                    # the last layers' inputs
    # the logits (4 x 8192 x 128256) and their gradient, bf16: the largest transient
    assert memory.transient_bytes == 2 * 2 * 4 * 8192 * 128256


def test_a_refusal_names_the_remat_policy_that_fits():
    """T3 (16 GiB v5e) keeping everything (remat none) needs 89 GiB per device; the
    one line names full remat, which fits, and no larger mesh (fsdp is all 256)."""
    with pytest.raises(HBMPlanError) as err:
        row_plan("T3", remat="none")
    message = str(err.value)
    assert message.startswith("pod.mesh: {fsdp: 256} needs ")
    assert message.endswith("does not fit 14.9 GiB; remat full fits (13 GiB per device)")
    assert "\n" not in message

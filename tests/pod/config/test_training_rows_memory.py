"""The HBM plan of every published MaxText training row (issue 29 item 5): T1-T9, M1-M3.

Each row of training-steps.md ran on real TPUs at the batch and remat policy shown, so a
plan that refuses one is wrong, not the row. Each is planned from its shipped scenario
(``scenarios/maxtext-*.yaml``, written as it ran) as ``validate`` plans it
(``build_plan``, timing-only: the device program's memory fitted by ``pod.config.fit``).

The plausible range: each plan is at least what the row cannot do without, counted by
hand (the parameters, gradients and AdamW moments of the device's share, 16 bytes a
float32 parameter, and the bf16 tensors its remat policy keeps in HBM: under ``full``
the layer inputs; under ``minimal`` also q, k, v and the MLP input product; offloaded
ones in host memory instead), and at most the chip's HBM. T1 ran near its memory
limit, as tuned MaxText configurations do: its plan is above 80% of v5p's 95 GiB.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pod.config.overrides import load_with_overrides
from pod.config.plan import build_plan
from pod.errors import HBMPlanError

GIB = 2**30
SCENARIOS = Path(__file__).resolve().parents[3] / "scenarios"
ROWS = {"T1": "maxtext-t1-32b-v5p-128", "T2": "maxtext-t2-512b-v5p-1024",
        "T3": "maxtext-t3-16b-v5e-256", "T4": "maxtext-t4-128b-v5e-256",
        "T5": "maxtext-t5-llama3.1-8b-v6e-256", "T6": "maxtext-t6-llama3.1-70b-v6e-64",
        "T7": "maxtext-t7-llama2-70b-v6e-256", "T8": "maxtext-t8-mixtral-8x7b-v6e-256",
        "T9": "maxtext-t9-22b-v4-128", "M1": "maxtext-m1-16b-2x-v5e-256",
        "M2": "maxtext-m2-32b-2x-v5p-128", "M3": "maxtext-m3-22b-8x-v4-128"}


def row_plan(row_id, *overrides):
    scenario = load_with_overrides(SCENARIOS / f"{ROWS[row_id]}.yaml", list(overrides))
    return build_plan(scenario, timing_only=True)


def kept_by_hand(plan):
    """bf16 bytes per device the row's remat keeps in HBM, by hand (per layer, per
    token of the sequences of a tensor group; the residual over tensor)."""
    o, b = plan.model.config, plan.per_device_batch
    tensor, custom = plan.mesh.axis_size("tensor"), dict(o.remat_custom or ())
    per_token = 0 if custom.get("decoder_layer_input") == "offload" else o.embed_dim // tensor
    if o.remat == "minimal":                                              # q, k, v; relu: one wi
        per_token += (o.heads + 2 * o.kv_heads) * o.head_dim // tensor + o.mlp_dim // tensor
    assert not [k for k, v in custom.items() if v == "device" and k != "decoder_layer_input"]
    return 2 * b * o.sequence_length * per_token * o.layers


@pytest.mark.parametrize("row_id", list(ROWS))
def test_every_calibration_row_fits_at_its_published_batch_and_remat(row_id):
    plan = row_plan(row_id)
    memory, capacity = plan.device_memory, plan.topology.chip.hbm_bytes // plan.mesh.devices_per_chip
    assert memory is not None
    state = 16 * plan.model.num_params / plan.mesh.size * plan.mesh.dcn_size("data")
    print(f"{row_id}: {memory.total_bytes / GIB:.1f} of {capacity / GIB:.1f} GiB at its "
          f"{memory.peak}: " + ", ".join(f"{k.strip()} {v / GIB:.2f}" for k, v in memory.rows()))
    assert 0.9 * state + kept_by_hand(plan) <= memory.total_bytes <= capacity
    assert memory.activations_bytes >= kept_by_hand(plan)
    if row_id in ("T1", "M2"):
        assert memory.total_bytes > 0.80 * capacity


def test_t5_offloads_its_layer_inputs_and_projections_to_the_host():
    """Llama 3.1 8B at 4 x 8192 per v6e: the layer inputs and the q, k, v, out
    projections of 32 layers (28 GiB in bf16) live in host memory, not in HBM."""
    memory = row_plan("T5").device_memory
    per_layer = 2 * 4 * 8192 * (4096 + 4096 + 1024 + 1024 + 4096)       # x, q, k, v, out_proj
    assert memory.host_activations_bytes == 32 * per_layer
    assert memory.activations_bytes < 2**30                               # the output layer's


def test_a_refusal_names_the_remat_policy_that_fits():
    """T3 (16 GiB v5e) keeping everything (remat none) does not fit; the one line names
    a remat policy that fits, and no larger mesh (fsdp is all 256)."""
    with pytest.raises(HBMPlanError) as err:
        row_plan("T3", "model.options.remat=none")
    message = str(err.value)
    assert message.startswith("pod.mesh: {fsdp: 256} needs ")
    assert "does not fit 15.8 GiB; remat " in message and " fits (" in message
    assert "\n" not in message

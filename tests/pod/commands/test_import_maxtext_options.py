"""``import-maxtext`` of the MaxText keys behind training-steps.md T6-T9 / M3: weight_dtype,
AQT int8, fsdp_transpose, qkv_proj_offloaded, the splash blocks, the dense MoE dispatch, and
MaxText's April 2023 decoder (enable_flash_attention, T5 relative position bias, QK norm).
The configs are a few lines of MaxText's base.yml (keys and defaults as at tpu-recipes-v0.1.4
and at 76bd53b0f), written here."""

from __future__ import annotations

from pathlib import Path

import pytest

from pod.commands.import_maxtext import import_maxtext, read_maxtext
from pod.config.plan import build_plan
from pod.config.scenario import parse_scenario
from pod.errors import ScenarioError

#: keys of MaxText's base.yml at tpu-recipes-v0.1.4 with its values (a small model's sizes)
BASE_2025 = """
base_emb_dim: 512
base_num_query_heads: 8
base_num_kv_heads: 8
base_mlp_dim: 1024
base_num_decoder_layers: 2
head_dim: 64
mlp_activations: ["silu", "linear"]
vocab_size: 32000
decoder_block: "llama2"
logits_via_embedding: False
per_device_batch_size: 1
max_target_length: 1024
dtype: "bfloat16"
weight_dtype: "float32"
quantization: ""
quantization_local_shard_count: -1
use_qk_norm: False
attention: 'autoselected'
remat_policy: 'full'
query_proj: 'remat'
key_proj: 'remat'
value_proj: 'remat'
ici_data_parallelism: 1
ici_fsdp_parallelism: -1
ici_fsdp_transpose_parallelism: 1
ici_tensor_parallelism: 1
ici_expert_parallelism: 1
dcn_data_parallelism: -1
dcn_fsdp_parallelism: 1
dcn_fsdp_transpose_parallelism: 1
sa_block_q: 512
sa_block_kv: 512
sa_block_q_dkv: 512
sa_block_kv_dkv: 512
sa_block_q_dq: 512
sa_block_kv_dq: 512
sa_use_fused_bwd_kernel: False
megablox: True
sparse_matmul: True
capacity_factor: -1.0
num_experts: 1
num_experts_per_tok: 1
opt_type: "adamw"
"""
#: keys of MaxText's base.yml at 76bd53b0f (December 2023)
BASE_2023 = """
dtype: "bfloat16"
int8_training: False
global_parameter_scale: 1
base_emb_dim: 2560
base_num_heads: 8
base_mlp_dim: 8192
base_num_decoder_layers: 16
head_dim: 256
mlp_activations: ["relu"]
logits_via_embedding: True
remat_policy: 'full'
attention: 'flash'
ici_fsdp_parallelism: -1
dcn_data_parallelism: -1
vocab_size: 32_768
per_device_batch_size: 12.0
max_target_length: 2048
enable_checkpointing: True
"""


def _file(tmp_path: Path, text: str, name: str = "base.yml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_t7s_keys_fsdp_transpose_offloaded_projections_and_splash_blocks(tmp_path):
    """Llama 2 70B's T7 config in miniature: ici_fsdp_transpose_parallelism -1 fills the
    slice; qkv_proj_offloaded keeps its name and is q / k / v to host; splash query
    blocks of 1024 forward and 2048 in both backward kernels (kept: they differ from the
    forward's; the key blocks, 512 each, are the forward's and not written)."""
    from pod.workloads.flash import BackwardBlocks

    keys = ["ici_fsdp_parallelism=1", "ici_fsdp_transpose_parallelism=-1",
            "remat_policy=qkv_proj_offloaded", "sa_block_q=1024", "sa_block_q_dkv=2048",
            "sa_block_q_dq=2048", "sa_block_kv_dq=512"]
    result = import_maxtext([_file(tmp_path, BASE_2025)], keys, slice_name="v6e-256")
    s = result.scenario
    options = s["model"]["options"]
    assert s["pod"]["mesh"] == {"fsdp_transpose": 256}
    assert options["remat"] == "qkv_proj_offloaded" and "remat_custom" not in options
    assert options["sa_block_q"] == 1024 and "sa_block_kv" not in options
    assert (options["sa_block_q_dkv"], options["sa_block_q_dq"]) == (2048, 2048)
    assert {"sa_block_kv_dkv", "sa_block_kv_dq", "sa_use_fused_bwd_kernel"}.isdisjoint(options)
    assert s["training"]["global_batch"] == 256
    assert not result.of("error")
    assert not {"sa_block_q_dkv", "sa_block_q_dq"} & {n.key for n in result.notes}
    plan = build_plan(parse_scenario(s), timing_only=True)
    assert plan.mesh.label == "{fsdp: 256} (fsdp_transpose 256 as fsdp)"
    block = next(layer for layer in plan.model.layers if hasattr(layer, "choices"))
    assert {name for name, choice in block.choices.items() if choice == "offload"} == {
        "query_proj", "key_proj", "value_proj"}
    assert plan.model.config.backward_blocks == BackwardBlocks((2048, 512), (2048, 512))


def test_t6s_fused_splash_backward_kernel_is_mapped_and_its_dq_blocks_dropped(tmp_path):
    """T6's splash: blocks of 2048 everywhere and sa_use_fused_bwd_kernel: the fused
    kernel runs on the dkv blocks, so the dq blocks (which splash refuses beside a fused
    kernel) are not written."""
    keys = [f"{k}=2048" for k in ("sa_block_q", "sa_block_kv", "sa_block_q_dkv",
                                  "sa_block_kv_dkv", "sa_block_q_dq", "sa_block_kv_dq")]
    result = import_maxtext([_file(tmp_path, BASE_2025)], keys + ["sa_use_fused_bwd_kernel=true"],
                            slice_name="v6e-64")
    options = result.scenario["model"]["options"]
    assert options["sa_use_fused_bwd_kernel"] is True
    assert not {"sa_block_q_dkv", "sa_block_kv_dkv", "sa_block_q_dq",
                "sa_block_kv_dq"} & set(options)
    config = build_plan(parse_scenario(result.scenario), timing_only=True).model.config
    assert config.backward_blocks.kernels(config.sa_block_q, config.sa_block_kv) == (
        ("fused", 2048, 2048),)


def test_weight_dtype_and_aqt_int8_are_model_options(tmp_path):
    base = _file(tmp_path, BASE_2025)
    plain = import_maxtext([base], [], slice_name="v5e-16").scenario
    assert {"weight_dtype", "quantization"}.isdisjoint(plain["model"]["options"])
    result = import_maxtext([base], ["weight_dtype=bfloat16", "quantization=int8"],
                            slice_name="v5e-16")
    options = result.scenario["model"]["options"]
    assert (options["weight_dtype"], options["quantization"]) == ("bfloat16", "int8")
    assert result.scenario["training"]["precision"] == "bf16"
    assert not {"weight_dtype", "quantization"} & {n.key for n in result.notes}
    build_plan(parse_scenario(result.scenario), timing_only=True)
    old = import_maxtext([_file(tmp_path, BASE_2023, "b23.yml")], ["int8_training=true"],
                         slice_name="v5e-16").scenario
    assert old["model"]["options"]["quantization"] == "int8"
    assert old["training"]["precision"] == "bf16"
    with pytest.raises(ScenarioError, match=r"^quantization: 'fp8' is not modelled; the emulator "
                                            r"maps \"\" \(bf16\) and int8 \(AQT\)"):
        import_maxtext([base], ["quantization=fp8"], slice_name="v5e-16")
    with pytest.raises(ScenarioError, match=r"^weight_dtype: 'float16' is not modelled"):
        import_maxtext([base], ["weight_dtype=float16"], slice_name="v5e-16")


@pytest.mark.parametrize("keys, sparse", [
    (["sparse_matmul=false", "megablox=false"], False),
    (["megablox=false"], True),                  # ragged dot: sparse, said in a note
    ([], True)])
def test_the_dense_moe_dispatch_is_sparse_matmul_false(tmp_path, keys, sparse):
    moe = ["num_experts=8", "num_experts_per_tok=2", "capacity_factor=1.25"]
    result = import_maxtext([_file(tmp_path, BASE_2025)], moe + keys, slice_name="v6e-8")
    options = result.scenario["model"]["options"]
    assert options.get("sparse_matmul", True) is sparse
    assert ("megablox" in {n.key for n in result.of("warning")}) == (keys == ["megablox=false"])


def test_megablox_false_without_a_sparse_matmul_key_is_the_dense_path(tmp_path):
    """MaxText before sparse_matmul (2e1ebad7, T8): megablox false was the dense einsum."""
    base = BASE_2025.replace("sparse_matmul: True\n", "")
    result = import_maxtext([_file(tmp_path, base)], ["num_experts=8", "num_experts_per_tok=2",
                                                      "capacity_factor=1.25", "megablox=false"],
                            slice_name="v6e-8")
    assert result.scenario["model"]["options"]["sparse_matmul"] is False


def test_maxtexts_april_2023_decoder_is_imported_as_what_it_is(tmp_path):
    """A base with enable_flash_attention (MaxText's key of April 2023, 281e04bf3): false is
    the dot-product kernel, and that decoder's T5 relative position bias and QK norm come
    with it, said in a note; never rotary and flash without a word."""
    april = BASE_2023.replace("attention: 'flash'\n", "enable_flash_attention: False\n")
    result = import_maxtext([_file(tmp_path, april)], ["ici_fsdp_parallelism=64"],
                            slice_name="v4-128")
    options = result.scenario["model"]["options"]
    assert (options["attention"], options["positions"], options["use_qk_norm"]) == (
        "dot_product", "relative", True)
    assert options["block"] == "parallel"
    [note] = [n for n in result.of("warning") if n.key == "enable_flash_attention"]
    assert "T5 relative position bias" in note.text and "positions: relative" in note.text
    build_plan(parse_scenario(result.scenario), timing_only=True)
    # the same decoder's flash path took no bias here: refused at the plan, one line
    flash = import_maxtext([_file(tmp_path, april)], ["enable_flash_attention=true"],
                           slice_name="v4-128").scenario
    with pytest.raises(ScenarioError, match=r"positions relative needs attention: dot_product"):
        build_plan(parse_scenario(flash), timing_only=True)


def test_a_key_of_another_maxtext_is_answered_with_this_bases_name_for_it(tmp_path):
    base = _file(tmp_path, BASE_2023)
    with pytest.raises(ScenarioError) as err:
        read_maxtext([base], ["enable_flash_attention=false"])
    assert str(err.value) == (
        "enable_flash_attention: not a key of base.yml (got enable_flash_attention=false); the "
        "attention kernel is the key attention (flash, mha, dot_product, autoselected) from late "
        "2023 on: e.g. attention=mha")
    assert import_maxtext([base], ["attention=mha"], slice_name="v4-8").scenario[
        "model"]["options"]["attention"] == "dot_product"


def test_use_qk_norm_is_carried(tmp_path):
    result = import_maxtext([_file(tmp_path, BASE_2025)], ["use_qk_norm=true"],
                            slice_name="v5e-16")
    assert result.scenario["model"]["options"]["use_qk_norm"] is True
    assert "use_qk_norm" not in {n.key for n in result.notes}


def test_num_vocab_tiling_is_a_model_option_that_chunks_the_logits(tmp_path):
    """MaxText's num_vocab_tiling (the loss over chunks of the tokens) is the transformer's
    option of that name, written only away from 1 (a MaxText later than
    tpu-recipes-v0.1.4 has the key, default 1); the plan holds less at its peak."""
    base = _file(tmp_path, BASE_2025 + "num_vocab_tiling: 1\n")
    plain = import_maxtext([base], [], slice_name="v5e-16").scenario
    assert "num_vocab_tiling" not in plain["model"]["options"]
    result = import_maxtext([base], ["num_vocab_tiling=4"], slice_name="v5e-16")
    assert result.scenario["model"]["options"]["num_vocab_tiling"] == 4
    assert "num_vocab_tiling" not in {n.key for n in result.notes}
    tiled = build_plan(parse_scenario(result.scenario), timing_only=True)
    whole = build_plan(parse_scenario(plain), timing_only=True)
    assert tiled.model.config.num_vocab_tiling == 4
    assert tiled.memory["total"] < whole.memory["total"]

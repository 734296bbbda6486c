"""tools/xla_oracle/maxtext_step: the oracle row -> MaxText 0.2.5 ``train_compile`` argument
mapping, the flags, the portable file names (fast, no jax, no maxtext); the committed records
of MaxText's own compiles; benchmarks/hlo_fidelity's stack-frame categories and the per-op
exposed collectives (fast, on a hand-written module)."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

from tools.xla_oracle.flags import MAXTEXT_2023_LIBTPU_ARGS
from tools.xla_oracle.maxtext_step import (
    OUT_DIR,
    MaxTextArgsError,
    libtpu_args,
    main,
    maxtext_args,
    portable_paths,
)
from tools.xla_oracle.spec import ROOT, load_configs, resolve

sys.path.insert(0, str(ROOT / "benchmarks"))
import hlo_fidelity  # noqa: E402


def _args(cid: str) -> dict[str, str]:
    spec = resolve(cid, load_configs()[cid])
    return dict(a.split("=", 1) for a in maxtext_args(spec))


def test_t2_is_the_2023_model_on_fsdp_32_by_tensor_16():
    a = _args("T2")
    # the scenario's model (training-steps.md T2: s = 512, E 20480, 64 heads x 256, F 65536,
    # 128 layers, relu, tied embedding, parallel block), MHA: kv heads = heads
    assert a["compile_topology"] == "v5p-1024" and a["compile_topology_num_slices"] == "1"
    assert (a["ici_fsdp_parallelism"], a["ici_tensor_parallelism"]) == ("32", "16")
    assert a["dcn_data_parallelism"] == "1"
    assert (a["base_emb_dim"], a["base_num_query_heads"], a["base_num_kv_heads"]) == \
        ("20480", "64", "64")
    assert (a["head_dim"], a["base_mlp_dim"], a["base_num_decoder_layers"]) == \
        ("256", "65536", "128")
    assert a["decoder_block"] == "default"   # 0.2.5's parallel block
    assert a["mlp_activations"] == "['relu']" and a["logits_via_embedding"] == "true"
    assert a["global_parameter_scale"] == "1" and a["vocab_size"] == "32768"
    # 1024 sequences over 512 chips, 2048 tokens
    assert a["per_device_batch_size"] == "2" and a["max_target_length"] == "2048"
    assert a["remat_policy"] == "full" and a["attention"] == "flash"
    assert (a["adam_b1"], a["adam_b2"], a["adam_weight_decay"]) == ("0.9", "0.95", "0.1")


def test_t5_is_llama2_block_with_the_custom_offload_policy():
    a = _args("T5")
    assert a["decoder_block"] == "llama2"
    assert a["mlp_activations"] == "['silu','linear']"
    assert a["logits_via_embedding"] == "false"
    assert (a["base_num_query_heads"], a["base_num_kv_heads"]) == ("32", "8")
    assert a["ici_fsdp_parallelism"] == "256" and a["per_device_batch_size"] == "4"
    assert a["remat_policy"] == "custom"
    for tensor in ("decoder_layer_input", "query_proj", "key_proj", "value_proj", "out_proj"):
        assert a[tensor] == "offload"
    assert a["mlpwo"] == "remat"
    # the oracle's splash blocks (configs.yaml flash_block 512) on every block option
    assert {a[k] for k in a if k.startswith("sa_block_")} == {"512"}


def test_m1_goes_over_the_dcn():
    a = _args("M1")
    assert a["compile_topology_num_slices"] == "2" and a["dcn_data_parallelism"] == "2"
    assert a["ici_fsdp_parallelism"] == "256"


def test_options_maxtext_cannot_express_are_refused_by_name():
    spec = resolve("T9", load_configs()["T9"])   # T5 relative position bias, QK norm
    with pytest.raises(MaxTextArgsError, match="T9: model.relative_position_buckets 32"):
        maxtext_args(spec)
    spec = resolve("T2", load_configs()["T2"])
    spec["mesh"] = {"ici": {"sequence": 512}, "dcn": {}}
    with pytest.raises(MaxTextArgsError, match=r"mesh.ici axes \['sequence'\]"):
        maxtext_args(spec)


def test_stage_axis_is_maxtexts_pipeline_option():
    spec = resolve("T2", load_configs()["T2"])
    spec["mesh"] = {"ici": {"stage": 4, "fsdp": 128}, "dcn": {}}
    args = maxtext_args(spec)
    assert "ici_pipeline_parallelism=4" in args and "ici_fsdp_parallelism=128" in args


def test_libtpu_args_drop_the_all_gather_fusion_libtpu_refuses_outside_v5e():
    t2 = resolve("T2", load_configs()["T2"])   # v5p, maxtext-2023
    flags, dropped = libtpu_args(t2)
    assert dropped == ["--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true"]
    assert set(flags.split()) == set(MAXTEXT_2023_LIBTPU_ARGS.split()) - set(dropped)
    t3 = resolve("T3", load_configs()["T3"])   # v5e keeps it
    assert libtpu_args(t3) == (MAXTEXT_2023_LIBTPU_ARGS, [])
    t5 = resolve("T5", load_configs()["T5"])   # no flag set: XLA's defaults
    assert libtpu_args(t5) == ("", [])
    flags, _ = libtpu_args(t5, host_offload=True)
    assert "--xla_tpu_host_transfer_overlap_limit=24" in flags.split()


def test_portable_paths_strip_this_machines_prefixes():
    root = Path("/some/where/repo")
    text = ('FileNames\n1 "/some/where/repo/tools/xla_oracle/maxtext_step.py"\n'
            '2 "/x/.venv-maxtext/lib/python3.12/site-packages/maxtext/layers/linears.py"\n'
            '3 "<frozen runpy>"\n')
    out = portable_paths(text, root)
    assert out.splitlines() == ["FileNames", '1 "tools/xla_oracle/maxtext_step.py"',
                                '2 "maxtext/layers/linears.py"', '3 "<frozen runpy>"']


def test_bad_rows_get_one_line_and_exit_2(capsys):
    assert main(["--only", "T99"]) == 2
    assert capsys.readouterr().err.strip() == "maxtext_step: --only T99: not in configs.yaml"
    assert main(["--only", "T9", "--args"]) == 2
    assert "relative_position_buckets" in capsys.readouterr().err


def test_missing_maxtext_environment_is_one_line(tmp_path, capsys):
    assert main(["--only", "T2", "--python", str(tmp_path / "python")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no MaxText environment" in err[0]


@pytest.mark.parametrize("path", sorted(OUT_DIR.glob("**/*.json")), ids=lambda p: p.stem)
def test_committed_records_match_their_hlo(path):
    rec = json.loads(path.read_text())
    assert rec["ok"] and rec["versions"]["maxtext"] == "0.2.5"
    hlo = path.with_name(f"{rec['id']}.hlo.txt.gz")
    with gzip.open(hlo, "rt") as f:
        head = f.readline()
    assert head.startswith("HloModule jit_train_step")
    # a compile for several slices prints one slice's partitions (M1: 256 of 2 x 256, as the
    # oracle's committed M1 module)
    assert f"num_partitions={rec['devices'] // rec['slices']}" in head
    # the arguments are what the mapping writes for the row today
    spec = resolve(rec["id"], load_configs()[rec["id"]])
    split = "allow_split_physical_axes=true" in rec["maxtext_args"]
    assert rec["maxtext_args"] == maxtext_args(spec, split)
    if rec.get("device_order"):
        assert sorted(rec["device_order"]) == list(range(rec["devices"]))
    mem = rec["memory"]
    assert rec["peak_bytes_per_device"] == mem["peak_memory_bytes"] > 0


MODULE = """HloModule m
FileNames
1 "maxtext/layers/linears.py"
FunctionNames
1 "MlpBlock.__call__"
2 "DenseGeneral.__call__"
3 "Attention.query_projection"
FileLocations
1 {file_name_id=1 function_name_id=1 line=10 end_line=10 column=1 end_column=1}
2 {file_name_id=1 function_name_id=2 line=20 end_line=20 column=1 end_column=1}
3 {file_name_id=1 function_name_id=3 line=30 end_line=30 column=1 end_column=1}
StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=2}
3 {file_location_id=3 parent_frame_id=1}
4 {file_location_id=2 parent_frame_id=4}

ENTRY %main {
  %a = f32[2] parameter(0), metadata={op_name="jit(f)/dot_general" stack_frame_id=2}
  %b = f32[2] add(%a, %a), metadata={op_name="jit(f)/dot_general" stack_frame_id=4}
  ROOT %c = f32[2] add(%b, %b)
}
"""


def test_stack_functions_walk_each_frame_to_its_root():
    frames = hlo_fidelity.stack_functions(MODULE)
    # parent_frame_id is the parent's number plus one (1: a root): frame 2 is DenseGeneral
    # called from frame 1 (MlpBlock), frame 4 from frame 3 (the query projection); %c has
    # no frame
    assert frames == {"a": "MlpBlock.__call__ > DenseGeneral.__call__",
                      "b": "Attention.query_projection > DenseGeneral.__call__"}
    assert hlo_fidelity._frame_category(frames["a"]) == "MLP matmuls"
    assert hlo_fidelity._frame_category(frames["b"]) == "attention projections"
    assert hlo_fidelity.stack_functions(MODULE[:MODULE.index("FileNames")]
                                        + MODULE[MODULE.index("ENTRY"):]) == {}

"""tools/xla_oracle: the op inventory parser, the result schema, the config resolution and
MaxText's logical axis rules (fast, no jax); the deviceless TPU compile (slow, skipped
without jax, libtpu and optax)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from tools.xla_oracle.inventory import HloParseError, op_inventory, replica_groups, shape_bytes
from tools.xla_oracle.record import RESULT_SCHEMA, build_result, device_peak_bytes, parse_oom
from tools.xla_oracle.sharding import logical_to_mesh, mesh_shape
from tools.xla_oracle.spec import RESULTS, ROOT, OracleConfigError, cache_key, load_configs, resolve

SNIPPET = Path(__file__).parent / "data" / "xla_oracle_snippet.hlo"
BF16 = 2


@pytest.fixture(scope="module")
def inventory():
    return op_inventory(SNIPPET.read_text())


def _row(inv, op):
    rows = [r for r in inv["collectives"] if r["op"] == op]
    assert len(rows) == 1, rows
    return rows[0]


def test_loop_trip_count_counts_the_peeled_loop_from_its_initial_counter(inventory):
    # condition: counter < 4; the init tuple starts the counter at 1 (XLA peeled a trip)
    (loop,) = inventory["while_loops"]
    assert loop["trip_count"] == 4 - 1
    assert loop["from"].startswith("condition compare and the counter")


def test_async_all_gather_is_counted_once_per_channel_and_per_trip(inventory):
    ag = _row(inventory, "all-gather")
    # printed in the start, compute and done fusions of one channel: one op per trip
    assert ag["count"] == 3 and ag["instructions"] == 1 and ag["async"] is True
    assert ag["result_bytes"] == 1 * 2048 * 1024 * BF16
    assert ag["operand_bytes"] == 1 * 2048 * 256 * BF16
    assert ag["replica_groups"]["form"] == "iota"
    assert (ag["replica_groups"]["group_size"], ag["replica_groups"]["groups"]) == (4, 2)


def test_reduce_scatter_is_the_all_reduce_a_dynamic_slice_takes(inventory):
    rs = _row(inventory, "reduce-scatter")
    assert rs["count"] == 3 and rs["dtype"] == "bf16"
    assert rs["operand_bytes"] == 4 * 2048 * 1024 * BF16
    assert rs["result_bytes"] == 4 * 2048 * 512 * BF16          # the slice, 1/2 of it
    assert rs["replica_groups"]["form"] == "explicit"
    assert rs["replica_groups"]["group_size"] == 2 and rs["replica_groups"]["groups"] == 4


def test_mesh_form_groups_and_the_entry_permute(inventory):
    ar = _row(inventory, "all-reduce")
    assert ar["replica_groups"]["form"] == "mesh"
    assert ar["replica_groups"]["group_size"] == 4 * 1           # axis_0 x axis_1
    assert ar["replica_groups"]["groups"] == 8 // 4
    cp = _row(inventory, "collective-permute")
    assert cp["count"] == 1 and cp["async"] is True and cp["replica_groups"]["groups"] == 8
    totals = inventory["collective_totals"]
    assert totals["all-gather"]["result_bytes"] == 3 * 1 * 2048 * 1024 * BF16


def test_an_all_reduce_whose_users_keep_a_shard_is_marked_scattered():
    # the scanned gradients: an all-reduce over 4 devices whose one user (a fusion holding
    # the dynamic-slice and a convert) keeps a quarter of it
    text = """HloModule m

%fused.1 (p.1: bf16[64,32]) -> f32[16,32] {
  %p.1 = bf16[64,32]{1,0} parameter(0)
  %c.1 = s32[] constant(0)
  %ds.1 = bf16[16,32]{1,0} dynamic-slice(%p.1, %c.1, %c.1), dynamic_slice_sizes={16,32}
  ROOT %cv.1 = f32[16,32]{1,0} convert(%ds.1)
}

ENTRY %main (a.1: bf16[64,32], b.1: bf16[64,32]) -> (f32[16,32], bf16[64,32]) {
  %a.1 = bf16[64,32]{1,0} parameter(0)
  %b.1 = bf16[64,32]{1,0} parameter(1)
  %all-reduce.1 = bf16[64,32]{1,0} all-reduce(%a.1), channel_id=1, replica_groups=[1,4]<=[4]
  %f.1 = f32[16,32]{1,0} fusion(%all-reduce.1), kind=kLoop, calls=%fused.1
  %all-reduce.2 = bf16[64,32]{1,0} all-reduce(%b.1), channel_id=2, replica_groups=[1,4]<=[4]
  ROOT %t.1 = (f32[16,32]{1,0}, bf16[64,32]{1,0}) tuple(%f.1, %all-reduce.2)
}
"""
    rows = {r["example"]: r for r in op_inventory(text)["collectives"]}
    assert rows["all-reduce.1"]["op"] == "all-reduce" and rows["all-reduce.1"]["scattered"]
    assert not rows["all-reduce.2"]["scattered"]


def test_fusions_and_custom_calls_counted_per_step(inventory):
    # in the loop body (3 trips): 4 kCustom fusions and 1 kLoop; in the entry: 1 kLoop;
    # the start fusion's root and the done fusion's root are custom calls, per trip
    assert inventory["fusions"] == {"kCustom": 4 * 3, "kLoop": 1 * 3 + 1}
    assert inventory["custom_calls"]["AsyncCollectiveStart"] == 3
    assert inventory["custom_calls"]["tpu_custom_call"] == 1


def test_replica_group_forms():
    assert replica_groups("replica_groups={{0,1,2,3},{4,5,6,7}}, x")["group_size"] == 4
    iota = replica_groups("replica_groups=[16,16]<=[256], dimensions={0}")
    assert (iota["group_size"], iota["groups"]) == (16, 16)
    sub = replica_groups("replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], "
                         "device_ids=([2,2,2]T(2,1,0)) {'axis_0':(2)2}, dimensions={0}")
    assert (sub["form"], sub["group_size"], sub["groups"]) == ("mesh", 2, 4)
    assert replica_groups("channel_id=3, dimensions={0}") is None


def test_shape_bytes():
    assert shape_bytes("bf16[4,2048,512]{2,1,0:T(8,128)(2,1)S(1)}") == 4 * 2048 * 512 * 2
    assert shape_bytes("(f32[], s32[2]{0}, pred[8])") == 4 + 8 + 8
    assert shape_bytes("u32[]{:S(2)}") == 4


def test_a_line_that_does_not_parse_is_named():
    text = SNIPPET.read_text().replace("%slice.1 = bf16[1,2048,256]{2,1,0} slice(",
                                       "%slice.1 = bf16[1,2048,256]{2,1,0} ???(")
    with pytest.raises(HloParseError, match=r"line \d+: cannot read the opcode of slice.1"):
        op_inventory(text)


# -- MaxText's logical axis rules (flax resolution) ------------------------------------------

def test_2025_rules_put_mlp_on_fsdp_transpose_and_embed_on_fsdp():
    # base.yml at tpu-recipes-v0.1.4 lists 'mlp' (fsdp_transpose first) before 'embed', whose
    # first rule then conflicts; its second rule (fsdp, ...) applies
    sizes = {"fsdp": 2, "fsdp_transpose": 4}
    assert logical_to_mesh(("embed", "mlp"), "2025", sizes) == (("fsdp",), ("fsdp_transpose",))
    # with only fsdp_transpose, the embed dimension is not sharded
    assert logical_to_mesh(("embed", "mlp"), "2025", {"fsdp_transpose": 256}) == (
        None, ("fsdp_transpose",))


def test_2025_rules_shard_experts_and_batch():
    sizes = {"fsdp": 8, "expert": 8}
    assert logical_to_mesh(("exp", "embed_no_exp", "mlp"), "2025", sizes) == (
        ("expert",), ("fsdp",), None)
    assert logical_to_mesh(("activation_batch", "activation_length", "activation_embed"),
                           "2025", sizes) == (("fsdp", "expert"), None, None)
    # a dense weight's embed dimension spans fsdp and expert
    assert logical_to_mesh(("embed", "q_heads", "kv"), "2025", sizes) == (
        ("fsdp", "expert"), None, None)


def test_2023_rules_shard_the_residual_over_tensor():
    sizes = {"fsdp": 16, "tensor": 4}
    assert logical_to_mesh(("activation_batch", "activation_length", "activation_embed"),
                           "2023", sizes) == (("fsdp",), None, ("tensor",))
    assert logical_to_mesh(("heads", "kv", "embed"), "2023", sizes) == (
        ("tensor",), None, ("fsdp",))


def test_mesh_shape_orders_axes_as_maxtext():
    assert mesh_shape("2023", {"fsdp": 16, "tensor": 4}, {"data": 2}) == (
        (1, 16, 1, 4), (2, 1, 1, 1))
    with pytest.raises(ValueError, match="expert"):
        mesh_shape("2023", {"expert": 8}, {})


# -- configurations and results --------------------------------------------------------------

@pytest.fixture(scope="module")
def configs():
    return load_configs()


@pytest.fixture(scope="module")
def results():
    return {p.stem: json.loads(p.read_text()) for p in sorted(RESULTS.glob("*.json"))}


@pytest.mark.slow
def test_every_config_resolves(configs):
    # the project's loader on every scenario and override (3 s: the slow tier)
    for cid, entry in configs.items():
        spec = resolve(cid, entry)
        assert spec["devices"] == spec["global_batch"] / spec["per_device_batch"]


def test_configs_span_what_the_oracle_must_cover(configs, results):
    assert len(configs) >= 40
    if set(configs) - set(results):
        pytest.skip(f"{len(set(configs) - set(results))} configs not compiled yet")
    specs = results
    assert {s["chip"] for s in specs.values()} == {"v4", "v5e", "v5p", "v6e"}
    remats = {s["model"]["remat"] for s in specs.values()}
    assert {"none", "minimal", "full", "save_qkv_proj", "qkv_proj_offloaded", "custom"} <= remats
    assert any(s["model"]["remat_custom"].get("decoder_layer_input") == "offload"
               for s in specs.values())
    assert any(s["model"]["experts"] and s["model"]["capacity_factor"] > 0 for s in specs.values())
    assert any(s["model"]["experts"] and s["model"]["capacity_factor"] == 0
               for s in specs.values())
    assert any(s["model"]["kv_heads"] < s["model"]["heads"] for s in specs.values())
    assert {s["model"]["block"] for s in specs.values()} == {"parallel", "sequential"}
    assert {s["model"]["tied_embeddings"] for s in specs.values()} == {True, False}
    rows = {s["calibration"] for s in specs.values() if s["calibration"]}
    assert rows == {f"T{i}" for i in range(1, 10)} | {"M1", "M2", "M3"}
    # a verdict both ways, so that a memory plan's verdict can disagree both ways
    assert {s["fits"] for s in specs.values()} >= {True, False}


def test_a_calibration_row_resolves_at_its_published_batch_and_remat(configs):
    t1 = resolve("T1", configs["T1"])
    assert t1["topology"]["name"] == "v5p:4x4x4" and t1["mesh"]["ici"] == {"fsdp": 16,
                                                                             "tensor": 4}
    assert t1["per_device_batch"] == 8 and t1["sequence_length"] == 2048
    assert t1["model"]["remat"] == "minimal" and t1["model"]["era"] == "2023"
    t7 = resolve("T7", configs["T7"])
    assert t7["mesh"]["ici"] == {"fsdp_transpose": 256}
    assert t7["model"]["remat"] == "qkv_proj_offloaded"
    m3 = resolve("M3", configs["M3"])
    assert m3["topology"]["slices"] == 8 and m3["mesh"]["dcn"] == {"data": 8}


def test_cache_key_follows_the_compiled_program_not_the_note(configs):
    spec = resolve("T3", configs["T3"])
    versions = {"jax": "0.10.2", "jaxlib": "0.10.2", "libtpu": "0.0.42.1", "optax": "0.2.8"}
    key = cache_key(spec, versions)
    assert cache_key({**spec, "note": "other", "id": "x"}, versions) == key
    assert cache_key({**spec, "global_batch": 2 * spec["global_batch"]}, versions) != key
    assert cache_key(spec, {**versions, "libtpu": "0.0.43"}) != key


def test_a_published_run_compiles_with_its_runs_xla_flags(configs, tmp_path):
    # training-steps.md gives the 2023 runs' LIBTPU_INIT_ARGS: their rows name that set, the
    # rest compile at XLA's defaults; the flags are part of the cache key
    for rid in ("T1", "T2", "T3", "T4", "M1", "M2"):
        spec = resolve(rid, configs[rid])
        assert spec["xla_flags"]["name"] == "maxtext-2023"
        assert "--xla_tpu_enable_async_collective_fusion=true" in spec["xla_flags"]["libtpu_args"]
    t9 = resolve("T9", configs["T9"])
    assert "xla_flags" not in t9
    versions = {"jax": "0.10.2", "jaxlib": "0.10.2", "libtpu": "0.0.42.1", "optax": "0.2.8"}
    t3 = resolve("T3", configs["T3"])
    defaults = {k: v for k, v in t3.items() if k != "xla_flags"}
    assert cache_key(t3, versions) != cache_key(defaults, versions)
    bad = tmp_path / "configs.yaml"
    bad.write_text("X:\n  scenario: s.yaml\n  xla_flags: fastest\n")
    with pytest.raises(OracleConfigError, match=r"X.xla_flags: 'fastest'; known: maxtext-2023"):
        load_configs(bad)


def test_parse_oom_reads_both_forms_of_xla_s_message():
    # the form libtpu 0.0.42 prints (T1 without remat on v5p-128)
    msg = ("JaxRuntimeError: RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory "
           "required for HLO temporaries (166.00G) exceeds available HBM (95.74G).")
    assert parse_oom(msg) == {"required_bytes": int(166.0 * 2 ** 30),
                              "available_bytes": int(95.74 * 2 ** 30),
                              "required_of": "HLO temporaries"}
    msg = ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory "
           "space hbm. Used 20.50G of 15.75G hbm. Exceeded hbm capacity by 4.75G.")
    assert parse_oom(msg) == {"required_bytes": int(20.5 * 2 ** 30),
                              "available_bytes": int(15.75 * 2 ** 30), "required_of": "total",
                              "exceeded_bytes": int(4.75 * 2 ** 30)}
    assert parse_oom("RESOURCE_EXHAUSTED: something else") is None


def test_build_result_fits_against_the_preset_hbm(configs, inventory):
    spec = resolve("T3", configs["T3"])
    memory = {"argument_bytes": 10, "output_bytes": 10, "alias_bytes": 8, "temp_bytes": 100,
              "generated_code_bytes": 1, "host_argument_bytes": 0, "host_output_bytes": 0,
              "host_alias_bytes": 0, "host_temp_bytes": 0, "peak_memory_bytes": 90}
    ok = build_result(spec, {"ok": True, "memory": dict(memory)}, inventory, "0" * 16, None)
    assert ok["peak_bytes_per_device"] == 90 and ok["sum_bytes_per_device"] == 10 + 10 - 8 + 100
    assert ok["fits"] is True
    big = dict(memory, peak_memory_bytes=spec["hbm_bytes_per_device"] + 1)
    assert build_result(spec, {"ok": True, "memory": big}, None, "0" * 16, None)["fits"] is False
    # a peak that is the arguments plus host memory (T6's: activations offloaded) is no HBM
    # figure; XLA compiled the step, so it fits
    host = 2 * spec["hbm_bytes_per_device"]
    offload = dict(memory, host_temp_bytes=host, peak_memory_bytes=10 + host)
    offloaded = build_result(spec, {"ok": True, "memory": offload}, None, "0" * 16, None)
    assert offloaded["fits"] is True and "host memory" in offloaded["fits_reason"]
    assert device_peak_bytes(offloaded) is None
    refused = build_result(spec, {"ok": False, "stage": "compile",
                                  "error": "XlaRuntimeError: RESOURCE_EXHAUSTED: Used 20G of "
                                           "15.75G hbm."}, None, "0" * 16, None)
    assert refused["fits"] is False and refused["compile"]["oom"]["required_bytes"] == 20 * 2 ** 30
    vmem = build_result(spec, {"ok": False, "stage": "compile", "error": (
        "JaxRuntimeError: RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom: Ran out of "
        "memory in memory space vmem while allocating on stack for %splash_mha_dkv")},
        None, "0" * 16, None)
    assert vmem["fits"] is None and "VMEM" in vmem["fits_reason"]
    crashed = build_result(spec, {"ok": False, "stage": "lower", "error": "TypeError"}, None,
                           "0" * 16, None)
    assert crashed["fits"] is None


def test_committed_results_follow_the_schema(configs, results):
    jsonschema = pytest.importorskip("jsonschema")
    if not results:
        pytest.skip("no results committed yet")
    for cid, result in results.items():
        jsonschema.validate(result, RESULT_SCHEMA)
        assert result["id"] == cid and cid in configs
        if result["compile"]["ok"]:
            mem = result["memory"]
            assert result["sum_bytes_per_device"] == (mem["argument_bytes"] + mem["output_bytes"]
                                                      - mem["alias_bytes"] + mem["temp_bytes"])
            # a compiled step fits its device's HBM: its peak is within it, or the peak is
            # the arguments plus host memory (offloaded activations), which says nothing of
            # HBM, and XLA's own check passed
            device_peak = device_peak_bytes(result)
            assert result["fits"] == (device_peak is None
                                      or device_peak <= result["hbm_bytes_per_device"])
            if device_peak is None:
                assert mem["host_temp_bytes"] > 0
            # the peak holds the donated train state at least
            assert result["peak_bytes_per_device"] >= mem["argument_bytes"] - mem["alias_bytes"]
        if result["hlo_file"]:
            assert (ROOT / result["hlo_file"]).exists()


# -- the compile path (slow; needs the tpu-compile extra) --------------------------------------

def _have_tpu_compile() -> str | None:
    missing = [m for m in ("jax", "libtpu", "optax") if importlib.util.find_spec(m) is None]
    return f"{', '.join(missing)} not installed (the tpu-compile extra; make oracle)" \
        if missing else None


E, H, D, F, V, L, T, B = 512, 4, 128, 1024, 2048, 3, 512, 8
#: a 3-layer transformer on a v5e 2x2, fsdp 4: seconds to compile
SMALL_SPEC = {"chip": "v5e", "topology": {"name": "v5e:2x2", "wraparound": [False, False],
                                          "slices": 1},
              "mesh": {"ici": {"fsdp": 4}, "dcn": {}}, "global_batch": B,
              "model": {"vocabulary": V, "sequence_length": T, "embed_dim": E, "heads": H,
                        "kv_heads": H, "head_dim": D, "mlp_dim": F, "mlp_activation": "relu",
                        "layers": L, "block": "parallel", "remat": "full", "era": "2025"},
              "optimizer": {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8,
                            "weight_decay": 0.1}}


def test_a_child_that_dies_is_a_crash_outcome_not_an_exception():
    """``compile_in_child`` (the oracle's and hlo_fidelity's compiles): a child process that
    exits without writing its outcome is reported as stage 'crash' with its exit code, also
    when it is gone before it read its spec (a spec larger than a pipe holds, 256 KiB: the
    write meets the closed pipe whenever the child exits)."""
    from tools.xla_oracle.compile_one import compile_in_child

    outcome, hlo = compile_in_child({**SMALL_SPEC, "pad": "x" * (256 << 10)}, 60,
                                    python="/bin/false")
    assert hlo is None and outcome["ok"] is False and outcome["stage"] == "crash"
    assert "exited with 1" in outcome["error"]


@pytest.mark.slow
@pytest.mark.skipif(_have_tpu_compile() is not None, reason=str(_have_tpu_compile()))
def test_deviceless_compile_holds_the_sharded_train_state():
    from tools.xla_oracle.compile_one import compile_in_child
    from tools.xla_oracle.step import compile_spec

    spec = SMALL_SPEC
    out = compile_spec(spec)
    assert out["ok"], out.get("error")
    # every parameter sharded 4 ways over fsdp (embed dim), fp32, and the two AdamW moments;
    # step / count scalars; six int32 (B, T) batch arrays sharded over the 4 devices
    params = V * E + E + L * (E + 3 * E * H * D + H * D * E + 2 * E * F)
    norms = E + L * E                    # the norm scales: 'norm' is not sharded here
    state = 3 * 4 * ((params - norms) / 4 + norms)
    scalars = 4 * 2 + 4                  # step, AdamW count, and the schedule's count
    batch = 6 * 4 * B * T / 4
    # within 0.1 %: the device layouts of the small arrays (norm scales, scalars) differ
    # from their logical bytes by a few hundred bytes (measured: 524 of 22 MB); a state not
    # sharded over fsdp would be 4 times as large
    assert math.isclose(out["memory"]["argument_bytes"], state + batch + scalars,
                        rel_tol=1e-3)
    inv = op_inventory(out["hlo_text"])
    trips = sorted(loop["trip_count"] for loop in inv["while_loops"])
    assert trips and all(t in (L - 1, L) for t in trips)
    assert "all-gather" in inv["collective_totals"]
    # the same compile in a child process (how make oracle and hlo_fidelity run it): the
    # same buffer assignment and the same op inventory
    child, hlo = compile_in_child(spec, 600)
    assert child["ok"] and hlo is not None, child.get("error")
    assert child["memory"] == out["memory"]
    assert op_inventory(hlo)["collective_totals"] == inv["collective_totals"]

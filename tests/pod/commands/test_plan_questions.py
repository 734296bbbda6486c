"""``tpu-pod plan`` answering what users ask (issue 33): a mixture of experts over every
axis the runtime runs it on (item 1), the pipeline bubble in every output (item 3), mesh
families at one global batch (item 4), MaxText's own keys and an output directory named
after what was planned (item 5), the KEY=VALUE epilog (item 12)."""

from __future__ import annotations

import contextlib
import csv
import io
import math
from pathlib import Path

import pytest
import yaml

from pod.commands.plan import PlanRequest, run_plan
from pod.commands.plan_report import family_lines, plan_table, search_line
from pod.commands.plan_search import (
    DEFAULT_CAPACITY_FACTOR,
    candidates,
    family,
    model_axes,
    runtime_axes,
)
from pod.config.mesh import AXIS_NAMES
from pod.errors import ScenarioError

# the API's current names only (slice=, per_device_batch=: no DeprecationWarning)
pytestmark = pytest.mark.filterwarnings("error:.*= is deprecated; use .*=:DeprecationWarning")

BLOCK = {"embed_dim": 64, "heads": 4, "head_dim": 16, "mlp_dim": 128, "layers": 4,
         "remat": "none"}


def _scenario(tmp_path, name, **options):
    data = {
        "name": name, "pod": {"slice": "v5e-8"},
        "model": {"name": "transformer", "options": {**BLOCK, **options}},
        "data": {"name": "synthetic_text", "test_fraction": 0.25,
                 "options": {"vocabulary": 256, "sequence_length": 64, "num_examples": 16}},
        "training": {"global_batch": 8, "steps": 1, "optimizer": {"name": "adamw"}},
        "metrics": {"port": 0},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.fixture
def moe(tmp_path):
    """Four experts, two per token, dropless as Mixtral is released."""
    return _scenario(tmp_path, "tiny-moe", experts=4, experts_per_token=2)


@pytest.fixture
def dense(tmp_path):
    return _scenario(tmp_path, "tiny-dense")


def _cli(*args: str) -> tuple[int, str, str]:
    from pod.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            pytest.raises(SystemExit) as code:
        main(["plan", *args])
    return code.value.code, out.getvalue(), err.getvalue()


# ------------------------------------------------------------------ item 1: experts


def test_a_mixture_of_experts_is_searched_over_the_axes_the_runtime_runs_it_on():
    """The runtime runs an MoE over data, fsdp and expert (a device program builds on
    each at 2), not over stage or tensor (the pipeline and the tensor split of experts
    are refused): the search takes exactly those; a dense model the dense ones."""
    from pod.programs import build_program
    from pod.workloads import build_optimizer
    from pod.workloads.transformer import TransformerConfig, TransformerModel

    config = TransformerConfig(vocabulary=16, sequence_length=4, embed_dim=8, heads=2,
                               mlp_dim=8, layers=2, experts=2,
                               capacity_factor=DEFAULT_CAPACITY_FACTOR)
    runs = []
    for axis in AXIS_NAMES:
        try:
            build_program(TransformerModel(config), {axis: 2}, build_optimizer("sgd"))
            runs.append(axis)
        except ValueError:
            pass
    assert tuple(runs) == runtime_axes(True) == ("data", "fsdp", "expert")
    assert model_axes(config) == ("data", "fsdp", "expert")
    assert "expert" not in model_axes(TransformerConfig(vocabulary=16, sequence_length=4,
                                                        embed_dim=8, heads=2, mlp_dim=8))


def test_an_moe_plan_tries_expert_layouts_at_a_capacity_and_says_which(moe):
    """The default search of a dropless MoE: every mesh over data, fsdp and expert, no
    stage layout; expert layouts at capacity 1.25 (dropless over expert is not modelled),
    the others dropless and at 1.25; the table and the family lines say which."""
    result = run_plan(PlanRequest(model=moe, slices=("v5e-8",), remat=("none",),
                                  per_device_batches=(1,), exhaustive=True))
    assert result.axes == ("data", "fsdp", "expert")
    assert result.capacities == (0.0, DEFAULT_CAPACITY_FACTOR)
    rows = result.rows
    assert all(r["stage"] == 1 and r["tensor"] == 1 for r in rows)
    expert = [r for r in rows if r["expert"] > 1]
    assert expert and all(r["capacity_factor"] == DEFAULT_CAPACITY_FACTOR for r in expert)
    assert any(r["status"] == "ok" for r in expert)
    assert {r["capacity_factor"] for r in rows if r["expert"] == 1} == {0.0, 1.25}
    assert "experts dropless, capacity 1.25" in search_line(result)
    text = _render(plan_table(result))
    assert "experts" in text and ("dropless" in text or "cf 1.25" in text)
    assert any(", experts capacity 1.25, " in line or ", experts dropless, " in line
               for line in family_lines(result))


def test_a_dense_dropless_moe_is_searched_dropless_over_expert(tmp_path):
    """A dense dropless MoE (sparse_matmul false, capacity 0: every expert on every token)
    runs over expert (``check_expert_split``): its expert layouts are searched at capacity
    0 too, and cost."""
    dense_moe = _scenario(tmp_path, "tiny-dense-moe", experts=4, experts_per_token=2,
                          sparse_matmul=False)
    result = run_plan(PlanRequest(model=dense_moe, slices=("v5e-8",), remat=("none",),
                                  per_device_batches=(1,), mesh_axes=("data", "expert"),
                                  exhaustive=True, workers=1))
    dropless = [r for r in result.rows if r["expert"] > 1 and r["capacity_factor"] == 0]
    runs = [r for r in dropless if 4 % r["expert"] == 0]  # expert 8 cannot split 4 experts
    assert runs and all(r["status"] == "ok" for r in runs)
    sparse = candidates([("v5e-8", 8)], ("data", "expert"), ("none",), per_device_batches=(1,),
                        capacities=(0.0,))
    assert all(c.mesh.get("expert", 1) == 1 for c in sparse)  # sparse dropless: not there


def test_mesh_axes_fsdp_expert_works_and_a_capacity_can_be_asked(moe):
    result = run_plan(PlanRequest(model=moe, slices=("v5e-8",), remat=("none",),
                                  per_device_batches=(1,), mesh_axes=("fsdp", "expert"),
                                  capacity_factors=("1.25",)))
    assert result.axes == ("fsdp", "expert") and result.capacities == (1.25,)
    assert {r["capacity_factor"] for r in result.rows} == {1.25}
    assert any(r["status"] == "ok" and r["expert"] == 4 for r in result.rows)
    as_override = run_plan(PlanRequest(model=moe, slices=("v5e-8",), remat=("none",),
                                       per_device_batches=(1,), mesh_axes=("fsdp", "expert"),
                                       overrides=("capacity_factor=1.25",)))
    assert as_override.capacities == (1.25,)


@pytest.mark.parametrize("args, line", [
    (["--mesh-axes", "fsdp,stage"], "error: --mesh-axes: stage is not an axis the runtime "
                                    "runs tiny-moe on; axes: data, fsdp, expert"),
    (["--capacity-factor", "lots"], "error: --capacity-factor: 'lots' is not a number"),
])
def test_moe_mistakes_are_one_line(moe, tmp_path, args, line):
    code, out, err = _cli(moe, "--slice", "v5e-8", *args, "--output-dir", str(tmp_path / "o"))
    assert code == 2 and err.startswith(line) and err.count("\n") == 1, err


def test_a_capacity_for_a_dense_model_is_one_line(dense):
    with pytest.raises(ScenarioError, match=r"^--capacity-factor: the model has no mixture"):
        run_plan(PlanRequest(model=dense, slices=("v5e-8",), capacity_factors=(1.25,)))


# ------------------------------------------------------------------ item 3: the bubble


def test_pipeline_rows_carry_their_bubble_in_every_output(dense, tmp_path):
    """results.csv has pipeline_bubble_seconds (0 without stages), a pipelined row's
    parts as layouts.png stacks them (compute, update, bubble, exposed per axis) add up
    to its step, and the table has a bubble column."""
    out = tmp_path / "o"
    result = run_plan(PlanRequest(model=dense, slices=("v5e-8",), remat=("none",),
                                  per_device_batches=(2,), mesh_axes=("stage", "fsdp"),
                                  exhaustive=True), output_dir=out)
    piped = [r for r in result.ranked if r["stage"] > 1]
    assert piped and all(r["pipeline_bubble_seconds"] > 0 for r in piped)
    for r in result.ranked:
        parts = (r["compute_seconds"] + r["update_seconds"] + r["pipeline_bubble_seconds"]
                 + sum(r[f"exposed_{a}_seconds"] for a in AXIS_NAMES))
        assert parts == pytest.approx(r["simulated_step_seconds"], rel=1e-9)
    with open(out / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {float(r["pipeline_bubble_seconds"]) > 0 for r in rows
            if r["status"] == "ok" and int(r["stage"]) > 1} == {True}
    assert {float(r["pipeline_bubble_seconds"]) for r in rows
            if r["status"] == "ok" and int(r["stage"]) == 1} == {0.0}
    assert "bubble" in _render(plan_table(result, top=20))


# ------------------------------------------------------------------ item 4: families


def test_families_are_compared_at_one_global_batch(dense):
    """With per-device batches the meshes' global batches differ ({fsdp: 8} at 4 per
    device is 32 sequences, {fsdp: 4, tensor: 2} at 4 is 16): the family lines are all
    at one global batch, the largest that every family here runs (16; before, fsdp's
    best at 32 stood against fsdp+tensor's at 16)."""
    result = run_plan(PlanRequest(model=dense, slices=("v5e-8",), remat=("none",),
                                  per_device_batches=(1, 2, 4), mesh_axes=("fsdp", "tensor"),
                                  exhaustive=True))
    assert result.ranked[0]["global_batch"] == 32  # the best runs a batch fsdp+tensor cannot
    lines = family_lines(result)
    assert [line.split()[0] for line in lines] == ["fsdp", "fsdp+tensor"]
    by_rank = {r["rank"]: r for r in result.ranked}
    for line in lines:
        row = by_rank[int(line.split("#")[1].split()[0])]
        assert row["global_batch"] == 16
        assert row is next(r for r in result.ranked if r["global_batch"] == 16
                           and family(r, result.axes) == line.split()[0])


# ------------------------------------------------------------------ item 5: MaxText's keys


def test_maxtext_layout_keys_set_the_search_with_a_preset_or_a_scenario(dense):
    result = run_plan(PlanRequest(model=dense, slices=("v5e-8",), overrides=(
        "ici_fsdp_parallelism=4", "per_device_batch_size=2", "remat_policy=full")))
    assert result.fixed == {"fsdp": 4} and result.remats == ("full",)
    assert result.rows and all(r["fsdp"] == 4 and r["per_device_batch"] == 2
                               and r["remat"] == "full" for r in result.rows)
    assert {r["mesh"] for r in result.rows} >= {"{data: 2, fsdp: 4}", "{fsdp: 4, tensor: 2}"}
    assert "with fsdp 4 (ici_*_parallelism)" in search_line(result)
    whole = run_plan(PlanRequest(model=dense, slices=("v5e-8",), remat=("none",), overrides=(
        "ici_data_parallelism=1", "ici_fsdp_parallelism=8", "ici_tensor_parallelism=1",
        "ici_pipeline_parallelism=1", "per_device_batch_size=1")))
    assert {r["mesh"] for r in whole.rows} == {"{fsdp: 8}"}  # all given: that mesh
    seq = run_plan(PlanRequest(model="llama2-7b", slices=("v5e-8",), remat=("full",),
                               overrides=("max_target_length=512", "model.options.layers=2",
                                          "ici_fsdp_parallelism=8", "per_device_batch_size=1")))
    assert seq.sequence_length == 512 and {r["mesh"] for r in seq.rows} == {"{fsdp: 8}"}


@pytest.mark.parametrize("keys, line", [
    (["ici_fsdp_parallelism=3"], "error: ici_fsdp_parallelism=3: "),
    (["ici_sequence_parallelism=2"], "error: ici_sequence_parallelism=2: the mesh has no "
                                     "sequence axis"),
    (["per_device_batch_size=0.5"], "error: per_device_batch_size=0.5: the plan tries whole "
                                    "sequences per device"),
    (["per_device_batch_size=2", "--global-batch", "16"],
     "error: per_device_batch_size=2 and --per-device-batch (or --global-batch, "
     "--tokens-per-step) set the same; give one"),
    (["dcn_fsdp_parallelism=2"], "error: dcn_fsdp_parallelism: the plan puts the data axis "
                                 "across slices"),
])
def test_maxtext_key_mistakes_are_one_line(dense, tmp_path, keys, line):
    code, out, err = _cli(dense, "--slice", "v5e-8", *keys, "--output-dir", str(tmp_path))
    assert code == 2 and err.startswith(line) and err.count("\n") == 1, err


def test_the_output_directory_is_named_after_the_model_and_slice(dense, tmp_path,
                                                                 monkeypatch):
    """runs/plan-<model>-<slice> (it was runs/<file stem>-plan: runs/base-plan for
    MaxText's base.yml)."""
    monkeypatch.chdir(tmp_path)
    code, out, err = _cli(dense, "--slice", "v5e-8", "--remat", "none", "--per-device-batch",
                          "1", "--mesh-axes", "fsdp")
    assert code == 0, err
    assert (Path("runs") / "plan-tiny-dense-v5e-8" / "results.csv").is_file()
    assert "Wrote runs/plan-tiny-dense-v5e-8/" in out


def test_maxtext_configs_get_their_models_name(tmp_path, monkeypatch):
    base = Path(__file__).resolve().parents[2] / "data" / "maxtext" / "base-2023-12.yml"
    monkeypatch.chdir(tmp_path)
    small = ("base_emb_dim=256", "base_num_heads=4", "base_mlp_dim=512",
             "base_num_decoder_layers=2", "max_target_length=128", "vocab_size=512")
    code, out, err = _cli(str(base), *small, "--slice", "v5p-8", "--remat", "full",
                          "--per-device-batch", "1", "--mesh-axes", "fsdp")
    assert code == 0, err
    written = [p.name for p in (tmp_path / "runs").iterdir()]
    assert written == ["plan-maxtext-s1-v5p-8"], written


def test_plan_help_has_the_key_value_epilog():
    from click.testing import CliRunner

    from pod.cli import cli

    text = CliRunner().invoke(cli, ["plan", "--help"], terminal_width=100).output
    assert "KEY=VALUE arguments after MODEL override" in text
    assert "ici_fsdp_parallelism=64" in text and "per_device_batch_size=2" in text


def _render(table) -> str:
    from rich.console import Console

    console = Console(width=250, record=True, file=io.StringIO())
    console.print(table)
    return console.export_text()


def test_no_nan_capacity_in_a_dense_plan(dense):
    rows = run_plan(PlanRequest(model=dense, slices=("v5e-8",), remat=("none",),
                                per_device_batches=(1,), mesh_axes=("fsdp",))).rows
    assert all(math.isnan(r["capacity_factor"]) for r in rows)

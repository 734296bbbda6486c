"""``tpu-pod import-maxtext`` across slices and pipeline stages (issue 24, items 1 and 2):
MaxText's ``num_slices`` / ``dcn_*_parallelism`` as ``pod.slices`` / ``pod.dcn_mesh``, and
``ici_pipeline_parallelism`` / ``num_pipeline_microbatches`` / ``num_pipeline_repeats`` as
the stage axis and the training's pipeline fields.

References: training-steps.md's multislice rows M1 and M2 (the single-slice rows' overrides
on ``dcn_data_parallelism`` = the number of slices) against the shipped
scenarios/maxtext-m1-*.yaml and maxtext-m2-*.yaml; MaxText's base.yml comments for the
pipeline's defaults ("The number of repeats will be set to num_decoder_layers /
(num_pipeline_stages * num_layers_per_pipeline_stage)"; microbatches "by default ... the
number of stages").
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import yaml

from pod.cli import main
from pod.commands.import_maxtext import import_maxtext
from pod.config.plan import build_plan
from pod.config.scenario import load_scenario, parse_scenario
from pod.errors import ScenarioError

from tests.pod.commands.test_import_maxtext import BASE_2023, BASE_2025, MODELS, T1

ROOT = Path(__file__).resolve().parents[3]
#: training-steps.md T3's overrides of MaxText's 2023 base (T1's: test_import_maxtext)
T3 = ["global_parameter_scale=16", "ici_fsdp_parallelism=256", "per_device_batch_size=6",
      "max_target_length=2048", "remat_policy=full"]



def same_in_what_matters(imported: dict, shipped_path: Path) -> None:
    """The imported scenario and the shipped one: the same pod, model, global batch,
    precision, optimizer and sequence; the same plan (mesh, its DCN part, batch split)."""
    shipped = load_scenario(shipped_path)
    mine = parse_scenario(imported)
    assert mine.pod == shipped.pod
    assert mine.model == shipped.model
    for key in ("global_batch", "precision", "optimizer", "microbatches", "pipeline_schedule",
                "pipeline_repeats"):
        assert getattr(mine.training, key) == getattr(shipped.training, key), key
    assert (mine.data.options["vocabulary"], mine.data.options["sequence_length"]) == \
        (shipped.data.options["vocabulary"], shipped.data.options["sequence_length"])
    a, b = build_plan(mine, timing_only=True), build_plan(shipped, timing_only=True)
    assert a.mesh == b.mesh and a.mesh.dcn_sizes == b.mesh.dcn_sizes
    assert a.per_device_batch == b.per_device_batch and a.memory == b.memory


@pytest.mark.parametrize("slices_key", ["dcn_data_parallelism=2", "compile_topology_num_slices=2"])
def test_m1_imports_to_the_shipped_m1(slices_key):
    """M1: T3's overrides on two v5e-256 slices (dcn_data_parallelism 2, or the slices
    given and the base's dcn_data_parallelism -1 filling them)."""
    result = import_maxtext([BASE_2023], [*T3, slices_key], slice_name="v5e-256")
    pod = result.scenario["pod"]
    assert pod == {"slice": "v5e-256", "slices": 2, "dcn_mesh": {"data": 2},
                   "mesh": {"fsdp": 256}}
    assert result.scenario["training"]["global_batch"] == 6 * 256 * 2
    assert not result.of("error")
    same_in_what_matters(result.scenario, ROOT / "scenarios/maxtext-m1-16b-2x-v5e-256.yaml")


def test_m2_imports_to_the_shipped_m2():
    result = import_maxtext([BASE_2023], [*T1, "dcn_data_parallelism=2"], slice_name="v5p-128")
    assert result.scenario["pod"]["dcn_mesh"] == {"data": 2}
    assert result.scenario["training"]["global_batch"] == 8 * 64 * 2
    same_in_what_matters(result.scenario, ROOT / "scenarios/maxtext-m2-32b-2x-v5p-128.yaml")


def test_fsdp_across_slices_and_the_rest_filled_by_data():
    """num_slices 8 with dcn_fsdp_parallelism 2: the base's dcn_data_parallelism -1 takes
    the other 4 (MaxText fills one -1 DCN axis); the batch is per device x every slice's
    devices."""
    result = import_maxtext([BASE_2025, MODELS / "llama2-7b.yml"],
                            ["num_slices=8", "dcn_fsdp_parallelism=2", "per_device_batch_size=2"],
                            slice_name="v5p-64")
    s = result.scenario
    assert (s["pod"]["slices"], s["pod"]["dcn_mesh"]) == (8, {"data": 4, "fsdp": 2})
    assert s["training"]["global_batch"] == 2 * 32 * 8
    plan = build_plan(parse_scenario(s), timing_only=True)
    assert plan.topology.chips == 256 and plan.mesh.sizes == {"data": 4, "fsdp": 64}
    assert plan.mesh.dcn_sizes == {"data": 4, "fsdp": 2}


@pytest.mark.parametrize("keys, needle", [
    (["num_slices=2", "dcn_data_parallelism=3"],
     "dcn_*_parallelism: data 3 across slices does not make the 2 slices of num_slices = 2"),
    (["num_slices=4", "dcn_fsdp_parallelism=-1"],
     "dcn_fsdp_parallelism: -1 for both data and fsdp; MaxText fills at most one DCN axis"),
    (["num_slices=0"], "num_slices: 0 is not a number of slices"),
    (["num_slices=2", "compile_topology_num_slices=4"],
     "num_slices: 2 and compile_topology_num_slices: 4 disagree"),
    (["ici_pipeline_parallelism=4", "ici_fsdp_parallelism=-1", "num_pipeline_repeats=3"],
     "num_pipeline_repeats: 3 x ici_pipeline_parallelism 4 x num_layers_per_pipeline_stage 1 "
     "is not the 32 decoder layers"),
])
def test_mistakes_across_slices_and_stages_are_one_line(keys, needle):
    with pytest.raises(ScenarioError) as err:
        import_maxtext([BASE_2025, MODELS / "llama2-7b.yml"], keys, slice_name="v5p-64")
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("keys, needle", [
    (["num_slices=2", "dcn_expert_parallelism=2", "dcn_data_parallelism=1"],
     "dcn_expert_parallelism: 2 (command line): an expert axis across slices"),
    (["num_slices=2", "dcn_pipeline_parallelism=2", "dcn_data_parallelism=1"],
     "dcn_pipeline_parallelism: 2 (command line): pipeline stages in different slices"),
    (["dcn_sequence_parallelism=2"], "dcn_sequence_parallelism: 2 (command line): the mesh has "
                                     "no sequence axis"),
    (["ici_pipeline_parallelism=2", "ici_fsdp_parallelism=-1", "pipeline_parallel_layers=16"],
     "pipeline_parallel_layers: 16 (command line): a pipeline of some layers only"),
])
def test_axes_across_slices_that_are_not_modelled_are_errors(keys, needle):
    result = import_maxtext([BASE_2025, MODELS / "llama2-7b.yml"], keys, slice_name="v5p-64")
    assert any(needle in n.text for n in result.of("error")), [n.text for n in result.notes]


def test_the_pipeline_keys_map_to_the_stage_axis_and_maxtexts_schedule():
    """ici_pipeline_parallelism 4 on LLaMA-2 7B's 32 layers: with num_pipeline_repeats -1
    MaxText sets the repeats to 32 / (4 x 1) = 8, a circular pipeline of one layer per
    stage per repeat; num_layers_per_pipeline_stage 8 leaves one repeat: GPipe; the
    microbatches are num_pipeline_microbatches (-1: the stages, our default, so none is
    written). Each imports to a scenario that plans."""
    base = [BASE_2025, MODELS / "llama2-7b.yml"]
    common = ["ici_pipeline_parallelism=4", "ici_fsdp_parallelism=-1", "per_device_batch_size=2"]
    circular = import_maxtext(base, [*common, "num_pipeline_microbatches=8"],
                              slice_name="v5p-64").scenario
    assert circular["pod"]["mesh"] == {"stage": 4, "fsdp": 8}
    assert {k: circular["training"].get(k) for k in
            ("microbatches", "pipeline_schedule", "pipeline_repeats")} == \
        {"microbatches": 8, "pipeline_schedule": "circular", "pipeline_repeats": 8}
    gpipe = import_maxtext(base, [*common, "num_layers_per_pipeline_stage=8"],
                           slice_name="v5p-64").scenario
    assert "microbatches" not in gpipe["training"]
    assert "pipeline_schedule" not in gpipe["training"]     # gpipe, the default
    assert "pipeline_fsdp_ag_once" not in gpipe["training"]   # false, the default
    once = import_maxtext(base, [*common, "num_layers_per_pipeline_stage=8",
                                 "pipeline_fsdp_ag_once=true"], slice_name="v5p-64")
    assert once.scenario["training"]["pipeline_fsdp_ag_once"] is True
    assert not [n.text for n in once.notes if "pipeline_fsdp_ag_once" in n.text]
    for s in (circular, gpipe, once.scenario):
        plan = build_plan(parse_scenario(s), timing_only=True)
        assert plan.mesh.sizes == {"stage": 4, "fsdp": 8}
        assert plan.global_batch == 64  # 2 per device x 32 devices; 8 per microbatch
    assert plan.training.pipeline_fsdp_ag_once


def _cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(args))
        except SystemExit as exit_:
            code = int(exit_.code or 0)
    return code, out.getvalue(), err.getvalue()


def test_the_cli_writes_a_multislice_scenario_that_plans(tmp_path):
    out = tmp_path / "m2.yaml"
    code, _, err = _cli("import-maxtext", str(BASE_2023), *T1, "dcn_data_parallelism=2",
                        "--slice", "v5p-128", "-o", str(out))
    assert code == 0, err
    assert err.strip().splitlines()[-1] == (
        f"Wrote {out}: ok (2 x v5p-128, mesh {{data: 2, fsdp: 16, tensor: 4}}, "
        f"32,548,136,960 parameters, global batch 1,024); cost a step with: tpu-pod sweep {out}")
    written = yaml.safe_load(out.read_text())
    assert written["name"] == "maxtext-s32-2x-v5p-128"
    assert written["pod"]["slices"] == 2 and written["pod"]["dcn_mesh"] == {"data": 2}

"""Suggestions are checked before they are offered (issue 33 item 6): a mesh the error
suggests validates for the model it is suggested to (``{fsdp: 3}`` on the CNN suggested
``{data: 1, fsdp: 8}``, which only the transformer runs), and ``describe llama2_7b``
says which preset it meant, as ``plan`` does."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

import pod
from pod.cli import cli

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("scenario, mesh", [
    ("quickstart.yaml", "{fsdp: 3}"), ("quickstart.yaml", "{data: 3}"),
    ("transformer-sharded.yaml", "{fsdp: 3}"), ("transformer-sharded.yaml", "{tensor: 3}"),
])
def test_every_suggested_mesh_validates(scenario, mesh):
    path = ROOT / "scenarios" / scenario
    with pytest.raises(pod.ScenarioError) as err:
        pod.validate(path, overrides=[f"pod.mesh={mesh}"])
    suggested = re.search(r"\(e\.g\. (.*?)\)", str(err.value)).group(1)
    meshes = re.findall(r"\{[^}]*\}", suggested)
    assert meshes, str(err.value)
    for good in meshes:
        pod.validate(path, overrides=[f"pod.mesh={good}"])  # raises if refused


def test_describe_says_which_preset_it_meant():
    out = CliRunner().invoke(cli, ["describe", "llama2_7b"])  # main() makes it one line, exit 2
    assert isinstance(out.exception, pod.ScenarioError)
    assert str(out.exception).startswith("llama2_7b: not a chip, a slice, a scenario file or a "
                                         "model preset; did you mean llama2-7b?")


def test_a_refusal_names_the_layer_input_offloaded_when_no_named_policy_fits():
    """T6 (Llama 3.1 70B on v6e-64, fsdp 64, 2 x 8192 per device) ran with the layer input
    offloaded; under full remat it does not fit, nor under any named policy (all keep the
    layer input in HBM): the refusal names the custom choice that fits, and it validates."""
    from pod.errors import HBMPlanError
    from pod.workloads.remat import LAYER_INPUT_OFFLOADED_VARIANT, REMAT_POLICIES

    path = ROOT / "scenarios" / "maxtext-t6-llama3.1-70b-v6e-64.yaml"
    for policy in (p for p in REMAT_POLICIES if p != "custom"):
        with pytest.raises(HBMPlanError) as err:
            pod.validate(path, overrides=[f"model.options.remat={policy}",
                                          "model.options.remat_custom="])
    assert str(err.value).endswith("; remat custom with remat_custom {decoder_layer_input: "
                                   "offload} fits (27.5 GiB per device)"), str(err.value)
    assert err.value.fits_with == f"remat {LAYER_INPUT_OFFLOADED_VARIANT}"
    again = pickle.loads(pickle.dumps(err.value))  # a plan's worker process sends it back
    assert (str(again), again.fits_with) == (str(err.value), err.value.fits_with)
    plan = pod.validate(path, overrides=["model.options.remat_custom={decoder_layer_input: "
                                         "offload}"])
    assert plan.memory["total"] <= plan.topology.chip.hbm_bytes


def test_a_plan_says_how_many_refused_points_fit_with_the_layer_input_offloaded(tmp_path):
    """T6's model, mesh and batch under full remat: the plan drops the point, its row says
    what fits it (results.csv's fits_with) and the summary line counts it with the keys
    that search it."""
    from pod.commands.plan import PlanRequest, run_plan

    result = run_plan(PlanRequest(model="llama3.1-70b", slices=("v6e-64",), mesh_axes=("fsdp",),
                                  remat=("full",), per_device_batches=(2,)),
                      output_dir=tmp_path / "o")
    (row,) = result.rows
    assert (row["status"], row["fits"]) == ("dropped", False)
    assert row["fits_with"] == "remat custom with remat_custom {decoder_layer_input: offload}"
    assert ("(1 does not fit in HBM; 1 of them fit with the layer input offloaded: "
            "remat_policy=custom decoder_layer_input=offload)") in result.summary()

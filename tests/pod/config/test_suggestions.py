"""Suggestions are checked before they are offered (issue 33 item 6): a mesh the error
suggests validates for the model it is suggested to (``{fsdp: 3}`` on the CNN suggested
``{data: 1, fsdp: 8}``, which only the transformer runs), and ``describe llama2_7b``
says which preset it meant, as ``plan`` does."""

from __future__ import annotations

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

"""The Python API (``import pod``): the README's notebook example, scenarios as
paths, YAML text and dicts, values instead of printing, no files unless asked.
Runs are in process (``in_process=True``: the same program and clock as chip
actors); one run on Ray in the slow tier."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pod
from pod.errors import ScenarioError, ShardingError

ROOT = Path(__file__).resolve().parents[2]
SMALL = {"name": "api-test", "pod": {"slice": "v2-8"},
         "model": {"name": "mlp", "options": {"hidden": [16]}},
         "data": {"name": "digits"}, "training": {"global_batch": 64, "steps": 3}}


def test_import_pod_is_light_and_lists_its_api():
    out = subprocess.run([sys.executable, "-c", "import sys, pod; print('ray' in sys.modules); "
                          "print(sorted(pod.__all__) == sorted(dir(pod)))"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"]
    for name in pod.__all__:
        assert getattr(pod, name) is not None, name


def test_the_readme_example(tmp_path, monkeypatch, capsys):
    """``result = pod.run("scenarios/quickstart.yaml", steps=5, quiet=True)``: nothing
    printed, nothing written, a summary and one typed record per step."""
    monkeypatch.chdir(ROOT)
    before = set((ROOT / "runs").glob("*")) if (ROOT / "runs").exists() else set()
    result = pod.run("scenarios/quickstart.yaml", steps=5, quiet=True, in_process=True)
    assert capsys.readouterr().out == ""
    after = set((ROOT / "runs").glob("*")) if (ROOT / "runs").exists() else set()
    assert after == before and result.output_dir is None
    assert result.summary["steps"] == 5 and result.summary["completed"] is True
    assert len(result.history) == 5
    assert [s.step for s in result.history] == [0, 1, 2, 3, 4]
    assert result.history[0].loss == pytest.approx(result.summary["initial_loss"])
    assert result.history[-1].loss == pytest.approx(result.summary["final_loss"])
    # the summary's step time is the mean of the history's steps after the first
    assert result.summary["simulated_step_seconds"] == pytest.approx(
        np.mean([s.step_seconds for s in result.history[1:]]))
    png = tmp_path / "run.png"
    result.plot(png)
    assert png.stat().st_size > 1000


def test_yaml_text_and_dict_give_the_same_plan_and_files_only_when_asked(tmp_path):
    import yaml

    text = yaml.safe_dump(SMALL)
    a, b = pod.validate(SMALL), pod.validate(text)
    assert (a.per_device_batch, a.steps, a.ici.algorithm, a.memory) == \
           (b.per_device_batch, b.steps, b.ici.algorithm, b.memory)
    result = pod.run(text, quiet=True, output_dir=tmp_path / "out", in_process=True)
    assert (tmp_path / "out" / "summary.json").is_file()
    assert len((tmp_path / "out" / "steps.csv").read_text().splitlines()) == 1 + 3
    assert len(result.history) == 3


def test_yaml_text_longer_than_a_file_name_is_text():
    """A scenario file's whole text (comments and all, longer than the OS allows a file
    name) loads as YAML text, as a path to that file does."""
    path = ROOT / "scenarios" / "transformer-sharded.yaml"
    text = path.read_text()
    assert len(text) > 255  # NAME_MAX
    assert pod.load(text) == pod.load(path)


def test_describe_returns_values_and_errors_are_one_line():
    d = pod.describe(SMALL)
    assert d.memory["total"] == sum(v for k, v in d.memory.items() if k != "total")
    assert "dense1 (dense)" in d.model_summary and d.plan.topology.chips == 4
    with pytest.raises(ShardingError, match=r"training\.global_batch: global batch 65 does not "
                                            r"split over data x fsdp = 8 devices"):
        pod.validate({**SMALL, "training": {"global_batch": 65, "steps": 1}})
    with pytest.raises(ScenarioError, match="scenario: expected a path"):
        pod.load(42)


def _mlp_from_layers(name: str, input_shape=(8, 8, 1)) -> pod.workloads.Model:
    """SMALL's named mlp (hidden [16]) rebuilt layer by layer from pod.workloads."""
    from pod.workloads import Dense, Flatten, Model, ReLU
    return Model(name, [Flatten("flatten"), Dense(16, "dense1"), ReLU("relu1"),
                        Dense(10, "dense2")], input_shape=input_shape, num_classes=10)


def test_a_custom_model_trains_like_the_named_model_it_equals():
    """A model built from layers replaces the scenario's: the same stack as the named
    mlp gives the same losses bit for bit (same parameters from the seed, same ops);
    the summary names the custom model."""
    named = pod.run(SMALL, quiet=True, in_process=True)
    custom = pod.run(SMALL, quiet=True, model=_mlp_from_layers("my-mlp"), in_process=True)
    assert custom.summary["model"] == "my-mlp" and named.summary["model"] == "mlp"
    assert [s.loss for s in custom.history] == [s.loss for s in named.history]
    assert custom.summary["test_loss"] == named.summary["test_loss"]
    assert custom.summary["simulated_step_seconds"] == named.summary["simulated_step_seconds"]


def test_a_custom_model_that_does_not_fit_is_one_line():
    with pytest.raises(ScenarioError, match=r"^model: the custom model wide does not fit digits "
                                            r"data: wide: inputs must be \(B, 28, 28, 1\), got \(\d+, 8, 8, 1\)"):
        pod.run(SMALL, quiet=True, model=_mlp_from_layers("wide", input_shape=(28, 28, 1)))
    with pytest.raises(ScenarioError, match="^model: a custom model must be a "
                                            "pod.workloads.Model, got str"):
        pod.run(SMALL, quiet=True, model="mlp")
    sharded = {**SMALL, "pod": {"chip": "v5e", "chips": 4, "mesh": {"data": 2, "fsdp": 2}}}
    with pytest.raises(ScenarioError, match=r"^pod.mesh: .*a custom model \(my-mlp\) trains "
                                            r"data parallel only"):
        pod.run(sharded, quiet=True, model=_mlp_from_layers("my-mlp"))


@pytest.mark.slow
def test_a_run_on_ray_chip_actors_returns_what_the_in_process_run_returns(ray_cluster):
    """``pod.run`` without ``in_process`` (chip actors, the README's call): the same
    summary figures of the simulated clock as in process, the losses to float32
    rounding (a ring of 8 adds in another order)."""
    ray = pod.run(SMALL, quiet=True)
    local = pod.run(SMALL, quiet=True, in_process=True)
    for key in ("steps", "simulated_step_seconds", "mfu", "collective_seconds",
                "collectives_by_axis", "hbm_peak_bytes", "replicas_identical"):
        assert ray.summary[key] == local.summary[key], key
    assert [s.loss for s in ray.history] == pytest.approx([s.loss for s in local.history],
                                                          rel=1e-5)

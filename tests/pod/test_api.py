"""The Python API (``import pod``): the README's notebook example, scenarios as
paths, YAML text and dicts, values instead of printing, no files unless asked."""

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


def test_the_readme_example(ray_cluster, tmp_path, monkeypatch, capsys):
    """``result = pod.run("scenarios/quickstart.yaml", steps=5, quiet=True)``: nothing
    printed, nothing written, a summary and one typed record per step."""
    monkeypatch.chdir(ROOT)
    before = set((ROOT / "runs").glob("*")) if (ROOT / "runs").exists() else set()
    result = pod.run("scenarios/quickstart.yaml", steps=5, quiet=True)
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


def test_yaml_text_and_dict_give_the_same_plan_and_files_only_when_asked(ray_cluster, tmp_path):
    import yaml

    text = yaml.safe_dump(SMALL)
    a, b = pod.validate(SMALL), pod.validate(text)
    assert (a.per_core_batch, a.steps, a.ici.algorithm, a.memory) == \
           (b.per_core_batch, b.steps, b.ici.algorithm, b.memory)
    result = pod.run(text, quiet=True, output_dir=tmp_path / "out")
    assert (tmp_path / "out" / "summary.json").is_file()
    assert len((tmp_path / "out" / "steps.csv").read_text().splitlines()) == 1 + 3
    assert len(result.history) == 3


def test_describe_returns_values_and_errors_are_one_line():
    d = pod.describe(SMALL)
    assert d.memory["total"] == sum(v for k, v in d.memory.items() if k != "total")
    assert "dense1 (dense)" in d.model_summary and d.plan.pod.chips == 4
    with pytest.raises(ShardingError, match=r"training\.global_batch: global batch 65 is not "
                                            r"divisible by 8 TensorCores"):
        pod.validate({**SMALL, "training": {"global_batch": 65, "steps": 1}})
    with pytest.raises(ScenarioError, match="scenario: expected a path"):
        pod.load(42)

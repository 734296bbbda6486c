"""A command that fails changes no earlier result (issue 26, item 1): a run whose pod
does not start leaves the earlier run's steps.csv, layers.csv and summary.json in its
output directory as they were. In process, no Ray."""

from __future__ import annotations

import pytest
import yaml
from rich.console import Console

from pod.commands.train import Run
from pod.config.plan import build_plan
from pod.config.scenario import parse_scenario
from pod.errors import ClusterError

SCENARIO = {"name": "failed-start", "pod": {"slice": "v2-8"},
            "model": {"name": "mlp", "options": {"hidden": [16], "dropout": False}},
            "data": {"name": "digits"}, "training": {"global_batch": 64, "steps": 2},
            "metrics": {"port": 0}}


def _run(out):
    plan = build_plan(parse_scenario(yaml.safe_load(yaml.safe_dump(SCENARIO))))
    return Run(plan, output_dir=out, console=Console(quiet=True), backend="local").run()


@pytest.mark.usefixtures("one_blas_thread")
def test_a_run_that_fails_to_start_keeps_the_earlier_runs_files(tmp_path, monkeypatch):
    from pod.runtime.local import LocalPod

    _run(tmp_path)
    names = ("steps.csv", "layers.csv", "summary.json")
    before = {n: (tmp_path / n).read_bytes() for n in names}
    assert before["steps.csv"].count(b"\n") == 3  # the header and two steps

    def fail(self, *args, **kwargs):
        raise ClusterError("ray: the local Ray cluster did not start (test)")

    monkeypatch.setattr(LocalPod, "start", fail)
    with pytest.raises(ClusterError):
        _run(tmp_path)
    assert {n: (tmp_path / n).read_bytes() for n in names} == before

"""Probe of issue 26: `metrics: {host: 0.0.0.0}` was accepted silently. Serving metrics
beyond loopback now needs `metrics.expose: true`, and the run prints a warning."""

from __future__ import annotations

import pytest

from pod.config.scenario import is_loopback, parse_scenario
from pod.errors import ScenarioError

BASE = {"name": "x", "pod": {"slice": "v2-8"}, "model": {"name": "mlp"},
        "training": {"global_batch": 64, "steps": 1}}


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.3.4.5", True),
                                            ("localhost", True), ("::1", True),
                                            ("0.0.0.0", False), ("::", False),
                                            ("192.168.1.5", False), ("example.org", False)])
def test_what_counts_as_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_a_host_beyond_loopback_needs_expose():
    with pytest.raises(ScenarioError, match=r"metrics\.host: '0\.0\.0\.0' is beyond loopback.*"
                                            r"metrics\.expose: true"):
        parse_scenario({**BASE, "metrics": {"host": "0.0.0.0"}})
    spec = parse_scenario({**BASE, "metrics": {"host": "0.0.0.0", "expose": True}})
    assert spec.metrics.expose and spec.metrics.host == "0.0.0.0"
    assert not parse_scenario(BASE).metrics.expose


def test_an_exposed_run_prints_a_warning(tmp_path, monkeypatch, capsys):
    from pod.commands.train import Run
    from pod.config.plan import build_plan
    from pod.report.metrics import PodMetrics

    def serve(self, port, host="127.0.0.1"):  # no real socket on 0.0.0.0 in a test
        self.port = port
        return port

    monkeypatch.setattr(PodMetrics, "serve", serve)
    plan = build_plan(parse_scenario({**BASE, "metrics": {"host": "0.0.0.0", "expose": True,
                                                          "port": 9999}}))
    run = Run(plan, output_dir=tmp_path / "out")
    run.start_metrics()
    run.locks.release()
    out = capsys.readouterr().out
    assert "warning: metrics.expose: serving metrics on 0.0.0.0, beyond loopback" in out


def test_a_bad_metrics_host_is_named_as_the_host_not_the_port():
    from pod.errors import MetricsError
    from pod.report.metrics import PodMetrics

    metrics = PodMetrics(scenario="x", generation="v2", slice_name="v2-8", topology="2x2",
                         links=[], chips=1, devices_per_chip=2, dataset="d", synthetic=True)
    with pytest.raises(MetricsError, match=r"^metrics\.host: cannot serve on 'no such host!'"):
        metrics.serve(9999, "no such host!")

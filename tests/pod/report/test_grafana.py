"""The Grafana folder: provisioning files, the dashboard, and its generator."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pod.report.metrics import PodMetrics

ROOT = Path(__file__).resolve().parents[3]
GRAFANA = ROOT / "monitoring" / "grafana"
PROVISIONING = GRAFANA / "provisioning"
DASHBOARD = GRAFANA / "tpu-pod-dashboard.json"


def _load(path: Path) -> dict:
    doc = yaml.safe_load(path.read_text())
    assert isinstance(doc, dict), path
    return doc


def _generator():
    spec = importlib.util.spec_from_file_location("make_dashboard", GRAFANA / "make_dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_datasource_provisioning_follows_grafana_v1():
    files = sorted((PROVISIONING / "datasources").glob("*.yaml"))
    assert [f.name for f in files] == ["prometheus.yaml"]
    doc = _load(files[0])
    assert doc["apiVersion"] == 1
    (source,) = doc["datasources"]
    assert {"name", "type", "uid", "url", "access"} <= set(source)
    assert source["type"] == "prometheus" and source["access"] == "proxy"
    # the Prometheus `tpu-pod monitor` starts by default
    assert source["url"] == "http://127.0.0.1:9090"


def test_dashboard_provisioning_points_at_the_dashboard_json():
    files = sorted((PROVISIONING / "dashboards").glob("*.yaml"))
    assert len(files) == 1
    doc = _load(files[0])
    assert doc["apiVersion"] == 1
    (provider,) = doc["providers"]
    assert {"name", "type", "options"} <= set(provider) and provider["type"] == "file"
    # relative to the directory Grafana starts from: the one holding monitoring/
    path = Path(provider["options"]["path"])
    assert not path.is_absolute()
    assert (ROOT / path / DASHBOARD.name).is_file()


def test_every_panel_uses_the_provisioned_datasource_and_the_run_variables():
    dash = json.loads(DASHBOARD.read_text())
    assert "__inputs" not in dash  # nothing to fill in on import
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert {"datasource", "scenario", "instance"} <= set(variables)
    (source,) = _load(PROVISIONING / "datasources" / "prometheus.yaml")["datasources"]
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["current"]["value"] == source["uid"]
    for name in ("scenario", "instance"):
        assert variables[name]["datasource"]["uid"] == "${datasource}"
        assert "tpu_pod_info" in variables[name]["definition"]
    assert "$scenario" in variables["instance"]["definition"]
    for panel in dash["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"], panel["title"]
            assert "$scenario" in target["expr"] and "$instance" in target["expr"], \
                f"{panel['title']}: {target['expr']}"


def test_dashboard_json_is_what_the_generator_writes():
    assert json.loads(DASHBOARD.read_text()) == _generator().build_dashboard(), \
        "run monitoring/grafana/make_dashboard.py and commit the JSON"


def test_info_metric_names_the_generation_and_chip_is_always_a_rank():
    metrics = PodMetrics(scenario="s", generation="v4", slice_name="v4-8", topology="2x2x1",
                         chips=1, devices_per_chip=1)
    text = generate_latest(metrics.registry).decode()
    (info,) = [s for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "tpu_pod_info"]
    assert info.labels["generation"] == "v4" and "chip" not in info.labels
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "chip" in sample.labels:
                assert sample.labels["chip"].isdigit(), sample


def test_dashboard_shows_the_renamed_info_label():
    dash = json.loads(DASHBOARD.read_text())
    legends = [t["legendFormat"] for p in dash["panels"] for t in p["targets"]
               if t["expr"].startswith("last_over_time(tpu_pod_info{")]
    assert legends and all("{{generation}}" in text for text in legends)

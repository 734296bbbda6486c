"""Writes tpu-pod-dashboard.json next to this file; edit the panels here, not in the JSON.

Run it from anywhere: ``.venv/bin/python monitoring/grafana/make_dashboard.py``.

Every query is narrowed to the runs chosen in the ``scenario`` and ``instance``
variables: a metric is kept only where ``tpu_pod_info`` of the same target
(``instance``, ``job``) names a chosen scenario, so two runs, or two scenarios,
can be told apart. A run's values are read with ``last_over_time`` over ``KEEP``, so
a short run (the quick start ends within one 5 s scrape interval) and a run that has
ended read their last scraped values instead of nothing; per-step figures divide two
counters (seconds so far / steps so far) and quantiles read the run's histogram so far,
never a ``rate`` that a run shorter than two scrapes leaves empty or wrong. The data source is the ``datasource`` variable, whose default
is the data source of ``provisioning/datasources/prometheus.yaml`` (uid
``tpu-pod-prometheus``): a Grafana provisioned from this folder shows the
dashboard with no clicks; one where the dashboard is imported by hand picks its
own Prometheus in the variable.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["DATASOURCE_UID", "build_dashboard", "main"]

DATASOURCE_UID = "tpu-pod-prometheus"  # the uid in provisioning/datasources/prometheus.yaml
DS = {"type": "prometheus", "uid": "${datasource}"}
OUTPUT = Path(__file__).with_name("tpu-pod-dashboard.json")

#: how long after its last scrape a run's values stay on the panels
KEEP = "10m"
# the chosen runs: tpu_pod_info of a chosen scenario on a chosen instance, kept KEEP
_INFO = 'tpu_pod_info{scenario=~"$scenario", instance=~"$instance"}'
_RUNS = f"last_over_time({_INFO}[{KEEP}])"


def run(metric: str, window: str | None = None) -> str:
    """A metric of the chosen runs only: its last value within ``KEEP``.

    Args:
        metric: a metric name, e.g. ``tpu_pod_mfu_ratio``.
        window: a range such as ``1m``: the per-second ``rate`` over it instead of the
            value (for figures per WALL second only: a run's simulated figures never
            need one).

    Returns:
        A PromQL expression keeping the metric's own labels (``instance`` among them).
    """
    series = f'{metric}{{instance=~"$instance"}}'
    series = f"rate({series}[{window}])" if window else f"last_over_time({series}[{KEEP}])"
    return f"({series} and on (instance, job) {_RUNS})"


def quantile(q: float, histogram: str) -> str:
    """The q-quantile of a histogram over the run so far, per run."""
    return f"histogram_quantile({q}, sum by (instance, le) {run(histogram + '_bucket')})"


def per_step(counter: str, by: str = "") -> str:
    """A counter's mean per training step over the run so far (the counter over
    ``tpu_pod_steps_total``), per run (and per ``by`` label)."""
    labels = f"instance, {by}" if by else "instance"
    return (f"sum by ({labels}) {run(counter)} / on (instance) group_left "
            f"sum by (instance) {run('tpu_pod_steps_total')}")


def _panel(panels: list[dict[str, Any]], title: str, kind: str, exprs: list[str], x: int, y: int,
           w: int = 12, h: int = 8, unit: str | None = None, stack: bool = False,
           legend: list[str] | None = None, extra: dict[str, Any] | None = None) -> None:
    targets = [{"refId": chr(65 + i), "expr": e, "legendFormat": (legend[i] if legend else ""),
                "datasource": DS} for i, e in enumerate(exprs)]
    p: dict[str, Any]  # a Grafana panel (JSON)
    p = {"id": len(panels) + 1, "title": title, "type": kind, "datasource": DS,
         "gridPos": {"x": x, "y": y, "w": w, "h": h}, "targets": targets,
         "fieldConfig": {"defaults": {}, "overrides": []}, "options": {}}
    if unit:
        p["fieldConfig"]["defaults"]["unit"] = unit
    if stack:
        p["fieldConfig"]["defaults"]["custom"] = {"stacking": {"mode": "normal", "group": "A"},
                                                  "fillOpacity": 60}
    if extra:
        p.update(extra)
    panels.append(p)


def _panels() -> list[dict[str, Any]]:
    panels: list[dict[str, Any]] = []
    last = {"options": {"reduceOptions": {"calcs": ["lastNotNull"]}}}
    _panel(panels, "Throughput (simulated examples/s)", "timeseries",
           [run("tpu_pod_simulated_examples_per_second")], 0, 0, legend=["{{instance}}"],
           unit="short")
    _panel(panels, "MFU (simulated)", "gauge", [run("tpu_pod_mfu_ratio")], 12, 0, w=6,
           unit="percentunit", legend=["{{instance}}"], extra=last)
    _panel(panels, "Model FLOP/s (simulated)", "stat", [run("tpu_pod_simulated_flops_per_second")],
           18, 0, w=6, unit="flops", legend=["{{instance}}"], extra=last)
    _panel(panels, "Step time breakdown (simulated)", "timeseries",
           [run("tpu_pod_simulated_step_part_seconds")], 0, 8, unit="s", stack=True,
           legend=["{{instance}} {{part}}"])
    _panel(panels, "Step time quantiles over the run (simulated)", "timeseries",
           [quantile(0.5, "tpu_pod_simulated_step_seconds"),
            quantile(0.99, "tpu_pod_simulated_step_seconds"),
            quantile(0.5, "tpu_pod_simulated_collective_seconds")],
           12, 8, unit="s",
           legend=["{{instance}} step p50", "{{instance}} step p99",
                   "{{instance}} collectives p50"])
    _panel(panels, "Loss and test accuracy", "timeseries",
           [run("tpu_pod_loss"), run("tpu_pod_test_accuracy_ratio")], 0, 16,
           legend=["{{instance}} training loss", "{{instance}} test accuracy"])
    _panel(panels, "HBM in use per chip", "bargauge",
           [f"sum by (instance, chip) {run('tpu_pod_hbm_used_bytes')} / "
            f"sum by (instance, chip) {run('tpu_pod_hbm_capacity_bytes')}"],
           12, 16, unit="percentunit", legend=["{{instance}} chip {{chip}}"],
           extra={"options": {"orientation": "horizontal",
                              "reduceOptions": {"calcs": ["lastNotNull"]}}})
    _panel(panels, "ICI heat map: utilisation per directed link (simulated)", "status-history",
           [run("tpu_pod_ici_link_utilization_ratio")], 0, 24, w=24, h=10,
           legend=["{{instance}} {{link}}"],
           extra={"fieldConfig": {"defaults": {"unit": "percentunit", "min": 0, "max": 1,
                                               "color": {"mode": "continuous-GrYlRd"}},
                                  "overrides": []}})
    _panel(panels, "ICI traffic: bytes per WALL second of emulation", "timeseries",
           [f"sum by (instance, link) {run('tpu_pod_ici_transferred_bytes_total', '1m')}"],
           0, 34, unit="Bps", legend=["{{instance}} {{link}}"])
    _panel(panels, "MXU utilisation per device (simulated)", "timeseries",
           [run("tpu_pod_mxu_utilization_ratio")], 12, 34, unit="percentunit",
           legend=["{{instance}} chip {{chip}} core {{core}}"])
    _panel(panels, "Emulation: wall time per step and slowdown", "timeseries",
           [quantile(0.5, "tpu_pod_wall_step_seconds"), run("tpu_pod_emulation_slowdown_ratio")],
           0, 42, legend=["{{instance}} wall step p50 (s)", "{{instance}} wall / simulated"])
    _panel(panels, "Collectives per mesh axis: simulated seconds per step (run mean)",
           "timeseries",
           [per_step("tpu_pod_collective_seconds_total", "axis"),
            per_step("tpu_pod_collective_exposed_seconds_total", "axis")],
           0, 50, unit="s", legend=["{{instance}} {{axis}}", "{{instance}} {{axis}} exposed"])
    _panel(panels, "Collectives hidden behind compute (simulated)", "timeseries",
           [run("tpu_pod_collective_overlap_ratio")], 12, 50, unit="percentunit",
           legend=["{{instance}}"])
    _panel(panels, "Steps and examples", "stat",
           [run("tpu_pod_steps_total"), run("tpu_pod_examples_total"), _RUNS], 12, 42,
           legend=["{{instance}} steps", "{{instance}} examples",
                   "{{scenario}}: {{generation}} {{slice}} {{topology}}"], extra=last)
    return panels


def _variables() -> list[dict[str, Any]]:
    datasource = {"name": "datasource", "label": "Prometheus", "type": "datasource",
                  "query": "prometheus", "hide": 0,
                  "current": {"text": "Prometheus (tpu-pod)", "value": DATASOURCE_UID}}

    def query(name: str, expr: str) -> dict[str, Any]:
        return {"name": name, "label": name, "type": "query", "datasource": DS,
                "query": {"query": expr, "refId": f"{name}-values"}, "definition": expr,
                "refresh": 2, "multi": True, "includeAll": True, "allValue": ".*",
                "current": {"text": ["All"], "value": ["$__all"]}, "sort": 1, "hide": 0}

    return [datasource,
            query("scenario", "label_values(tpu_pod_info, scenario)"),
            query("instance", 'label_values(tpu_pod_info{scenario=~"$scenario"}, instance)')]


def build_dashboard() -> dict[str, Any]:
    """The dashboard as Grafana's JSON model (schema version 39)."""
    return {
        "uid": "tpu-pod-emulator",
        "title": "TPU pod emulator",
        "description": "An emulated TPU pod: simulated throughput, MFU, step breakdown, HBM and "
                       "ICI, per scenario and instance.",
        "tags": ["tpu", "tpu-pod-emulator"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "5s",
        "time": {"from": "now-15m", "to": "now"},
        "templating": {"list": _variables()},
        "annotations": {"list": []},
        "panels": _panels(),
    }


def main() -> None:
    """Write the dashboard JSON next to this file."""
    OUTPUT.write_text(json.dumps(build_dashboard(), indent=2) + "\n")


if __name__ == "__main__":
    main()

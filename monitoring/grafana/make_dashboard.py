"""Writes monitoring/grafana/tpu-pod-dashboard.json (run from the repository root):
    .venv/bin/python monitoring/grafana/make_dashboard.py
Edit the panels here, not in the JSON."""
import json
DS = {"type": "prometheus", "uid": "${datasource}"}
panels = []
def panel(title, kind, exprs, x, y, w=12, h=8, unit=None, stack=False, legend=None, extra=None):
    targets = [{"refId": chr(65 + i), "expr": e, "legendFormat": (legend[i] if legend else ""),
                "datasource": DS} for i, e in enumerate(exprs)]
    p = {"id": len(panels) + 1, "title": title, "type": kind, "datasource": DS,
         "gridPos": {"x": x, "y": y, "w": w, "h": h}, "targets": targets,
         "fieldConfig": {"defaults": {}, "overrides": []}, "options": {}}
    if unit:
        p["fieldConfig"]["defaults"]["unit"] = unit
    if stack:
        p["fieldConfig"]["defaults"]["custom"] = {"stacking": {"mode": "normal", "group": "A"},
                                                  "fillOpacity": 60}
    if extra:
        for k, v in extra.items():
            p[k] = v
    panels.append(p)
panel("Throughput (simulated examples/s)", "timeseries",
      ["tpu_pod_simulated_examples_per_second"], 0, 0, legend=["{{instance}}"], unit="short")
panel("MFU (simulated)", "gauge", ["tpu_pod_mfu_ratio"], 12, 0, w=6, unit="percentunit",
      extra={"options": {"reduceOptions": {"calcs": ["lastNotNull"]}}})
panel("Model FLOP/s (simulated)", "stat", ["tpu_pod_simulated_flops_per_second"], 18, 0, w=6,
      unit="flops", extra={"options": {"reduceOptions": {"calcs": ["lastNotNull"]}}})
panel("Step time breakdown (simulated)", "timeseries",
      ["tpu_pod_simulated_step_part_seconds"], 0, 8, unit="s", stack=True, legend=["{{part}}"])
panel("Step time quantiles (simulated)", "timeseries",
      ["histogram_quantile(0.5, sum by (le) (rate(tpu_pod_simulated_step_seconds_bucket[1m])))",
       "histogram_quantile(0.99, sum by (le) (rate(tpu_pod_simulated_step_seconds_bucket[1m])))",
       "histogram_quantile(0.5, sum by (le) (rate(tpu_pod_simulated_allreduce_seconds_bucket[1m])))"],
      12, 8, unit="s", legend=["step p50", "step p99", "allreduce p50"])
panel("Loss and test accuracy", "timeseries", ["tpu_pod_loss", "tpu_pod_test_accuracy_ratio"],
      0, 16, legend=["training loss", "test accuracy"])
panel("HBM in use per chip", "bargauge",
      ["sum by (chip) (tpu_pod_hbm_used_bytes) / sum by (chip) (tpu_pod_hbm_capacity_bytes)"],
      12, 16, unit="percentunit", legend=["chip {{chip}}"],
      extra={"options": {"orientation": "horizontal", "reduceOptions": {"calcs": ["lastNotNull"]}}})
panel("ICI heat map: utilisation per directed link (simulated)", "status-history",
      ["tpu_pod_ici_link_utilization_ratio"], 0, 24, w=24, h=10,
      unit="percentunit", legend=["{{link}}"],
      extra={"fieldConfig": {"defaults": {"unit": "percentunit", "min": 0, "max": 1,
                                          "color": {"mode": "continuous-GrYlRd"}},
                             "overrides": []}})
panel("ICI traffic: bytes per WALL second of emulation", "timeseries",
      ["sum by (link) (rate(tpu_pod_ici_transferred_bytes_total[1m]))"], 0, 34, unit="Bps",
      legend=["{{link}}"])
panel("MXU utilisation per TensorCore (simulated)", "timeseries",
      ["tpu_pod_mxu_utilization_ratio"], 12, 34, unit="percentunit",
      legend=["chip {{chip}} core {{core}}"])
panel("Emulation: wall time per step and slowdown", "timeseries",
      ["histogram_quantile(0.5, sum by (le) (rate(tpu_pod_wall_step_seconds_bucket[1m])))",
       "tpu_pod_emulation_slowdown_ratio"], 0, 42, legend=["wall step p50 (s)", "wall / simulated"])
panel("Steps and examples", "stat",
      ["tpu_pod_steps_total", "tpu_pod_examples_total", "tpu_pod_info"], 12, 42,
      legend=["steps", "examples", "{{slice}} {{topology}}"],
      extra={"options": {"reduceOptions": {"calcs": ["lastNotNull"]}}})
dash = {
    "__inputs": [{"name": "DS_PROMETHEUS", "label": "Prometheus", "type": "datasource",
                  "pluginId": "prometheus", "pluginName": "Prometheus"}],
    "uid": "tpu-pod-emulator",
    "title": "TPU pod emulator",
    "description": "An emulated TPU pod: simulated throughput, MFU, step breakdown, HBM and ICI.",
    "tags": ["tpu", "tpu-pod-emulator"],
    "timezone": "browser",
    "schemaVersion": 39,
    "version": 1,
    "editable": True,
    "refresh": "5s",
    "time": {"from": "now-15m", "to": "now"},
    "templating": {"list": [{"name": "datasource", "label": "Prometheus", "type": "datasource",
                             "query": "prometheus", "current": {}, "hide": 0}]},
    "annotations": {"list": []},
    "panels": panels,
}
open("monitoring/grafana/tpu-pod-dashboard.json", "w").write(json.dumps(dash, indent=2) + "\n")

"""Sweep rows and plots (issue 25 item 7): a failed point records its own per-device batch
(not the precision), missing numbers are NaN (empty in results.csv, null in --json), a
one-point sweep is not "strong scaling" and draws no efficiency.png, and a layout sweep's
throughput.png is a bar per layout, not a one-point series each."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math

import numpy as np
import pytest
from matplotlib.figure import Figure

from pod.commands.sweep import (COLUMNS, TEXT_COLUMNS, csv_row, is_missing, run_sweep, sweep_kind)
from pod.config.scenario import parse_scenario
from tests.pod.commands.test_timing_and_sweep import scenario as mlp_scenario

pytestmark = pytest.mark.usefixtures("one_blas_thread")


def sweep_scenario(**model):
    """A small transformer's layout sweep on a v5p-16: 2 meshes x 2 remat x 2 per-device
    batches (as tests/pod/commands/test_sharded_sweep.py's)."""
    return parse_scenario({
        "name": "layouts", "pod": {"slice": "v5p-16", "mesh": {"fsdp": 8}},
        "model": {"name": "transformer", "options": {"embed_dim": 32, "heads": 4, "head_dim": 8,
                                                     "mlp_dim": 64, "layers": 2, **model}},
        "data": {"name": "synthetic_text",
                 "options": {"vocabulary": 64, "sequence_length": 16, "num_examples": 64}},
        "training": {"global_batch": 8, "steps": 2, "optimizer": {"name": "adamw"}},
        "metrics": {"port": 0},
        "sweep": {"mode": "timing", "mesh": [{"fsdp": 8}, {"data": 2, "fsdp": 2, "tensor": 2}],
                  "remat": ["none", "full"], "per_device_batch": [1, 2], "steps": 2},
    })


def _does_not_fit_sweep():
    """{data: 8} of this model does not fit a v5e-8 chip's 16 GiB, {fsdp: 8} does
    (tests/pod/commands/test_sharded_sweep.py); 2 sequences per device."""
    return sweep_scenario(embed_dim=4096, heads=32, head_dim=128, mlp_dim=16384,
                          layers=8).with_overrides(
        pod__slice="v5e-8", pod__mesh={"fsdp": 8}, sweep__mesh=[{"data": 8}, {"fsdp": 8}],
        sweep__remat=["full"], sweep__per_device_batch=[2])


@pytest.fixture(scope="module")
def failing(tmp_path_factory):
    out = tmp_path_factory.mktemp("failing")
    return run_sweep(_does_not_fit_sweep(), out), out


def test_a_failed_point_records_its_per_device_batch_not_the_precision(failing):
    rows, out = failing
    assert [r["status"] for r in rows] == ["failed", "ok"]
    assert rows[0]["per_device_batch"] == 2 and rows[0]["precision"] == "bf16"
    assert rows[0]["mesh"] == "{data: 8}" and rows[0]["chips"] == 8
    with (out / "results.csv").open() as f:
        written = list(csv.DictReader(f))
    assert written[0]["per_device_batch"] == "2"
    assert "b=bf16" not in (out / "results.md").read_text()


def test_missing_numbers_are_nan_in_rows_and_empty_in_the_csv(failing):
    rows, out = failing
    for row in rows:
        for key in COLUMNS:
            if key not in TEXT_COLUMNS:
                assert isinstance(row[key], (int, float)) and not isinstance(row[key], bool), key
    mfu = np.array([r["mfu"] for r in rows], dtype=float)  # '' would raise here, as in pandas
    assert math.isnan(mfu[0]) and np.nanmax(mfu) == rows[1]["mfu"] > 0
    assert math.isnan(rows[0]["simulated_step_seconds"]) and is_missing(rows[0]["mfu"])
    with (out / "results.csv").open() as f:
        written = list(csv.DictReader(f))
    assert written[0]["mfu"] == "" and written[0]["simulated_step_seconds"] == ""
    assert not any(value.lower() == "nan" for row in written for value in row.values())
    assert csv_row({"a": math.nan, "b": 1, "c": ""}) == {"a": "", "b": 1, "c": ""}
    assert "| nan |" not in (out / "results.md").read_text()


def test_sweep_json_prints_null_for_a_missing_number(tmp_path):
    from pod.cli import main

    path = tmp_path / "s.yaml"
    import yaml

    path.write_text(yaml.safe_dump(_does_not_fit_sweep().model_dump()))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            pytest.raises(SystemExit) as code:
        main(["sweep", str(path), "--json", "--output-dir", str(tmp_path / "o")])
    assert code.value.code == 0, err.getvalue()
    rows = json.loads(out.getvalue())  # strict JSON: no NaN token
    assert rows[0]["mfu"] is None and rows[0]["per_device_batch"] == 2
    assert "NaN" not in out.getvalue()


def _saved_figures(monkeypatch) -> dict[str, Figure]:
    """The figures the sweep saves, by file name (``sweep._save_png`` writes every PNG)."""
    import pod.commands.sweep as sweep

    saved: dict[str, Figure] = {}
    original = sweep._save_png

    def save_png(fig, path):
        saved[path.name] = fig
        return original(fig, path)

    monkeypatch.setattr(sweep, "_save_png", save_png)
    return saved


def _titles(fig: Figure) -> list[str]:
    return [ax.get_title() for ax in fig.axes] + [fig._suptitle.get_text() if fig._suptitle else ""]


def test_a_one_point_sweep_is_not_strong_scaling_and_has_no_efficiency_plot(tmp_path, monkeypatch):
    s = mlp_scenario(pod={"slice": "v4-8"}, sweep={"steps": 2})
    assert sweep_kind(s) == "one point"
    (tmp_path / "efficiency.png").write_bytes(b"an earlier sweep's")
    saved = _saved_figures(monkeypatch)
    rows = run_sweep(s, tmp_path)
    assert len(rows) == 1 and rows[0]["status"] == "ok"
    assert not (tmp_path / "efficiency.png").exists() and "efficiency.png" not in saved
    for name, fig in saved.items():
        assert not any("scaling" in t for t in _titles(fig)), (name, _titles(fig))
    assert "(one point, timing mode)" in (tmp_path / "results.md").read_text()


def test_sweep_kind_names_what_varies():
    assert sweep_kind(mlp_scenario(sweep={"chips": [1, 2], "steps": 2})) == "strong scaling"
    assert sweep_kind(mlp_scenario(pod={"slice": "v4-8"},
                                   sweep={"global_batch": [64, 128], "steps": 2})) == \
        "a sweep of global batch"
    assert sweep_kind(sweep_scenario()) == "a sweep of mesh, remat and per-device batch"


def test_a_layout_sweep_draws_a_bar_per_layout_not_a_series_each(tmp_path, monkeypatch):
    scenario = sweep_scenario()  # 2 meshes x 2 remat x 2 per-device batches on one pod
    saved = _saved_figures(monkeypatch)
    rows = run_sweep(scenario, tmp_path)
    fig = saved["throughput.png"]
    (ax,) = fig.axes
    assert not ax.get_lines()  # no line per series
    bars = [patch for container in ax.containers for patch in container]
    assert len(ax.containers[0]) == len(rows) == 8  # one bar per layout (+ the best, redrawn)
    assert len(ax.get_legend().get_texts()) == 1 and len(bars) == 9
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels[0] == "{fsdp: 8} none b=1" and labels[-1] == "{data: 2, fsdp: 2, tensor: 2} full b=2"
    assert ax.get_xlabel() == "tokens/s (simulated)"
    widths = [patch.get_width() for patch in ax.containers[0]]
    assert widths == pytest.approx([r["simulated_tokens_per_second"] for r in rows])
    assert len(saved["breakdown.png"].axes) == 1  # one panel, not one per layout
    assert not any("scaling" in t for t in _titles(fig))

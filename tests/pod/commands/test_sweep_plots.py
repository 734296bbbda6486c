"""Sweep plots put the quantity the sweep varies on the x axis: a batch study (one pod,
three global batches) plots against the batch and writes no efficiency plot (1 by
definition at one pod size); a chips sweep plots against chips, one series per
algorithm, with the chip counts as tick labels (thousands separators)."""

from __future__ import annotations

from pod.commands.sweep import _series, _tick_label, _x_axis, run_sweep
from tests.pod.commands.test_timing_and_sweep import scenario


def test_a_batch_study_is_plotted_against_the_batch(tmp_path):
    s = scenario(pod={"slice": "v4-8"}, sweep={"global_batch": [64, 128, 256], "steps": 2})
    (tmp_path / "efficiency.png").write_bytes(b"an earlier sweep's")
    rows = run_sweep(s, tmp_path)
    assert _x_axis(s, rows) == ("global_batch", "global batch")
    series = _series(s, rows, "global_batch")
    assert list(series) == ["allreduce torus"]   # nothing else varies: one series, named in full
    assert [r["global_batch"] for r in series["allreduce torus"]] == [64, 128, 256]
    assert not (tmp_path / "efficiency.png").exists()
    assert (tmp_path / "throughput.png").stat().st_size > 0
    assert (tmp_path / "breakdown.png").stat().st_size > 0


def test_a_chips_sweep_is_plotted_against_chips_one_series_per_algorithm(tmp_path):
    s = scenario(sweep={"scaling": "weak", "per_core_batch": 16, "chips": [4, 8, 16],
                        "allreduce": ["ring", "bidirectional_ring"], "steps": 2})
    rows = run_sweep(s, tmp_path)
    assert _x_axis(s, rows) == ("chips", "chips")   # the global batch follows the chips
    series = _series(s, rows, "chips")
    assert sorted(series) == ["bidirectional_ring", "ring"]
    assert all([r["chips"] for r in rs] == [4, 8, 16] for rs in series.values())
    assert (tmp_path / "efficiency.png").stat().st_size > 0
    assert [_tick_label(v) for v in (4, 4096, "bf16")] == ["4", "4,096", "bf16"]


def test_series_share_the_points_that_lack_the_varying_quantity():
    s = scenario(sweep={"scaling": "strong", "chips": [1, 2, 4],
                        "allreduce": ["ring", "bidirectional_ring"], "steps": 2})
    row = {"chips": 1, "allreduce_algorithm": "", "collective_algorithms": "", "precision": "bf16",
           "generation": "v4", "global_batch": 64, "per_device_batch": 64}
    rows = [row] + [{**row, "chips": c, "allreduce_algorithm": a,
                     "collective_algorithms": f"data {a}"}
                    for c in (2, 4) for a in ("ring", "bidirectional_ring")]
    series = _series(s, rows, "chips")
    assert sorted(series) == ["bidirectional_ring", "ring"]
    assert all([r["chips"] for r in rs] == [1, 2, 4] for rs in series.values())

"""Plots a person can read at their default size (issue 33 item 8): every plot the
commands write is rendered and no two tick labels of an axis overlap (bounds.png's
layout labels overprinted; breakdown.png stood them on end in a strip), no legend hides
a bar's label (layouts.png's hid the last one), ``result.plot``'s steps are whole numbers
(run.png ticked at 1.5 steps) and its stack adds up to the step (it stacked the whole
infeed, hidden or not, against it)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.transforms import Bbox

import pod
import pod.commands.plan
import pod.commands.sweep
from pod.commands.sweep import run_sweep
from tests.pod.commands.test_sweep_rows import sweep_scenario
from tests.pod.commands.test_timing_and_sweep import scenario as mlp_scenario
from tests.pod.report.test_one_figures_record import scenario_data

pytestmark = pytest.mark.slow  # each renders figures: seconds, not milliseconds


def _shrunk(box: Bbox, pixels: float = 0.5) -> Bbox:
    return Bbox.from_extents(box.x0 + pixels, box.y0 + pixels, box.x1 - pixels, box.y1 - pixels)


def assert_readable(fig, name: str) -> None:
    """No two tick labels of one axis overlap; no legend covers a text written on the
    axes (a bar's note); every label lies inside what is saved (``bbox_inches``
    "tight": the figure's tight box)."""
    FigureCanvasAgg(fig)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    saved = fig.get_tightbbox(renderer).transformed(fig.dpi_scale_trans)
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            low, high = sorted(axis.get_view_interval())
            span = (high - low) * 1e-9
            boxes = [(t.get_text(), _shrunk(t.get_window_extent(renderer)))
                     for loc, t in zip(axis.get_majorticklocs(), axis.get_ticklabels(),
                                       strict=True)
                     if t.get_visible() and t.get_text() and low - span <= loc <= high + span]
            for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2):
                assert not box_a.overlaps(box_b), f"{name}: tick labels {a!r} and {b!r} overlap"
            for text, box in boxes:
                assert saved.x0 - 1 <= box.x0 and box.x1 <= saved.x1 + 1, f"{name}: {text!r} cut"
        legend = ax.get_legend()
        if legend is not None:
            covers = _shrunk(legend.get_window_extent(renderer))
            for text in ax.texts:
                assert not covers.overlaps(text.get_window_extent(renderer)), \
                    f"{name}: the legend hides {text.get_text()!r}"


@pytest.fixture
def saved(monkeypatch):
    """Every figure the sweep and the plan save, by file name."""
    figures: dict[str, object] = {}
    original = pod.commands.sweep._save_png

    def save(fig, path: Path) -> None:
        figures[path.name] = fig
        original(fig, path)

    monkeypatch.setattr(pod.commands.sweep, "_save_png", save)
    return figures


def test_a_layout_sweeps_plots_read(tmp_path, saved):
    rows = run_sweep(sweep_scenario(), tmp_path)  # 8 layouts of a transformer
    assert all(r["status"] == "ok" for r in rows)
    assert set(saved) == {"throughput.png", "breakdown.png", "bounds.png", "layouts.png"}
    for name, fig in saved.items():
        assert_readable(fig, name)
    bounds = saved["bounds.png"].axes[0]
    assert [t.get_text() for t in bounds.get_yticklabels()][0] == "{fsdp: 8} none b=1"


def test_a_scaling_sweeps_plots_read(tmp_path, saved):
    scenario = mlp_scenario(sweep={"scaling": "weak", "per_core_batch": 8, "steps": 2,
                                   "chips": [2**k for k in range(13)]})  # 1 .. 4,096
    run_sweep(scenario, tmp_path)  # chips vary: efficiency.png too
    assert {"throughput.png", "efficiency.png", "breakdown.png", "bounds.png"} <= set(saved)
    for name, fig in saved.items():
        assert_readable(fig, name)


def test_the_plans_layouts_read(tmp_path, saved):
    tiny = str(Path(__file__).resolve().parents[3] / "scenarios/transformer-tiny.yaml")
    pod.plan(tiny, slice="v5e-8", remat=("none", "full"), per_device_batch=(1, 2),
             output_dir=tmp_path)
    assert_readable(saved["layouts.png"], "plan layouts.png")


def test_result_plot_has_whole_steps_and_stacks_the_critical_path(tmp_path):
    result = pod.run(scenario_data("v4") | {"training": {
        **scenario_data("v4")["training"], "steps": 3}}, timing_only=True, quiet=True)
    fig = result.plot(tmp_path / "run.png")
    assert_readable(fig, "run.png")
    for ax in fig.axes:
        for label in ax.get_xticklabels():
            text = label.get_text().replace("−", "-")
            assert not text or float(text) == int(float(text)), f"step tick {text}"
    right = fig.axes[1]
    top = sum(c.get_paths()[0].vertices[:, 1].max() > 0 for c in right.collections)
    assert top >= 2  # compute and more
    stacked = max(p.vertices[:, 1].max() for c in right.collections for p in c.get_paths())
    step_ms = max(s.step_seconds for s in result.history) * 1e3
    assert stacked == pytest.approx(step_ms, rel=1e-6)  # the parts add up to the step


def test_chip_counts_closer_than_a_factor_two_do_not_touch():
    """The multislice sweep's last two points, 32,768 and 50,944 chips: upright, their
    labels overprinted (docs/scaling/multislice-16b-v5e)."""
    from pod.commands.sweep import _along_x
    from pod.report import figures as plt

    xs = [256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 50944]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(xs, [1.0] * len(xs), marker="o")
    _along_x(ax, xs, True, "chips")
    fig.tight_layout()
    assert_readable(fig, "efficiency.png")

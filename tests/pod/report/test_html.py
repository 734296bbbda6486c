"""report.html and layers.csv: written by a real run (`tpu-pod run --report --in-process`,
no Ray), read back, and opened in a real headless browser (Debian's chromium) where
one is installed: the page loads, renders (a screenshot with ink and colour in it) and
says what summary.json and layers.csv say."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[3]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _chromium(*args: str, profile: Path) -> subprocess.CompletedProcess:
    """Headless chromium (root needs --no-sandbox), its own profile, no network use."""
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                           "--hide-scrollbars", f"--user-data-dir={profile}",
                           "--no-first-run", "--disable-extensions", *args],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HOME": str(profile)})


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    result = subprocess.run([sys.executable, "-m", "pod", "run", "scenarios/quickstart.yaml",
                             "--steps", "6", "--metrics-port", "0", "--output-dir", str(out),
                             "--report", "--in-process"], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "report.html" in result.stdout and "layers.csv" in result.stdout
    return out


def test_layers_csv_matches_the_model_and_the_cost_records(run_dir):
    """One row per layer (then the loss); FLOPs of a Dense layer by the closed form
    (forward 2*B*in*out, backward twice that, plus the bias), and the per-unit seconds
    adding up to the layer's."""
    rows = list(csv.DictReader((run_dir / "layers.csv").open()))
    assert [r["layer"] for r in rows][:2] == ["conv1", "relu1"] and rows[-1]["layer"] == "loss"
    dense = next(r for r in rows if r["layer"] == "dense2")
    assert (dense["input_shape"], dense["output_shape"]) == ("(32, 256)", "(32, 10)")
    assert int(dense["parameters"]) == 256 * 10 + 10
    assert int(dense["mxu_flops"]) == 3 * 2 * 32 * 256 * 10
    for r in rows:
        units = sum(float(r[f"simulated_{u}_seconds"]) for u in ("mxu", "vpu", "scalar"))
        assert units == pytest.approx(float(r["simulated_seconds"]), rel=1e-9)
        assert int(r["hbm_bytes"]) >= 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert sum(int(r["parameters"]) for r in rows) == summary["parameters"]


def test_report_html_says_what_summary_json_says(run_dir):
    """The page's text (no browser): title, the summary's figures, the HBM plan per
    device with the plan's items, the model's layers."""
    page = (run_dir / "report.html").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "<title>quickstart - tpu-pod run report</title>" in page
    assert f"{summary['simulated_examples_per_second']:,.0f}" in page
    assert f"{summary['test_accuracy']:.4f}" in page and "<svg" in page
    assert "HBM plan per device" in page and "conv1 (conv2d)" in page
    assert (f"global batch {summary['global_batch']:,} = {summary['per_device_batch']:,}\n"
            "per device of the mesh {data: 8}") in page
    for item in ("params", "grads", "optimizer_state", "activations", "workspace", "total"):
        assert f"<td>{item}</td>" in page, item


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install "
                                             "chromium; .ci/run installs it where it can)")
def test_report_html_renders_in_headless_chromium(run_dir, tmp_path):
    from PIL import Image  # matplotlib's own dependency, in the [plots] extra

    page = (run_dir / "report.html").resolve().as_uri()
    shot = tmp_path / "report.png"
    out = _chromium(f"--screenshot={shot}", "--window-size=1200,1600", page,
                    profile=tmp_path / "profile")
    assert shot.exists(), out.stderr[-2000:]
    image = Image.open(shot).convert("RGB")
    assert image.size == (1200, 1600)
    pixels = np.asarray(image, dtype=np.int16).reshape(-1, 3)
    ink = float(np.mean(pixels.min(axis=1) < 200))
    colour = float(np.mean(pixels.max(axis=1) - pixels.min(axis=1) > 80))
    assert ink > 0.03, f"the page looks blank ({ink:.2%} of pixels have ink)"
    assert colour > 0.005, f"no plot colours ({colour:.2%} of pixels coloured)"

    dom = _chromium("--dump-dom", page, profile=tmp_path / "profile").stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "<title>quickstart - tpu-pod run report</title>" in dom
    assert f"{summary['simulated_examples_per_second']:,.0f}" in dom
    assert f"{summary['test_accuracy']:.4f}" in dom and "<svg" in dom
    assert "HBM plan per device" in dom and "conv1 (conv2d)" in dom

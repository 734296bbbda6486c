"""VALIDATION.md's generated tables equal what the calibration runs print now (issue 29,
item 7): every ``<!-- generated: NAME -->`` region against ``tools/validation_figures.py``'s
generator, to the last printed digit (every figure is simulated or computed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import validation_figures as figures  # noqa: E402

TEXT = (ROOT / "VALIDATION.md").read_text()


def test_every_region_has_a_generator_and_every_generator_a_region():
    names = {m["name"] for m in figures.REGION.finditer(TEXT)}
    assert names == set(figures.GENERATORS)


def test_regenerating_only_the_named_regions_leaves_the_rest():
    # a region outside ``only`` is kept as it is, even when it differs from its generator
    text = "a\n<!-- generated: chip-report -->\nold\n<!-- /generated -->\nb\n"
    new, changed = figures.regenerate(text, only={"training"})
    assert new == text and changed == []


@pytest.mark.slow
def test_every_region_is_what_its_command_prints():
    # the fits and the held-out refits take about half a minute
    new, changed = figures.regenerate(TEXT)
    assert changed == [], f"stale: {changed}; run python tools/validation_figures.py"

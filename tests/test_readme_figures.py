"""The quoted outputs of the README and the docs pages equal what the code prints now
(issue 25, item 10):
every ``<!-- generated: NAME -->`` region against ``tools/readme_figures.py``'s
generator, wall-clock figures left out, every other figure to its last printed digit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import readme_figures as figures  # noqa: E402

REGIONS = figures.page_regions()
#: regions whose generator runs for more than a few seconds (a 12-step training run
#: in-process, a sweep, a plan of up to 990 points)
SLOW = {"quickstart-run", "progress-line", "quickstart-epochs", "sweep-v4-weak",
        "sweep-layouts-llama-33b", "sweep-llama2-7b-weak", "sweep-llama2-7b-strong",
        "sweep-pipeline-gpt3", "sweep-layouts-mixtral", "plan-llama2-7b", "plan-maxtext-s1"}


def test_every_region_has_a_generator_and_every_generator_a_region():
    assert set(REGIONS) == set(figures.GENERATORS)


def test_wall_figures_are_left_out_and_simulated_ones_are_not():
    quoted = ("step 12/12  loss 2.1645  sim 0.0674 ms/step  sim 3,798,870 examples/s  "
              "wall 1563.8 ms/step\n│ step time      │  1548.8 ms │ wall           │\n"
              "Epoch 3/3 - loss: 2.1828 - 0.0674 ms/step (simulated) - 3.9 s (wall)")
    other_machine = (quoted.replace("1563.8", "61.2").replace("1548.8", "60.0")
                     .replace("3.9 s", "0.5 s"))
    assert figures.stale(quoted, other_machine) is None
    assert figures.stale(quoted, quoted.replace("2.1645", "2.1646")) is None  # a rounding flip
    # a loss is learned: another CPU's float32 bits move it a little (under 2%), a broken
    # run far more
    assert figures.stale(quoted, quoted.replace("2.1645", "2.1700")) is None
    assert figures.stale(quoted, quoted.replace("2.1645", "2.3100"))
    assert figures.stale(quoted, quoted.replace("2.1828", "2.0000"))  # the epoch's loss too
    assert figures.stale(quoted, quoted.replace("0.0674 ms/step (simulated)",
                                                "0.0690 ms/step (simulated)"))
    assert figures.stale(quoted, quoted.replace("0.0674 ms/step  sim", "0.0687 ms/step  sim"))
    assert figures.stale(quoted, quoted.replace("examples/s", "tokens/s"))


def test_a_region_in_two_pages_is_refused(tmp_path):
    one, two = tmp_path / "a.md", tmp_path / "b.md"
    one.write_text("<!-- generated: x -->\n1\n<!-- /generated -->\n")
    two.write_text("<!-- generated: y -->2<!-- /generated --> <!-- generated: x -->3<!-- /generated -->")
    with pytest.raises(ValueError, match="'x' is also in a.md"):
        figures.page_regions([one, two])
    assert figures.page_regions([two]) == {"y": (two, "2"), "x": (two, "3")}


def test_rewriting_replaces_only_the_bodies():
    text = "a\n<!-- generated: x -->\nold\n<!-- /generated -->\nb <!-- generated: y -->1<!-- /generated -->"
    out = figures.rewrite(text, {"x": "new\n", "y": "2"})
    assert out == "a\n<!-- generated: x -->\nnew\n<!-- /generated -->\nb <!-- generated: y -->2<!-- /generated -->"
    assert figures.rewrite(out, {"x": "new\n", "y": "2"}) == out


def _check(name: str) -> None:
    page, quoted = REGIONS[name]
    why = figures.stale(quoted, figures.GENERATORS[name]())
    assert why is None, f"{page.name} region {name} is stale (python tools/readme_figures.py " \
                        f"rewrites it): {why}"


@pytest.mark.parametrize("name", sorted(set(figures.GENERATORS) - SLOW))
def test_quick_regions_are_current(name):
    _check(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SLOW))
def test_run_and_sweep_regions_are_current(name):
    _check(name)

"""``benchmarks/accuracy.py``: issue 29's done-when read criterion by criterion from the
measured errors (fast: the criteria on given figures, the constants' comments of this
repository; the runs themselves are the slow region checks of
``tests/test_validation_figures.py`` and ``tests/test_readme_figures.py``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _accuracy():
    name = "accuracy_benchmark"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "accuracy.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _measured(**change):
    acc = _accuracy()
    base = dict(single_op_pct={"C1": -0.8, "C3": -6.4}, training_pct={"T1": 1.0, "T2": -2.0},
                held_out_pct={"T1": 2.0, "T2": -4.0}, training_expected=("T1", "T2"),
                memory_agree={f"m{i}": True for i in range(40)},
                memory_error={"m0": 0.05, "m1": -0.02})
    return acc.Measured(**(base | change))


def _met(measured) -> dict[str, bool]:
    return {c.name: c.met for c in _accuracy().criteria(measured)}


def test_every_criterion_holds_on_figures_within_the_bars():
    met = _met(_measured())
    assert all(met.values()), met
    assert len(met) == 10


def test_each_bar_fails_on_its_own_figure():
    acc = _accuracy()
    cases = {
        "training rows costed at their published batch and remat":
            dict(training_pct={"T1": 1.0}),
        "training rows held out one at a time: mean absolute error":
            dict(held_out_pct={"T1": 6.0, "T2": -4.5}),
        "training rows held out: every row": dict(held_out_pct={"T1": 0.0, "T2": 0.0, "T3": -10.5}),
        "training rows in sample: every row": dict(training_pct={"T1": 10.2, "T2": 0.0}),
        "memory oracle: configurations": dict(memory_agree={"m0": True}),
        "memory oracle: fit verdicts agree with XLA's":
            dict(memory_agree={f"m{i}": i != 3 for i in range(40)}),
        "memory oracle: plan bytes vs XLA's peak": dict(memory_error={"m0": -0.112}),
        "single-op rows C1-C14: mean absolute error": dict(single_op_pct={"C1": 5.5, "C3": -5.0}),
        "single-op rows C1-C14: every row": dict(single_op_pct={"C1": 0.0, "C2": 0.0, "C3": 10.5}),
        "fitted constants of `*/calibration.py` naming their rows":
            dict(constants_without_rows=("chip/calibration.py:9 X",)),
    }
    for name, change in cases.items():
        met = _met(_measured(**change))
        assert [k for k, v in met.items() if not v] == [name], (name, met)
    one_row_out = {"T1": 0.0, "T2": 0.0, "T3": 0.0, "T4": -13.0}
    text = acc.render(acc.criteria(_measured(held_out_pct=one_row_out)))
    assert "beyond: T4 -13.0%" in text and "**no**" in text and "9 of 10 criteria met." in text


def test_a_constant_whose_comment_names_no_row_is_found(tmp_path):
    acc = _accuracy()
    (tmp_path / "calibration.py").write_text(
        "#: fitted on C1, C2\nA_RATE = 0.9\n\n"
        "B_COST = 2.0\n\n"
        "C = Cal(\n    # rows T1-T9\n    good=1.0,\n    bad=2.0,\n"
        "    by={\n        # C7 alone\n        'v5e': 1e-6,\n        'v6e': 2e-6,\n    },\n)\n"
        "D_SECONDS = 1e-4\n\"\"\"From C3.\"\"\"\n")
    missing = acc.constants_without_rows(("calibration.py",), tmp_path)
    assert [m.split(" ", 1)[1] for m in missing] == ["B_COST", "C.bad", "C.by['v6e']"]


def test_every_fitted_constant_of_the_repository_names_its_rows():
    assert _accuracy().constants_without_rows() == ()


def test_the_headline_names_the_held_out_worst_and_the_criteria_not_met():
    acc = _accuracy()
    measured = _measured(held_out_pct={"T1": 0.0, "T2": 0.0, "T3": 0.0, "T4": -13.0})
    line = acc.headline(measured, acc.criteria(measured))
    assert "mean 3.2%, worst T4 -13.0%" in line
    assert "9 of 10 criteria met (not: training rows held out: every row)." in line
    good = _measured()
    assert acc.headline(good, acc.criteria(good)).endswith("10 of 10 criteria met.\n")

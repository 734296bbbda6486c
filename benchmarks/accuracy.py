"""Issue 29's bar, measured: each criterion of its "done when" beside what the runs give now.

The runs, in this process (about ten seconds):

- the single-op rows C1-C14 (``benchmarks/fidelity.py --single-op``; S1-S2 are
  specifications, out of the statistics);
- the step clock's fit on the GEMM rows and the training rows T1-T9, M1-M3, each
  row's error in sample and held out (``benchmarks/fidelity.py --fit-mxu --held-out``:
  the constants refitted without the row, the row predicted with them);
- the HBM plan beside every committed XLA-oracle result
  (``benchmarks/memory_oracle.py``).

The criteria (issue 29, "Done when"): every training row costed at its published batch
and remat (none refused), the held-out mean within 5% and every row within 10% (in
sample and held out: both are shown); the memory oracle at 40 configurations or more,
every verdict agreeing and every byte figure within 10%; the single-op rows' mean within
5% and every row within 10%. ``tools/validation_figures.py`` and
``tools/readme_figures.py`` write the table into VALIDATION.md's summary and the
README's accuracy section.

Usage::

    python benchmarks/accuracy.py              # the table
    python benchmarks/accuracy.py --markdown   # as VALIDATION.md and the README quote it
    python benchmarks/accuracy.py --json       # the measured figures
    python benchmarks/accuracy.py --headline   # one line, as the README quotes it
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import re
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]

#: the files whose constants are fitted (issue 29: "grep for each constant in
#: */calibration.py finds its rows")
CALIBRATION_FILES = ("chip/calibration.py", "interconnect/calibration.py")
#: a row id of the calibration set: C1-C14, S1-S2, T1-T9, M1-M3
ROW_ID = re.compile(r"\b[CSTM]\d{1,2}\b")

#: issue 29's bars
MEAN_BAR_PCT = 5.0
ROW_BAR_PCT = 10.0
MEMORY_CONFIGS = 40
MEMORY_BAR = 0.10


@dataclass(frozen=True)
class Measured:
    """What the runs gave: signed errors in percent by row id, and the memory rows.

    Attributes:
        single_op_pct: single-op rows in the statistics (C1-C14), predicted vs published.
        training_pct: training rows at the fit (TFLOP/s, in sample).
        held_out_pct: training rows under a fit without them.
        training_expected: the training rows there are (a row missing from the fit was
            not costed: refused or failed).
        memory_agree: oracle id -> whether the plan's verdict is XLA's.
        memory_error: oracle id -> (plan - XLA) / XLA where XLA gave an HBM peak.
    """

    single_op_pct: Mapping[str, float]
    training_pct: Mapping[str, float]
    held_out_pct: Mapping[str, float]
    training_expected: tuple[str, ...]
    memory_agree: Mapping[str, bool]
    memory_error: Mapping[str, float]
    constants_without_rows: tuple[str, ...] = ()


@dataclass(frozen=True)
class Criterion:
    """One line of the bar: what, the target, what was measured, whether it holds."""

    name: str
    target: str
    measured: str
    met: bool


def _constants(tree: ast.Module) -> list[tuple[str, int, int]]:
    """(name, first line, last line) of each fitted constant: a module-level UPPER_CASE
    assignment of a number or a dict of numbers, each keyword of a module-level call
    (``CALIBRATION = Calibration(efficiency=...)``) and each key of a dict keyword."""
    out: list[tuple[str, int, int]] = []
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name) and node.targets[0].id.isupper()):
            continue
        name, value = node.targets[0].id, node.value
        number = isinstance(value, ast.Constant) and isinstance(value.value, (int, float))
        numbers = isinstance(value, ast.Dict) and all(isinstance(v, ast.Constant)
                                                      for v in value.values)
        if number or numbers:
            out.append((name, node.lineno, node.end_lineno or node.lineno))
        elif isinstance(value, ast.Call):
            for kw in value.keywords:
                if isinstance(kw.value, ast.Dict):
                    out += [(f"{name}.{kw.arg}[{ast.literal_eval(k)!r}]", k.lineno,
                             v.end_lineno or v.lineno)
                            for k, v in zip(kw.value.keys, kw.value.values, strict=True)
                            if isinstance(k, ast.Constant)]
                else:
                    out.append((f"{name}.{kw.arg}", kw.lineno, kw.end_lineno or kw.lineno))
    return out


def constants_without_rows(files: tuple[str, ...] = CALIBRATION_FILES,
                           root: Path = ROOT) -> tuple[str, ...]:
    """The fitted constants of ``files`` whose comment (the comment lines right above the
    constant, its own lines, and a docstring right below) names no calibration row id."""
    missing = []
    for rel in files:
        text = (root / rel).read_text()
        lines = text.splitlines()
        for name, first, last in _constants(ast.parse(text)):
            start = first - 1
            while start > 0 and lines[start - 1].lstrip().startswith("#"):
                start -= 1
            stop = last
            if stop < len(lines) and lines[stop].lstrip().startswith('"""'):
                stop += 1
            if not ROW_ID.search("\n".join(lines[start:stop])):
                missing.append(f"{rel}:{first} {name}")
    return tuple(missing)


def _module(name: str, path: Path) -> ModuleType:
    """A benchmark script as a module (imported once)."""
    if name not in sys.modules:
        sys.path.insert(0, str(ROOT))
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its dataclasses look themselves up there
        spec.loader.exec_module(module)
    return sys.modules[name]


def measure() -> Measured:
    """Run the three benchmarks (module docstring) and keep their errors."""
    fidelity = _module("fidelity_for_accuracy", ROOT / "benchmarks" / "fidelity.py")
    oracle = _module("memory_oracle_for_accuracy", ROOT / "benchmarks" / "memory_oracle.py")
    ic = fidelity._import_interconnect(None)

    def link_for(generation: str):
        return ic.calibrated_link(generation, fidelity.LINK_BYTES_PER_S[generation],
                                  fidelity.HOP_LATENCY_S)

    single = {r.id: r.error_pct for r in fidelity.run(ic, link_for) if r.in_stats}
    fit = fidelity.fit_training(held_out=True)
    rows = [oracle.plan_row(r) for r in oracle.load_results()]
    return Measured(single, dict(fit["error_pct"]),
                    {k: v["error_pct"] for k, v in fit["held_out"].items()},
                    tuple(r.id for r in fidelity.TRAINING_ROWS),
                    {r.id: r.plan_fits == r.xla_fits for r in rows},
                    {r.id: r.error for r in rows if r.error is not None},
                    constants_without_rows())


def _worst(errors: Mapping[str, float]) -> str:
    key = max(errors, key=lambda k: abs(errors[k]))
    return f"worst {key} {errors[key]:+.1f}%"


def _beyond(errors: Mapping[str, float], bar: float, scale: float = 1.0) -> list[str]:
    return [f"{k} {v * scale:+.1f}%" for k, v in errors.items() if abs(v) > bar]


def _mean(errors: Mapping[str, float]) -> float:
    return sum(abs(v) for v in errors.values()) / len(errors) if errors else float("nan")


def criteria(m: Measured) -> list[Criterion]:
    """Issue 29's done-when, criterion by criterion, against ``m``."""
    missing = [k for k in m.training_expected if k not in m.training_pct]
    out = [Criterion("training rows costed at their published batch and remat",
                     f"all {len(m.training_expected)}",
                     f"{len(m.training_pct)} of {len(m.training_expected)}"
                     + (f" (missing {', '.join(missing)})" if missing else ""), not missing)]
    held_mean = _mean(m.held_out_pct)
    out.append(Criterion("training rows held out one at a time: mean absolute error",
                         f"<= {MEAN_BAR_PCT:.0f}%", f"{held_mean:.1f}%",
                         held_mean <= MEAN_BAR_PCT))
    for label, errors in (("in sample", m.training_pct), ("held out", m.held_out_pct)):
        beyond = _beyond(errors, ROW_BAR_PCT)
        out.append(Criterion(f"training rows {label}: every row", f"within {ROW_BAR_PCT:.0f}%",
                             f"mean {_mean(errors):.1f}%, {_worst(errors)}"
                             + (f"; beyond: {', '.join(beyond)}" if beyond else ""), not beyond))
    n, agree = len(m.memory_agree), sum(m.memory_agree.values())
    out.append(Criterion("memory oracle: configurations", f">= {MEMORY_CONFIGS}",
                         f"{n} with an HBM verdict", n >= MEMORY_CONFIGS))
    out.append(Criterion("memory oracle: fit verdicts agree with XLA's", "all",
                         f"{agree} of {n}", agree == n))
    beyond = _beyond(m.memory_error, MEMORY_BAR, 100.0)
    pct = {k: v * 100.0 for k, v in m.memory_error.items()}
    out.append(Criterion("memory oracle: plan bytes vs XLA's peak",
                         f"within {MEMORY_BAR:.0%}",
                         f"{len(pct)} with an HBM peak: mean {_mean(pct):.1f}%, {_worst(pct)}"
                         + (f"; beyond: {', '.join(beyond)}" if beyond else ""), not beyond))
    single_mean = _mean(m.single_op_pct)
    beyond = _beyond(m.single_op_pct, ROW_BAR_PCT)
    out.append(Criterion("single-op rows C1-C14: mean absolute error", f"<= {MEAN_BAR_PCT:.0f}%",
                         f"{single_mean:.1f}%", single_mean <= MEAN_BAR_PCT))
    out.append(Criterion("single-op rows C1-C14: every row", f"within {ROW_BAR_PCT:.0f}%",
                         _worst(m.single_op_pct)
                         + (f"; beyond: {', '.join(beyond)}" if beyond else ""), not beyond))
    out.append(Criterion("fitted constants of `*/calibration.py` naming their rows", "all",
                         "all" if not m.constants_without_rows else
                         "missing: " + ", ".join(m.constants_without_rows),
                         not m.constants_without_rows))
    return out


def render(rows: list[Criterion], markdown: bool = True) -> str:
    """The criteria as a table (Markdown or plain) and a count of those met."""
    head = ("criterion (issue 29)", "target", "measured", "met")
    cells = [(c.name, c.target, c.measured, "yes" if c.met else "**no**" if markdown else "NO")
             for c in rows]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|---|---|---|---|"]
        lines += ["| " + " | ".join(row) + " |" for row in cells]
    else:
        widths = [max(len(r[i]) for r in (head, *cells)) for i in range(len(head))]
        lines = ["  ".join(x.ljust(w) for x, w in zip(row, widths, strict=True)).rstrip()
                 for row in (head, *cells)]
    met = sum(c.met for c in rows)
    return "\n".join(lines) + f"\n\n{met} of {len(rows)} criteria met.\n"


def headline(m: Measured, rows: list[Criterion]) -> str:
    """One line for the README: the held-out training errors and the criteria met."""
    held = m.held_out_pct
    return (f"Held out one at a time (each training row predicted by the constants fitted "
            f"without it): mean {_mean(held):.1f}%, {_worst(held)}. Issue 29's bar: "
            f"{sum(c.met for c in rows)} of {len(rows)} criteria met"
            + (f" (not: {'; '.join(c.name for c in rows if not c.met)})"
               if not all(c.met for c in rows) else "") + ".\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--json", action="store_true", help="the measured figures")
    parser.add_argument("--headline", action="store_true",
                        help="one line: the held-out errors and the criteria met")
    args = parser.parse_args(argv)
    measured = measure()
    if args.headline:
        print(headline(measured, criteria(measured)), end="")
        return 0
    if args.json:
        print(json.dumps({"measured": asdict(measured),
                          "criteria": [asdict(c) for c in criteria(measured)]}, indent=1))
        return 0
    print(render(criteria(measured), args.markdown), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())

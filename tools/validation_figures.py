"""Regenerate the tables VALIDATION.md quotes from the calibration runs, so they cannot go stale.

Each table sits in VALIDATION.md between two markers, as the README's do
(``tools/readme_figures.py``)::

    <!-- generated: NAME -->
    ...what the command printed...
    <!-- /generated -->

and ``GENERATORS[NAME]`` prints it again from the code: ``benchmarks/fidelity.py`` (the
single-op rows, the training rows, the fits and the held-out errors) and
``chip.fitting.report`` (the single-chip rows). Every figure is simulated or
computed, so a region must match to the last digit.

Usage::

    python tools/validation_figures.py            # rewrite the regions of VALIDATION.md
    python tools/validation_figures.py --check    # exit 1 if a region is stale
    python tools/validation_figures.py --only training-fit

``tests/test_validation_figures.py`` runs ``--check``'s comparison (slow tier: the fits
take about half a minute).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VALIDATION = ROOT / "VALIDATION.md"
REGION = re.compile(r"(<!-- generated: (?P<name>[\w.-]+) -->\n?)(?P<body>.*?)(<!-- /generated -->)",
                    re.S)


def _fidelity():
    """``benchmarks/fidelity.py`` as a module (imported once)."""
    if "fidelity_for_validation" not in sys.modules:
        sys.path.insert(0, str(ROOT))
        spec = importlib.util.spec_from_file_location("fidelity_for_validation",
                                                      ROOT / "benchmarks" / "fidelity.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look themselves up there
        spec.loader.exec_module(module)
    return sys.modules["fidelity_for_validation"]


def _printed(*argv: str) -> str:
    """What ``python benchmarks/fidelity.py ARGV`` prints."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        _fidelity().main(list(argv))
    return out.getvalue()


def _command(text: str, *argv: str) -> str:
    return f"`python benchmarks/fidelity.py {' '.join(argv)}`:\n\n{text.rstrip()}\n"


def _chip_report() -> str:
    sys.path.insert(0, str(ROOT))
    from chip.fitting import report

    return ("`python -m chip.fitting`:\n\n"
            + report().rstrip() + "\n")


GENERATORS: dict[str, Callable[[], str]] = {
    "single-op": lambda: _command(_printed("--single-op", "--markdown"),
                                  "--single-op", "--markdown"),
    "training": lambda: _command(_printed("--training", "--markdown"), "--training", "--markdown"),
    "training-fit": lambda: _command(_printed("--fit-mxu", "--held-out", "--markdown"),
                                     "--fit-mxu", "--held-out", "--markdown"),
    "single-op-readings": lambda: _command(_printed("--readings", "--markdown"),
                                           "--readings", "--markdown"),
    "ici-fit": lambda: _command("```\n" + _printed("--fit").rstrip() + "\n```", "--fit"),
    "chip-report": _chip_report,
}


def regenerate(text: str, only: set[str] | None = None) -> tuple[str, list[str]]:
    """``text`` with every generated region (or those in ``only``) made again, and the
    names of the regions that changed.

    Raises:
        KeyError: a region names no generator.
    """
    changed: list[str] = []
    cache: dict[str, str] = {}

    def body(match: re.Match) -> str:
        name = match["name"]
        if only and name not in only:
            return match.group(0)
        if name not in cache:
            cache[name] = GENERATORS[name]()
        new = cache[name]
        if new != match["body"]:
            changed.append(name)
        return match.group(1) + new + match.group(4)

    return REGION.sub(body, text), changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a region is stale")
    parser.add_argument("--only", action="append", help="regenerate only this region")
    args = parser.parse_args(argv)
    text = VALIDATION.read_text()
    new, changed = regenerate(text, set(args.only) if args.only else None)
    if args.check:
        for name in changed:
            print(f"VALIDATION.md: region {name} is stale; run python tools/validation_figures.py")
        return 1 if changed else 0
    if new != text:
        VALIDATION.write_text(new)
    print(f"VALIDATION.md: {len(changed)} region(s) rewritten: {', '.join(changed) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

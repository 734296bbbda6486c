"""Regenerate the outputs the README quotes, so that they cannot go stale.

Each quoted output sits in README.md between two markers::

    <!-- generated: NAME -->
    ...what the command printed...
    <!-- /generated -->

and ``GENERATORS[NAME]`` makes it again from the code: the commands run as a user
runs them (``python -m pod ...``; training in-process, sweeps timing-only), their
output cut to what the README shows. Wall-clock figures (``wall 61.2 ms/step``,
``0.5 s (wall)``, summary rows on the wall clock) are this machine's and are left
out of the comparison (``skeleton``); every other figure is simulated or computed
and must match, to the last printed digit (one unit of it either way: float32
bits may differ between machines, pitfalls.md).

Usage::

    python tools/readme_figures.py            # rewrite the regions of README.md
    python tools/readme_figures.py --check    # exit 1 if a region is stale
    python tools/readme_figures.py --only collective-v4-128

``tests/tools/test_readme_figures.py`` runs ``--check``'s comparison.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
REGION = re.compile(r"(<!-- generated: (?P<name>[\w.-]+) -->\n?)(?P<body>.*?)(<!-- /generated -->)",
                    re.S)
#: the note under every block that holds wall figures
WALL_NOTE = "(wall figures: this machine, a 2-core host shared with other work)"


def _pod(*args: str) -> str:
    """What ``tpu-pod ARGS`` prints (stdout and stderr, as a terminal shows them), run
    from the checkout as a user runs it; raises if it fails."""
    env = {**os.environ, "COLUMNS": "160", "NO_COLOR": "1", "TERM": "dumb"}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run([sys.executable, "-m", "pod", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)
    if done.returncode not in (0, 2):
        raise RuntimeError(f"tpu-pod {' '.join(args)} failed ({done.returncode}):\n"
                           f"{done.stderr[-3000:]}")
    return done.stdout + done.stderr


def _fence(text: str, note: str = "") -> str:
    return "```\n" + text.rstrip("\n") + "\n```\n" + (f"{note}\n" if note else "")


@functools.lru_cache(maxsize=None)
def _quickstart_lines() -> tuple[str, ...]:
    """The lines ``tpu-pod run scenarios/quickstart.yaml --steps 12 --in-process`` prints
    (the quick start's scenario, 12 steps: 5 per epoch, three epochs, evaluated at the
    end), without the files it writes."""
    with tempfile.TemporaryDirectory() as out:
        text = _pod("run", "scenarios/quickstart.yaml", "--steps", "12", "--in-process",
                    "--metrics-port", "0", "--output-dir", out)
    return tuple(line.rstrip() for line in text.splitlines()
                 if line.strip() and not line.startswith("Wrote "))


def _summary_table(lines: tuple[str, ...]) -> list[str]:
    """The end-of-run summary table: from its title (the line above the ┏ after the last
    progress line) to its last border."""
    last = max(i for i, line in enumerate(lines) if line.startswith(("step ", "Epoch ")))
    start = last + 1
    end = max(i for i, line in enumerate(lines) if line.startswith("└"))
    return list(lines[start:end + 1])


def quickstart_run() -> str:
    """The quick start's run, cut: its first epoch, its end, the summary table."""
    lines = _quickstart_lines()
    first_epoch = next(i for i, line in enumerate(lines) if line.startswith("Epoch 1/"))
    first_step = next(i for i, line in enumerate(lines) if line.startswith("step "))
    last = max(i for i, line in enumerate(lines) if line.startswith(("step ", "Epoch ")))
    shown = ["$ tpu-pod run scenarios/quickstart.yaml --steps 12 --in-process",
             "...", *lines[first_step:first_epoch + 1], "...", *lines[last - 2:last + 1],
             *_summary_table(lines)]
    return _fence("\n".join(shown), WALL_NOTE)


def progress_line() -> str:
    """One progress line of the quick start's run (its last step)."""
    step = [line for line in _quickstart_lines() if line.startswith("step ")][-1]
    return _fence(step, WALL_NOTE)


def quickstart_epochs() -> str:
    """The quick start's last two epoch lines, inline in a list item (the README's
    Progress bullet): no line of its own, continuation lines indented."""
    epochs = [line for line in _quickstart_lines() if line.startswith("Epoch ")][-2:]
    return ",\n  ".join(f"`{line}`" for line in epochs)


def collective_v4_128() -> str:
    """``tpu-pod collective``: a 1 GiB allreduce on a v4-128, ring against torus."""
    args = ("collective", "--slice", "v4-128", "--sizes", "1GiB", "--algorithm", "ring,torus")
    return _fence(f"$ tpu-pod {' '.join(args)}\n" + _pod(*args))


def override_error() -> str:
    """The one line a bad override gives."""
    args = ("validate", "scenarios/llama-33b-v5p-128.yaml", "pod.mesh.fsdp=8")
    return _fence(f"$ tpu-pod {' '.join(args)}\n" + _pod(*args))


def sweep_v4_weak() -> str:
    """The MLP's weak-scaling sweep on v4, every point (timing-only, simulated)."""
    sys.path.insert(0, str(ROOT))
    import pod

    with tempfile.TemporaryDirectory() as out:
        rows = pod.sweep(ROOT / "scenarios/scaling-v4-weak.yaml", output_dir=out)
    head = ("| chips | torus | allreduce | step ms | exposed collectives ms | examples/s "
            "| efficiency | bound |\n|---:|---|---|---:|---:|---:|---:|---|\n")
    body = "".join(
        f"| {r['chips']:,} | {r['topology']} | {r['allreduce_algorithm']} "
        f"| {r['simulated_step_seconds'] * 1e3:.4f} | {r['exposed_collective_seconds'] * 1e3:.4f} "
        f"| {r['simulated_examples_per_second']:,.0f} | {r['scaling_efficiency']:.2f} "
        f"| {r['bound']} {r['bound_fraction']:.0%} |\n" for r in rows if r["status"] == "ok")
    return ("`tpu-pod sweep scenarios/scaling-v4-weak.yaml` (simulated; 32 examples per "
            "TensorCore):\n\n" + head + body)


GENERATORS: dict[str, Callable[[], str]] = {
    "quickstart-run": quickstart_run,
    "progress-line": progress_line,
    "quickstart-epochs": quickstart_epochs,
    "collective-v4-128": collective_v4_128,
    "override-error": override_error,
    "sweep-v4-weak": sweep_v4_weak,
}

_NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")
_WALL = (re.compile(r"(wall )[\d,.]+( ms/step)"), re.compile(r"()[\d,.]+( s \(wall\))"),
         re.compile(r"(ready in )[\d,.]+( s \(wall\))"))


def regions(text: str) -> dict[str, str]:
    """Every generated region of ``text``: name -> body.

    Raises:
        ValueError: a name given twice.
    """
    found: dict[str, str] = {}
    for match in REGION.finditer(text):
        if match["name"] in found:
            raise ValueError(f"README: region {match['name']!r} twice")
        found[match["name"]] = match["body"]
    return found


def skeleton(text: str) -> tuple[str, list[str]]:
    """What must match between the README and a fresh run: the text with its wall-clock
    figures masked and its numbers taken out ("#"), and the numbers in order."""
    lines = []
    for line in text.splitlines():
        if re.search(r"│\s*wall(/simulated)?\s*│\s*$", line):  # a summary row on the wall clock
            # its width follows the wall figure's digits: spaces collapsed too
            line = re.sub(r" +", " ", re.sub(_NUMBER, "<wall>", line))
        for pattern in _WALL:
            line = pattern.sub(r"\1<wall>\2", line)
        lines.append(line)
    masked = "\n".join(lines)
    return _NUMBER.sub("#", masked), _NUMBER.findall(masked)


def _close(quoted: str, fresh: str) -> bool:
    """Two printed numbers agree to one unit of the last digit printed."""
    a, b = float(quoted.replace(",", "")), float(fresh.replace(",", ""))
    decimals = len(quoted.split(".")[1]) if "." in quoted else 0
    return decimals == (len(fresh.split(".")[1]) if "." in fresh else 0) and \
        abs(a - b) <= 10 ** -decimals * 1.0001


def stale(quoted: str, fresh: str) -> str | None:
    """Why a README region differs from a fresh one (None: it does not)."""
    (text_q, num_q), (text_f, num_f) = skeleton(quoted), skeleton(fresh)
    if text_q != text_f:
        import difflib

        diff = difflib.unified_diff(text_q.splitlines(), text_f.splitlines(), "README",
                                    "generated", lineterm="", n=1)
        return "the text differs:\n" + "\n".join(diff)
    bad = [(q, f) for q, f in zip(num_q, num_f) if not _close(q, f)]
    return f"figures differ (README, generated): {bad[:8]}" if bad else None


def rewrite(text: str, fresh: dict[str, str]) -> str:
    """``text`` with the bodies of the regions named in ``fresh`` replaced."""
    def body(match: re.Match) -> str:
        new = fresh.get(match["name"])
        return match.group(0) if new is None else f"{match.group(1)}{new}{match.group(4)}"

    return REGION.sub(body, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="compare, do not write; exit 1 if a region is stale")
    parser.add_argument("--only", nargs="*", choices=sorted(GENERATORS), default=None)
    parser.add_argument("--readme", type=Path, default=README)
    args = parser.parse_args(argv)
    text = args.readme.read_text()
    present = regions(text)
    unknown = sorted(set(present) - set(GENERATORS))
    if unknown:
        print(f"error: README regions with no generator: {', '.join(unknown)}", file=sys.stderr)
        return 2
    names = [n for n in (args.only or GENERATORS) if n in present]
    fresh = {name: GENERATORS[name]() for name in names}
    if args.check:
        problems = {n: why for n in names if (why := stale(present[n], fresh[n]))}
        for name, why in problems.items():
            print(f"{name}: stale: {why}", file=sys.stderr)
        print(json.dumps({"checked": names, "stale": sorted(problems)}))
        return 1 if problems else 0
    args.readme.write_text(rewrite(text, fresh))
    print(f"rewrote {', '.join(names)} in {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

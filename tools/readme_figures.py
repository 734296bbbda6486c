"""Regenerate the outputs the README and the documentation pages quote, so that they
cannot go stale.

Each quoted output sits in README.md or a page of docs/ (``PAGES``) between two
markers::

    <!-- generated: NAME -->
    ...what the command printed...
    <!-- /generated -->

and ``GENERATORS[NAME]`` makes it again from the code: the commands run as a user
runs them (``python -m pod ...``; training in-process, sweeps timing-only), their
output cut to what the README shows. Wall-clock figures (``wall 61.2 ms/step``,
``0.5 s (wall)``, summary rows on the wall clock) are this machine's and are left
out of the comparison (``skeleton``). Learned figures (a training run's losses and
test accuracy) come from float32 arithmetic whose bits differ between CPUs and BLAS
builds (pitfalls.md: the quick start's test accuracy is 0.5933 on one machine and
0.5905 on an AMD EPYC): they are this machine's, said so under their block
(``LEARNED_NOTE``), and checked only to ``LEARNED_RELATIVE`` (a broken training
run moves them by far more). Every other figure is simulated or computed and must
match, to the last printed digit (one unit of it either way).

Usage::

    python tools/readme_figures.py            # rewrite the regions of README.md and docs/*.md
    python tools/readme_figures.py --check    # exit 1 if a region is stale
    python tools/readme_figures.py --only collective-v4-128

``tests/test_readme_figures.py`` runs ``--check``'s comparison.
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


def pages() -> list[Path]:
    """The files whose regions this tool writes: README.md and every page of docs/
    (not docs/scaling/*, a sweep's own output)."""
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def page_regions(paths: list[Path] | None = None) -> dict[str, tuple[Path, str]]:
    """Every generated region of every page: name -> (its page, its body).

    Raises:
        ValueError: a name given twice, in one page or in two.
    """
    found: dict[str, tuple[Path, str]] = {}
    for path in pages() if paths is None else paths:
        for name, body in regions(path.read_text()).items():
            if name in found:
                raise ValueError(f"{path.name}: region {name!r} is also in "
                                 f"{found[name][0].name}")
            found[name] = (path, body)
    return found
REGION = re.compile(r"(<!-- generated: (?P<name>[\w.-]+) -->\n?)(?P<body>.*?)(<!-- /generated -->)",
                    re.S)
#: the note under every block that holds wall figures
WALL_NOTE = "(wall figures: this machine, a 2-core host shared with other work)"
#: the note under a block that also holds learned figures (losses, accuracy)
LEARNED_NOTE = ("(wall figures, losses and accuracy: this machine; losses and accuracy come from "
                "float32 arithmetic whose last digits differ between CPUs)")
#: how far a learned figure may move between machines and stay current: 2% of its value.
#: Measured spread: the quick start's test accuracy 0.5933 here, 0.5905 (-0.5%) on an AMD
#: EPYC (issue 31); twice that, and a margin, is 2%; a run that trains wrongly (another
#: learning rate, a lost gradient) moves the losses by 10% and more.
LEARNED_RELATIVE = 0.02


def _pod(*args: str, cwd: Path = ROOT) -> str:
    """What ``tpu-pod ARGS`` prints (stdout and stderr, as a terminal shows them), run
    from the checkout as a user runs it (``cwd``: another directory, for a command that
    writes files where it runs; this checkout's ``pod`` is imported all the same);
    raises if it fails."""
    path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "COLUMNS": "160", "NO_COLOR": "1", "TERM": "dumb",
           "PYTHONPATH": os.pathsep.join(path)}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run([sys.executable, "-m", "pod", *args], cwd=cwd, env=env,
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
    return _fence("\n".join(shown), LEARNED_NOTE)


def progress_line() -> str:
    """One progress line of the quick start's run (its last step)."""
    step = [line for line in _quickstart_lines() if line.startswith("step ")][-1]
    return _fence(step, LEARNED_NOTE)


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


@functools.lru_cache(maxsize=None)
def _sweep(scenario: str) -> tuple[dict, ...]:
    """The rows of ``tpu-pod sweep scenarios/SCENARIO`` (timing-only, in this process;
    the files it writes go to a temporary directory)."""
    sys.path.insert(0, str(ROOT))
    import pod

    with tempfile.TemporaryDirectory() as out:
        return tuple(pod.sweep(ROOT / "scenarios" / scenario, output_dir=out))


def _table(head: tuple[str, ...], align: str, rows: list[tuple]) -> str:
    """A Markdown table; ``align``: one letter a column, r (right) or l (left)."""
    rule = "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"
    return "\n".join(["| " + " | ".join(head) + " |", rule,
                      *("| " + " | ".join(str(c) for c in row) + " |" for row in rows)]) + "\n"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f}" if seconds >= 0.01 else f"{seconds * 1e3:.1f}"


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f}"


def _not_fit(r: dict) -> str:
    return f"does not fit ({_gib(r['hbm_per_device_bytes'])} GiB)"


def sweep_layouts_llama_33b() -> str:
    """The 33B layout sweep on v5p-128, one row per mesh: its fastest point that fits."""
    rows = _sweep("layouts-llama-33b-v5p-128.yaml")
    out = []
    for mesh in dict.fromkeys(r["mesh"] for r in rows):
        points = [r for r in rows if r["mesh"] == mesh]
        ok = [r for r in points if r["status"] == "ok"]
        if not ok:
            least = min(points, key=lambda r: r["hbm_per_device_bytes"])
            out.append((mesh, f"0 of {len(points)}", "-", "-", "-", "-", "-",
                        f"needs {_gib(least['hbm_per_device_bytes'])} at least", "-", "-"))
            continue
        b = max(ok, key=lambda r: r["simulated_tokens_per_second"])
        out.append((mesh, f"{len(ok)} of {len(points)}", f"{b['remat']}, {b['per_device_batch']}",
                    f"{b['simulated_step_seconds']:.3f}", _ms(b["exposed_data_seconds"]),
                    _ms(b["exposed_fsdp_seconds"]), _ms(b["exposed_tensor_seconds"]),
                    _gib(b["hbm_per_device_bytes"]), f"{b['mfu']:.1%}",
                    f"{b['simulated_tokens_per_second']:,.0f}"))
    return ("`tpu-pod sweep scenarios/layouts-llama-33b-v5p-128.yaml` (simulated), the fastest "
            "point of each mesh that fits:\n\n" + _table(
                ("mesh", "fit", "remat, sequences / device", "step s", "exposed data ms",
                 "exposed fsdp ms", "exposed tensor ms", "HBM GiB / device", "MFU", "tokens/s"),
                "llllrrrrrr", out))


def _scaling_table(scenario: str, title: str) -> str:
    rows = [r for r in _sweep(scenario) if r["status"] == "ok"]
    out = [(f"{r['chips']:,}", r["mesh"], r["per_device_batch"],
            f"{r['simulated_step_seconds']:.3f}", f"{r['compute_seconds']:.3f}",
            _ms(r["exposed_data_seconds"]), _ms(r["exposed_fsdp_seconds"]),
            _ms(r["exposed_tensor_seconds"]), f"{r['mfu']:.1%}",
            f"{r['simulated_tokens_per_second']:,.0f}", f"{r['scaling_efficiency']:.2f}",
            f"{r['bound']} {r['bound_fraction']:.0%}") for r in rows]
    return f"`tpu-pod sweep scenarios/{scenario}` (simulated; {title}):\n\n" + _table(
        ("chips", "mesh", "sequences / device", "step s", "compute s", "exposed data ms",
         "exposed fsdp ms", "exposed tensor ms", "MFU", "tokens/s", "efficiency", "bound"),
        "rlrrrrrrrrrl", out)


def sweep_llama2_7b_weak() -> str:
    """LLaMA-2 7B weak scaling on v5p, every point."""
    return _scaling_table("scaling-llama2-7b-v5p-weak.yaml",
                          "2 sequences of 4,096 tokens per device")


def sweep_llama2_7b_strong() -> str:
    """LLaMA-2 7B strong scaling on v5p, every point."""
    return _scaling_table("scaling-llama2-7b-v5p-strong.yaml",
                          "global batch 256 sequences of 4,096 tokens")


def sweep_pipeline_gpt3() -> str:
    """The pipeline bubble against the microbatches, GPT-3 175B on v5p-1024."""
    rows = _sweep("pipeline-gpt3-175b-v5p-1024.yaml")
    out = []
    for r in rows:
        stages, m = r["stage"], r["microbatches"]
        out.append((m, f"{r['simulated_step_seconds']:.2f}",
                    f"{r['pipeline_bubble_seconds']:.2f}", f"{r['pipeline_bubble_fraction']:.0%}",
                    f"{(stages - 1) / (m + stages - 1):.0%}", _ms(r["exposed_fsdp_seconds"]),
                    f"{r['mfu']:.1%}", _gib(r["hbm_per_device_bytes"]),
                    f"{r['bound']} {r['bound_fraction']:.0%}"))
    head = ("microbatches", "step s", "bubble s", "bubble / (fwd + bwd)",
            "closed form (S - 1) / (M + S - 1)", "exposed fsdp ms", "MFU", "HBM GiB / device",
            "bound")
    return (f"`tpu-pod sweep scenarios/pipeline-gpt3-175b-v5p-1024.yaml`: `{rows[0]['mesh']}`, "
            f"{rows[0]['global_batch']:,} sequences of 2,048 tokens per step, remat "
            f"{rows[0]['remat']}:\n\n" + _table(head, "rrrrrrrrl", out))


def sweep_layouts_mixtral() -> str:
    """Mixtral 8x7B's layouts on v5p-128: the expert axis at 1 to 8, remat."""
    out = []
    for r in _sweep("layouts-mixtral-8x7b-v5p-128.yaml"):
        if r["status"] != "ok":
            out.append((r["mesh"], r["remat"], _not_fit(r), "", "", "", "", "", ""))
            continue
        out.append((r["mesh"], r["remat"], f"{r['simulated_step_seconds']:.3f}",
                    f"{r['compute_seconds']:.3f}", _ms(r["exposed_expert_seconds"]),
                    _ms(r["exposed_fsdp_seconds"]), _gib(r["hbm_per_device_bytes"]),
                    f"{r['mfu']:.1%}", f"{r['simulated_tokens_per_second']:,.0f}"))
    return ("`tpu-pod sweep scenarios/layouts-mixtral-8x7b-v5p-128.yaml` (simulated; 4 sequences "
            "of 4,096 tokens per device, 1,048,576 tokens a step on every layout):\n\n" + _table(
                ("mesh", "remat", "step s", "compute s", "exposed expert ms", "exposed fsdp ms",
                 "HBM GiB / device", "MFU", "tokens/s"), "llrrrrrrr", out))


def _plan(*args: str) -> str:
    """``tpu-pod plan ARGS`` as a user runs it (in a fresh directory, so the files it names
    are ``runs/plan-<model>-<slice>/``), its lines with the table's padding cut."""
    with tempfile.TemporaryDirectory() as cwd:
        text = _pod("plan", *args, cwd=Path(cwd))
    lines = [line.rstrip() for line in text.splitlines()]
    return _fence(f"$ tpu-pod plan {' '.join(args)}\n" + "\n".join(lines), WALL_NOTE)


def plan_llama2_7b() -> str:
    """Question (a): Llama-2-7B on v5e-256 at its published 4M tokens a step, for 2T tokens."""
    return _plan("llama2-7b", "--slice", "v5e-256", "--seq-len", "4096", "--tokens-per-step",
                 "4Mi", "--token-budget", "2T")


def plan_maxtext_s1() -> str:
    """Question (b): the MaxText 2023 1B model on v5p-64, FSDP against FSDP + tensor."""
    return _plan("maxtext-2023-s1", "--slice", "v5p-64", "--mesh-axes", "fsdp,tensor")


def plan_num_slices() -> str:
    """The 1B MaxText model on one to four v5e-64 slices at a fixed 512Ki tokens a step."""
    return _plan("maxtext-2023-s1", "--slice", "v5e-64", "--num-slices", "1,2,4",
                 "--mesh-axes", "fsdp", "--remat", "full", "--tokens-per-step", "512Ki")


@functools.cache
def _fidelity_doc() -> dict:
    """``benchmarks/fidelity.py --json``'s document (one run for both regions)."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fidelity.py"), "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=1800, check=True)
    return json.loads(done.stdout)


def _mean_error_line(doc: dict) -> str:
    """One sentence: the mean absolute errors of the single ops and the training steps."""
    ops = [r for r in doc["rows"] if r["in_stats"]]
    steps = doc["training_rows"]
    one = [r for r in steps if r["id"].startswith("T")]
    mae = lambda rows: sum(abs(r["error_pct"]) for r in rows) / len(rows)  # noqa: E731
    worst = max(steps, key=lambda r: abs(r["error_pct"]))
    return (f"Mean absolute error {mae(ops):.1f}% over the {len(ops)} measured single-op rows "
            f"(S1-S2 are specifications); {mae(one):.1f}% over T1-T{len(one)} and "
            f"{mae(steps):.1f}% over all {len(steps)} training steps, the worst "
            f"{worst['id']} {worst['error_pct']:+.1f}% (in sample: `benchmarks/fidelity.py "
            f"--fit-mxu --held-out` holds each out).\n")


def accuracy_headline() -> str:
    """The README's accuracy headline: each training row's error in one line, then the
    mean errors (``fidelity``'s last line)."""
    doc = _fidelity_doc()
    rows = ", ".join(f"{r['id']} {r['error_pct']:+.1f}%" for r in doc["training_rows"])
    return f"Training steps, predicted against published: {rows}.\n\n" + _mean_error_line(doc)


def fidelity() -> str:
    """What the clock is checked against: every single-op and training row of
    ``benchmarks/fidelity.py`` (published, predicted, error), one table."""
    doc = _fidelity_doc()

    def seconds(s: float) -> str:
        return f"{s * 1e3:.4g} ms" if s >= 1e-3 else f"{s * 1e6:.4g} us"

    out = []
    for r in doc["rows"]:
        if r["timing"] == "spec":
            pub, pred = f"{r['published_s'] / 1e12:.1f} TB/s", f"{r['predicted_s'] / 1e12:.1f} TB/s"
        else:
            pub, pred = seconds(r["published_s"]), seconds(r["predicted_s"])
        err = f"{r['error_pct']:+.1f}%" + ("" if r["in_stats"] else " (spec)")
        out.append((r["id"], r["source"], r["setup"], r["timing"], pub, pred, err))
    for r in doc["training_rows"]:
        out.append((r["id"], r["source"], r["setup"],
                    "TFLOP/s per device", f"{r['published_tflops']:.1f}",
                    f"{r['predicted_tflops']:.1f}",
                    f"{r['error_pct']:+.1f}%"))
    return (_table(("id", "source", "setup", "timing", "published", "predicted", "error"),
                   "llllrrr", out)
            + "\n" + _mean_error_line(doc))


GENERATORS: dict[str, Callable[[], str]] = {
    "quickstart-run": quickstart_run,
    "progress-line": progress_line,
    "quickstart-epochs": quickstart_epochs,
    "collective-v4-128": collective_v4_128,
    "override-error": override_error,
    "sweep-v4-weak": sweep_v4_weak,
    "sweep-layouts-llama-33b": sweep_layouts_llama_33b,
    "sweep-llama2-7b-weak": sweep_llama2_7b_weak,
    "sweep-llama2-7b-strong": sweep_llama2_7b_strong,
    "sweep-pipeline-gpt3": sweep_pipeline_gpt3,
    "sweep-layouts-mixtral": sweep_layouts_mixtral,
    "plan-llama2-7b": plan_llama2_7b,
    "plan-maxtext-s1": plan_maxtext_s1,
    "plan-num-slices": plan_num_slices,
    "fidelity": fidelity,
    "accuracy-headline": accuracy_headline,
}

_NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")
_WALL = (re.compile(r"(wall )[\d,.]+( ms/step)"), re.compile(r"()[\d,.]+( s \(wall\))"),
         re.compile(r"(ready in )[\d,.]+( s \(wall\))"),
         re.compile(r"(; )[\d,.]+ s wall \([\d,.]+( points/s\))"))  # tpu-pod plan's summary


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


#: learned figures: a step's loss, an epoch's losses and accuracy, the summary's rows
_LEARNED = (re.compile(r"(?<![\w-])(loss:? |test_loss: |test_accuracy: )(\d+\.\d+)"),
            re.compile(r"(│ loss first -> last\s+│\s+)(\d+\.\d+) -> (\d+\.\d+)"),
            re.compile(r"(│ test loss, accuracy\s+│\s+)(\d+\.\d+), (\d+\.\d+)"))


def skeleton(text: str) -> tuple[str, list[str], list[str]]:
    """What must match between the README and a fresh run: the text with its wall-clock
    figures masked and its numbers taken out ("#"), the numbers in order, and the learned
    figures (losses, accuracy; ``LEARNED_RELATIVE``) in order."""
    lines, learned = [], []
    for line in text.splitlines():
        if re.search(r"│\s*wall(/simulated)?\s*│\s*$", line):  # a summary row on the wall clock
            # its width follows the wall figure's digits: spaces collapsed too
            line = re.sub(r" +", " ", re.sub(_NUMBER, "<wall>", line))
        for pattern in _WALL:
            line = pattern.sub(r"\1<wall>\2", line)
        for pattern in _LEARNED:
            for match in pattern.finditer(line):
                learned.extend(match.groups()[1:])
            line = pattern.sub(lambda m: m.group(1) + "<learned>", line)
        lines.append(line)
    masked = "\n".join(lines)
    return _NUMBER.sub("#", masked), _NUMBER.findall(masked), learned


def _close(quoted: str, fresh: str) -> bool:
    """Two printed numbers agree to one unit of the last digit printed."""
    a, b = float(quoted.replace(",", "")), float(fresh.replace(",", ""))
    decimals = len(quoted.split(".")[1]) if "." in quoted else 0
    return decimals == (len(fresh.split(".")[1]) if "." in fresh else 0) and \
        abs(a - b) <= 10 ** -decimals * 1.0001


def stale(quoted: str, fresh: str) -> str | None:
    """Why a README region differs from a fresh one (None: it does not)."""
    (text_q, num_q, learned_q), (text_f, num_f, learned_f) = skeleton(quoted), skeleton(fresh)
    if text_q != text_f:
        import difflib

        diff = difflib.unified_diff(text_q.splitlines(), text_f.splitlines(), "README",
                                    "generated", lineterm="", n=1)
        return "the text differs:\n" + "\n".join(diff)
    bad = [(q, f) for q, f in zip(num_q, num_f) if not _close(q, f)]
    bad += [(q, f) for q, f in zip(learned_q, learned_f)
            if abs(float(q) - float(f)) > LEARNED_RELATIVE * abs(float(q))]
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
    parser.add_argument("--page", type=Path, action="append", default=None,
                        help="only this page's regions (default: README.md and docs/*.md)")
    args = parser.parse_args(argv)
    present = page_regions(args.page)
    unknown = sorted(set(present) - set(GENERATORS))
    if unknown:
        print(f"error: regions with no generator: {', '.join(unknown)}", file=sys.stderr)
        return 2
    names = [n for n in (args.only or GENERATORS) if n in present]
    fresh = {name: GENERATORS[name]() for name in names}
    if args.check:
        problems = {n: why for n in names if (why := stale(present[n][1], fresh[n]))}
        for name, why in problems.items():
            print(f"{name} ({present[name][0].name}): stale: {why}", file=sys.stderr)
        print(json.dumps({"checked": names, "stale": sorted(problems)}))
        return 1 if problems else 0
    for path in sorted({present[n][0] for n in names}):
        mine = {n: fresh[n] for n in names if present[n][0] == path}
        path.write_text(rewrite(path.read_text(), mine))
        print(f"rewrote {', '.join(mine)} in {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Valid scenarios mutated leaf by leaf, through ``tpu-pod validate``'s own code path.

Hypothesis picks a shipped scenario, one place in it (a value, a list item, a
mapping) and one mutation: another value from a pool of hostile ones (negative,
zero, huge, NaN, infinite, empty, very long, ``..``, NUL, the wrong type, deep
nesting), the key deleted, an unknown key added beside it. The mutated file is
given to ``pod.cli.main(["validate", FILE])`` in this process, which must either
accept it (``ok``, exit 0) or print exactly one bounded line naming the file
(exit 2), never a traceback, within 5 s of CPU time (CPU, not wall: the suite
shares a busy machine; an alias bomb took 32 s of CPU before the YAML bounds).
"""

from __future__ import annotations

import contextlib
import io
import math
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[3]
#: Valid scenarios of every kind: training (several models and data), a benchmark, a sweep.
BASES = {name: yaml.safe_load((ROOT / "scenarios" / f"{name}.yaml").read_text())
         for name in ("quickstart", "char-lstm", "transformer-tiny", "seed-imdb-lstm-v2-8",
                      "seed-matmul-v2-8", "scaling-v5e-strong")}
#: CPU seconds one validation may take.
CPU_SECONDS = 5.0
#: Longest error line accepted (messages show values with a bounded repr).
MAX_LINE = 1500

HOSTILE: list[Any] = [
    -1, 0, 1, 3, 2**31, 2**63, 10**30, -(10**30),
    0.0, -0.5, 1e-300, 1e308, math.nan, math.inf, -math.inf,
    True, False, None,
    "", " ", "x", "..", ".", "../outside", "a/b", "nul\x00byte", "é✓", "x" * 5000,
    "2x2x2", "v9-8", "1e9", "-3",
    [], {}, [None], {"x": 1}, [[[[[[[[]]]]]]]], list(range(1000)), {"name": "mlp"},
]


def _places(node: Any, path: tuple = ()) -> list[tuple]:
    """Every place of a YAML tree: each mapping value, list item (and the tree itself)."""
    out = [path] if path else []
    if isinstance(node, dict):
        for key, value in node.items():
            out += _places(value, (*path, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            out += _places(value, (*path, i))
    return out


def _mutated(base: dict, path: tuple, op: str, value: Any) -> dict:
    tree = yaml.safe_load(yaml.safe_dump(base))
    parent = tree
    for key in path[:-1]:
        parent = parent[key]
    last = path[-1]
    if op == "replace":
        parent[last] = value
    elif op == "delete" and isinstance(parent, dict):
        del parent[last]
    elif op == "delete":
        parent.pop(last)
    elif op == "unknown key" and isinstance(parent, dict):
        parent["no_such_key"] = value
    else:  # an unknown key beside a list item: the item becomes a mapping holding it
        parent[last] = {"no_such_key": value}
    return tree


@st.composite
def mutations(draw) -> tuple[str, tuple, str, Any]:
    name = draw(st.sampled_from(sorted(BASES)))
    path = draw(st.sampled_from(_places(BASES[name])))
    op = draw(st.sampled_from(["replace", "replace", "replace", "delete", "unknown key"]))
    value = draw(st.sampled_from(HOSTILE))
    return name, path, op, value


def validate_in_process(path: Path) -> tuple[Any, str, str, float]:
    """``pod.cli.main(["validate", path])``: exit code, stdout, stderr (with a traceback
    if one escaped), CPU seconds."""
    from pod.cli import main

    out, err = io.StringIO(), io.StringIO()
    code: Any = None
    cpu = time.process_time()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(["validate", str(path)])
        except SystemExit as exit_:
            code = exit_.code
        except BaseException:  # noqa: BLE001 - a traceback is what this test looks for
            err.write(traceback.format_exc())
    return code, out.getvalue(), err.getvalue(), time.process_time() - cpu


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mutations")


def test_every_base_scenario_is_valid(workdir):
    for name, base in BASES.items():
        path = workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(base, allow_unicode=True))
        code, stdout, stderr, _ = validate_in_process(path)
        assert code == 0 and ": ok (" in stdout and not stderr, (name, stderr)


@pytest.mark.slow  # several seconds: the slow tier (make test stays under 3 minutes)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutations())
def test_a_mutated_scenario_is_ok_or_one_line(workdir, mutation):
    name, place, op, value = mutation
    path = workdir / "mutated.yaml"
    text = yaml.safe_dump(_mutated(BASES[name], place, op, value), allow_unicode=True)
    path.write_text(text, encoding="utf-8")
    code, stdout, stderr, cpu = validate_in_process(path)
    what = f"{name}: {'.'.join(map(str, place))} {op} {value!r:.80}"
    assert "Traceback" not in stderr + stdout, f"{what}: traceback:\n{stderr}"
    assert cpu < CPU_SECONDS, f"{what}: {cpu:.1f} s of CPU"
    if code == 0:
        assert ": ok (" in stdout and not stderr.strip(), f"{what}: {stdout!r} {stderr!r}"
        return
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, f"{what}: exit {code}, stderr:\n{stderr}"
    assert lines[0].startswith(f"error: {path}: "), f"{what}: {lines[0]}"
    assert len(lines[0]) < MAX_LINE, f"{what}: a {len(lines[0])}-character line"


def _validate_with(path: Path, overrides: list[str]) -> tuple[Any, str, str]:
    """``pod.cli.main(["validate", path, *overrides])``: exit code, stdout, stderr."""
    from pod.cli import main

    out, err = io.StringIO(), io.StringIO()
    code: Any = None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(["validate", str(path), *overrides])
        except SystemExit as exit_:
            code = exit_.code
        except BaseException:  # noqa: BLE001 - a traceback is what this test looks for
            err.write(traceback.format_exc())
    return code, out.getvalue(), err.getvalue()


def _as_override(place: tuple, value: Any) -> str | None:
    """``KEY=VALUE`` setting ``place`` to ``value`` on the command line (None: cannot be one:
    too long, or a key whose override drops another or whose path resolves differently)."""
    from pod.config.overrides import MAX_OVERRIDE_CHARS, REPLACES

    key = ".".join(map(str, place))
    text = yaml.safe_dump(value, default_flow_style=True, allow_unicode=True, width=10**9)
    text = text.removesuffix("\n").removesuffix("\n...")
    if key in REPLACES or key in ("data.path", "checkpoint.dir") or not all(
            str(p).isidentifier() or str(p).isdigit() for p in place):
        return None
    override = f"{key}={text}"
    return override if len(override) <= MAX_OVERRIDE_CHARS and "\n" not in override else None


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutations())
def test_a_mutation_given_as_an_override_gives_the_file_s_outcome(workdir, mutation):
    """The same replacement, made in the file or given as KEY=VALUE after it, is accepted
    or refused alike, with the same line (the override named at its end)."""
    name, place, _, value = mutation
    override = _as_override(place, value)
    if override is None:
        return
    base = workdir / f"base-{name}.yaml"
    base.write_text(yaml.safe_dump(BASES[name], allow_unicode=True), encoding="utf-8")
    edited = workdir / "edited.yaml"
    edited.write_text(yaml.safe_dump(_mutated(BASES[name], place, "replace", value),
                                     allow_unicode=True), encoding="utf-8")
    file_code, _, file_err = _validate_with(edited, [])
    code, out, err = _validate_with(base, [override])
    assert "Traceback" not in err + out, f"{override}: traceback:\n{err}"
    assert code == file_code, f"{override}: exit {code}, the edited file's {file_code}: {err}"
    if code:
        mine = err.strip().removeprefix(f"error: {base}: ")
        theirs = file_err.strip().removeprefix(f"error: {edited}: ")
        assert mine.startswith(theirs.split(" (and ")[0]), (override, mine, theirs)

"""Every malformed scenario in ``bad_scenarios/`` ends in one clear line, through the CLI.

Each corpus file starts with a comment saying what is wrong, then

    # expect: FIELD | FRAGMENT | FRAGMENT ...
    # command: validate            (optional; "run", or "validate, run")
    # overrides: KEY=VALUE ...     (optional; command-line overrides given after the file)

FIELD is the dotted path the message must name right after the file
(``error: <file>: FIELD: ...``), ``line N`` for a YAML error at line N, or
``<file>`` for a problem with the file itself. Every FRAGMENT (the value
received, what is allowed) must appear in the line. The message must be the
only line on stderr, the exit status 2, and there must be no traceback.

``validate`` and ``run`` agree: every validate case is also given to
``run`` (no ``--steps``, which would change the scenario), which must stop
with the very same line before any actor starts.

Speed: the validate cases run in ONE subprocess (this file run as a script
calls ``pod.cli.main(["validate", FILE])`` and ``pod.cli.main(["run", FILE])``
per file and reports each exit status and stderr as JSON); four are also run as ``python -m pod validate``
(two at a time) to check the real entry point; the cases only ``run`` can see (a port in use)
run ``python -m pod run FILE --steps 1`` in their own subprocess. All of them
run from a different working directory than the repository, so ``data.path``
must resolve relative to the scenario file.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import socket
import subprocess
import sys
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
CORPUS_DIR = Path(__file__).resolve().parent / "bad_scenarios"
CORPUS = sorted(CORPUS_DIR.glob("*.yaml"))


def _header(path: Path) -> tuple[str, list[str], set[str]]:
    """(field, fragments, commands) from a corpus file's comment lines."""
    field, fragments, commands = None, [], {"validate"}
    for line in path.read_bytes().decode("utf-8", errors="replace").splitlines():
        if not line.startswith("#"):
            break
        if line.startswith("# expect:"):
            field, *fragments = [part.strip() for part in line[len("# expect:"):].split(" | ")]
        elif line.startswith("# command:"):
            commands = {c.strip() for c in line[len("# command:"):].split(",")}
    assert field, f"{path.name}: no '# expect: FIELD | FRAGMENT' line"
    return field, fragments, commands


def overrides_of(path: Path) -> list[str]:
    """The ``# overrides:`` arguments of a corpus file (shell words), given after the file."""
    for line in path.read_bytes().decode("utf-8", errors="replace").splitlines():
        if not line.startswith("#"):
            break
        if line.startswith("# overrides:"):
            return shlex.split(line[len("# overrides:"):])
    return []


CASES = {path.name: (path, *_header(path)) for path in CORPUS}
VALIDATE = sorted(name for name, case in CASES.items() if "validate" in case[3])
RUN = sorted(name for name, case in CASES.items() if "run" in case[3])


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}


def _check(name: str, path: Path, code, stdout: str, stderr: str, *,
           file_named: bool = True) -> None:
    """Assert one CLI outcome against the file's expect line.

    ``file_named=False``: errors raised once a run has started (the metrics
    port) name the field but not the scenario file.
    """
    _, field, fragments, _ = CASES[name]
    assert "Traceback" not in stderr + stdout, f"{name}: traceback:\n{stderr}"
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"{name}: expected one line on stderr, got:\n{stderr}"
    assert code == 2, f"{name}: exit status {code}, expected 2; stderr: {stderr}"
    line = lines[0]
    prefix = f"error: {path}: " if file_named or line.startswith(f"error: {path}: ") else "error: "
    assert line.startswith(prefix), f"{name}: does not start with {prefix!r}: {line}"
    message = line[len(prefix):]
    if field.startswith("line "):
        assert message.startswith(f"invalid YAML at {field}, "), f"{name}: {line}"
    elif field != "<file>":
        assert message.startswith(f"{field}: "), f"{name}: field {field!r} not named first: {line}"
    for fragment in fragments:
        assert fragment in message, f"{name}: {fragment!r} not in: {line}"


@pytest.fixture(scope="module")
def validated(tmp_path_factory) -> dict[str, dict]:
    """Every validate case through ``pod.cli.main`` in one subprocess, from another directory."""
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    paths = [str(CASES[name][0]) for name in VALIDATE]
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), *paths], cwd=elsewhere,
                         capture_output=True, text=True, timeout=600, env=_env())
    assert out.returncode == 0, out.stderr
    results = {}
    for line in out.stdout.splitlines():
        row = json.loads(line)
        results[Path(row["path"]).name] = row
    return results


def test_the_corpus_is_large_and_every_file_says_what_is_wrong():
    assert len(CORPUS) >= 30
    for path in CORPUS:
        first = path.read_bytes().splitlines()[0]
        assert first.startswith(b"# ") and len(first) > 10, path.name


@pytest.mark.parametrize("name", VALIDATE)
def test_validate_gives_one_line_naming_field_and_value(validated, name):
    row = validated[name]
    _check(name, CASES[name][0], row["code"], row["stdout"], row["stderr"])


@pytest.mark.parametrize("name", VALIDATE)
def test_run_rejects_what_validate_rejects_with_the_same_line(validated, name):
    row, run = validated[name], validated[name]["run"]
    assert "Traceback" not in run["stderr"], f"{name}: traceback:\n{run['stderr']}"
    assert (run["code"], run["stderr"]) == (row["code"], row["stderr"]), name
    assert "chip actors ready" not in run["stdout"], f"{name}: run started the pod"


def test_the_real_entry_point_agrees(tmp_path):
    """A few cases as a user types them, ``python -m pod validate FILE``, two at a time."""
    names = ["python_object_tag.yaml", "empty_file.yaml", "model_too_big_for_hbm.yaml",
             "data_path_wrong_format.yaml"]

    def validate(name: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pod", "validate", str(CASES[name][0])],
                              cwd=tmp_path, capture_output=True, text=True, timeout=300,
                              env=_env())

    with ThreadPoolExecutor(max_workers=2) as pool:
        outs = list(pool.map(validate, names))
    for name, out in zip(names, outs):
        _check(name, CASES[name][0], out.returncode, out.stdout, out.stderr)


def _bound_port() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    return sock


@pytest.mark.parametrize("name", RUN)
def test_run_gives_one_line_before_training(tmp_path, name):
    """``run --steps 1``: the error comes before any chip actor trains."""
    source = CASES[name][0]
    with contextlib.closing(_bound_port()) as sock:
        port = sock.getsockname()[1]
        path = tmp_path / source.name
        path.write_text(source.read_text().replace("PORT_IN_USE", str(port)))
        out = subprocess.run([sys.executable, "-m", "pod", "run", str(path), *overrides_of(source),
                              "--steps", "1",
                              "--output-dir", str(tmp_path / "out")], cwd=tmp_path,
                             capture_output=True, text=True, timeout=300, env=_env())
    _check(name, path, out.returncode, out.stdout, out.stderr, file_named=False)
    if "PORT_IN_USE" in source.read_text():
        assert f"port {port} " in out.stderr, out.stderr
    assert "step 1/1" not in out.stdout


def test_data_path_is_relative_to_the_scenario_not_the_working_directory(tmp_path):
    """The same scenario validates from any directory; its data file is found beside it."""
    (tmp_path / "conf" / "data").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "conf" / "data" / "corpus.txt").write_text(
        "The quick brown fox jumps over the lazy dog. " * 200, encoding="utf-8")
    scenario = tmp_path / "conf" / "s.yaml"
    scenario.write_text("name: s\npod: {slice: v2-8}\nmodel: {name: char_lstm}\n"
                        "data: {name: text, path: data/corpus.txt, options: {sequence_length: 8}}\n"
                        "training: {global_batch: 64, steps: 1}\n")
    out = subprocess.run([sys.executable, "-m", "pod", "validate", "../conf/s.yaml"],
                         cwd=tmp_path / "elsewhere", capture_output=True, text=True, timeout=300,
                         env=_env())
    assert out.returncode == 0 and ": ok (" in out.stdout, out.stderr


def _main(args: list[str]) -> dict:
    """``pod.cli.main(args)`` in this process: exit code, stdout, stderr (a traceback
    if one escaped)."""
    from pod.cli import main

    err, std = io.StringIO(), io.StringIO()
    code = None
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(std):
        try:
            main(args)
        except SystemExit as exit_:
            code = exit_.code
        except BaseException:  # noqa: BLE001 - a traceback is exactly what we look for
            err.write(traceback.format_exc())
    return {"code": code, "stdout": std.getvalue(), "stderr": err.getvalue()}


def _runner(paths: list[str]) -> None:
    """Script mode: validate, then run, each file through the CLI entry point; one JSON
    line per file."""
    import tempfile

    for path in paths:
        extra = overrides_of(Path(path))
        row = _main(["validate", path, *extra])
        with tempfile.TemporaryDirectory() as out:
            row["run"] = _main(["run", path, *extra, "--output-dir", out, "--metrics-port", "0"])
        print(json.dumps({"path": path, **row}), flush=True)


if __name__ == "__main__":
    _runner(sys.argv[1:])

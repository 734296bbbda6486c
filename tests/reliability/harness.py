"""The probe harness of issue 34's corpus: a probe is a ``tpu-pod`` command line and what
it must end in (one line starting ``error:``, or success), with the files it must leave
as they were.

A probe runs two ways: in this process (``pod.cli.main``: the fast tier, for probes that
take well under a second) and in a subprocess under ``RLIMIT_AS`` (1 GiB of address
space) and ``RLIMIT_CPU`` (10 s of CPU), the issue's bounds, so that a missing bound shows
as a MemoryError, a kill or SIGXCPU rather than as a slow test (the slow tier; CPU time,
not wall time, because this machine is shared). A full disk is a real one: a 64 KiB
tmpfs mounted in a private mount namespace (``unshare --user --map-root-user --mount``),
where the kernel allows it.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import resource
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: The issue's bounds: every probe within 1 GiB of address space and 10 s (CPU).
ADDRESS_SPACE_BYTES = 1 << 30
CPU_SECONDS = 10
#: A hang guard only (never an assertion about speed): a probe past it failed.
WALL_TIMEOUT_S = 600


@dataclass(frozen=True)
class Result:
    """What a probe printed and how it ended."""

    code: int
    out: str
    err: str


def cli(args: list[str], cwd: Path) -> Result:
    """``tpu-pod ARGS`` in this process (``pod.cli.main``): its exit status and output."""
    from pod.cli import main

    out, err = io.StringIO(), io.StringIO()
    code = 0
    old = Path.cwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main(list(args))
            except SystemExit as stop:
                code = stop.code if isinstance(stop.code, int) else 1
    finally:
        os.chdir(old)
    return Result(code, out.getvalue(), err.getvalue())


def _limits() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_BYTES, ADDRESS_SPACE_BYTES))
    resource.setrlimit(resource.RLIMIT_CPU, (CPU_SECONDS, CPU_SECONDS))


def bounded_cli(args: list[str], cwd: Path, *, full_disk: Path | None = None) -> Result:
    """``tpu-pod ARGS`` in a subprocess within the issue's bounds (``_limits``); with
    ``full_disk``, that directory is a full 64 KiB tmpfs for the command (skips the test
    where no private mount namespace can be made)."""
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "pod", *args]
    if full_disk is not None:
        full_disk.mkdir(parents=True, exist_ok=True)
        command = _in_full_tmpfs(full_disk, command)
    proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=WALL_TIMEOUT_S, preexec_fn=_limits)
    return Result(proc.returncode, proc.stdout, proc.stderr)


def can_fill_a_disk() -> bool:
    """Whether this machine lets the tests mount a tmpfs of their own (``unshare``)."""
    if shutil.which("unshare") is None:
        return False
    proc = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                           "mount -t tmpfs -o size=64k tmpfs /tmp"], capture_output=True)
    return proc.returncode == 0


def _in_full_tmpfs(directory: Path, command: list[str]) -> list[str]:
    if not can_fill_a_disk():
        pytest.skip("no private mount namespace here (unshare --user --mount)")
    script = (f"mount -t tmpfs -o size=64k tmpfs '{directory}' && "
              f"dd if=/dev/zero of='{directory}/filler' bs=1k count=64 2>/dev/null; "
              'exec "$@"')
    return ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, "sh",
            *command]


def one_line_error(result: Result, *fragments: str, code: int = 2, notes: bool = False) -> None:
    """The probe ended with exit ``code`` and one line on stderr starting ``error:`` that
    holds every fragment; no traceback, no MemoryError. With ``notes``, lines starting
    ``warning:`` or ``note:`` may come before it (import-maxtext names every key it does
    not map)."""
    lines = [line for line in result.err.splitlines() if line.strip() and not (
        notes and line.startswith(("warning: ", "note: ")))]
    assert result.code == code, (result.code, result.err[-3000:])
    assert "Traceback" not in result.err and "MemoryError" not in result.err, result.err[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.err[-3000:]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def succeeded(result: Result) -> None:
    """The probe ended with exit 0 and no traceback."""
    assert result.code == 0, (result.code, result.err[-3000:])
    assert "Traceback" not in result.err + result.out, result.err[-3000:]


def snapshot(*paths: Path) -> dict[str, str]:
    """Every file under ``paths``, by path, as a digest of its bytes (links by target):
    taken before a probe and compared after it, nothing it did not mean to change has."""
    out: dict[str, str] = {}
    for root in paths:
        items = [root] if not root.is_dir() or root.is_symlink() else sorted(root.rglob("*"))
        for item in items:
            if item.is_symlink():
                out[str(item)] = "link:" + os.readlink(item)
            elif item.is_file():
                out[str(item)] = hashlib.sha256(item.read_bytes()).hexdigest()
            elif item.exists() and not item.is_dir():
                out[str(item)] = f"node:{item.stat().st_mode:o}"
    return out


@dataclass(frozen=True)
class Probe:
    """One probe of the corpus.

    Attributes:
        name: the issue's words for it.
        args: the command line after ``tpu-pod`` (``{tmp}`` and ``{data}`` filled in).
        expect: the fragments of the one ``error:`` line, or None: it must succeed.
        fast: also run in this process in the fast tier (well under a second).
        keep: paths (under ``{tmp}``) that must be as they were after it.
        notes: ``warning:`` and ``note:`` lines may come before the error line.
    """

    name: str
    args: tuple[str, ...]
    expect: tuple[str, ...] | None
    fast: bool = True
    keep: tuple[str, ...] = field(default=())
    notes: bool = False

    def command(self, tmp: Path) -> list[str]:
        data = ROOT / "tests" / "data" / "maxtext"
        return [a.format(tmp=tmp, data=data, scenarios=ROOT / "scenarios") for a in self.args]

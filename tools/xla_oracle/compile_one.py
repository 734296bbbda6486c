"""Compile one spec in its own process: ``python -m tools.xla_oracle.compile_one OUT_DIR``
with the spec as JSON on stdin; :func:`compile_in_child` runs it from the parent.

Writes ``OUT_DIR/outcome.json`` (``step.compile_spec``'s outcome without the HLO) and
``OUT_DIR/module.hlo.txt`` (the scheduled HLO) when the compile succeeded. One process per
config keeps a crash or the host memory of one big compile away from the others.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def compile_in_child(spec: dict[str, Any], timeout_s: float = float("inf"), *,
                     python: str = sys.executable,
                     libtpu_args: str | None = None) -> tuple[dict[str, Any], str | None]:
    """Compile ``spec`` in a child process of ``python`` (this module's ``main``), printing
    a note every few minutes while it runs.

    Args:
        spec: a resolved spec (``tools.xla_oracle.spec.resolve``).
        timeout_s: wall seconds before the child is killed.
        python: the interpreter whose jax and libtpu compile it.
        libtpu_args: XLA's TPU flags (``LIBTPU_INIT_ARGS``); None: the spec's own
            ``xla_flags`` and none for a spec that names none (a ``LIBTPU_INIT_ARGS`` of
            the caller's shell would change the program behind the cache key's back).

    Returns:
        (outcome, the scheduled HLO text or None): the outcome of ``step.compile_spec``,
        or ``{"ok": False, "stage": "timeout" | "crash", "error": ...}``.
    """
    if libtpu_args is None:
        libtpu_args = (spec.get("xla_flags") or {}).get("libtpu_args", "")
    with tempfile.TemporaryDirectory(prefix="xla-oracle-") as tmp:
        log = Path(tmp) / "stderr.txt"
        with log.open("w") as err:
            proc = subprocess.Popen([python, "-m", "tools.xla_oracle.compile_one", tmp],
                                    cwd=ROOT, stdin=subprocess.PIPE, stdout=err, stderr=err,
                                    bufsize=0, env={**os.environ, "LIBTPU_INIT_ARGS": libtpu_args})
            assert proc.stdin is not None
            data = memoryview(json.dumps(spec).encode())
            try:   # unbuffered: nothing left to flush at close if the child is gone
                while data:
                    data = data[proc.stdin.write(data) or 0:]
            except BrokenPipeError:  # the child died at once: its exit code says so below
                pass
            finally:
                proc.stdin.close()
            start = time.monotonic()
            next_note = 120.0
            while proc.poll() is None:
                elapsed = time.monotonic() - start
                if elapsed > timeout_s:
                    proc.kill()
                    proc.wait()
                    return ({"ok": False, "stage": "timeout",
                             "error": f"compile did not finish in {timeout_s:.0f} s"}, None)
                if elapsed > next_note:
                    print(f"    ... still compiling ({elapsed / 60:.0f} min)", flush=True)
                    next_note += 300.0
                time.sleep(2.0)
        outcome_path = Path(tmp) / "outcome.json"
        if not outcome_path.exists():
            tail = log.read_text()[-2000:]
            return ({"ok": False, "stage": "crash",
                     "error": f"the compile process exited with {proc.returncode}: {tail}"},
                    None)
        outcome = json.loads(outcome_path.read_text())
        hlo = Path(tmp) / "module.hlo.txt"
        return outcome, (hlo.read_text() if hlo.exists() else None)


def main(argv: list[str]) -> int:
    out_dir = Path(argv[0])
    spec = json.loads(sys.stdin.read())
    from tools.xla_oracle.step import compile_spec, versions

    outcome = compile_spec(spec)
    text = outcome.pop("hlo_text", None)
    if text is not None:
        (out_dir / "module.hlo.txt").write_text(text)
    outcome["versions"] = versions()
    (out_dir / "outcome.json").write_text(json.dumps(dict(outcome), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

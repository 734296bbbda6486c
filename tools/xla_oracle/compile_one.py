"""Compile one spec in its own process: ``python -m tools.xla_oracle.compile_one OUT_DIR``
with the spec as JSON on stdin.

Writes ``OUT_DIR/outcome.json`` (``step.compile_spec``'s outcome without the HLO) and
``OUT_DIR/module.hlo.txt`` (the scheduled HLO) when the compile succeeded. One process per
config keeps a crash or the host memory of one big compile away from the others.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


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

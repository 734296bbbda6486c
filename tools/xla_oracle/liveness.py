"""Which buffers a scheduled HLO module holds at its peak: ``pod.hlo.memory``'s walk, printed.

``memory_analysis().peak_memory_in_bytes`` gives XLA's peak, not what is live there. This
prints the liveness walk of ``pod.hlo.memory`` (the HLO path's own memory estimate; its
module docstring says what defines a buffer and what only passes one on) over the text
``compiled.as_text()`` prints (``is_scheduled=true``): the peak, the instruction it is at,
the buffers live there (largest first, each with the instruction that defines it, its
shape and the JAX op that made it), and the same inside the loop body at the peak, nested.
Bytes are the arrays' (``--tiled``: the layout's, tile padding included); memory spaces
other than HBM are left out.

    python -m tools.xla_oracle.liveness FILE.hlo.txt[.gz] [--top N] [--tiled]

Pure Python (no jax). Checked against XLA's own peak on the committed compiles
(docs/xla-oracle.md).
"""

from __future__ import annotations

import argparse
import gzip
import sys
from pathlib import Path

from pod.errors import HloParseError
from pod.hlo.memory import MemoryPeak, memory_peak
from pod.hlo.module import parse_hlo

__all__ = ["format_peak", "main"]

_GIB = 2**30


def format_peak(peak: MemoryPeak, top: int = 15, depth: int = 0) -> list[str]:
    """The lines the command prints for ``peak``: a header line (the peak in GiB, the
    instruction, the inner computation's peak), one line per buffer live there (its GiB,
    name, shape, op_name; the ``top`` largest), then the inner computation's, indented
    four spaces per level.

    Args:
        peak: a walk's peak (``pod.hlo.memory.memory_peak``).
        top: buffers listed per level, >= 0.
        depth: the indentation level of ``peak``.

    Returns:
        The lines, without newlines.
    """
    pad = "    " * depth
    head = (f"{pad}peak {peak.peak_bytes / _GIB:.3f} GiB in {peak.computation} at {peak.at}"
            + (f" (inner {peak.inner.peak_bytes / _GIB:.3f} GiB)" if peak.inner else ""))
    lines = [head]
    for b in peak.live[:top]:
        lines.append(f"{pad}  {b.size_bytes / _GIB:8.3f}  {b.name[:40]:40s} {b.shape[:34]:34s}"
                     f" {b.op_name[-70:]}".rstrip())
    if len(peak.live) > top:
        rest = sum(b.size_bytes for b in peak.live[top:])
        lines.append(f"{pad}  {rest / _GIB:8.3f}  ({len(peak.live) - top} more buffers)")
    if peak.inner is not None:
        lines.extend(format_peak(peak.inner, top, depth + 1))
    return lines


def main(argv: list[str] | None = None) -> int:
    """``python -m tools.xla_oracle.liveness FILE.hlo.txt[.gz] [--top N] [--tiled]``: the
    walk's peak and the buffers live there, nested into the while bodies at the peak.
    Exit 2 with one line for a file that cannot be read or parsed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--top", type=int, default=15, help="buffers listed per level")
    parser.add_argument("--tiled", action="store_true",
                        help="bytes in the layout's tiles (T(8,128) padding), as XLA sizes them")
    args = parser.parse_args(argv)
    if args.top < 0:
        parser.error(f"--top: {args.top} is negative; give 0 or more buffers")
    opener = gzip.open if args.file.suffix == ".gz" else open
    try:
        with opener(args.file, "rt") as fh:
            module = parse_hlo(fh.read())
    except (OSError, UnicodeDecodeError) as err:
        print(f"liveness: cannot read {args.file}: {err}", file=sys.stderr)
        return 2
    except HloParseError as err:
        print(f"liveness: {args.file}: {err}", file=sys.stderr)
        return 2
    print("\n".join(format_peak(memory_peak(module, tiled=args.tiled), args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

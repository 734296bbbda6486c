"""The console every command prints through (rich)."""

from __future__ import annotations

from typing import IO

from rich.console import Console

__all__ = ["make_console", "PIPE_WIDTH"]

#: Columns when output is not a terminal (a file, a pipe, CI): rich would use 80
#: and cut table cells such as layer and algorithm names.
PIPE_WIDTH = 160


def make_console(file: IO[str] | None = None) -> Console:
    """A rich console: the terminal's width, or ``PIPE_WIDTH`` columns when piped."""
    console = Console(file=file)
    if not console.is_terminal:
        console = Console(file=file, width=PIPE_WIDTH)
    return console

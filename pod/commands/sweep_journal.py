"""A sweep keeps its finished points: ``sweep-journal.jsonl`` in the output directory.

Each finished point's row is appended to the journal as one JSON line and
flushed to disk (``fsync``) before the next point starts; the journal's first
line names the scenario (a digest of its checked content), the mode and the
columns. A sweep run again into the same directory with the same scenario and
mode takes the rows of the points already done from the journal (matched by
the point's parameters) and runs only the others; ``tpu-pod sweep --fresh``
(``fresh=True``) starts over. A journal of another scenario, mode or column
set is replaced. A line cut short by a crash (``kill -9`` mid-append) is
ignored: that point runs again.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pod.safe_io import output_errors, read_regular, write_atomic

__all__ = ["SweepJournal", "JOURNAL_NAME", "MAX_JOURNAL_BYTES"]

JOURNAL_NAME = "sweep-journal.jsonl"
#: Largest journal read back (a row is about 2 KB; a sweep of 10,000 points, the most
#: ``pod.config.scenario.MAX_SWEEP_POINTS`` allows, is 20 MB).
MAX_JOURNAL_BYTES = 64 << 20
_FORMAT = "tpu-pod-sweep-journal/1"


def _digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def point_key(values: dict[str, Any]) -> str:
    """What identifies a point across runs: a digest of the values it sets."""
    return _digest(values)


class SweepJournal:
    """The rows of a sweep's finished points, on disk as they finish.

    Args:
        output_dir: the sweep's output directory (already locked by the caller).
        scenario: the sweep's scenario (its checked content is digested).
        mode: "timing" or "functional".
        columns: the rows' columns (a journal with other columns is not reused).
        fresh: ignore (and replace) a journal found there.
        text_columns: the columns that hold text (or true / false); every other one
            holds a number. A row read back otherwise is damage.

    Attributes:
        damage: one line per damaged row read back (``sweep-journal.jsonl line 5:
            the row has no 'status'; that point runs again``).
    """

    def __init__(self, output_dir: Path, scenario: Any, mode: str, columns: Sequence[str], *,
                 fresh: bool = False, text_columns: frozenset[str] = frozenset()) -> None:
        self.path = Path(output_dir) / JOURNAL_NAME
        self.columns, self.text_columns = tuple(columns), text_columns
        self.damage: list[str] = []
        self.header = {"format": _FORMAT, "mode": mode, "columns": _digest(list(columns)),
                       "scenario": _digest(scenario.model_dump(mode="json"))}
        self.rows: dict[str, dict[str, Any]] = {} if fresh else self._read()
        self.reused = 0
        if not self.rows:  # a new journal (an earlier one of another sweep is replaced)
            line = json.dumps(self.header) + "\n"
            write_atomic(self.path, lambda f: f.write(line))

    def _read(self) -> dict[str, dict[str, Any]]:
        """The rows of a journal of this very sweep ({} if none, or of another)."""
        if not self.path.exists():
            return {}
        try:
            lines = read_regular(self.path, MAX_JOURNAL_BYTES, "sweep journals").splitlines()
        except ValueError:
            return {}
        try:
            if not lines or json.loads(lines[0]) != self.header:
                return {}
        except ValueError:
            return {}
        rows = {}
        for number, line in enumerate(lines[1:], start=2):
            try:
                key, row = self._entry(line)
            except ValueError as err:  # cut short by a crash, or worse: that point runs again
                self.damage.append(f"{JOURNAL_NAME} line {number:,}: {err}; that point runs "
                                   "again")
                continue
            rows[key] = row
        return rows

    def _entry(self, line: bytes) -> tuple[str, dict[str, Any]]:
        """A journal line's (key, row), checked: the row has every column, a status of
        ok or failed, text in the text columns and numbers in the others.

        Raises:
            ValueError: why the line is damage (one line).
        """
        try:
            entry = json.loads(line)
        except ValueError:
            raise ValueError("not a whole JSON line (cut short by a crash?)") from None
        if not isinstance(entry, dict) or not isinstance(entry.get("key"), str) \
                or not isinstance(entry.get("row"), dict):
            raise ValueError("not a {key, row} record")
        row = entry["row"]
        missing = [c for c in self.columns if c not in row]
        if missing:
            raise ValueError(f"the row has no {missing[0]!r}")
        if row["status"] not in ("ok", "failed"):
            raise ValueError(f"status is {str(row['status'])[:20]!r}, not ok or failed")
        for column in self.columns:
            value, text = row[column], column in self.text_columns
            if (not isinstance(value, (str, bool)) if text else
                    isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ValueError(f"{column} is {str(value)[:20]!r}, not "
                                 f"{'text' if text else 'a number'}")
        return entry["key"], {c: row[c] for c in self.columns}

    def done(self, values: dict[str, Any]) -> dict[str, Any] | None:
        """The row of the point setting ``values`` if an earlier run finished it."""
        row = self.rows.get(point_key(values))
        if row is not None:
            self.reused += 1
            return dict(row)
        return None

    def record(self, values: dict[str, Any], row: dict[str, Any]) -> None:
        """Append a finished point's row and flush it to disk.

        Raises:
            OutputError: the file system refused; one line naming the journal.
        """
        key = point_key(values)
        line = (json.dumps({"key": key, "row": row}, default=str) + "\n").encode()
        with output_errors(self.path):
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.write(fd, line)
                os.fsync(fd)
            finally:
                os.close(fd)
        self.rows[key] = dict(row)

"""The tool's file rules, in one place: every file it writes, every file it reads,
every directory it writes into.

Writing (``write_atomic``): the content goes to a fresh temporary file in the
target's own directory (``mkstemp``: created with ``O_CREAT | O_EXCL``, so a
symbolic link planted at that name is never followed), is flushed to disk
(``fsync``) and renamed over the target (a link planted at the target is
replaced, the file it pointed to is untouched); the directory is flushed too.
A failure removes the temporary file; a ``kill -9`` can leave at most one,
named ``.<target>.tmp-<pid>-<random>``: readers ignore it by name (a leading
dot), and the next run that locks the directory removes it
(``remove_stale_temporaries``, only when its pid no longer runs).

Reading (``read_regular``, ``read_text``, ``open_regular``; CSV files the tool wrote:
``pod.report.csv_read``): only regular files, opened without blocking (a FIFO or
``/dev/zero`` named as a scenario, a checkpoint, a MaxText config or a data file
is one line, not a hang), their size checked against a cap before any byte is
read, and memory bounded by what the file holds, never by the cap.

Directories (``lock_directories``): a run or a sweep holds an exclusive
``fcntl.flock`` on ``.tpu-pod.lock`` in its output (and checkpoint) directory;
a second one is refused with one line naming the holder (pid, host, command,
since when). The kernel drops the lock when its holder dies, however it dies,
so a stale lock file (``kill -9``, a reboot) is simply taken over.
"""

from __future__ import annotations

import contextlib
import csv
import errno
import fcntl
import io
import json
import os
import re
import socket
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pod.errors import DirectoryInUseError, OutputError

__all__ = ["write_atomic", "output_errors", "read_regular", "read_text", "open_regular",
           "check_regular", "too_large", "check_replaceable", "read_csv_rows",
           "MAX_CSV_LINE_CHARS",
           "remove_stale_temporaries", "lock_directories", "DirectoryLock", "LOCK_NAME"]

#: The lock file a run or sweep holds in each directory it writes.
LOCK_NAME = ".tpu-pod.lock"
#: ``.<target name>.tmp-<pid>-<mkstemp's random part>``; the pid tells a live writer's
#: file from a dead one's.
_TEMPORARY = re.compile(r"^\..+\.tmp-(\d+)-[a-z0-9_]+$")
#: The name earlier versions gave their temporaries (no pid): ``.<name>.<random>.tmp``.
_OLD_TEMPORARY = re.compile(r"^\..+\.[a-z0-9_]{8}\.tmp$")


def _file_mode() -> int:
    """The mode ``open`` would give a new file (0666 less the umask): ``mkstemp``
    makes 0600 files, and a result file should read like any other."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


@contextlib.contextmanager
def output_errors(path: Path | str) -> Iterator[None]:
    """Turn an ``OSError`` while writing ``path`` (ENOSPC, EROFS, EACCES, ...) into
    one ``OutputError`` line naming it."""
    try:
        yield
    except OSError as err:
        where = err.filename if err.filename else path
        raise OutputError(where, err.strerror or str(err)) from None


def _fsync_directory(directory: Path) -> None:
    """Flush a directory's entries (the rename) to disk; a file system that cannot
    (some network ones) is left as it is."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


#: Where a link may not lead for ``write_atomic`` to replace it: pseudo file systems
#: (``/proc/self/fd/1`` is the writer's own output, ``/dev/null`` a device).
_PSEUDO_ROOTS = ("/proc", "/sys", "/dev")


def _pseudo(target: str) -> bool:
    return any(target == root or target.startswith(root + "/") for root in _PSEUDO_ROOTS)


def check_replaceable(path: Path | str) -> None:
    """Refuse to replace what is not a regular file with one: a device node, a FIFO, a
    socket, a directory, or a link to one of them or into ``/proc``, ``/sys`` or
    ``/dev`` (``--output /dev/null`` run as root would replace ``/dev/null``). A
    missing path, a regular file, a link to a regular file and a dangling link are
    fine (the link itself is replaced, never what it points to).

    Raises:
        OutputError: ``<path>: cannot write (it is a device; only a regular file is
            replaced)``.
    """
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    except (OSError, ValueError) as err:  # ValueError: a NUL byte in the name
        raise OutputError(path, getattr(err, "strerror", None) or str(err)) from None
    what = ""
    if stat.S_ISLNK(info.st_mode):
        first, final = os.readlink(path), os.path.realpath(path)
        if _pseudo(os.path.join(os.path.dirname(os.path.abspath(path)), first)) or _pseudo(final):
            raise OutputError(path, f"it is a link to {first}; only a regular file is replaced")
        try:
            info = os.stat(path)
        except OSError:  # dangling: the link is replaced
            return
        what = " (a link to one)"
    if not stat.S_ISREG(info.st_mode):
        raise OutputError(path, f"it is {_kind(info.st_mode)}{what}; only a regular file is "
                                "replaced")


def write_atomic(path: Path | str, write: Callable[[Any], None], *, newline: str | None = None,
                 binary: bool = False, make_parents: bool = False) -> Path:
    """Write a file whole or not at all.

    ``write(file)`` fills a fresh temporary file in ``path``'s directory (text,
    or bytes with ``binary``), which is flushed to disk and renamed over
    ``path``; the directory entry is flushed too.

    Args:
        path: the file to write.
        write: fills the open temporary file (``f.write``, ``savefig(f)``, ...).
        newline: ``open``'s newline for text (``""`` for CSV).
        binary: the file is bytes.
        make_parents: create ``path``'s directory (and its parents) first.

    Returns:
        ``path``.

    Raises:
        OutputError: the file system refused (no space, read-only, no
            permission), or ``path`` is not a file to replace
            (``check_replaceable``: a device, a FIFO, a link into ``/proc``);
            one line naming the path. The temporary file is gone and ``path``
            holds what it held before.
    """
    path = Path(path)
    check_replaceable(path)
    with output_errors(path):
        if make_parents:
            path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-{os.getpid()}-", dir=path.parent)
        try:
            with (os.fdopen(fd, "wb") if binary else
                  os.fdopen(fd, "w", newline=newline, encoding="utf-8")) as f:
                write(f)
                f.flush()
                os.fchmod(f.fileno(), _file_mode())
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        _fsync_directory(path.parent)
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temporaries(directory: Path | str, *, old_format: bool = False) -> list[Path]:
    """Remove the temporary files that writers which no longer run left in ``directory``
    (a ``kill -9`` between creating one and renaming it).

    Args:
        directory: the directory to clean (missing: nothing to do).
        old_format: also remove temporaries without a pid (earlier versions'
            ``.<name>.<random>.tmp``): only safe when this process holds the
            directory's lock.

    Returns:
        The files removed.
    """
    removed: list[Path] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        match = _TEMPORARY.match(entry.name)
        stale = ((match is not None and not _alive(int(match.group(1))))
                 or (old_format and match is None and _OLD_TEMPORARY.match(entry.name)))
        if stale and entry.is_file(follow_symlinks=False):
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
                removed.append(Path(entry.path))
    return removed


def _kind(mode: int) -> str:
    return ("a FIFO" if stat.S_ISFIFO(mode) else "a device" if
            stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else
            "a directory" if stat.S_ISDIR(mode) else "a socket" if
            stat.S_ISSOCK(mode) else "not a regular file")


def check_regular(path: Path | str, what: str = "files read here") -> os.stat_result:
    """``path``'s stat (following links), refusing anything but a regular file.

    Raises:
        ValueError: missing, unreadable, or a FIFO, device, directory, socket:
            ``<path>: is a FIFO; <what> must be regular files``.
    """
    try:
        info = Path(path).stat()
    except OSError as err:
        raise ValueError(f"{path}: cannot read ({err.strerror})") from None
    except ValueError:  # a NUL byte in the name
        raise ValueError(f"{str(path)!r}: cannot read (a file name cannot hold a NUL "
                         "byte)") from None
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{path}: is {_kind(info.st_mode)}; {what} must be regular files")
    return info


#: Bytes asked of the kernel per read once a file's own size is read (a file that grew
#: since, or one that reports no size): memory follows what a file holds, never the limit.
_CHUNK_BYTES = 1 << 20


@contextlib.contextmanager
def open_regular(path: Path | str, limit_bytes: int,
                 what: str = "files read here") -> Iterator[tuple[Any, int]]:
    """A regular file opened for reading bytes, and its size, refused before any byte is
    read when it is not a regular file or larger than ``limit_bytes``.

    The file is checked by name (a FIFO is never opened: an open of one blocks),
    opened without blocking (a FIFO swapped in after the check cannot hang the
    open) and checked again once open. The caller still stops reading at
    ``limit_bytes`` (a file may grow while it is read; ``/proc`` files report size 0).

    Yields:
        (the open binary file, its size in bytes when opened).

    Raises:
        ValueError: not a regular file, larger than ``limit_bytes``, or unreadable;
            one line naming the path.
    """
    check_regular(path, what)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        raise ValueError(f"{path}: cannot read ({err.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path}: is {_kind(info.st_mode)}; {what} must be regular files")
        if info.st_size > limit_bytes:
            raise ValueError(too_large(path, info.st_size, limit_bytes, what))
        yield f, info.st_size


def too_large(path: Path | str, size_bytes: int | None, limit_bytes: int,
              what: str = "files read here") -> str:
    """``<path>: 3,221,225,472 bytes is larger than the 1,048,576 bytes allowed for
    scenarios`` (without the size when it is not known)."""
    size = f"{size_bytes:,} bytes is " if size_bytes is not None else ""
    return f"{path}: {size}larger than the {limit_bytes:,} bytes allowed for {what}"


def read_regular(path: Path | str, limit_bytes: int, what: str = "files read here") -> bytes:
    """A regular file's bytes, at most ``limit_bytes`` (``open_regular``).

    Memory is what the file holds: its size is checked against the limit before
    any byte is read, and the read asks for that size, never for the limit.

    Raises:
        ValueError: not a regular file, larger than ``limit_bytes``, or
            unreadable; one line naming the path.
    """
    with open_regular(path, limit_bytes, what) as (f, size):
        try:
            parts = [f.read(size + 1)] if size else []
            total = sum(map(len, parts))
            while total <= limit_bytes and total > size - (not size):  # it grew since, or
                # reports no size (/proc): a short first read is the end of the file
                chunk = f.read(min(_CHUNK_BYTES, limit_bytes + 1 - total))
                if not chunk:
                    break
                parts.append(chunk)
                total += len(chunk)
        except OSError as err:
            raise ValueError(f"{path}: cannot read ({err.strerror})") from None
    if total > limit_bytes:
        raise ValueError(too_large(path, None, limit_bytes, what))
    return parts[0] if len(parts) == 1 else b"".join(parts)


def read_text(path: Path | str, limit_bytes: int, what: str = "files read here") -> str:
    """A regular file's UTF-8 text, at most ``limit_bytes`` (``read_regular``).

    Raises:
        ValueError: as ``read_regular``; or not UTF-8 (``<path>: not UTF-8 text
            (invalid start byte at byte 12)``).
    """
    raw = read_regular(path, limit_bytes, what)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start:,}); "
                         f"{what} are UTF-8 text") from None


#: Longest line of a CSV file the tool reads back (a steps.csv row is about 1 KB): a
#: line past it is damage, and memory stays bounded by it, not by the file.
MAX_CSV_LINE_CHARS = 1 << 16


def read_csv_rows(path: Path | str, limit_bytes: int, what: str, *,
                  required: tuple[str, ...] = (),
                  check_row: Callable[[dict[str, str]], None] | None = None,
                  on_damage: Callable[[str], None] | None = None
                  ) -> Iterator[tuple[int, dict[str, str]]]:
    """The rows of a CSV file the tool wrote (steps.csv), read back defensively, one at
    a time (memory is one line, at most ``MAX_CSV_LINE_CHARS``).

    The file is opened as ``open_regular`` opens it (a regular file of at most
    ``limit_bytes``). Reading stops at the first damaged line, as a crash or a full
    disk leaves a file: a header without names, with one twice or without one of
    ``required``, a line that is not
    UTF-8, holds NUL bytes, is longer than ``MAX_CSV_LINE_CHARS`` or has another
    number of fields than the header, or a row ``check_row`` refuses (it raises
    ``ValueError`` with the reason). That line is named once, through
    ``on_damage``: ``steps.csv line 14: has 3 fields, the header 50``.

    Yields:
        (line number, counting the header as line 1; the row as header -> text).

    Raises:
        ValueError: not a regular file, larger than ``limit_bytes``, unreadable (one
            line naming the path), when iteration starts.
    """
    name = Path(path).name
    with open_regular(path, limit_bytes, what) as (f, _):
        text = io.TextIOWrapper(f, encoding="utf-8", errors="surrogateescape", newline="")
        lines = _bounded_lines(text, limit_bytes)
        reader = csv.reader(lines, strict=True)
        header: list[str] | None = None

        def damaged(line: int, problem: object) -> None:
            if on_damage is not None:
                on_damage(f"{name} line {line:,}: {problem}")

        try:
            for record in reader:
                line = reader.line_num
                problem = lines.problem or _field_problem(record)
                if header is None and problem is None:
                    header, problem = record, _header_problem(record, required)
                    if problem is None:
                        continue
                elif problem is None and len(record) != len(header or ()):
                    problem = (f"has {len(record)} field{'s' if len(record) != 1 else ''}, "
                               f"the header {len(header or ())}")
                if problem is None:
                    row = dict(zip(header or (), record, strict=True))
                    try:
                        if check_row is not None:
                            check_row(row)
                    except ValueError as err:
                        problem = str(err)
                if problem is not None:
                    damaged(line, problem)
                    return
                yield line, row
            if lines.problem:  # the line past a bound, or a last one cut short
                damaged(reader.line_num + 1, lines.problem)
        except csv.Error as err:
            damaged(reader.line_num, lines.problem or err)
        except OSError as err:
            raise ValueError(f"{path}: cannot read ({err.strerror})") from None


class _bounded_lines:  # noqa: N801 - an iterator used like a function
    """The lines of a text file, each at most ``MAX_CSV_LINE_CHARS``, at most
    ``limit_bytes`` in all (a file growing while read); the first line past either,
    or a last line without its newline (the tool ends every row with one: a row
    cut short), ends the iteration with ``problem`` set."""

    def __init__(self, text: io.TextIOBase, limit_bytes: int) -> None:
        self.text, self.limit, self.read = text, limit_bytes, 0
        self.problem: str | None = None

    def __iter__(self) -> _bounded_lines:
        return self

    def __next__(self) -> str:
        line = self.text.readline(MAX_CSV_LINE_CHARS + 1)
        self.read += len(line)
        if len(line) > MAX_CSV_LINE_CHARS:
            self.problem = f"longer than {MAX_CSV_LINE_CHARS:,} characters"
        elif self.read > self.limit:
            self.problem = f"past the {self.limit:,} bytes allowed"
        elif line and not line.endswith("\n"):
            self.problem = "cut short: no newline at its end (a crash or a full disk)"
        if not line or self.problem:
            raise StopIteration
        return line


def _field_problem(record: list[str]) -> str | None:
    """Why a line's fields are damage (NUL bytes, bytes that are not UTF-8), or None."""
    joined = "".join(record)
    if "\x00" in joined:
        return "holds NUL bytes (a crash or a full disk leaves them)"
    if any("\udc80" <= c <= "\udcff" for c in joined):
        return "is not UTF-8 text"
    return None


def _header_problem(header: list[str], required: tuple[str, ...]) -> str | None:
    """Why a header line is no header (no names, an empty, a repeated or a missing
    one), or None."""
    if not header or any(not name.strip() for name in header):
        return "the header has an empty column name"
    missing = [name for name in required if name not in header]
    if missing:
        return f"the header has no {missing[0]!r} column"
    if len(set(header)) != len(header):
        twice = sorted({n for n in header if header.count(n) > 1})
        return f"the header names {', '.join(map(repr, twice[:3]))} twice"
    return None


class DirectoryLock:
    """An exclusive lock on a directory a command writes into, held while it runs.

    ``fcntl.flock`` on ``<directory>/.tpu-pod.lock`` (opened without following a
    link), which then holds the holder's pid, host, command and start time for
    the error line of whoever comes second. Stale temporaries of dead writers
    are removed once the lock is held.

    Args:
        directory: created (with its parents) if missing.
        command: what holds it, as shown to the next one (``tpu-pod run x.yaml``).
    """

    def __init__(self, directory: Path | str, command: str) -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_NAME
        self.command = command
        self._fd: int | None = None

    def acquire(self) -> DirectoryLock:
        """Take the lock.

        Raises:
            DirectoryInUseError: another live process holds it; one line naming it.
            OutputError: the directory or its lock file cannot be created.
        """
        with output_errors(self.directory):
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                         _file_mode())
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = _read_holder(fd)
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise DirectoryInUseError(self.directory, holder) from None
            raise OutputError(self.path, err.strerror or str(err)) from None
        self._fd = fd
        record = {"pid": os.getpid(), "host": socket.gethostname(), "command": self.command,
                  "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "since_unix_s": time.time()}
        with contextlib.suppress(OSError):  # the lock holds even if the note cannot be written
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        remove_stale_temporaries(self.directory, old_format=True)
        return self

    def release(self) -> None:
        """Let go (the note is cleared: a lock file with a note and no lock is stale)."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
        os.close(self._fd)  # closing drops the flock
        self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> DirectoryLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __del__(self) -> None:  # a Run never run (the Python API) lets go when collected
        with contextlib.suppress(Exception):
            self.release()


def _read_holder(fd: int) -> dict[str, Any]:
    """The note of the process holding a lock file ({} if none can be read)."""
    try:
        text = os.pread(fd, 4096, 0).decode("utf-8", errors="replace")
        holder = json.loads(text) if text.strip() else {}
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


class DirectoryLocks:
    """The locks of a command's directories (``lock_directories``), released together."""

    def __init__(self, locks: list[DirectoryLock]) -> None:
        self.locks = locks

    def release(self) -> None:
        for lock in reversed(self.locks):
            lock.release()

    def __enter__(self) -> DirectoryLocks:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def command_line() -> str:
    """This process's command as a user would type it (``tpu-pod run x.yaml``)."""
    argv = list(sys.argv) or ["python"]
    name = Path(argv[0]).name
    argv[0] = "tpu-pod" if name in ("tpu-pod", "__main__.py") else name
    text = " ".join(argv)
    return text if len(text) <= 200 else text[:197] + "..."


def lock_directories(*directories: Path | str | None, command: str | None = None
                     ) -> DirectoryLocks:
    """Lock every directory given (None skipped; one directory named twice is locked
    once), or none: on a refusal the locks already taken are released.

    Args:
        directories: the output directory, the checkpoint directory, ...
        command: shown to a second command (default: this process's command line).

    Returns:
        The held locks (a context manager; ``release()`` lets go).

    Raises:
        DirectoryInUseError: one directory is held by another live process.
        OutputError: a directory cannot be created.
    """
    command = command or command_line()
    seen, locks = set(), []
    try:
        for directory in directories:
            if directory is None:
                continue
            key = os.path.realpath(directory)  # a link to a directory already locked is it
            if key in seen:
                continue
            seen.add(key)
            locks.append(DirectoryLock(directory, command).acquire())
    except BaseException:
        DirectoryLocks(locks).release()
        raise
    return DirectoryLocks(locks)

"""Errors raised by the pod layer, and the set of errors that are the user's.

``EmulatorError`` is the root of every error ``pod`` raises; ``chip`` and
``interconnect`` keep their own roots (``ChipError``, ``InterconnectError``)
because they must not import ``pod``. ``USER_ERRORS`` joins the three roots:
the CLI prints such an error as one line and exits non-zero, never a
traceback.

The tree::

    EmulatorError
    +-- ScenarioError (ValueError)        a scenario field or option is wrong
    |   +-- BenchError                    a bad option of ``tpu-pod collective``
    +-- ShardingError (ValueError)        a batch does not split over the cores
    +-- HBMPlanError (HBMOutOfMemoryError) a run's HBM plan does not fit a core
    +-- CheckpointError (ValueError)      missing, corrupted, or of another run
    +-- ClusterError (RuntimeError)       Ray could not start, or an actor failed
    |   +-- ChipFailureError              chips died and nothing can restore them
    |   +-- IciError                      a chip-to-chip link failed mid-collective
    +-- MetricsError (RuntimeError)       the Prometheus exporter could not start
    +-- NonFiniteLossError                a step's loss is NaN or infinite
    +-- OutputError                       a result or checkpoint cannot be written
    +-- HloError (ValueError)             an XLA HLO module the emulator cannot cost
    |   +-- HloParseError                 the text does not parse (names the line)
    |   +-- HloOpError                    an op with no cost model and no XLA estimate
    +-- CaptureError (ValueError)         a JAX step that does not trace or compile

``RunInterrupted`` is not an error: a run stopped by SIGINT / SIGTERM after
writing what it had.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from typing import Any

from chip import ChipError, HBMOutOfMemoryError
from interconnect import InterconnectError

__all__ = [
    "EmulatorError",
    "ScenarioError",
    "BenchError",
    "ShardingError",
    "HBMPlanError",
    "CheckpointError",
    "ClusterError",
    "ChipFailureError",
    "ChipUnresponsiveError",
    "IciError",
    "MetricsError",
    "NonFiniteLossError",
    "OutputError",
    "HloError",
    "HloParseError",
    "HloOpError",
    "CaptureError",
    "RunInterrupted",
    "USER_ERRORS",
    "MAX_ERROR_CHARS",
    "one_line",
]

#: Longest error line the CLI prints: a message quoting a huge value (a list of a
#: thousand numbers given as a size) keeps its start (the field) and its end (what
#: is allowed).
MAX_ERROR_CHARS = 600


def one_line(message: object, limit: int = MAX_ERROR_CHARS) -> str:
    """``message`` as one line of at most ``limit`` characters: line breaks become
    spaces and an over-long middle becomes `` ... ``."""
    text = " ".join(str(message).split())
    if len(text) <= limit:
        return text
    head = limit * 2 // 3
    return f"{text[:head]} ... {text[len(text) - (limit - head - 5):]}"


class EmulatorError(Exception):
    """Root of the errors raised by ``pod``."""


class ScenarioError(EmulatorError, ValueError):
    """A scenario file or option is malformed; the message names the field."""


class BenchError(ScenarioError):
    """A bad option of ``tpu-pod collective`` (size, topology, algorithm)."""


class ShardingError(EmulatorError, ValueError):
    """A batch cannot be split evenly over the TensorCores of the pod."""


class HBMPlanError(EmulatorError, HBMOutOfMemoryError):
    """A run's HBM plan does not fit one TensorCore: an ``HBMOutOfMemoryError``
    with a message naming the scenario field to change, carrying the plan.

    Attributes:
        tag, requested_bytes, free_bytes, capacity_bytes: as
            ``HBMOutOfMemoryError``.
        memory_plan: bytes per item (params, grads, optimizer_state,
            activations, workspace) and their total.
        fits_with: the version of the model that fits the same mesh, as the message
            names it ("remat full"; ``pod.config.fit.fit_memory``), "" when none does.
    """

    def __init__(self, message: str, *, tag: str, requested_bytes: int, free_bytes: int,
                 capacity_bytes: int, memory_plan: dict[str, int], fits_with: str = "") -> None:
        Exception.__init__(self, message)
        self.tag = tag
        self.requested_bytes = int(requested_bytes)
        self.free_bytes = int(free_bytes)
        self.capacity_bytes = int(capacity_bytes)
        self.name = None
        self.memory_plan = dict(memory_plan)
        self.fits_with = str(fits_with)

    def __reduce__(self) -> Any:
        return (_rebuild_hbm_plan_error, (str(self), self.tag, self.requested_bytes,
                                          self.free_bytes, self.capacity_bytes, self.memory_plan,
                                          self.fits_with))


def _rebuild_hbm_plan_error(message: str, tag: str, requested: int, free: int, capacity: int,
                            plan: dict[str, int], fits_with: str = "") -> HBMPlanError:
    return HBMPlanError(message, tag=tag, requested_bytes=requested, free_bytes=free,
                        capacity_bytes=capacity, memory_plan=plan, fits_with=fits_with)


class CheckpointError(EmulatorError, ValueError):
    """A checkpoint is missing, truncated, corrupted, of an unknown format, or
    of a different run."""


class ClusterError(EmulatorError, RuntimeError):
    """Ray could not be started or joined, or a chip actor failed."""


class ChipFailureError(ClusterError):
    """Chip actors died and the run cannot recover (no checkpoint configured)."""


class ChipUnresponsiveError(ChipFailureError):
    """Chip actors stopped answering: their process answered no heartbeat for its
    timeout (frozen: stopped, a frozen host, a paused VM), or a step ran past its
    deadline. The run recovers from them as from dead chips.

    Attributes:
        ranks: the chips declared failed, ascending.
    """

    def __init__(self, message: str, ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.ranks = sorted(int(r) for r in ranks)

    def __reduce__(self) -> Any:
        return (type(self), (str(self), self.ranks))


class IciError(ClusterError):
    """A peer chip did not deliver a chunk (it died, the link closed, the wait
    timed out) or broke the link protocol (a chunk the plan does not expect, of
    the wrong length, from the wrong sender); the message names the chip, the
    phase and the reason."""


class MetricsError(EmulatorError, RuntimeError):
    """The Prometheus exporter or ``tpu-pod monitor`` could not start (for example,
    a port in use, or no ``prometheus`` binary)."""


class NonFiniteLossError(EmulatorError):
    """A training step's loss is NaN or infinite: the run stops (unless the
    scenario says to continue), keeping what it had written."""


class OutputError(EmulatorError):
    """A result file or checkpoint cannot be written: no space left (ENOSPC), a
    read-only file system (EROFS), no permission (EACCES), ...; one line naming
    the path and the reason.

    Attributes:
        path: the file or directory that could not be written.
    """

    def __init__(self, path: object, reason: str) -> None:
        self.path = str(path)
        super().__init__(f"{self.path}: cannot write ({reason})")


class DirectoryInUseError(EmulatorError):
    """Another live run, sweep or plan holds the lock of a directory this command
    would write into (``pod.safe_io.lock_directories``): two writers would mix
    their results.

    Attributes:
        path: the directory.
        holder: what its lock file says of the holder (pid, host, command, since).
    """

    def __init__(self, path: object, holder: dict) -> None:
        self.path, self.holder = str(path), dict(holder)
        who = (f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}: "
               f"'{holder.get('command', '?')}', since {holder.get('since', '?')}"
               if holder else "its holder has not written its note yet")
        super().__init__(f"{self.path}: in use by another tpu-pod command ({who}); wait for it "
                         "to end, or write to another directory (--output-dir, checkpoint.dir)")


class HloError(EmulatorError, ValueError):
    """An XLA HLO module the emulator cannot cost (``pod.hlo``): the message names the
    instruction (and its line in the text where there is one)."""


class HloParseError(HloError):
    """HLO text that does not parse: ``line N: what is wrong: the line's start``.

    Attributes:
        line: the 1-based line number in the text (0: the text as a whole).
        source: the file the text came from ("" for text given as is); named first.
    """

    def __init__(self, line: int, message: str, source: str = "") -> None:
        self.line, self.source, self.detail = int(line), str(source), message
        where = f"line {self.line}: " if self.line else ""
        super().__init__(f"{self.source}: {where}{message}" if self.source else f"{where}{message}")

    def in_file(self, source: str) -> HloParseError:
        """The same error, naming the file the text came from."""
        return HloParseError(self.line, self.detail, source)


class HloOpError(HloError):
    """An HLO op the cost model does not know and for which XLA gave no estimate
    (``estimated_cycles``): refused, never costed as zero."""


class CaptureError(EmulatorError, ValueError):
    """A JAX step that cannot be captured (``pod.frontends``): it does not trace, its
    mesh does not divide the slice, or XLA refused to compile it; the message says
    which, in one line."""


class RunInterrupted(Exception):
    """The run was stopped by a signal after writing what it had.

    Attributes:
        signum: the signal (SIGINT or SIGTERM).
        exit_code: 128 + signum (130, 143), the shell's code for a signalled command.
    """

    def __init__(self, signum: int, message: str = "") -> None:
        self.signum = int(signum)
        self.exit_code = 128 + self.signum
        super().__init__(message or f"interrupted by {signal.Signals(self.signum).name}")


USER_ERRORS: tuple[type[Exception], ...] = (EmulatorError, ChipError, InterconnectError)

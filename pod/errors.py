"""Errors raised by the pod layer, and the set of errors that are the user's.

The hierarchy (see ../shared/DESIGN.md): ``EmulatorError`` is the root of the
errors ``pod`` raises; ``chip`` and ``interconnect`` keep their own roots
(``ChipError``, ``InterconnectError``) because they must not import ``pod``.
``USER_ERRORS`` lists every root whose message is meant for the user: the CLI
prints such an error as one line and exits non-zero, never a traceback.
"""

from __future__ import annotations

from chip import ChipError
from interconnect import InterconnectError

__all__ = [
    "EmulatorError",
    "ScenarioError",
    "ShardingError",
    "ClusterError",
    "MetricsError",
    "USER_ERRORS",
]


class EmulatorError(Exception):
    """Root of the errors raised by ``pod``."""


class ScenarioError(EmulatorError, ValueError):
    """A scenario file or option is malformed; the message names the field."""


class ShardingError(EmulatorError, ValueError):
    """A batch cannot be split evenly over the TensorCores of the pod."""


class ClusterError(EmulatorError, RuntimeError):
    """Ray could not be started or joined, or a chip actor failed."""


class MetricsError(EmulatorError, RuntimeError):
    """The Prometheus exporter could not start (for example, port in use)."""


USER_ERRORS: tuple[type[Exception], ...] = (EmulatorError, ChipError, InterconnectError)

"""Errors raised by the interconnect package.

A small hierarchy: everything the package raises on bad input is an
:class:`InterconnectError`, so callers (the pod's CLI) can catch one type and
print one clear line. The concrete errors also subclass :class:`ValueError`,
because each of them means "an argument had a value that is not allowed".
Every message quotes the value received and says what is allowed.
"""

from __future__ import annotations

__all__ = ["InterconnectError", "TopologyError", "LinkSpecError", "ScheduleError"]


class InterconnectError(Exception):
    """Base class of every error raised by :mod:`interconnect`."""


class TopologyError(InterconnectError, ValueError):
    """A torus shape, wraparound flag, rank or coordinate is not valid.

    Example message: ``shape '2x0' is not valid: every axis needs at least
    1 chip; write it like '8', '4x4' or '4x4x4'``.
    """


class LinkSpecError(InterconnectError, ValueError):
    """A link's bandwidth or latency is not valid (e.g. bandwidth <= 0)."""


class ScheduleError(InterconnectError, ValueError):
    """A transfer, schedule or buffer list is not valid for the operation.

    Raised for example by a :class:`~interconnect.collectives.Transfer` whose
    ``src`` equals its ``dst``, by a schedule whose transfer names a chunk that
    does not exist, or by :func:`~interconnect.execute.execute` when the number
    of buffers differs from the schedule's ``num_ranks``.
    """

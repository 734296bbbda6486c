"""Slowed and failed ICI links: the one place where scenario link entries
(``pod.links``, ``slow_link`` / ``fail_link`` faults) become
``interconnect.LinkFaults`` and are checked against a torus.

An entry is a ``LinkConfig`` (from the scenario) or a mapping with ``link``
("src->dst" chip ranks) and either ``slowdown`` (the link runs at bandwidth /
slowdown) or ``failed: true`` (it carries nothing; routes go around it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from interconnect import LinkFaults, TopologyError, Torus, parse_link, route

__all__ = ["link_entry", "link_faults", "check_links"]


def link_entry(entry: Any) -> dict[str, Any]:
    """One entry as a plain mapping: ``{"link", "slowdown"}`` or ``{"link", "failed": True}``.

    Args:
        entry: a ``LinkConfig`` or a mapping with the same keys.
    """
    if isinstance(entry, Mapping):
        entry = dict(entry)
        if entry.get("failed"):
            return {"link": entry["link"], "failed": True}
        return {"link": entry["link"], "slowdown": entry.get("slowdown", 1.0)}
    if entry.failed:
        return {"link": entry.link, "failed": True}
    return {"link": entry.link, "slowdown": entry.slowdown}


def link_faults(entries: Sequence[Any]) -> LinkFaults:
    """``LinkFaults`` from link entries (``LinkConfig`` objects or mappings).

    Raises:
        TopologyError: a malformed link or factor.
    """
    return LinkFaults.from_entries([link_entry(e) for e in entries])


def check_links(entries: Sequence[Any], torus: Torus, field: str = "pod.links") -> None:
    """Check link entries against the pod's torus, before any actor starts.

    Args:
        entries: link entries (``LinkConfig`` or mappings).
        torus: the resolved ICI topology.
        field: the scenario field the entries come from, for messages (an
            entry's own ``field`` key, where it has one, names it instead).

    Raises:
        TopologyError: ``<field>.<i>.link: ...`` for a link the torus does
            not have (the message lists the links of its source chip), or
            ``<field>.<i>.failed: ...`` for a failed link that nothing can
            route around (``faults.<i>.link`` for a ``fail_link`` fault, which
            has no ``failed`` field).
    """
    rows = [link_entry(e) for e in entries]
    names = [e["field"] if isinstance(e, Mapping) and "field" in e else f"{field}.{i}"
             for i, e in enumerate(entries)]
    for name, row in zip(names, rows, strict=True):
        try:
            LinkFaults.from_entries([row]).check(torus)
        except TopologyError as err:
            raise TopologyError(f"{name}.link: {err} (got {row['link']!r})") from None
    faults = LinkFaults.from_entries(rows)
    for name, row in zip(names, rows, strict=True):
        if row.get("failed"):
            src, dst = parse_link(row["link"])
            try:
                route(torus, src, dst, faults)
            except TopologyError as err:
                # pod.links entries say `failed: true`; a fail_link fault has only `link`
                where = f"{name}.link" if name.startswith("faults.") else f"{name}.failed"
                raise TopologyError(f"{where}: {err} (got {row['link']!r} "
                                    f"failed); fail fewer links") from None

"""Link heterogeneity: slowed and failed ICI links, and routing around failures.

A :class:`LinkFaults` value names directed links ``(src, dst)``: a slowed
link carries its bytes ``slowdown`` times slower (bandwidth / factor); a
failed link carries nothing. Each direction of a physical link is its own
entry (a cut cable is two entries, ``0->1`` and ``1->0``).

Routing (:func:`route`): a transfer takes the dimension-order route of
:meth:`~interconnect.topology.Torus.route` when it avoids every failed link;
otherwise the shortest route over the remaining links (breadth-first, the
neighbours of a chip tried in increasing rank order, so it is deterministic).
When failed links cut the source off from the destination there is no
route: :class:`LinkFailureError` names the pair and the failed links.
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import cast

from interconnect.errors import TopologyError
from interconnect.topology import Torus

__all__ = ["LinkFailureError", "LinkFaults", "parse_link", "route"]

Link = tuple[int, int]

_LINK_RE = re.compile(r"^\s*(\d+)\s*->\s*(\d+)\s*$")


class LinkFailureError(TopologyError):
    """Failed links leave no route between two chips that must talk."""


def parse_link(text: object) -> Link:
    """Parses a directed link written ``"src->dst"`` (ranks), e.g. ``"0->1"``.

    Args:
        text: the link as text, or a ``(src, dst)`` pair of ints.

    Returns:
        ``(src, dst)``.

    Raises:
        TopologyError: not of that form; the message quotes the value.
    """
    if isinstance(text, tuple) and len(text) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) for v in text):
        return (int(text[0]), int(text[1]))
    match = _LINK_RE.match(text) if isinstance(text, str) else None
    if not match:
        raise TopologyError(f"link {text!r} is not valid: write it as 'src->dst' with chip "
                            "ranks, e.g. '0->1'")
    return (int(match.group(1)), int(match.group(2)))


@dataclass(frozen=True)
class LinkFaults:
    """Slowed and failed directed links of a pod.

    Attributes:
        slowdowns: ``{(src, dst): factor}``, factor >= 1 and finite: the link
            runs at bandwidth / factor. Given as a mapping (or pairs); keys
            may be ``"src->dst"`` strings.
        failed: directed links that carry nothing.

    Raises:
        TopologyError: a bad link, a factor below 1 or not finite, or a link
            both slowed and failed.
    """

    slowdowns: Mapping[Link, float] = field(default_factory=dict)
    failed: frozenset[Link] = frozenset()

    def __post_init__(self) -> None:
        items = self.slowdowns.items() if isinstance(self.slowdowns, Mapping) else self.slowdowns
        slow: dict[Link, float] = {}
        for key, factor in items:
            link = parse_link(key)
            if (isinstance(factor, bool) or not isinstance(factor, (int, float))
                    or not math.isfinite(factor) or factor < 1):
                raise TopologyError(
                    f"slowdown {factor!r} of link {link[0]}->{link[1]} is not valid: expected a "
                    f"finite number >= 1 (the link runs at bandwidth / slowdown)"
                )
            slow[link] = float(factor)
        failed = frozenset(parse_link(item) for item in self.failed)
        both = sorted(set(slow) & failed)
        if both:
            raise TopologyError(f"link {both[0][0]}->{both[0][1]} is both slowed and failed: "
                                "give one")
        object.__setattr__(self, "slowdowns", dict(sorted(slow.items())))
        object.__setattr__(self, "failed", failed)

    def __hash__(self) -> int:
        return hash((tuple(self.slowdowns.items()), self.failed))

    def __bool__(self) -> bool:
        return bool(self.slowdowns or self.failed)

    def slowdown(self, link: Link) -> float:
        """Slowdown factor of a directed link (1.0 when healthy)."""
        return self.slowdowns.get(link, 1.0)

    def check(self, topology: Torus) -> None:
        """Checks that every named link exists in ``topology``.

        Raises:
            TopologyError: a link that is not in the topology; the message
                lists the links of its source chip.
        """
        for link in list(self.slowdowns) + sorted(self.failed):
            src, dst = link
            if not (0 <= src < topology.num_chips and 0 <= dst < topology.num_chips
                    and topology.has_link(src, dst)):
                choices = ""
                if 0 <= src < topology.num_chips:
                    choices = "; links of chip {}: {}".format(
                        src, ", ".join(f"{src}->{d}" for d in topology.neighbors(src)) or "none")
                raise TopologyError(
                    f"link {src}->{dst} is not a link of torus {topology.name} "
                    f"(wraparound {'/'.join('y' if w else 'n' for w in topology.wraparound)})"
                    f"{choices}"
                )

    @classmethod
    def from_entries(cls, entries: Iterable[Mapping[str, object]]) -> LinkFaults:
        """Builds faults from scenario entries ``{link: "0->1", slowdown: 2.0}`` /
        ``{link, failed: true}``."""
        slow, failed = {}, set()
        for entry in entries:
            link = parse_link(entry.get("link"))
            if entry.get("failed"):
                failed.add(link)
            elif entry.get("slowdown") is not None:
                # LinkFaults checks the factor (a finite number >= 1) and quotes a bad one
                slow[link] = cast(float, entry["slowdown"])
        return cls(slowdowns=slow, failed=frozenset(failed))


def route(topology: Torus, src: int, dst: int, faults: LinkFaults | None = None) -> list[Link]:
    """The route a transfer takes, around failed links when it must.

    Args:
        topology: the torus.
        src: source rank.
        dst: destination rank.
        faults: failed links to avoid (None: none).

    Returns:
        Directed links from ``src`` to ``dst``: the dimension-order route when
        it avoids every failed link, else a shortest route over healthy links.

    Raises:
        LinkFailureError: no route avoids the failed links.
    """
    path = topology.route(src, dst)
    if faults is None or not faults.failed or not any(hop in faults.failed for hop in path):
        return path
    failed = faults.failed
    previous = {src: src}
    queue = deque([src])
    while queue:
        here = queue.popleft()
        if here == dst:
            break
        for nxt in topology.neighbors(here):
            if nxt not in previous and (here, nxt) not in failed:
                previous[nxt] = here
                queue.append(nxt)
    if dst not in previous:
        names = ", ".join(f"{a}->{b}" for a, b in sorted(failed))
        raise LinkFailureError(
            f"no route from chip {src} to chip {dst} on torus {topology.name} avoids the failed "
            f"links ({names}); this collective needs one"
        )
    hops = []
    node = dst
    while node != src:
        hops.append((previous[node], node))
        node = previous[node]
    return hops[::-1]

"""Faults injected from a scenario's ``faults:`` list, and interrupted runs.

Kinds (``pod.config.scenario.FaultConfig``; ``step`` is 1-based, as the progress
lines count):

- ``kill_chip {chip}``: during that step the chip's actor is killed
  (``ray.kill``). The coordinator sees the Ray actor error, finds the dead
  actors, starts new ones in their hosts' placement-group bundles, restores
  every chip from the newest checkpoint this run wrote (or the initial state
  when none was written yet) and recomputes the steps since. Since every
  random generator is derived from (seed, step), the recomputed steps give
  the same bytes, and the final parameters equal the fault-free run's.
- ``kill_host {host}``: the same for every chip of a TPU host (ranks
  ``host * chips_per_host ..``).
- ``slow_chip {chip, factor}``: a straggler from that step on: the chip's
  simulated forward + backward seconds (and its op records, so the trace)
  x factor; every step waits for the slowest chip, so the step time grows.
- ``slow_link {link, slowdown}`` / ``fail_link {link}``: from that step on the
  directed ICI link runs at bandwidth / slowdown, or carries nothing and the
  allreduce is routed around it (``interconnect.LinkFaults``, the semantics of
  ``pod.links``). The allreduce algorithm chosen at the start is kept (a real
  pod does not recompile mid-run), so the gradient bytes do not change; only
  its simulated cost does. On a sharded mesh every collective's cost over
  every group is recomputed with the links in force
  (``TrainingPlan.collective_costs_at``); a kill takes down the chip's device
  actors (two on a v2 / v3 chip) and recovery shards the checkpoint onto new
  ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from interconnect import parse_link
from pod.config.links import link_entry
from pod.errors import ScenarioError

__all__ = ["Fault", "FaultPlan"]


@dataclass(frozen=True)
class Fault:
    """One resolved fault.

    Attributes:
        index: position in the scenario's ``faults`` list.
        kind: kill_chip, kill_host, slow_chip, slow_link or fail_link.
        step: zero-based step it starts at.
        chips: ranks it kills or slows (kills, slow_chip).
        factor: compute slowdown (slow_chip).
        link: (src, dst) (slow_link, fail_link).
        slowdown: bandwidth divisor (slow_link).
    """

    index: int
    kind: str
    step: int
    chips: tuple[int, ...] = ()
    factor: float = 1.0
    link: tuple[int, int] | None = None
    slowdown: float = 1.0

    def describe(self) -> str:
        """e.g. 'kill_chip chip 2 at step 5' (1-based step)."""
        what = (f"link {self.link[0]}->{self.link[1]}" if self.link else
                f"chip{'s' if len(self.chips) > 1 else ''} {', '.join(map(str, self.chips))}")
        return f"{self.kind} {what} at step {self.step + 1}"


class FaultPlan:
    """A scenario's faults checked against its pod.

    Args:
        faults: ``Scenario.faults`` entries.
        chips: chips in the pod.
        chips_per_host: chips of one TPU host.
        base_links: ``pod.links`` entries (mappings or LinkConfig), always active.

    Raises:
        ScenarioError: a chip or host that the pod does not have; names the
            entry (``faults.<i>.chip``) and the allowed range.
    """

    def __init__(self, faults: Any, chips: int, chips_per_host: int,
                 base_links: Any = ()) -> None:
        self.chips = chips
        hosts = -(-chips // chips_per_host)
        resolved = []
        for i, f in enumerate(faults):
            step = f.step - 1
            if f.kind in ("kill_chip", "slow_chip"):
                if f.chip >= chips:
                    raise ScenarioError(f"faults.{i}.chip: {f.chip} is not a chip of this pod "
                                        f"(ranks 0..{chips - 1})")
                resolved.append(Fault(i, f.kind, step, chips=(f.chip,),
                                      factor=f.factor if f.factor is not None else 1.0))
            elif f.kind == "kill_host":
                if f.host >= hosts:
                    raise ScenarioError(f"faults.{i}.host: {f.host} is not a host of this pod "
                                        f"(hosts 0..{hosts - 1}, {chips_per_host} chips each)")
                ranks = tuple(r for r in range(chips) if r // chips_per_host == f.host)
                resolved.append(Fault(i, f.kind, step, chips=ranks))
            else:
                link = parse_link(f.link)
                bad = [r for r in link if r >= chips]
                if bad:
                    raise ScenarioError(f"faults.{i}.link: {f.link!r} names chip {bad[0]}, not a "
                                        f"chip of this pod (ranks 0..{chips - 1})")
                resolved.append(Fault(i, f.kind, step, link=link,
                                      slowdown=f.slowdown if f.slowdown is not None else 1.0))
        self.faults: tuple[Fault, ...] = tuple(resolved)
        self.base_links = [link_entry(e) for e in base_links]

    def kills_at(self, step: int) -> list[Fault]:
        """Kill faults (kill_chip, kill_host) that happen during zero-based ``step``."""
        return [f for f in self.faults if f.kind.startswith("kill_") and f.step == step]

    def compute_slowdowns(self, step: int) -> dict[int, float]:
        """Per chip, the straggler factor in force at zero-based ``step`` (the largest)."""
        out: dict[int, float] = {}
        for f in self.faults:
            if f.kind == "slow_chip" and f.step <= step:
                out[f.chips[0]] = max(out.get(f.chips[0], 1.0), f.factor)
        return out

    def link_entries(self, step: int) -> list[dict[str, Any]]:
        """``pod.links``-style entries in force at zero-based ``step``: the scenario's
        ``pod.links``, overridden per link by the link faults started by then
        (a later fault on the same link replaces an earlier one). Each entry's
        ``field`` names where it comes from (``pod.links.<i>``, ``faults.<i>``)."""
        entries = {parse_link(e["link"]): {**e, "field": f"pod.links.{i}"}
                   for i, e in enumerate(self.base_links)}
        for f in sorted((f for f in self.faults if f.link and f.step <= step),
                        key=lambda f: (f.step, f.index)):
            link = f.link
            assert link is not None  # the filter above keeps the link faults
            text = f"{link[0]}->{link[1]}"
            entries[link] = ({"link": text, "failed": True} if f.kind == "fail_link"
                             else {"link": text, "slowdown": f.slowdown})
            entries[link]["field"] = f"faults.{f.index}"
        return [entries[k] for k in sorted(entries)]

    def link_change_steps(self) -> list[int]:
        """Zero-based steps at which the link faults change (0 always included)."""
        return sorted({0} | {f.step for f in self.faults if f.link})

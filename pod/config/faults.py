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
- ``slow_dcn {slice, slowdown}`` (multislice): from that step on the slice's
  data-centre network interfaces run at bandwidth / slowdown. A collective across
  slices is a ring with one member per slice, each ring step as slow as its
  slowest hop, so every DCN collective's bandwidth term grows by the largest
  slowdown in force (its latency does not); the ICI parts inside the slices do
  not change (``TrainingPlan.collective_costs_at``).

Hosts never span slices: a slice's chips are on hosts of their own
(:func:`host_chips`), so ``kill_host`` on a multislice pod names a host of one
slice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from interconnect import parse_link
from pod.config.links import link_entry
from pod.errors import ScenarioError

__all__ = ["Fault", "FaultPlan", "host_of", "host_chips"]


def host_of(rank: int, chips_per_host: int, slice_chips: int) -> int:
    """The TPU host of a chip: hosts of ``chips_per_host`` chips (fewer on a slice
    smaller than one host), numbered slice by slice; a host never spans two slices.

    Args:
        rank: the chip's rank (ranks run on from one slice to the next).
        chips_per_host: the chip's ``ChipSpec.chips_per_host``.
        slice_chips: chips in one slice.
    """
    per_host = min(chips_per_host, slice_chips)
    hosts_per_slice = -(-slice_chips // per_host)
    return (rank // slice_chips) * hosts_per_slice + (rank % slice_chips) // per_host


def host_chips(chips: int, chips_per_host: int, slice_chips: int) -> list[list[int]]:
    """The chip ranks of every host (:func:`host_of`), host by host."""
    hosts: dict[int, list[int]] = {}
    for rank in range(chips):
        hosts.setdefault(host_of(rank, chips_per_host, slice_chips), []).append(rank)
    return [hosts[h] for h in sorted(hosts)]


@dataclass(frozen=True)
class Fault:
    """One resolved fault.

    Attributes:
        index: position in the scenario's ``faults`` list.
        kind: kill_chip, kill_host, slow_chip, slow_link, fail_link or slow_dcn.
        step: zero-based step it starts at.
        chips: ranks it kills or slows (kills, slow_chip).
        factor: compute slowdown (slow_chip).
        link: (src, dst) (slow_link, fail_link).
        slowdown: bandwidth divisor (slow_link, slow_dcn).
        slice: the slice whose DCN interfaces slow down (slow_dcn).
    """

    index: int
    kind: str
    step: int
    chips: tuple[int, ...] = ()
    factor: float = 1.0
    link: tuple[int, int] | None = None
    slowdown: float = 1.0
    slice: int | None = None

    def describe(self) -> str:
        """e.g. 'kill_chip chip 2 at step 5' (1-based step)."""
        what = (f"link {self.link[0]}->{self.link[1]}" if self.link else
                f"slice {self.slice}'s DCN / {self.slowdown:g}" if self.slice is not None else
                f"chip{'s' if len(self.chips) > 1 else ''} {', '.join(map(str, self.chips))}")
        return f"{self.kind} {what} at step {self.step + 1}"


class FaultPlan:
    """A scenario's faults checked against its pod.

    Args:
        faults: ``Scenario.faults`` entries.
        chips: chips in the pod.
        chips_per_host: chips of one TPU host.
        base_links: ``pod.links`` entries (mappings or LinkConfig), always active.
        slices: slices of the pod (multislice), each of ``chips / slices`` chips.

    Raises:
        ScenarioError: a chip, host or slice that the pod does not have, or a
            slow_dcn on one slice; names the entry (``faults.<i>.chip``) and the
            allowed range.
    """

    def __init__(self, faults: Any, chips: int, chips_per_host: int,
                 base_links: Any = (), slices: int = 1) -> None:
        self.chips = chips
        slice_chips = chips // slices
        hosts = host_chips(chips, chips_per_host, slice_chips)
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
                if f.host >= len(hosts):
                    raise ScenarioError(f"faults.{i}.host: {f.host} is not a host of this pod "
                                        f"(hosts 0..{len(hosts) - 1}, {len(hosts[0])} chips "
                                        "each)")
                resolved.append(Fault(i, f.kind, step, chips=tuple(hosts[f.host])))
            elif f.kind == "slow_dcn":
                if slices == 1:
                    raise ScenarioError(f"faults.{i}.kind: slow_dcn slows the data-centre network "
                                        "between slices, and this pod has one slice; set "
                                        "pod.slices (e.g. 2) or use slow_link for an ICI link")
                if f.slice >= slices:
                    raise ScenarioError(f"faults.{i}.slice: {f.slice} is not a slice of this pod "
                                        f"(slices 0..{slices - 1})")
                resolved.append(Fault(i, f.kind, step, slowdown=f.slowdown, slice=f.slice))
            else:
                link = parse_link(f.link)
                bad = [r for r in link if r >= chips]
                if bad:
                    raise ScenarioError(f"faults.{i}.link: {f.link!r} names chip {bad[0]}, not a "
                                        f"chip of this pod (ranks 0..{chips - 1})")
                other = [r for r in link if r >= slice_chips]
                if other:  # every slice runs the same collectives: slice 0 stands for all
                    raise ScenarioError(
                        f"faults.{i}.link: {f.link!r} names chip {other[0]} of slice "
                        f"{other[0] // slice_chips}; on {slices} slices an ICI link fault names "
                        f"slice 0's ranks 0..{slice_chips - 1} (each slice runs the same "
                        "collectives and the step waits for the slowest); for the network "
                        "between slices use slow_dcn")
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

    def dcn_slowdown(self, step: int) -> float:
        """The DCN bandwidth divisor in force at zero-based ``step``: the largest slow_dcn
        started by then (a ring across slices runs at its slowest member's pace); 1.0
        without one."""
        return max((f.slowdown for f in self.faults if f.kind == "slow_dcn" and f.step <= step),
                   default=1.0)

    def link_change_steps(self) -> list[int]:
        """Zero-based steps at which the collectives' costs change: the link faults' and
        the slow_dcn faults' first steps (0 always included)."""
        return sorted({0} | {f.step for f in self.faults if f.link or f.kind == "slow_dcn"})

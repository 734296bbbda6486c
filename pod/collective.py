"""Run an ``interconnect.Schedule`` over chip actors.

Default transport, "direct": the driver makes one call per chip
(``ChipActor.run_collective``) carrying only that rank's part of the
schedule (``rank_plans``: ranks, chunk indices, reduce flags) and its
receivers' link addresses. Each chip then runs its phases by itself: it sends
this phase's chunks from its buffer straight to the receiving chips over
chip-to-chip links (``pod.ici``), waits for the chunks addressed to it and
applies them in the schedule's order. Sending before applying is exactly
"every transfer reads its source as it was at the start of the phase", and
the receiver computes ``dst = dst + incoming`` in the schedule's order, the
semantics of ``interconnect.execute``, so the two give bit-identical results.
Gradient bytes never pass through the driver.

"object_store" (the earlier path, kept for comparison): one call per chip per
phase, all submitted at once; each call applies the chunks that arrived in
the previous phase and sends this phase's as objects the chip puts in Ray's
object store, returning only references, which the driver hands to the
receivers. It is call-bound: about 15x slower than a driver gather at 64 KiB.
"""

from __future__ import annotations

import secrets
from collections import defaultdict
from typing import Any, Mapping, Sequence

import ray

from interconnect import (ALLREDUCE_ALGORITHMS, FAST_PATHS, LinkFaults, LinkSpec, Schedule,
                          ScheduleCost, Torus, collective_cost)

__all__ = ["run_schedule", "rank_plans", "choose_algorithm", "link_faults", "AUTO_MATERIALISE_MAX_CHIPS"]

#: ``auto`` only considers algorithms without a fast cost path up to this many chips
#: (their schedules are built Transfer by Transfer).
AUTO_MATERIALISE_MAX_CHIPS = 1024


def link_faults(entries: Sequence[Any]) -> LinkFaults:
    """``LinkFaults`` from scenario ``pod.links`` entries (objects or mappings with link,
    slowdown, failed).

    Raises:
        TopologyError: a malformed link or factor.
    """
    rows = []
    for entry in entries:
        if not isinstance(entry, Mapping):
            entry = {"link": entry.link, "slowdown": entry.slowdown, "failed": entry.failed}
        rows.append(entry)
    return LinkFaults.from_entries(rows)


def choose_algorithm(op: str, topology: Torus, num_elements: int, link: LinkSpec, *,
                     algorithm: str | None = "auto", itemsize: int = 4,
                     faults: LinkFaults | None = None,
                     candidates: Sequence[str] | None = None) -> tuple[str, ScheduleCost]:
    """The algorithm to run and its simulated cost: the given one, or the fastest.

    Args:
        op: the collective (``interconnect.OPS``).
        topology: the torus.
        num_elements: elements per chip's buffer.
        link: a healthy directed link.
        algorithm: an algorithm name, or "auto"/None for the fastest of
            ``candidates`` (default: every algorithm of ``op``; on pods above
            ``AUTO_MATERIALISE_MAX_CHIPS`` chips only those with a fast cost path,
            and on a multi-axis torus of that size only "torus").
        itemsize: bytes per element.
        faults: slowed / failed links.
        candidates: algorithms ``auto`` compares.

    Returns:
        (algorithm name, its ScheduleCost). Ties go to the earlier candidate.

    Raises:
        ScheduleError: unknown algorithm; TopologyError: bad faults.
    """
    from interconnect import ALGORITHMS

    if algorithm not in (None, "auto"):
        return algorithm, collective_cost(op, topology, num_elements, link, algorithm=algorithm,
                                          itemsize=itemsize, faults=faults)
    names = list(candidates or ALGORITHMS.get(op, ALLREDUCE_ALGORITHMS))
    if topology.num_chips > AUTO_MATERIALISE_MAX_CHIPS:
        names = [a for a in names if (op, a) in FAST_PATHS] or names[:1]
        if sum(axis > 1 for axis in topology.shape) > 1 and "torus" in names:
            # whole-pod rings cost O(chips^2) to evaluate (2(n-1) phases of n transfers)
            # and lose to per-axis rings on a multi-axis torus at this size: compare none
            names = ["torus"]
    best: tuple[str, ScheduleCost] | None = None
    for name in names:
        cost = collective_cost(op, topology, num_elements, link, algorithm=name, itemsize=itemsize,
                               faults=faults)
        if best is None or cost.seconds < best[1].seconds:
            best = (name, cost)
    assert best is not None
    return best


def run_schedule(actors: Sequence[Any], schedule: Schedule, *,
                 transport: str = "direct", key: bytes = b"") -> list[ray.ObjectRef]:
    """Submit a schedule to the actors; return one completion ref per actor.

    The actors must already hold their buffers (``ChipActor.compute``) and the
    schedule's chunk bounds (``ChipActor.set_chunk_bounds``). Nothing here
    blocks; ``ray.get`` the returned refs to wait for the collective to end.

    Args:
        actors: Ray actor handles of ``ChipActor``, indexed by topology rank.
        schedule: the collective's phases of transfers.
        transport: "direct" (default): one call per chip runs its whole part
            of the schedule and sends its chunks straight to the receivers
            over chip-to-chip links (``pod.ici``). "object_store": one call
            per chip per phase; each sender puts its chunks in Ray's object
            store and the receiver fetches them (the slower, earlier path).
        key: the pod's link secret for the direct transport (the same for
            every call on these actors): a chip accepts chunks only from
            peers that present it.

    Returns:
        One ObjectRef per actor; each resolves (to None) when that actor has
        applied its last incoming chunk.

    Raises:
        ValueError: the schedule is for a different number of ranks, or an
            unknown transport.
    """
    n = len(actors)
    if schedule.num_ranks != n:
        raise ValueError(f"schedule is for {schedule.num_ranks} ranks but there are {n} actors")
    if transport == "direct":
        return _run_direct(actors, schedule, key)
    if transport != "object_store":
        raise ValueError(f"transport {transport!r} is not valid: expected 'direct' or 'object_store'")
    return _run_object_store(actors, schedule)


def rank_plans(schedule: Schedule) -> list[list[tuple[int, list, list]]]:
    """Each rank's part of a schedule (``pod.ici.RankPlan``): per phase in which the
    rank sends or receives, (phase index, sends [(dst, chunk, seq)], receives
    [(src, seq, dst_chunk, reduce)]); receives keep the schedule's order, and
    ``seq`` numbers the transfers between one pair of ranks within a phase."""
    plans: list[list[tuple[int, list, list]]] = [[] for _ in range(schedule.num_ranks)]
    for index, phase in enumerate(schedule.phases):
        sends: dict[int, list] = defaultdict(list)
        receives: dict[int, list] = defaultdict(list)
        seqs: dict[tuple[int, int], int] = defaultdict(int)
        for t in phase:
            seq = seqs[(t.src, t.dst)]
            seqs[(t.src, t.dst)] = seq + 1
            sends[t.src].append((t.dst, t.chunk, seq))
            receives[t.dst].append((t.src, seq, t.dst_chunk, t.reduce))
        for rank in sends.keys() | receives.keys():
            plans[rank].append((index, sends.get(rank, []), receives.get(rank, [])))
    return plans


def _run_direct(actors: Sequence[Any], schedule: Schedule, key: bytes) -> list[ray.ObjectRef]:
    run_id = secrets.randbits(63)
    addresses = [actor.ici_address.remote(key) for actor in actors]
    done = []
    for rank, plan in enumerate(rank_plans(schedule)):
        peers = sorted({dst for _, sends, _ in plan for dst, _, _ in sends})
        done.append(actors[rank].run_collective.remote(run_id, plan, peers,
                                                       *(addresses[p] for p in peers)))
    return done


def _run_object_store(actors: Sequence[Any], schedule: Schedule) -> list[ray.ObjectRef]:
    n = len(actors)
    pending: dict[int, list[tuple[int, bool, ray.ObjectRef]]] = defaultdict(list)
    last: list[ray.ObjectRef | None] = [None] * n
    for phase in schedule.phases:
        sends: dict[int, list[Any]] = defaultdict(list)
        for transfer in phase:
            sends[transfer.src].append(transfer)
        arrived: dict[int, list[tuple[int, bool, ray.ObjectRef]]] = defaultdict(list)
        for rank in range(n):
            inbox, outbox = pending.pop(rank, []), sends.get(rank, [])
            if not inbox and not outbox:
                continue
            refs = _call(actors[rank], inbox, [t.chunk for t in outbox])
            last[rank] = refs[0]
            for transfer, ref in zip(outbox, refs):
                arrived[transfer.dst].append((transfer.dst_chunk, transfer.reduce, ref))
        pending = arrived
    done = []
    for rank in range(n):
        inbox = pending.pop(rank, [])
        if inbox:
            done.append(_call(actors[rank], inbox, [])[0])
        elif last[rank] is not None:
            done.append(last[rank])
        else:
            done.append(actors[rank].exchange.remote([], []))
    return done


def _call(actor: Any, inbox: list[tuple[int, bool, ray.ObjectRef]], sends: list[int]) -> list:
    receives = [(chunk, reduce) for chunk, reduce, _ in inbox]
    refs = [ref for _, _, ref in inbox]
    num_returns = max(1, len(sends))
    out = actor.exchange.options(num_returns=num_returns).remote(receives, sends, *refs)
    return list(out) if num_returns > 1 else [out]

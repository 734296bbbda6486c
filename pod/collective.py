"""Run an ``interconnect.Schedule`` over chip actors.

Every phase is one round of actor calls; all rounds are submitted at once
and Ray runs them in order on each actor, so the driver never waits between
phases (the phases pipeline). Each call to ``ChipActor.exchange`` first
applies the chunks that arrived in the previous phase and then sends this
phase's chunks; reading a chunk after applying the previous phase is exactly
"every transfer reads its source as it was at the start of the phase", the
semantics of ``interconnect.execute``, so the two give bit-identical results.

Chunks travel actor to actor: the sender puts each chunk in Ray's object
store and returns only its reference; the receiver fetches it. The driver
passes references along and never holds gradient bytes.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Sequence

import ray

from interconnect import Schedule

__all__ = ["run_schedule"]


def run_schedule(actors: Sequence[Any], schedule: Schedule) -> list[ray.ObjectRef]:
    """Submit a schedule's phases to the actors; return one completion ref per actor.

    The actors must already hold their buffers (``ChipActor.compute``) and the
    schedule's chunk bounds (``ChipActor.set_chunk_bounds``). Nothing here
    blocks; ``ray.get`` the returned refs to wait for the collective to end.

    Args:
        actors: Ray actor handles of ``ChipActor``, indexed by topology rank.
        schedule: the collective's phases of transfers.

    Returns:
        One ObjectRef per actor; each resolves (to None) when that actor has
        applied its last incoming chunk.

    Raises:
        ValueError: the schedule is for a different number of ranks.
    """
    n = len(actors)
    if schedule.num_ranks != n:
        raise ValueError(f"schedule is for {schedule.num_ranks} ranks but there are {n} actors")
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
                arrived[transfer.dst].append((transfer.chunk, transfer.reduce, ref))
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

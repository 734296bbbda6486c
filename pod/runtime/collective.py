"""Run an ``interconnect.Schedule`` over chip actors, and wait for every chip.

The driver makes one call per chip (``ChipActor.run_collective``) carrying
only that rank's part of the schedule (``rank_plans``: ranks, chunk indices,
reduce flags) and its receivers' link addresses. Each chip then runs its
phases by itself: it sends this phase's chunks from its buffer straight to
the receiving chips over chip-to-chip links (``pod.runtime.ici``), waits for
the chunks addressed to it and applies them in the schedule's order. Sending
before applying is exactly "every transfer reads its source as it was at the
start of the phase", and the receiver computes ``dst = dst + incoming`` in the
schedule's order, the semantics of ``interconnect.execute``, so the two give
bit-identical results. Gradient bytes never pass through the driver.
"""

from __future__ import annotations

import secrets
from collections import defaultdict
from typing import Any, Sequence

import ray

from interconnect import Schedule

__all__ = ["run_schedule", "rank_plans"]


def run_schedule(actors: Sequence[Any], schedule: Schedule, *, key: bytes = b"") -> list[ray.ObjectRef]:
    """Submit a schedule to the actors; return one completion ref per actor.

    The actors must already hold their buffers (``ChipActor.compute``) and the
    schedule's chunk bounds (``ChipActor.set_chunk_bounds``). Nothing here
    blocks: the caller must ``ray.get`` EVERY returned ref before it reads a
    chip's buffer, so that an ``IciError`` on any chip (a chunk that never
    came) is seen and no chip goes on with a partly reduced buffer.

    Args:
        actors: Ray actor handles of ``ChipActor``, indexed by topology rank.
        schedule: the collective's phases of transfers.
        key: the pod's link secret (the same for every call on these actors):
            a chip accepts chunks only from peers that present it.

    Returns:
        One ObjectRef per actor; each resolves (to None) when that actor has
        applied its last incoming chunk, or raises the chip's ``IciError``.

    Raises:
        ValueError: the schedule is for a different number of ranks.
    """
    n = len(actors)
    if schedule.num_ranks != n:
        raise ValueError(f"schedule is for {schedule.num_ranks} ranks but there are {n} actors")
    run_id = secrets.randbits(63)
    addresses = [actor.ici_address.remote(key) for actor in actors]
    done = []
    for rank, plan in enumerate(rank_plans(schedule)):
        peers = sorted({dst for _, sends, _ in plan for dst, _, _ in sends})
        done.append(actors[rank].run_collective.remote(run_id, plan, peers,
                                                       *(addresses[p] for p in peers)))
    return done


def rank_plans(schedule: Schedule) -> list[list[tuple[int, list, list]]]:
    """Each rank's part of a schedule (``pod.runtime.ici.RankPlan``): per phase in
    which the rank sends or receives, (phase index, sends [(dst, chunk, seq)],
    receives [(src, seq, dst_chunk, reduce)]); receives keep the schedule's
    order, and ``seq`` numbers the transfers between one pair of ranks within
    a phase."""
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

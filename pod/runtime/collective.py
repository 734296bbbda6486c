"""Run an ``interconnect.Schedule`` over actors that hold a buffer, and wait for every one.

The transport of the ICI tested and benchmarked on its own, apart from the
device programs (which run their collectives inside a step:
``pod.runtime.mesh_collectives``). The driver makes one call per actor
(``BufferActor.run_collective``) carrying only that rank's part of the
schedule (``rank_plans``: ranks, chunk indices, reduce flags) and its
receivers' link addresses. Each actor then runs its phases by itself: it
sends this phase's chunks from its buffer straight to the receiving actors
over chip-to-chip links (``pod.runtime.ici``), waits for the chunks addressed
to it and applies them in the schedule's order. Sending before applying is
exactly "every transfer reads its source as it was at the start of the
phase", and the receiver computes ``dst = dst + incoming`` in the schedule's
order, the semantics of ``interconnect.execute``, so the two give
bit-identical results. The buffer's bytes never pass through the driver.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np

from interconnect import Schedule, Transfer, chunk_bounds
from pod.runtime.blas import one_blas_thread

__all__ = ["BufferActor", "run_schedule", "rank_plans", "phase_plans", "split_chunks",
           "PIPELINE_CHUNK_BYTES"]

#: Chunks larger than this are cut into pieces of at most this many bytes
#: (``split_chunks``), so that a chip reduces the first pieces of a chunk while
#: the rest are still on the wire. Smaller pieces cost more CPU per byte
#: (headers, wake-ups): on 8 actors sharing 2 cores, where no core is idle,
#: pieces of 128-512 KiB made a 16 MiB allreduce slower (BENCHMARKS.md,
#: "Emulation speed"), so only chunks above 4 MiB are cut.
PIPELINE_CHUNK_BYTES = 4 << 20


def run_schedule(actors: Sequence[Any], schedule: Schedule, *, key: bytes = b"",
                 addresses: Sequence[Any] | None = None) -> list[Any]:
    """Submit a schedule to the actors; return one completion ref per actor.

    The actors must already hold their buffers (``BufferActor.set_buffer``) and the
    schedule's chunk bounds (``BufferActor.set_chunk_bounds``). Nothing here
    blocks: the caller must ``ray.get`` EVERY returned ref before it reads a
    chip's buffer, so that an ``IciError`` on any chip (a chunk that never
    came) is seen (its buffer is dropped: ``get_buffer`` then refuses).

    Args:
        actors: Ray actor handles of ``BufferActor``, indexed by topology rank.
        schedule: the collective's phases of transfers.
        key: the pod's link secret (the same for every call on these actors):
            a chip accepts chunks only from peers that present it.
        addresses: every actor's ``ici_address(key)`` by rank (values or refs),
            when the caller already has them: saves one call per actor.

    Returns:
        One Ray ObjectRef per actor; each resolves (to None) when that actor has
        applied its last incoming chunk, or raises the chip's ``IciError``.

    Raises:
        ValueError: the schedule is for a different number of ranks.
    """
    n = len(actors)
    if schedule.num_ranks != n:
        raise ValueError(f"schedule is for {schedule.num_ranks} ranks but there are {n} actors")
    run_id = secrets.randbits(63)
    if addresses is None:
        addresses = [actor.ici_address.remote(key) for actor in actors]
    done = []
    for rank, plan in enumerate(rank_plans(schedule)):
        peers = sorted({dst for _, sends, _ in plan for dst, _, _ in sends})
        done.append(actors[rank].run_collective.remote(run_id, plan, peers,
                                                       *(addresses[p] for p in peers)))
    return done


def split_chunks(schedule: Schedule, max_chunk_bytes: int = PIPELINE_CHUNK_BYTES) -> Schedule:
    """The same collective with every chunk larger than ``max_chunk_bytes`` cut into
    equal pieces (``interconnect.chunk_bounds``) that travel as the chunk did.

    Each piece takes its chunk's transfers, phase by phase, in the schedule's
    order, so every element is added in the same order as before: the result
    is bit-identical (tested against ``interconnect.execute``). A chip then
    applies a chunk piece by piece as the pieces arrive, while its reader
    threads still receive the next ones. Only the execution changes: the
    simulated cost is the plan's, from the schedule as built.

    Args:
        schedule: any schedule without ``owned_chunks`` (those are returned as is).
        max_chunk_bytes: the largest piece, bytes >= the itemsize.

    Returns:
        The split schedule (``schedule`` itself if no chunk is larger).

    Raises:
        ValueError: ``max_chunk_bytes`` smaller than one element.
    """
    if max_chunk_bytes < schedule.itemsize:
        raise ValueError(f"max_chunk_bytes must hold one element ({schedule.itemsize} bytes), "
                         f"got {max_chunk_bytes!r}")
    per_piece = max_chunk_bytes // schedule.itemsize
    if schedule.owned_chunks or all(b - a <= per_piece for a, b in schedule.chunk_bounds):
        return schedule
    bounds: list[tuple[int, int]] = []
    pieces: list[list[int]] = []  # chunk -> its pieces' indices
    for start, stop in schedule.chunk_bounds:
        count = max(1, -(-(stop - start) // per_piece))
        first = len(bounds)
        bounds.extend((start + a, start + b) for a, b in chunk_bounds(stop - start, count))
        pieces.append(list(range(first, len(bounds))))
    size = schedule.itemsize
    phases = tuple(
        tuple(Transfer(t.src, t.dst, c, (bounds[c][1] - bounds[c][0]) * size, t.reduce, d)
              for t in phase for c, d in zip(pieces[t.chunk], pieces[t.dst_chunk], strict=False))
        for phase in schedule.phases)
    return dataclasses.replace(schedule, chunk_bounds=tuple(bounds), phases=phases)


def rank_plans(schedule: Schedule) -> list[list[tuple[int, list, list]]]:
    """Each rank's part of a schedule (``pod.runtime.ici.RankPlan``): per phase in
    which the rank sends or receives, (phase index, sends [(dst, chunk, seq)],
    receives [(src, seq, dst_chunk, reduce)]); receives keep the schedule's
    order, and ``seq`` numbers the transfers between one pair of ranks within
    a phase."""
    return phase_plans(schedule.num_ranks, schedule.phases)


def phase_plans(num_ranks: int, phases: Sequence[Sequence[Transfer]]
                ) -> list[list[tuple[int, list, list]]]:
    """``rank_plans`` of phases of ``Transfer`` over ``num_ranks`` ranks that need not
    form a checked ``Schedule`` (``pod.runtime.direct``: chunks that overlap)."""
    plans: list[list[tuple[int, list, list]]] = [[] for _ in range(num_ranks)]
    for index, phase in enumerate(phases):
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


class BufferActor:
    """One chip's flat float32 buffer and its ``IciPort``: what ``run_schedule`` runs a
    collective over (tests and benchmarks of the transport).

    Plain Python (usable in-process); wrap it with ``ray.remote`` where it is made.

    Args:
        rank: the chip's rank in the schedule (its ``IciPort`` rank).
        limit_threads: pin BLAS to one thread (several actors share few cores).
    """

    def __init__(self, rank: int, *, limit_threads: bool = True) -> None:
        if limit_threads:
            one_blas_thread()  # pod.runtime.blas: the same BLAS threading as every back-end
        self.rank = int(rank)
        self.buffer: np.ndarray | None = None
        self.chunk_bounds: tuple[tuple[int, int], ...] = ()
        self._port: Any = None

    def node_id(self) -> str:
        """The Ray node this actor runs on ("" outside Ray)."""
        try:
            import ray
            return ray.get_runtime_context().get_node_id()
        except Exception:  # noqa: BLE001 - outside a Ray worker
            return ""

    def ici_port(self, key: bytes = b"") -> Any:
        """This chip's ``IciPort`` (opened on first use with the link ``key``)."""
        if self._port is None:
            from pod.runtime.ici import IciPort
            self._port = IciPort(self.rank, key)
        return self._port

    def set_shared_memory(self, enabled: bool) -> None:
        """Send chunks to chips of this host through shared memory (the default) or
        every payload over TCP (``IciPort.shared_memory``; benchmarks compare them)."""
        self.ici_port().shared_memory = bool(enabled)

    def ici_address(self, key: bytes = b"") -> tuple[str, int]:
        """(host, port) where this chip receives chunks from its peers."""
        return self.ici_port(key).address

    def set_chunk_bounds(self, bounds: Sequence[Sequence[int]]) -> None:
        """Store the schedule's chunk element ranges [(start, stop), ...]."""
        self.chunk_bounds = tuple((int(a), int(b)) for a, b in bounds)

    def set_buffer(self, buffer: np.ndarray) -> None:
        """Replace the buffer by a float32 copy of ``buffer``, (P,)."""
        self.buffer = np.array(buffer, dtype=np.float32, copy=True)

    def get_buffer(self) -> np.ndarray:
        """A copy of the buffer, (P,) float32.

        Raises:
            RuntimeError: there is none (never set, or dropped by a failed collective).
        """
        if self.buffer is None:
            raise RuntimeError(f"chip {self.rank}: no buffer (none was set, or its last "
                               "collective failed and dropped the partial result)")
        return self.buffer.copy()

    def run_collective(self, run_id: int, plan: Sequence[Any], peers: Sequence[int],
                       *addresses: tuple[str, int]) -> None:
        """Run this chip's part of a schedule on the buffer, chip to chip (``pod.runtime.ici``).

        Args:
            run_id: the collective's id, the same on every chip.
            plan: this rank's phases (``pod.runtime.ici.RankPlan``).
            peers: the ranks this chip sends to, in the order of ``addresses``.
            addresses: their ``ici_address()`` (Ray resolves the references).

        Raises:
            IciError: a chunk did not arrive (the peer died, the link closed, or
                the wait timed out); the buffer is dropped, so that no partial
                result is read (``get_buffer`` refuses).
            RuntimeError: no buffer.
        """
        if self.buffer is None:
            raise RuntimeError(f"chip {self.rank}: run_collective without a buffer")
        try:
            self.ici_port().run(run_id, list(plan), dict(zip(peers, addresses, strict=False)),
                                self.buffer, self.chunk_bounds)
        except BaseException:
            self.buffer = None  # partly reduced: never read
            raise

"""Pipeline schedules: which stage runs which microbatch's forward or backward, tick by tick.

A pipeline splits the model's layers over ``S`` stages (the ``stage`` mesh
axis) and the batch into ``M`` microbatches. With ``R`` repeats (the circular
schedule) each stage holds ``R`` chunks of layers, MaxText's layout
(``num_pipeline_repeats``): chunk ``r`` of stage ``s`` is *virtual stage*
``v = r S + s`` of ``V = S R``, so a microbatch goes round the ring of
stages ``R`` times. An op is the forward or backward of one microbatch
through one chunk (:class:`PipeOp`). Pure: no arrays, no collectives.

Each stage runs its ops in the order of its schedule:

- ``gpipe`` [GPipe] (Huang et al. 2019): every microbatch's forward, then every
  backward in the reverse order (what autodiff of MaxText's forward loop
  does). All M microbatches' activations are kept at once.
- ``1f1b`` [1F1B] (PipeDream-flush, Narayanan et al. 2021 "Efficient
  large-scale language model training on GPU clusters using Megatron-LM";
  PipeDream, Narayanan et al. 2019): stage ``s`` runs ``min(S - s - 1, M)``
  warm-up forwards, then one forward and one backward in turn, then the
  remaining backwards. The same bubble as GPipe, at most ``min(S - s, M)``
  microbatches in flight instead of M.
- ``circular`` [MaxText] (``pipeline.py``, ``num_pipeline_repeats``): GPipe over
  the V virtual stages: for each repeat every microbatch's forward, then the
  backwards in reverse. The bubble shrinks R-fold: ``(S - 1) / (R M + S - 1)``.
  Needs M a multiple of S (as MaxText), so that a microbatch's next repeat
  finds its stage free.

The ticks (:attr:`PipelineSchedule.ticks`) lay those orders out in SPMD
steps: at each tick every stage runs at most one op, the next of its order,
once the op it depends on (the previous virtual stage's forward of the
microbatch, or the next one's backward) ran at an earlier tick; after the
tick the outputs move one stage on (forward) or back (backward) by a
collective permute (``pod.programs.pipeline``). A tick is a point of the
program, not a unit of time: the clock (``pod.report.clock``) lets each stage
wait only for the data it uses, so a stage's ops run back to back wherever
their inputs are ready, and the bubble comes out as the waits of the
dataflow.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

__all__ = ["SCHEDULES", "PipeOp", "PipelineSchedule", "build_schedule", "check_pipeline",
           "bubble_fraction"]

#: ``training.pipeline_schedule`` values.
SCHEDULES = ("gpipe", "1f1b", "circular")


@dataclass(frozen=True, order=True)
class PipeOp:
    """One op of a stage: the forward or backward of a microbatch through one chunk.

    Attributes:
        phase: "fwd" or "bwd".
        microbatch: 0 .. M - 1.
        repeat: the chunk of the stage, 0 .. R - 1 (virtual stage ``repeat x S + stage``).
    """

    phase: str
    microbatch: int
    repeat: int = 0


def check_pipeline(name: str, stages: int, microbatches: int, repeats: int = 1) -> None:
    """Checks a schedule's figures.

    Raises:
        ValueError: one line naming the value and what is allowed: an unknown
            schedule; a count below 1; repeats above 1 outside ``circular``;
            ``circular`` with microbatches not a multiple of the stages.
    """
    if name not in SCHEDULES:
        raise ValueError(f"pipeline schedule {name!r} is unknown; allowed: {', '.join(SCHEDULES)}")
    for what, value in (("stages", stages), ("microbatches", microbatches),
                        ("repeats", repeats)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"pipeline {what} {value!r} is not a count; give an int >= 1")
    if repeats > 1 and name != "circular":
        raise ValueError(f"pipeline repeats {repeats} need the circular schedule (got {name}); "
                         "use pipeline_schedule: circular or repeats 1")
    if name == "circular" and microbatches % stages:
        lower = microbatches // stages * stages
        near = f"{lower} or {lower + stages}" if lower else f"{stages}"
        raise ValueError(f"the circular schedule needs microbatches a multiple of the {stages} "
                         f"stages, got {microbatches}; use {near}")


def _stage_order(name: str, stages: int, microbatches: int, repeats: int, stage: int,
                 forward_only: bool) -> list[PipeOp]:
    """One stage's ops in the order it runs them (module docstring)."""
    m_count = microbatches
    if name == "1f1b" and not forward_only:
        warm = min(stages - stage - 1, m_count)
        order = [PipeOp("fwd", m) for m in range(warm)]
        for i in range(m_count - warm):
            order += [PipeOp("fwd", warm + i), PipeOp("bwd", i)]
        return order + [PipeOp("bwd", m) for m in range(m_count - warm, m_count)]
    forward = [PipeOp("fwd", m, r) for r in range(repeats) for m in range(m_count)]
    if forward_only:
        return forward
    return forward + [PipeOp("bwd", op.microbatch, op.repeat) for op in reversed(forward)]


@dataclass(frozen=True)
class PipelineSchedule:
    """A schedule laid out in ticks (:func:`build_schedule`).

    Attributes:
        name: gpipe, 1f1b or circular.
        stages: S; microbatches: M; repeats: R (chunks per stage).
        forward_only: only forwards (evaluation).
        ticks: per tick, per stage, the op it runs or None (idle).
    """

    name: str
    stages: int
    microbatches: int
    repeats: int
    forward_only: bool
    ticks: tuple[tuple[PipeOp | None, ...], ...]

    @property
    def virtual_stages(self) -> int:
        """V = S x R."""
        return self.stages * self.repeats

    def virtual(self, stage: int, op: PipeOp) -> int:
        """The virtual stage of ``op`` run by ``stage``: repeat x S + stage."""
        return op.repeat * self.stages + stage

    def sends(self, tick: int, phase: str) -> bool:
        """Whether some stage's op at ``tick`` has output for the next (fwd) or the
        previous (bwd) virtual stage: the tick's permute in that direction runs."""
        return any(self._target(s, op, phase) is not None
                   for s, op in enumerate(self.ticks[tick]) if op is not None)

    def _target(self, stage: int, op: PipeOp, phase: str) -> PipeOp | None:
        """The op that uses what ``op`` (run by ``stage``) sends in ``phase``'s direction."""
        if op.phase != phase:
            return None
        v = self.virtual(stage, op) + (1 if phase == "fwd" else -1)
        if not 0 <= v < self.virtual_stages:
            return None
        return PipeOp(phase, op.microbatch, v // self.stages)

    def received(self, stage: int, tick: int, phase: str) -> PipeOp | None:
        """The op of ``stage`` that will use what the tick's permute in ``phase``'s
        direction brings it (from stage - 1 forward, stage + 1 backward, cyclic), or
        None when the sender sends nothing it uses."""
        src = (stage - 1 if phase == "fwd" else stage + 1) % self.stages
        op = self.ticks[tick][src]
        return None if op is None else self._target(src, op, phase)

    def in_flight(self, stage: int) -> int:
        """The most (microbatch, chunk) forward activations ``stage`` keeps at once for
        their backward: M R (gpipe, circular), ``min(S - stage, M)`` (1f1b)."""
        kept = peak = 0
        for row in self.ticks:
            op = row[stage]
            if op is not None:
                kept += 1 if op.phase == "fwd" else -1
                peak = max(peak, kept)
        return peak

    def ops(self, stage: int) -> list[PipeOp]:
        """``stage``'s ops in the order it runs them."""
        return [op for row in self.ticks if (op := row[stage]) is not None]


@functools.lru_cache(maxsize=256)
def build_schedule(name: str, stages: int, microbatches: int, repeats: int = 1, *,
                   forward_only: bool = False) -> PipelineSchedule:
    """The ticks of a schedule (module docstring): at each tick every stage runs the
    next op of its order if what it depends on ran at an earlier tick. Kept per
    arguments (a frozen value; a plan search builds thousands of pipelined programs).

    Args:
        name: gpipe, 1f1b or circular.
        stages: S >= 1.
        microbatches: M >= 1.
        repeats: R >= 1 (circular only).
        forward_only: forwards only (evaluation; every schedule runs them in
            GPipe's order).

    Raises:
        ValueError: as :func:`check_pipeline`.
    """
    check_pipeline(name, stages, microbatches, repeats)
    orders = [_stage_order(name, stages, microbatches, repeats, s, forward_only)
              for s in range(stages)]
    v_last = stages * repeats - 1
    done: set[tuple[str, int, int]] = set()  # (phase, microbatch, virtual stage), earlier ticks
    next_op = [0] * stages
    ticks: list[tuple[PipeOp | None, ...]] = []
    while any(i < len(o) for i, o in zip(next_op, orders, strict=True)):
        row: list[PipeOp | None] = []
        for s, order in enumerate(orders):
            op = order[next_op[s]] if next_op[s] < len(order) else None
            if op is not None:
                v = op.repeat * stages + s
                need = (("fwd", op.microbatch, v - 1) if op.phase == "fwd"
                        else ("fwd", op.microbatch, v) if v == v_last
                        else ("bwd", op.microbatch, v + 1))
                if op.phase == "fwd" and v == 0 or need in done:
                    next_op[s] += 1
                else:
                    op = None
            row.append(op)
        if not any(row):  # cannot happen for the orders above: a guard against a bad order
            raise RuntimeError(f"pipeline schedule {name}: no stage can run at tick {len(ticks)}")
        done.update((op.phase, op.microbatch, op.repeat * stages + s)
                    for s, op in enumerate(row) if op is not None)
        ticks.append(tuple(row))
    return PipelineSchedule(name, stages, microbatches, repeats, forward_only, tuple(ticks))


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
    """The closed form of the bubble's share of the forward and backward passes with
    stages of equal cost and free transfers: ``(S - 1) / (R M + S - 1)`` [GPipe]
    ([1F1B]: the same for 1F1B; [MaxText] R-fold smaller for the circular schedule)."""
    return (stages - 1) / (repeats * microbatches + stages - 1)

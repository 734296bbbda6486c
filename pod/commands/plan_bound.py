"""A lower bound of a pipelined point's step from one stage's passes: ``tpu-pod plan``
prunes with it (``plan_cost``) without running the other stages or the clock.

The clock (``pod.report.clock``) runs each stage's records back to back on its compute
stream and only ever adds waits: a stage's op (the forward or backward of a microbatch
through a chunk of layers, ``pod.programs.pipeline_schedule``) starts no earlier than
the end of its previous op on the stage, and no earlier than the end of the op whose
output it uses on the stage before (forward) or after (backward): its wait for that
collective permute ends at the send's end, which is at or after the moment the source's
stream reached the send, right after that op's records. The step is the slowest
stage's clock, at least the end of every stage's last op; the sustained MXU budget,
the collectives, the infeed and the dispatch only add to it.

So any duration ``d(op)`` at most each op's real one gives, over the schedule's
dataflow (the longest path of ops and their dependencies), a lower bound of the step.
Each block's pass costs at least its MXU records' seconds: those depend on the op's
shapes and the core only, never on the fusion state a chunk starts in (``chip.
TensorCore``; ``LayerTape.pass_mxu_seconds``), and every block of a model whose blocks
share one signature runs the same on every stage. So an op of ``n`` blocks lasts at
least ``n`` times a block's MXU seconds in its phase (the embedding, the output layer
and the VPU work only add). On the stage whose passes were run (``stage``), the passes
lie between the start of its first op and the end of its last op: its clock spends at
least their seconds ``passes`` there. Hence (:func:`pipeline_bound`)

    step >= max(fill + passes + drain, the longest path of the op bounds),

``fill`` the longest path of op bounds before the stage's first op can start (the
pipeline filling up to it), ``drain`` the longest path after its last op (the
gradients flowing back past it to the first stage). With S stages of GPipe and the
last stage run, fill and drain are (S - 1) forwards and (S - 1) backwards of a chunk:
the bubble of ``pipeline_schedule.bubble_fraction``, at the MXU's share of the passes.
"""

from __future__ import annotations

from collections.abc import Sequence

from pod.programs.pipeline_schedule import PipelineSchedule, PipeOp

__all__ = ["pipeline_bound"]


def _producer(schedule: PipelineSchedule, stage: int, op: PipeOp) -> tuple[int, PipeOp] | None:
    """The (stage, op) whose output ``op`` of ``stage`` waits for: the previous virtual
    stage's forward of the microbatch (a forward), the next one's backward (a backward
    but on the last virtual stage, whose input is its own forward's, on its stage)."""
    s_count, v = schedule.stages, schedule.virtual(stage, op)
    if op.phase == "fwd":
        if v == 0:
            return None
        w = v - 1
    else:
        if v == schedule.virtual_stages - 1:
            return None
        w = v + 1
    return w % s_count, PipeOp(op.phase, op.microbatch, w // s_count)


def pipeline_bound(schedule: PipelineSchedule, stage: int, blocks: Sequence[int],
                   forward_seconds: float, backward_seconds: float,
                   passes_seconds: float) -> float:
    """A lower bound of the simulated step of a pipelined point (module docstring).

    Args:
        schedule: the step's ticks (``PipelinedTransformer.schedule``).
        stage: the stage whose passes were run (0 .. S - 1).
        blocks: per virtual stage, its chunk's transformer blocks (the blocks of a model
            whose blocks all share one signature).
        forward_seconds, backward_seconds: a block's forward and backward pass of one
            microbatch, its MXU records' seconds (at most any block's, on any stage).
        passes_seconds: the forward and backward passes of ``stage``, seconds of their
            compute-stream records.

    Returns:
        Simulated seconds the step takes at least.
    """
    per_phase = {"fwd": forward_seconds, "bwd": backward_seconds}
    orders: list[list[PipeOp]] = [schedule.ops(s) for s in range(schedule.stages)]
    ends: dict[tuple[int, PipeOp], float] = {}
    cost: dict[tuple[int, PipeOp], float] = {}
    starts: dict[tuple[int, PipeOp], float] = {}
    free = [0.0] * schedule.stages
    longest = 0.0
    for row in schedule.ticks:  # a dependency ran at an earlier tick
        for s, op in enumerate(row):
            if op is None:
                continue
            key = (s, op)
            source = _producer(schedule, s, op)
            start = max(free[s], ends[source] if source is not None else 0.0)
            cost[key] = blocks[schedule.virtual(s, op)] * per_phase[op.phase]
            starts[key] = start
            ends[key] = free[s] = start + cost[key]
            longest = max(longest, ends[key])
    if not orders[stage]:
        return max(longest, passes_seconds)
    fill = starts[(stage, orders[stage][0])]
    drain = _tail(schedule, orders, cost, stage)
    return max(longest, fill + passes_seconds + drain)


def _tail(schedule: PipelineSchedule, orders: list[list[PipeOp]],
          cost: dict[tuple[int, PipeOp], float], stage: int) -> float:
    """The longest path of op bounds after ``stage``'s last op: through the ops that use
    its output, then theirs and the ops after them on their stages."""
    consumers: dict[tuple[int, PipeOp], list[tuple[int, PipeOp]]] = {}
    following: dict[tuple[int, PipeOp], tuple[int, PipeOp]] = {}
    for s, order in enumerate(orders):
        for a, b in zip(order, order[1:], strict=False):
            following[(s, a)] = (s, b)
        for op in order:
            source = _producer(schedule, s, op)
            if source is not None:
                consumers.setdefault(source, []).append((s, op))
    tail: dict[tuple[int, PipeOp], float] = {}
    for later in reversed(schedule.ticks):  # what follows an op runs at a later tick
        for s, maybe in enumerate(later):
            if maybe is None:
                continue
            key = (s, maybe)
            after = [tail[k] for k in (*consumers.get(key, ()), following.get(key))
                     if k is not None]
            tail[key] = cost[key] + max(after, default=0.0)
    last = (stage, orders[stage][-1])
    return max((tail[k] for k in consumers.get(last, ())), default=0.0)

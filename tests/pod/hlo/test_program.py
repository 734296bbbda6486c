"""A module as the events one device runs (``pod.hlo.program``): loops unrolled by their trip
counts against hand counts, async windows paired, a CPU module's windows."""

from __future__ import annotations

import pytest

from pod.errors import HloError
from pod.hlo import flatten, parse_hlo
from pod.hlo.program import DoneEvent, OpEvent, StartEvent


def looped(init: int, step: str, direction: str, limit: int, known: str = "") -> str:
    """A module: a kernel, a loop whose body runs two kernels and an all-reduce, a kernel.
    ``step`` is the body's update of the counter ("add 1", "subtract 2")."""
    op, amount = step.split()
    return f"""HloModule loop, is_scheduled=true, num_partitions=4

%sum (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}}

%body (p: (s32[], f32[64])) -> (s32[], f32[64]) {{
  %p = (s32[], f32[64]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %k = s32[] constant({amount})
  %next = s32[] {op}(%i, %k)
  %x = f32[64] get-tuple-element(%p), index=1
  %e = f32[64] exponential(%x)
  %r = f32[64] all-reduce(%e), replica_groups={{{{0,1,2,3}}}}, to_apply=%sum
  %n = f32[64] negate(%r)
  ROOT %t = (s32[], f32[64]) tuple(%next, %n)
}}

%cond (p: (s32[], f32[64])) -> pred[] {{
  %p = (s32[], f32[64]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant({limit})
  ROOT %c = pred[] compare(%i, %n), direction={direction}
}}

ENTRY %main (a: f32[64]) -> f32[64] {{
  %a = f32[64] parameter(0)
  %first = f32[64] tanh(%a)
  %zero = s32[] constant({init})
  %copied = s32[] copy(%zero)
  %init = (s32[], f32[64]) tuple(%copied, %first)
  %w = (s32[], f32[64]) while(%init), condition=%cond, body=%body{known}
  %out = f32[64] get-tuple-element(%w), index=1
  ROOT %last = f32[64] abs(%out)
}}
"""


def kinds(program):
    return [type(e).__name__[0] for e in program.events]


@pytest.mark.parametrize("init, step, direction, limit, trips", [
    (0, "add 1", "LT", 7, 7), (0, "add 3", "LT", 7, 3), (1, "add 1", "LE", 4, 4),
    (10, "subtract 2", "GT", 0, 5), (10, "subtract 2", "GE", 0, 6), (5, "add 1", "LT", 5, 0)])
def test_counted_loops_run_their_trip_count(init, step, direction, limit, trips):
    program = flatten(parse_hlo(looped(init, step, direction, limit)))
    assert program.trip_counts == {"w": trips}
    # by hand: tanh and copy, then per trip the counter's add, exp, all-reduce (start +
    # done), negate, then abs
    assert kinds(program) == ["O", "O"] + ["O", "O", "S", "D", "O"] * trips + ["O"]


def test_known_trip_count_wins():
    text = looped(0, "add 1", "LT", 7, ', backend_config={"known_trip_count":{"n":"2"}}')
    assert flatten(parse_hlo(text)).trip_counts == {"w": 2}


def test_a_loop_that_is_not_counted_is_refused():
    text = looped(0, "add 1", "LT", 7).replace("%n = s32[] constant(7)",
                                               "%n = s32[] get-tuple-element(%p), index=0")
    with pytest.raises(HloError, match=r"line \d+: while 'w': its trip count is not recorded"):
        flatten(parse_hlo(text))


def test_snippet_loops_as_counted(modules):
    """The TPU-compiled scan of 3 layers has no known_trip_count: read off the loop; the
    CPU-compiled one records it."""
    for platform in ("tpu", "cpu"):
        program = flatten(modules[("mlp_scan", platform)], approximate=platform == "cpu")
        assert sorted(program.trip_counts.values()) == [3, 3], platform


@pytest.mark.parametrize("platform", ["tpu", "cpu"])
@pytest.mark.parametrize("name", ["mlp_scan", "fsdp_block", "ring_permute"])
def test_every_window_opens_before_it_closes(modules, name, platform):
    program = flatten(modules[(name, platform)], approximate=platform == "cpu")
    opened, closed = [], []
    for event in program.events:
        if isinstance(event, StartEvent):
            opened.append(event.key)
        elif isinstance(event, DoneEvent):
            assert event.key in opened and event.key not in closed
            closed.append(event.key)
    assert sorted(opened) == sorted(closed) and opened
    assert not program.notes


def test_tpu_async_collective_fusions_are_windows(modules):
    """XLA TPU's async collective fusions (start / compute carrying it / done) are windows
    around compute; the FSDP gathers of both layers are among them."""
    program = flatten(modules[("fsdp_block", "tpu")])
    starts = {e.key: i for i, e in enumerate(program.events) if isinstance(e, StartEvent)}
    spans = [i - starts[e.key] for i, e in enumerate(program.events) if isinstance(e, DoneEvent)]
    fused = [e.info for e in program.events if isinstance(e, StartEvent)
             and e.info.form == "async collective fusion"]
    assert fused and all(info.op == "all_gather" for info in fused)
    assert max(spans) > 1                                   # compute inside some window


def test_cpu_windows_start_after_their_operands(modules):
    """A CPU-compiled collective is sync; costed approximately it opens right after its
    operands are made and closes before its first user."""
    program = flatten(modules[("fsdp_block", "cpu")], approximate=True)
    done_at = {}
    for i, event in enumerate(program.events):
        if isinstance(event, DoneEvent):
            done_at[event.key] = i
    windows = [(i, e) for i, e in enumerate(program.events) if isinstance(e, StartEvent)]
    assert windows and all(e.info.form == "window (approximate)" for _, e in windows)
    assert any(done_at[e.key] - i > 1 for i, e in windows)
    assert any(e.info.op == "reduce_scatter" for _, e in windows)   # all-reduce then a slice


def test_entry_order_is_kept(modules):
    module = modules[("matmul", "tpu")]
    program = flatten(module)
    ops = [e.instr.name for e in program.events if isinstance(e, OpEvent)]
    order = [i.name for i in module.entry_computation.instructions]
    assert ops == sorted(ops, key=order.index)

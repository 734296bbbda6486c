"""A gather libtpu 0.0.50 offloads to the SparseCore (tests/data/hlo/embed_gather, compiled for
v5p 2x2x1 by ``tools/hlo_snippets.py --sparsecore``): its call-start / call-update / call-done
pair is a window on a lane of its own, costed from the bytes its gather moves at the chip's HBM
bandwidth (or XLA's estimate where the call has one), the compute stream waiting at done; an op
the bound from bytes does not cover is refused by name."""

from __future__ import annotations

import re

import pytest

from pod.config.sharding import device_chip_spec
from pod.config.slices import resolve_pod
from pod.errors import HloOpError
from pod.hlo import cost_module, parse_hlo
from pod.hlo.report import summary
from pod.hlo.step import DMA_HBM, SPARSECORE

from .conftest import snippet_text

V5P8 = resolve_pod(slice_name="v5p-8")  # v5p 2x2x1: the 4 devices the module was compiled for
#: What each device gathers (tools/hlo_snippets.py): 4,096 tokens of a (32768, 2048) bf16 table.
TOKENS, WIDTH, BF16, S32 = 4096, 2048, 2, 4


@pytest.fixture(scope="module")
def text() -> str:
    return snippet_text("embed_gather", "tpu")


def _line(text: str, pattern: str) -> str:
    (found,) = [line for line in text.splitlines() if re.search(pattern, line)]
    return found


def _move_after(text: str, moved: str, anchor: str) -> str:
    """The module with the line matching ``moved`` printed (scheduled) right after the line
    matching ``anchor``: the schedule is the printed order."""
    line = _line(text, moved)
    lines = [x for x in text.splitlines() if x != line]
    at = lines.index(_line(text, anchor)) + 1
    return "\n".join(lines[:at] + [line] + lines[at:])


def _offload(step):
    (row,) = [r for r in step.collectives if r.op == "sparsecore"]
    return row


def test_the_module_offloads_a_gather_to_the_sparsecore(text):
    module = parse_hlo(text)
    threads = {c.execution_thread for c in module.computations.values()}
    assert threads == {"main", "sparsecore"}
    start = module.entry_computation.by_name["gather_offload_async_start"]
    assert start.opcode == "call-start"
    assert start.attrs["async_execution_thread"].strip('"') == "sparsecore"
    gathers = [i for c in module.computations.values() if c.execution_thread == "sparsecore"
               for i in c.instructions if i.opcode == "gather"]
    assert [g.shape.nbytes for g in gathers] == [TOKENS * WIDTH * BF16]


def test_the_offload_costs_its_gather_bytes_at_the_hbm_bandwidth(text):
    step = cost_module(parse_hlo(text), V5P8)
    row = _offload(step)
    # the gather reads the rows it gathers and its indices, and writes the rows
    nbytes = 2 * TOKENS * WIDTH * BF16 + TOKENS * S32
    bandwidth = device_chip_spec(V5P8.chip).core.achieved_hbm_bandwidth_bytes_per_s
    assert row.lane == SPARSECORE and row.form == "sparsecore offload"
    assert row.algorithm == "sparsecore (HBM bytes)"
    assert row.nbytes == nbytes
    assert row.seconds == pytest.approx(nbytes / bandwidth, rel=1e-12)
    assert step.stats.axis_collective_seconds[SPARSECORE] == pytest.approx(row.seconds,
                                                                            rel=1e-12)
    lane = summary(step)["collectives_by_lane"][SPARSECORE]
    assert lane["costed_as"] == "sparsecore (HBM bytes)" and lane["bytes_per_step"] == nbytes
    # the matmul is not on the SparseCore: the compute stream's FLOPs are its 2 * M * K * N
    assert step.flops_per_device == pytest.approx(2 * TOKENS * WIDTH * WIDTH, rel=1e-12)


def test_the_compute_stream_waits_for_the_offload_at_done(text):
    done, bitcast = r"%gather_offload_async_done = ", r"%bitcast\.8 = "
    update = r"%gather_offload_async_start\.update = "
    # done right after the operands are given: nothing runs beside the offload
    adjacent = _move_after(text, done, update)
    # the matmul scheduled between update and done (the walk follows the printed order): the
    # offload runs beside it
    hidden = _move_after(_move_after(text, r"%convert_reduce_fusion = ", update), done,
                         r"%convert_reduce_fusion = ")
    hidden = _move_after(hidden, bitcast, done)
    # each op from an idle start (no sustained MXU budget over the step, which would stretch
    # the shorter step's matmul): the two steps differ by their windows alone
    serial = cost_module(parse_hlo(adjacent), V5P8, sustained=False)
    overlapped = cost_module(parse_hlo(hidden), V5P8, sustained=False)
    offload = _offload(serial).seconds
    assert offload > 0
    assert serial.stats.axis_exposed_seconds[SPARSECORE] == pytest.approx(offload, rel=1e-9)
    assert overlapped.stats.axis_exposed_seconds.get(SPARSECORE, 0.0) == 0.0
    # same work in both: the step differs by the offload it hides (and the index copy's DMA,
    # now waited for after the matmul too)
    assert overlapped.stats.compute_seconds == pytest.approx(serial.stats.compute_seconds,
                                                             rel=1e-12)
    dma = serial.stats.axis_exposed_seconds.get(DMA_HBM, 0.0) - \
        overlapped.stats.axis_exposed_seconds.get(DMA_HBM, 0.0)
    assert 0 <= dma < 1e-3 * offload
    assert serial.step_seconds - overlapped.step_seconds == pytest.approx(offload + dma,
                                                                          rel=1e-9)
    # as compiled, only the small index fusions run beside it: the rest is exposed
    compiled = cost_module(parse_hlo(text), V5P8)
    exposed = compiled.stats.axis_exposed_seconds[SPARSECORE]
    assert 0 < exposed < offload


def test_an_op_the_bound_does_not_cover_is_refused_by_name(text):
    transpose = _line(text, r"%transpose\.8 = ")
    sorted_ = text.replace(transpose, transpose.replace(" transpose(", " sort(", 1))
    with pytest.raises(HloOpError, match=r"sort .*transpose\.8.* SparseCore"):
        cost_module(parse_hlo(sorted_), V5P8)


def test_xla_estimated_cycles_on_the_call_are_preferred(text):
    start = _line(text, r"%gather_offload_async_start = ")
    transpose = _line(text, r"%transpose\.8 = ")
    cycles = 123_456
    estimated = text.replace(start, start.replace(
        'backend_config={', f'backend_config={{"estimated_cycles":"{cycles}",', 1)).replace(
        transpose, transpose.replace(" transpose(", " sort(", 1))
    row = _offload(cost_module(parse_hlo(estimated), V5P8))
    assert row.algorithm == "sparsecore (XLA estimate)"
    clock_hz = device_chip_spec(V5P8.chip).core.clock_hz
    assert row.seconds == pytest.approx(cycles / clock_hz, rel=1e-12)


def test_xla_no_estimate_sentinel_is_no_estimate(text):
    module = parse_hlo(text)
    (fusion,) = [i for c in module.computations.values() for i in c.instructions
                 if i.name.startswith("gather_offload_custom_fusion")
                 and i.opcode == "fusion"]
    assert '"estimated_cycles":"9223372036854775807"' in fusion.attrs["backend_config"]
    assert fusion.estimated_cycles is None

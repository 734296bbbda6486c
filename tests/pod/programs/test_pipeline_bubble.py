"""The pipeline bubble as the clock sees it: the closed forms of GPipe, 1F1B and the
circular schedule with stages of equal cost and free transfers, run through the real
tick loop (``run_ticks``) on a LocalMesh and the real clock. No Ray.

References: [GPipe] Huang et al. 2019, bubble (S - 1) / (M + S - 1); [1F1B] Narayanan
et al. 2021, the same bubble with at most S microbatches in flight; [MaxText] circular
pipeline, (S - 1) / (R M + S - 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from pod.programs import LocalMesh, bubble_fraction, build_schedule, run_ticks
from pod.report.clock import BUBBLE, DeviceReport, StepContext, combine_device_reports

F_SECONDS, B_SECONDS, UPDATE_SECONDS = 1e-3, 2e-3, 1e-4


@dataclass(frozen=True)
class Record:
    name: str
    seconds: float


@dataclass
class FakeCore:
    """Just what the tick loop asks of a core: its records, and it executes."""

    records: list = field(default_factory=list)
    execute: bool = True


class EqualStages:
    """A stage whose every op costs F (forward) or B (backward) over R repeats."""

    def __init__(self, core: FakeCore, repeats: int):
        self.core, self.repeats = core, repeats

    def buffer_elements(self, phase):
        return 4

    def forward(self, op, x):
        self.core.records.append(Record(f"fwd {op}", F_SECONDS / self.repeats))
        return np.full(4, op.microbatch, np.float32)

    def backward(self, op, dy):
        self.core.records.append(Record(f"bwd {op}", B_SECONDS / self.repeats))
        return np.full(4, op.microbatch, np.float32)


class FreeCosts:
    """Collectives that take no time."""

    def seconds(self, axis, op, nbytes):
        return 0.0

    def link_bytes(self, calls):
        return {}


def _step(schedule, costs=None, update_seconds=UPDATE_SECONDS):
    """The stats of one step of equal stages under ``schedule``, and the device reports."""
    stages, costs = schedule.stages, costs or FreeCosts()

    def device(comm):
        core = FakeCore()
        run_ticks(schedule, comm.axis_index("stage"), comm, core,
                  EqualStages(core, schedule.repeats), tag="pipeline", itemsize=2)
        update = len(core.records)
        core.records.append(Record("update", update_seconds))
        return DeviceReport(device=comm.device, loss=0.0,
                            record_seconds=tuple(r.seconds for r in core.records),
                            record_bounds=("mxu",) * len(core.records), update_start=update,
                            calls=tuple(comm.calls), mxu_flops=0,
                            stage_group=tuple(range(stages)))

    reports = LocalMesh({"stage": stages}).run(device)
    context = StepContext(global_batch=1, model_flops=1, device_peak_flops_per_s=1.0,
                          devices=stages, devices_per_chip=1, host_to_chip_bytes_per_s=1e30)
    return combine_device_reports(0, reports, costs, context, infeed_bytes=0,
                                  wall_seconds=0.0), reports


@pytest.mark.parametrize("stages, microbatches", [(2, 1), (2, 4), (4, 4), (4, 8), (8, 3)])
def test_gpipe_bubble_is_its_closed_form(stages, microbatches):
    stats, _ = _step(build_schedule("gpipe", stages, microbatches))
    f_b = F_SECONDS + B_SECONDS
    assert stats.pipeline_bubble_seconds == pytest.approx((stages - 1) * f_b, rel=1e-12)
    assert stats.compute_seconds == pytest.approx(microbatches * f_b, rel=1e-12)
    assert stats.pipeline_bubble_fraction == pytest.approx(
        bubble_fraction(stages, microbatches), rel=1e-12)
    assert stats.pipeline_bubble_fraction == pytest.approx(
        (stages - 1) / (microbatches + stages - 1), rel=1e-12)
    assert stats.step_seconds == pytest.approx((microbatches + stages - 1) * f_b
                                               + UPDATE_SECONDS, rel=1e-12)
    assert stats.exposed_collective_seconds == pytest.approx(0.0, abs=1e-15)


@pytest.mark.parametrize("stages, microbatches", [(2, 4), (4, 4), (4, 8), (4, 2), (8, 16)])
def test_1f1b_has_gpipes_bubble_with_fewer_microbatches_in_flight(stages, microbatches):
    schedule = build_schedule("1f1b", stages, microbatches)
    stats, _ = _step(schedule)
    assert stats.pipeline_bubble_fraction == pytest.approx(
        bubble_fraction(stages, microbatches), rel=1e-12)
    assert [schedule.in_flight(s) for s in range(stages)] == [
        min(stages - s, microbatches) for s in range(stages)]
    gpipe = build_schedule("gpipe", stages, microbatches)
    assert [gpipe.in_flight(s) for s in range(stages)] == [microbatches] * stages


@pytest.mark.parametrize("stages, microbatches, repeats", [(2, 2, 2), (2, 4, 3), (4, 4, 2),
                                                           (4, 8, 4)])
def test_the_circular_bubble_shrinks_with_the_repeats(stages, microbatches, repeats):
    stats, _ = _step(build_schedule("circular", stages, microbatches, repeats))
    want = (stages - 1) / (repeats * microbatches + stages - 1)
    assert stats.pipeline_bubble_fraction == pytest.approx(want, rel=1e-12)
    assert stats.compute_seconds == pytest.approx(microbatches * (F_SECONDS + B_SECONDS),
                                                  rel=1e-12)


def test_the_bubble_is_named_on_the_compute_lane_and_transfers_are_exposed_stage_time():
    """With a cost per permute, a stage's wait splits into the bubble (the other stage
    still busy) and the transfer (exposed ``stage`` time); GPipe on 2 stages with one
    microbatch: stage 0 waits F + B (bubble) plus two transfers."""

    class Costs(FreeCosts):
        def seconds(self, axis, op, nbytes):
            return 1e-4 if op == "ppermute" else 0.0

    stats, _ = _step(build_schedule("gpipe", 2, 1), costs=Costs())
    assert stats.pipeline_bubble_seconds == pytest.approx(F_SECONDS + B_SECONDS + 1e-4)
    assert stats.axis_exposed_seconds["stage"] == pytest.approx(1e-4)
    assert {axis for _, _, axis in stats.compute_waits} == {BUBBLE, "stage"}
    assert stats.step_seconds == pytest.approx(2 * (F_SECONDS + B_SECONDS) + 2e-4
                                               + UPDATE_SECONDS)


def test_a_permute_nobody_uses_is_waited_for_nowhere():
    _, reports = _step(build_schedule("1f1b", 4, 8))
    for r in reports:
        waits = [c.wait_record for c in r.calls if c.op == "ppermute"]
        used = [w for w in waits if w is not None]
        assert 0 < len(used) < len(waits)
        # a piece is used where the op that needs it starts, after it arrived
        assert all(w >= c.after_record for c in r.calls if (w := c.wait_record) is not None)

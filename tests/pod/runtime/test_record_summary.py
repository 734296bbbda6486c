"""``pod.runtime.device.RecordSummary``: a step's record tuples reused only when the core
handed out the very records of the step before."""

from __future__ import annotations

import dataclasses

import numpy as np

from chip import TensorCore
from chip.spec import V2
from pod.report.stats import op_bound
from pod.runtime.device import RecordSummary, record_bound


def _step(core, n=16):
    a = np.arange(n * n, dtype=np.float32).reshape(n, n) / 7
    core.matmul(a, a, name="dense/fwd")
    core.vector("relu", np.maximum, a, 0.0)
    core.vector("scale", np.multiply, a, np.float32(0.5))
    return core.take_records()


def _walked(records):
    """The summary by a plain walk over the records (the reference)."""
    return (tuple(float(r.seconds) for r in records), tuple(record_bound(r) for r in records),
            int(sum(r.flops for r in records if r.unit == "mxu")))


def test_the_same_records_give_the_same_tuples_and_other_records_their_own():
    core = TensorCore(V2.core)
    summary = RecordSummary()
    first = _step(core)
    got = summary.of(first)
    assert got == _walked(first) and got[2] == 2 * 16 ** 3
    assert got[1][0] == op_bound(first[0])
    second = _step(core)
    assert all(a is b for a, b in zip(first, second, strict=True))  # the core's cached records
    assert summary.of(second) is got  # the tuples of the step before, not walked again
    # a straggler's stretched copies: equal names, other seconds, summarised afresh
    slow = [dataclasses.replace(r, seconds=r.seconds * 2) for r in second]
    assert summary.of(slow) == _walked(slow) != got
    # fewer records, more records, none
    assert summary.of(second[:2]) == _walked(second[:2])
    bigger = _step(core, 32)
    assert summary.of(second + bigger) == _walked(second + bigger)
    assert summary.of([]) == ((), (), 0)
    assert summary.of(second) == got

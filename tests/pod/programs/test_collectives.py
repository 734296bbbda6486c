"""The timing-only collectives (``ShapeCollectives``) and the checks every implementation
shares (``CollectivesBase``); LocalMesh's sums and ring order are tested with the
transformer program (test_transformer.py)."""

from __future__ import annotations

import numpy as np
import pytest

from pod.programs import CollectiveCall, LocalMesh, ShapeCollectives


def test_shape_collectives_record_every_call_and_return_zero_views_of_the_right_size():
    comm = ShapeCollectives({"data": 2, "fsdp": 4, "tensor": 1}, {"data": 1, "fsdp": 3})
    assert [comm.axis_index(a) for a in ("data", "fsdp", "tensor")] == [1, 3, 0]
    x = np.zeros(8, np.float32)
    gathered = comm.all_gather("fsdp", x, tag="g", kind="param_gather", after_record=0)
    scattered = comm.reduce_scatter("fsdp", x, tag="r", kind="grad_reduce", after_record=2)
    summed = comm.allreduce("data", x, tag="a", kind="grad_reduce", after_record=2)
    assert [v.shape for v in (gathered, scattered, summed)] == [(32,), (2,), (8,)]
    for v in (gathered, scattered, summed):
        assert v.dtype == np.float32 and not v.flags.writeable and not np.any(v)
        assert v.strides == (0,)                                       # no memory behind it
    assert comm.calls == [CollectiveCall("fsdp", "all_gather", 32, "g", "param_gather", 0),
                          CollectiveCall("fsdp", "reduce_scatter", 32, "r", "grad_reduce", 2),
                          CollectiveCall("data", "allreduce", 32, "a", "grad_reduce", 2)]
    # an axis of size 1 is free: the input back, nothing recorded
    assert comm.allreduce("tensor", x, tag="t", kind="activation", after_record=2) is x
    assert len(comm.take_calls()) == 3 and comm.calls == []


@pytest.mark.parametrize("call, message", [
    (lambda c: c.allreduce("data", np.zeros(4), tag="t", kind="activation", after_record=0),
     "needs a 1-D float32 buffer, got float64"),
    (lambda c: c.allreduce("data", np.zeros((2, 2), np.float32), tag="t", kind="activation",
                           after_record=0), r"got float32 \(2, 2\)"),
    (lambda c: c.reduce_scatter("data", np.zeros(3, np.float32), tag="t", kind="grad_reduce",
                                after_record=0), "3 elements do not split into 2 equal chunks"),
    (lambda c: c.allreduce("data", np.zeros(2, np.float32), tag="t", kind="weights",
                           after_record=0), "collective kind 'weights' is unknown"),
    (lambda c: c.allreduce("pipe", np.zeros(2, np.float32), tag="t", kind="activation",
                           after_record=0), "mesh axis 'pipe' is unknown"),
])
def test_every_implementation_refuses_the_same_bad_calls(call, message):
    for comm in (ShapeCollectives({"data": 2}, {"data": 0}), LocalMesh({"data": 2}).devices[0]):
        with pytest.raises(ValueError, match=message):
            call(comm)
        assert comm.calls == []


def test_bad_meshes_are_refused():
    with pytest.raises(ValueError, match=r"index 2 is not in \[0, 2\)"):
        ShapeCollectives({"data": 2}, {"data": 2})
    with pytest.raises(ValueError, match="must be a permutation of range"):
        LocalMesh({"fsdp": 3}, rings={"fsdp": (0, 1, 1)})

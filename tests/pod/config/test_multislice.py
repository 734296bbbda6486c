"""Multislice (issue 24, item 1): slices joined by the data-centre network (DCN).

- the mesh: MaxText's hybrid mesh (``create_hybrid_device_mesh``): every axis's DCN part
  outermost, slice ``s`` holding the devices whose DCN indices number ``s``, the in-slice
  part laid on each slice's torus as one slice's mesh;
- the cost of a collective over an axis that spans slices, against its closed form:
  a reduce-scatter inside the slice, the ring allreduce of the shard across the K slices
  at the per-chip DCN bandwidth of tpu-specs.md ([SB]: 3.1e9 B/s per chip on v5e, 6.25e9
  on v5p: a host's network interfaces shared by its chips) plus one DCN latency per ring
  step (2e-5 s, an assumption: no published figure), an all-gather inside the slice;
- the clock overlaps the cross-slice gradient reduction with the backward pass, as it
  does every gradient reduction (XLA's async all-reduce); with ``training.overlap:
  false`` it is exposed whole.

No Ray: plans and timing-only steps.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest

from interconnect.calibration import SLICE_STEP_JITTER
from pod.config.plan import build_plan
from pod.config.scenario import load_scenario, parse_scenario
from pod.runtime.timing import TimingPod

ROOT = Path(__file__).resolve().parents[3]
V5E_DCN_BYTES_PER_S = 3.1e9    # tpu-specs.md [SB], per chip across slices
V5P_DCN_BYTES_PER_S = 6.25e9
DCN_LATENCY_S = 2e-5           # chip.spec.DCN_LATENCY_S (an assumption, VALIDATION.md)
TINY = {"embed_dim": 32, "heads": 4, "head_dim": 8, "mlp_dim": 64, "layers": 2}
TEXT = {"name": "synthetic_text",
        "options": {"vocabulary": 64, "sequence_length": 16, "num_examples": 64}}


def scenario(pod: dict, batch: int = 16, **training) -> object:
    """A tiny transformer on ``pod`` (a ``pod:`` block)."""
    return parse_scenario({
        "name": "multislice", "pod": pod,
        "model": {"name": "transformer", "options": TINY}, "data": TEXT,
        "training": {"global_batch": batch, "steps": 2,
                     "optimizer": {"name": "adamw", "learning_rate": 0.01}, **training},
        "metrics": {"port": 0}})


def dcn_ring_seconds(op: str, k: int, nbytes: float, bytes_per_s: float,
                     senders: int = 1) -> float:
    """The ring closed form across K slices (tpu-specs.md): each device sends (K-1)/K
    of its buffer per round (2 rounds for an allreduce) through its chip's share of the
    host's network interfaces, one DCN latency per ring step."""
    rounds = 2 if op == "allreduce" else 1
    return (senders * rounds * (k - 1) / k * nbytes / bytes_per_s
            + rounds * (k - 1) * DCN_LATENCY_S)


# ------------------------------------------------------------------ the mesh

@pytest.mark.parametrize("ici, dcn, slices", [
    ({"fsdp": 2, "tensor": 2}, {"data": 2}, 2),
    ({"data": 2, "fsdp": 2}, {"fsdp": 2}, 2),
    ({"fsdp": 4}, {"data": 2, "fsdp": 2}, 4),
    ({"tensor": 4}, {"data": 3}, 3),
])
def test_the_mesh_is_maxtexts_hybrid_mesh(ici, dcn, slices):
    """Index ``(d_a * ici_a + i_a)`` along every axis ``a`` is device ``slice(d) x slice
    devices + one slice's device(i)``, slice(d) the DCN indices row-major; an axis
    without a DCN factor stays inside each slice, an axis with one has the same
    in-slice position in every slice it crosses."""
    plan = build_plan(scenario({"slice": "v5e-4", "slices": slices, "dcn_mesh": dcn,
                                "mesh": ici}, batch=48), timing_only=True)
    mesh, one = plan.mesh, plan.mesh.in_slice
    assert mesh.slices == slices and mesh.size == slices * one.size == plan.topology.chips
    assert mesh.dcn_sizes == {a: n for a, n in dcn.items() if n > 1}
    outer = [dcn.get(a, 1) for a in mesh.axis_names]
    inner = [one.axis_size(a) for a in mesh.axis_names]
    assert [o * i for o, i in zip(outer, inner)] == list(mesh.shape)
    slice_of = np.arange(slices).reshape(outer)
    for index in itertools.product(*map(range, mesh.shape)):
        d = [x // i for x, i in zip(index, inner)]
        i = [x % n for x, n in zip(index, inner)]
        local = tuple(x for a, x in zip(mesh.axis_names, i) if a in one.axis_names)
        want = slice_of[tuple(d)] * one.size + one.devices[local]
        assert mesh.devices[index] == want
    for axis in mesh.axis_names:
        for group in mesh.groups(axis, "mesh"):
            spans = {device // one.size for device in group}
            assert len(spans) == mesh.dcn_size(axis)
            positions = {device % one.size for device in group}
            assert len(positions) == one.axis_size(axis)


def test_the_device_count_and_the_dcn_mesh_are_checked():
    from pod.errors import ScenarioError

    with pytest.raises(ScenarioError, match=r"dcn_mesh: \{data: 3\} must multiply to "
                                            r"pod.slices 2"):
        scenario({"slice": "v5e-4", "slices": 2, "dcn_mesh": {"data": 3}})
    plan = build_plan(scenario({"slice": "v5e-4", "slices": 2, "dcn_mesh": {"data": -1}}),
                      timing_only=True)
    assert plan.mesh.sizes == {"data": 8} and plan.mesh.dcn_sizes == {"data": 2}


# ------------------------------------------------------------------ the hierarchical cost

@pytest.mark.parametrize("slices", [2, 4])
@pytest.mark.parametrize("op", ["allreduce", "reduce_scatter", "all_gather"])
def test_a_collective_across_slices_is_in_slice_then_dcn_then_in_slice(slices, op):
    """``{data: 2, fsdp: 4}`` in each v5e-8 slice, data also across K slices: a data
    allreduce of B bytes is the in-slice reduce-scatter of B (one slice's own plan), the
    ring allreduce of the B / 2 shard across K slices at 3.1e9 B/s per chip, the
    in-slice all-gather of B / 2; a reduce-scatter the first two; an all-gather of a
    piece P the DCN all-gather of K P, then the in-slice one of K P."""
    nbytes = 3 * 2**20
    multi = build_plan(scenario({"slice": "v5e-8", "slices": slices, "mesh": {"data": 2, "fsdp": 4},
                                 "dcn_mesh": {"data": slices}}, batch=16 * slices),
                       timing_only=True).collective_costs
    one = build_plan(scenario({"slice": "v5e-8", "mesh": {"data": 2, "fsdp": 4}}),
                     timing_only=True).collective_costs
    ici = lambda o, b: one.seconds("data", o, b)  # noqa: E731 - the slice's own cost
    if op == "allreduce":
        dcn = dcn_ring_seconds("allreduce", slices, nbytes / 2, V5E_DCN_BYTES_PER_S)
        want = ici("reduce_scatter", nbytes) + dcn + ici("all_gather", nbytes // 2)
    elif op == "reduce_scatter":
        dcn = dcn_ring_seconds("reduce_scatter", slices, nbytes / 2, V5E_DCN_BYTES_PER_S)
        want = ici("reduce_scatter", nbytes) + dcn
    else:
        dcn = dcn_ring_seconds("all_gather", slices, slices * nbytes, V5E_DCN_BYTES_PER_S)
        want = dcn + ici("all_gather", slices * nbytes)
    assert multi.seconds("data", op, nbytes) == pytest.approx(want, rel=1e-12)
    assert multi.dcn_seconds("data", op, nbytes) == pytest.approx(dcn, rel=1e-12)
    assert multi.dcn_seconds("fsdp", op, nbytes) == 0.0        # inside the slice
    assert multi.seconds("fsdp", op, nbytes) == one.seconds("fsdp", op, nbytes)


def test_m2s_gradient_allreduce_is_the_dcn_ring_at_v5ps_per_chip_bandwidth():
    """M2 (2 x v5p-128, fsdp 16 x tensor 4 in each slice, data 2 across): the data axis
    has no in-slice part, so a gradient allreduce is the DCN ring alone: a 2-slice ring
    sends each device's whole buffer (2 x 1/2) at 6.25e9 B/s, two messages."""
    plan = build_plan(load_scenario(ROOT / "scenarios/maxtext-m2-32b-2x-v5p-128.yaml"),
                      timing_only=True)
    assert plan.mesh.dcn_sizes == {"data": 2} and plan.mesh.in_slice.axis_size("data") == 1
    costs = plan.collective_costs
    for nbytes in (2**20, 123_456_789):
        want = nbytes / V5P_DCN_BYTES_PER_S + 2 * DCN_LATENCY_S
        assert costs.seconds("data", "allreduce", nbytes) == pytest.approx(want, rel=1e-12)
        assert costs.dcn_bytes("data", "allreduce", nbytes) == pytest.approx(nbytes)
        assert not costs.cost("data", "allreduce", nbytes).link_bytes  # no ICI link used


def test_on_v3_both_tensorcores_of_a_chip_share_its_dcn_bandwidth():
    """2 x v3-8 (a device per TensorCore), data 8 in each slice and 2 across: the DCN
    ring of each device's 1/8 shard, both devices of a chip sending through the chip's
    share of the host's interfaces (twice the seconds of one sender)."""
    plan = build_plan(parse_scenario({
        "name": "v3-multislice", "pod": {"slice": "v3-8", "slices": 2},
        "model": {"name": "mlp", "options": {"hidden": [16]}}, "data": {"name": "digits"},
        "training": {"global_batch": 64, "steps": 1, "optimizer": {"name": "sgd"}},
        "metrics": {"port": 0}}), timing_only=True)
    costs = plan.collective_costs
    assert plan.mesh.devices_per_chip == 2 and plan.mesh.sizes == {"data": 16}
    nbytes = 8 * 2**20
    want = dcn_ring_seconds("allreduce", 2, nbytes / 8, V5E_DCN_BYTES_PER_S, senders=2)
    assert costs.dcn_seconds("data", "allreduce", nbytes) == pytest.approx(want, rel=1e-12)
    assert plan.topology.chip.dcn_bytes_per_s == V5E_DCN_BYTES_PER_S  # v3: v5e's figure assumed


# ------------------------------------------------------------------ overlap on the clock

def m1(**training):
    """M1 (training-steps.md): T3's 16B on 2 x v5e-256, fsdp 256 in each slice, data 2
    across, global batch 3,072 (6 per device)."""
    base = load_scenario(ROOT / "scenarios/maxtext-m1-16b-2x-v5e-256.yaml")
    overrides = {f"training__{k}": v for k, v in training.items()}
    return build_plan(base.with_overrides(**overrides) if overrides else base, timing_only=True)


def test_the_cross_slice_gradient_reduction_runs_behind_the_backward_pass():
    """On M1 every data-axis collective is a gradient reduction (one DCN allreduce of
    the device's fsdp shard per layer, 4 bytes per parameter: 16.2B / 256 x 4 = 258 MB,
    83 ms at 3.1e9 B/s); the clock starts each when the backward pass produced it, so
    they run during the backward pass and none is waited for: M1's step is T3's
    (the same slice's step) to within the DCN's last message, plus the wait for the
    slower of the two slices (``interconnect.dcn.slice_wait_seconds``: jitter x step x
    0.564, charged to the data axis, where the slices meet), while the serial sum grows
    by the whole DCN time. Without overlap (``training.overlap: false``: one bucket after
    the backward pass) the DCN time is exposed whole."""
    plan = m1()
    stats = TimingPod(plan).step(0)
    t3 = TimingPod(build_plan(load_scenario(ROOT / "scenarios/maxtext-t3-16b-v5e-256.yaml"),
                              timing_only=True)).step(0)
    data = [s for s in stats.collective_spans if s.axis == "data"]
    assert data and {s.kind for s in data} == {"grad_reduce"} and {s.op for s in data} == {"allreduce"}
    dcn = stats.axis_dcn_seconds["data"]
    shard_bytes = plan.num_params / 256 * 4
    assert sum(s.nbytes for s in data) == pytest.approx(shard_bytes, rel=0.01)
    want = sum(dcn_ring_seconds("allreduce", 2, s.nbytes, V5E_DCN_BYTES_PER_S) for s in data)
    assert dcn == pytest.approx(want, rel=1e-12)
    assert 0.082 < dcn < 0.084
    assert stats.axis_collective_seconds["data"] == pytest.approx(dcn, rel=1e-12)
    assert stats.axis_dcn_bytes["data"] == sum(s.nbytes for s in data)
    backward_end = stats.compute_seconds        # forward + backward, from the step's start
    after = sum(max(0.0, s.end - max(s.start, backward_end)) for s in data)
    assert after < 0.1 * dcn                    # the last layer's (block1, embed) at most
    wait = SLICE_STEP_JITTER / math.sqrt(math.pi) * t3.step_seconds  # E[max of 2] = 1/sqrt(pi)
    assert stats.axis_exposed_seconds.get("data", 0.0) - wait < 1e-3 * dcn
    assert stats.step_seconds == pytest.approx(t3.step_seconds + wait,
                                               abs=2 * DCN_LATENCY_S + 1e-6)
    assert stats.serial_step_seconds == pytest.approx(t3.serial_step_seconds + dcn, rel=1e-9)
    serial = TimingPod(m1(overlap=False)).step(0)
    # without overlap the gradients are one bucket after the backward pass (as any
    # model's: training.overlap_bucket_bytes has no say), so one DCN allreduce of the
    # whole shard: one latency term where the layers' buckets had one each
    (whole,) = [s for s in serial.collective_spans if s.axis == "data"]
    assert whole.nbytes == sum(s.nbytes for s in data)
    serial_dcn = serial.axis_dcn_seconds["data"]
    assert serial_dcn == pytest.approx(
        dcn_ring_seconds("allreduce", 2, whole.nbytes, V5E_DCN_BYTES_PER_S), rel=1e-12)
    # the same bytes: what differs is the latency of the other buckets' two messages each
    assert dcn - serial_dcn == pytest.approx((len(data) - 1) * 2 * DCN_LATENCY_S, rel=1e-6)
    # one slice's serial step is the sum of its parts, the DCN whole among them; the job's
    # adds the wait for the slower slice on top (a share of the one slice's step)
    one_slice = serial.step_seconds / (1 + SLICE_STEP_JITTER / math.sqrt(math.pi))
    assert serial.axis_exposed_seconds["data"] == pytest.approx(
        serial_dcn + serial.step_seconds - one_slice, rel=1e-6)

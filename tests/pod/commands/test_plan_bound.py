"""The lower bound ``tpu-pod plan`` prunes with (``plan_bound``, ``Planner.point``): a
pipeline's fill and drain in closed form, and never above the costed step (a property
over a few hundred points of every layout kind, pipelines among them)."""

from __future__ import annotations

import math

import pytest
from pod.commands.plan import Planner
from pod.commands.plan_bound import pipeline_bound
from pod.commands.plan_search import candidates, remat_policies
from pod.commands.plan_source import model_source
from pod.programs.pipeline_schedule import build_schedule

from .test_plan_fast import AXES, tiny  # noqa: F401 (the fixture)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,microbatches", [(2, 2), (4, 4), (4, 8), (8, 8)])
def test_the_pipeline_bound_is_the_closed_form_of_equal_stages(name, stages, microbatches):
    """Equal chunks of n blocks, a block's forward F and backward B: the longest path of
    the ops is GPipe's (M + S - 1)(F + B) for n blocks (bubble_fraction's closed form:
    the bubble (S - 1)(F + B)); with the last stage's passes P run, fill + P + drain
    is (S - 1) n F + P + (S - 1) n B; from the first stage, P."""
    n, f, b = 3, 0.25, 0.5
    schedule = build_schedule(name, stages, microbatches)
    ops = (microbatches + stages - 1) * n * (f + b)
    passes = microbatches * n * (f + b) + 1.0  # the output layer's too
    chain = (stages - 1) * n * (f + b) + passes
    assert math.isclose(pipeline_bound(schedule, stages - 1, [n] * stages, f, b, passes),
                        max(ops, chain))
    assert math.isclose(pipeline_bound(schedule, stages - 1, [n] * stages, f, b, 0.0), ops)
    assert math.isclose(pipeline_bound(schedule, 0, [n] * stages, f, b, 100.0), 100.0)


def test_the_circular_schedule_goes_round_the_ring():
    """R repeats: a microbatch's forward visits each stage R times, so the last stage's
    first op waits for S R - 1 chunks; the bubble shrinks R-fold (bubble_fraction)."""
    s, m, r, f, b = 2, 4, 2, 1.0, 2.0
    schedule = build_schedule("circular", s, m, r)
    ops = (r * m + s - 1) * (f + b)  # one block per chunk
    assert math.isclose(pipeline_bound(schedule, s - 1, [1] * (s * r), f, b, 0.0), ops)


def _bounds_against_steps(tiny, slice_name, devices, remats, batches):
    planner = Planner(model_source(tiny, slice_name=slice_name))
    points = candidates([(slice_name, devices)], AXES, remats, per_device_batches=batches)
    out = []
    for c in points:
        row, seconds = planner.point(c, mode="bound")
        if row["status"] != "pruned":
            continue
        step = Planner(planner.source).cost_alone(c)["simulated_step_seconds"]
        out.append((c, seconds, step))
    return out


@pytest.mark.slow
def test_the_bound_is_at_most_the_step_in_pipelines(tiny):
    """Every point of 4 devices (pipelines of 2 and 4 stages among them): its bound, run
    alone, at most its step costed alone."""
    pairs = _bounds_against_steps(tiny, "v5e-4", 4, ("full",), (4,))
    assert sum(c.mesh.get("stage", 1) > 1 for c, _, _ in pairs) >= 4
    assert all(0 < bound <= step for _, bound, step in pairs)


@pytest.mark.slow
def test_the_bound_is_at_most_the_step_over_hundreds_of_points(tiny):
    """Every mesh of 16 devices over four axes, every remat policy, two batches (420
    points; those that plan): bound <= step, each."""
    pairs = _bounds_against_steps(tiny, "v5e-16", 16, remat_policies(), (2, 4))
    assert len(pairs) > 150 and sum(c.mesh.get("stage", 1) > 1 for c, _, _ in pairs) > 50
    bad = [(c.label, bound, step) for c, bound, step in pairs if not 0 < bound <= step]
    assert not bad


def test_the_bound_of_a_point_does_not_depend_on_the_points_before(tiny):
    """A planner that ran a 2-stage pipeline of the same local model first gives a
    4-stage point the bound a fresh planner gives it (the pool's workers see the points
    in any order: the same points must be pruned)."""
    source = model_source(tiny, slice_name="v5e-4")
    two, four = (c for c in candidates([("v5e-4", 4)], AXES, ("full",), per_device_batches=(4,))
                 if c.mesh in ({"stage": 2, "fsdp": 2}, {"stage": 4}))
    warm = Planner(source)
    warm.point(two, mode="bound")
    assert warm.point(four, mode="bound")[1] == Planner(source).point(four, mode="bound")[1]


def test_blocks_the_signature_cannot_describe_give_no_pipeline_bound(monkeypatch):
    """``Planner._chunk_blocks``: blocks ``replay.signature`` cannot describe are not known
    to be alike (None: the bound falls back to the passes); any other error is raised."""
    import types

    import pod.commands.plan as plan
    from pod.programs.replay import UnsignableError
    from pod.workloads.block import TransformerBlock

    blocks = [object.__new__(TransformerBlock) for _ in range(4)]
    program = types.SimpleNamespace(local_model=types.SimpleNamespace(layers=blocks),
                                    chunks=[[0, 1], [2, 3]])

    def unsignable(value):
        raise UnsignableError("Thing")

    monkeypatch.setattr(plan, "signature", unsignable)
    assert Planner._chunk_blocks(types.SimpleNamespace(_blocks={}), program) is None
    monkeypatch.setattr(plan, "signature", lambda value: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        Planner._chunk_blocks(types.SimpleNamespace(_blocks={}), program)
    monkeypatch.setattr(plan, "signature", lambda value: "alike")
    assert Planner._chunk_blocks(types.SimpleNamespace(_blocks={}), program) == (
        [2, 2], frozenset(range(4)))

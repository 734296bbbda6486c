"""``tpu-pod plan`` at speed (issue 32, item 1): the fast path (a mesh's collective costs
shared, the layers' passes replayed from a ``LayerTape``, points pruned by a bound of
their step, a process pool) gives the figures of costing each point alone, bit for bit,
and the outputs of costing every point."""

from __future__ import annotations

import dataclasses
import math

import pytest
import yaml

from pod.commands.plan import PLOTTED, Planner, PlanRequest, run_plan
from pod.commands.plan_cost import Scoring, class_key, cost_points
from pod.commands.plan_report import family_lines
from pod.commands.plan_search import (DEFAULT_REMATS, candidates, compared_batch, family,
                                     remat_policies)
from pod.commands.plan_source import model_source
from pod.workloads.remat import remat_effect, twin_policies

# the API's current names only (slice=, per_device_batch=: no DeprecationWarning)
pytestmark = pytest.mark.filterwarnings("error:.*= is deprecated; use .*=:DeprecationWarning")

#: Four alike blocks (three replayed from the first), a vocabulary and sequence big enough
#: that the layouts differ.
TINY = {
    "name": "tiny4",
    "pod": {"slice": "v5e-8"},
    "model": {"name": "transformer",
              "options": {"embed_dim": 64, "heads": 4, "head_dim": 16, "mlp_dim": 128,
                          "layers": 4, "remat": "none"}},
    "data": {"name": "synthetic_text", "test_fraction": 0.25,
             "options": {"vocabulary": 256, "sequence_length": 64, "num_examples": 16}},
    "training": {"global_batch": 8, "steps": 1, "optimizer": {"name": "adamw"}},
    "metrics": {"port": 0},
}
AXES = ("data", "stage", "fsdp", "tensor")


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny4.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return str(path)


def _same(a: dict, b: dict) -> bool:
    """Rows equal in every column but the wall seconds (NaN equal to NaN)."""
    drop = lambda r: {k: v for k, v in r.items() if k != "wall_seconds"}  # noqa: E731
    return repr(drop(a)) == repr(drop(b))


def _alone_and_fast(tiny, slice_name, devices, remats, batches):
    planner = Planner(model_source(tiny, slice_name=slice_name))
    points = candidates([(slice_name, devices)], AXES, remats, per_device_batches=batches)
    fast = [planner.cost(c) for c in points]
    alone = [Planner(planner.source).cost_alone(c) for c in points]
    return points, fast, alone, planner


def test_the_fast_path_costs_points_as_costing_each_alone(tiny):
    """Every mesh of 4 devices over data, stage, fsdp and tensor, two remat policies, two
    batches (40 points): the same row, every figure, as a fresh plan and an op-by-op
    step of each point."""
    points, fast, alone, planner = _alone_and_fast(tiny, "v5e-4", 4, ("none", "full"), (1, 2))
    assert len(points) == 40
    assert sum(r["status"] == "ok" for r in fast) > 20
    assert all(_same(a, b) for a, b in zip(fast, alone, strict=True))
    assert planner.tape.hits > planner.tape.misses  # the tape did replay


def test_the_later_and_offloading_policies_cost_as_each_alone(tiny):
    """MaxText's four policies outside the default search (the context kept, out_proj
    alone, q / k / v and minimal's tensors in host memory): the same rows as costing each
    point alone, host transfers included."""
    later = ("save_dot_with_context_except_mlp", "save_out_proj", "qkv_proj_offloaded",
             "minimal_offloaded")
    assert not set(later) & set(DEFAULT_REMATS) and set(later) <= set(remat_policies())
    points, fast, alone, _ = _alone_and_fast(tiny, "v5e-4", 4, later, (1,))
    assert len(points) == 40 and sum(r["status"] == "ok" for r in fast) > 20
    assert all(_same(a, b) for a, b in zip(fast, alone, strict=True))


def test_a_twin_policys_step_is_taken_as_costing_it_alone(tiny):
    """save_dot_except_mlp and save_dot_except_mlpwi keep the same tensors (mlpwo is read by
    no backward pass): the fast path takes one's step from the other's, and every row
    (the policy's name included) is that of costing the point alone."""
    assert remat_effect("save_dot_except_mlp") == remat_effect("save_dot_except_mlpwi")
    assert remat_effect("save_dot_except_mlp") != remat_effect("save_qkv_proj")
    assert twin_policies() == set(("save_dot_except_mlp", "save_dot_except_mlpwi"))
    twins = ("save_dot_except_mlp", "save_dot_except_mlpwi")
    points, fast, alone, planner = _alone_and_fast(tiny, "v5e-4", 4, twins, (1,))
    ok = sum(r["status"] == "ok" for r in fast)
    assert ok > 10 and planner.twin_steps == ok // 2
    assert all(_same(a, b) for a, b in zip(fast, alone, strict=True))
    assert {r["remat"] for r in fast if r["status"] == "ok"} == set(twins)


def test_a_custom_policy_is_searched_beside_the_named_ones_as_costing_it_alone(tmp_path):
    """A model whose policy is custom (a published run's, as T5's and T6's) is searched
    under it by default beside the named policies, and MaxText's per-tensor keys on the
    command line make the same choices; each point's row is that of costing it alone, a
    named point without the custom choices (its tensors are its own): the layer input
    offloaded keeps less in HBM than full remat, which keeps it on the device."""
    from pod.commands.plan import _remats
    from pod.commands.plan_source import search_keys

    custom = {"decoder_layer_input": "offload", "query_proj": "offload"}
    data = {**TINY, "model": {"name": "transformer",
                              "options": {**TINY["model"]["options"], "remat": "custom",
                                          "remat_custom": custom}}}
    path = tmp_path / "custom.yaml"
    path.write_text(yaml.safe_dump(data))
    planner = Planner(model_source(str(path), slice_name="v5e-4"))
    assert planner.remat_custom == custom
    assert _remats(planner, ()) == (*DEFAULT_REMATS, "custom")
    plain = tmp_path / "plain.yaml"  # TINY: remat none, no choices of its own
    plain.write_text(yaml.safe_dump(TINY))
    assert Planner(model_source(str(plain), slice_name="v5e-4")).remat_custom is None
    keys = [f"{k}={v}" for k, v in custom.items()]
    _, rest = search_keys(str(plain), (), keys)
    from_keys = Planner(model_source(str(plain), slice_name="v5e-4", overrides=rest))
    assert from_keys.remat_custom == custom
    assert _remats(from_keys, ()) == (*DEFAULT_REMATS, "custom")
    points = candidates([("v5e-4", 4)], AXES, ("full", "custom"), per_device_batches=(1,))
    fast = [planner.cost(c) for c in points]
    alone = [Planner(planner.source).cost_alone(c) for c in points]
    assert all(_same(a, b) for a, b in zip(fast, alone, strict=True))
    rows = {(r["mesh"], r["remat"]): r for r in fast if r["status"] == "ok"}
    meshes = {mesh for mesh, remat in rows if remat == "custom"}
    assert len(meshes) > 3 and all((mesh, "full") in rows for mesh in meshes)
    assert all(rows[m, "custom"]["hbm_per_device_bytes"] < rows[m, "full"]["hbm_per_device_bytes"]
               for m in meshes)


@pytest.mark.slow
def test_a_few_hundred_points_cost_as_each_alone(tiny):
    """420 points (every mesh of 16 devices over four axes, the default remat policies,
    two batches): the fast path's rows are those of costing each point alone."""
    points, fast, alone, _ = _alone_and_fast(tiny, "v5e-16", 16, DEFAULT_REMATS, (1, 2))
    assert len(points) == 420 and sum(r["status"] == "ok" for r in fast) > 150
    assert all(_same(a, b) for a, b in zip(fast, alone, strict=True))


def _scored(tiny, keep, exhaustive, workers=1, devices=4):
    """cost_points over every mesh of a v5e slice's ``devices``, two remat policies, two
    batches."""
    planner = Planner(model_source(tiny, slice_name=f"v5e-{devices}"))
    points = candidates([(f"v5e-{devices}", devices)], AXES, ("none", "full"),
                        per_device_batches=(1, 2))
    rows = cost_points(planner, points, scoring=Scoring(planner.sequence_length, None),
                       keep=keep, family_of=lambda r: family(r, AXES),
                       compared_batch=lambda rows: compared_batch(rows, AXES),
                       exhaustive=exhaustive, workers=workers, round_points=4)
    return points, rows


def _rate(row: dict) -> float:
    return row["simulated_tokens_per_second"]


@pytest.mark.parametrize("devices", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_pruning_keeps_what_the_outputs_show(tiny, devices):
    """With 3 kept: the 3 best, and each family's best at the best's global batch, are
    the exhaustive search's, row for row; every pruned point plans, and is slower than
    the 3rd best in the exhaustive search."""
    points, pruned = _scored(tiny, keep=3, exhaustive=False, devices=devices)
    _, every = _scored(tiny, keep=3, exhaustive=True, devices=devices)
    ok = sorted((r for r in every if r["status"] == "ok"), key=_rate, reverse=True)
    kept = sorted((r for r in pruned if r["status"] == "ok"), key=_rate, reverse=True)
    assert sum(r["status"] == "pruned" for r in pruned) >= 3  # pruning happened
    assert all(_same(a, b) for a, b in zip(kept[:3], ok[:3], strict=True))
    third = _rate(ok[2])
    for mine, full in zip(pruned, every, strict=True):
        if mine["status"] == "pruned":
            assert full["status"] == "ok" and _rate(full) < third
            assert mine["fits"] is True and mine["reason"].startswith("not costed: its forward")
        else:
            assert _same(mine, full)
    batch = compared_batch(every, AXES)
    assert batch == compared_batch(pruned, AXES)
    for name in {family(r, AXES) for r in ok if r["global_batch"] == batch}:
        best = [max((r for r in rows if r["status"] == "ok" and r["global_batch"] == batch
                     and family(r, AXES) == name), key=_rate) for rows in (pruned, every)]
        assert _same(*best)


def test_the_bound_is_at_most_the_step_and_one_per_class(tiny):
    """A point's passes' seconds (``Planner.point``) never exceed its simulated step, and
    the points of a class (the same but for data and fsdp) have the same."""
    planner = Planner(model_source(tiny, slice_name="v5e-4"))
    points = candidates([("v5e-4", 4)], AXES, ("none", "full"), per_device_batches=(1, 2))
    by_class: dict = {}
    for c in points:
        row, seconds = planner.point(c)
        if row["status"] != "ok":
            continue
        assert 0 < seconds <= row["simulated_step_seconds"]  # (a pipeline's slowest stage
        # is not always the one with the most compute: no order with compute_seconds)
        by_class.setdefault(class_key(c), set()).add(seconds)
    assert by_class and all(len(s) == 1 for s in by_class.values())
    assert any(len([c for c in points if class_key(c) == k]) > 1 for k in by_class)


def test_a_pool_gives_the_rows_of_one_process(tiny):
    """The same points pruned and the same rows, whatever the processes."""
    _, one = _scored(tiny, keep=3, exhaustive=False, workers=1)
    _, pool = _scored(tiny, keep=3, exhaustive=False, workers=2)
    assert all(_same(a, b) for a, b in zip(one, pool, strict=True))


def test_what_runs_beside_a_pool_runs_in_this_process_and_changes_no_row(tiny):
    """``cost_points(beside=...)``: with workers, run once in a thread of this process
    (while they cost) and joined before the rows return, its error dropped; without
    workers not run; the rows the same either way."""
    import os
    import threading

    calls: list[tuple[int, bool]] = []

    def beside() -> None:
        calls.append((os.getpid(), threading.current_thread() is threading.main_thread()))
        raise RuntimeError("dropped")

    def rows(workers: int, run=None):
        planner = Planner(model_source(tiny, slice_name="v5e-4"))
        points = candidates([("v5e-4", 4)], ("data", "fsdp"), ("full",), per_device_batches=(1,))
        return cost_points(planner, points, scoring=Scoring(planner.sequence_length, None),
                           keep=3, family_of=lambda r: family(r, AXES),
                           compared_batch=lambda rows: compared_batch(rows, AXES),
                           workers=workers, round_points=4, beside=run)

    alone = rows(1, beside)
    assert calls == []
    pool = rows(2, beside)
    assert calls == [(os.getpid(), False)]
    assert all(_same(a, b) for a, b in zip(alone, pool, strict=True))


@pytest.mark.slow  # matplotlib's import: a second or more
def test_the_plots_warm_up_writes_nothing(tmp_path, monkeypatch):
    """``figures.warm_up`` (run beside a plan's workers) draws in memory only."""
    from pod.report.figures import warm_up

    monkeypatch.chdir(tmp_path)
    warm_up()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_the_plan_shows_what_an_exhaustive_plan_shows(tiny, tmp_path):
    """run_plan's table rows (PLOTTED of them), best.yaml and family lines with pruning
    equal --exhaustive's; the summary says how many were pruned and why."""
    request = PlanRequest(model=tiny, slices=("v5e-8",), mesh_axes=AXES,
                          per_device_batches=(1, 2, 4), workers=1)
    pruned = run_plan(request, output_dir=tmp_path / "a")
    every = run_plan(dataclasses.replace(request, exhaustive=True), output_dir=tmp_path / "b")
    assert pruned.count("pruned") > 0 and every.count("pruned") == 0
    assert all(_same(a, b) for a, b in zip(pruned.ranked[:PLOTTED], every.ranked[:PLOTTED],
                                           strict=True))
    assert family_lines(pruned) == family_lines(every)
    assert yaml.safe_load((tmp_path / "a" / "best.yaml").read_text()) == yaml.safe_load(
        (tmp_path / "b" / "best.yaml").read_text())
    assert f"pruned (slower than the {PLOTTED} best by their compute alone)" in pruned.summary()
    assert not math.isnan(pruned.rows[-1]["point"])


def test_a_classs_bound_is_its_first_point_that_plans_in_one_round(tiny):
    """"first" tasks (``plan_cost._execute``): each class's points in search order up to
    its first that plans, run as ``Planner.point`` in bound mode runs each alone; the
    class's later points are left (None)."""
    from pod.commands.plan_cost import _execute

    source = model_source(tiny, slice_name="v5e-4")
    points = candidates([("v5e-4", 4)], AXES, ("full",), per_device_batches=(1, 4))
    got = dict(_execute(Planner(source), enumerate((c, "first") for c in points)))
    by_class: dict = {}
    for i, c in enumerate(points):
        by_class.setdefault(class_key(c), []).append((c, got[i]))
    alone = Planner(source)
    dropped_first = 0
    for members in by_class.values():
        ran = [(c, r) for c, r in members if r is not None]
        assert [c for c, _ in ran] == [c for c, _ in members[:len(ran)]]  # a prefix
        statuses = [r[0]["status"] for _, r in ran]
        assert all(s in ("dropped", "failed") for s in statuses[:-1])
        assert statuses[-1] == "pruned" or len(ran) == len(members)
        dropped_first += statuses[0] != "pruned"
        for c, (row, seconds) in ran:
            ref_row, ref_seconds = alone.point(c, mode="bound")
            assert _same(row, ref_row) and seconds == ref_seconds
    assert dropped_first and any(r is None for r in got.values())

"""``tpu-pod plan --num-slices``: points over K identical slices joined by the DCN, data
parallel across them (``pod.slices: K``, ``pod.dcn_mesh: {data: K}``, MaxText's
``num_slices`` with ``dcn_data_parallelism``).

References: a 2-slice point's figures equal a timing-only sweep of best.yaml (computed
in the same test, not pinned); the batch splits over every slice's devices (by hand);
a plan without the option prints what it printed before (no slices, no dcn column);
two slices of a compute-bound model give more than one slice's tokens/s and less than
twice (the DCN's gradient reduction is not free).
"""

from __future__ import annotations

import csv
import re

import pytest
import yaml

from pod.commands.plan import PLAN_COLUMNS, PlanRequest, run_plan
from pod.commands.plan_search import candidates
from pod.commands.sweep import run_sweep
from pod.config.scenario import load_scenario
from pod.errors import ScenarioError

from .test_plan import TINY, _cli

pytestmark = [pytest.mark.usefixtures("one_blas_thread"), pytest.mark.filterwarnings(
    "error:.*= is deprecated; use .*=:DeprecationWarning")]  # the API's current names only


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return str(path)


def test_the_batch_splits_over_every_slices_devices():
    fixed = candidates([("v5e-8", 8)], ("fsdp",), ("",), global_batch=32, num_slices=(1, 2, 4))
    assert [(c.slices, c.per_device_batch) for c in fixed] == [(1, 4), (2, 2), (4, 1)]
    assert [c.dcn_mesh for c in fixed] == [None, {"data": 2}, {"data": 4}]
    assert fixed[1].label == "2 x v5e-8 {fsdp: 8} none b=2"
    odd = candidates([("v5e-8", 8)], ("fsdp",), ("",), global_batch=8, num_slices=(2,))
    assert odd[0].per_device_batch is None  # 8 sequences over 16 devices
    grown = candidates([("v5e-8", 8)], ("data", "tensor"), ("",), per_device_batches=(2,),
                       num_slices=(1, 2))
    assert [(c.slices, c.mesh, c.global_batch) for c in grown] == [
        (1, {"tensor": 8}, 2), (1, {"data": 2, "tensor": 4}, 4), (1, {"data": 4, "tensor": 2}, 8),
        (1, {"data": 8}, 16), (2, {"tensor": 8}, 4), (2, {"data": 2, "tensor": 4}, 8),
        (2, {"data": 4, "tensor": 2}, 16), (2, {"data": 8}, 32)]
    # the default: one slice, the points of before
    assert candidates([("v5e-8", 8)], ("fsdp",), ("",), global_batch=32) == fixed[:1]


def test_a_two_slice_point_equals_a_timing_sweep_of_its_best_yaml(tiny, tmp_path):
    """best.yaml of a 2-slice winner carries pod.slices and pod.dcn_mesh; `tpu-pod sweep
    best.yaml` (its own plan, data and costs) gives the plan's figures."""
    result = run_plan(PlanRequest(model=tiny, slices=("v5e-8",), num_slices=(2,),
                                  remat=("none",), per_device_batches=(2,),
                                  mesh_axes=("fsdp", "tensor")), output_dir=tmp_path / "plan")
    best = result.ranked[0]
    assert best["slices"] == 2 and best["dcn_mesh"] == "{data: 2}"
    assert best["chips"] == best["devices"] == 16 and best["data"] == 2
    scenario = yaml.safe_load((tmp_path / "plan" / "best.yaml").read_text())
    assert scenario["pod"]["slices"] == 2 and scenario["pod"]["dcn_mesh"] == {"data": 2}
    assert scenario["pod"]["mesh"] == yaml.safe_load(best["mesh"])
    rows = run_sweep(load_scenario(tmp_path / "plan" / "best.yaml"), tmp_path / "sweep")
    assert [r["status"] for r in rows] == ["ok"]
    swept = rows[0]
    assert swept["slices"] == 2 and swept["chips"] == 16
    assert best["simulated_step_seconds"] == pytest.approx(swept["simulated_step_seconds"],
                                                           rel=1e-12)
    assert best["simulated_tokens_per_second"] == pytest.approx(
        swept["simulated_tokens_per_second"], rel=1e-12)
    assert best["dcn_collective_seconds"] == pytest.approx(swept["dcn_collective_seconds"],
                                                           rel=1e-12)
    assert best["dcn_collective_seconds"] > 0


def test_a_fixed_batch_splits_over_the_slices_or_the_point_is_dropped(tiny):
    result = run_plan(PlanRequest(model=tiny, slices=("v5e-8",), num_slices=(1, 2),
                                  remat=("none",), global_batch=8, mesh_axes=("fsdp",)))
    by_slices = {r["slices"]: r for r in result.rows}
    assert by_slices[1]["status"] == "ok" and by_slices[1]["per_device_batch"] == 1
    dropped = by_slices[2]
    assert dropped["status"] == "dropped" and dropped["global_batch"] == 8
    assert "8" in dropped["reason"] and "16" in dropped["reason"], dropped["reason"]


def test_two_slices_give_more_than_one_and_less_than_twice_the_tokens_per_second():
    """maxtext-2023-s1 on v5e-8, 2 sequences per device: the global batch doubles with the
    slices, compute per device stays, the gradients' reduction across the DCN costs."""
    result = run_plan(PlanRequest(model="maxtext-2023-s1", slices=("v5e-8",),
                                  num_slices=(1, 2), remat=("full",), per_device_batches=(2,),
                                  mesh_axes=("fsdp", "tensor")))
    best = {k: max(r["simulated_tokens_per_second"] for r in result.ranked if r["slices"] == k)
            for k in (1, 2)}
    assert best[1] < best[2] < 2 * best[1]


def _table(out: str) -> str:
    """The printed plan without its wall figures."""
    return re.sub(r"[0-9.]+ s wall \([0-9.]+ points/s\)", "", out)


def test_a_plan_without_the_option_prints_what_it_did_before(tiny, tmp_path):
    args = (tiny, "--slice", "v5e-8", "--remat", "none", "--per-device-batch", "1,2",
            "--output-dir", str(tmp_path / "o"))
    code, default, err = _cli(*args)
    assert code == 0, err
    code, one, err = _cli(*args, "--num-slices", "1")
    assert code == 0, err
    assert _table(one) == _table(default)
    head = next(line for line in default.splitlines() if line.lstrip().startswith("#"))
    assert head.split()[:3] == ["#", "mesh", "remat"] and "dcn" not in head.split()
    assert "slices" not in default and "DCN" not in default and "} x {" not in default


def test_the_table_and_results_csv_show_the_slices(tiny, tmp_path):
    out_dir = tmp_path / "o"
    code, out, err = _cli(tiny, "--slice", "v5e-8", "--remat", "none", "--per-device-batch",
                          "2", "--mesh-axes", "fsdp", "--num-slices", "1", "--num-slices",
                          "2,4", "--output-dir", str(out_dir))
    assert code == 0, err
    assert "tiny on v5e-8 x 1, 2, 4 slices (data parallel across them, over the DCN)" in out
    head = next(line for line in out.splitlines() if line.lstrip().startswith("#"))
    assert head.split()[:3] == ["#", "slices", "mesh"] and "dcn" in head.split()
    assert "{data: 2} x {fsdp: 8}" in out and "{data: 4} x {fsdp: 8}" in out
    with open(out_dir / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == PLAN_COLUMNS
    assert sorted((r["slices"], r["dcn_mesh"], r["chips"]) for r in rows) == [
        ("1", "", "8"), ("2", "{data: 2}", "16"), ("4", "{data: 4}", "32")]
    assert all(r["mesh"] == "{fsdp: 8}" for r in rows)
    dcn = {r["slices"]: float(r["dcn_collective_seconds"]) for r in rows}
    assert dcn["1"] == 0 < dcn["2"] < dcn["4"]


@pytest.mark.parametrize("value", ["0", "x", "1,0", "-2", "1.5", "257"])
def test_a_bad_number_of_slices_is_one_line_exit_2(tiny, value):
    code, out, err = _cli(tiny, "--slice", "v5e-8", "--num-slices", value)
    assert code == 2, err
    assert err.startswith("error: --num-slices: ") and "is not a whole number of slices from " \
        "1 to 256; give e.g. 1,2,4" in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_the_python_api_takes_the_number_of_slices(tiny):
    import pod

    rows = pod.plan(tiny, slice="v5e-8", remat="none", per_device_batch=1,
                    mesh_axes="fsdp", num_slices=2)
    assert [(r["slices"], r["dcn_mesh"], r["global_batch"]) for r in rows] == [
        (2, "{data: 2}", 16)]
    with pytest.raises(ScenarioError, match="^--num-slices: 0 is not a whole number of slices from 1"):
        pod.plan(tiny, slice="v5e-8", num_slices=0)


def test_maxtext_slice_keys_set_the_slices_searched(tiny):
    """MaxText's num_slices (or dcn_data_parallelism) is taken as --num-slices is (issue 33,
    item 5: it was refused, one round trip at a time)."""
    for key in ("num_slices=2", "dcn_data_parallelism=2"):
        result = run_plan(PlanRequest(model=tiny, slices=("v5e-8",), remat=("none",),
                                      per_device_batches=(1,), mesh_axes=("fsdp",),
                                      overrides=(key,)))
        assert result.num_slices == (2,) and {r["slices"] for r in result.rows} == {2}
    with pytest.raises(ScenarioError, match=r"^num_slices=2 and --num-slices set the same; "
                                            r"give one$"):
        run_plan(PlanRequest(model=tiny, slices=("v5e-8",), num_slices=(1,),
                             overrides=("num_slices=2",)))

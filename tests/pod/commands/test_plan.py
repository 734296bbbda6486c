"""``tpu-pod plan`` (issue 25, item 3): the search space, drops, ranking, the best point
against a timing-only step of its own scenario, one-line errors, and a small plan end to end."""

from __future__ import annotations

import contextlib
import csv
import io
import itertools
import json
import math

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from pod.commands.plan import PLAN_COLUMNS, Planner, PlanRequest, run_plan
from pod.commands.plan_search import (
    DEFAULT_REMATS,
    SEARCH_AXES,
    factorisation_count,
    meshes,
    ordered_factorisations,
    remat_policies,
    runtime_axes,
)
from pod.commands.plan_source import model_source, parse_count
from pod.config.mesh import AXIS_NAMES, build_mesh
from pod.config.plan import build_plan
from tests.pod.commands.test_import_maxtext import BASE_2023
from pod.config.scenario import load_scenario, parse_scenario
from pod.config.slices import resolve_pod
from pod.errors import HBMPlanError, ScenarioError
from pod.runtime.timing import TimingPod
from pod.workloads.block import REMAT_POLICIES

# the API's current names only (slice=, per_device_batch=: no DeprecationWarning)
pytestmark = pytest.mark.filterwarnings("error:.*= is deprecated; use .*=:DeprecationWarning")

#: A two-layer transformer on random tokens: a point costs a few milliseconds.
TINY = {
    "name": "tiny",
    "pod": {"slice": "v5e-8"},
    "model": {"name": "transformer",
              "options": {"embed_dim": 64, "heads": 4, "head_dim": 16, "mlp_dim": 128,
                          "layers": 2, "remat": "none"}},
    "data": {"name": "synthetic_text", "test_fraction": 0.25,
             "options": {"vocabulary": 256, "sequence_length": 64, "num_examples": 16}},
    "training": {"global_batch": 8, "steps": 1, "optimizer": {"name": "adamw"}},
    "metrics": {"port": 0},
}


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return str(path)


def _brute_force(n: int, k: int) -> set[tuple[int, ...]]:
    """Every k-tuple of divisors of n whose product is n (by brute force)."""
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return {t for t in itertools.product(divisors, repeat=k) if math.prod(t) == n}


# ------------------------------------------------------------------ the search space


@pytest.mark.parametrize("n, k, count", [(1, 3, 1), (8, 3, 10), (256, 3, 45), (12, 2, 6),
                                         (96, 3, 63), (8960, 3, 405), (256, 5, 495)])
def test_meshes_are_the_ordered_factorisations_each_once(n, k, count):
    """Closed form: n = prod p^e has prod C(e + k - 1, k - 1) ordered factorisations into k
    factors: 256 = 2^8 over data, fsdp, tensor: C(10, 2) = 45; 96 = 2^5 3: C(7, 2) 3 = 63;
    the 8,960 chips of v5p-17920 = 2^8 5 7: 45 x 3 x 3 = 405; every axis of 256: C(12, 4)."""
    axes = AXIS_NAMES[:k]
    found = ordered_factorisations(n, k)
    assert len(found) == len(set(found)) == factorisation_count(n, k) == count
    assert set(found) == _brute_force(n, k) if n <= 256 else all(math.prod(t) == n for t in found)
    listed = meshes(n, axes)
    assert len(listed) == count
    assert len({tuple(sorted(m.items())) for m in listed}) == count
    assert all(math.prod(m.values()) == n for m in listed)


@given(st.integers(1, 720), st.integers(1, 4))
@settings(max_examples=80, deadline=None)
def test_factorisation_count_is_the_number_listed(n, k):
    found = ordered_factorisations(n, k)
    assert len(found) == factorisation_count(n, k)
    assert set(found) == _brute_force(n, k)


@pytest.mark.parametrize("slice_name", ["v5e-8", "v4-32", "v2-8"])
def test_every_mesh_of_a_slice_lays_out(slice_name):
    """Every mesh the search lists is a mesh of the slice's devices (a TensorCore each on v2)."""
    pod = resolve_pod(slice_name=slice_name)
    devices = pod.chips * (2 if pod.chip.name == "v2" else 1)
    for mesh in meshes(devices, ("data", "fsdp", "tensor")):
        assert build_mesh(mesh, pod).sizes == mesh


def test_the_search_table_has_one_entry_per_mesh_axis_and_probes_the_runtime():
    """A new axis is one SEARCH_AXES entry; today's runtime runs data, fsdp and tensor (the
    transformer program refuses stage and expert), and the transformer's remat policies
    come from its code."""
    from pod.workloads.block import REMAT_POLICIES

    assert tuple(a.name for a in SEARCH_AXES) == AXIS_NAMES
    assert {"data", "fsdp", "tensor"} <= set(runtime_axes())
    assert set(remat_policies()) <= set(REMAT_POLICIES) and "full" in remat_policies()


@pytest.mark.parametrize("text, value", [("4194304", 4194304), ("4,194,304", 4194304),
                                         ("4Mi", 4 << 20), ("4M", 4_000_000), ("1e12", 10**12),
                                         ("2T", 2 * 10**12), (1024, 1024)])
def test_counts_read_as_people_write_them(text, value):
    assert parse_count(text, "--tokens-per-step") == value


@pytest.mark.parametrize("text", ["0", "-4", "4.5", "four", "4Q", ""])
def test_a_count_that_is_not_a_whole_number_is_one_line(text):
    with pytest.raises(ScenarioError, match=r"^--token-budget: .* is not a positive whole"):
        parse_count(text, "--token-budget")


# ------------------------------------------------------------------ drops and ranking


def test_a_point_that_does_not_fit_is_dropped_with_the_hbm_plans_line():
    """LLaMA-2 7B without remat, 8 sequences of 4,096 per device, FSDP over a v5e-8: the
    row's reason is build_plan's HBMPlanError line for that very scenario."""
    request = PlanRequest(model="llama2-7b", slices=("v5e-8",), seq_len=4096, remat=("none",),
                          mesh_axes=("fsdp",), per_device_batches=(8,))
    (row,) = run_plan(request).rows
    assert row["status"] == "dropped" and row["fits"] is False
    source = model_source("llama2-7b", slice_name="v5e-8", seq_len=4096)
    planner = Planner(source)
    from pod.commands.plan_search import candidates

    (point,) = candidates([("v5e-8", 8)], ("fsdp",), ("none",), per_device_batches=(8,))
    with pytest.raises(HBMPlanError) as err:
        build_plan(parse_scenario(planner.scenario_mapping(point), source="x"),
                   timing_only=True)
    assert row["reason"] == str(err.value)
    assert row["reason"].startswith("pod.mesh: {fsdp: 8} needs ")
    assert "does not fit 15.8 GiB" in row["reason"]  # XLA makes 15.75 GiB of a v5e available
    assert row["hbm_per_device_bytes"] == err.value.memory_plan["total"]
    assert math.isnan(row["mfu"]) and math.isnan(row["simulated_step_seconds"])


def test_points_rank_by_tokens_per_second_then_the_dropped_ones(tiny):
    result = run_plan(PlanRequest(model=tiny, slices=("v5e-8",), remat=("none", "full"),
                                  per_device_batches=(1, 4), mesh_axes=("data", "fsdp", "tensor")))
    ok = result.ranked
    assert [r["rank"] for r in ok] == list(range(1, len(ok) + 1))
    rates = [r["simulated_tokens_per_second"] for r in ok]
    assert rates == sorted(rates, reverse=True)
    for r in ok:  # tokens/s is the global batch's tokens over the simulated step
        assert r["simulated_tokens_per_second"] == pytest.approx(
            r["global_batch"] * 64 / r["simulated_step_seconds"], rel=1e-12)
    rest = result.rows[len(ok):]
    assert rest and all(r["status"] == "dropped" and r["reason"] for r in rest)
    assert all("tensor 8 does not divide" in r["reason"] for r in rest)  # 4 heads
    assert len(result.rows) == 10 * 2 * 2  # meshes of 8 devices x remat x batches


def test_a_token_budget_ranks_by_the_time_to_train_on_it(tiny):
    budget = 10**9
    result = run_plan(PlanRequest(model=tiny, slices=("v5e-8",), remat=("none",),
                                  per_device_batches=(1, 2), token_budget="1G"))
    times = [r["simulated_seconds_to_budget"] for r in result.ranked]
    assert times == sorted(times)
    for r in result.ranked:
        steps = math.ceil(budget / r["tokens_per_step"])
        assert r["simulated_seconds_to_budget"] == pytest.approx(
            steps * r["simulated_step_seconds"], rel=1e-12)


@pytest.mark.slow  # several seconds: the slow tier (make test stays under 3 minutes)
def test_the_best_point_equals_a_timing_pod_step_of_its_scenario(tiny, tmp_path):
    """The plan shares the data and each mesh's collective costs between points; the best
    point's figures equal a fresh plan of best.yaml (loaded from disk, its own data and
    costs) costed by a TimingPod step: the caches are exact."""
    result = run_plan(PlanRequest(model=tiny, slices=("v5e-8",), per_device_batches=(1, 2)),
                      output_dir=tmp_path / "out")
    best = result.ranked[0]
    plan = build_plan(load_scenario(tmp_path / "out" / "best.yaml"), timing_only=True)
    stats = TimingPod(plan).step(0)
    assert plan.mesh.sizes == {a: best[a] for a in plan.mesh.sizes}
    assert best["simulated_step_seconds"] == stats.step_seconds
    assert best["compute_seconds"] == stats.compute_seconds
    assert best["update_seconds"] == stats.update_seconds
    assert best["exposed_collective_seconds"] == stats.exposed_collective_seconds
    for axis in AXIS_NAMES:
        assert best[f"exposed_{axis}_seconds"] == stats.axis_exposed_seconds.get(axis, 0.0)
    assert best["mfu"] == pytest.approx(stats.mfu, rel=1e-12)
    assert best["simulated_tokens_per_second"] == pytest.approx(stats.tokens_per_second,
                                                                rel=1e-12)
    assert best["hbm_per_device_bytes"] == plan.memory["total"]


def test_the_parameter_layout_cache_is_exact():
    """``device_param_elements`` is kept per (config, fsdp, tensor): the same count as the
    program's own layout, built afresh."""
    from pod.programs.transformer import device_param_elements, param_layout
    from pod.workloads.transformer import TransformerConfig, TransformerModel

    config = TransformerConfig(vocabulary=100, sequence_length=8, embed_dim=32, heads=4,
                               mlp_dim=48, layers=2, tied_embeddings=False)
    model = TransformerModel(config)
    for fsdp, tensor in [(1, 1), (3, 1), (4, 2), (8, 4)]:
        fresh = sum(p.device_elements for p in param_layout(model, {"fsdp": fsdp,
                                                                    "tensor": tensor}))
        assert device_param_elements(model, fsdp, tensor) == fresh
        assert device_param_elements(TransformerModel(config), fsdp, tensor) == fresh


# ------------------------------------------------------------------ the command line


def _cli(*args: str) -> tuple[int, str, str]:
    from pod.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            pytest.raises(SystemExit) as code:
        main(["plan", *args])
    return code.value.code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("args, line", [
    (["lama2-7b", "--slice", "v5e-256"],
     "error: preset: unknown preset 'lama2-7b'; did you mean llama2-7b? presets: "),
    (["llama2-7b", "--slice", "v5e-300"],
     "error: --slice: slice 'v5e-300' does not exist: the number counts chips for v5e; "),
    (["llama2-7b", "--slice", "v5e-256", "--seq-len", "4096", "--tokens-per-step", "4M"],
     "error: --tokens-per-step: 4,000,000 is not a whole number of 4,096-token sequences; "
     "use a multiple of 4,096 such as 3,997,696 or 4,001,792"),
    (["llama2-7b", "--slice", "v5e-256", "--tokens-per-step", "1000"],
     "error: --tokens-per-step: 1,000 is not a whole number of 4,096-token sequences; use a "
     "multiple of 4,096 such as 4,096"),
    (["llama2-7b"], "error: --slice: give the slice to plan for"),
    (["llama2-7b", "--slice", "v5e-256", "--remat", "some"],
     "error: --remat: 'some' is not a remat policy; policies: "
     + ", ".join(p for p in REMAT_POLICIES if p != "custom") + " (or all)"),
    (["llama2-7b", "--slice", "v5e-256", "--mesh-axes", "fsdp,pipe"],
     "error: --mesh-axes: 'pipe' is not a mesh axis; axes: data, stage, fsdp, expert, tensor"),
    (["llama2-7b", "--slice", "v5e-256", "pod.mesh.fsdp=8"],
     "error: pod.mesh.fsdp=8: the plan searches pod.mesh.fsdp; use --slice, --chips, --num-slices "
     "and --mesh-axes"),
    (["llama2-7b", "--chips", "100"], "error: --chips: no "),
])
def test_user_errors_are_one_line_exit_2(args, line):
    code, out, err = _cli(*args)
    assert code == 2, err
    assert err.startswith(line), err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_a_small_plan_end_to_end_writes_every_point_and_the_plot(tiny, tmp_path):
    """A tiny transformer on a v5e-8: the table, the summary line, results.csv with every
    point (the dropped ones with their reason), layouts.png and best.yaml."""
    out_dir = tmp_path / "plan"
    code, out, err = _cli(tiny, "--slice", "v5e-8", "--remat", "none,full",
                          "--per-device-batch", "1,2", "--top", "5", "--mesh-axes",
                          "data,fsdp,tensor", "--output-dir", str(out_dir))
    assert code == 0, err
    assert "tiny on v5e-8: 64-token sequences, 1, 2 per device; meshes over data, fsdp, " \
           "tensor; remat none, full" in out
    assert "The 5 fastest of 36 costed layouts" in out
    assert "40 points: 36 costed, 4 dropped;" in out and " s wall (" in out
    with open(out_dir / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == PLAN_COLUMNS and len(rows) == 40
    assert [r["rank"] for r in rows[:36]] == [str(i) for i in range(1, 37)]
    assert all(r["status"] == "dropped" and r["reason"] and r["mfu"] == "" for r in rows[36:])
    assert (out_dir / "layouts.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    best = yaml.safe_load((out_dir / "best.yaml").read_text())
    assert best["pod"]["mesh"] == {k: v for k, v in yaml.safe_load(
        rows[0]["mesh"]).items()}


def test_json_has_every_point_with_null_for_a_missing_number(tiny, tmp_path):
    code, out, err = _cli(tiny, "--slice", "v5e-8", "--remat", "none", "--per-device-batch", "1",
                          "--mesh-axes", "fsdp,tensor", "--json", "--output-dir",
                          str(tmp_path / "o"))
    assert code == 0, err
    doc = json.loads(out)
    assert doc["points"] == len(doc["rows"]) == 4 and doc["axes"] == ["fsdp", "tensor"]
    dropped = [r for r in doc["rows"] if r["status"] == "dropped"]
    assert dropped and all(r["mfu"] is None for r in dropped)


def test_the_python_api_returns_the_rows_with_nan(tiny):
    import pod

    rows = pod.plan(tiny, slice="v5e-8", remat="none", per_device_batch=1,
                    mesh_axes=("data", "tensor"))
    assert len(rows) == 4 and rows[0]["rank"] == 1
    dropped = [r for r in rows if r["status"] == "dropped"]
    assert dropped and all(math.isnan(r["mfu"]) for r in dropped)
    assert set(rows[0]) == set(PLAN_COLUMNS)


def test_the_command_is_the_python_api_printed(tiny, tmp_path, monkeypatch):
    """tpu-pod plan asks pod.plan (the options by the API's names) and prints its result:
    the JSON's rows are the API's rows, each figure the same."""
    from pod import api

    calls = []
    real = api.plan

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "plan", spy)
    code, out, _ = _cli(tiny, "--slice", "v5e-8", "--remat", "none,full", "--per-device-batch",
                        "1", "--mesh-axes", "data", "--jobs", "1", "--json",
                        "--output-dir", str(tmp_path / "o"))
    assert code in (0, None) and len(calls) == 1
    asked = calls[0]
    assert (asked["slice"], asked["remat"], asked["per_device_batch"], asked["mesh_axes"],
            asked["jobs"]) == (("v5e-8",), ("none", "full"), ("1",), ("data",), 1)
    rows = real(tiny, slice="v5e-8", remat=("none", "full"), per_device_batch=1,
                mesh_axes="data", jobs=1, progress=False)
    assert len(rows) == 2
    printed = json.loads(out)["rows"]
    assert [(r["mesh"], r["remat"], r["per_device_batch"], r["status"]) for r in printed] == [
        (r["mesh"], r["remat"], r["per_device_batch"], r["status"]) for r in rows]
    assert [r["simulated_step_seconds"] for r in printed if r["status"] == "ok"] == [
        r["simulated_step_seconds"] for r in rows if r["status"] == "ok"]


def test_maxtext_configs_plan_with_their_keys_overridden(tmp_path):
    """MaxText's base.yml with MaxText key=value overrides (a small model) plans; MaxText's
    own layout keys set the search, as import-maxtext reads them (issue 33 item 5: they
    were refused one round trip at a time): ici_fsdp_parallelism fixes fsdp, the base
    file's ici values (MaxText's defaults) do not."""
    base = str(BASE_2023)
    small = ("base_emb_dim=256", "base_num_heads=4", "base_mlp_dim=512",
             "base_num_decoder_layers=2", "max_target_length=128", "vocab_size=512")
    rows = run_plan(PlanRequest(model=base, slices=("v5p-8",), remat=("full",),
                                per_device_batches=(1,), overrides=small,
                                mesh_axes=("data", "fsdp", "tensor"))).rows
    assert len(rows) == 6 and rows[0]["status"] == "ok" and rows[0]["sequence_length"] == 128
    result = run_plan(PlanRequest(model=base, slices=("v5p-8",), mesh_axes=("data", "fsdp"),
                                  overrides=(*small, "ici_fsdp_parallelism=2",
                                             "per_device_batch_size=2", "remat_policy=full")))
    assert {(r["data"], r["fsdp"], r["remat"], r["per_device_batch"]) for r in result.rows} == {
        (2, 2, "full", 2)}
    assert result.fixed == {"fsdp": 2}


def test_sequence_parallel_timing_steps_equal_functional_ones():
    """The timing-only reduction of the replicated gradients under sequence parallelism
    (sizes only, no index arrays) costs what the functional step does: the same tensor
    collectives, the same clock."""
    from pod.runtime.local import LocalPod

    data = {**TINY, "pod": {"slice": "v5e-4", "mesh": {"fsdp": 2, "tensor": 2}},
            "training": {**TINY["training"], "global_batch": 4, "sequence_parallel": True}}
    plan = build_plan(parse_scenario(data, source="sp"))
    with LocalPod(plan) as pod:
        functional = pod.step(0)
    timing = TimingPod(plan).step(0)
    assert timing.step_seconds == functional.step_seconds
    assert timing.axis_collective_seconds == functional.axis_collective_seconds
    assert timing.axis_collective_seconds["tensor"] > 0


def test_a_chip_count_plans_every_generations_slice_of_that_many_chips():
    from pod.commands.plan_source import plan_slices

    names = [p.slice_name for p in plan_slices((), 64)]
    assert names == ["v2-128", "v3-128", "v4-128", "v5e-64", "v5p-128", "v6e-64"]  # PRESETS order
    assert [p.slice_name for p in plan_slices(("v5e",), 16)] == ["v5e-16"]
    with pytest.raises(ScenarioError, match=r"^--slice: 'v5e-16' with --chips is a generation"):
        plan_slices(("v5e-16",), 16)


def test_a_plan_where_nothing_fits_leaves_an_earlier_plans_files_as_they_were(tiny, tmp_path):
    """Issue 34: a plan that failed (exit 2) into an earlier plan's directory deleted its
    best.yaml and layouts.png and replaced results.csv with one dropped row."""
    out = tmp_path / "o"
    run_plan(PlanRequest(model=tiny, slices=("v5e-8",), remat=("none",), per_device_batches=(1,),
                         mesh_axes=("data",)), output_dir=out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert {"layouts.png", "best.yaml", "results.csv"} <= set(before)
    result = run_plan(PlanRequest(model=tiny, slices=("v5e-8",), remat=("none",),
                                  per_device_batches=(1,), mesh_axes=("tensor",)), output_dir=out)
    assert not result.ranked  # tensor 8 does not split 4 heads
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_plan_where_nothing_runs_says_why_in_one_line(tiny, tmp_path):
    code, out, err = _cli(tiny, "--slice", "v5e-8", "--mesh-axes", "tensor", "--output-dir",
                          str(tmp_path / "o"))
    # one mesh, the default remat policies and 4 batches
    points = len(DEFAULT_REMATS) * 4
    assert code == 2 and f"{points} points: 0 costed, {points} dropped" in out
    assert err == ("error: plan: no layout of tiny runs; the first point's reason: pod.mesh: "
                   "{tensor: 8}: tensor 8 does not divide the transformer's heads 4, kv_heads 4 "
                   "and mlp_dim 128; tensor must divide all three: 1, 2, 4\n")
    # --remat all: every policy the transformer has (custom aside: it needs its choices)
    code, out, _ = _cli(tiny, "--slice", "v5e-8", "--mesh-axes", "tensor", "--remat", "all",
                        "--output-dir", str(tmp_path / "o"))
    points = len([p for p in REMAT_POLICIES if p != "custom"]) * 4
    assert code == 2 and f"{points} points: 0 costed, {points} dropped" in out
    assert "qkv_proj_offloaded, minimal_offloaded" in out


def test_a_preset_gets_sequence_parallelism_with_tensor_unless_told_otherwise():
    from pod.commands.plan_search import Candidate

    point = Candidate(1, "v5e-8", {"fsdp": 4, "tensor": 2}, "full", 8, 2)
    default = Planner(model_source("llama2-7b", slice_name="v5e-8", seq_len=512,
                                   overrides=["model.options.layers=2"]))
    assert default.scenario_mapping(point)["training"]["sequence_parallel"] is True
    told = Planner(model_source("llama2-7b", slice_name="v5e-8", seq_len=512,
                                overrides=["model.options.layers=2",
                                           "training.sequence_parallel=false"]))
    assert told.scenario_mapping(point)["training"]["sequence_parallel"] is False


def test_a_plan_never_imports_ray(tiny):
    """Every point is costed timing-only in this process (``TimingPod``)."""
    import subprocess
    import sys

    code = (f"import sys, pod; pod.plan({tiny!r}, slice='v5e-8', remat='none', "
            "per_device_batch=1, mesh_axes='data'); print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_the_best_of_each_family_lines_up_when_a_family_name_is_long():
    """A family of four axes ("data+stage+fsdp+tensor", 22 characters) used to push its
    rank and figures out of the column the others share."""
    from pod.commands.plan import PlanResult
    from pod.commands.plan_report import family_lines

    def row(rank, **sizes):
        mesh = {a: sizes.get(a, 1) for a in ("data", "stage", "fsdp", "tensor")}
        return {"rank": rank, "status": "ok", "mfu": 0.5, "simulated_tokens_per_second": 1e5,
                "slice": "v5e-256", "mesh": str({a: s for a, s in mesh.items() if s > 1}),
                "remat": "full", "per_device_batch": 4, "global_batch": 1024,
                "capacity_factor": math.nan, **mesh}

    rows = [row(1, fsdp=256), row(2, data=2, stage=2, fsdp=16, tensor=4)]
    result = PlanResult("m", rows, ("v5e-256",), ("data", "stage", "fsdp", "tensor"),
                        ("full",), 4096, 1024, (), None, 1.0, None)
    lines = family_lines(result)
    assert [line.split()[0] for line in lines] == ["fsdp", "data+stage+fsdp+tensor"]
    assert len({line.index("#") for line in lines}) == 1
    assert len({line.index("MFU") for line in lines}) == 1

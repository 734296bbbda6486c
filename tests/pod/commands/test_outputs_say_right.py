"""Outputs that say right things (issue 33 items 9, 11, 12): describe of an offloading
remat policy, the columns of results.csv and results.md for the kind of sweep, tokens/s
for language models, the MaxText TFLOP/s formula named beside its figure, best.yaml's
slice, the names of precision options, generate's --seed help."""

from __future__ import annotations

import csv
import json

import pytest
from click.testing import CliRunner

from pod.cli import cli
from pod.commands.sweep import ms_text
from pod.config.scenario import parse_scenario


def _offload_scenario() -> dict:
    return {"name": "offload", "pod": {"slice": "v5e-8", "mesh": {"fsdp": 8}},
            "model": {"name": "transformer",
                      "options": {"embed_dim": 64, "heads": 4, "head_dim": 16, "mlp_dim": 128,
                                  "layers": 2, "remat": "custom",
                                  "remat_custom": {"decoder_layer_input": "offload",
                                                   "query_proj": "offload"}}},
            "data": {"name": "synthetic_text",
                     "options": {"vocabulary": 64, "sequence_length": 32, "num_examples": 64}},
            "training": {"global_batch": 16, "steps": 2}, "metrics": {"port": 0}}


def test_describe_a_remat_policy_that_offloads(tmp_path):
    """``describe`` crashed (KeyError 'host_seconds') on any offloading remat policy, the
    shipped maxtext-t5 scenarios included: the host link's seconds are a row figure."""
    import yaml

    path = tmp_path / "offload.yaml"
    path.write_text(yaml.safe_dump(_offload_scenario()))
    parse_scenario(_offload_scenario())  # a valid scenario
    out = CliRunner().invoke(cli, ["describe", str(path)])
    assert out.exit_code == 0, out.output[-3000:]
    line = out.output[out.output.index("step (simulated, timing-only)"):].replace("\n", " ")
    # every part of the critical path named: they add up to the step
    total, parts = line.split(" ms = ")[0].split()[-1], line.split(" ms = ")[1].split(";")[0]
    assert "exposed host offload" in parts
    named = [float(word) for word in parts.split() if word.replace(".", "").isdigit()]
    assert sum(named) - sum(float(w) for w in parts.split("(")[1].split(")")[0].split()
                            if w.replace(".", "").isdigit()) == pytest.approx(float(total),
                                                                             abs=0.004)
    out = CliRunner().invoke(cli, ["describe", str(path), "--detail", "--json"])
    assert out.exit_code == 0, out.output[-3000:]
    layers = json.loads(out.stdout)["layers"]
    assert sum(row.get("host_seconds", 0.0) for row in layers.values()) > 0


def test_precision_names_are_one_scheme_with_aliases():
    """``collective --dtype f32`` but ``matmul --precision fp32``: both commands take both
    option names and the project's precision names (fp32), the old f32 still accepted."""
    runner = CliRunner()
    for args in (["collective", "--slice", "v4-8", "--sizes", "1MiB", "--dtype", "fp32"],
                 ["collective", "--slice", "v4-8", "--sizes", "1MiB", "--precision", "f32"]):
        out = runner.invoke(cli, [*args, "--json"])
        assert out.exit_code == 0, out.output
        assert json.loads(out.stdout)[0]["dtype"] == "fp32"
    for args in (["matmul", "--precision", "fp32"], ["matmul", "--dtype", "f32"]):
        out = runner.invoke(cli, [*args, "--m", "256", "--k", "256", "--n", "256", "--json"])
        assert out.exit_code == 0, out.output
        assert json.loads(out.stdout)["precision"] == "fp32"
    out = runner.invoke(cli, ["collective", "--slice", "v4-8", "--dtype", "fp8"])
    assert "dtype 'fp8' is not valid: expected one of bf16, fp32, int8" in str(out.exception)


def test_generate_seed_has_help():
    out = CliRunner().invoke(cli, ["generate", "--help"])
    assert out.exit_code == 0
    seed = out.output[out.output.index("--seed"):]
    assert "Seed of the sampling" in " ".join(seed.split()[:12])


def test_best_yaml_names_the_slice_it_was_planned_for(tmp_path, monkeypatch):
    """best.yaml said "on v5p-8" (the preset's describe slice) for a v5e plan."""
    import yaml

    import pod
    import pod.commands.plan

    monkeypatch.setattr(pod.commands.plan, "plot_layouts", lambda rows, out, title: out)

    rows = pod.plan("llama2-7b", slice="v5e-16", remat="full", mesh_axes="fsdp",
                    per_device_batch=1, seq_len=512, output_dir=tmp_path)
    assert rows[0]["status"] == "ok"
    best = yaml.safe_load((tmp_path / "best.yaml").read_text())
    assert best["pod"]["slice"] == "v5e-16"
    assert "v5e-16" in best["description"] and "v5p" not in best["description"]


def _layout_sweep(tmp_path, monkeypatch):
    import pod.commands.sweep
    from tests.pod.commands.test_sweep_rows import sweep_scenario

    monkeypatch.setattr(pod.commands.sweep, "plot", lambda *a: [])  # the tables, not the plots
    scenario = sweep_scenario().with_overrides(sweep__remat=["full"], sweep__per_device_batch=[1])
    return pod.commands.sweep.run_sweep(scenario, tmp_path)


def test_a_language_models_layout_sweep_says_tokens_and_its_columns_mean_something(
        tmp_path, monkeypatch):
    """results.csv's slice was empty for every scenario sweep; results.md had examples/s for
    an LLM, 'step ms 5897.4333', and epoch s / efficiency columns that mean nothing for a
    layout sweep of synthetic data on one pod; the MaxText figure said no formula."""
    rows = _layout_sweep(tmp_path, monkeypatch)
    assert [r["status"] for r in rows] == ["ok", "ok"]
    with (tmp_path / "results.csv").open() as f:
        written = list(csv.DictReader(f))
    assert {r["slice"] for r in written} == {"v5p-16"}
    assert {r["maxtext_tflops_formula"] for r in written} == {
        "MaxText tpu-recipes-v0.1.4: causal attention not halved"}
    assert all(float(r["maxtext_2023_tflops_per_device"]) < float(r["maxtext_tflops_per_device"])
               for r in written)  # the 2023 formula halves the attention term
    table = (tmp_path / "results.md").read_text().splitlines()
    head = next(line for line in table if line.startswith("| # |"))
    assert "tokens/s" in head and "examples/s" not in head
    assert "epoch s" not in head and "efficiency" not in head
    body = next(line for line in table if line.startswith("| 1 |"))
    step = body.split(" | ")[7]
    assert step == ms_text(rows[0]["simulated_step_seconds"]) and len(step.split(".")[-1]) <= 4
    # TFLOP/s per device as MaxText prints it, not the pod's (issue 33 item 5)
    column = head.split(" | ").index("TFLOP/s / device (MaxText)")
    assert body.split(" | ")[column] == f"{rows[0]['maxtext_tflops_per_device']:,.1f}"
    assert rows[0]["simulated_tflops"] > 4 * rows[0]["maxtext_tflops_per_device"]  # 8 chips


def test_a_sweep_points_line_says_tokens_and_which_tflops(tmp_path, monkeypatch):
    from pod.commands.sweep import point_line

    rows = _layout_sweep(tmp_path, monkeypatch)
    line = point_line(rows[0], 2)
    assert f"{rows[0]['simulated_tokens_per_second']:,.0f} tokens/s" in line
    assert "examples/s" not in line and "TFLOP/s/device (MaxText, attention not halved)" in line
    assert line.startswith("point 1/2: v5p-16 8 chips") and "HBM" in line

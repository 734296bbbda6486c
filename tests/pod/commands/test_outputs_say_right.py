"""Outputs that say right things (issue 33 items 9, 11, 12): describe of an offloading
remat policy, the columns of results.csv and results.md for the kind of sweep, tokens/s
for language models, the MaxText TFLOP/s formula named beside its figure, best.yaml's
slice, the names of precision options, generate's --seed help."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from pod.cli import cli
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
    assert out.exit_code == 2 and "'fp8' is not one of bf16, fp32, int8" in out.output


def test_generate_seed_has_help():
    out = CliRunner().invoke(cli, ["generate", "--help"])
    assert out.exit_code == 0
    seed = out.output[out.output.index("--seed"):]
    assert "Seed of the sampling" in " ".join(seed.split()[:12])

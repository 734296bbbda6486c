"""The sharding table (``describe``, the run header) and the model summary of models too
large to hold: each layer's sharding, identical blocks merged, totals that add up."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

from click.testing import CliRunner
from rich.console import Console

from pod.cli import cli
from pod.report.model_summary import layer_costs, sharding_groups, sharding_table
from pod.workloads import build_model, build_optimizer
from pod.programs import ShardedTransformer

ROOT = Path(__file__).resolve().parents[3]


def _program(layers=3, sizes=None):
    model = build_model("transformer", (64,), 256, embed_dim=64, heads=4, head_dim=16,
                        mlp_dim=128, layers=layers)
    return model, ShardedTransformer(model, sizes or {"fsdp": 2, "tensor": 2},
                                     build_optimizer("adamw"))


def test_identical_blocks_are_one_group_and_the_totals_are_the_models():
    model, program = _program(layers=3)
    groups = sharding_groups(program.param_layout())
    assert [names for names, _ in groups] == [["embed"], ["block1", "block2", "block3"],
                                              ["final_norm"]]
    text = _render(sharding_table(program.param_layout(), program.sizes))
    assert "block1 .. block3 (x3)" in text
    assert f"{model.num_params:,} parameters" in text
    assert f"{program.local_param_bytes():,}" in text  # the device's bytes, from the program
    # Megatron: query column-parallel (output dim), out row-parallel (input dim)
    rows = {line.split("│")[2].strip(): line for line in text.splitlines() if "│" in line}
    assert "dim 1 (column)" in rows["attention/query"] and "(64, 32)" in rows["attention/query"]
    assert "dim 0 (row)" in rows["attention/out"] and "(32, 64)" in rows["attention/out"]
    assert "replicated" in rows["embedding"]


def _render(table) -> str:
    console = Console(width=200, record=True)
    console.print(table)
    return console.export_text()


def test_describe_shows_the_sharding_of_a_mesh_and_the_device_hbm():
    result = CliRunner().invoke(cli, ["describe", str(ROOT / "scenarios/transformer-sharded.yaml")],
                                terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "Sharding on the mesh {data: 2, fsdp: 2, tensor: 2}" in result.output
    assert "HBM plan per device (pod.mesh {data: 2, fsdp: 2, tensor: 2}" in result.output
    assert "allreduce:" not in result.output  # no data-parallel allreduce on this mesh
    plain = CliRunner().invoke(cli, ["describe", str(ROOT / "scenarios/quickstart.yaml")],
                               terminal_width=200)
    assert plain.exit_code == 0 and "Sharding" not in plain.output


def test_the_summary_of_a_33b_model_holds_no_parameter_array():
    """The per-layer costs run on zero views: LLaMA-33B's float32 parameters would be
    130 GB; the summary's traced peak stays under 300 MiB."""
    from chip import get_chip_spec

    model = build_model("transformer", (2048,), 32000, embed_dim=6656, heads=52, head_dim=128,
                        mlp_dim=17920, layers=60)
    tracemalloc.start()
    try:
        costs = layer_costs(model, get_chip_spec("v5p").core, 1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 300 * 2**20, peak
    assert costs["block1"]["flops"] == costs["block60"]["flops"] > 0


def test_describe_names_the_mxu_as_the_bound_of_the_blocks_and_of_the_sharded_step():
    """Issue 22: describe's per-layer table said every LLaMA-33B block is MXU-bound while
    the sharded step's bound read HBM. Both now come from per-op bounds: the blocks' rows
    and the timing-only step line (the one clock) name the MXU."""
    result = CliRunner().invoke(cli, ["describe", str(ROOT / "scenarios/llama-33b-v5p-128.yaml")],
                                terminal_width=200)
    assert result.exit_code == 0, result.output
    blocks = [line for line in result.output.splitlines() if "(transformer_block)" in line]
    assert len(blocks) == 60 and all("│ MXU " in line for line in blocks)
    step = result.output[result.output.index("step (simulated, timing-only):"):]
    assert "bound MXU" in " ".join(step.split())


def test_describes_step_line_is_the_timing_pods_step():
    """The step line of describe: the TimingPod's figures of step 0, every exposed axis."""
    from pod.config.plan import build_plan
    from pod.config.scenario import load_scenario
    from pod.runtime.timing import TimingPod

    path = ROOT / "scenarios/transformer-sharded.yaml"
    stats = TimingPod(build_plan(load_scenario(path))).step(0)
    result = CliRunner().invoke(cli, ["describe", str(path)], terminal_width=400)
    assert result.exit_code == 0, result.output
    line = " ".join(result.output[result.output.index("step (simulated"):].split())
    assert line.startswith(f"step (simulated, timing-only): {stats.step_seconds * 1e3:.3f} ms = "
                           f"compute {stats.compute_seconds * 1e3:.3f} + exposed collectives "
                           f"{stats.exposed_collective_seconds * 1e3:.3f} (")
    for axis in ("data", "fsdp", "tensor"):
        assert f"{axis} {stats.axis_exposed_seconds[axis] * 1e3:.3f} ms" in line
    assert f"{stats.tokens_per_second:,.0f} tokens/s" in line

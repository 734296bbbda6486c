"""A module's step on the clock (``pod.hlo.step``): hand-worked time lines of sync and async
collectives, lanes named after the mesh, the report files, and one line for a module of
another slice."""

from __future__ import annotations

import gzip
import json

import pytest

from chip import TensorCore, get_chip_spec
from pod.config.slices import resolve_pod
from pod.errors import HloError
from pod.hlo import CollectiveModel, cost_module, parse_hlo
from pod.hlo.report import (
    APPROXIMATE,
    COLLECTIVE_COLUMNS,
    LAYER_COLUMNS,
    layer_rows,
    summary,
    write_results,
)

V5E8 = resolve_pod(slice_name="v5e-8")


def module(start: str, middle: str, done: str) -> str:
    """Three negates of a (1024, 4096) float32 array around an all-reduce of 8 devices."""
    return f"""HloModule m, is_scheduled=true, num_partitions=8
%sum (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}}
ENTRY %main (x: f32[1024,4096]) -> f32[1024,4096] {{
  %x = f32[1024,4096]{{1,0}} parameter(0)
  %n1 = f32[1024,4096]{{1,0}} negate(%x), metadata={{op_name="jit(f)/first"}}
{start}
  %n2 = f32[1024,4096]{{1,0}} negate(%x), metadata={{op_name="jit(f)/second"}}
{middle}
{done}
  ROOT %n3 = f32[1024,4096]{{1,0}} negate(%r)
}}
"""


SYNC = module("  %r = f32[1024,4096]{1,0} all-reduce(%n1), replica_groups={{0,1,2,3,4,5,6,7}}, "
              "to_apply=%sum", "", "")
ASYNC = module("  %ars = f32[1024,4096]{1,0} all-reduce-start(%n1), "
               "replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%sum",
               "  %n4 = f32[1024,4096]{1,0} negate(%n2)",
               "  %r = f32[1024,4096]{1,0} all-reduce-done(%ars)")


def parts():
    core = TensorCore(get_chip_spec("v5e").core, numerics=False, execute=False, sustained=True)
    negate = core.account_vector("n", 1024 * 4096, 2 * 4 * 1024 * 4096).seconds
    model = CollectiveModel.of(V5E8.chip, V5E8.torus)
    ar = model.cost("allreduce", (tuple(range(8)),), 4 * 1024 * 4096, 4).seconds
    return negate, ar


def test_a_sync_collective_blocks():
    negate, ar = parts()
    step = cost_module(parse_hlo(SYNC), V5E8)
    assert step.step_seconds == pytest.approx(3 * negate + ar, rel=1e-9)
    assert step.stats.exposed_collective_seconds == pytest.approx(ar, rel=1e-9)


def test_an_async_collective_runs_beside_the_compute_between_start_and_done():
    negate, ar = parts()
    step = cost_module(parse_hlo(ASYNC), V5E8)
    # n1, then the all-reduce beside n2 and n4; n3 waits for it
    assert step.step_seconds == pytest.approx(negate + max(2 * negate, ar) + negate, rel=1e-9)
    assert step.stats.exposed_collective_seconds == pytest.approx(max(0.0, ar - 2 * negate),
                                                                  rel=1e-9)
    assert step.stats.serial_step_seconds == pytest.approx(4 * negate + ar, rel=1e-9)


def test_lanes_are_named_after_the_mesh(modules):
    step = cost_module(modules[("fsdp_block", "tpu")], V5E8, mesh_axes={"fsdp": 4, "tensor": 2})
    assert {"fsdp", "tensor"} <= set(step.lanes)
    unnamed = cost_module(modules[("fsdp_block", "tpu")], V5E8)
    assert any(lane.endswith("groups of 4") for lane in unnamed.lanes)


@pytest.mark.parametrize("platform", ["tpu", "cpu"])
def test_both_paths_cost_the_same_step(modules, platform):
    step = cost_module(modules[("fsdp_block", platform)], V5E8, approximate=platform == "cpu",
                       mesh_axes={"fsdp": 4, "tensor": 2})
    stats = step.stats
    assert 0 < stats.compute_seconds <= step.step_seconds <= stats.serial_step_seconds
    assert stats.collective_seconds > 0 and step.flops_per_device > 0
    assert summary(step)["costed_from"] == (APPROXIMATE if platform == "cpu"
                                            else "TPU-compiled HLO")


def test_the_tpu_and_cpu_modules_do_the_same_mxu_work(modules):
    tpu = cost_module(modules[("fsdp_block", "tpu")], V5E8)
    cpu = cost_module(modules[("fsdp_block", "cpu")], V5E8, approximate=True)
    assert cpu.flops_per_device == pytest.approx(tpu.flops_per_device, rel=1e-9)


def test_a_module_of_another_slice_is_one_line(modules):
    with pytest.raises(HloError, match="runs on 8 devices but v5p-128 has 64"):
        cost_module(modules[("fsdp_block", "tpu")], resolve_pod(slice_name="v5p-128"))


def test_results_files(modules, tmp_path):
    step = cost_module(modules[("fsdp_block", "cpu")], V5E8, approximate=True,
                       mesh_axes={"fsdp": 4, "tensor": 2})
    data = summary(step)
    paths = write_results(step, tmp_path, data)
    assert [p.name for p in paths] == ["summary.json", "layers.csv", "collectives.csv",
                                       "trace.json.gz"]
    assert json.loads(paths[0].read_text())["costed_from"] == APPROXIMATE
    assert paths[1].read_text().splitlines()[0] == ",".join(LAYER_COLUMNS)
    assert paths[2].read_text().splitlines()[0] == ",".join(COLLECTIVE_COLUMNS)
    trace = json.loads(gzip.decompress(paths[3].read_bytes()))
    lanes = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert {"ICI fsdp", "ICI tensor"} <= lanes
    rows = layer_rows(step)
    assert sum(r["simulated_seconds"] for r in rows) == pytest.approx(
        sum(r.seconds for r in step.ops))
    assert any("block" in r["source"] for r in rows)


def test_permute_lanes_say_their_direction():
    from pod.hlo.step import lane_name

    mesh = {"fsdp": 2, "tensor": 4}
    forward = tuple((f * 4 + t, f * 4 + (t + 1) % 4) for f in range(2) for t in range(4))
    backward = tuple((b, a) for a, b in forward)
    assert lane_name(forward, mesh, "ppermute") == "permute tensor +1"
    assert lane_name(backward, mesh, "ppermute") == "permute tensor -1"
    assert lane_name(((0, 1, 2, 3), (4, 5, 6, 7)), mesh) == "tensor"
    assert lane_name(((0, 4),), mesh) == "fsdp"


def test_cpu_modules_take_the_projects_overlap_rules(modules):
    """Approximate: the FSDP gathers of weights are param_gathers (prefetched), the
    gradient reduce-scatters grad_reduces (behind the backward pass)."""
    from pod.hlo.program import StartEvent, flatten

    program = flatten(modules[("fsdp_block", "cpu")], approximate=True)
    roles = {(e.info.op, e.info.role) for e in program.events if isinstance(e, StartEvent)}
    assert ("all_gather", "param_gather") in roles
    assert ("reduce_scatter", "grad_reduce") in roles


def test_memory_estimate_counts_an_in_place_update_once():
    """A fusion updating a buffer in place (a dynamic-update-slice root) defines no new
    buffer: the peak is the parameters plus the one new update."""
    from pod.hlo.memory import peak_bytes

    text = """HloModule m, is_scheduled=true
%upd (big: f32[1024,1024], u: f32[1,1024], i: s32[]) -> f32[1024,1024] {
  %big = f32[1024,1024]{1,0} parameter(0)
  %u = f32[1,1024]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %d = f32[1024,1024]{1,0} dynamic-update-slice(%big, %u, %i, %z)
}
ENTRY %main (big: f32[1024,1024], x: f32[1,1024]) -> f32[1024,1024] {
  %big = f32[1024,1024]{1,0} parameter(0)
  %x = f32[1,1024]{1,0} parameter(1)
  %n = f32[1,1024]{1,0} negate(%x)
  %i = s32[] constant(3)
  ROOT %f = f32[1024,1024]{1,0} fusion(%big, %n, %i), kind=kLoop, calls=%upd
}
"""
    assert peak_bytes(parse_hlo(text)) == 4 * (1024 * 1024 + 1024) + 4 * 1024


def test_memory_estimate_writes_donated_outputs_into_their_arguments():
    """An output the header aliases to a donated argument (``input_output_alias``: an
    optimizer's new weights) takes the argument's buffer: the peak is the arguments plus
    the other output, where without the alias it holds both outputs."""
    from pod.hlo.memory import peak_bytes

    body = """ENTRY %main (w: f32[1024,1024], g: f32[1024,1024]) -> (f32[1024,1024], f32[1024,1024]) {
  %w = f32[1024,1024]{1,0} parameter(0)
  %g = f32[1024,1024]{1,0} parameter(1)
  %n = f32[1024,1024]{1,0} subtract(%w, %g)
  %m = f32[1024,1024]{1,0} multiply(%g, %g)
  ROOT %t = (f32[1024,1024]{1,0}, f32[1024,1024]{1,0}) tuple(%n, %m)
}
"""
    array = 4 * 1024 * 1024
    donated = parse_hlo("HloModule m, is_scheduled=true, input_output_alias={ {0}: (0, {}, "
                        "may-alias), {1, 0}: (1, {2}, must-alias) }\n" + body)
    assert donated.output_aliases == {(0,): (0, ()), (1, 0): (1, (2,))}
    assert peak_bytes(donated) == 2 * array + array
    assert peak_bytes(parse_hlo("HloModule m, is_scheduled=true\n" + body)) == 2 * array + 2 * array


def test_memory_estimate_leaves_host_memory_out():
    """Buffers in host memory (``S(5)``: XLA's host offload) are not HBM."""
    from pod.hlo.memory import peak_bytes

    text = """HloModule m, is_scheduled=true
ENTRY %main (h: f32[1024,1024], x: f32[1024]) -> (f32[1024,1024], f32[1024]) {
  %h = f32[1024,1024]{1,0:S(5)} parameter(0)
  %x = f32[1024]{0} parameter(1)
  %c = f32[1024,1024]{1,0:S(5)} copy(%h)
  %n = f32[1024]{0} negate(%x)
  ROOT %t = (f32[1024,1024]{1,0:S(5)}, f32[1024]{0}) tuple(%c, %n)
}
"""
    assert peak_bytes(parse_hlo(text)) == 4 * 1024 + 4 * 1024


def test_an_async_update_into_host_memory_moves_the_update():
    """XLA's host offload writes each layer's activations into a stack of all layers in host
    memory with an async dynamic-update-slice: the DMA moves the update (one layer), not the
    stack, over the host link."""
    from pod.config.slices import resolve_pod
    from pod.hlo import cost_module

    text = """HloModule m, is_scheduled=true
ENTRY %main (s: bf16[80,1024,1024], u: bf16[1,1024,1024], i: s32[]) -> bf16[80,1024,1024] {
  %s = bf16[80,1024,1024]{2,1,0:S(5)} parameter(0)
  %u = bf16[1,1024,1024]{2,1,0} parameter(1)
  %i = s32[] parameter(2)
  %z = s32[] constant(0)
  %st = ((bf16[80,1024,1024]{2,1,0:S(5)}, bf16[1,1024,1024]{2,1,0}, s32[], s32[], s32[]), bf16[80,1024,1024]{2,1,0:S(5)}, u32[]) dynamic-update-slice-start(%s, %u, %i, %z, %z)
  ROOT %d = bf16[80,1024,1024]{2,1,0:S(5)} dynamic-update-slice-done(%st)
}
"""
    topology = resolve_pod(slice_name="v5e-1")
    step = cost_module(parse_hlo(text), topology)
    (row,) = step.collectives
    update = 1024 * 1024 * 2
    assert (row.op, row.lane, row.nbytes) == ("dma", "DMA host", update)
    assert row.seconds == pytest.approx(update / topology.chip.host_to_chip_bytes_per_s)


def test_an_offloading_steps_peak_of_host_memory_is_not_judged_as_hbm():
    """XLA's ``peak_memory_in_bytes`` of a step that offloads activations can be its
    arguments plus host temporaries (the oracle's T6: 12.34 GiB + 45.00 GiB on a 31.25 GiB
    v6e): the verdict takes XLA's device buffers at once instead (an upper bound), and
    says so; a peak of HBM is taken as XLA gives it. The capacity is shown as it is."""
    from pod.hlo.step import HloMemory, _xla_figures

    gib = 2**30
    capacity = 33_554_432_000                       # v6e: 31.25 GiB a program may use
    device = {"argument_size_in_bytes": 12 * gib, "output_size_in_bytes": 12 * gib,
              "alias_size_in_bytes": 12 * gib, "temp_size_in_bytes": 18 * gib}
    t6 = _xla_figures(device | {"host_temp_size_in_bytes": 45 * gib,
                                "peak_memory_in_bytes": 57 * gib})
    assert t6["peak_bytes"] == 30 * gib and t6["peak_counts_host"] == 1
    memory = HloMemory(capacity, t6, "tpu", estimate_bytes=29 * gib)
    assert memory.fits and memory.verdict().startswith("30.00 GiB of 31.25 GiB HBM per device")
    assert "upper bound" in memory.verdict()
    hbm = _xla_figures(device | {"host_temp_size_in_bytes": 45 * gib,
                                 "peak_memory_in_bytes": 33 * gib})
    assert hbm["peak_bytes"] == 33 * gib and "peak_counts_host" not in hbm
    refused = HloMemory(capacity, hbm, "tpu")
    assert not refused.fits
    assert refused.verdict() == ("does not fit: 33.00 GiB per device (XLA's buffer assignment) "
                                 "exceeds the 31.25 GiB of HBM")

"""The pipelined transformer (issue 24, item 2) on the in-process LocalMesh and LocalPod,
against one device's numerics and the timing-only pod. No Ray.

The reference is the same model trained on one TensorCore on the same global batches
(``TransformerModel.loss_and_grads`` + the optimizer), in fp32. A pipelined step sums
the same float32 terms in another order (the batch split over data x fsdp and into
microbatches, the gradients accumulated microbatch by microbatch, heads split over
tensor, the tied table's two parts added by a collective); the tolerance is the one
tests/pod/workloads/test_sharded.py measured for such reorderings (5e-5, 5x the worst
sharded run, 2,400x below what bf16 rounding does to this model). Measured here: the
pipelined runs land 8e-7 .. 1.5e-5 away after 3 steps.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from chip import TensorCore, get_chip_spec
from pod.config.plan import build_plan
from pod.config.scenario import parse_scenario
from pod.errors import ScenarioError
from pod.programs import DeviceCoords, LocalMesh, PipelinedTransformer, build_program, stage_layers
from pod.runtime.local import LocalPod
from pod.runtime.timing import TimingPod
from pod.workloads import TransformerConfig, TransformerModel
from tests.pod.programs.test_transformer import batches as transformer_batches
from tests.pod.programs.test_transformer import optimizer  # adamw, learning rate 1e-2

pytestmark = pytest.mark.usefixtures("one_blas_thread")

SPEC = get_chip_spec("v4").core
TINY = {"vocabulary": 32, "sequence_length": 8, "embed_dim": 16, "heads": 4, "head_dim": 4,
        "mlp_dim": 32, "layers": 4}
BATCH, STEPS, FP32_ATOL = 8, 3, 5e-5  # the learning rate: test_transformer's optimizer()


def batches(steps=STEPS):
    """test_transformer's token batches at this file's batch and model."""
    return transformer_batches(steps, BATCH, TINY)


@functools.cache
def single(option_items=()):
    """One TensorCore on the global batches: (params, losses)."""
    model = TransformerModel(TransformerConfig(**{**TINY, **dict(option_items)}))
    core, opt = TensorCore(SPEC, precision="fp32"), optimizer()
    params = model.init_params(0)
    state, losses = opt.init(params), []
    for step, (x, y) in enumerate(batches(), 1):
        loss, grads = model.loss_and_grads(core, params, x, y)
        params, state = opt.update(core, grads, state, params, step)
        losses.append(loss)
        core.take_records()
    return params, losses


def pipelined(sizes, schedule, microbatches, repeats=1, sequence_parallel=False,
              bucket_elements=None, **options):
    """Every device of a LocalMesh trained STEPS steps: (program, [(shard, losses)])."""
    model = TransformerModel(TransformerConfig(**{**TINY, **options}))
    program = PipelinedTransformer(model, sizes, optimizer(), microbatches=microbatches,
                                   schedule=schedule, repeats=repeats,
                                   sequence_parallel=sequence_parallel,
                                   bucket_elements=bucket_elements)
    data = batches()

    def device(comm):
        coords = DeviceCoords.of(comm)
        core = TensorCore(SPEC, precision="fp32")
        shard, part, losses = program.init_local(0, coords), program.batch_slice(BATCH, coords), []
        for step, (x, y) in enumerate(data, 1):
            result = program.train_step(core, comm, shard, x[part], y[part], step)
            shard = result.shard
            losses.append(result.loss)
            records = core.take_records()
            assert records[result.update_start].name.startswith("adamw/")
        return shard, losses

    return program, LocalMesh(sizes).run(device)


def max_diff(a, b):
    assert a.keys() == b.keys()
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


MESHES = {"stage2-data2": {"stage": 2, "data": 2},
          "stage2-fsdp2-tensor2": {"stage": 2, "fsdp": 2, "tensor": 2}}
SCHEDULES = {"gpipe": ("gpipe", 2, 1), "1f1b": ("1f1b", 4, 1), "circular": ("circular", 2, 2)}


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("mesh", MESHES)
def test_pipelined_training_ends_with_the_single_device_parameters(mesh, schedule):
    want, want_losses = single()
    name, microbatches, repeats = SCHEDULES[schedule]
    program, devices = pipelined(MESHES[mesh], name, microbatches, repeats)
    got = program.assemble(shard for shard, _ in devices)
    assert max_diff(got, want) < FP32_ATOL
    np.testing.assert_allclose(np.mean([losses for _, losses in devices], axis=0), want_losses,
                               rtol=1e-6)
    by_shard = {}  # every stage reports its data shard's loss: the last stage's bits
    for shard, losses in devices:
        by_shard.setdefault((shard.coords.data, shard.coords.fsdp, shard.coords.tensor),
                            set()).add(tuple(losses))
    assert all(len(v) == 1 for v in by_shard.values())


@pytest.mark.parametrize("schedule", ["gpipe", "circular"])
def test_a_stage_reduces_its_gradients_in_buckets_to_the_same_parameters(schedule):
    """``training.overlap_bucket_bytes`` in a pipeline: each stage combines its layers'
    gradients (in the order its last microbatch's backward finishes them) into buckets,
    as the sharded program does over all layers; None is one bucket after the stage's
    backward. The buckets move the reduction, not its sums: the same parameters, bit
    for bit."""
    name, microbatches, repeats = SCHEDULES[schedule]
    runs = {cap: pipelined({"stage": 2, "data": 2}, name, microbatches, repeats,
                           bucket_elements=cap) for cap in (None, 1)}
    one, each = runs[None][0], runs[1][0]
    for stage in range(2):
        owning = {i for i in range(len(one.local_model.layers)) if one._reduce_at[stage].get(i)}
        assert len(one._bucket_closers[stage]) == 1 and one._bucket_closers[stage] <= owning
        assert each._bucket_closers[stage] == owning and len(owning) > 1
    got = {cap: program.assemble(s for s, _ in devices) for cap, (program, devices) in runs.items()}
    for key, value in got[None].items():
        assert np.array_equal(value, got[1][key]), key


@pytest.mark.parametrize("sizes, schedule, microbatches, options", [
    ({"stage": 4}, "1f1b", 2, {}),                          # fewer microbatches than stages
    ({"stage": 2, "tensor": 2}, "gpipe", 4, {"tied_embeddings": False}),
    ({"stage": 2, "data": 2}, "circular", 4, {"positions": "learned", "block": "parallel"}),
], ids=["stage4-m2", "untied-tensor", "learned-parallel"])
def test_more_pipelines_equal_one_device(sizes, schedule, microbatches, options):
    want, _ = single(tuple(sorted(options.items())))
    program, devices = pipelined(sizes, schedule, microbatches, **options)
    assert max_diff(program.assemble(s for s, _ in devices), want) < FP32_ATOL


def test_sequence_parallel_inside_the_stages_equals_one_device():
    want, _ = single()
    program, devices = pipelined({"stage": 2, "tensor": 2}, "gpipe", 2, sequence_parallel=True)
    assert max_diff(program.assemble(s for s, _ in devices), want) < FP32_ATOL


def test_the_tied_table_stays_identical_on_the_first_and_the_last_stage():
    program, devices = pipelined({"stage": 4}, "gpipe", 4)
    assert program.shared_keys == ["embed/embedding"]
    tables = {s.coords.stage: s.params.get("embed/embedding") for s, _ in devices}
    assert tables[1] is None and tables[2] is None
    np.testing.assert_array_equal(tables[0], tables[3])


def test_stages_hold_their_layers_only():
    model = TransformerModel(TransformerConfig(**TINY))
    program = PipelinedTransformer(model, {"stage": 2}, optimizer(), microbatches=2,
                                   schedule="circular", repeats=2)
    assert stage_layers(4, 2, 2) == [[0, 1], [2], [3], [4, 5, 6]]
    assert program.chunks == stage_layers(4, 2, 2)
    first, last = program.stage_keys(0), program.stage_keys(1)
    assert {k.split("/")[0] for k in first} == {"embed", "block1", "block3"}
    assert {k.split("/")[0] for k in last} == {"block2", "block4", "final_norm", "embed"}
    whole = sum(int(np.prod(s)) for s in model.param_shapes.values())
    table = int(np.prod(model.param_shapes["embed/embedding"]))
    assert program.stage_param_elements(0) + program.stage_param_elements(1) == whole + table
    with pytest.raises(ValueError, match="4 transformer layers do not split into 3 stages"):
        stage_layers(4, 3, 1)
    with pytest.raises(ValueError, match="circular schedule needs microbatches a multiple"):
        PipelinedTransformer(model, {"stage": 2}, optimizer(), microbatches=3,
                             schedule="circular", repeats=2)


def test_build_program_pipelines_a_mesh_with_stages():
    model = TransformerModel(TransformerConfig(**TINY))
    program = build_program(model, {"stage": 2, "data": 2}, optimizer())
    assert isinstance(program, PipelinedTransformer)
    assert (program.microbatches, program.schedule.name) == (2, "gpipe")  # MaxText: M = S


def test_load_local_is_the_inverse_of_assemble():
    program, devices = pipelined({"stage": 2, "fsdp": 2}, "gpipe", 2)
    shards = [s for s, _ in devices]
    params, state = program.assemble(shards), program.assemble(shards, opt_state=True)
    for shard in shards:
        again = program.load_local(params, state, shard.coords)
        assert again.params.keys() == shard.params.keys()
        for k in shard.params:
            np.testing.assert_array_equal(again.params[k], shard.params[k])
        for k in shard.opt_state:
            np.testing.assert_array_equal(again.opt_state[k], shard.opt_state[k])


# --------------------------------------------------------------------------- the pod

def scenario(mesh, **training):
    return parse_scenario({
        "name": "pipeline-test",
        "pod": {"slice": "v5e-8", "mesh": mesh},
        "model": {"name": "transformer", "options": {
            "embed_dim": 16, "heads": 4, "head_dim": 4, "mlp_dim": 32, "layers": 4}},
        "data": {"name": "synthetic_text",
                 "options": {"vocabulary": 32, "sequence_length": 8, "num_examples": 96},
                 "test_fraction": 0.25},
        "training": {"global_batch": 16, "steps": 2, "seed": 0,
                     "optimizer": {"name": "adamw", "learning_rate": 0.01}, **training},
        "metrics": {"port": 0}})


@pytest.mark.parametrize("mesh, training", [
    ({"stage": 2, "data": 2, "fsdp": 2}, {"microbatches": 4, "pipeline_schedule": "1f1b"}),
    ({"stage": 2, "fsdp": 2, "tensor": 2}, {"microbatches": 2, "pipeline_schedule": "circular",
                                            "pipeline_repeats": 2}),
], ids=["1f1b", "circular"])
def test_a_timing_only_step_equals_the_functional_one_record_for_record(mesh, training):
    plan = build_plan(scenario(mesh, **training))
    with LocalPod(plan) as pod:
        functional = pod.step(1)
        reports = {r.device: r for r in pod.last_reports}
        assert pod.replicas_identical()
        evaluation = pod.evaluate()
    timing_pod = TimingPod(plan)
    timing = timing_pod.step(1)
    assert len(timing_pod.last_reports) == 2  # one device per stage
    for r in timing_pod.last_reports:
        f = reports[r.device]
        assert r.record_seconds == f.record_seconds
        assert r.calls == f.calls
        assert r.stage_group == f.stage_group and len(r.stage_group) == 2
    for name in ("step_seconds", "compute_seconds", "exposed_collective_seconds",
                 "pipeline_bubble_seconds", "update_seconds", "model_flops", "hardware_flops"):
        assert getattr(timing, name) == getattr(functional, name), name
    assert timing.axis_exposed_seconds == functional.axis_exposed_seconds
    assert 0 < functional.pipeline_bubble_fraction < 1
    assert functional.axis_collective_bytes["stage"] > 0
    unit = pod.program.batch_shards * pod.program.microbatches  # eval cuts to whole microbatches
    assert evaluation.sums.count == 24 // unit * unit * 8  # the tokens, counted once


def test_a_pipelined_checkpoint_assembles_the_whole_model_and_restores():
    plan = build_plan(scenario({"stage": 2, "data": 4}, microbatches=2))
    with LocalPod(plan) as pod:
        pod.step(0)
        state = pod.checkpoint_state()
        assert state["params"].keys() == plan.model.param_shapes.keys()
        before = [d.digests() for d in pod.devices]
        for d in pod.devices:
            d.load(state["params"], state["optimizer_state"])
        assert [d.digests() for d in pod.devices] == before


# --------------------------------------------------------------------------- the plan

def test_the_memory_plan_counts_the_stage_and_the_microbatches_in_flight():
    """The plan is the pipelined program's memory (``PipelinedTransformer.memory``, its
    largest stage): a stage holds half the blocks of the flat mesh's device, and 1F1B
    keeps fewer microbatches in flight than GPipe (tests/pod/programs/test_memory.py
    counts them)."""
    base = {"stage": 2, "fsdp": 4}
    gpipe = build_plan(scenario(base, microbatches=4))
    one_f = build_plan(scenario(base, microbatches=4, pipeline_schedule="1f1b")).memory
    flat = build_plan(scenario({"data": 2, "fsdp": 4})).memory
    assert gpipe.memory["params"] < 0.75 * flat["params"]          # half the blocks per device
    program = PipelinedTransformer(gpipe.model, gpipe.mesh.sizes, optimizer(), microbatches=4)
    assert gpipe.device_memory == program.memory(gpipe.per_device_batch)
    assert one_f["activations"] < gpipe.memory["activations"]
    assert gpipe.memory["total"] == sum(v for k, v in gpipe.memory.items() if k != "total")


@pytest.mark.parametrize("mesh, training, match", [
    ({"stage": 3, "fsdp": -1}, {}, None),                   # 8 devices: 3 does not divide
    ({"stage": 8}, {}, "4 layers do not split into stage 8 x pipeline_repeats 1"),
    ({"stage": 2, "fsdp": 4}, {"microbatches": 3},
     "does not split into data x fsdp = 4 devices x 3"),
    ({"stage": 2, "fsdp": 4}, {"pipeline_repeats": 2}, "need the circular schedule"),
    ({"stage": 2, "fsdp": 4}, {"pipeline_schedule": "circular", "microbatches": 1},
     "multiple of the 2 stages"),
    ({"fsdp": 8}, {"microbatches": 4}, "needs pipeline stages"),
], ids=["wrong-product", "layers", "batch", "repeats", "circular", "no-stage"])
def test_bad_pipelines_are_one_line_errors(mesh, training, match):
    with pytest.raises(ScenarioError) as err:
        build_plan(scenario(mesh, **training))
    assert "\n" not in str(err.value)
    if match:
        assert match in str(err.value)



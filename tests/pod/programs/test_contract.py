"""The device-program contract (``pod.programs.contract``), kept by both programs: the
replicated program of any Model and the sharded transformer. State round trips bit for
bit (init_local -> assemble -> load_local), the batch and the evaluation set are split
so that every example is trained or counted once, and a timing-only shard has the
shapes of a functional one. No Ray, no step (test_replicated / test_transformer run
steps)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pod.programs import (DeviceCoords, DeviceProgram, EvalSums, LocalMesh, ReplicatedProgram,
                          ShardedTransformer, build_program, combine_buckets)
from pod.workloads import TransformerConfig, TransformerModel, build_model, build_optimizer

TINY = {"vocabulary": 32, "sequence_length": 8, "embed_dim": 16, "heads": 4, "head_dim": 4,
        "mlp_dim": 32, "layers": 2}


def _mlp(batch_norm=True):
    return build_model("mlp", (8, 8, 1), 10, hidden=[32, 16], batch_norm=batch_norm,
                       dropout=False)


def _programs():
    """(name, program) pairs: the replicated MLP (with BatchNorm state) and the sharded
    transformer on three meshes, sequence parallelism on one."""
    adam = build_optimizer("adam", learning_rate=0.01)
    lm = TransformerModel(TransformerConfig(**TINY))
    mlp = _mlp()
    return [
        ("replicated-data4", ReplicatedProgram(mlp, {"data": 4}, adam,
                                               buckets=combine_buckets(mlp.gradient_buckets(),
                                                                       600))),
        ("transformer-data2-fsdp2-tensor2",
         ShardedTransformer(lm, {"data": 2, "fsdp": 2, "tensor": 2}, adam)),
        ("transformer-fsdp3", ShardedTransformer(lm, {"fsdp": 3}, adam)),
        ("transformer-tensor2-sequence", ShardedTransformer(lm, {"tensor": 2, "data": 2}, adam,
                                                            sequence_parallel=True)),
    ]


PROGRAMS = dict(_programs())


def _coords(program):
    sizes = program.sizes
    return [DeviceCoords(d, f, t) for d, f, t in itertools.product(
        range(sizes["data"]), range(sizes["fsdp"]), range(sizes["tensor"]))]


@pytest.fixture(params=sorted(PROGRAMS))
def program(request):
    return PROGRAMS[request.param]


def test_both_programs_keep_the_protocol(program):
    assert isinstance(program, DeviceProgram)
    sizes = program.sizes
    assert set(sizes) == {"data", "stage", "fsdp", "expert", "tensor"}
    assert program.batch_shards == sizes["data"] * sizes["fsdp"]


def test_build_program_picks_the_program_of_the_model():
    sgd = build_optimizer("sgd")
    lm = TransformerModel(TransformerConfig(**TINY))
    assert isinstance(build_program(lm, {"data": 2}, sgd), ShardedTransformer)
    mlp = _mlp(batch_norm=False)
    whole = build_program(mlp, {"data": 2}, sgd)
    assert isinstance(whole, ReplicatedProgram)
    # no bucket size: one bucket of every layer; a size: the combiner's buckets
    assert [layers for layers, _ in whole.buckets] == [("dense3", "dense2", "dense1")]
    split = build_program(mlp, {"data": 2}, sgd, bucket_elements=170 + 528)  # dense3 + dense2
    assert [layers for layers, _ in split.buckets] == [("dense3", "dense2"), ("dense1",)]
    with pytest.raises(ValueError, match="must have every axis but data 1"):
        build_program(mlp, {"data": 1, "fsdp": 2}, sgd)


def test_init_local_assemble_load_local_round_trip_bit_for_bit(program):
    """Every device's shard of the assembled model is its own shard again, and the
    assembled model is ``model.init_params`` (a sharded run starts where one device
    does); the optimizer state too, and the model state per device."""
    coords = _coords(program)
    shards = [program.init_local(5, c) for c in coords]
    params = program.assemble(shards)
    opt_state = program.assemble(shards, opt_state=True)
    want = program.model.init_params(5)
    assert params.keys() == want.keys()
    for key in want:
        assert np.array_equal(params[key], want[key]), key
        assert params[key].dtype == np.float32
    assert set(opt_state) == {f"{k}/{slot}" for k in want for slot in program.optimizer.slots}
    for shard in shards:
        again = program.load_local(params, opt_state, shard.coords, dict(shard.model_state))
        assert again.coords == shard.coords
        for tree in ("params", "opt_state", "model_state"):
            mine, got = getattr(shard, tree), getattr(again, tree)
            assert set(mine) == set(got), tree
            for key in mine:
                assert np.array_equal(got[key], mine[key]), (tree, key)
                assert got[key] is not mine[key]                         # copies, not views


def test_assemble_refuses_a_missing_replica_zero_shard(program):
    shards = [program.init_local(0, c) for c in _coords(program) if c.data == 1]
    with pytest.raises(ValueError, match="replica 0"):
        program.assemble(shards)


def test_a_timing_only_shard_has_the_functional_shapes_and_no_memory(program):
    c = _coords(program)[-1]
    real, shape = program.init_local(0, c), program.shape_shard(c)
    for tree in ("params", "opt_state"):
        mine, got = getattr(real, tree), getattr(shape, tree)
        assert set(mine) == set(got), tree
        for key in mine:
            assert got[key].shape == mine[key].shape and got[key].dtype == np.float32, key
            assert not got[key].flags.writeable and not np.any(got[key])
            assert got[key].strides == (0,) * got[key].ndim or got[key].size <= 1, key


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 3), st.integers(1, 12))
def test_the_batch_slices_cover_the_global_batch_once(index, per_shard):
    """Devices that see different examples split a global batch into disjoint equal
    parts that cover it; devices along tensor share theirs."""
    program = PROGRAMS[sorted(PROGRAMS)[index]]
    global_batch = per_shard * program.batch_shards
    seen: dict[tuple[int, int], slice] = {}
    for c in _coords(program):
        part = program.batch_slice(global_batch, c)
        assert part.stop - part.start == per_shard
        key = (c.data, c.fsdp)
        assert seen.setdefault(key, part) == part                     # tensor shares it
    covered = sorted(i for part in seen.values() for i in range(global_batch)[part])
    assert covered == list(range(global_batch))
    if program.batch_shards > 1:
        with pytest.raises(ValueError, match="does not split over"):
            program.batch_slice(global_batch + 1, DeviceCoords())


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 3), st.integers(0, 700))
def test_the_counted_evaluation_slices_cover_the_examples_once(index, n):
    """The devices whose sums count (counts_eval) evaluate every example they cover once:
    the replicated program the whole set (parts differ by at most one), the transformer
    its first EVAL_EXAMPLES cut to a multiple of data x fsdp."""
    program = PROGRAMS[sorted(PROGRAMS)[index]]
    counted = [c for c in _coords(program) if program.counts_eval(c)]
    parts = [program.eval_slice(n, c) for c in counted]
    covered = sorted(i for part in parts for i in range(n)[part])
    if isinstance(program, ReplicatedProgram):
        want = n
        sizes = [p.stop - p.start for p in parts]
        assert max(sizes) - min(sizes) <= 1
    else:
        shards = program.batch_shards
        want = min(n, program.EVAL_EXAMPLES) // shards * shards
        if program.sequence_parallel:  # each tensor device counts its own sequence chunk
            covered = sorted(set(covered))
            assert len(counted) == len(_coords(program))
    assert covered == list(range(want))


def test_who_counts_in_an_evaluation(program):
    coords = _coords(program)
    counting = {c for c in coords if program.counts_eval(c)}
    if isinstance(program, ReplicatedProgram) or program.sequence_parallel:
        assert counting == set(coords)
    else:  # the tensor devices of a group predict the same tokens: the first counts
        assert counting == {c for c in coords if c.tensor == 0}


def test_eval_sums_add_up():
    parts = [EvalSums(1.5, 2, 4), EvalSums(0.5, 1, 2), EvalSums(0.0, 0, 0)]
    assert EvalSums.total(parts) == EvalSums(2.0, 3, 6)
    assert parts[0] + parts[1] == EvalSums(2.0, 3, 6)
    assert EvalSums.total([]) == EvalSums(0.0, 0, 0)


def test_device_coords_are_the_ring_positions_of_the_collectives():
    mesh = LocalMesh({"data": 2, "fsdp": 3}, rings={"fsdp": (2, 0, 1)})
    coords = [DeviceCoords.of(comm) for comm in mesh.devices]
    # device numbers are row-major (data, fsdp, tensor); positions follow the fsdp ring
    assert coords[:3] == [DeviceCoords(0, 1, 0), DeviceCoords(0, 2, 0), DeviceCoords(0, 0, 0)]
    assert sorted(coords) == [DeviceCoords(d, f, 0) for d in range(2) for f in range(3)]

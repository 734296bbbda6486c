"""Replaying layers' timing-only passes (``pod.programs.replay.LayerTape``): a step with
the tape equals a step run op by op, record for record (names, seconds, bounds) and call
for call (tags, bytes, places), on every kind of layout and block the transformer has."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from chip.core import OpRecord
from pod.config.plan import build_plan
from pod.config.scenario import parse_scenario
from pod.programs.replay import LayerTape, _op_record, signature
from pod.runtime.timing import TimingPod

TINY = {"embed_dim": 32, "heads": 4, "head_dim": 8, "mlp_dim": 64, "layers": 4}


def _plan(mesh, *, batch=8, sequence_parallel=False, training=None, **options):
    return build_plan(parse_scenario({
        "name": "replay-test",
        "pod": {"slice": "v5p-16", "mesh": mesh},
        "model": {"name": "transformer", "options": {**TINY, **options}},
        "data": {"name": "synthetic_text",
                 "options": {"vocabulary": 64, "sequence_length": 16, "num_examples": 64}},
        "training": {"global_batch": batch, "steps": 2, "sequence_parallel": sequence_parallel,
                     "optimizer": {"name": "adamw", "learning_rate": 0.01}, **(training or {})},
        "metrics": {"port": 0},
    }), timing_only=True)


CASES = {
    "fsdp": ({"fsdp": 8}, {}),
    "fsdp+tensor, sequence parallel, remat minimal": (
        {"fsdp": 4, "tensor": 2}, {"sequence_parallel": True, "remat": "minimal"}),
    "data+tensor, parallel block with biases, remat full": (
        {"data": 2, "tensor": 4}, {"block": "parallel", "use_bias": True, "remat": "full"}),
    "offloaded remat, untied, dot-product attention": (
        {"fsdp": 8}, {"remat": "custom", "tied_embeddings": False, "attention": "dot_product",
                      "remat_custom": {"decoder_layer_input": "offload", "mlpwi_0": "device"}}),
    "mixture of experts over expert": (
        {"fsdp": 2, "expert": 4}, {"experts": 4, "experts_per_token": 2,
                                   "capacity_factor": 1.25}),
    "pipeline over stage (1f1b)": (
        {"stage": 2, "fsdp": 4}, {"batch": 16, "training": {"microbatches": 4,
                                                            "pipeline_schedule": "1f1b"}}),
}


def _step(plan, tape):
    pod = TimingPod(plan, tape=tape)
    stats = pod.step(0, trace=True)
    return dataclasses.replace(stats, wall_seconds=0.0), pod.last_reports


@pytest.mark.parametrize("case", CASES)
def test_a_replayed_step_is_the_step_run_op_by_op(case):
    mesh, options = CASES[case]
    plan = _plan(mesh, **options)
    alone, reports = _step(plan, None)
    tape = LayerTape()
    for _ in range(2):  # the first step replays across layers, the second all of it
        replayed, again = _step(plan, tape)
        assert replayed == alone
        for a, b in zip(reports, again, strict=True):
            assert b.trace == a.trace  # (name, unit, seconds, flops, bytes, bound) per record
            assert b.calls == a.calls
            assert (b.record_bounds, b.update_start, b.mxu_flops) == (
                a.record_bounds, a.update_start, a.mxu_flops)
    assert tape.hits > tape.misses  # 4 alike blocks and their parameters' updates


def test_a_tape_serves_another_plan_with_the_same_per_device_shapes():
    """{data: 2, fsdp: 4} and {fsdp: 8} run the same layers on the same shapes; only the
    gathers' and reductions' sizes differ, which are not part of a layer's pass."""
    tape = LayerTape()
    _step(_plan({"fsdp": 8}), tape)
    misses = tape.misses
    other = _plan({"data": 2, "fsdp": 4})
    replayed, reports = _step(other, tape)
    alone, expected = _step(other, None)
    assert replayed == alone and reports[0].trace == expected[0].trace
    assert reports[0].calls == expected[0].calls
    layer_passes = 2 * (TINY["layers"] + 3)  # forward and backward of every layer
    assert tape.misses - misses < layer_passes  # the blocks' passes came from the tape


def test_a_signature_tells_shapes_and_settings_apart_and_ignores_names():
    import numpy as np

    from pod.workloads.block import TransformerBlock

    a = TransformerBlock(4, 8, 64, name="block1")
    assert signature(a) == signature(TransformerBlock(4, 8, 64, name="block7"))
    assert signature(a) != signature(TransformerBlock(4, 8, 64, remat="full", name="block1"))
    assert signature(a) != signature(TransformerBlock(4, 8, 32, name="block1"))
    x = np.zeros((2, 3), np.float32)
    assert signature(x) == signature(np.ones((2, 3), np.float32))
    assert signature(x) != signature(np.zeros((3, 2), np.float32))
    assert signature(x) != signature(np.zeros((2, 3), np.float64))


class _Comm:
    """Collectives that issue nothing (the passes below make no calls)."""

    def __init__(self):
        self.calls = []


def _epilogue_pass(core, i):
    """A pass whose first op is an epilogue fused into the MXU record made before it
    (its exposed seconds depend on that record), then a matmul of its own."""
    core.account_vector(f"l{i}/act", 1 << 20, 1 << 22, ops_per_element=4.0, fused="previous")
    core.account_matmul(64, 64, 64, name=f"l{i}/mm")


def _passes(core, tape):
    names = ("l0", "l1", "l2", "l3")
    comm = _Comm()
    core.account_matmul(256, 256, 256, name="l0/mm")
    for i in (1, 2):  # the second pass follows a much shorter matmul than the first
        if tape is None:
            _epilogue_pass(core, i)
        else:
            tape.run(core, comm, names, i, "layer", "forward", (), lambda i=i: _epilogue_pass(
                core, i))
        core.account_matmul(8, 8, 8, name=f"l{i}/small")
    return [(r.name, r.seconds, r.fused_into) for r in core.take_records()]


def test_a_pass_fused_into_the_record_before_it_is_kept_per_that_record():
    from chip import Chip, get_chip_spec

    def core():
        c = Chip(get_chip_spec("v5e"), 0, sustained=True).cores[0]
        c.execute = False
        return c

    tape = LayerTape()
    assert _passes(core(), tape) == _passes(core(), None)
    assert tape.misses == 2  # the same pass after another MXU record is not the same pass


def test_a_placed_record_equals_one_made_by_its_constructor():
    """``_op_record`` (a replay's records, made without the frozen dataclass's
    ``__init__``) gives the record ``OpRecord(*values)`` gives: equal, the same hash and
    fields, still frozen."""
    values = ("block3/attention/q", "mxu", 2.0e9, 4096, 1200, 1.5e-6, 2.5e-6, 2.5e-6, "memory",
              1100, 100, "block2/add")
    made, placed = OpRecord(*values), _op_record(values)
    assert placed == made and hash(placed) == hash(made)
    assert dataclasses.astuple(placed) == values
    with pytest.raises(dataclasses.FrozenInstanceError):
        placed.name = "block4/attention/q"


def test_a_mapping_of_arrays_is_told_apart_by_keys_shapes_and_dtypes():
    """An all-array mapping's signature (its fast path) changes with a key, a shape, a
    dtype or the order of its keys, not with the values; a mapping with another value
    takes the item-by-item path and differs from it."""
    a = {"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32)}
    assert signature(a) == signature({"w": np.ones((2, 3), np.float32),
                                      "b": np.ones(3, np.float32)})
    for other in ({"w": a["w"], "c": a["b"]}, {"w": a["w"], "b": np.zeros(4, np.float32)},
                  {"w": a["w"], "b": np.zeros(3, np.float64)}, {"b": a["b"], "w": a["w"]},
                  {"w": a["w"], "b": 3}):
        assert signature(a) != signature(other)


def test_a_tapes_tokens_stand_for_one_signature_each_even_after_a_clear():
    """``LayerTape._token``: equal signatures one number, different ones different numbers,
    and a number once given never stands for another signature (after the table is
    cleared, a signature seen again gets a new one: a key kept with the old misses);
    what is not a tuple is returned as it is."""
    from pod.workloads.block import TransformerBlock

    tape = LayerTape(max_segments=1)  # the table clears at 16 signatures
    a, b = signature(TransformerBlock(4, 8, 64)), signature(TransformerBlock(4, 8, 32))
    first = tape._token(a)
    assert tape._token(signature(TransformerBlock(4, 8, 64, name="block9"))) == first
    assert tape._token(b) != first and tape._token(7) == 7
    given = {first, tape._token(b)}
    for n in range(20):  # past the table's size
        given.add(tape._token(("filler", n)))
    again = tape._token(a)
    assert again != first and again not in given - {first}

"""The emulation's speed-ups change no result: pinned figures of the code before them,
and the chunk splitting the pod runs large allreduces with."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from interconnect import ALGORITHMS, Torus, build_collective, execute
from pod.config.plan import build_plan
from pod.config.scenario import parse_scenario

QUICKSTART = Path(__file__).parents[3] / "scenarios" / "quickstart.yaml"

# Computed by the code before the speed-ups (commit d0a0f7f: three actor calls per chip
# per step, TensorCores one after the other, no op-cost cache), quickstart.yaml with 4
# steps: every replica's parameter digest after step 4 and, per step, (loss, simulated
# step, compute, update, local reduce, ICI, exposed allreduce seconds, hardware FLOPs).
# A change to the cost model or the numerics moves them: recompute them then with the
# code before that change, never with the code under test.
PINNED_DIGEST = "9ab54b377f3a0593658c75632ef8be8a578d01f2f2c4e904a2a319346cd4fec2"
_SIMULATED = [6.867668081635919e-05, 4.9788798930758943e-05, 7.26115924191579e-06,
              1.782513293397052e-06, 9.844209350287395e-06, 1.1626722643684448e-05, 272367616]
PINNED_STEPS = [[loss, *_SIMULATED] for loss in
                (2.3198563158512115, 2.2957338988780975, 2.311282128095627, 2.292434573173523)]


def quickstart_plan(steps: int = 4):
    raw = yaml.safe_load(QUICKSTART.read_text())
    raw["training"]["steps"] = steps
    raw["metrics"] = {"port": 0}
    return build_plan(parse_scenario(raw))


@pytest.mark.parametrize("core_threads", [False, True], ids=["cores-in-turn", "core-threads"])
def test_the_quickstart_gives_the_previous_code_paths_bits_and_simulated_figures(
        ray_cluster, core_threads):
    from pod.runtime.coordinator import Pod

    plan = quickstart_plan()
    with Pod(plan, core_threads=core_threads) as pod:
        stats = [pod.step(s) for s in range(plan.steps)]
        digests = pod.digests()
    assert {d for chip in digests for d in chip} == {PINNED_DIGEST}
    got = [[s.loss, s.step_seconds, s.compute_seconds, s.update_seconds, s.local_reduce_seconds,
            s.ici_seconds, s.exposed_allreduce_seconds, s.hardware_flops] for s in stats]
    assert got == PINNED_STEPS  # exact: the same floats, not approximately


@pytest.mark.parametrize("op", ["allreduce", "all_to_all"])
@pytest.mark.parametrize("max_bytes", [4, 40, 400, 4000])
def test_split_chunks_gives_the_pure_executors_bits(op, max_bytes):
    from pod.runtime.collective import split_chunks

    torus = Torus((2, 3), True)
    rng = np.random.default_rng(max_bytes)
    buffers = [rng.standard_normal(996).astype(np.float32) for _ in range(torus.num_chips)]
    for algorithm in ALGORITHMS[op]:
        schedule = build_collective(op, torus, 996, 4, algorithm)
        split = split_chunks(schedule, max_bytes)
        assert max(b - a for a, b in split.chunk_bounds) * 4 <= max(max_bytes, 4)
        assert split.num_phases == schedule.num_phases
        for got, ref in zip(execute(split, buffers), execute(schedule, buffers)):
            np.testing.assert_array_equal(got, ref, err_msg=f"{op} {algorithm}")


def test_split_chunks_leaves_small_chunks_and_refuses_less_than_an_element():
    from pod.runtime.collective import split_chunks

    schedule = build_collective("allreduce", Torus((4,), True), 100, 4, "ring")
    assert split_chunks(schedule, 1 << 20) is schedule
    with pytest.raises(ValueError, match="max_chunk_bytes must hold one element"):
        split_chunks(schedule, 3)


def test_core_threads_give_the_same_report_and_gradients_in_process():
    from pod.runtime.actor import ChipActor
    from pod.runtime.coordinator import chip_arguments

    plan = quickstart_plan()
    args, kwargs = chip_arguments(plan, 1, in_process=True)
    chips = [ChipActor(*args, **kwargs, core_threads=threads) for threads in (False, True)]
    assert chips[1]._pool is not None and chips[0]._pool is None
    data = plan.dataset
    x, y = data.x_train[:plan.per_chip_batch], data.y_train[:plan.per_chip_batch]
    reports = [chip.compute(0, x, y, 0, trace=True) for chip in chips]
    assert reports[0] == reports[1]
    np.testing.assert_array_equal(chips[0].get_buffer(), chips[1].get_buffer())
    with pytest.raises(RuntimeError, match="train_step before set_collective"):
        chips[0].train_step(1, x, y, 0, run_id=1)

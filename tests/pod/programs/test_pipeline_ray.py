"""A pipelined transformer on Ray chip actors (slow tier): activations and gradients
move stage to stage by ppermute over the ICI transport, and the run equals the
in-process one (every group has two devices, so the ring's sums are LocalMesh's bit
for bit) with the same simulated step."""

from __future__ import annotations

import numpy as np
import pytest

from pod.config.plan import build_plan
from pod.config.scenario import parse_scenario
from pod.runtime.local import LocalPod

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

STEPS = 3


def _plan():
    return build_plan(parse_scenario({
        "name": "pipeline-ray",
        "pod": {"slice": "v5e-8", "mesh": {"stage": 2, "fsdp": 2, "tensor": 2}},
        "model": {"name": "transformer", "options": {
            "embed_dim": 16, "heads": 4, "head_dim": 4, "mlp_dim": 32, "layers": 4}},
        "data": {"name": "synthetic_text",
                 "options": {"vocabulary": 32, "sequence_length": 8, "num_examples": 80},
                 "test_fraction": 0.2},
        "training": {"global_batch": 8, "steps": STEPS, "microbatches": 2,
                     "pipeline_schedule": "1f1b",
                     "optimizer": {"name": "adamw", "learning_rate": 0.01}},
        "metrics": {"port": 0}}))


def _train(pod):
    stats = [pod.step(s) for s in range(STEPS)]
    assert pod.replicas_identical()
    return stats, pod.checkpoint_state(), pod.evaluate()


def test_a_pipelined_run_on_ray_actors_equals_the_in_process_run():
    from pod.runtime.pod import Pod

    plan = _plan()
    with Pod(plan) as pod:
        ray_stats, ray_state, ray_eval = _train(pod)
    with LocalPod(plan) as pod:
        local_stats, local_state, local_eval = _train(pod)
    assert ray_state["digests"] == local_state["digests"]
    for key, value in local_state["params"].items():
        np.testing.assert_array_equal(ray_state["params"][key], value)
    assert [s.loss for s in ray_stats] == [s.loss for s in local_stats]
    assert [s.step_seconds for s in ray_stats] == [s.step_seconds for s in local_stats]
    assert ray_stats[-1].pipeline_bubble_seconds > 0
    assert ray_stats[-1].axis_collective_bytes["stage"] > 0
    assert ray_eval.sums == local_eval.sums

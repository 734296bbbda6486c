"""Data-parallel training ({data: N}, the replicated program): the numerics and the
step's figures in this process (``LocalPod``); on Ray chip actors (``Pod``) the same
program gives the same figures and, to float32 rounding, the same parameters."""

from __future__ import annotations

import dataclasses
import json
import urllib.request

import numpy as np
import pytest

from chip import TensorCore, get_chip_spec
from pod.config.plan import batch_indices, build_plan
from pod.config.scenario import parse_scenario
from pod.runtime.local import LocalPod
from pod.workloads import build_optimizer


def mlp_scenario(**training):
    return parse_scenario({
        "name": "pod-test",
        "pod": {"slice": "v2-8"},  # 4 chips, 8 TensorCores: 8 devices
        "model": {"name": "mlp", "options": {"hidden": [32], "dropout": False}},
        "data": {"name": "digits"},
        "training": {"global_batch": 64, "steps": 3,
                     "optimizer": {"name": "adam", "learning_rate": 0.01}, **training},
        "metrics": {"port": 0},
    })


def single_process_params(plan):
    """The reference: one TensorCore training on the whole global batch of each step."""
    scenario = plan.scenario
    core = TensorCore(get_chip_spec("v2").core, numerics=True)
    opt = build_optimizer(scenario.training.optimizer.name, **scenario.training.optimizer.options())
    params = plan.model.init_params(scenario.training.seed)
    state = opt.init(params)
    data = plan.dataset
    for step in range(plan.steps):
        idx = batch_indices(data.x_train.shape[0], plan.global_batch, step, scenario.training.seed)
        _, grads = plan.model.loss_and_grads(core, params, data.x_train[idx], data.y_train[idx],
                                             rng=np.random.default_rng(0))
        params, state = opt.update(core, grads, state, params, step + 1)
    return params


@pytest.fixture(scope="module")
def trained():
    """A v2-8 pod in this process after 3 steps, its step stats, and its plan."""
    plan = build_plan(mlp_scenario())
    with LocalPod(plan) as pod:
        stats = [pod.step(s) for s in range(plan.steps)]
        yield pod, stats, plan


def test_replicas_stay_bit_identical_and_the_check_can_fail(trained):
    pod, _, plan = trained
    shards = pod.shards()
    assert len(shards) == plan.mesh.size == 8  # a device per TensorCore on v2
    assert pod.replicas_identical()
    for shard in shards[1:]:
        for name, value in shard.params.items():
            assert value.tobytes() == shards[0].params[name].tobytes(), name
    # parameters did move away from their start
    start = plan.model.init_params(plan.scenario.training.seed)
    assert any(not np.array_equal(start[k], shards[5].params[k]) for k in start)
    # and one ulp on one device is seen, by the check and by the checkpoint
    from pod.errors import CheckpointError

    device = pod.devices[5]
    kept = device.state
    name = next(iter(kept.params))
    bumped = dict(kept.params)
    bumped[name] = np.nextafter(kept.params[name], np.float32(np.inf)).astype(np.float32)
    device.state = dataclasses.replace(kept, params=bumped)
    try:
        assert not pod.replicas_identical()
        with pytest.raises(CheckpointError, match="device 5 differs from its data replica 0"):
            pod.checkpoint_state()
    finally:
        device.state = kept
    assert pod.replicas_identical()


def test_parameters_match_single_process_training_on_the_whole_batch(trained):
    pod, _, plan = trained
    want = single_process_params(plan)
    emulated = pod.shards()[5].params  # chip 2, TensorCore 1
    for name in want:
        np.testing.assert_allclose(emulated[name], want[name], rtol=1e-4, atol=2e-5,
                                   err_msg=name)


def test_step_time_is_the_sum_of_its_simulated_parts(trained):
    _, stats, plan = trained
    peak = get_chip_spec("v2").peak_bf16_flops_per_s  # the chip's: two TensorCores
    for s in stats:
        parts = s.infeed_seconds + s.compute_seconds + s.collective_seconds + s.update_seconds
        assert s.serial_step_seconds == pytest.approx(parts)
        # the critical path: what is not hidden (one gradient bucket here: the allreduce
        # starts when the backward pass ends, so all of it is exposed; infeed hides
        # behind the step)
        assert s.exposed_collective_seconds == pytest.approx(s.collective_seconds)
        assert s.exposed_infeed_seconds == 0.0 < s.infeed_seconds
        assert s.step_seconds == pytest.approx(s.compute_seconds + s.collective_seconds
                                               + s.update_seconds)
        assert s.compute_seconds > 0 and s.collective_seconds > 0 and s.update_seconds > 0
        assert set(s.axis_collective_seconds) == {"data"}
        assert s.axis_collective_seconds["data"] == pytest.approx(s.collective_seconds)
        # MXU FLOPs of the MLP 64 -> 32 -> 10 over the global batch: forward, weight
        # gradients, and the input gradient of the second layer only (the first
        # layer's input gradient is not needed and not computed).
        forward = 2 * (64 * 32 + 32 * 10)
        backward = 2 * (64 * 32 + 32 * 10) + 2 * 32 * 10
        assert s.model_flops == plan.global_batch * (forward + backward)
        assert sum(s.device_mxu_flops.values()) == s.model_flops
        # MFU over the pod's peak: 8 TensorCores of half a chip's peak each = 4 chips
        assert s.peak_flops_per_s == pytest.approx(4 * peak)
        assert s.mfu == pytest.approx(s.model_flops / s.step_seconds / (4 * peak))
        assert 0 < s.mfu < 1
    assert stats[-1].loss < stats[0].loss


def test_ici_bytes_match_the_ring_formula(trained):
    _, stats, plan = trained
    n = plan.topology.chips
    payload = plan.num_params * 4
    # the chip's two TensorCores add on chip; a ring allreduce over the chips sends
    # 2 (n-1)/n of the buffer out of every chip
    expected = 2 * (n - 1) * payload
    assert sum(stats[0].ici_link_bytes.values()) == pytest.approx(expected, rel=0.01)
    # the gradient buffer, float32, once per device and step
    assert stats[0].axis_collective_bytes == {"data": payload}


def test_run_training_serves_prometheus_and_writes_summary(tmp_path):
    import socket

    from rich.console import Console

    from pod.commands.train import run_training

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    scraped = []

    def scrape(stats):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            scraped.append(resp.read().decode())

    plan = build_plan(mlp_scenario(steps=2))
    summary = run_training(plan, output_dir=tmp_path, metrics_port=port, on_step=scrape,
                           console=Console(file=open(tmp_path / "log.txt", "w")),
                           backend="local")
    text = scraped[-1]
    for name in ("tpu_pod_simulated_step_seconds_bucket", "tpu_pod_simulated_examples_per_second",
                 "tpu_pod_simulated_flops_per_second", "tpu_pod_mfu_ratio", "tpu_pod_loss",
                 'tpu_pod_hbm_used_bytes{chip="3",core="1"}', "tpu_pod_ici_transferred_bytes_total",
                 "tpu_pod_simulated_collective_seconds_count",
                 'tpu_pod_collective_seconds_total{axis="data"}'):
        assert name in text, name
    eps = [line for line in text.splitlines()
           if line.startswith("tpu_pod_simulated_examples_per_second ")]
    assert float(eps[0].split()[1]) > 0
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written == json.loads(json.dumps(summary))
    for key in ("generation", "chips", "cores", "steps", "global_batch", "initial_loss", "final_loss",
                "test_accuracy", "simulated_step_seconds", "simulated_examples_per_second",
                "simulated_tflops", "mfu", "compute_seconds", "collective_seconds",
                "exposed_collective_seconds", "collectives_by_axis", "mesh", "devices",
                "per_device_batch", "wall_seconds", "hbm_peak_bytes", "replicas_identical"):
        assert key in written, key
    assert written["replicas_identical"] is True
    assert (written["mesh"], written["devices"], written["per_device_batch"]) == ({"data": 8}, 8, 8)
    assert written["simulated_examples_per_second"] == pytest.approx(
        written["global_batch"] / written["simulated_step_seconds"])
    assert (tmp_path / "steps.csv").read_text().count("\n") == 3  # header + 2 steps


# ------------------------------------------------------------------ on Ray

@pytest.mark.slow
def test_the_local_cluster_is_bound_to_loopback(ray_cluster):
    import ray

    assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
    assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")


@pytest.mark.slow
def test_chip_actors_train_as_the_local_pod_does(ray_cluster, trained):
    """The same plan on Ray chip actors (4 actors of 2 devices, gradients over the ICI
    transport's ring): replicas bit-identical, the same simulated figures, the
    parameters to float32 rounding (a ring of 8 sums in another order than
    ``LocalMesh``), and the single-process reference as closely as the local pod."""
    from pod.runtime.pod import Pod

    local, local_stats, plan = trained
    with Pod(plan) as pod:
        stats = [pod.step(s) for s in range(plan.steps)]
        shards = pod.shards()
        assert pod.replicas_identical()
        assert len(pod.actors) == plan.topology.chips == 4
    for got, want in zip(stats, local_stats):
        assert got.step_seconds == want.step_seconds
        assert got.axis_collective_bytes == want.axis_collective_bytes
        assert got.model_flops == want.model_flops
        assert got.loss == pytest.approx(want.loss, rel=1e-5)
    reference = local.shards()
    for d, shard in enumerate(shards):
        for name, value in shard.params.items():
            np.testing.assert_allclose(value, reference[d].params[name], rtol=1e-5, atol=1e-6,
                                       err_msg=f"device {d} {name}")

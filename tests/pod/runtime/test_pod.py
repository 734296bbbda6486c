"""Data-parallel training over chip actors on the shared Ray cluster."""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest

from chip import TensorCore, get_chip_spec
from interconnect import execute, ring_allreduce
from pod.config.plan import batch_indices, build_plan
from pod.config.scenario import parse_scenario
from pod.workloads import build_optimizer

pytestmark = pytest.mark.usefixtures("ray_cluster")


def mlp_scenario(**training):
    return parse_scenario({
        "name": "pod-test",
        "pod": {"slice": "v2-8"},  # 4 chips, 8 TensorCores
        "model": {"name": "mlp", "options": {"hidden": [32], "dropout": False}},
        "data": {"name": "digits"},
        "training": {"global_batch": 64, "steps": 3,
                     "optimizer": {"name": "adam", "learning_rate": 0.01}, **training},
        "metrics": {"port": 0},
    })


@pytest.fixture(scope="module")
def trained():
    """A 4-chip pod after 3 steps, its step stats, and its plan."""
    from pod.runtime.coordinator import Pod

    plan = build_plan(mlp_scenario())
    pod = Pod(plan)
    pod.start()
    stats = [pod.step(s) for s in range(plan.steps)]
    yield pod, stats, plan
    pod.shutdown()


def test_the_local_cluster_is_bound_to_loopback():
    import ray

    assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
    assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")


def test_replicas_stay_bit_identical(trained):
    pod, _, plan = trained
    digests = pod.digests()
    assert len(digests) == plan.pod.chips
    assert all(len(chip) == plan.pod.chip.tensorcores for chip in digests)
    assert pod.replicas_identical()
    # and the check can fail: parameters did move away from their start
    start = plan.model.init_params(plan.scenario.training.seed)
    after = pod.params(chip=3, core=1)
    assert any(not np.array_equal(start[k], after[k]) for k in start)


def test_parameters_match_single_process_training_on_the_whole_batch(trained):
    pod, _, plan = trained
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
    emulated = pod.params(chip=2, core=0)
    for name in params:
        np.testing.assert_allclose(emulated[name], params[name], rtol=1e-4, atol=2e-5,
                                   err_msg=name)


def test_step_time_is_the_sum_of_its_simulated_parts(trained):
    _, stats, plan = trained
    for s in stats:
        parts = s.infeed_seconds + s.compute_seconds + s.allreduce_seconds + s.update_seconds
        assert s.serial_step_seconds == pytest.approx(parts)
        # the critical path: what is not hidden (one gradient bucket here: the allreduce
        # starts when the backward pass ends, so all of it is exposed; infeed hides
        # behind the previous step)
        assert s.exposed_allreduce_seconds == pytest.approx(s.allreduce_seconds)
        assert s.step_seconds == pytest.approx(s.exposed_infeed_seconds + s.compute_seconds
                                               + s.allreduce_seconds + s.update_seconds)
        assert s.compute_seconds > 0 and s.ici_seconds > 0 and s.update_seconds > 0
        # MXU FLOPs of the MLP 64 -> 32 -> 10 over the global batch: forward, weight
        # gradients, and the input gradient of the second layer only (the first
        # layer's input gradient is not needed and not computed).
        forward = 2 * (64 * 32 + 32 * 10)
        backward = 2 * (64 * 32 + 32 * 10) + 2 * 32 * 10
        assert s.model_flops == plan.global_batch * (forward + backward)
        assert 0 < s.mfu < 1
    assert stats[-1].loss < stats[0].loss


def test_ici_bytes_match_the_ring_formula(trained):
    _, stats, plan = trained
    n = plan.pod.chips
    payload = plan.num_params * 4
    # a ring allreduce sends 2 (n-1)/n of the buffer out of every chip
    expected = 2 * (n - 1) * payload
    assert sum(stats[0].ici_link_bytes.values()) == pytest.approx(expected, rel=0.01)


def test_actor_allreduce_equals_numpy_sum_and_the_pure_executor():
    import ray

    from pod.runtime.actor import ChipActor
    from pod.runtime.collective import run_schedule
    from pod.config.slices import resolve_pod

    plan = build_plan(mlp_scenario())
    pod = resolve_pod(chip="v4", topology="2x2x1")
    remote = ray.remote(ChipActor).options(num_cpus=0)
    actors = [remote.remote(pod.chip, r, plan.model, "sgd", {"learning_rate": 0.1}, 0, 8,
                            numerics=True, limit_threads=True) for r in range(pod.chips)]
    rng = np.random.default_rng(7)
    for size in (3, 1001):
        buffers = [rng.standard_normal(size).astype(np.float32) for _ in actors]
        schedule = ring_allreduce(pod.torus, size)
        ray.get([a.set_chunk_bounds.remote(schedule.chunk_bounds) for a in actors])
        ray.get([a.set_buffer.remote(b) for a, b in zip(actors, buffers)])
        ray.get(run_schedule(actors, schedule))
        results = ray.get([a.get_buffer.remote() for a in actors])
        reference = execute(schedule, buffers)
        total = np.sum(np.stack(buffers).astype(np.float64), axis=0)
        for got, ref in zip(results, reference):
            np.testing.assert_array_equal(got, ref)
            np.testing.assert_allclose(got, total, rtol=1e-5, atol=1e-5)
    for actor in actors:
        ray.kill(actor)


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
                           console=Console(file=open(tmp_path / "log.txt", "w")))
    text = scraped[-1]
    for name in ("tpu_pod_simulated_step_seconds_bucket", "tpu_pod_simulated_examples_per_second",
                 "tpu_pod_simulated_flops_per_second", "tpu_pod_mfu_ratio", "tpu_pod_loss",
                 'tpu_pod_hbm_used_bytes{chip="3",core="1"}', "tpu_pod_ici_transferred_bytes_total",
                 "tpu_pod_simulated_allreduce_seconds_count"):
        assert name in text, name
    eps = [line for line in text.splitlines()
           if line.startswith("tpu_pod_simulated_examples_per_second ")]
    assert float(eps[0].split()[1]) > 0
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written == json.loads(json.dumps(summary))
    for key in ("generation", "chips", "cores", "steps", "global_batch", "initial_loss", "final_loss",
                "test_accuracy", "simulated_step_seconds", "simulated_examples_per_second",
                "simulated_tflops", "mfu", "compute_seconds", "allreduce_seconds",
                "wall_seconds", "hbm_peak_bytes", "replicas_identical"):
        assert key in written, key
    assert written["replicas_identical"] is True
    assert written["simulated_examples_per_second"] == pytest.approx(
        written["global_batch"] / written["simulated_step_seconds"])
    assert (tmp_path / "steps.csv").read_text().count("\n") == 3  # header + 2 steps

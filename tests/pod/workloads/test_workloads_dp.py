"""Data parallelism per model, checkpoints, and the seed scenarios end to end, all in
process (no Ray).

- The replicated program (``pod.programs.ReplicatedProgram``) on a ``LocalMesh`` of
  four replicas against single-process training on the whole batch, for every model;
  BatchNorm against a reference computing per-shard statistics; a plan's
  ``{data: 8}`` on a ``LocalPod`` against the same reference on its global batches.
- Checkpoints: round trip, checksum, atomic write, no pickle.
- Each seed scenario runs two steps in process (shrunk by overrides), and
  ``tpu-pod generate`` samples from the char LSTM's checkpoint.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from chip import TensorCore, get_chip_spec
from pod.errors import CheckpointError
from pod.programs import DeviceCoords, LocalMesh, ReplicatedProgram, combine_buckets
from pod.state.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from pod.workloads import build_model, build_optimizer, load_dataset

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True, scope="module")
def one_blas_thread():
    with threadpool_limits(limits=1, user_api="blas"):
        yield


#: The optimizer of the data-parallel comparisons: plain SGD, whose update moves a parameter by
#: lr x its gradient, so float32 reordering of the gradient sums (the allreduce adds in
#: another order than one process) stays at float32's relative size in the parameters on any
#: CPU. Adam divides by the root of tiny second moments and turns the same reordering into
#: 0.5% differences on some CPUs (pitfalls.md, "Adam amplifies float32 reordering"); Adam's
#: own update is tested against its formula in test_workloads.py and test_transformer.py.
SGD = ("sgd", {"learning_rate": 0.1})


def train_data_parallel(model, x_steps, y_steps, *, replicas=4, opt=SGD):
    """The replicated program on a LocalMesh of ``replicas`` v2 TensorCores, a gradient
    bucket per layer. Returns replica 0's params and every replica's model state."""
    program = ReplicatedProgram(model, {"data": replicas}, build_optimizer(opt[0], **opt[1]),
                                buckets=combine_buckets(model.gradient_buckets(), 1))

    def device(comm):
        core = TensorCore(get_chip_spec("v2").core, numerics=True)
        coords = DeviceCoords.of(comm)
        shard = program.init_local(0, coords)
        for step, (x, y) in enumerate(zip(x_steps, y_steps)):
            part = program.batch_slice(x.shape[0], coords)
            shard = program.train_step(core, comm, shard, x[part], y[part], step + 1).shard
            core.take_records()
        return shard

    shards = LocalMesh({"data": replicas}).run(device)
    for shard in shards[1:]:                                             # replicas bit-identical
        for tree in ("params", "opt_state"):
            mine, first = getattr(shard, tree), getattr(shards[0], tree)
            assert all(np.array_equal(mine[k], first[k]) for k in first), tree
    return program.assemble(shards), [dict(s.model_state) for s in shards]


def train_reference(model, x_steps, y_steps, *, shards=1, opt=SGD):
    """Single process: the mean gradient over ``shards`` equal parts of each
    batch (shards=1: the whole batch at once), state from each shard."""
    core = TensorCore(get_chip_spec("v2").core, numerics=True)
    optimizer = build_optimizer(opt[0], **opt[1])
    params = model.init_params(0)
    states = [model.init_state() for _ in range(shards)]
    opt_state = optimizer.init(params)
    for step, (x, y) in enumerate(zip(x_steps, y_steps)):
        b = x.shape[0] // shards
        total = None
        for s in range(shards):
            _, g, states[s] = model.loss_grads_and_state(core, params, x[s * b:(s + 1) * b],
                                                         y[s * b:(s + 1) * b], state=states[s])
            total = g if total is None else {k: total[k] + g[k] for k in g}
        grads = {k: (v / np.float32(shards)).astype(np.float32) for k, v in total.items()}
        params, opt_state = optimizer.update(core, grads, opt_state, params, step + 1)
    return params, states


def _batches(ds, batch, steps):
    rng = np.random.default_rng(0)
    idx = [rng.choice(len(ds.x_train), batch, replace=False) for _ in range(steps)]
    return [ds.x_train[i] for i in idx], [ds.y_train[i] for i in idx]


def _close(a, b, rtol=2e-4, atol=2e-5):
    for k in b:
        np.testing.assert_allclose(a[k], b[k], rtol=rtol, atol=atol, err_msg=k)


@pytest.mark.parametrize("name", ["cnn", "lstm_classifier", "char_lstm"])
def test_data_parallel_equals_single_process_on_the_whole_batch(name):
    if name == "cnn":
        ds = load_dataset("digits")
        model = build_model("cnn", ds.example_shape, 10, dropout=False)
    elif name == "lstm_classifier":
        ds = load_dataset("synthetic", shape=[10], vocabulary=50, num_classes=2, num_examples=200)
        model = build_model(name, (10,), 2, vocabulary=50, embedding_dim=8, units=12)
    else:
        ds = load_dataset("text", sequence_length=12)
        model = build_model(name, (12,), ds.num_classes, embedding_dim=8, units=16)
    xs, ys = _batches(ds, 16, 3)
    dp, _ = train_data_parallel(model, xs, ys)
    ref, _ = train_reference(model, xs, ys, shards=1)
    _close(dp, ref)
    assert not np.array_equal(dp[next(iter(dp))], model.init_params(0)[next(iter(dp))])


def test_batchnorm_data_parallel_matches_per_shard_statistics_reference():
    ds = load_dataset("digits")
    model = build_model("mlp", ds.example_shape, 10, hidden=[32, 16], batch_norm=True)
    xs, ys = _batches(ds, 32, 3)
    dp, dp_states = train_data_parallel(model, xs, ys)                   # 4 replicas of 8
    ref, ref_states = train_reference(model, xs, ys, shards=4)
    _close(dp, ref)
    for got, want in zip(dp_states, ref_states):                         # each replica: its shards
        _close(got, want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(dp_states[0]["bn1/moving_mean"], dp_states[1]["bn1/moving_mean"])
    # and whole-batch statistics would give something else: the check can fail
    whole, _ = train_reference(model, xs, ys, shards=1)
    assert max(np.abs(whole[k] - dp[k]).max() for k in dp) > 1e-3


def test_a_plans_data_parallel_pod_trains_as_one_process_on_its_global_batches():
    """A {data: 8} plan on a v2-8 (a device per TensorCore) run by LocalPod: its batches,
    split and gradient buckets; the parameters after 3 steps are those of one process
    on the same global batches (the pod's own ``batch``), within float32 reordering."""
    from pod.config.plan import build_plan
    from pod.config.scenario import parse_scenario
    from pod.runtime.local import LocalPod

    plan = build_plan(parse_scenario({
        "name": "dp", "pod": {"slice": "v2-8"},
        "model": {"name": "cnn", "options": {"dropout": False}}, "data": {"name": "digits"},
        "training": {"global_batch": 64, "steps": 3, "overlap_bucket_bytes": 4096,
                     "optimizer": {"name": SGD[0], **SGD[1]}},
        "metrics": {"port": 0}}))
    assert plan.mesh.sizes == {"data": 8} and plan.per_device_batch == 8
    with LocalPod(plan) as pod:
        assert len(pod.program.buckets) > 1                              # overlapped buckets
        batches = [pod.batch(step) for step in range(3)]
        for step in range(3):
            pod.step(step)
        assert pod.replicas_identical()
        got = pod.checkpoint_state()["params"]
    want, _ = train_reference(plan.model, [x for x, _ in batches], [y for _, y in batches])
    _close(got, want)
    assert not np.array_equal(got["conv1/kernel"], plan.model.init_params(0)["conv1/kernel"])


# --------------------------------------------------------------------------- checkpoints

def test_checkpoint_round_trip_checksum_and_no_pickle(tmp_path):
    rng = np.random.default_rng(0)
    ck = Checkpoint(step=7, scenario={"name": "x", "model": {"name": "mlp"}},
                    params={"a/kernel": rng.standard_normal((3, 4)).astype(np.float32),
                            "a/bias": np.zeros(4, np.float32)},
                    model_state={"bn/moving_mean": np.arange(4, dtype=np.float32)},
                    optimizer_state={"a/kernel/m": np.ones((3, 4), np.float32)},
                    extra={"vocabulary": "ab\n", "input_shape": [3]})
    path = save_checkpoint(tmp_path / "ck" / "c.msgpack", ck)
    assert [p.name for p in path.parent.iterdir()] == ["c.msgpack"]     # temp file renamed away
    back = load_checkpoint(path)
    assert back.step == 7 and back.scenario == ck.scenario and back.extra == ck.extra
    for field in ("params", "model_state", "optimizer_state"):
        want, got = getattr(ck, field), getattr(back, field)
        assert list(got) == list(want)
        for k in want:
            assert got[k].dtype == want[k].dtype and np.array_equal(got[k], want[k])
    raw = bytearray(path.read_bytes())
    assert b"pickle" not in raw and raw[:1] != b"\x80"                   # msgpack, not a pickle
    raw[-20] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        load_checkpoint(path)
    path.write_bytes(bytes(raw[:40]))
    with pytest.raises(CheckpointError, match="truncated|not a tpu-pod-checkpoint"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="cannot read"):
        load_checkpoint(tmp_path / "missing.msgpack")
    with pytest.raises(CheckpointError, match="dtype object"):
        save_checkpoint(tmp_path / "o.msgpack", Checkpoint(0, {}, {"x": np.array([None])}))


# --------------------------------------------------------------------------- scenarios

SHRINK = {
    "seed-cifar-mlp-v3-8.yaml": {"model__options": {"hidden": [64, 32], "batch_norm": True,
                                                    "dropout": 0.5},
                                 "training__global_batch": 64},
    "seed-mnist-cnn-v2-8.yaml": {},
    "seed-imdb-lstm-v2-8.yaml": {"data__options": {"shape": [20], "vocabulary": 15000,
                                                   "num_classes": 2, "num_examples": 256},
                                 "training__global_batch": 32},
    "char-lstm.yaml": {"data__options": {"sequence_length": 16}, "training__global_batch": 32},
}


@pytest.mark.parametrize("filename", sorted(SHRINK))
def test_seed_scenarios_run_two_steps(filename, tmp_path):
    from rich.console import Console

    from pod.config.plan import build_plan
    from pod.commands.train import run_training
    from pod.config.scenario import load_scenario

    scenario = load_scenario(ROOT / "scenarios" / filename)
    scenario = scenario.with_overrides(training__steps=2, metrics__port=0,
                                       checkpoint={"every_steps": 2}, **SHRINK[filename])
    plan = build_plan(scenario)
    log = tmp_path / "log.txt"
    with log.open("w") as f:
        summary = run_training(plan, output_dir=tmp_path, console=Console(file=f, width=150),
                               log_every=1, backend="local")
    text = log.read_text()
    assert "Model: " in text and "sim time / step" in text               # the summary table
    assert summary["steps"] == 2 and summary["replicas_identical"] is True
    assert summary["synthetic_data"] == plan.dataset.synthetic
    if plan.dataset.synthetic:
        assert "(synthetic)" in text
    assert np.isfinite(summary["final_loss"]) and summary["simulated_step_seconds"] > 0
    ck = load_checkpoint(tmp_path / "checkpoints" / "ckpt-00000002.msgpack")
    assert ck.step == 2 and set(ck.params) == set(plan.model.param_shapes)
    assert set(ck.model_state) == set(plan.model.state_shapes)
    if filename == "char-lstm.yaml":
        out = subprocess.run([sys.executable, "-m", "pod", "generate", str(tmp_path / "checkpoints"),
                              "--prompt", "The ", "--length", "40", "--seed", "1"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith("The ") and len(out.stdout.rstrip("\n")) >= 40
        assert set(out.stdout.rstrip("\n")) <= set(ck.extra["vocabulary"])
        bad = subprocess.run([sys.executable, "-m", "pod", "generate",
                              str(tmp_path / "checkpoints"), "--prompt", "\u00e9\u00e9"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert bad.returncode == 2 and "not in the model's vocabulary" in bad.stderr
    json.loads((tmp_path / "summary.json").read_text())

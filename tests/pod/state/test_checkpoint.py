"""Checkpoints: the file format, keeping the last K, resume bit-identical, corrupted files skipped."""

from __future__ import annotations

import hashlib
import io
import json

import msgpack
import numpy as np
import pytest
from rich.console import Console

from pod.errors import CheckpointError
from pod.state.checkpoint import (Checkpoint, checkpoint_path, latest_checkpoint, list_checkpoints,
                                  load_checkpoint, params_digest, prune_checkpoints, save_checkpoint)
from pod.state.resume import RunCheckpoints, check_compatible, pod_checkpoint
from pod.config.plan import build_plan
from pod.config.scenario import parse_scenario


def scenario(steps=6, checkpoint=None, faults=(), name="ckpt-test", **options):
    """A v2-8 MLP with BatchNorm and dropout (per-replica state, per-core streams)."""
    data = {
        "name": name,
        "pod": {"slice": "v2-8"},  # 4 chips, 8 TensorCores
        # BatchNorm (per-replica state) and dropout (per (step, chip, core) streams)
        "model": {"name": "mlp", "options": {"hidden": [32], "batch_norm": True, "dropout": 0.2,
                                             **options}},
        "data": {"name": "digits"},
        "training": {"global_batch": 64, "steps": steps, "seed": 3,
                     "optimizer": {"name": "adam", "learning_rate": 0.01}},
        "metrics": {"port": 0},
        "faults": list(faults),
    }
    if checkpoint:
        data["checkpoint"] = checkpoint
    return parse_scenario(data)


def run(tmp, sc, backend="local", **kw):
    """``run_training`` of a scenario, in this process unless ``backend="ray"``; (summary, log)."""
    from pod.commands.train import run_training

    log = io.StringIO()
    summary = run_training(build_plan(sc), output_dir=tmp, console=Console(file=log, width=200),
                           log_every=1, backend=backend, **kw)
    return summary, log.getvalue()


def state_bytes(ck: Checkpoint) -> dict[str, bytes]:
    """Every array of the training state, as raw bytes (params, optimizer, each replica's state)."""
    out = {f"p/{k}": v.tobytes() for k, v in ck.params.items()}
    out |= {f"o/{k}": v.tobytes() for k, v in ck.optimizer_state.items()}
    for c, chip in enumerate(ck.replica_model_state):
        for r, state in enumerate(chip):
            out |= {f"m/{c}/{r}/{k}": v.tobytes() for k, v in state.items()}
    return out


# ------------------------------------------------------------------ no Ray: the format

def small(step=1, **kw):
    return Checkpoint(step=step, scenario={"name": "x"}, params={"w": np.arange(6, dtype=np.float32)
                                                                 .reshape(2, 3)},
                      optimizer_state={"m": np.ones(3, np.float32)}, **kw)


def test_round_trip_of_every_field_without_pickle(tmp_path):
    ck = small(step=7, replica_model_state=[[{"mean": np.full(2, 0.5, np.float32)}]],
               rng={"seed": 3}, data_position={"epoch": 1, "index": 2},
               digests={"params": "ab"}, run_state={"totals": {"steps": 7}})
    path = save_checkpoint(tmp_path / "c.msgpack", ck)
    back = load_checkpoint(path)
    assert back.step == 7 and back.rng == {"seed": 3} and back.run_state["totals"]["steps"] == 7
    assert back.data_position == {"epoch": 1, "index": 2}
    np.testing.assert_array_equal(back.replica_model_state[0][0]["mean"], [0.5, 0.5])
    assert back.params["w"].tobytes() == ck.params["w"].tobytes()
    # the outer map really is msgpack with a sha256 of the body: an independent check
    outer = msgpack.unpackb(path.read_bytes(), raw=False)
    assert outer["sha256"] == hashlib.sha256(outer["body"]).hexdigest()
    assert b"pickle" not in path.read_bytes() and not path.read_bytes().startswith(b"\x80")


def test_prune_keeps_the_newest_k_and_latest_skips_a_corrupted_one(tmp_path):
    for step in (2, 4, 6, 8):
        save_checkpoint(checkpoint_path(tmp_path, step), small(step))
    removed = prune_checkpoints(tmp_path, keep=3)
    assert [p.name for p in removed] == ["ckpt-00000002.msgpack"]
    assert [s for s, _ in list_checkpoints(tmp_path)] == [8, 6, 4]
    newest = checkpoint_path(tmp_path, 8)
    newest.write_bytes(newest.read_bytes()[:-10])           # truncated
    flipped = bytearray(checkpoint_path(tmp_path, 6).read_bytes())
    flipped[-5] ^= 0xFF                                      # one corrupted byte in the body
    checkpoint_path(tmp_path, 6).write_bytes(bytes(flipped))
    warnings = []
    ck = latest_checkpoint(tmp_path, warn=warnings.append)
    assert ck.step == 4
    assert len(warnings) == 2 and "ckpt-00000008.msgpack" in warnings[0] \
        and "ckpt-00000006.msgpack" in warnings[1] and "checksum" in warnings[1]


def test_a_checkpoint_of_replicas_that_differ_is_refused():
    """The pod compares every device's digests with its data replica 0's before it
    assembles anything: one differing device is named."""
    from pod.runtime.actor import DeviceSnapshot
    from pod.runtime.base import PodBase

    class FakePod(PodBase):
        def _snapshot(self, full):
            return [DeviceSnapshot(d, ("b" if d == 3 else "a", "o"), {}, None)
                    for d in range(len(full))]

    FakePod.__abstractmethods__ = frozenset()  # a checkpoint needs only its _snapshot

    plan = build_plan(scenario(batch_norm=False))
    with pytest.raises(CheckpointError, match=r"device 3 differs from its data replica 0 "
                                              r"\(b != a\); replicas are not bit-identical"):
        pod_checkpoint(FakePod(plan), plan, 3)


def test_resume_refuses_another_scenario_and_a_used_directory(tmp_path):
    plan = build_plan(scenario())
    other = build_plan(scenario(hidden=[16]))
    ck = Checkpoint(step=2, scenario=other.scenario.model_dump(mode="json"), params={})
    with pytest.raises(CheckpointError, match=r"model\.options is .*16.* in the checkpoint"):
        check_compatible(ck, plan)
    save_checkpoint(checkpoint_path(tmp_path / "c", 4), small(4))
    plan = build_plan(scenario(checkpoint={"every_steps": 2, "dir": str(tmp_path / "c")}))
    with pytest.raises(CheckpointError, match="already holds 1 checkpoint.*--resume"):
        RunCheckpoints(plan, tmp_path)
    assert RunCheckpoints(plan, tmp_path, resume_dir=tmp_path / "c").dir == tmp_path / "c"


def test_digest_is_sha256_of_the_raw_bytes_in_order():
    import hashlib

    arrays = {"a": np.arange(4, dtype=np.float32), "b": np.ones((2, 2), np.float32)}
    expected = hashlib.sha256(arrays["a"].tobytes() + arrays["b"].tobytes()).hexdigest()
    assert params_digest(arrays) == expected
    assert params_digest(dict(reversed(arrays.items()))) != expected  # order matters


# ------------------------------------------------------------------ resume (in process)

@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference: 6 steps in one go, checkpoints every 2 steps."""
    out = tmp_path_factory.mktemp("whole")
    summary, _ = run(out, scenario(checkpoint={"every_steps": 2, "keep": 5}))
    return out, summary, load_checkpoint(checkpoint_path(out / "checkpoints", 6))


def test_stop_at_k_and_resume_is_bit_identical(uninterrupted, tmp_path):
    _, whole_summary, whole = uninterrupted
    ckpt = {"every_steps": 2, "keep": 5}
    first, _ = run(tmp_path, scenario(steps=4, checkpoint=ckpt))   # stops after step 4
    assert first["steps"] == 4
    summary, log = run(tmp_path, scenario(steps=6, checkpoint=ckpt),
                       resume_dir=tmp_path / "checkpoints")
    assert "Resuming from" in log and "ckpt-00000004.msgpack" in log
    resumed = load_checkpoint(checkpoint_path(tmp_path / "checkpoints", 6))
    assert state_bytes(resumed) == state_bytes(whole)
    assert resumed.digests == whole.digests
    # and the check can fail: the state did move between steps 4 and 6
    four = load_checkpoint(checkpoint_path(tmp_path / "checkpoints", 4))
    assert state_bytes(four) != state_bytes(whole)
    # the summary continues the same sums: its simulated figures and losses are the same
    for key in ("steps", "initial_loss", "final_loss", "test_loss", "test_accuracy",
                "simulated_step_seconds", "mfu", "hbm_peak_bytes"):
        assert summary[key] == whole_summary[key], key
    assert summary["resumed_from_step"] == 4 and summary["replicas_identical"] is True
    rows = (tmp_path / "steps.csv").read_text().splitlines()
    assert len(rows) == 7 and [r.split(",")[0] for r in rows[1:]] == [str(s) for s in range(1, 7)]


def test_a_corrupted_newest_checkpoint_is_skipped_with_a_warning(uninterrupted, tmp_path):
    _, _, whole = uninterrupted
    ckpt = {"every_steps": 2, "keep": 5}
    run(tmp_path, scenario(steps=4, checkpoint=ckpt))
    newest = checkpoint_path(tmp_path / "checkpoints", 4)
    newest.write_bytes(newest.read_bytes()[: len(newest.read_bytes()) // 2])   # truncated
    summary, log = run(tmp_path, scenario(steps=6, checkpoint=ckpt),
                       resume_dir=tmp_path / "checkpoints")
    text = " ".join(log.split())
    assert f"warning: skipping checkpoint {newest}" in text
    assert summary["resumed_from_step"] == 2
    resumed = load_checkpoint(checkpoint_path(tmp_path / "checkpoints", 6))
    assert state_bytes(resumed) == state_bytes(whole)
    assert json.loads((tmp_path / "summary.json").read_text())["completed"] is True

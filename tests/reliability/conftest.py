"""The inputs of issue 34's probes, made once per session: hostile files (a FIFO, a
3 GB sparse file, checkpoints declaring what they do not hold), small scenarios, a
checkpoint of a tiny transformer (its initial state: no training), and for the slow
tier a finished run of it to resume."""

from __future__ import annotations

import copy
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
import yaml

from tests.reliability.harness import ROOT

TINY = {
    "name": "tiny",
    "pod": {"slice": "v4-8"},
    "model": {"name": "transformer", "options": {"embed_dim": 32, "heads": 2, "head_dim": 16,
                                                 "mlp_dim": 64, "layers": 2}},
    "data": {"name": "text", "options": {"sequence_length": 32}, "test_fraction": 0.05},
    "training": {"global_batch": 16, "steps": 4, "eval_every_steps": 2,
                 "optimizer": {"name": "adamw", "learning_rate": 0.003}},
    "metrics": {"port": 0},
    "checkpoint": {"every_steps": 2},
}


def _write_yaml(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _checkpoint(directory: Path) -> Path:
    """A tiny transformer's checkpoint at step 0 (``initial_checkpoint``: no training)."""
    from pod.config.plan import build_plan
    from pod.config.scenario import parse_scenario
    from pod.state.checkpoint import checkpoint_path, save_checkpoint
    from pod.state.resume import initial_checkpoint

    plan = build_plan(parse_scenario(TINY, source="tiny"))
    return save_checkpoint(checkpoint_path(directory, 2), initial_checkpoint(plan))


def _lying(source: Path, target: Path, edit) -> Path:
    """``source`` with its body edited and its checksum made right again: what a crafted
    checkpoint looks like (the checksum guards against damage, not against a forger)."""
    outer = msgpack.unpackb(source.read_bytes(), raw=False)
    body = msgpack.unpackb(outer["body"], raw=False)
    edit(body)
    raw = msgpack.packb(body, use_bin_type=True)
    target.write_bytes(msgpack.packb({**outer, "body": raw,
                                      "sha256": hashlib.sha256(raw).hexdigest()},
                                     use_bin_type=True))
    return target


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """The probes' input files, in one directory (``{tmp}`` of the probes)."""
    tmp = tmp_path_factory.mktemp("corpus")
    os.mkfifo(tmp / "fifo.yml")
    with (tmp / "sparse.yml").open("wb") as f:
        f.write(b"base_emb_dim: 4096\n")
        f.truncate(3 << 30)
    _write_yaml(tmp / "tiny.yaml", TINY)
    _write_yaml(tmp / "layers.yaml", {**TINY, "model": {"name": "transformer", "options": {
        **TINY["model"]["options"], "layers": 1_000_000_000}}})
    _write_yaml(tmp / "bench_cpu.yaml", {"name": "bench-cpu", "pod": {"slice": "v2-8"},
                                         "metrics": {"port": 0}, "benchmark": {
                                             "kind": "matmul", "n": 4096, "cpu_n": 8192,
                                             "cpu_iterations": 10000}})
    _write_yaml(tmp / "bench_big.yaml", {"name": "bench-big", "pod": {"slice": "v5p-8"},
                                         "metrics": {"port": 0}, "benchmark": {
                                             "kind": "matmul", "n": 40000, "iterations": 10,
                                             "functional": True}})
    sweep = yaml.safe_load((ROOT / "scenarios" / "scaling-v5e-strong.yaml").read_text())
    sweep["sweep"].update(global_batch=list(range(1, 2001)), precision=["bf16", "fp32"],
                          allreduce=["ring", "torus", "bidirectional_ring", "halving_doubling"])
    _write_yaml(tmp / "bigsweep.yaml", sweep)
    small = copy.deepcopy(sweep)
    small["sweep"].update(chips=[1, 4, 16], global_batch=[256], precision=None,
                          allreduce=["ring"])
    _write_yaml(tmp / "sweep.yaml", small)
    ck = tmp / "ck"
    legit = _checkpoint(ck)

    def huge_shape(body):
        name = next(iter(body["params"]))
        body["params"][name].update(shape=[2**32, 2**32], data=b"")

    def huge_model(body):
        body["scenario"]["model"]["options"].update(embed_dim=1 << 20, head_dim=1 << 16,
                                                    layers=4096)

    def many_layers(body):
        body["scenario"]["model"]["options"]["layers"] = 600

    bad = tmp / "bad"
    bad.mkdir()
    _lying(legit, bad / "huge_shape.msgpack", huge_shape)
    _lying(legit, bad / "huge_model.msgpack", huge_model)
    _lying(legit, bad / "many_layers.msgpack", many_layers)
    sparse_ck = tmp / "sparse_ck"
    sparse_ck.mkdir()
    (sparse_ck / legit.name).write_bytes(legit.read_bytes())
    with (sparse_ck / "ckpt-00000009.msgpack").open("wb") as f:
        f.truncate(20 << 30)
    (tmp / "victim.txt").write_text("the victim's data\n")
    (tmp / "out").mkdir()
    os.symlink("/proc/self/fd/1", tmp / "out" / "proc_link.safetensors")
    os.symlink("/dev/null", tmp / "out" / "null_link.safetensors")
    os.mkfifo(tmp / "out" / "fifo.safetensors")
    os.symlink(tmp / "victim.txt", tmp / "out" / "planted.yaml")
    return tmp


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory, corpus) -> Path:
    """A finished 4-step run of the tiny transformer (in this process's devices: no Ray)
    with its checkpoints, steps.csv and summary.json: what the resume probes start from."""
    out = tmp_path_factory.mktemp("run") / "run"
    subprocess.run([sys.executable, "-m", "pod", "run", str(corpus / "tiny.yaml"),
                    "--in-process", "--output-dir", str(out), "--log-every", "0"],
                   cwd=ROOT, check=True, capture_output=True, timeout=600)
    return out

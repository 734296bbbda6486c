"""Seeded chaos: chip and host kills and SIGTERMs at random steps over several short
runs, each resumed from the last one's checkpoints, end bit-identical to the run
that had no fault at all.

Per seed, ``random.Random(seed)`` draws two kills (a chip, or every chip of the
host) at random steps of a 12-step run that checkpoints every 2 steps, and two
step counts after which the test sends SIGTERM to its own process (the run's
``InterruptGuard`` stops at the next step boundary with a final checkpoint,
``RunInterrupted``); the next run resumes with ``resume_dir``, as ``tpu-pod run
--resume`` does, until one completes. The reference is the same scenario without
faults. Kills in the scenario are recovered inside a run from its newest
checkpoint (``Run.recover``); a kill whose checkpoint came before a resume's
starting point is injected again, which is also fine: every path must end on the
same bits. Marked ``chaos`` (about a minute per seed on an idle 2-core machine);
deselect with ``-m 'not chaos'``.
"""

from __future__ import annotations

import csv
import io
import os
import random
import signal
from pathlib import Path

import pytest
from rich.console import Console

from pod.config.plan import build_plan
from pod.errors import RunInterrupted
from pod.state.checkpoint import checkpoint_path, load_checkpoint
from tests.pod.state.test_checkpoint import scenario, state_bytes

pytestmark = [pytest.mark.chaos, pytest.mark.usefixtures("ray_cluster")]

STEPS = 12
CKPT = {"every_steps": 2, "keep": 3}


def chaos_plan(seed: int) -> tuple[list[dict], list[int]]:
    """(faults for the scenario, step counts after which SIGTERM is sent), from ``seed``."""
    rng = random.Random(seed)
    faults = []
    for step in sorted(rng.sample(range(1, STEPS + 1), 2)):
        if rng.random() < 0.25:
            faults.append({"kind": "kill_host", "host": 0, "step": step})
        else:
            faults.append({"kind": "kill_chip", "chip": rng.randrange(4), "step": step})
    return faults, sorted(rng.sample(range(1, STEPS), 2))


def run_until_done(out: Path, faults: list[dict], sigterm_after: list[int]) -> tuple[dict, int]:
    """Run, and resume after every SIGTERM, until the run completes.

    Returns:
        The final summary and how many runs were interrupted.
    """
    from pod.commands.train import run_training

    pending = set(sigterm_after)

    def on_step(stats) -> None:
        done = stats.step + 1
        if done in pending:  # once each: a resumed run redoes steps after its checkpoint
            pending.discard(done)
            os.kill(os.getpid(), signal.SIGTERM)

    interrupted, resume = 0, None
    while True:
        plan = build_plan(scenario(STEPS, CKPT, faults, name="chaos"))
        try:
            summary = run_training(plan, output_dir=out, resume_dir=resume, on_step=on_step,
                                   console=Console(file=io.StringIO(), width=200), log_every=0)
        except RunInterrupted:
            interrupted += 1
            resume = out / "checkpoints"
            assert interrupted <= len(sigterm_after), "more interruptions than SIGTERMs sent"
            continue
        return summary, interrupted


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory):
    out = tmp_path_factory.mktemp("fault-free")
    summary, interrupted = run_until_done(out, [], [])
    assert interrupted == 0
    return summary, load_checkpoint(checkpoint_path(out / "checkpoints", STEPS))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kills_and_sigterms_at_random_steps_end_bit_identical(fault_free, tmp_path, seed):
    reference_summary, reference = fault_free
    faults, sigterm_after = chaos_plan(seed)
    summary, interrupted = run_until_done(tmp_path, faults, sigterm_after)
    assert interrupted == len(sigterm_after)
    final = load_checkpoint(checkpoint_path(tmp_path / "checkpoints", STEPS))
    assert state_bytes(final) == state_bytes(reference), (faults, sigterm_after)
    assert final.digests == reference.digests
    assert summary["completed"] is True and summary["replicas_identical"] is True
    for key in ("steps", "initial_loss", "final_loss", "test_loss", "test_accuracy"):
        assert summary[key] == reference_summary[key], key
    rows = list(csv.DictReader((tmp_path / "steps.csv").open()))
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))  # each step once, in order

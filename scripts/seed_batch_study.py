"""The seed material's batch-size study: the MNIST CNN on a TPU v2-8 at global
batch 256, 512 and 1024; simulated time per step and per epoch of 60,000
examples. (A stand-in until `sweep:` scenarios exist, issue 5.)

Usage: .venv/bin/python scripts/seed_batch_study.py [--mnist DIR] [--steps N]

Without --mnist the inputs are SYNTHETIC 28x28x1 images (MNIST's shape; the
simulated time depends only on shapes). Each batch size runs N steps (default
3) on the emulated pod; the step time is the mean over the steps after the
first, as in summary.json.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from statistics import fmean

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from pod.coordinator import Pod  # noqa: E402
from pod.plan import build_plan  # noqa: E402
from pod.scenario import load_scenario  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EPOCH_EXAMPLES = 60_000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mnist", type=Path, help="directory with the MNIST IDX files")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    base = load_scenario(ROOT / "scenarios" / "seed-mnist-cnn-v2-8.yaml")
    data = ({"name": "mnist", "path": str(args.mnist.resolve()), "options": {}} if args.mnist else
            {"name": "synthetic", "path": None,
             "options": {"shape": [28, 28, 1], "num_classes": 10, "num_examples": 4096}})
    table = Table(title="Seed MNIST CNN on a TPU v2-8 (8 TensorCores), simulated")
    for col in ("global batch", "per core", "sim step", "sim epoch (60,000)", "examples/s",
                "compute", "allreduce", "MFU", "data"):
        table.add_column(col, justify="right")
    pod = None
    for batch in (256, 512, 1024):
        scenario = base.with_overrides(training__global_batch=batch, training__steps=args.steps,
                                       metrics__port=0, data__name=data["name"],
                                       data__path=data["path"], data__options=data["options"])
        plan = build_plan(scenario)
        pod = Pod(plan)
        try:
            pod.start()
            stats = [pod.step(s) for s in range(plan.steps)][1:]
        finally:
            pod.shutdown()
        step = fmean(s.step_seconds for s in stats)
        steps_per_epoch = -(-EPOCH_EXAMPLES // batch)
        table.add_row(f"{batch}", f"{plan.per_core_batch}", f"{step * 1e3:.4f} ms",
                      f"{steps_per_epoch * step * 1e3:.2f} ms ({steps_per_epoch} steps)",
                      f"{batch / step:,.0f}", f"{fmean(s.compute_seconds for s in stats) * 1e3:.4f} ms",
                      f"{fmean(s.allreduce_seconds for s in stats) * 1e3:.4f} ms",
                      f"{fmean(s.mfu for s in stats):.2%}",
                      "synthetic 28x28x1" if plan.dataset.synthetic else plan.dataset.name)
    Console(width=160).print(table)


if __name__ == "__main__":
    main()

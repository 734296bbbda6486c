"""Wall time of ResNet-50's timing-only step (issue 14).

A timing-only core (``TensorCore.execute = False``) records every op from
its shapes. Since issue 14 the layers also skip the work whose values a
timing-only step never reads: the im2col and col2im buffers, the bf16
rounding, and the VPU work of ReLU, BatchNorm, pooling and residual adds
(``pod.workloads.layers.vector_op``); the records are the same as an
executing core's (tests/pod/workloads/test_resnet.py). This prints, wall
clock (medians of ``--repeats``):

1. one TensorCore's forward + backward of ResNet-50 on 224x224x3 at
   ``--batch`` images, timing-only, and its simulated seconds;
2. one whole ``TimingPod`` step of a v4-8 (4 chips) at that batch per core:
   the representative chip's two cores, the gradient flatten and the SGD
   update of 25.6 M parameters per core (work that scales with the
   parameters, not the images);
3. side by side at 64x64 (an executing core is too slow at 224 on this
   host): an executing core against a timing-only one, and the ratio.

Run: .venv/bin/python benchmarks/resnet_timing.py [--repeats 3] [--batch 32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from chip import TensorCore, get_chip_spec
from pod.config.plan import build_plan
from pod.config.scenario import parse_scenario
from pod.runtime.timing import TimingPod
from pod.workloads import build_model


def model_step(model, batch: int, execute: bool) -> tuple[float, float]:
    """(wall seconds, simulated seconds) of one forward + backward on a v4 TensorCore."""
    core = TensorCore(get_chip_spec("v4").core, numerics=True, execute=execute)
    x = np.random.default_rng(0).standard_normal((batch, *model.input_shape), dtype=np.float32)
    y = np.zeros(batch, np.int64)
    params, state = model.init_params(0), model.init_state()
    t0 = time.perf_counter()
    model.loss_grads_and_state(core, params, x, y, state=state)
    wall = time.perf_counter() - t0
    return wall, sum(r.seconds for r in core.take_records())


def pod_step(batch: int, repeats: int) -> tuple[list[float], float]:
    plan = build_plan(parse_scenario({
        "name": "resnet-timing", "pod": {"slice": "v4-8"},
        "model": {"name": "resnet", "options": {"depth": 50}},
        "data": {"name": "synthetic", "options": {"shape": [224, 224, 3], "num_classes": 1000,
                                                  "num_examples": 2 * batch + 16,
                                                  "labels": "uniform"}},
        "training": {"global_batch": 8 * batch, "steps": repeats + 1,
                     "optimizer": {"name": "sgd", "learning_rate": 0.1, "momentum": 0.9}},
        "metrics": {"port": 0}}), timing_only=True)
    pod = TimingPod(plan)
    stats = [pod.step(s) for s in range(repeats + 1)]
    return [s.wall_seconds for s in stats[1:]], stats[-1].step_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    r50 = build_model("resnet", (224, 224, 3), 1000, depth=50)
    runs = [model_step(r50, args.batch, False) for _ in range(args.repeats)]
    print(f"1. ResNet-50 224x224, batch {args.batch}, one v4 TensorCore, timing-only: "
          f"wall {statistics.median(w for w, _ in runs):.3f} s (median of {args.repeats}), "
          f"simulated {runs[0][1] * 1e3:.2f} ms")
    walls, sim = pod_step(args.batch, args.repeats)
    print(f"2. TimingPod step, v4-8, {args.batch} per core: wall {statistics.median(walls):.3f} s "
          f"(median of {args.repeats}), simulated {sim * 1e3:.2f} ms")
    small = build_model("resnet", (64, 64, 3), 1000, depth=50)
    executed, timed = [], []
    for _ in range(args.repeats):  # alternate, as the machine's load drifts
        executed.append(model_step(small, 8, True))
        timed.append(model_step(small, 8, False))
    e = statistics.median(w for w, _ in executed)
    t = statistics.median(w for w, _ in timed)
    assert executed[0][1] == timed[0][1], "the simulated seconds must not change"
    print(f"3. ResNet-50 64x64, batch 8, one v4 TensorCore: executing {e:.3f} s, timing-only "
          f"{t:.3f} s wall (medians of {args.repeats}), {e / t:,.0f}x; simulated "
          f"{executed[0][1] * 1e3:.3f} ms both")


if __name__ == "__main__":
    main()

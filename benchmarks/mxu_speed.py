"""Functional MXU emulation speed: bf16 matmul through a TensorCore vs raw numpy float32.

Measured side by side in one run, variants alternated, medians quoted (timing
noise on the project's machines is +-20-30% between runs). Variants per size N
(square N x N . N x N, float32 inputs):

- numpy:        a @ b (float32 BLAS), the reference;
- core:         TensorCore.matmul(a, b): rounds both inputs to bf16, then the
                same float32 BLAS product;
- core, cached: TensorCore.matmul(a, b_r, b_rounded=True) with b_r =
                core.mxu_input(b) rounded once (weights reused many times).

Ratio = numpy time / variant time (1.0 = as fast as raw numpy).

    .venv/bin/python benchmarks/mxu_speed.py [--sizes 512 1024 2048] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from chip import TensorCore, get_chip_spec  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    core = TensorCore(get_chip_spec("v2").core)
    print("| N | numpy float32 (ms) | TensorCore bf16 (ms) | ratio | TensorCore bf16, cached "
          "weights (ms) | ratio |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in args.sizes:
        rng = np.random.default_rng(n)
        a = rng.standard_normal((n, n), dtype=np.float32)
        b = rng.standard_normal((n, n), dtype=np.float32)
        b_r = core.mxu_input(b)
        variants = {
            "numpy": lambda: a @ b,
            "core": lambda: core.matmul(a, b),
            "cached": lambda: core.matmul(a, b_r, b_rounded=True),
        }
        times = {k: [] for k in variants}
        for fn in variants.values():  # warm up
            fn()
        for _ in range(args.repeats):
            for name, fn in variants.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
            core.take_records()
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"| {n} | {med['numpy'] * 1e3:.1f} | {med['core'] * 1e3:.1f} | "
              f"{med['numpy'] / med['core']:.2f} | {med['cached'] * 1e3:.1f} | "
              f"{med['numpy'] / med['cached']:.2f} |")


if __name__ == "__main__":
    main()

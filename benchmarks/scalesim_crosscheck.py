"""Cross-check `chip.mxu_gemm_cycles(..., mxu_model="scalesim")` against SCALE-Sim's weight-stationary GEMM.

SCALE-Sim (PyPI `scalesim` 3.0.0, a public cycle-level systolic-array
simulator) needs numpy < 2.4, so it lives in its own virtualenv, outside this
repository (SCALE-Sim 3.0.0 crashes with numpy 2.4):

    python3 -m venv /tmp/scalesim-venv
    /tmp/scalesim-venv/bin/pip install scalesim 'numpy<2.4'

Then, from the repository root:

    .venv/bin/python benchmarks/scalesim_crosscheck.py --scalesim-python /tmp/scalesim-venv/bin/python

The script re-runs itself under the SCALE-Sim interpreter (``--worker``) to
get SCALE-Sim's total cycles per case (Python API, ``save_disk_space=True``,
dataflow "ws", bandwidth mode CALC so there are no memory stalls), then
prints a Markdown table of our cycles beside SCALE-Sim's and exits 1 if any
case differs. The table in VALIDATION.md was produced this way. The last
column shows the default "pipelined" count (one bubble per op) beside it,
for comparison only: SCALE-Sim pays the bubble on every fold, so the two
agree on one-fold cases and "pipelined" is lower on the others.

GEMM mapping in SCALE-Sim's GEMM mode (topology row "name, M, N, K,"): the
ifmap is M x K, the filter K x N, so its T (ofmap pixels) = M, Sr = K, Sc = N,
which is our (M x K) . (K x N).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# (M, K, N, array rows R, array cols C): hand-sized cases, one fold, folds
# over K and N, partial folds, M < R, and TPU-sized 128 x 128 arrays.
CASES = [
    (2, 2, 2, 2, 2),
    (2, 4, 2, 2, 2),
    (2, 2, 4, 2, 2),
    (2, 4, 4, 2, 2),
    (1, 4, 4, 4, 4),
    (5, 3, 4, 3, 4),
    (7, 10, 9, 4, 4),
    (3, 8, 8, 8, 8),
    (16, 16, 16, 8, 8),
    (33, 17, 40, 8, 16),
    (64, 64, 64, 32, 32),
    (100, 70, 50, 32, 16),
    (8, 128, 128, 128, 128),
    (128, 128, 128, 128, 128),
    (256, 256, 256, 128, 128),
    (300, 200, 130, 128, 128),
    (512, 512, 512, 128, 128),
    (1024, 256, 384, 128, 128),
]

_CONFIG = """[general]
run_name = crosscheck

[architecture_presets]
ArrayHeight: {rows}
ArrayWidth: {cols}
IfmapSramSzkB: 1024
FilterSramSzkB: 1024
OfmapSramSzkB: 1024
IfmapOffset: 0
FilterOffset: 10000000
OfmapOffset: 20000000
Dataflow: ws
Bandwidth: 10
ReadRequestBuffer: 32
WriteRequestBuffer: 32

[layout]
IfmapCustomLayout: False
IfmapSRAMBankBandwidth: 10
IfmapSRAMBankNum: 10
IfmapSRAMBankPort: 2
FilterCustomLayout: False
FilterSRAMBankBandwidth: 10
FilterSRAMBankNum: 10
FilterSRAMBankPort: 2

[sparsity]
SparsitySupport: false
SparseRep: ellpack_block
OptimizedMapping: false
BlockSize: 8
RandomNumberGeneratorSeed: 40

[run_presets]
InterfaceBandwidth: CALC
UseRamulatorTrace: False
"""


def scalesim_cycles(m: int, k: int, n: int, rows: int, cols: int) -> tuple[int, int]:
    """SCALE-Sim's (compute cycles, stall cycles) for one GEMM (inside the SCALE-Sim venv).

    Compute cycles are SCALE-Sim's "Compute cycles" report item
    (`memory_system.get_total_compute_cycles()`, stalls included); with
    bandwidth mode CALC the stalls are 0. (`scalesim.get_total_cycles()` in
    3.0.0 crashes: it indexes a method; so the layer object is read directly.)
    """
    from scalesim.scale_sim import scalesim

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cfg = tmp / "ws.cfg"
        cfg.write_text(_CONFIG.format(rows=rows, cols=cols))
        topo = tmp / "gemm.csv"
        topo.write_text(f"Layer, M, N, K,\ngemm, {m}, {n}, {k},\n")
        layout = tmp / "layout.csv"
        layout.write_text("Layer, a, b, c, d, e, f, g,\ngemm, 1, 1, 1, 1, 1, 1, 1,\n")
        sim = scalesim(save_disk_space=True, verbose=False, config=str(cfg), topology=str(topo),
                       layout=str(layout), input_type_gemm=True)
        with contextlib.redirect_stdout(io.StringIO()):
            sim.run_scale(top_path=str(tmp / "out"))
        layer = sim.runner.single_layer_sim_object_list[0]
        items = layer.get_compute_report_items()
        return int(items[1]), int(items[2])


def _worker() -> None:
    out = []
    for m, k, n, rows, cols in CASES:
        compute, stalls = scalesim_cycles(m, k, n, rows, cols)
        out.append([m, k, n, rows, cols, compute, stalls])
    json.dump(out, sys.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scalesim-python", default="/tmp/scalesim-venv/bin/python",
                        help="Python of a venv where `scalesim` is installed")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker()
        return 0

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from chip import MXUSpec, mxu_gemm_cycles

    env = dict(os.environ, PYTHONPATH="")
    done = subprocess.run([args.scalesim_python, __file__, "--worker"], capture_output=True,
                          text=True, env=env, check=False)
    if done.returncode != 0:
        print(f"SCALE-Sim run failed:\n{done.stderr}", file=sys.stderr)
        return 2
    rows_out = json.loads(done.stdout)
    print("| M | K | N | array R x C | folds | ours (cycles) | SCALE-Sim compute cycles "
          "| SCALE-Sim stalls | difference | pipelined (cycles) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    bad = 0
    for m, k, n, rows, cols, theirs, stalls in rows_out:
        ours = mxu_gemm_cycles(m, k, n, MXUSpec(rows, cols), mxu_model="scalesim")
        pipelined = mxu_gemm_cycles(m, k, n, MXUSpec(rows, cols), mxu_model="pipelined")
        folds = -(-k // rows) * -(-n // cols)
        bad += ours != theirs
        print(f"| {m} | {k} | {n} | {rows}x{cols} | {folds} | {ours} | {theirs} | {stalls} "
              f"| {ours - theirs:+d} | {pipelined} |")
    print(f"\n{len(rows_out) - bad} of {len(rows_out)} cases agree cycle for cycle")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

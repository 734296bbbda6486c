"""The HBM plan against XLA's own (issue 29 item 2): every committed result of the XLA
oracle (``tools/xla_oracle/results``, a deviceless TPU compile of MaxText's step for the
configuration) is planned as ``validate`` plans it (``benchmarks/memory_oracle.py``), and

- the verdicts agree: XLA compiled it and the plan fits it, or XLA ran out of HBM and the
  plan refuses it;
- where XLA compiled it, the plan's total is within 10% of XLA's peak per device
  (``memory_analysis().peak_memory_in_bytes``).

Reads the committed JSON of this repository only; a result XLA could not decide on HBM
(a kernel's scoped VMEM, a lowering error) is left out by the loader.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _benchmark():
    name = "memory_oracle_benchmark"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" /
                                                      "memory_oracle.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


RESULTS = _benchmark().load_results(ROOT / "tools" / "xla_oracle" / "results")


def test_there_are_results_to_check():
    assert RESULTS, "tools/xla_oracle/results holds no result with a verdict on HBM"


@pytest.mark.parametrize("result", RESULTS, ids=[r["id"] for r in RESULTS])
def test_the_plan_agrees_with_xla(result):
    bench = _benchmark()
    row = bench.plan_row(result, ROOT)
    fits = "fits" if row.plan_fits else "refuses"
    assert row.plan_fits == row.xla_fits, (
        f"{row.id}: XLA {'fits' if row.xla_fits else 'refuses'} it, the plan {fits} it "
        f"({row.plan_bytes / 2**30:.2f} GiB; {row.note})")
    if row.error is not None:
        assert abs(row.error) <= bench.TOLERANCE, (
            f"{row.id}: plan {row.plan_bytes / 2**30:.2f} GiB, XLA {row.xla_peak_bytes / 2**30:.2f}"
            f" GiB ({row.error:+.1%})")

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


#: results the plan misses, each a finding reported in VALIDATION.md section 10 and in
#: ``benchmarks/accuracy.py``'s table (strict: the test fails once the plan meets it)
KNOWN_MISSES = {
    "M1": "the plan is 23.3% below XLA's peak (7.72 of 10.07 GiB): XLA holds 1.69 GiB more "
          "for T3's model and mesh across two slices (dcn data 2) than in one (T3, 8.37 GiB); "
          "its HLO (tools/xla_oracle/hlo/M1.hlo.txt.gz) runs one layer's flash kernels outside "
          "the scanned loops (peeled), and the schedule's peak is there, beside the stacked "
          "activations; M2 (T1 across two slices) holds 3.66 GiB more than T1 the same way, "
          "M3 (dot-product attention) nothing: no rule read from two rows that disagree; "
          "MaxText 0.2.5's own step holds more still (12.99 GiB, two copies of the saved "
          "layer inputs; VALIDATION.md 11 (d)); "
          "compiled with its run's flags (xla_flags maxtext-2023) as at XLA's defaults",
    "T5-full": "the plan is 17.1% above XLA's peak (20.82 of 17.77 GiB): it holds the "
               "logits' gradient (4 x 8192 x 128,256 bf16, 7.83 GiB) through the layers' "
               "backward, as XLA does in T5, T5-qkv_proj_offloaded, T9-untied-flash and "
               "gpt-style-v5p-64; in T5-full's scheduled HLO (tools/xla_oracle/hlo/, and "
               "llama2-7b-full-b4's) XLA "
               "forms the output kernel's gradient before the layers' backward and holds "
               "it instead (bf16[4096,128256], 0.98 GiB; its peak, multiply_reduce_fusion.3, "
               "is at the loss). Holding that instead the plan is +0.3%; taking the smaller "
               "of the two for every row puts T9-untied-flash and T5-qkv_proj_offloaded "
               "out (-10.9%, -21.0%) and T6-b4's verdict wrong: no rule read yet",
}


@pytest.mark.parametrize("result", [
    pytest.param(r, marks=pytest.mark.xfail(reason=KNOWN_MISSES[r["id"]], strict=True))
    if r["id"] in KNOWN_MISSES else r for r in RESULTS], ids=[r["id"] for r in RESULTS])
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


def test_a_peak_of_arguments_and_host_memory_is_no_hbm_peak():
    # T6's record: jaxlib's peak is its arguments plus the offloaded activations, which
    # live in host memory; a peak above them is the device's
    bench = _benchmark()
    gib = 2**30
    memory = {"argument_bytes": 12 * gib, "host_temp_bytes": 45 * gib, "temp_bytes": 21 * gib}
    host_peak = {"peak_bytes_per_device": 57 * gib + 36_544, "memory": memory,
                 "compile": {"ok": True}}
    device_peak = {**host_peak, "peak_bytes_per_device": 30 * gib}
    no_host = {**device_peak, "memory": {**memory, "host_temp_bytes": 0}}
    assert bench.device_peak_bytes(host_peak) is None
    assert bench.device_peak_bytes(device_peak) == 30 * gib
    assert bench.device_peak_bytes(no_host) == 30 * gib


def test_t6_is_checked_on_xla_compiling_it():
    # XLA compiled T6 (it refuses programs its HBM cannot hold); the record's "fits: false"
    # compares the host-memory peak with HBM, so the loader keeps T6 as compiled
    t6 = [r for r in RESULTS if r["id"] == "T6"]
    assert t6, "T6's result is missing from tools/xla_oracle/results"
    row = _benchmark().plan_row(t6[0], ROOT)
    assert row.xla_fits and row.xla_peak_bytes is None
    assert row.xla_device_bound_bytes == t6[0]["sum_bytes_per_device"]

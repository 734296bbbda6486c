"""Tests of chip.TensorCore and chip.Chip: results, records, roofline bound."""

import math
import subprocess
import sys

import numpy as np
import pytest

from chip import Chip, MXUSpec, OpRecord, TensorCore, TensorCoreSpec, get_chip_spec, to_bf16
from tests.chip.rates import fresh_op_cycles

V2 = get_chip_spec("v2")


def expected_matmul_record(spec, m, k, n):
    """Independent roofline of one GEMM: pipelined MXU cycles vs HBM bytes.

    The MXU streams rounds x max(M, R) rows and pays one bubble (weight load
    R, skew R - 1, drain C - 1) per op, less one (SCALE-Sim's convention),
    at the calibrated efficiency of a fresh op of that length; the scalar unit adds its
    issue cycles. HBM: bf16 in, bf16 out [PALLAS], at the achieved bandwidth.
    """
    r, c = spec.mxu.rows, spec.mxu.cols
    rounds = math.ceil(math.ceil(k / r) * math.ceil(n / c) / spec.mxus_per_core)
    ideal = (rounds - 1) * max(m, r) + (m + 2 * r + c - 2) - 1
    cycles = fresh_op_cycles(spec, ideal) + spec.scalar_issue_cycles
    hbm_bytes = 2 * m * k + 2 * k * n + 2 * m * n  # bf16 in, bf16 out
    compute_s = cycles / spec.clock_hz
    memory_s = hbm_bytes / (spec.hbm_bandwidth_bytes_per_s * spec.hbm_efficiency)
    return cycles, hbm_bytes, compute_s, memory_s


def test_matmul_numerics_and_record():
    core = TensorCore(V2.core, name="chip0/core0")
    rng = np.random.default_rng(0)
    a = rng.standard_normal((50, 300)).astype(np.float32)
    b = rng.standard_normal((300, 70)).astype(np.float32)
    out = core.matmul(a, b, name="dense")
    assert out.dtype == np.float32 and out.shape == (50, 70)
    np.testing.assert_array_equal(out, to_bf16(a) @ to_bf16(b))
    exact = a.astype(np.float64) @ b.astype(np.float64)
    rel = np.linalg.norm(out - exact) / np.linalg.norm(exact)
    assert 0 < rel < 1e-2

    (rec,) = core.records
    cycles, hbm_bytes, compute_s, memory_s = expected_matmul_record(V2.core, 50, 300, 70)
    assert isinstance(rec, OpRecord)
    assert (rec.name, rec.unit) == ("dense", "mxu")
    assert rec.flops == 2 * 50 * 300 * 70
    assert rec.hbm_bytes == hbm_bytes
    assert rec.cycles == cycles
    assert rec.issue_cycles == V2.core.scalar_issue_cycles
    assert rec.mxu_cycles == cycles - V2.core.scalar_issue_cycles
    assert rec.compute_seconds == pytest.approx(compute_s)
    assert rec.memory_seconds == pytest.approx(memory_s)
    assert rec.seconds == max(rec.compute_seconds, rec.memory_seconds)


def test_matmul_without_numerics_is_plain_numpy_in_input_dtype():
    core = TensorCore(V2.core, numerics=False)
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((5, 7)), rng.standard_normal((7, 3))
    out = core.matmul(a, b)
    assert out.dtype == np.float64
    np.testing.assert_array_equal(out, a @ b)
    assert core.records[0].flops == 2 * 5 * 7 * 3  # costed the same


def test_rounded_flags_skip_rounding():
    core = TensorCore(V2.core)
    a = np.full((2, 3), 1 + 2**-10, dtype=np.float32)  # not representable in bf16
    b = np.ones((3, 2), dtype=np.float32)
    np.testing.assert_array_equal(core.matmul(a, b), np.full((2, 2), 3.0, np.float32))
    np.testing.assert_array_equal(core.matmul(a, b, a_rounded=True, b_rounded=True), a @ b)


def test_matmul_shape_errors():
    core = TensorCore(V2.core)
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(4, 5\)"):
        core.matmul(np.ones((2, 3)), np.ones((4, 5)))
    with pytest.raises(ValueError):
        core.matmul(np.ones(3), np.ones((3, 1)))


def test_tiny_k_big_m_is_memory_bound_on_v2():
    core = TensorCore(V2.core, numerics=False)
    # One fold streams a row per cycle: 2K + 2N = 512 HBM bytes per cycle,
    # above v2's ~424 achieved bytes per cycle per core: memory bound.
    m, k, n = 65536, 128, 128
    core.matmul(np.ones((m, k), np.float32), np.ones((k, n), np.float32))
    rec = core.records[-1]
    _, _, compute_s, memory_s = expected_matmul_record(V2.core, m, k, n)
    assert memory_s > compute_s  # the independent model agrees
    assert rec.bound == "memory" and rec.seconds == pytest.approx(memory_s)


def test_big_square_is_compute_bound_on_v2():
    core = TensorCore(V2.core, numerics=False)
    n = 1024
    core.matmul(np.ones((n, n), np.float32), np.ones((n, n), np.float32))
    rec = core.records[-1]
    _, _, compute_s, memory_s = expected_matmul_record(V2.core, n, n, n)
    assert compute_s > memory_s
    assert rec.bound == "compute" and rec.seconds == pytest.approx(compute_s)
    # Below the core's peak: a 0.1 ms op runs at about e0 (the fitted 0.952; the rate
    # has not fallen yet), and one bubble of 3R - 2 cycles over 64 folds x 1024 rows.
    peak = 2 * V2.core.mxus_per_core * 128 * 128 * V2.core.clock_hz
    ideal = 64 * 1024 / (64 * 1024 + 3 * 128 - 3)
    # (The scalar issue cycles and the first 0.1 ms of the fall are the 1e-3.)
    assert rec.flops / rec.seconds == pytest.approx(peak * ideal * V2.core.mxu_efficiency, rel=1e-3)


def test_four_mxus_spread_a_large_gemm():
    one = TensorCoreSpec(mxu=MXUSpec(128, 128), mxus_per_core=1, clock_hz=1e9,
                         hbm_bytes=2**34, hbm_bandwidth_bytes_per_s=1e15, vmem_bytes=0)
    four = TensorCoreSpec(mxu=MXUSpec(128, 128), mxus_per_core=4, clock_hz=1e9,
                          hbm_bytes=2**34, hbm_bandwidth_bytes_per_s=1e15, vmem_bytes=0)
    a = np.ones((1024, 1024), np.float32)
    records = []
    for spec in (one, four):
        core = TensorCore(spec, numerics=False)
        core.matmul(a, a)
        records.append(core.records[0])
    # 64 vs 16 rounds of 1024 rows, one bubble (3R - 3) each: about a quarter.
    bubble = 3 * 128 - 3
    assert records[1].mxu_cycles == math.ceil((16 * 1024 + bubble) / four.mxu_efficiency)
    assert records[0].mxu_cycles == math.ceil((64 * 1024 + bubble) / one.mxu_efficiency)
    assert records[1].seconds / records[0].seconds == pytest.approx(0.25, rel=0.02)


def test_vector_costs():
    core = TensorCore(V2.core)
    x = np.linspace(-1, 1, 4096, dtype=np.float32).reshape(64, 64)
    y = core.vector("add", np.add, x, x)
    np.testing.assert_array_equal(y, x + x)
    e = core.vector("exp", np.exp, x, transcendental=True)
    np.testing.assert_array_equal(e, np.exp(x))
    add, exp = core.records
    lanes = 8 * 128 * 2  # 2 ALUs per (lane, sublane) [SB-tpus]
    assert add.unit == "vpu" and add.flops == 4096
    assert add.hbm_bytes == 3 * x.nbytes
    assert add.cycles == math.ceil(4096 / lanes) + V2.core.scalar_issue_cycles
    assert exp.cycles == (math.ceil(math.ceil(4096 / lanes) * V2.core.transcendental_cycles_per_element_op)
                          + V2.core.scalar_issue_cycles)
    assert exp.cycles > add.cycles and exp.compute_seconds > add.compute_seconds


def test_vector_elements_is_largest_of_inputs_and_result():
    core = TensorCore(V2.core)
    x = np.ones((10, 100), np.float32)
    total = core.vector("sum", np.sum, x, ops_per_element=1.0)
    assert total == 1000
    s = core.vector("scale", lambda v, a: v * a, x, 2.0, ops_per_element=2.0)
    assert s.shape == x.shape
    reduce_rec, scale_rec = core.records
    assert reduce_rec.flops == 1000 and scale_rec.flops == 2000
    assert reduce_rec.hbm_bytes == x.nbytes + np.float32(0).nbytes
    with pytest.raises(ValueError, match="-1"):
        core.vector("bad", np.negative, x, ops_per_element=-1.0)


def test_account_and_take_records():
    core = TensorCore(V2.core)
    rec = core.account("infeed", "scalar", 0, 7.16e11 / 2 * V2.core.hbm_efficiency * 1e-3, 10)
    assert rec.bound == "memory" and rec.seconds == pytest.approx(1e-3)
    assert rec.cycles == 10 and rec.compute_seconds == pytest.approx(10 / 700e6)
    with pytest.raises(ValueError, match="'gpu'"):
        core.account("x", "gpu", 0, 0, 0)
    with pytest.raises(ValueError, match="-5"):
        core.account("x", "mxu", 0, -5, 0)
    core.matmul(np.ones((2, 2)), np.ones((2, 2)))
    taken = core.take_records()
    assert [r.name for r in taken] == ["infeed", "matmul"]
    assert core.records == [] and core.take_records() == []


def test_zero_sized_matmul_costs_only_issue():
    core = TensorCore(V2.core)
    out = core.matmul(np.ones((0, 4), np.float32), np.ones((4, 3), np.float32))
    assert out.shape == (0, 3)
    assert core.records[0].cycles == V2.core.scalar_issue_cycles


@pytest.mark.parametrize("name", ["v2", "v4", "v5e", "v6e"])
def test_chip_cores(name):
    spec = get_chip_spec(name)
    chip = Chip(spec, chip_id=5, numerics=False)
    assert chip.spec is spec and chip.chip_id == 5
    assert [c.name for c in chip.cores] == [f"chip5/core{i}" for i in range(spec.tensorcores)]
    assert all(c.spec is spec.core and not c.numerics for c in chip.cores)
    assert all(c.hbm.capacity_bytes == spec.hbm_available_bytes // spec.tensorcores for c in chip.cores)
    with pytest.raises(ValueError, match="-1"):
        Chip(spec, chip_id=-1)


def test_chip_never_imports_ray_pod_or_interconnect():
    code = ("import sys, chip; bad = [m for m in ('ray', 'pod', 'interconnect') if m in sys.modules];"
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_timing_only_core_records_the_same_costs_without_computing():
    """execute=False (timing-only mode): products are zeros, every record is unchanged."""
    import numpy as np

    from chip import TensorCore, get_chip_spec

    rng = np.random.default_rng(0)
    a = rng.standard_normal((64, 96)).astype(np.float32)
    b = rng.standard_normal((96, 40)).astype(np.float32)
    x = rng.standard_normal((2, 6, 6, 3)).astype(np.float32)
    w = rng.standard_normal((2, 2, 3, 5)).astype(np.float32)
    cores = [TensorCore(get_chip_spec("v4").core), TensorCore(get_chip_spec("v4").core)]
    cores[1].execute = False
    outs = []
    for core in cores:
        outs.append((core.matmul(a, b), core.batch_matmul(a[None], b[None]),
                     core.conv2d(x, w, padding="same")))
    for real, dry in zip(outs[0], outs[1]):
        assert dry.shape == real.shape and dry.dtype == real.dtype
        assert not dry.any() and real.any()
    assert cores[0].take_records() == cores[1].take_records()


def test_cached_op_costs_equal_a_fresh_cores_and_still_check_their_input():
    # costs are cached per (op, shapes): a core that has seen an op many times
    # records exactly what a fresh core records for it, and bad input still raises
    warm, fresh = TensorCore(V2.core), TensorCore(V2.core)
    a, b = np.ones((64, 32), np.float32), np.ones((32, 16), np.float32)
    for _ in range(3):
        warm.matmul(a, b, name="mm")
        warm.vector("add", np.add, a, a)
    warm.take_records()
    warm.matmul(a, b, name="mm")
    warm.vector("add", np.add, a, a)
    fresh.matmul(a, b, name="mm")
    fresh.vector("add", np.add, a, a)
    assert warm.take_records() == fresh.take_records()
    warm.vector("add", np.add, a[:10], a[:10])  # another shape: another cost
    assert warm.records[-1].flops == 10 * 32
    with pytest.raises(ValueError, match="m must be an integer"):
        warm.account_matmul(64.0, 32, 16, name="mm")
    with pytest.raises(ValueError, match="ops_per_element"):
        warm.vector("add", np.add, a, a, ops_per_element=-1.0)


# --------------------------------------------------------------------------- fusion


def test_fused_vpu_work_adds_only_what_the_matmul_does_not_cover():
    """Epilogue ("previous") and prologue ("next") VPU work fused into a matmul: no
    HBM bytes, recorded after the matmul with its name, and together they add
    max(MXU, VPU, HBM) - max(MXU, HBM) to the step (the fused kernel's roofline)."""
    spec = get_chip_spec("v5e").core
    core = TensorCore(spec, numerics=False)
    x = np.ones((256, 256), np.float32)
    core.vector("norm", np.negative, x, ops_per_element=2.0, fused="next")  # waits for the matmul
    assert core.records == []
    mm = core.account_matmul(256, 256, 256, name="proj")
    core.vector("bias", np.negative, x, fused="previous")
    big = np.ones((4096, 4096), np.float32)                              # VPU-heavy epilogue
    core.vector("act", np.exp, big, ops_per_element=4.0, transcendental=True, fused="previous")
    records = core.take_records()
    assert [r.name for r in records] == ["proj", "norm", "bias", "act"]
    fused = records[1:]
    assert all(r.fused_into == "proj" and r.hbm_bytes == 0 and r.unit == "vpu" for r in fused)
    vpu = sum(r.compute_seconds for r in fused)
    assert vpu == pytest.approx(sum(r.cycles for r in fused) / spec.clock_hz)
    assert vpu > mm.seconds                                              # the VPU dominates here
    assert sum(r.seconds for r in records) == pytest.approx(max(mm.seconds, vpu), rel=1e-12)
    assert records[1].seconds == 0.0 and records[2].seconds == 0.0       # hidden under the MXU


def test_a_prologue_without_a_matmul_runs_as_its_own_op():
    core = TensorCore(V2.core, numerics=False)
    x = np.ones((64, 64), np.float32)
    core.vector("lonely", np.negative, x, fused="next")
    core.vector("next_op", np.negative, x)                               # not a matmul
    core.vector("tail", np.negative, x, fused="next")
    core.vector("no_host_yet", np.negative, x, fused="previous")         # nothing to fuse into
    records = core.take_records()                                        # flushes "tail" too
    assert [r.name for r in records] == ["lonely", "next_op", "tail", "no_host_yet"]
    assert all(r.fused_into == "" and r.hbm_bytes == 2 * x.nbytes for r in records)
    core.account_matmul(8, 8, 8, name="mm")
    core.take_records()                                                  # a step ends the kernel
    assert core.account_vector("after", 10, 40, fused="previous").fused_into == ""
    with pytest.raises(ValueError, match="fused must be one of"):
        core.vector("bad", np.negative, x, fused="later")


def test_a_kernel_record_sums_its_products():
    core = TensorCore(get_chip_spec("v5p").core, numerics=False)
    gemms = [(128, 64, 128, 6), (64, 128, 64, 6)]
    rec = core.account_kernel("flash", gemms, 1000)
    assert rec.unit == "mxu" and rec.hbm_bytes == 1000
    assert rec.flops == 2 * 6 * 128 * 64 * 128 + 2 * 6 * 64 * 128 * 64
    assert rec.mxu_cycles == sum(core.mxu_cycles(m, k, n, batch=b) for m, k, n, b in gemms)
    assert rec.cycles == rec.mxu_cycles + rec.issue_cycles
    assert core.account_kernel("flash", gemms, 1000) == rec and len(core.records) == 2  # cached

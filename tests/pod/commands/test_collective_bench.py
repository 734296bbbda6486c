"""``tpu-pod collective --slice``: slices, dtypes, several algorithms, sizes as given with their
cuts said, and nccl-tests' closing '# Avg bus bandwidth' line."""

from __future__ import annotations

import json
import re
from statistics import fmean

import pytest
from click.testing import CliRunner

from chip import get_chip_spec
from interconnect.calibration import CALIBRATION as C
from pod.cli import cli, main
from pod.commands.collective_bench import (DTYPE_ALIASES, DTYPES, avg_bus_bandwidth, cut_count,
                                           run_collective_bench, summary_line)
from pod.errors import BenchError

GIB = 1 << 30
AVG = re.compile(r"^# Avg bus bandwidth\s+: ([0-9.]+) GB/s(?: \((\w+)\))?$")


def _invoke(*args: str):
    result = CliRunner().invoke(cli, ["collective", *args])
    assert result.exit_code == 0, result.output
    return result.output


def test_question_c_a_1gib_allreduce_on_v4_128_ring_against_torus_is_one_command():
    """Issue 25 (c): both algorithms in one table, each with its summary line; the ring is
    the textbook ring on one link per chip, 2 (n-1)/n x V / W plus 2 (n-1) hops of latency
    and the fixed cost (interconnect/calibration.py), the torus faster."""
    out = _invoke("--slice", "v4-128", "--op", "allreduce", "--sizes", "1GiB",
                  "--algorithm", "ring,torus")
    assert "allreduce on v4-128 = v4 4x4x4 (64 chips, wraparound y/y/y), fp32" in out
    averages = {m.group(2): float(m.group(1)) for m in map(AVG.match, out.splitlines()) if m}
    assert set(averages) == {"ring", "torus"}
    rows = json.loads(_invoke("--slice", "v4-128", "--sizes", "1GiB", "--algorithm", "ring,torus",
                              "--json"))
    ring, torus = rows
    v4, n = get_chip_spec("v4"), 64
    expected = (2 * (n - 1) / n * GIB / (v4.ici_link_bandwidth_bytes_per_s * C.efficiency)
                + 2 * (n - 1) * v4.ici_latency_s + C.fixed_s("v4"))
    assert (ring["algorithm"], torus["algorithm"]) == ("ring", "torus")
    assert ring["simulated_seconds"] == pytest.approx(expected, rel=1e-9)
    assert torus["simulated_seconds"] < ring["simulated_seconds"] / 2  # six links per chip
    assert averages["ring"] == pytest.approx(ring["busbw_bytes_per_s"] / 1e9, abs=1e-4)


@pytest.mark.parametrize("op, factor", [("allreduce", lambda n: 2 * (n - 1) / n),
                                        ("reduce-scatter", lambda n: (n - 1) / n),
                                        ("all-gather", lambda n: (n - 1) / n)])
def test_busbw_is_algbw_times_nccl_tests_factor(op, factor):
    """nccl-tests doc/PERFORMANCE.md: allreduce 2(n-1)/n, reduce-scatter and all-gather (n-1)/n."""
    rows = json.loads(_invoke("--slice", "v5e-16", "--op", op, "--sizes", "1MiB:8MiB", "--json"))
    for row in rows:
        assert row["algbw_bytes_per_s"] == pytest.approx(row["size_bytes"] / row["simulated_seconds"])
        assert row["busbw_bytes_per_s"] == pytest.approx(row["algbw_bytes_per_s"] * factor(16))


def test_the_summary_line_is_the_mean_busbw_over_the_sizes():
    out = _invoke("--slice", "v5p-32", "--sizes", "64KiB:64MiB")
    last = out.rstrip("\n").splitlines()[-1]
    match = AVG.match(last)
    assert match and match.group(2) is None, last
    rows = json.loads(_invoke("--slice", "v5p-32", "--sizes", "64KiB:64MiB", "--json"))
    assert float(match.group(1)) == pytest.approx(fmean(r["busbw_bytes_per_s"] for r in rows) / 1e9,
                                                  abs=1e-4)
    assert summary_line(12.5e9) == "# Avg bus bandwidth    : 12.5000 GB/s"


@pytest.mark.parametrize("dtype, count", [("bf16", GIB // 2), ("fp32", GIB // 4), ("int8", GIB),
                                          ("f32", GIB // 4)])  # f32: fp32's other name
def test_the_dtype_sets_the_count_not_the_bytes(dtype, count):
    _, _, (row,) = run_collective_bench(None, None, "allreduce", [GIB], slice_name="v4-128",
                                        algorithm="torus", dtype=dtype)
    _, _, (f32,) = run_collective_bench(None, None, "allreduce", [GIB], slice_name="v4-128",
                                        algorithm="torus")
    assert (row.count, row.size_bytes, row.requested_bytes, row.cut) == (count, GIB, GIB, "")
    assert row.dtype == DTYPE_ALIASES.get(dtype, dtype) and DTYPES[row.dtype] * count == GIB
    assert row.simulated_seconds == pytest.approx(f32.simulated_seconds, rel=1e-6)


def test_a_size_that_does_not_divide_is_cut_and_says_how():
    count, cut = cut_count(1001, 2, "all_gather", 64, "bf16")
    assert count == 448  # 500 whole bf16 elements, 448 = 64 x 7
    assert "1,001 B is not a whole number of 2-byte bf16 elements" in cut
    assert "500 elements do not split into 64 equal parts" in cut
    assert "cut to 448 elements = 896 B" in cut
    assert cut_count(1024, 4, "allreduce", 64) == (256, "")
    assert cut_count(1000, 4, "allreduce", 64) == (250, "")  # an allreduce splits unevenly, uncut
    out = _invoke("--slice", "v4-128", "--op", "all-gather", "--dtype", "bf16", "--sizes", "1001")
    assert "1,001 B *" in out  # the size as given, marked
    assert "* 1,001 B: 1,001 B is not a whole number" in " ".join(out.split())
    (row,) = json.loads(_invoke("--slice", "v4-128", "--op", "all-gather", "--dtype", "bf16",
                                "--sizes", "1001", "--json"))
    assert (row["requested_bytes"], row["size_bytes"], row["count"]) == (1001, 896, 448)


def test_a_slice_is_its_chip_and_shape():
    by_slice = run_collective_bench(None, None, "allreduce", [1 << 20], slice_name="v4-128")
    by_shape = run_collective_bench("v4", "4x4x4", "allreduce", [1 << 20])
    assert by_slice[1] == by_shape[1] and by_slice[2] == by_shape[2]


def test_averages_per_algorithm_only_when_several_are_given():
    _, _, rows = run_collective_bench(None, None, "allreduce", [1 << 10, 1 << 30],
                                      slice_name="v5e-256")
    assert list(avg_bus_bandwidth(rows)) == [""]  # the fastest per size: one series
    assert len({r.algorithm for r in rows}) >= 1


@pytest.mark.parametrize("args, needle", [
    ([], "give --slice (e.g. v4-128) or --chip with --topology"),
    (["--chip", "v5e"], "give --slice (e.g. v4-128) or --chip with --topology"),
    (["--slice", "v4-100"], "--slice: slice 'v4-100' does not exist"),
    (["--slice", "v4-128", "--chip", "v5e"], "--chip: 'v5e' contradicts --slice 'v4-128'"),
    (["--slice", "v4-128", "--sizes", "3"], "size 3 B is too small for allreduce of fp32 on 64 chips"),
    (["--slice", "v4-128", "--algorithm", "ring,butterfly"], "'butterfly' is not available"),
    (["--slice", "v4-128", "--dtype", "fp8"], "dtype 'fp8' is not valid: expected one of bf16, fp32"),
])
def test_mistakes_are_one_line(capsys, args, needle):
    with pytest.raises(SystemExit) as info:
        main(["collective", *args])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1 and needle in err, err


def test_bench_errors_are_user_errors():
    with pytest.raises(BenchError, match="dtype 'f16' is not valid"):
        run_collective_bench(None, None, "allreduce", [1024], slice_name="v4-8", dtype="f16")


def test_the_readme_shows_question_c_s_real_output():
    """docs/commands.md's answer to issue 25 (c) is this command's output, byte for byte."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[3] / "docs" / "commands.md").read_text()
    command = "tpu-pod collective --slice v4-128 --sizes 1GiB --algorithm ring,torus"
    block = readme.split(f"$ {command}\n", 1)[1].split("```", 1)[0]
    assert block == _invoke(*command.split()[2:])

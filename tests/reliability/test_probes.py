"""Issue 34's probes (the third audit), each with its expected one line and the files it
must leave alone: in this process where they take well under a second (the fast tier),
and every one in a subprocess within 1 GiB of address space and 10 s of CPU (the slow
tier). Item 0 (a frozen chip, signals reaching the driver, ``RAY_ADDRESS=auto``) belongs
to the runtime stream and is not here. docs/RELIABILITY.md lists them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.reliability.harness import (
    Probe,
    bounded_cli,
    cli,
    one_line_error,
    snapshot,
    succeeded,
)

SEQ = ",".join(map(str, range(1, 5001)))
SLICES = ",".join(map(str, range(1, 3001)))

PROBES = [
    # 1. files read back without checks (the CSV and journal ones: test_read_back.py)
    Probe("import-maxtext on /dev/zero", ("import-maxtext", "/dev/zero", "--slice", "v5p-128"),
          ("/dev/zero: is a device; MaxText configs must be regular files",)),
    Probe("import-maxtext on a 3 GB sparse file",
          ("import-maxtext", "{tmp}/sparse.yml", "--slice", "v5p-128"),
          ("3,221,225,472 bytes is larger than the 1,048,576 bytes allowed",)),
    Probe("import-maxtext on a FIFO", ("import-maxtext", "{tmp}/fifo.yml", "--slice", "v5p-128"),
          ("fifo.yml: is a FIFO",)),
    Probe("plan on /dev/zero", ("plan", "/dev/zero", "--slice", "v5p-128", "--output-dir",
                                "{tmp}/plan_zero"), ("MODEL: /dev/zero: is a device",)),
    Probe("plan on a 3 GB sparse file", ("plan", "{tmp}/sparse.yml", "--slice", "v5p-128",
                                         "--output-dir", "{tmp}/plan_sparse"),
          ("MODEL:", "is larger than the 1,048,576 bytes allowed")),
    Probe("plan on a FIFO", ("plan", "{tmp}/fifo.yml", "--slice", "v5p-128", "--output-dir",
                             "{tmp}/plan_fifo"), ("MODEL:", "fifo.yml: is a FIFO")),
    # 2. memory decided by the input
    Probe("export of a checkpoint declaring a 2^32 x 2^32 array",
          ("export", "{tmp}/bad/huge_shape.msgpack", "--output", "{tmp}/x.safetensors"),
          ("needs 73,786,976,294,838,206,464 bytes, has 0",)),
    Probe("generate from a checkpoint declaring a 2^32 x 2^32 array",
          ("generate", "{tmp}/bad/huge_shape.msgpack"), ("needs 73,786,976,294,838,206,464",)),
    Probe("generate from a checkpoint whose model options declare huge layers",
          ("generate", "{tmp}/bad/huge_model.msgpack"),
          ("the checkpoint's model does not build", "head_dim must be at most 16,384")),
    Probe("generate from a checkpoint declaring 600 layers it does not hold",
          ("generate", "{tmp}/bad/many_layers.msgpack"), ("params lacks",)),
    Probe("export with a sparse 20 GB file named like the newest checkpoint",
          ("export", "{tmp}/sparse_ck", "--output", "{tmp}/sparse_ck.safetensors"), None),
    Probe("export of a legitimate checkpoint under the address-space limit",
          ("export", "{tmp}/ck", "--output", "{tmp}/legit.safetensors"), None),
    Probe("collective on a 1-D torus of 1,000,000 chips",
          ("collective", "--chip", "v4", "--topology", "1000000", "--sizes", "1KiB"),
          ("1,000,000 chips", "units of work, more than")),
    Probe("collective on a 1000x1000 torus (a 7.44 GiB numpy array before)",
          ("collective", "--chip", "v4", "--topology", "1000x1000", "--sizes", "1MiB"),
          ("1000x1000 torus", "units of work, more than")),
    Probe("collective of a size that overflows a C long",
          ("collective", "--slice", "v4-8", "--sizes", "100000000000000000000"),
          ("more than the 70,368,744,177,664 (64 TiB) a collective may move",)),
    Probe("all-to-all on 16,384 chips", ("collective", "--chip", "v5p", "--topology", "16x32x32",
                                         "--op", "all-to-all", "--sizes", "1MiB:1GiB"),
          None, fast=False),
    Probe("all-to-all on v4-8192", ("collective", "--slice", "v4-8192", "--op", "all-to-all",
                                    "--sizes", "1MiB:1GiB"), None, fast=False),
    Probe("all-to-all on v5p-17920", ("collective", "--slice", "v5p-17920", "--op",
                                      "all-to-all", "--sizes", "1MiB:1GiB"), None, fast=False),
    Probe("all-to-all on 128 chips in a row", ("collective", "--chip", "v4", "--topology", "128",
                                               "--op", "all-to-all"), None, fast=False),
    Probe("a functional benchmark of a v5p GEMM with n = 40000",
          ("run", "{tmp}/bench_big.yaml", "--output-dir", "{tmp}/bench_big_out"),
          ("functional chips", "benchmark.functional: false")),
    # 3. waits and work the input decides
    Probe("plan --seq-len 1e9", ("plan", "llama2-7b", "--slice", "v5e-256", "--seq-len",
                                 "1000000000"), ("'--seq-len'", "1<=x<=1048576")),
    Probe("plan --tokens-per-step 1e30", ("plan", "llama2-7b", "--slice", "v5e-256",
                                          "--tokens-per-step", "1e30"),
          ("--tokens-per-step: '1e30' is not a positive whole number (below 2^63)",)),
    Probe("plan --per-device-batch 1..5000", ("plan", "llama2-7b", "--slice", "v5e-256",
                                              "--per-device-batch", SEQ, "--output-dir",
                                              "{tmp}/plan_pdb"),
          ("the search has 4,950,000 points", "more than the 50,000 allowed")),
    Probe("plan --num-slices 1..3000", ("plan", "llama2-7b", "--slice", "v5e-256",
                                        "--num-slices", SLICES),
          ("--num-slices: '257' is not a whole number of slices from 1 to 256",)),
    Probe("a sweep of 144,000 points", ("sweep", "{tmp}/bigsweep.yaml", "--output-dir",
                                        "{tmp}/bigsweep_out"),
          ("the sweep has 144,000 points", "more than the 10,000 allowed")),
    Probe("a benchmark with cpu_n 8192 and cpu_iterations 10000",
          ("validate", "{tmp}/bench_cpu.yaml"), ("FLOPs of host numpy", "lower cpu_n")),
    Probe("--chips 1048576", ("plan", "llama2-7b", "--slice", "v5e", "--chips", "1048576"),
          ("v5e slices have 1, 4, 8, 16, 32, 64, 128 or 256 chips",)),
    Probe("validate with layers: 1000000000", ("validate", "{tmp}/layers.yaml"),
          ("option layers must be at most 4,096, got 1,000,000,000",)),
    Probe("import-maxtext with base_num_decoder_layers=1000000000",
          ("import-maxtext", "{data}/base-2023-12.yml", "{data}/models/llama2-7b.yml",
           "base_num_decoder_layers=1000000000", "--slice", "v5p-128", "-o",
           "{tmp}/refused.yaml"), ("option layers must be at most 4,096",), notes=True),
    # 4. writes
    Probe("export --output onto a link to /proc/self/fd/1",
          ("export", "{tmp}/ck", "--output", "{tmp}/out/proc_link.safetensors"),
          ("it is a link to /proc/self/fd/1; only a regular file is replaced",),
          keep=("out",)),
    Probe("export --output onto a link to /dev/null",
          ("export", "{tmp}/ck", "--output", "{tmp}/out/null_link.safetensors"),
          ("it is a link to /dev/null",), keep=("out",)),
    Probe("export --output onto a FIFO",
          ("export", "{tmp}/ck", "--output", "{tmp}/out/fifo.safetensors"),
          ("it is a FIFO; only a regular file is replaced",), keep=("out",)),
    Probe("import-maxtext -o FILE where a link to another file is planted",
          ("import-maxtext", "{data}/base-2023-12.yml", "{data}/models/llama2-7b.yml",
           "--slice", "v5p-128", "-o", "{tmp}/out/planted.yaml"), None,
          keep=("victim.txt",), notes=True),
]


def _ids(probe: Probe) -> str:
    return probe.name


def _check(probe: Probe, result, tmp: Path, before: dict[str, str]) -> None:
    if probe.expect is None:
        succeeded(result)
    else:
        one_line_error(result, *probe.expect, notes=probe.notes)
    assert snapshot(*(tmp / k for k in probe.keep)) == before


@pytest.mark.parametrize("probe", [p for p in PROBES if p.fast], ids=_ids)
def test_probe_in_process(probe, corpus):
    before = snapshot(*(corpus / k for k in probe.keep))
    _check(probe, cli(probe.command(corpus), corpus), corpus, before)


@pytest.mark.slow
@pytest.mark.parametrize("probe", PROBES, ids=_ids)
def test_probe_within_1_gib_and_10_s_of_cpu(probe, corpus):
    before = snapshot(*(corpus / k for k in probe.keep))
    _check(probe, bounded_cli(probe.command(corpus), corpus), corpus, before)


def test_a_refused_import_writes_nothing_and_a_planted_link_is_replaced_not_followed(
        corpus, tmp_path):
    """import-maxtext wrote its scenario before a refusal (exit 2), and through a link
    planted at -o FILE (exit 0) where export refused it."""
    data = Path(__file__).resolve().parents[1] / "data" / "maxtext"
    victim, planted = tmp_path / "victim.txt", tmp_path / "planted.yaml"
    victim.write_text("the victim's data\n")
    planted.symlink_to(victim)
    args = ["import-maxtext", str(data / "base-2023-12.yml"), str(data / "models/llama2-7b.yml"),
            "--slice", "v5p-128", "-o"]
    one_line_error(cli([*args[:3], "base_num_decoder_layers=1000000000", *args[3:],
                        str(tmp_path / "refused.yaml")], tmp_path),
                   "option layers must be at most 4,096", notes=True)
    assert not (tmp_path / "refused.yaml").exists()
    succeeded(cli([*args, str(planted)], tmp_path))
    assert victim.read_text() == "the victim's data\n"
    assert not planted.is_symlink() and "base_emb_dim" not in planted.read_text()[:0]
    assert planted.read_text().startswith("#")

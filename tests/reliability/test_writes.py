"""Issue 34, item 4, and the recovery item: every write through ``write_atomic``, nothing
replaced that is not a regular file, a full disk one line and exit 2 for every command
(a real full tmpfs, in a private mount namespace), a checkpoint directory that is a link
to the output directory, and a recovery that succeeds without Ray's stack dumps."""

from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest
import yaml

from tests.reliability.conftest import TINY
from tests.reliability.harness import (
    ROOT,
    bounded_cli,
    cli,
    one_line_error,
    snapshot,
    succeeded,
)


@pytest.mark.skipif(os.geteuid() != 0, reason="making a device node needs root")
def test_export_refuses_to_replace_a_character_device(corpus, tmp_path):
    """As root, --output /dev/null would have replaced /dev/null with a regular file;
    tried on a node of our own."""
    node = tmp_path / "null"
    os.mknod(node, 0o666 | 0o020000, os.makedev(1, 3))
    one_line_error(cli(["export", str(corpus / "ck"), "--output", str(node)], tmp_path),
                   "it is a device; only a regular file is replaced")
    assert not node.is_file() and node.exists()


FULL_DISK = {  # the command, with {out} the full disk and {tmp} the corpus
    "run": ("run", "{tmp}/tiny.yaml", "--in-process", "--output-dir", "{out}/run"),
    "export": ("export", "{tmp}/ck", "--output", "{out}/w.safetensors"),
    "import-maxtext": ("import-maxtext", "{data}/base-2023-12.yml",
                       "{data}/models/llama2-7b.yml", "--slice", "v5p-128", "-o",
                       "{out}/im.yaml"),
    "plan": ("plan", "{tmp}/tiny.yaml", "--slice", "v5e-8", "--remat", "none",
             "--per-device-batch", "1", "--mesh-axes", "data", "--output-dir", "{out}/plan"),
    "sweep": ("sweep", "{tmp}/sweep.yaml", "--output-dir", "{out}/sweep"),
    "init": ("init", "{out}/init"),
}


@pytest.mark.slow
@pytest.mark.parametrize("command", FULL_DISK)
def test_a_full_disk_is_one_line_and_exit_2(corpus, tmp_path, command):
    """export exited 0 with no message and import-maxtext ended in an OSError traceback;
    every command now ends in one line, exit 2."""
    out = tmp_path / "full"
    data = ROOT / "tests" / "data" / "maxtext"
    args = [a.format(tmp=corpus, out=out, data=data) for a in FULL_DISK[command]]
    result = bounded_cli(args, tmp_path, full_disk=out)
    one_line_error(result, "cannot write (No space left on device)",
                   notes=command == "import-maxtext")


@pytest.mark.slow
def test_steps_csv_ends_in_whole_rows_when_the_disk_fills_mid_run(corpus, tmp_path):
    """After the disk filled mid-run, steps.csv ended in half a row (cut at 4,096 bytes)."""
    scenario = {**TINY, "training": {**TINY["training"], "steps": 200,
                                     "eval_every_steps": 0}}
    scenario.pop("checkpoint")
    path = tmp_path / "long.yaml"
    path.write_text(yaml.safe_dump(scenario))
    out = tmp_path / "full"
    script = (f"mount -t tmpfs -o size=64k tmpfs '{out}' && "
              f"dd if=/dev/zero of='{out}/filler' bs=1k count=20 2>/dev/null; "
              f"'{sys.executable}' -m pod run '{path}' --in-process --log-every 0 "
              f"--output-dir '{out}/run' 2> '{tmp_path}/err'; echo $? > '{tmp_path}/code'; "
              f"cp '{out}/run/steps.csv' '{tmp_path}/steps.csv'")
    from tests.reliability.harness import can_fill_a_disk

    if not can_fill_a_disk():
        pytest.skip("no private mount namespace here (unshare --user --mount)")
    out.mkdir()
    subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
                   cwd=ROOT, timeout=600, check=True,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert (tmp_path / "code").read_text().strip() == "2"
    err = (tmp_path / "err").read_text()
    assert err.count("\n") == 1 and err.startswith("error: ") and "steps.csv" in err, err
    raw = (tmp_path / "steps.csv").read_bytes()
    assert raw.endswith(b"\r\n")
    with (tmp_path / "steps.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, len(rows) + 1)) and len(rows) > 5


@pytest.mark.slow
def test_a_checkpoint_dir_that_links_to_the_output_dir_is_locked_once(corpus, tmp_path):
    """The run refused itself ("in use by another tpu-pod command", naming its own pid)."""
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "ck").symlink_to(out)
    scenario = {**TINY, "checkpoint": {"every_steps": 2, "dir": str(tmp_path / "ck")}}
    path = tmp_path / "linked.yaml"
    path.write_text(yaml.safe_dump(scenario))
    succeeded(bounded_cli(["run", str(path), "--in-process", "--output-dir", str(out),
                           "--log-every", "0"], tmp_path))
    assert (out / "ckpt-00000004.msgpack").is_file() and (out / "summary.json").is_file()


@pytest.mark.slow
def test_a_recovery_that_succeeds_prints_no_stack_dumps(tmp_path):
    """A multislice slow_dcn + kill_chip + slow_chip run recovered bit-identically but
    printed 165 lines of Ray "Unhandled error" (the failed step's calls on the stuck
    chips were never read). Ray chip actors: a few minutes on a busy machine."""
    scenario = yaml.safe_load((ROOT / "scenarios" /
                               "multislice-transformer-2x-v5e-4.yaml").read_text())
    scenario.update(name="recovery", checkpoint={"every_steps": 2}, faults=[
        {"kind": "slow_dcn", "slice": 1, "slowdown": 4.0, "step": 1},
        {"kind": "kill_chip", "chip": 5, "step": 3},
        {"kind": "slow_chip", "chip": 2, "factor": 3.0, "step": 2}])
    path = tmp_path / "recovery.yaml"
    path.write_text(yaml.safe_dump(scenario))
    before = snapshot(path)
    proc = subprocess.run([sys.executable, "-m", "pod", "run", str(path), "--output-dir",
                           str(tmp_path / "out"), "--log-every", "0"], cwd=ROOT,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Unhandled error" not in proc.stderr and "Traceback" not in proc.stderr, \
        proc.stderr[-3000:]
    assert "restored step 2" in proc.stdout
    assert snapshot(path) == before


@pytest.mark.parametrize("code, shown", [(28, "cannot write (No space left on device)"),
                                         (13, ": Permission denied")])
def test_a_refusal_no_command_caught_is_still_one_line(tmp_path, monkeypatch, code, shown):
    """The CLI's last line of defence: an OSError of the file system (ENOSPC, EACCES, ...)
    that a command did not turn into its own line is one line, exit 2, not a traceback."""
    import errno as errnos

    from pod.commands import init

    def refuse(*args, **kwargs):
        raise OSError(code, os.strerror(code), str(tmp_path / "x" / "f.yaml"))

    monkeypatch.setattr(init, "init_directory", refuse)
    result = cli(["init", str(tmp_path / "x")], tmp_path)
    one_line_error(result, str(tmp_path / "x" / "f.yaml"), shown)
    assert code in (errnos.ENOSPC, errnos.EACCES)

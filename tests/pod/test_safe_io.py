"""Every file the tool writes goes through one helper (``pod.safe_io.write_atomic``):
a fresh temporary name, fsync, rename, no planted link followed, nothing left on
failure, and what a ``kill -9`` leaves removed by the next run. No Ray."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import numpy as np
import pytest

from pod.errors import OutputError
from pod.safe_io import read_regular, remove_stale_temporaries, write_atomic
from pod.state.checkpoint import Checkpoint, load_checkpoint, save_checkpoint


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_link_planted_at_the_target_is_replaced_not_followed(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("the victim's data")
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.json").symlink_to(victim)
    write_atomic(out / "summary.json", lambda f: f.write("{}"))
    assert victim.read_text() == "the victim's data"
    assert not (out / "summary.json").is_symlink() and (out / "summary.json").read_text() == "{}"


def test_export_never_writes_through_a_fixed_temporary_name(tmp_path):
    """Probe 6: export wrote through ``.<name>.tmp``; a link planted there by another
    user had the victim's file overwritten."""
    from pod.state.export import export_safetensors

    victim = tmp_path / "victim.txt"
    victim.write_text("the victim's data")
    (tmp_path / ".w.safetensors.tmp").symlink_to(victim)
    ck = Checkpoint(step=1, scenario={}, params={"w": np.ones(3, np.float32)})
    export_safetensors(ck, tmp_path / "w.safetensors")
    assert victim.read_text() == "the victim's data"
    assert (tmp_path / "w.safetensors").stat().st_size > 0


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "results.csv"
    path.write_text("old")

    def full(f):
        f.write("new, half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(OutputError, match=r"results\.csv: cannot write \(No space left on device\)"):
        write_atomic(path, full)
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["results.csv"]


def test_a_full_disk_while_plotting_is_one_line_and_no_png(tmp_path):
    """Probe: a sweep whose disk filled while plotting was a PIL traceback and left a
    truncated PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pod.commands.sweep import _save_png

    fig, ax = plt.subplots()
    ax.plot([1, 2], [3, 4])

    class Full(Exception):
        pass

    original = fig.savefig

    def savefig(f, **kwargs):
        original(f, **kwargs)  # writes the PNG's bytes, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    fig.savefig = savefig
    with pytest.raises(OutputError, match=r"throughput\.png: cannot write \(No space left"):
        _save_png(fig, tmp_path / "throughput.png")
    plt.close(fig)
    assert list(tmp_path.iterdir()) == []


def test_what_a_kill_9_leaves_is_removed_by_name_and_pid(tmp_path):
    """Probe: a temporary checkpoint file survived kill -9. Its name carries the
    writer's pid: a dead writer's is removed, a live one's kept, other files kept."""
    dead = tmp_path / f".ckpt-00000004.msgpack.tmp-{_dead_pid()}-abc123xy"
    live = tmp_path / f".ckpt-00000006.msgpack.tmp-{os.getpid()}-abc123xy"
    for p in (dead, live, tmp_path / "ckpt-00000002.msgpack", tmp_path / "notes.tmp"):
        p.write_bytes(b"x")
    assert remove_stale_temporaries(tmp_path) == [dead]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [live.name, "ckpt-00000002.msgpack", "notes.tmp"])


def test_a_checkpoint_killed_mid_write_leaves_a_file_named_for_its_pid(tmp_path):
    """A writer killed between the temporary file and the rename (kill -9)."""
    code = ("import os, numpy as np\n"
            "from pod.safe_io import write_atomic\n"
            f"write_atomic({str(tmp_path / 'ckpt-00000002.msgpack')!r}, "
            "lambda f: (f.write(b'half'), f.flush(), os.kill(os.getpid(), 9)), binary=True)\n")
    proc = subprocess.run([sys.executable, "-c", code])
    assert proc.returncode == -9
    left = [p.name for p in tmp_path.iterdir()]
    assert len(left) == 1 and left[0].startswith(".ckpt-00000002.msgpack.tmp-")
    assert remove_stale_temporaries(tmp_path) and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "directory"])
def test_reading_a_fifo_or_device_as_a_checkpoint_is_one_line(tmp_path, kind):
    path = {"fifo": tmp_path / "ckpt-00000001.msgpack", "dev_zero": "/dev/zero",
            "directory": tmp_path}[kind]
    if kind == "fifo":
        os.mkfifo(path)
    from pod.errors import CheckpointError

    with pytest.raises(CheckpointError, match=r"is (a FIFO|a device|a directory); checkpoints "
                                              r"must be regular files"):
        load_checkpoint(path)


def test_read_regular_is_bounded(tmp_path):
    path = tmp_path / "big"
    path.write_bytes(b"x" * 101)
    assert read_regular(path, 101) == b"x" * 101
    with pytest.raises(ValueError, match="larger than the 100 bytes"):
        read_regular(path, 100)


def test_checkpoints_still_round_trip(tmp_path):
    ck = Checkpoint(step=3, scenario={}, params={"w": np.arange(4, dtype=np.float32)})
    save_checkpoint(tmp_path / "ck" / "ckpt-00000003.msgpack", ck)
    back = load_checkpoint(tmp_path / "ck" / "ckpt-00000003.msgpack")
    assert back.step == 3 and np.array_equal(back.params["w"], ck.params["w"])
    assert [p.name for p in (tmp_path / "ck").iterdir()] == ["ckpt-00000003.msgpack"]


def test_init_into_a_folder_that_cannot_be_made_is_one_line(tmp_path):
    """Probe: `tpu-pod init /proc/foo` was a FileNotFoundError traceback."""
    proc = subprocess.run([sys.executable, "-m", "pod", "init", "/proc/foo"],
                          capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: /proc/foo") and "cannot write" in proc.stderr

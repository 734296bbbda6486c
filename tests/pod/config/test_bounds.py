"""Bounds on what a scenario and its data files can cost: file size, YAML nesting
and aliases, bounded messages, regular data files only, capped decompression. No Ray."""

from __future__ import annotations

import gzip
import os
import threading
import time

import pytest

from pod.config.scenario import MAX_SCENARIO_BYTES, load_scenario, parse_scenario
from pod.errors import ScenarioError
from pod.workloads import files, load_dataset

BASE = ("name: ok\npod: {slice: v2-8}\nmodel: {name: mlp}\n"
        "training: {global_batch: 64, steps: 1}\nmetrics: {port: 0}\n")


def finishes(fn, seconds=20.0):
    """Run ``fn`` in a thread; its exception or result, or fail if it is still blocked."""
    out = {}

    def target():
        try:
            out["result"] = fn()
        except BaseException as err:  # noqa: BLE001 - handed to the test
            out["error"] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still blocked after {seconds} s"
    return out


def test_an_alias_bomb_is_refused_in_milliseconds(tmp_path):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 10)]
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\n" + BASE.replace("{name: mlp}", "{name: mlp, options: "
                                                                          "{x: *a9}}"))
    assert path.stat().st_size < 1024
    t0 = time.perf_counter()
    with pytest.raises(ScenarioError, match="expands to more than 100,000 values"):
        load_scenario(path)
    assert time.perf_counter() - t0 < 5.0


def test_a_bomb_under_the_limit_gives_a_short_message(tmp_path):
    """The error message repr()s the value: bounded, whatever the expanded size."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 4)]
    path = tmp_path / "small-bomb.yaml"
    path.write_text("\n".join(lines) + "\n" + BASE.replace("{slice: v2-8}", "{slice: v2-8, "
                                                                           "topology: *a3}"))
    with pytest.raises(ScenarioError) as err:
        load_scenario(path)
    assert "pod.topology" in str(err.value) and len(str(err.value)) < 400


def test_deep_nesting_is_refused_not_a_recursion_error(tmp_path):
    path = tmp_path / "deep.yaml"
    path.write_text(BASE + "x: " + "[" * 10000 + "]" * 10000 + "\n")
    with pytest.raises(ScenarioError, match="nested deeper than 64 levels"):
        load_scenario(path)


def test_a_large_file_and_an_endless_one_are_refused(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text(BASE + "description: '" + "x" * MAX_SCENARIO_BYTES + "'\n")
    with pytest.raises(ScenarioError, match="larger than 1,048,576 bytes"):
        load_scenario(path)
    out = finishes(lambda: load_scenario("/dev/zero"))
    assert isinstance(out.get("error"), ScenarioError), out


def test_a_long_value_is_shown_bounded():
    with pytest.raises(ScenarioError) as err:
        parse_scenario({"name": "x" * 100_000, "pod": {"slice": "v2-8"}})
    assert len(str(err.value)) < 400


def test_a_fifo_named_like_a_data_file_does_not_block(tmp_path):
    root = tmp_path / "cifar-10-batches-py"
    root.mkdir()
    os.mkfifo(root / "data_batch_1")
    (root / "test_batch").write_bytes(b"")
    out = finishes(lambda: load_dataset("cifar10", path=root))
    assert isinstance(out.get("error"), ValueError), out
    assert str(out["error"]) == f"{root / 'data_batch_1'}: is a FIFO; data files must be regular files"


def test_a_device_as_a_data_file_is_refused(tmp_path):
    link = tmp_path / "reviews.txt"
    link.symlink_to("/dev/zero")
    out = finishes(lambda: load_dataset("text", path=link))
    assert "is a device; data files must be regular files" in str(out.get("error")), out


def test_a_gzip_bomb_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "MAX_DECOMPRESSED_BYTES", 1 << 20)
    root = tmp_path / "mnist"
    root.mkdir()
    with gzip.open(root / "train-images-idx3-ubyte.gz", "wb") as f:
        f.write(bytes([0, 0, 8, 1]) + (8 << 20).to_bytes(4, "big") + bytes(8 << 20))
    with pytest.raises(ValueError, match=r"train-images-idx3-ubyte.gz: decompresses to more than "
                                         r"1,048,576 bytes"):
        load_dataset("mnist", path=root)

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


def test_a_gzip_bomb_stops_at_the_size_its_idx_header_declares(tmp_path):
    """A header declaring 16 bytes of labels followed by 64 MiB of zeros: reading stops
    at the declared size (memory bounded by the header, not by MAX_DECOMPRESSED_BYTES)."""
    root = tmp_path / "mnist"
    root.mkdir()
    with gzip.open(root / "train-images-idx3-ubyte.gz", "wb") as f:
        f.write(bytes([0, 0, 8, 1]) + (16).to_bytes(4, "big") + bytes(64 << 20))
    with pytest.raises(ValueError, match=r"train-images-idx3-ubyte.gz: decompresses to more than "
                                         r"the 24 bytes its IDX header declares; refused"):
        load_dataset("mnist", path=root)


def huge_array_pickle(elements: int = 2**40) -> bytes:
    """A 100-byte pickle: ``numpy._core.multiarray._reconstruct(ndarray, (elements,), b'b')``,
    which allocates its shape before reading any data."""
    import pickle

    return (b"\x80\x02cnumpy._core.multiarray\n_reconstruct\nq\x00cnumpy\nndarray\nq\x01"
            + pickle.dumps((elements,), protocol=2)[2:-1] + b"C\x01b\x87R.")


def lying_npz(path, rows: int = 2**37) -> None:
    """An .npz of a few hundred bytes whose x_train.npy header declares (rows, 8) int32."""
    import io
    import zipfile

    import numpy as np

    def npy(arr, shape=None) -> bytes:
        buffer = io.BytesIO()
        np.save(buffer, arr)
        raw = buffer.getvalue()
        if shape is None:
            return raw
        length = int.from_bytes(raw[8:10], "little")
        header = raw[10:10 + length].decode("latin1").replace(repr(arr.shape), repr(shape))
        header = header.rstrip().ljust(length - 1) + "\n"
        return raw[:10] + header.encode("latin1") + raw[10 + length:]

    x, y = np.zeros((4, 8), np.int32), np.zeros(4, np.int32)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("x_train.npy", npy(x, (rows, 8)))
        for name, arr in (("y_train", y), ("x_test", x), ("y_test", y)):
            z.writestr(f"{name}.npy", npy(arr))


def test_a_pickled_array_asking_for_a_tebibyte_is_refused_before_allocation(tmp_path):
    root = tmp_path / "cifar-10-batches-py"
    root.mkdir()
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (root / name).write_bytes(huge_array_pickle())
    out = finishes(lambda: load_dataset("cifar10", path=root))
    assert str(out.get("error")) == (
        f"{root / 'data_batch_1'}: not a CIFAR-10 python batch (an array of shape "
        "(1099511627776,) is larger than the 1,073,741,824 bytes allowed)"), out


def test_an_npz_header_declaring_more_than_its_bytes_is_refused(tmp_path):
    path = tmp_path / "imdb.npz"
    lying_npz(path)
    assert path.stat().st_size < 2000
    out = finishes(lambda: load_dataset("imdb", path=path))
    assert str(out.get("error")) == (
        f"{path}: x_train.npy declares shape (137438953472, 8) of int32 (4,398,046,511,104 "
        "bytes) but holds 256 bytes; refused"), out


def _numeric(annotation) -> bool:
    import typing

    args = typing.get_args(annotation) or (annotation,)
    return any(a in (int, float) for a in args) and bool not in args


def _has_upper_bound(metadata) -> bool:
    return any(getattr(m, "le", None) is not None or getattr(m, "lt", None) is not None
               for m in metadata)


def test_every_number_of_a_scenario_has_an_upper_bound():
    """So that no value can overflow the cost model (a documented MAX_* each)."""
    import typing

    from pydantic import BaseModel

    from pod.config import scenario as module

    unbounded = []
    for cls in vars(module).values():
        if not (isinstance(cls, type) and issubclass(cls, BaseModel) and cls is not BaseModel):
            continue
        for name, field in cls.model_fields.items():
            annotation = field.annotation
            inner = [a for a in typing.get_args(annotation) if typing.get_args(a)]
            for a in inner:  # tuple[Annotated[int, Field(...)], ...]
                for item in typing.get_args(a):
                    if typing.get_origin(item) is typing.Annotated:
                        base, *meta = typing.get_args(item)
                        if _numeric(base) and not _has_upper_bound(
                                [m for f in meta for m in getattr(f, "metadata", [f])]):
                            unbounded.append(f"{cls.__name__}.{name}[]")
            if _numeric(annotation) and not _has_upper_bound(field.metadata):
                unbounded.append(f"{cls.__name__}.{name}")
    assert not unbounded


def test_a_fault_after_the_last_step_is_an_error():
    from pod.config.plan import build_plan

    data = {"name": "late", "pod": {"slice": "v2-8"}, "model": {"name": "mlp"},
            "training": {"global_batch": 64, "steps": 20}, "metrics": {"port": 0},
            "faults": [{"kind": "slow_chip", "chip": 1, "factor": 2.0, "step": 50}]}
    with pytest.raises(ScenarioError, match=r"^faults\.0\.step: 50 is after the last step \(20\)"):
        build_plan(parse_scenario(data))


@pytest.mark.parametrize("name", [".", "..", "..."])
def test_a_name_that_is_not_a_directory_inside_runs_is_refused(name):
    with pytest.raises(ScenarioError, match=r"name: must name a directory inside runs/"):
        parse_scenario({"name": name, "pod": {"slice": "v2-8"}})

"""Dataset loaders for the user's files: tiny MNIST IDX, CIFAR-10 pickle, IMDB
folder and .npz files written here, the safe unpickler refusing code, clear
errors for missing or malformed paths, and scenario-relative paths. No Ray."""

from __future__ import annotations

import gzip
import os
import pickle
import struct

import numpy as np
import pytest

from pod.errors import ScenarioError
from pod.config.plan import build_plan
from pod.config.scenario import load_scenario
from pod.workloads import load_dataset
from pod.workloads.files import pad_sequences, python_docs_text, read_idx, tokenize


def write_idx(path, array: np.ndarray, *, gz=False):
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(struct.pack(">I", d) for d in array.shape)
    data = header + array.astype(np.uint8).tobytes()
    (gzip.open if gz else open)(path, "wb").write(data)


def make_mnist(root, n_train=6, n_test=4):
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    train = rng.integers(0, 256, (n_train, 28, 28))
    write_idx(root / "train-images-idx3-ubyte.gz", train, gz=True)
    write_idx(root / "train-labels-idx1-ubyte", np.arange(n_train) % 10)
    write_idx(root / "t10k-images-idx3-ubyte", rng.integers(0, 256, (n_test, 28, 28)))
    write_idx(root / "t10k-labels-idx1-ubyte", np.arange(n_test) % 10)
    return train


def test_mnist_idx_files(tmp_path):
    train = make_mnist(tmp_path / "mnist")
    ds = load_dataset("mnist", path=tmp_path / "mnist")
    assert ds.x_train.shape == (6, 28, 28, 1) and ds.x_test.shape == (4, 28, 28, 1)
    assert not ds.synthetic and ds.num_classes == 10
    np.testing.assert_allclose(ds.x_train[2, :, :, 0], train[2] / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(ds.y_train, np.arange(6) % 10)
    # malformed: truncated data, bad magic
    bad = tmp_path / "bad"
    make_mnist(bad)
    raw = (bad / "t10k-images-idx3-ubyte").read_bytes()
    (bad / "t10k-images-idx3-ubyte").write_bytes(raw[:-5])
    with pytest.raises(ValueError, match="t10k-images-idx3-ubyte.*need 3136 data bytes"):
        load_dataset("mnist", path=bad)
    (bad / "t10k-images-idx3-ubyte").write_bytes(b"PK\x03\x04" + raw[4:])
    with pytest.raises(ValueError, match="not an IDX file"):
        read_idx(bad / "t10k-images-idx3-ubyte")
    os.remove(bad / "t10k-images-idx3-ubyte")
    with pytest.raises(ValueError, match="no t10k-images-idx3-ubyte file"):
        load_dataset("mnist", path=bad)


def test_keras_mnist_npz_reads_as_the_idx_files_do(tmp_path):
    """Keras's mnist.npz (its keys and dtypes, generated small here) loads to the same
    arrays as the IDX files holding the same pixels; as a file or in a directory."""
    rng = np.random.default_rng(1)
    arrays = {"x_train": rng.integers(0, 256, (6, 28, 28)).astype(np.uint8),
              "y_train": (np.arange(6) % 10).astype(np.uint8),
              "x_test": rng.integers(0, 256, (4, 28, 28)).astype(np.uint8),
              "y_test": (np.arange(4) % 10).astype(np.uint8)}
    folder = tmp_path / "keras"
    folder.mkdir()
    np.savez_compressed(folder / "mnist.npz", **arrays)
    idx = tmp_path / "idx"
    idx.mkdir()
    for split, prefix in (("train", "train"), ("test", "t10k")):
        write_idx(idx / f"{prefix}-images-idx3-ubyte", arrays[f"x_{split}"])
        write_idx(idx / f"{prefix}-labels-idx1-ubyte", arrays[f"y_{split}"])
    reference = load_dataset("mnist", path=idx)
    for path in (folder / "mnist.npz", folder):
        ds = load_dataset("mnist", path=path)
        for name in ("x_train", "y_train", "x_test", "y_test"):
            np.testing.assert_array_equal(getattr(ds, name), getattr(reference, name))
        np.testing.assert_allclose(ds.x_test[..., 0], arrays["x_test"] / 255.0, rtol=1e-6)
    np.savez(tmp_path / "partial.npz", x_train=arrays["x_train"], y_train=arrays["y_train"])
    with pytest.raises(ValueError, match="missing array 'x_test'; mnist .npz needs x_train"):
        load_dataset("mnist", path=tmp_path / "partial.npz")
    (tmp_path / "fake.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="not a .npz archive"):
        load_dataset("mnist", path=tmp_path / "fake.npz")


def cifar_batch(n, seed, **extra):
    rng = np.random.default_rng(seed)
    return {b"batch_label": b"test", b"labels": [int(v) for v in rng.integers(0, 10, n)],
            b"data": rng.integers(0, 256, (n, 3072)).astype(np.uint8),
            b"filenames": [b"x.png"] * n, **extra}


def test_cifar10_pickle_batches_load_safely(tmp_path):
    root = tmp_path / "cifar-10-batches-py"
    root.mkdir()
    batches = [cifar_batch(5, 1), cifar_batch(3, 2)]
    for i, b in enumerate(batches, start=1):
        (root / f"data_batch_{i}").write_bytes(pickle.dumps(b, protocol=2))
    (root / "test_batch").write_bytes(pickle.dumps(cifar_batch(4, 3), protocol=4))
    ds = load_dataset("cifar10", path=root)
    assert ds.x_train.shape == (8, 32, 32, 3) and ds.x_test.shape == (4, 32, 32, 3)
    # channel planes: the first 1024 bytes are red, row-major
    red = batches[0][b"data"][1, :1024].reshape(32, 32)
    np.testing.assert_allclose(ds.x_train[1, :, :, 0], red / 255.0, rtol=1e-6)
    np.testing.assert_allclose(ds.x_train[6, 3, 4, 2], batches[1][b"data"][1, 2048 + 3 * 32 + 4] / 255.0)
    assert list(ds.y_train[5:]) == batches[1][b"labels"]


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_cifar10_refuses_a_pickle_that_would_run_code(tmp_path):
    root = tmp_path / "c"
    root.mkdir()
    (root / "data_batch_1").write_bytes(pickle.dumps(cifar_batch(2, 0, evil=_Evil()), protocol=2))
    (root / "test_batch").write_bytes(pickle.dumps(cifar_batch(2, 0)))
    with pytest.raises(ValueError, match=r"data_batch_1.*refusing to load (posix|os)\.system"):
        load_dataset("cifar10", path=root)
    assert not (tmp_path / "pwned").exists() and not os.path.exists("pwned")
    (root / "data_batch_1").write_bytes(pickle.dumps({"data": np.zeros((2, 10), np.uint8),
                                                      "labels": [0, 1]}))
    with pytest.raises(ValueError, match=r"'data' must be a uint8 array \(N, 3072\)"):
        load_dataset("cifar10", path=root)


def test_imdb_folders_and_npz(tmp_path):
    root = tmp_path / "reviews"
    reviews = {"pos": ["A great, great film.<br />Loved it", "great fun", "loved the cast"],
               "neg": ["Awful film", "boring and awful", "not great at all, awful"]}
    for label, texts in reviews.items():
        (root / label).mkdir(parents=True)
        for i, text in enumerate(texts):
            (root / label / f"{i}_1.txt").write_text(text)
    ds = load_dataset("imdb", path=root, num_words=6, maxlen=5, test_fraction=0.34)
    assert ds.x_train.shape == (4, 5) and ds.x_test.shape == (2, 5) and ds.num_classes == 2
    assert ds.x_train.dtype == np.int32 and ds.x_train.max() <= 5
    assert sorted(np.concatenate([ds.y_train, ds.y_test])) == [0, 0, 0, 1, 1, 1]
    assert tokenize("A great,<br />GREAT film") == ["a", "great", "great", "film"]
    np.testing.assert_array_equal(pad_sequences([[1, 2], [3, 4, 5, 6, 7, 8]], 4),
                                  [[0, 0, 1, 2], [5, 6, 7, 8]])
    # the aclImdb layout: train/ and test/
    acl = tmp_path / "aclImdb"
    for split in ("train", "test"):
        for label, texts in reviews.items():
            (acl / split / label).mkdir(parents=True)
            for i, text in enumerate(texts):
                (acl / split / label / f"{i}.txt").write_text(text)
    ds = load_dataset("imdb", path=acl, num_words=100, maxlen=8)
    assert ds.x_train.shape == (6, 8) and ds.x_test.shape == (6, 8)
    # pre-tokenised .npz: ids above num_words become 1 (out of vocabulary)
    npz = tmp_path / "imdb.npz"
    np.savez(npz, x_train=np.array([[0, 0, 5, 7], [3, 99, 4, 2]]), y_train=np.array([1, 0]),
             x_test=np.array([[0, 6, 6, 6]]), y_test=np.array([1]))
    ds = load_dataset("imdb", path=npz, num_words=10, maxlen=3)
    np.testing.assert_array_equal(ds.x_train, [[0, 5, 7], [1, 4, 2]])
    np.testing.assert_array_equal(ds.x_test, [[6, 6, 6]])
    # Keras' imdb.npz keeps lists in object arrays: refused, pickle is never used
    ragged = np.empty(2, dtype=object)
    ragged[0], ragged[1] = [1, 2], [3]
    np.savez(tmp_path / "keras.npz", x_train=ragged, y_train=np.array([0, 1]), x_test=ragged,
             y_test=np.array([0, 1]))
    with pytest.raises(ValueError, match="keras.npz: cannot read without pickle"):
        load_dataset("imdb", path=tmp_path / "keras.npz")
    (tmp_path / "empty" / "pos").mkdir(parents=True)
    with pytest.raises(ValueError, match="no neg/ folder"):
        load_dataset("imdb", path=tmp_path / "empty")


def test_text_corpus_python_docs_and_a_file(tmp_path):
    text = python_docs_text()
    assert len(text) > 400_000 and "for" in text and "The " in text      # real English
    ds = load_dataset("text", sequence_length=32)
    assert ds.vocabulary and ds.num_classes == len(ds.vocabulary) and not ds.synthetic
    # labels are the inputs shifted by one character
    ids = {c: i for i, c in enumerate(ds.vocabulary)}
    row = "".join(ds.vocabulary[i] for i in ds.x_train[0])
    assert row in text
    start = text.index(row)
    assert [ds.vocabulary[i] for i in ds.y_train[0]] == list(text[start + 1:start + 33])
    assert ds.x_train.max() < len(ids)
    f = tmp_path / "t.txt"
    f.write_text("hello world, " * 20)
    small = load_dataset("text", path=f, sequence_length=10)
    assert small.vocabulary == " ,dehlorw" and small.x_train.shape[1] == 10
    f.write_bytes(b"\xff\xfe bad")
    with pytest.raises(ValueError, match="not UTF-8"):
        load_dataset("text", path=f)


@pytest.mark.parametrize("name, kwargs, needle", [
    ("mnist", {}, "dataset 'mnist' reads files: give data.path"),
    ("mnist", {"path": "/nonexistent/mnist"}, "path '/nonexistent/mnist' does not exist"),
    ("cifar10", {"path": "/nonexistent"}, "cifar-10-batches-py"),
    ("imdb", {"path": __file__}, "is a file but not .npz"),
    ("digits", {"path": "/tmp"}, "path is not used by dataset 'digits'"),
])
def test_missing_or_misused_paths_are_one_clear_line(name, kwargs, needle):
    with pytest.raises(ValueError) as info:
        load_dataset(name, **kwargs)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_scenario_paths_resolve_relative_to_the_scenario_file(tmp_path, monkeypatch):
    make_mnist(tmp_path / "data" / "mnist", n_train=16, n_test=4)
    scenario = tmp_path / "conf" / "s.yaml"
    scenario.parent.mkdir()
    scenario.write_text("name: s\npod: {slice: v2-8}\nmodel: {name: cnn}\n"
                        "data: {name: mnist, path: ../data/mnist}\n"
                        "training: {global_batch: 8, steps: 1}\n")
    monkeypatch.chdir("/")
    plan = build_plan(load_scenario(scenario))
    assert plan.dataset.name == "mnist" and plan.dataset.x_train.shape == (16, 28, 28, 1)
    scenario.write_text(scenario.read_text().replace("../data/mnist", "../data/nope"))
    with pytest.raises(ScenarioError, match=r"^data: path '.*data/nope' does not exist"):
        build_plan(load_scenario(scenario))


# ---- issue 26: no silent wrong result; ids and labels checked on load --------------

def _imdb_npz(path, *, y_train=None, x_train=None, x_test=None, y_test=None):
    x = np.array([[3, 4, 5], [0, 2, 6], [7, 8, 9], [2, 3, 4]], np.int32)
    np.savez(path, x_train=x if x_train is None else x_train,
             y_train=np.array([0, 1, 0, 1]) if y_train is None else y_train,
             x_test=x[:2] if x_test is None else x_test,
             y_test=np.array([1, 0]) if y_test is None else y_test)
    return path


def _imdb_scenario(tmp_path, npz):
    scenario = tmp_path / "s.yaml"
    scenario.write_text(f"name: t\npod: {{slice: v2-8}}\nmodel: {{name: lstm_classifier, options: "
                        f"{{vocabulary: 100}}}}\ndata: {{name: imdb, path: {npz.name}, options: "
                        f"{{num_words: 100, maxlen: 3}}}}\ntraining: {{global_batch: 8, steps: 1}}\n")
    return scenario


def test_imdb_labels_of_half_are_refused_not_rounded(tmp_path):
    """Probe: IMDB labels 0.5 / 1.5 silently became 0 / 1."""
    npz = _imdb_npz(tmp_path / "i.npz", y_train=np.array([0.5, 1.5, 0.0, 1.0]))
    with pytest.raises(ValueError, match=r"i\.npz: y_train must be 4 integer labels of 0 or 1, "
                                         r"got float64"):
        load_dataset("imdb", path=npz)
    npz = _imdb_npz(tmp_path / "j.npz", y_test=np.array([0, 2]))
    with pytest.raises(ValueError, match=r"y_test must hold labels of 0 or 1, found 2"):
        load_dataset("imdb", path=npz)


def test_negative_token_ids_are_the_datas_fault_not_the_vocabularys(tmp_path):
    """Probe: a negative token id was reported as 'vocabulary ... use at least 100'."""
    bad = np.array([[3, -4, 5], [0, 2, 6], [7, 8, 9], [2, 3, 4]], np.int32)
    npz = _imdb_npz(tmp_path / "i.npz", x_train=bad)
    with pytest.raises(ScenarioError) as err:
        build_plan(load_scenario(_imdb_scenario(tmp_path, npz)))
    text = str(err.value)
    assert text.startswith("data.path: ") and "x_train holds negative token ids (smallest -4)" \
        in text and "use at least" not in text


def test_an_empty_test_split_is_an_error_not_an_accuracy_of_zero(tmp_path):
    """Probe: an .npz with an empty test split ran and reported test loss 0.0000 and
    accuracy 0.0000."""
    npz = _imdb_npz(tmp_path / "i.npz", x_test=np.zeros((0, 3), np.int32),
                    y_test=np.zeros((0,), np.int64))
    with pytest.raises(ScenarioError, match=r"^data\.path: the test split of imdb is empty "
                                            r"\(0 examples\)"):
        build_plan(load_scenario(_imdb_scenario(tmp_path, npz)))


def test_a_dataset_past_the_value_cap_is_refused_before_conversion(tmp_path, monkeypatch):
    from pod.workloads import files

    monkeypatch.setattr(files, "MAX_DATASET_VALUES", 100)
    npz = _imdb_npz(tmp_path / "i.npz", x_train=np.ones((40, 3), np.int32),
                    y_train=np.zeros(40, np.int64))
    with pytest.raises(ValueError, match=r"x_train holds 120 values, more than the 100"):
        load_dataset("imdb", path=npz)


@pytest.mark.slow  # several seconds: the slow tier (make test stays under 3 minutes)
def test_digits_are_load_digits_bit_for_bit_without_importing_sklearn(monkeypatch):
    """The digits are read from scikit-learn's own file without ``import sklearn``
    (scipy and pandas with it: about 3 s of CPU in every ``tpu-pod`` process); the
    arrays equal ``load_digits``' in value and dtype, and the fallback that calls
    ``load_digits`` gives the same."""
    import subprocess
    import sys

    from sklearn.datasets import load_digits

    from pod.workloads import datasets

    assert datasets._digits_file() is not None  # the fast path is the one taken here
    d = load_digits()
    want_x, want_y = (d.images / 16.0).astype(np.float32)[..., None], d.target.astype(np.int64)
    read = datasets._digits_raw.__wrapped__()  # uncached: the file read here
    monkeypatch.setattr(datasets, "_digits_file", lambda: None)
    for x, y in (read, datasets._digits_raw.__wrapped__()):  # then the load_digits fallback
        assert x.dtype == np.float32 and y.dtype == np.int64
        assert np.array_equal(x, want_x) and np.array_equal(y, want_y)
    code = ("import sys; from pod.workloads import load_dataset; d = load_dataset('digits'); "
            "print(d.x_train.shape[0] + d.x_test.shape[0], 'sklearn' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["1797", "False"], out.stderr[-2000:]

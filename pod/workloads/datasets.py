"""Datasets: small, in memory, deterministic for a given seed."""

from __future__ import annotations

import functools
import gzip
import importlib.util
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np

from pod.workloads import files
from pod.workloads.checks import check_int
from pod.workloads.dataset import Dataset, stratified_split

__all__ = ["DATASET_NAMES", "Dataset", "load_dataset", "stratified_split"]

DATASET_NAMES = ("digits", "synthetic", "mnist", "cifar10", "imdb", "text", "synthetic_text")


def _digits_file() -> Path | None:
    """scikit-learn's copy of the UCI digits (``sklearn/datasets/data/digits.csv.gz``),
    found without importing scikit-learn: ``import sklearn`` pulls in scipy and pandas,
    about 3 s of CPU in every ``tpu-pod`` process, to read an 8x8 CSV. None where that
    file is not (then ``load_digits`` reads it)."""
    spec = importlib.util.find_spec("sklearn")  # a top-level find runs no package code
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            return path
    return None


@functools.lru_cache(maxsize=1)
def _digits_raw() -> tuple[np.ndarray, np.ndarray]:
    path = _digits_file()
    if path is None:
        from sklearn.datasets import load_digits  # imported lazily: slow import
        d = load_digits()
        images, target = d.images, d.target                             # (1797, 8, 8), (1797,)
    else:
        # what load_digits does with that file: 64 pixels then the label per row
        with gzip.open(path, mode="rt", encoding="utf-8") as f:
            data = np.loadtxt(f, delimiter=",")                         # (1797, 65) float64
        images, target = data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)
    x = (images / 16.0).astype(np.float32)[..., None]                   # (1797, 8, 8, 1) in [0, 1]
    return x, target.astype(np.int64)


def _digits(test_fraction: float, seed: int) -> Dataset:
    x, y = _digits_raw()
    tr, te = stratified_split(y, test_fraction, seed)
    return Dataset("digits", x[tr], y[tr], x[te], y[te], 10, synthetic=False)


#: Most values a synthetic dataset (or its labelling table) may hold: 2**26 float32
#: values are 256 MiB; the largest shipped one (CIFAR-shaped, 4,096 examples) has
#: 12.6 million.
MAX_SYNTHETIC_VALUES = 1 << 26


def _synthetic(test_fraction: float, seed: int, shape=(8, 8, 1), num_classes: int = 10,
               num_examples: int = 2048, vocabulary: int | None = None,
               labels: str = "linear") -> Dataset:
    """Gaussian inputs; label = argmax of a fixed random linear map of the
    input (a rule a model can learn, so the loss can fall).

    With ``vocabulary`` V: integer token ids in [1, V) (0 is left for
    padding), int32, and label = argmax over classes of the summed random
    per-token class scores (a bag-of-words rule).

    ``labels: uniform`` draws the labels uniformly instead (nothing to learn):
    for throughput-only data whose linear map would be large (224x224x3
    inputs and 1000 classes: a 150528 x 1000 map, 0.6 GB)."""
    if labels not in ("linear", "uniform"):
        raise ValueError(f"synthetic: option labels must be linear or uniform, got {labels!r}")
    if isinstance(shape, int):
        shape = (shape,)
    if not isinstance(shape, (list, tuple)):
        raise ValueError(f"synthetic: option shape must be positive integers, got {shape!r:.60}")
    shape = tuple(shape)
    if not shape or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v > 0
                            for v in shape):
        raise ValueError(f"synthetic: option shape must be positive integers, got {shape!r:.60}")
    for field, value, low in (("num_classes", num_classes, 2), ("num_examples", num_examples, 2)):
        check_int(value, f"synthetic: option {field}", low)
    if vocabulary is not None:
        check_int(vocabulary, "synthetic: option vocabulary", 2)
    per_example = math.prod(shape)
    # the labelling table: per-token class scores, or the linear rule's weights
    # (uniform labels have none)
    table = (vocabulary * num_classes if vocabulary is not None else
             per_example * num_classes if labels == "linear" else 0)
    for what, values in ((f"num_examples x shape ({num_examples} x {per_example})",
                          num_examples * per_example),
                         (f"{'vocabulary' if vocabulary is not None else 'shape'} x num_classes",
                          table)):
        if values > MAX_SYNTHETIC_VALUES:
            raise ValueError(f"synthetic: options {what} make {values:,} values, more than the "
                             f"{MAX_SYNTHETIC_VALUES:,} allowed")
    rng = np.random.default_rng(seed)
    x: np.ndarray  # (N, *shape): int32 token ids or float32 features
    if vocabulary is not None:
        x = rng.integers(1, vocabulary, size=(num_examples, *shape)).astype(np.int32)  # (N, *shape)
        scores = rng.standard_normal((int(vocabulary), num_classes))                 # (V, K)
        scores -= scores.mean(axis=0)                                     # balanced classes
        y = scores[x].reshape(num_examples, -1, num_classes).sum(axis=1).argmax(axis=1)
        y = y.astype(np.int64)
    elif labels == "uniform":
        x = rng.standard_normal((num_examples, *shape), dtype=np.float32)  # (N, *shape)
        y = rng.integers(0, num_classes, num_examples).astype(np.int64)  # (N,)
    else:
        x = rng.standard_normal((num_examples, *shape), dtype=np.float32)  # (N, *shape)
        w = rng.standard_normal((int(np.prod(shape)), num_classes)).astype(np.float32)
        y = (x.reshape(num_examples, -1) @ w).argmax(axis=1).astype(np.int64)  # (N,)
    n_test = int(round(test_fraction * num_examples))
    if n_test < 1 or n_test >= num_examples:
        raise ValueError(f"synthetic: test_fraction {test_fraction} of {num_examples} examples "
                         "leaves an empty split")
    return Dataset("synthetic", x[n_test:], y[n_test:], x[:n_test], y[:n_test],
                   int(num_classes), synthetic=True, source="generated")


def _synthetic_text(test_fraction: float, seed: int, vocabulary: int = 32000,
                    sequence_length: int = 2048, num_examples: int = 64) -> Dataset:
    """Uniformly random token ids for a language model's shapes (timing-only runs of
    full-size models): x (N, T) int32 ids in [0, V), y (N, T) int64 the next token
    of the same stream (x shifted by one), V classes. Nothing to learn: the data
    only set the vocabulary and the sequence length."""
    for field, value, low in (("vocabulary", vocabulary, 2),
                              ("sequence_length", sequence_length, 1),
                              ("num_examples", num_examples, 2)):
        check_int(value, f"synthetic_text: option {field}", low)
    stream = np.random.default_rng(seed).integers(
        0, vocabulary, size=(num_examples, sequence_length + 1))             # (N, T + 1)
    x, y = stream[:, :-1].astype(np.int32), stream[:, 1:].astype(np.int64)
    n_test = int(round(test_fraction * num_examples))
    if n_test < 1 or n_test >= num_examples:
        raise ValueError(f"synthetic_text: test_fraction {test_fraction} of {num_examples} "
                         "examples leaves an empty split")
    return Dataset("synthetic_text", x[n_test:], y[n_test:], x[:n_test], y[:n_test],
                   int(vocabulary), synthetic=True, source="generated")


# name -> (loader: (test_fraction, seed, **options) -> the Dataset, its options)
_LOADERS: dict[str, tuple[Callable[..., Dataset], tuple[str, ...]]] = {
    "digits": (_digits, ()),
    "synthetic": (_synthetic, ("shape", "num_classes", "num_examples", "vocabulary", "labels")),
    "mnist": (files.load_mnist, ()),
    "cifar10": (files.load_cifar10, ()),
    "imdb": (files.load_imdb, ("num_words", "maxlen")),
    "text": (files.load_text, ("sequence_length",)),
    "synthetic_text": (_synthetic_text, ("vocabulary", "sequence_length", "num_examples")),
}
_NEEDS_PATH = ("mnist", "cifar10", "imdb")
_TAKES_PATH = ("mnist", "cifar10", "imdb", "text")


def load_dataset(name: str, *, test_fraction: float = 0.2, seed: int = 0,
                 path: str | Path | None = None, **options) -> Dataset:
    """Loads a dataset by name.

    Args:
        name: one of ``DATASET_NAMES``:
            "digits": scikit-learn's 1,797 real 8x8 handwritten digits,
            pixels 0..16 scaled to [0, 1], shape (N, 8, 8, 1), 10 classes,
            split stratified by class with a seeded shuffle;
            "synthetic": generated, labelled synthetic (options shape=(8, 8, 1),
            num_classes=10, num_examples=2048, vocabulary=None for token ids,
            labels="linear" (a learnable rule) or "uniform" (random, cheap));
            "mnist": ``path`` = a directory with the four IDX files, or Keras's
            mnist.npz (or a directory holding it);
            "cifar10": ``path`` = the "cifar-10-batches-py" directory;
            "imdb": ``path`` = a directory of pos/ and neg/ text files (or
            train/ and test/ holding them), or a pre-tokenised .npz (options
            num_words=15000, maxlen=250);
            "text": characters of an English text for next-character models,
            the Python documentation shipped with Python (``pydoc_data``) or
            ``path`` = a UTF-8 text file (option sequence_length=64);
            "synthetic_text": random token ids and their next tokens, for a
            language model's shapes (options vocabulary=32000,
            sequence_length=2048, num_examples=64).
            See ``pod.workloads.files`` for the formats.
        test_fraction: share of the examples held out for test, in (0, 1)
            (files that come with their own test split keep it).
        seed: seed of the split (and of the synthetic data).
        path: the file or directory of a file-backed dataset.

    Raises:
        ValueError: unknown name or option, a bad value, a missing path, or a
            missing / malformed file (the message names the path).
    """
    if name not in _LOADERS:
        raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASET_NAMES)}")
    loader, allowed = _LOADERS[name]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(map(repr, unknown))} for dataset {name!r}; "
                         f"allowed: {', '.join(allowed) or 'none'}")
    if isinstance(test_fraction, bool) or not isinstance(test_fraction, (int, float)) \
            or not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    if path is not None and name not in _TAKES_PATH:
        raise ValueError(f"path is not used by dataset {name!r}; datasets read from files: "
                         f"{', '.join(_TAKES_PATH)}")
    if path is None and name in _NEEDS_PATH:
        raise ValueError(f"dataset {name!r} reads files: give data.path ({files.FORMATS[name]})")
    if name in _TAKES_PATH:
        return loader(float(test_fraction), int(seed), path=None if path is None else Path(path),
                      **options)
    return loader(float(test_fraction), int(seed), **options)

"""Datasets: small, in memory, deterministic for a given seed."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from pod.workloads import files
from pod.workloads.checks import check_int
from pod.workloads.dataset import Dataset, stratified_split

__all__ = ["DATASET_NAMES", "Dataset", "load_dataset", "stratified_split"]

DATASET_NAMES = ("digits", "synthetic", "mnist", "cifar10", "imdb", "text")


@functools.lru_cache(maxsize=1)
def _digits_raw() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits  # imported lazily: slow-ish import
    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)[..., None]                 # (1797, 8, 8, 1) in [0, 1]
    return x, d.target.astype(np.int64)


def _digits(test_fraction: float, seed: int) -> Dataset:
    x, y = _digits_raw()
    tr, te = stratified_split(y, test_fraction, seed)
    return Dataset("digits", x[tr], y[tr], x[te], y[te], 10, synthetic=False)


def _synthetic(test_fraction: float, seed: int, shape=(8, 8, 1), num_classes: int = 10,
               num_examples: int = 2048, vocabulary: int | None = None) -> Dataset:
    """Gaussian inputs; label = argmax of a fixed random linear map of the
    input (a rule a model can learn, so the loss can fall).

    With ``vocabulary`` V: integer token ids in [1, V) (0 is left for
    padding), int32, and label = argmax over classes of the summed random
    per-token class scores (a bag-of-words rule)."""
    if isinstance(shape, int):
        shape = (shape,)
    shape = tuple(shape)
    if not shape or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v > 0
                            for v in shape):
        raise ValueError(f"synthetic: option shape must be positive integers, got {shape!r}")
    for field, value, low in (("num_classes", num_classes, 2), ("num_examples", num_examples, 2)):
        check_int(value, f"synthetic: option {field}", low)
    rng = np.random.default_rng(seed)
    if vocabulary is not None:
        check_int(vocabulary, "synthetic: option vocabulary", 2)
        x = rng.integers(1, vocabulary, size=(num_examples, *shape)).astype(np.int32)  # (N, *shape)
        scores = rng.standard_normal((int(vocabulary), num_classes))                 # (V, K)
        scores -= scores.mean(axis=0)                                     # balanced classes
        y = scores[x].reshape(num_examples, -1, num_classes).sum(axis=1).argmax(axis=1)
        y = y.astype(np.int64)
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


_LOADERS = {
    "digits": (_digits, ()),
    "synthetic": (_synthetic, ("shape", "num_classes", "num_examples", "vocabulary")),
    "mnist": (files.load_mnist, ()),
    "cifar10": (files.load_cifar10, ()),
    "imdb": (files.load_imdb, ("num_words", "maxlen")),
    "text": (files.load_text, ("sequence_length",)),
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
            num_classes=10, num_examples=2048, vocabulary=None for token ids);
            "mnist": ``path`` = a directory with the four IDX files, or Keras's
            mnist.npz (or a directory holding it);
            "cifar10": ``path`` = the "cifar-10-batches-py" directory;
            "imdb": ``path`` = a directory of pos/ and neg/ text files (or
            train/ and test/ holding them), or a pre-tokenised .npz (options
            num_words=15000, maxlen=250);
            "text": characters of an English text for next-character models,
            the Python documentation shipped with Python (``pydoc_data``) or
            ``path`` = a UTF-8 text file (option sequence_length=64).
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

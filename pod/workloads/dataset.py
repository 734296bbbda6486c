"""``Dataset``, a train / test split in memory, and the stratified split every
loader uses (``pod.workloads.datasets`` for the built-in sets,
``pod.workloads.files`` for the file formats)."""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["Dataset", "stratified_split"]


@dataclasses.dataclass(frozen=True)
class Dataset:
    """A train / test split held in memory (arrays are read-only).

    Attributes:
        name: dataset name, e.g. "digits".
        x_train: (N_train, *example_shape) float32 inputs.
        y_train: (N_train,) int64 labels in [0, num_classes).
        x_test: (N_test, *example_shape) float32 inputs.
        y_test: (N_test,) int64 labels.
        num_classes: number of classes.
        synthetic: True when the data is generated, not real.
        vocabulary: for character datasets, the characters (id i is
            ``vocabulary[i]``); None otherwise.
        source: where the examples came from (a file path, a module).
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    synthetic: bool
    vocabulary: str | None = None  # text datasets: the characters, id i is vocabulary[i]
    source: str = ""               # where the data came from (a path, a module), for output

    def __post_init__(self):
        for field in ("x_train", "y_train", "x_test", "y_test"):
            getattr(self, field).flags.writeable = False
        if len(self.x_train) != len(self.y_train) or len(self.x_test) != len(self.y_test):
            raise ValueError(f"{self.name}: inputs and labels differ in length")

    @property
    def example_shape(self) -> tuple[int, ...]:
        """One example's shape, e.g. (8, 8, 1)."""
        return tuple(self.x_train.shape[1:])

    def __repr__(self) -> str:
        return (f"Dataset({self.name!r}, train={self.x_train.shape}, test={self.x_test.shape}, "
                f"num_classes={self.num_classes}, synthetic={self.synthetic})")


def stratified_split(y: np.ndarray, test_fraction: float, seed: int):
    """Per class, a seeded permutation; round(test_fraction * n_class) go to test.
    Returns (train_idx, test_idx), each shuffled with the same seed."""
    rng = np.random.default_rng(seed)
    train, test = [], []
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        n_test = int(round(test_fraction * len(idx)))
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    return rng.permutation(np.concatenate(train)), rng.permutation(np.concatenate(test))

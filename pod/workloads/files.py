"""Datasets read from files the user has, and the English text shipped with Python.

Formats (``data.path`` in a scenario; relative paths are resolved against
the scenario file's directory):

- MNIST: a directory holding the four IDX files as distributed
  (``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
  ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``; "-idx3-ubyte" may
  also be ".idx3-ubyte"; each may be gzipped, ending ".gz"). IDX: two zero
  bytes, a type byte (0x08 = uint8), the number of dimensions, then each
  dimension as a big-endian uint32, then the data (LeCun et al.,
  http://yann.lecun.com/exdb/mnist/). Or Keras's ``mnist.npz`` (the file, or a
  directory holding it): uint8 ``x_train`` (N, 28, 28), ``y_train`` (N,),
  ``x_test``, ``y_test``, read without pickle. Pixels scaled to [0, 1], (N, 28, 28, 1).
- CIFAR-10: the "python version" directory ``cifar-10-batches-py`` with
  ``data_batch_1`` ... ``data_batch_5`` (any that exist) and ``test_batch``:
  pickled dicts with ``data`` (N, 3072) uint8 (1024 red, 1024 green, 1024
  blue, row-major) and ``labels`` (N ints). Read with a restricted unpickler
  that can build only dicts, lists, bytes, numbers and plain numpy arrays:
  a pickle naming any other class or function is refused, so a file from a
  stranger cannot run code. Pixels scaled to [0, 1], (N, 32, 32, 3).
- IMDB: a directory with ``pos/`` and ``neg/`` folders of ``*.txt`` reviews
  (split by ``test_fraction``), or with ``train/`` and ``test/`` each holding
  them (the aclImdb layout); or a pre-tokenised ``.npz`` with integer arrays
  ``x_train`` (N, L), ``y_train`` (N,), ``x_test``, ``y_test`` (read without
  pickle). Text is lower-cased and split into words; the ``num_words`` - 2
  most frequent training words get ids 2..num_words-1, others 1 (out of
  vocabulary), 0 pads. Sequences are padded and truncated at the front to
  ``maxlen`` (Keras ``pad_sequences`` defaults), (N, maxlen) int32.
- Text: any UTF-8 file; without a path, the English text of the Python
  documentation topics that ships with Python itself (the standard
  library's ``pydoc_data/topics.py``, what ``help('FOR')`` prints, about
  465,000 characters). Cut into non-overlapping windows of
  ``sequence_length`` characters; labels are the next character at each step.
"""

from __future__ import annotations

import collections
import gzip
import io
import math
import os
import pickle
import re
import zipfile
from pathlib import Path

import numpy as np
from numpy.typing import DTypeLike

from pod.safe_io import check_regular, read_regular, too_large
from pod.workloads.checks import check_int
from pod.workloads.dataset import Dataset, stratified_split

FORMATS = {
    "mnist": "a directory with the MNIST IDX files train-images-idx3-ubyte, "
             "train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte "
             "(.gz allowed), "
             "or Keras's mnist.npz (x_train, y_train, x_test, y_test)",
    "cifar10": "the cifar-10-batches-py directory (data_batch_1..5, test_batch)",
    "imdb": "a directory with pos/ and neg/ text files (or train/ and test/ holding them), "
            "or a pre-tokenised .npz with x_train, y_train, x_test, y_test",
    "text": "a UTF-8 text file",
}


#: Largest data file read, in bytes (the largest format here, an IMDB .npz or the
#: MNIST train images, is tens of megabytes): ``/dev/zero`` or a runaway file ends
#: with one line instead of filling memory.
MAX_DATA_FILE_BYTES = 1 << 30
#: Largest decompressed size of a gzipped IDX file or of an .npz's arrays, in
#: bytes: a gzip bomb (kilobytes that expand to gigabytes) is refused.
MAX_DECOMPRESSED_BYTES = 1 << 30
#: Most values (pixels, token ids) a dataset read from files may hold, checked before
#: they are converted to float32 / int64: 2**28 values is 1 GiB of float32 (CIFAR-10's
#: train split is 153,600,000 pixels, MNIST's 47,040,000). A file at the caps above
#: then peaks at about 3 GiB of memory (the bytes, the float32 copy, one temporary).
MAX_DATASET_VALUES = 1 << 28
#: Largest text file (``data.name: text``) read, in bytes: its windows take about 30
#: bytes of memory per character (UTF-32, ids, next-character labels, the split),
#: so 64 MiB (140 times the shipped Python documentation) peaks near 2 GiB.
MAX_TEXT_FILE_BYTES = 64 << 20
#: Most bytes of review files an IMDB directory may hold in total (aclImdb: 130 MB).
MAX_REVIEWS_BYTES = 1 << 30


def _check_values(path: Path, what: str, count: int) -> None:
    """Refuse a dataset array of more than ``MAX_DATASET_VALUES`` values before it is
    converted (a file at the byte caps would otherwise need several GiB more)."""
    if count > MAX_DATASET_VALUES:
        raise ValueError(f"{path}: {what} holds {count:,} values, more than the "
                         f"{MAX_DATASET_VALUES:,} a dataset may have")


def _regular(path: Path) -> os.stat_result:
    """``path``'s stat, refusing anything but a regular file (following symlinks;
    ``pod.safe_io.check_regular``): a FIFO named like a data file would block the read
    forever, a device (``/dev/zero``) never end.

    Raises:
        ValueError: missing, not a regular file, or larger than ``MAX_DATA_FILE_BYTES``.
    """
    info = check_regular(path, "data files")
    if info.st_size > MAX_DATA_FILE_BYTES:
        raise ValueError(too_large(path, info.st_size, MAX_DATA_FILE_BYTES, "data files"))
    return info


def read_data_file(path: Path) -> bytes:
    """A regular file's bytes, at most ``MAX_DATA_FILE_BYTES`` (``pod.safe_io.read_regular``:
    the size checked before any byte is read, a FIFO never opened).

    Raises:
        ValueError: not a regular file, too large, or unreadable; one line
            naming the path.
    """
    return read_regular(path, MAX_DATA_FILE_BYTES, "data files")


def gunzip_bounded(raw: bytes, path: Path, limit_of=None) -> bytes:
    """Decompress gzip data, refusing more than ``MAX_DECOMPRESSED_BYTES``.

    Args:
        raw: the gzip file's bytes.
        path: named in errors.
        limit_of: optional ``f(read) -> (limit_bytes, why)`` given a function that
            reads the first bytes (a format's header): the data may not decompress
            to more than ``limit_bytes``; so a bomb stops at the size its header
            declares, not at ``MAX_DECOMPRESSED_BYTES`` of memory.

    Raises:
        ValueError: not gzip, or a gzip bomb; one line naming the path.
    """
    limit, why = MAX_DECOMPRESSED_BYTES, f"{MAX_DECOMPRESSED_BYTES:,} bytes"
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(raw)) as f:
            head = b""
            if limit_of is not None:
                def read(n: int) -> bytes:
                    nonlocal head
                    head += f.read(n)
                    return head
                declared, declared_why = limit_of(read)
                if declared <= limit:
                    limit, why = declared, declared_why
            out = head + f.read(limit + 1 - len(head))
    except (OSError, EOFError) as err:
        raise ValueError(f"{path}: not a valid gzip file ({err})") from None
    if len(out) > limit:
        raise ValueError(f"{path}: decompresses to more than {why}; refused (a data file this "
                         "size is not one of the formats read here)")
    return out


def _require(path: Path, name: str, *, directory: bool | None = None) -> Path:
    if not path.exists():
        raise ValueError(f"path {str(path)!r} does not exist; {name} needs {FORMATS[name]}")
    if directory is True and not path.is_dir():
        raise ValueError(f"path {str(path)!r} is not a directory; {name} needs {FORMATS[name]}")
    if directory is False and path.is_dir():  # other non-regular files: read_data_file
        raise ValueError(f"path {str(path)!r} is not a file; {name} needs {FORMATS[name]}")
    return path


# --------------------------------------------------------------------------- MNIST

_IDX_TYPES: dict[int, DTypeLike] = {0x08: np.uint8, 0x09: np.int8, 0x0B: np.dtype(">i2"),
                                    0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"),
                                    0x0E: np.dtype(">f8")}


def _idx_declared_bytes(read) -> tuple[int, str]:
    """The size an IDX header declares (header and data), from its first bytes."""
    head = read(4)
    if len(head) < 4 or head[2] not in _IDX_TYPES:
        return MAX_DECOMPRESSED_BYTES, f"{MAX_DECOMPRESSED_BYTES:,} bytes"
    head = read(4 * head[3])
    dims = [int.from_bytes(head[i:i + 4], "big") for i in range(4, len(head) - 3, 4)]
    total = len(head) + math.prod(dims) * np.dtype(_IDX_TYPES[head[2]]).itemsize
    return total, f"the {total:,} bytes its IDX header declares"


def read_idx(path: Path) -> np.ndarray:
    """Reads one IDX file (gzipped if it ends in .gz).

    Raises:
        ValueError: a bad magic number, type or size, naming the file.
    """
    raw = read_data_file(path)
    if path.suffix == ".gz":
        raw = gunzip_bounded(raw, path, _idx_declared_bytes)
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_TYPES or raw[3] < 1:
        raise ValueError(f"{path}: not an IDX file (magic bytes {raw[:4].hex() or 'missing'}; "
                         "expected 00 00 <type> <dims>)")
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{path}: IDX header truncated")
    dims = tuple(int(d) for d in np.frombuffer(raw, ">u4", count=ndim, offset=4))
    dtype = np.dtype(_IDX_TYPES[raw[2]])
    expected = int(np.prod(dims)) * dtype.itemsize
    if len(raw) - header != expected:
        raise ValueError(f"{path}: IDX dimensions {dims} need {expected} data bytes, "
                         f"the file has {len(raw) - header}")
    return np.frombuffer(raw, dtype, offset=header).reshape(dims)


def _find(directory: Path, stems: tuple[str, ...], name: str) -> Path:
    for stem in stems:
        for candidate in (directory / stem, directory / f"{stem}.gz"):
            if candidate.exists():
                return candidate  # read_idx refuses anything but a regular file
    raise ValueError(f"{directory}: no {stems[0]} file; {name} needs {FORMATS[name]}")


def load_mnist(test_fraction: float, seed: int, path: Path) -> Dataset:
    """MNIST: (60000, 28, 28, 1) train, (10000, ...) test (the files' own split;
    ``test_fraction`` is not used), from the four IDX files in a directory, or from
    Keras's ``mnist.npz`` (the file, or a directory holding it; arrays ``x_train``
    (N, 28, 28) uint8, ``y_train`` (N,), ``x_test``, ``y_test``, read without pickle)."""
    _require(path, "mnist")
    pairs: dict[str, tuple[np.ndarray, ...]]  # split -> (images, labels)
    if not path.is_dir() or (not _has_idx(path) and (path / "mnist.npz").exists()):
        npz = path if not path.is_dir() else path / "mnist.npz"
        arrays = _read_npz(npz, "mnist", ("x_train", "y_train", "x_test", "y_test"))
        pairs = {"train": (arrays["x_train"], arrays["y_train"]),
                 "test": (arrays["x_test"], arrays["y_test"])}
    else:
        pairs = {}
        for split, prefix in (("train", "train"), ("test", "t10k")):
            pairs[split] = tuple(read_idx(_find(path, (f"{prefix}-{kind}-idx{n}-ubyte",
                                                       f"{prefix}-{kind}.idx{n}-ubyte"), "mnist"))
                                 for kind, n in (("images", 3), ("labels", 1)))
    splits = {}
    for split, (images, labels) in pairs.items():
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise ValueError(f"{path}: MNIST {split} images {images.shape} and labels "
                             f"{labels.shape} "
                             "do not match (expected (N, H, W) and (N,))")
        if images.dtype != np.uint8 or labels.dtype.kind not in "iu":
            raise ValueError(f"{path}: MNIST {split} images must be uint8 and labels integers, "
                             f"got {images.dtype} and {labels.dtype}")
        if labels.size and (labels.max() > 9 or labels.min() < 0):
            raise ValueError(f"{path}: MNIST {split} labels must be 0..9, found "
                             f"{labels.min()}..{labels.max()}")
        _check_values(path, f"MNIST {split} images", images.size)
        splits[split] = ((images.astype(np.float32) / 255.0)[..., None], labels.astype(np.int64))
    (xtr, ytr), (xte, yte) = splits["train"], splits["test"]
    return Dataset("mnist", xtr, ytr, xte, yte, 10, synthetic=False, source=str(path))


def _has_idx(directory: Path) -> bool:
    return any(directory.glob("train-images*idx3-ubyte*"))


def _read_npz(path: Path, name: str, keys: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The named arrays of an .npz archive, read without pickle and bounded in size.

    Raises:
        ValueError: not a regular .npz file, too large, an array missing or not
            readable without pickle; one line naming the file.
    """
    _regular(path)
    if path.suffix != ".npz" or not zipfile.is_zipfile(path):
        # np.load would try it as a pickle and talk about allow_pickle, which misleads
        raise ValueError(f"{path}: not a .npz archive (an .npz is a zip of .npy arrays, as "
                         f"numpy.savez writes); {name} needs {FORMATS[name]}")
    _check_zip_size(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = [k for k in keys if k not in z.files]
            if missing:
                raise ValueError(f"{path}: missing array {missing[0]!r}; {name} .npz needs "
                                 f"{', '.join(keys)}")
            return {k: z[k] for k in keys}
    except ValueError as err:
        if str(err).startswith(f"{path}: missing array"):
            raise
        raise ValueError(f"{path}: cannot read without pickle ({err}); save numeric arrays, "
                         "not lists of lists") from None
    except (OSError, EOFError) as err:
        raise ValueError(f"{path}: not a valid .npz file ({err})") from None


# --------------------------------------------------------------------------- CIFAR-10

class SafeUnpickler(pickle.Unpickler):
    """Builds only plain data: dicts, lists, tuples, bytes, str, numbers, and
    numpy arrays of numbers; refuses every other class or function."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),  # how protocol-2 pickles spell bytes
    }

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}: only plain data and "
                                         "numpy arrays are allowed")
        found = super().find_class(module, name)
        return _bounded_reconstruct(found) if name == "_reconstruct" else found


def _bounded_reconstruct(reconstruct):
    """numpy's ``_reconstruct(subtype, shape, typecode)`` allocates ``shape`` before any
    data is read (pickles write ``(0,)``): refuse a shape whose elements would exceed
    ``MAX_DECOMPRESSED_BYTES`` (a 100-byte pickle asking for 1 TiB)."""

    def checked(subtype, shape, typecode):
        dims = shape if isinstance(shape, tuple) else (shape,)
        if not all(isinstance(d, int) and d >= 0 for d in dims) or \
                math.prod(dims) > MAX_DECOMPRESSED_BYTES:
            raise pickle.UnpicklingError(f"an array of shape {_short(shape)} is larger than the "
                                         f"{MAX_DECOMPRESSED_BYTES:,} bytes allowed")
        return reconstruct(subtype, shape, typecode)

    return checked


def _short(value: object, limit: int = 60) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def safe_unpickle(raw: bytes, source: Path) -> object:
    """Unpickles ``raw`` with ``SafeUnpickler`` (Python 2 strings as bytes).

    Raises:
        ValueError: a refused class, or a corrupt pickle, naming ``source``.
    """
    try:
        obj = SafeUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
            IndexError, KeyError, MemoryError) as err:
        raise ValueError(f"{source}: not a CIFAR-10 python batch "
                         f"({_short(str(err) or type(err).__name__, 200)})") from None
    if isinstance(obj, np.ndarray) and obj.dtype.hasobject:
        raise ValueError(f"{source}: object arrays are not allowed")
    return obj


def _cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    batch = safe_unpickle(read_data_file(path), path)
    if not isinstance(batch, dict):
        raise ValueError(f"{path}: a CIFAR-10 batch is a dict, got {type(batch).__name__}")
    get = {(k.decode() if isinstance(k, bytes) else k): v for k, v in batch.items()}
    data, labels = get.get("data"), get.get("labels")
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 \
            or data.shape[1] != 3072:
        shape = getattr(data, "shape", None)
        raise ValueError(f"{path}: 'data' must be a uint8 array (N, 3072), got {shape}")
    if not isinstance(labels, (list, np.ndarray)) or len(labels) != len(data):
        raise ValueError(f"{path}: 'labels' must be a list of {len(data)} ints")
    y = np.asarray(labels, dtype=np.int64)
    if y.size and (y.min() < 0 or y.max() > 9):
        raise ValueError(f"{path}: labels must be 0..9, found {y.min()}..{y.max()}")
    _check_values(path, "'data'", data.size)
    x = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)                # (N, 32, 32, 3)
    return (x.astype(np.float32) / 255.0), y


def load_cifar10(test_fraction: float, seed: int, path: Path) -> Dataset:
    """CIFAR-10 from its python batches: (N, 32, 32, 3) in [0, 1], 10 classes
    (the files' own train / test split)."""
    _require(path, "cifar10", directory=True)
    train_files = sorted(path.glob("data_batch_*"))
    test_file = path / "test_batch"
    if not train_files or not test_file.exists():
        raise ValueError(f"{path}: no data_batch_* or test_batch file; cifar10 needs "
                         f"{FORMATS['cifar10']}")
    if len(train_files) > 5:
        raise ValueError(f"{path}: {len(train_files)} data_batch_* files; CIFAR-10 has 5 "
                         "(data_batch_1 .. data_batch_5)")
    parts = [_cifar_batch(p) for p in train_files]
    xte, yte = _cifar_batch(test_file)
    return Dataset("cifar10", np.concatenate([p[0] for p in parts]),
                   np.concatenate([p[1] for p in parts]), xte, yte, 10, synthetic=False,
                   source=str(path))


# --------------------------------------------------------------------------- IMDB

_WORD = re.compile(r"[a-z0-9']+")


def tokenize(text: str) -> list[str]:
    """Lower-cased words; HTML line breaks (as in the IMDB reviews) removed."""
    return _WORD.findall(text.lower().replace("<br />", " "))


def pad_sequences(seqs, maxlen: int) -> np.ndarray:
    """(N, maxlen) int32: pad with 0 and truncate at the front (Keras defaults)."""
    out = np.zeros((len(seqs), maxlen), np.int32)
    for i, seq in enumerate(seqs):
        seq = list(seq)[-maxlen:]
        if seq:
            out[i, maxlen - len(seq):] = seq
    return out


def _read_reviews(directory: Path) -> tuple[list[str], list[int]]:
    texts, labels, total = [], [], 0
    for label, sub in ((0, "neg"), (1, "pos")):
        folder = directory / sub
        if not folder.is_dir():
            raise ValueError(f"{directory}: no {sub}/ folder; imdb needs {FORMATS['imdb']}")
        for f in sorted(folder.glob("*.txt")):
            total += _regular(f).st_size
            if total > MAX_REVIEWS_BYTES:
                raise ValueError(f"{directory}: its reviews hold more than {MAX_REVIEWS_BYTES:,} "
                                 "bytes; refused (aclImdb holds about 130 MB)")
            texts.append(read_data_file(f).decode("utf-8", errors="replace"))
            labels.append(label)
    if not texts:
        raise ValueError(f"{directory}: pos/ and neg/ hold no .txt files")
    return texts, labels


def _check_int(value, field: str, low: int) -> int:
    return check_int(value, f"imdb: option {field}", low)


def _check_zip_size(path: Path) -> None:
    """Refuse an .npz whose arrays decompress to more than ``MAX_DECOMPRESSED_BYTES``
    (the sizes in the zip directory; reading stops at them), or whose .npy headers
    declare more bytes than their member holds (numpy allocates the declared shape
    before reading: a 100-byte member claiming 4 TiB would be a MemoryError)."""
    try:
        with zipfile.ZipFile(path) as z:
            members = z.infolist()
            total = sum(info.file_size for info in members)
            if total > MAX_DECOMPRESSED_BYTES:
                raise ValueError(f"{path}: its arrays decompress to {total:,} bytes, more than "
                                 f"{MAX_DECOMPRESSED_BYTES:,}; refused")
            for info in members:
                if info.filename.endswith(".npy"):
                    with z.open(info) as member:
                        _check_npy_header(path, info, member)
    except (OSError, zipfile.BadZipFile) as err:
        raise ValueError(f"{path}: not a valid .npz file ({err})") from None


def _check_npy_header(path: Path, info: zipfile.ZipInfo, member) -> None:
    """The shape and dtype an .npy member declares must fit in the bytes it holds."""
    fmt = np.lib.format
    try:
        version = fmt.read_magic(member)
        read = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
        shape, _, dtype = read(member)
    except (ValueError, TypeError, SyntaxError) as err:
        raise ValueError(f"{path}: {info.filename}: not an .npy array ({err})") from None
    declared = dtype.itemsize * math.prod(shape)
    if declared > info.file_size:
        raise ValueError(f"{path}: {info.filename} declares shape {shape} of {dtype} "
                         f"({declared:,} bytes) but holds {info.file_size:,} bytes; refused")


def _imdb_labels(path: Path, key: str, y: np.ndarray, rows: int) -> np.ndarray:
    """An .npz's labels, checked for type and range before any conversion (a float
    0.5 must not become 0)."""
    if y.dtype.kind not in "biu" or y.ndim not in (1, 2) or (y.ndim == 2 and y.shape[1] != 1):
        raise ValueError(f"{path}: {key} must be {rows:,} integer labels of 0 or 1, got "
                         f"{y.dtype} {y.shape}")
    y = y.reshape(-1)
    if len(y) != rows:
        raise ValueError(f"{path}: {key} has {len(y):,} labels for {rows:,} sequences")
    bad = y[(y != 0) & (y != 1)]
    if bad.size:
        raise ValueError(f"{path}: {key} must hold labels of 0 or 1, found {bad[0].item()!r} "
                         f"({bad.size:,} such)")
    return y.astype(np.int64)


def _imdb_npz(path: Path, num_words: int, maxlen: int) -> Dataset:
    """A pre-tokenised IMDB .npz: token ids and labels checked for type and range."""
    arrays = _read_npz(path, "imdb", ("x_train", "y_train", "x_test", "y_test"))
    xs, ys = {}, {}
    for split in ("train", "test"):
        key, x = f"x_{split}", arrays[f"x_{split}"]
        if x.ndim != 2 or x.dtype.kind not in "iu":
            raise ValueError(f"{path}: {key} must be an integer array (N, L), got "
                             f"{x.dtype} {x.shape}")
        _check_values(path, key, x.size)
        if x.size and x.min() < 0:
            raise ValueError(f"{path}: {key} holds negative token ids (smallest {x.min()}); "
                             "token ids are 0 (padding), 1 (out of vocabulary) and up")
        x = np.where(x >= num_words, 1, x.astype(np.int64))                # out of vocabulary
        xs[split] = pad_sequences([row[np.argmax(row != 0):] if row.any() else [] for row in x],
                                  maxlen)
        ys[split] = _imdb_labels(path, f"y_{split}", arrays[f"y_{split}"], len(x))
    return Dataset("imdb", xs["train"], ys["train"], xs["test"], ys["test"], 2,
                   synthetic=False, source=str(path))


def load_imdb(test_fraction: float, seed: int, path: Path, num_words: int = 15000,
              maxlen: int = 250) -> Dataset:
    """IMDB reviews as (N, maxlen) int32 token ids, labels 1 positive / 0 negative."""
    num_words = _check_int(num_words, "num_words", 3)
    maxlen = _check_int(maxlen, "maxlen", 1)
    _require(path, "imdb")
    if not path.is_dir():
        _regular(path)
        if path.suffix != ".npz":
            raise ValueError(f"path {str(path)!r} is a file but not .npz; imdb needs "
                             f"{FORMATS['imdb']}")
        return _imdb_npz(path, num_words, maxlen)
    if (path / "train").is_dir():
        train_texts, train_labels = _read_reviews(path / "train")
        test_texts, test_labels = _read_reviews(path / "test")
    else:
        texts, labels = _read_reviews(path)
        tr, te = stratified_split(np.asarray(labels), test_fraction, seed)
        train_texts, train_labels = [texts[i] for i in tr], [labels[i] for i in tr]
        test_texts, test_labels = [texts[i] for i in te], [labels[i] for i in te]
    train_tokens = [tokenize(t) for t in train_texts]
    counts = collections.Counter(w for toks in train_tokens for w in toks)
    # most frequent first, ties broken alphabetically so the ids are reproducible
    ranked = sorted(counts, key=lambda w: (-counts[w], w))[:num_words - 2]
    index = {w: i + 2 for i, w in enumerate(ranked)}

    def encode(tokens_list):
        return pad_sequences([[index.get(w, 1) for w in toks] for toks in tokens_list], maxlen)

    return Dataset("imdb", encode(train_tokens), np.asarray(train_labels, np.int64),
                   encode([tokenize(t) for t in test_texts]), np.asarray(test_labels, np.int64), 2,
                   synthetic=False, source=str(path))


# --------------------------------------------------------------------------- text

def python_docs_text() -> str:
    """The English text of Python's documentation topics, shipped with Python
    itself (``pydoc_data.topics``), topics in sorted order."""
    from pydoc_data.topics import topics
    return "\n\n".join(topics[k] for k in sorted(topics))


def load_text(test_fraction: float, seed: int, path: Path | None = None,
              sequence_length: int = 64) -> Dataset:
    """Character windows of an English text for next-character prediction.

    x (N, T) int32 character ids, y (N, T) int64: the character after each
    one; windows do not overlap and are split into train / test by a seeded
    shuffle. ``Dataset.vocabulary`` lists the characters (sorted).
    """
    check_int(sequence_length, "text: option sequence_length", 2)
    if path is None:
        text, source = python_docs_text(), "pydoc_data.topics (Python's documentation)"
    else:
        _require(path, "text", directory=False)
        if _regular(path).st_size > MAX_TEXT_FILE_BYTES:
            raise ValueError(f"{path}: {path.stat().st_size:,} bytes is larger than the "
                             f"{MAX_TEXT_FILE_BYTES:,} bytes a text file may have")
        try:
            text = read_data_file(path).decode("utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
        source = str(path)
    vocabulary = "".join(sorted(set(text)))
    if len(vocabulary) < 2:
        raise ValueError(f"text: {source} has fewer than 2 distinct characters")
    lookup = np.zeros(max(map(ord, vocabulary)) + 1, np.int32)
    lookup[[ord(c) for c in vocabulary]] = np.arange(len(vocabulary))
    ids = lookup[np.frombuffer(text.encode("utf-32-le"), "<u4")]         # (len,)
    t = sequence_length
    n = (len(ids) - 1) // t
    if n < 2:
        raise ValueError(f"text: {source} has {len(text)} characters, too few for two windows "
                         f"of sequence_length {t}")
    x = ids[:n * t].reshape(n, t)                                         # (N, T)
    y = ids[1:n * t + 1].reshape(n, t).astype(np.int64)                   # next characters
    order = np.random.default_rng(seed).permutation(n)
    n_test = max(1, int(round(test_fraction * n)))
    te, tr = order[:n_test], order[n_test:]
    return Dataset("text", x[tr], y[tr], x[te], y[te], len(vocabulary), synthetic=False,
                   vocabulary=vocabulary, source=source)

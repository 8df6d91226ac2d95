"""CIFAR-10 and MNIST read from files already on disk, in their distribution formats.
Nothing here downloads anything: a missing file is a UsageError naming the files expected and
the directories searched.

- CIFAR-10, "python version" (cifar-10-python.tar.gz, unpacked): `data_batch_1` ..
  `data_batch_5` and `test_batch` in `<data_dir>/cifar-10-batches-py/` or in `<data_dir>`
  itself. Each is a pickled dict with b'data', a uint8 (N, 3072) array (each row the 1024 red,
  then green, then blue values of a 32x32 image, row-major) and b'labels', N ints in 0..9.
- MNIST, IDX: `train-images-idx3-ubyte`, `train-labels-idx1-ubyte`, `t10k-images-idx3-ubyte`,
  `t10k-labels-idx1-ubyte`, each raw or gzipped (`.gz` appended), in `<data_dir>` or in
  `<data_dir>/MNIST/raw` (where torchvision keeps them). An IDX file is a big-endian header
  (magic 0x00000803 for images, 0x00000801 for labels: two zero bytes, type 0x08 = unsigned
  byte, the number of dimensions) then one uint32 per dimension, then the bytes.

Images come back as float32 (N, H, W, C) scaled to [0, 1]; labels as int32, in a `Dataset`
(defined here, the lowest of the data modules, so jaxdist/data.py imports this one and not
the other way round).
"""

from __future__ import annotations

import gzip
import math
import pickle
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxdist import host_memory
from jaxdist.errors import UsageError

FILE_DATASETS = ("cifar10", "mnist")
CIFAR_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR_TEST = "test_batch"
CIFAR_SUBDIR = "cifar-10-batches-py"
MNIST_FILES = {"train_x": "train-images-idx3-ubyte", "train_y": "train-labels-idx1-ubyte",
               "test_x": "t10k-images-idx3-ubyte", "test_y": "t10k-labels-idx1-ubyte"}
MNIST_SUBDIR = Path("MNIST") / "raw"
_IDX_MAGIC = {3: 0x00000803, 1: 0x00000801}  # dimensions -> magic (unsigned-byte data)


@dataclass(frozen=True)
class Dataset:
    name: str
    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    num_classes: int

    @property
    def image_shape(self) -> tuple[int, ...]:
        return self.train_x.shape[1:]


def load_files(name: str, data_dir: str | Path) -> Dataset:
    """The dataset `name` ("cifar10" or "mnist") read from `data_dir`."""
    if name == "cifar10":
        return load_cifar10(data_dir)
    if name == "mnist":
        return load_mnist(data_dir)
    raise UsageError(f"no file reader for dataset {name!r}; choose from "
                     f"{', '.join(FILE_DATASETS)}")


# ---- CIFAR-10 ---------------------------------------------------------------------------

def load_cifar10(data_dir: str | Path) -> Dataset:
    root = _existing_dir(data_dir)
    where = root / CIFAR_SUBDIR if (root / CIFAR_SUBDIR).is_dir() else root
    names = CIFAR_TRAIN + (CIFAR_TEST,)
    missing = [n for n in names if not (where / n).is_file()]
    if missing:
        searched = f"{root / CIFAR_SUBDIR} or {root}" if where == root else str(where)
        raise UsageError(
            f"CIFAR-10 files missing: {', '.join(missing)} not in {searched}; expected "
            f"{', '.join(names)} (the unpacked 'CIFAR-10 python version' archive); nothing "
            f"is downloaded")
    train = [_cifar_batch(where / n) for n in CIFAR_TRAIN]
    test_x, test_y = _cifar_batch(where / CIFAR_TEST)
    return Dataset("cifar10", np.concatenate([x for x, _ in train]),
                   np.concatenate([y for _, y in train]), test_x, test_y, num_classes=10)


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """The CIFAR-10 batches ARE pickles (that is the published format), and unpickling can
    run arbitrary code, so only the globals a pickled numpy array needs are resolved; any
    other reference in the file is refused. Python-2-era files name numpy.core.multiarray,
    current numpy numpy._core.multiarray: both map to the same functions. Python 3 writes
    bytes into protocol-2 pickles as _codecs.encode(text, "latin1"), and arrays into
    protocol-5 ones with numeric._frombuffer: both allowed, so re-saved batches load too."""

    def find_class(self, module, name):
        if (module, name) in (("numpy", "ndarray"), ("numpy", "dtype")):
            return getattr(np, name)
        if (module, name) == ("_codecs", "encode"):
            import codecs
            return codecs.encode
        if module in ("numpy.core.multiarray", "numpy._core.multiarray") and \
                name in ("_reconstruct", "scalar"):
            return getattr(_numpy_core("multiarray"), name)
        if module in ("numpy.core.numeric", "numpy._core.numeric") and name == "_frombuffer":
            return _numpy_core("numeric")._frombuffer  # protocol 5
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def _numpy_core(module):
    import importlib
    try:
        return importlib.import_module(f"numpy._core.{module}")
    except ImportError:  # numpy < 2
        return importlib.import_module(f"numpy.core.{module}")


def _cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    def bad(why):
        return UsageError(f"CIFAR-10 file {path} is malformed: {why} (expected a pickled dict "
                          f"with b'data' uint8 (N, 3072) and b'labels' N ints in 0..9)")

    try:
        with open(path, "rb") as f:
            # encoding="bytes": the batches were pickled by Python 2, so their str keys load
            # as bytes (b'data', b'labels'), as in the dataset's own instructions.
            batch = _NumpyOnlyUnpickler(f, encoding="bytes").load()
    except Exception as e:  # truncated, not a pickle, or a refused global
        raise bad(f"cannot unpickle ({type(e).__name__}: {e})") from None
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        raise bad("no b'data' and b'labels' keys")
    data, labels = batch[b"data"], np.asarray(batch[b"labels"])
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 \
            or data.shape[1] != 3072:
        shape = getattr(data, "shape", None)
        raise bad(f"b'data' is {type(data).__name__} {getattr(data, 'dtype', '')} {shape}")
    if labels.shape != (data.shape[0],) or labels.dtype.kind not in "iu":
        raise bad(f"{labels.shape} labels for {data.shape[0]} images")
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise bad(f"labels outside 0..9 ({labels.min()}..{labels.max()})")
    x_NHWC = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return x_NHWC.astype(np.float32) / 255.0, labels.astype(np.int32)


# ---- MNIST ------------------------------------------------------------------------------

def load_mnist(data_dir: str | Path) -> Dataset:
    root = _existing_dir(data_dir)
    dirs = [root, root / MNIST_SUBDIR]
    paths, missing = {}, []
    for key, name in MNIST_FILES.items():
        found = [d / n for d in dirs for n in (name, name + ".gz") if (d / n).is_file()]
        if found:
            paths[key] = found[0]
        else:
            missing.append(name)
    if missing:
        raise UsageError(
            f"MNIST files missing: {', '.join(missing)} (raw or .gz) not in {dirs[0]} or "
            f"{dirs[1]}; expected {', '.join(MNIST_FILES.values())}, each raw or gzipped; "
            f"nothing is downloaded")
    train_x, test_x = _idx(paths["train_x"], 3), _idx(paths["test_x"], 3)
    train_y, test_y = _idx(paths["train_y"], 1), _idx(paths["test_y"], 1)
    for x, y, split in ((train_x, train_y, "train"), (test_x, test_y, "test")):
        if len(x) != len(y):
            raise UsageError(f"MNIST {split} files disagree: {len(x)} images in "
                             f"{paths[split + '_x']}, {len(y)} labels in {paths[split + '_y']}")
        if y.size and y.max() > 9:
            raise UsageError(f"MNIST labels in {paths[split + '_y']} outside 0..9 "
                             f"(max {y.max()})")
    scale = lambda x: (x.astype(np.float32) / 255.0)[..., None]  # noqa: E731
    return Dataset("mnist", scale(train_x), train_y.astype(np.int32), scale(test_x),
                   test_y.astype(np.int32), num_classes=10)


def _idx(path: Path, ndim: int) -> np.ndarray:
    """An unsigned-byte IDX file with `ndim` dimensions, checked against its header."""
    kind = "images" if ndim == 3 else "labels"

    def bad(why):
        return UsageError(f"MNIST {kind} file {path} is malformed: {why} (expected an IDX "
                          f"file, magic 0x{_IDX_MAGIC[ndim]:08x})")

    header = 4 + 4 * ndim
    try:
        # Read as far as the header says and one byte more, never the whole stream: a small
        # .gz that inflates to gigabytes (a zip bomb) was read whole into memory first.
        with (gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")) as f:
            raw = f.read(header)
            if len(raw) < 4:
                raise bad(f"{len(raw)} bytes, shorter than the 4-byte magic number")
            (magic,) = struct.unpack(">I", raw[:4])
            if magic != _IDX_MAGIC[ndim]:
                raise bad(f"magic number 0x{magic:08x}")
            if len(raw) < header:
                raise bad(f"{len(raw)} bytes, shorter than its {header}-byte header")
            dims = struct.unpack(f">{ndim}I", raw[4:header])
            if ndim == 3 and dims[1:] != (28, 28):
                raise bad(f"images of {dims[1]}x{dims[2]}, not 28x28")
            expected = header + math.prod(dims)  # Python ints: numpy's overflow
            available = host_memory.available_bytes()
            if available is not None and expected > available:
                raise bad(f"the header {dims} implies {expected:,} bytes, more than the "
                          f"{available:,} this host has available")
            raw += _read_at_most(f, expected - header + 1)
    except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
        raise bad(f"cannot decompress ({type(e).__name__}: {e})") from None
    if len(raw) < expected:
        raise bad(f"{len(raw):,} bytes where the header {dims} implies {expected:,} "
                  f"(truncated)")
    if len(raw) > expected:
        raise bad(f"more than the {expected:,} bytes the header {dims} implies (trailing "
                  f"bytes)")
    return np.frombuffer(raw, np.uint8, offset=header).reshape(dims)


def _read_at_most(f, n: int, chunk: int = 1 << 24) -> bytes:
    """Up to `n` bytes of stream `f`, read in chunks (one read(n) allocates n at once)."""
    parts, left = [], n
    while left > 0:
        part = f.read(min(left, chunk))
        if not part:
            break
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def _existing_dir(data_dir) -> Path:
    root = Path(data_dir).expanduser()
    if not root.is_dir():
        raise UsageError(f"data directory {root} does not exist (or is not a directory)")
    return root

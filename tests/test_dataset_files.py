"""CIFAR-10 and MNIST readers on small files written here in the real formats, and the
errors for missing or malformed files (no download, no JAX; < 1 s)."""

import gzip
import os
import pickle
import struct

import numpy as np
import pytest

from jaxdist.dataset_files import (CIFAR_TEST, CIFAR_TRAIN, MNIST_FILES, load_cifar10,
                                   load_files, load_mnist)
from jaxdist.errors import UsageError

# ---- writers in the distribution formats ------------------------------------------------


def cifar_rows(n, seed):
    """(N, 3072) uint8 rows as the archive stores them and the (N, 32, 32, 3) images they
    are: each row is the red plane, then green, then blue, each 32x32 row-major."""
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
    rows = np.concatenate([images[..., c].reshape(n, 1024) for c in range(3)], axis=1)
    return rows, images


def write_cifar_batch(path, rows, labels, protocol=2):
    batch = {b"batch_label": b"training batch", b"labels": list(labels), b"data": rows,
             b"filenames": [b"x.png"] * len(labels)}
    blob = pickle.dumps(batch, protocol=protocol)
    if protocol == 2:  # the published files: protocol 2, pickled with numpy 1.x
        blob = blob.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
    path.write_bytes(blob)


def write_cifar(root, sizes=(3, 2, 2, 2, 2, 4)):
    root.mkdir(parents=True, exist_ok=True)
    expected = []
    for i, (name, n) in enumerate(zip(CIFAR_TRAIN + (CIFAR_TEST,), sizes)):
        rows, images = cifar_rows(n, i)
        labels = np.arange(n) % 10
        write_cifar_batch(root / name, rows, labels, protocol=(2, 4, 5)[i % 3])
        expected.append((images, labels))
    return expected


def idx_bytes(array, magic=None):
    magic = magic if magic is not None else (0x803 if array.ndim == 3 else 0x801)
    return struct.pack(f">I{array.ndim}I", magic, *array.shape) + array.astype(np.uint8).tobytes()


def write_mnist(root, gz, n_train=5, n_test=3):
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    arrays = {"train_x": rng.integers(0, 256, (n_train, 28, 28)),
              "train_y": np.arange(n_train) % 10,
              "test_x": rng.integers(0, 256, (n_test, 28, 28)), "test_y": np.arange(n_test)}
    for key, name in MNIST_FILES.items():
        data = idx_bytes(arrays[key])
        if gz:
            (root / (name + ".gz")).write_bytes(gzip.compress(data))
        else:
            (root / name).write_bytes(data)
    return arrays


# ---- CIFAR-10 ---------------------------------------------------------------------------


@pytest.mark.parametrize("subdir", ["cifar-10-batches-py", ""])
def test_cifar_reads_python_batches(tmp_path, subdir):
    expected = write_cifar(tmp_path / subdir if subdir else tmp_path)
    ds = load_cifar10(tmp_path)
    assert ds.name == "cifar10" and ds.num_classes == 10
    assert ds.train_x.shape == (11, 32, 32, 3) and ds.test_x.shape == (4, 32, 32, 3)
    assert ds.train_x.dtype == np.float32 and ds.train_y.dtype == np.int32
    assert ds.image_shape == (32, 32, 3)
    train_images = np.concatenate([im for im, _ in expected[:5]])
    np.testing.assert_array_equal(ds.train_x, train_images / np.float32(255.0))
    np.testing.assert_array_equal(ds.train_y, np.concatenate([lab for _, lab in expected[:5]]))
    np.testing.assert_array_equal(ds.test_x, expected[5][0] / np.float32(255.0))
    np.testing.assert_array_equal(ds.test_y, expected[5][1])
    assert 0.0 <= ds.train_x.min() and ds.train_x.max() <= 1.0
    # A pixel lands where the channel-planar layout says: row 0, red plane, pixel (1, 2).
    rows = pickle.loads((tmp_path / (subdir or ".") / "data_batch_1").read_bytes(),
                        encoding="bytes")[b"data"]
    assert ds.train_x[0, 1, 2, 0] == np.float32(rows[0, 1 * 32 + 2]) / 255.0
    assert ds.train_x[0, 1, 2, 2] == np.float32(rows[0, 2048 + 1 * 32 + 2]) / 255.0
    assert load_files("cifar10", tmp_path).train_x.shape == ds.train_x.shape


def test_cifar_missing_files_named(tmp_path):
    write_cifar(tmp_path / "cifar-10-batches-py")
    os.remove(tmp_path / "cifar-10-batches-py" / "data_batch_3")
    os.remove(tmp_path / "cifar-10-batches-py" / "test_batch")
    with pytest.raises(UsageError) as info:
        load_cifar10(tmp_path)
    msg = str(info.value)
    assert "data_batch_3, test_batch" in msg and "data_batch_1" in msg  # missing and expected
    assert str(tmp_path / "cifar-10-batches-py") in msg and "\n" not in msg
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UsageError, match=f"data_batch_1.*not in .*empty"):
        load_cifar10(empty)
    with pytest.raises(UsageError, match="does not exist"):
        load_cifar10(tmp_path / "nope")


def _malformed(tmp_path, name, blob):
    root = tmp_path / "cifar-10-batches-py"
    write_cifar(root)
    (root / name).write_bytes(blob)
    with pytest.raises(UsageError) as info:
        load_cifar10(tmp_path)
    assert str(root / name) in str(info.value) and "malformed" in str(info.value)
    return str(info.value)


def test_cifar_malformed(tmp_path):
    rows, _ = cifar_rows(2, 0)
    good = pickle.dumps({b"data": rows, b"labels": [1, 2]}, protocol=2)
    assert "unpickle" in _malformed(tmp_path, "data_batch_2", good[: len(good) // 2])
    assert "unpickle" in _malformed(tmp_path, "test_batch", b"not a pickle at all")
    assert "keys" in _malformed(tmp_path, "data_batch_1",
                                pickle.dumps({"data": rows, "labels": [1, 2]}))
    assert "(2, 3000)" in _malformed(tmp_path, "data_batch_4",
                                     pickle.dumps({b"data": rows[:, :3000], b"labels": [1, 2]}))
    assert "labels for 2 images" in _malformed(
        tmp_path, "data_batch_5", pickle.dumps({b"data": rows, b"labels": [1, 2, 3]}))
    assert "outside 0..9" in _malformed(
        tmp_path, "data_batch_5", pickle.dumps({b"data": rows, b"labels": [1, 10]}))
    assert "float32" in _malformed(
        tmp_path, "data_batch_5", pickle.dumps({b"data": rows.astype(np.float32),
                                                b"labels": [1, 2]}))


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_cifar_pickle_may_only_build_numpy_arrays(tmp_path):
    rows, _ = cifar_rows(2, 0)
    msg = _malformed(tmp_path, "data_batch_1",
                     pickle.dumps({b"data": rows, b"labels": [1, 2], b"x": _Evil()}, protocol=2))
    assert "refusing to load" in msg and "system" in msg


# ---- MNIST ------------------------------------------------------------------------------


@pytest.mark.parametrize("gz", [True, False])
@pytest.mark.parametrize("subdir", ["", "MNIST/raw"])
def test_mnist_reads_idx(tmp_path, gz, subdir):
    arrays = write_mnist(tmp_path / subdir if subdir else tmp_path, gz)
    ds = load_mnist(tmp_path)
    assert ds.name == "mnist" and ds.num_classes == 10
    assert ds.train_x.shape == (5, 28, 28, 1) and ds.test_x.shape == (3, 28, 28, 1)
    assert ds.train_x.dtype == np.float32 and ds.test_y.dtype == np.int32
    np.testing.assert_array_equal(ds.train_x[..., 0], arrays["train_x"].astype(np.float32) / 255.0)
    np.testing.assert_array_equal(ds.test_x[..., 0], arrays["test_x"].astype(np.float32) / 255.0)
    np.testing.assert_array_equal(ds.train_y, arrays["train_y"])
    np.testing.assert_array_equal(ds.test_y, arrays["test_y"])
    assert load_files("mnist", tmp_path).test_y.tolist() == [0, 1, 2]


def test_mnist_mixed_raw_and_gz(tmp_path):
    write_mnist(tmp_path, gz=True)
    name = MNIST_FILES["test_y"]
    (tmp_path / name).write_bytes(gzip.decompress((tmp_path / (name + ".gz")).read_bytes()))
    os.remove(tmp_path / (name + ".gz"))
    assert load_mnist(tmp_path).test_y.tolist() == [0, 1, 2]


def test_mnist_missing_files_named(tmp_path):
    write_mnist(tmp_path, gz=True)
    os.remove(tmp_path / "t10k-labels-idx1-ubyte.gz")
    with pytest.raises(UsageError) as info:
        load_mnist(tmp_path)
    msg = str(info.value)
    assert "missing: t10k-labels-idx1-ubyte" in msg and str(tmp_path) in msg
    assert all(name in msg for name in MNIST_FILES.values()) and "\n" not in msg


@pytest.mark.parametrize("key, blob, why", [
    ("train_x", idx_bytes(np.zeros((2, 28, 28)), magic=0x801), "magic number 0x00000801"),
    ("train_y", idx_bytes(np.zeros((5, 28, 28))), "magic number 0x00000803"),
    ("test_x", idx_bytes(np.zeros((3, 28, 28)))[:-1], "truncated"),
    ("test_x", idx_bytes(np.zeros((3, 28, 28))) + b"\0", "trailing bytes"),
    ("test_x", idx_bytes(np.zeros((3, 32, 32))), "32x32, not 28x28"),
    ("test_y", b"\0\0", "shorter than the 4-byte magic"),
    ("test_y", struct.pack(">I", 0x801), "shorter than its 8-byte header"),
    ("test_y", idx_bytes(np.array([1, 2, 11])), "outside 0..9"),
    ("test_y", idx_bytes(np.array([1, 2])), "2 labels"),
])
def test_mnist_malformed(tmp_path, key, blob, why):
    write_mnist(tmp_path, gz=False)
    (tmp_path / MNIST_FILES[key]).write_bytes(blob)
    with pytest.raises(UsageError, match="malformed|disagree|outside") as info:
        load_mnist(tmp_path)
    assert why in str(info.value) and str(tmp_path / MNIST_FILES[key]) in str(info.value)


def test_mnist_bad_gzip(tmp_path):
    write_mnist(tmp_path, gz=True)
    name = MNIST_FILES["train_x"] + ".gz"
    good = (tmp_path / name).read_bytes()
    (tmp_path / name).write_bytes(good[: len(good) // 2])
    with pytest.raises(UsageError, match="cannot decompress"):
        load_mnist(tmp_path)
    (tmp_path / name).write_bytes(b"plain bytes, not gzip")
    with pytest.raises(UsageError, match=f"{name}.*cannot decompress"):
        load_mnist(tmp_path)


def test_mnist_reads_no_further_than_its_header_says(tmp_path, monkeypatch):
    """A small .gz that inflates far past what its header says (a zip bomb) is read up to
    the header's size and one byte, not whole; a header that implies more bytes than the
    host has available is refused before reading."""
    from jaxdist import host_memory

    write_mnist(tmp_path, gz=True)
    name = MNIST_FILES["test_x"] + ".gz"
    with gzip.open(tmp_path / name, "wb") as f:
        f.write(idx_bytes(np.zeros((3, 28, 28))))
        f.write(bytes(64 << 20))  # 64 MiB of zeros after the 3 images: 64 KiB compressed
    with pytest.raises(UsageError, match=r"more than the 2,368 bytes the header \(3, 28, 28\) "
                                         r"implies \(trailing bytes\)"):
        load_mnist(tmp_path)
    write_mnist(tmp_path, gz=True, n_train=2000)
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 10 ** 6)
    with pytest.raises(UsageError, match=r"the header \(2000, 28, 28\) implies 1,568,016 "
                                         r"bytes, more than the 1,000,000 this host has"):
        load_mnist(tmp_path)


def test_unknown_name():
    with pytest.raises(UsageError, match="cifar10, mnist"):
        load_files("imagenet", "/nonexistent")


def test_cli_trains_on_cifar_files_and_reports_accuracy(tmp_path):
    from jaxdist.record import RunRecord
    from tests.helpers import run_cli

    write_cifar(tmp_path / "data", sizes=(16, 16, 16, 16, 16, 16))
    proc = run_cli("--dataset", "cifar10", "--data-dir", str(tmp_path / "data"), "--model",
                   "mlp-tiny", "--mesh", "2", "--batch-size", "8", "--steps", "4",
                   "--warmup", "1", "--eval-every", "5", "--logdir", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr
    results = RunRecord.load(tmp_path / "run").results
    assert results["accuracy"] and 0.0 <= results["accuracy"][-1]["accuracy"] <= 1.0


def test_cli_dataset_without_data_dir(tmp_path, monkeypatch, capsys):
    from tests.helpers import cli_main

    monkeypatch.chdir(tmp_path)
    proc = cli_main(capsys, "--dataset", "mnist", "--model", "mlp-tiny", "--mesh", "2",
                    "--batch-size", "8")
    assert proc.returncode == 2
    assert "--dataset mnist needs --data-dir DIR" in proc.stderr
    assert list(tmp_path.iterdir()) == []

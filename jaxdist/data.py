"""Where batches come from: synthetic (fixed seed, default, for speed runs) or a real
dataset with a fixed train/test split, for accuracy and time-to-accuracy.

`digits` is scikit-learn's embedded 8x8 handwritten digits (1,797 images, 10 classes): real
data that needs no download. A dataset fixes the model's input shape, so the model config is
adapted to it (models/build.py: an MLP's input width, a CNN's image size and channels).
"""

from __future__ import annotations

import math

import numpy as np

from jaxdist.dataset_files import FILE_DATASETS, Dataset, load_files
from jaxdist.errors import UsageError

DATASETS = ("synthetic", "digits", "cifar10", "mnist")
NUM_SYNTHETIC_BATCHES = 8  # distinct synthetic batches, cycled


def load_dataset(name: str, data_dir: str = "") -> Dataset | None:
    """The named dataset, or None for synthetic data. cifar10 and mnist are read from
    `data_dir` in their standard distribution formats (jaxdist/dataset_files.py)."""
    if name == "synthetic":
        return None
    if name in FILE_DATASETS:
        if not data_dir:
            raise UsageError(f"--dataset {name} needs --data-dir DIR (the directory holding "
                             f"the standard {name} files; nothing is downloaded)")
        return load_files(name, data_dir)
    if name == "digits":
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        digits = load_digits()
        x_NHWC = (digits.images / 16.0).astype(np.float32)[..., None]
        y_N = digits.target.astype(np.int32)
        train_x, test_x, train_y, test_y = train_test_split(
            x_NHWC, y_N, test_size=0.2, random_state=0, stratify=y_N)
        return Dataset("digits", train_x, train_y, test_x, test_y, num_classes=10)
    raise UsageError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")


class TrainStream:
    """Global batches in a reproducible order: synthetic batches cycled, or a dataset
    reshuffled every epoch from (seed, epoch). `position` is the number of batches served."""

    def __init__(self, model_cfg, dataset: Dataset | None, batch_size: int, seed: int):
        self.model_cfg, self.dataset = model_cfg, dataset
        self.batch_size, self.seed = batch_size, seed
        self.position = 0
        if dataset is not None and len(dataset.train_y) < batch_size:
            raise UsageError(f"--batch-size {batch_size} exceeds the {len(dataset.train_y)} "
                             f"training samples of {dataset.name!r}")
        self._synthetic = [] if dataset is not None else [
            model_cfg.synthetic_batch(np.random.default_rng([seed, i]), batch_size)
            for i in range(NUM_SYNTHETIC_BATCHES)]

    @property
    def batches_per_epoch(self) -> int:
        return len(self.dataset.train_y) // self.batch_size if self.dataset else len(self._synthetic)

    def batch(self, index: int) -> dict[str, np.ndarray]:
        if self.dataset is None:
            return self._synthetic[index % len(self._synthetic)]
        epoch, i = divmod(index, self.batches_per_epoch)
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset.train_y))
        rows = order[i * self.batch_size:(i + 1) * self.batch_size]
        return {"x": self.dataset.train_x[rows], "y": self.dataset.train_y[rows]}

    def next(self) -> dict[str, np.ndarray]:
        out = self.batch(self.position)
        self.position += 1
        return out


def eval_batches(dataset: Dataset, batch_size: int, multiple: int):
    """The whole test split in batches padded to a multiple of the device count; `mask`
    marks real rows, so padding never counts toward accuracy."""
    size = math.ceil(min(batch_size, len(dataset.test_y)) / multiple) * multiple
    for start in range(0, len(dataset.test_y), size):
        x = dataset.test_x[start:start + size]
        y = dataset.test_y[start:start + size]
        pad = size - len(y)
        yield {"x": np.concatenate([x, np.zeros((pad, *x.shape[1:]), x.dtype)]),
               "y": np.concatenate([y, np.zeros(pad, y.dtype)]),
               "mask": np.concatenate([np.ones(len(y), np.float32), np.zeros(pad, np.float32)])}


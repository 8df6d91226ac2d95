"""The model config of a run: the registered size, its `--model-opts` overrides and remat,
adapted to the run's dataset."""

from __future__ import annotations

import dataclasses

from jaxdist.data import Dataset, load_dataset
from jaxdist.errors import UsageError
from models.registry import families, get_model, parse_overrides


def adapt_model(model_cfg, dataset: Dataset | None):
    """The model config with its input and head sized for `dataset`."""
    if dataset is None:
        return model_cfg
    h, w, c = dataset.image_shape
    if model_cfg.input_kind == "vector":
        return dataclasses.replace(model_cfg, in_dim=h * w * c, num_classes=dataset.num_classes)
    if model_cfg.input_kind == "image":
        adapted = dataclasses.replace(model_cfg, image_size=h, channels=c,
                                      num_classes=dataset.num_classes)
        if hasattr(adapted, "validate"):
            adapted.validate()  # e.g. an ImageNet stem cannot take 28x28 MNIST
        return adapted
    raise UsageError(f"dataset {dataset.name!r} is images; model family "
                     f"{model_cfg.family!r} cannot read it (use an mlp or a CNN: "
                     f"{', '.join(families('image'))})")


def build_model(cfg):
    """(model config for a RunConfig: size overrides, remat, adapted to the dataset; the
    dataset or None)."""
    dataset = load_dataset(cfg.data.dataset, cfg.data.data_dir)
    model_cfg = get_model(cfg.model.model, parse_overrides(cfg.model.model_opts))
    if cfg.train.remat != "none":
        if not hasattr(model_cfg, "remat"):
            raise UsageError(f"--remat applies to gpt models, not {cfg.model.model!r}")
        model_cfg = dataclasses.replace(model_cfg, remat=cfg.train.remat)
    return adapt_model(model_cfg, dataset), dataset

"""PyTorch twins of the JAX models, for the live cross-framework reference (experiments.torch_run).

Same architectures, same parameter shapes and counts, same loss, same synthetic data:

- `arch_spec(model_cfg)` turns a registered JAX model config into a plain dict (family,
  sizes and derived structure such as a ResNet's block list), so the PyTorch side never
  re-derives an architecture and needs neither JAX nor flax at run time.
- `build(spec)` is the `torch.nn.Module`; its module names mirror the NNX attribute names
  (`blocks.0.attn.q`, `stem_bn`, ...), so one rule maps every JAX leaf onto a PyTorch one.
- `state_from_nnx(model)` converts an NNX model's parameters and BatchNorm statistics to a
  PyTorch state dict (Linear kernels transposed, conv kernels HWIO -> OIHW), so a PyTorch
  run can start from exactly the JAX run's initial weights and the two loss curves are
  comparable step by step.

Layout differences kept deliberately: images are NHWC in JAX and NCHW here (`to_torch_batch`
transposes); JAX's "SAME" padding is asymmetric for stride 2 (0 before, 1 after), so the
convs here pad the same way instead of PyTorch's symmetric padding=1.

Known semantic differences (documented in docs/compare.md): under JAX data parallelism
BatchNorm statistics are over the global batch (SyncBN), under PyTorch DDP over each rank's
local batch; PyTorch's running variance is unbiased, flax's biased (eval only); bfloat16 runs
use torch.autocast, which keeps LayerNorm and softmax in float32.

torch is imported lazily, so `models` stays importable without it.
"""

from __future__ import annotations

import dataclasses
import math
from functools import lru_cache
from typing import Any

import numpy as np

FAMILIES = ("mlp", "resnet", "gpt")


def twin_problem(model_cfg) -> str | None:
    """Why `model_cfg` has no PyTorch twin here, or None. The gpt twin is GPTConfig's
    architecture; Llama configs share its family (layouts, data) but not its blocks (RMSNorm,
    RoPE, SwiGLU, grouped-query attention)."""
    from models.gpt import GPTConfig

    if model_cfg.family not in FAMILIES:
        return f"family {model_cfg.family}"
    if model_cfg.family == "gpt" and type(model_cfg) is not GPTConfig:
        return f"{type(model_cfg).__name__.removesuffix('Config')}, not GPT's blocks"
    return None


def arch_spec(model_cfg) -> dict[str, Any]:
    """A JSON-able description of a registered model config: everything `build` needs."""
    family = model_cfg.family
    problem = twin_problem(model_cfg)
    if problem:
        raise ValueError(f"no PyTorch twin for {problem}")
    spec = {k: v for k, v in dataclasses.asdict(model_cfg).items()}
    if family == "resnet":
        spec["block_specs"] = [list(b) for b in model_cfg.block_specs()]
        spec["bottleneck"] = model_cfg.bottleneck
        spec["features"] = model_cfg.features
        spec["expansion"] = 4
        spec["stem"] = model_cfg.resolved_stem
    return spec


def import_torch():
    """torch, or ImportError with the install line."""
    try:
        import torch
    except ImportError as e:
        raise ImportError("PyTorch is not installed: pip install -e '.[torch]' "
                          "(CPU build: pip install torch==2.13.0)") from e
    return torch


@lru_cache(maxsize=None)
def _classes():
    torch = import_torch()
    nn = torch.nn
    F = torch.nn.functional

    class SameConv2d(nn.Conv2d):
        """Conv with JAX/TF "SAME" padding: out = ceil(in / stride), extra pad after."""

        def __init__(self, cin, cout, k, stride):
            super().__init__(cin, cout, k, stride=stride, padding=0, bias=False)

        def forward(self, x):
            k, s = self.kernel_size[0], self.stride[0]
            h, w = x.shape[-2:]
            pads = []
            for n in (w, h):  # F.pad order: last dim first
                total = max((math.ceil(n / s) - 1) * s + k - n, 0)
                pads += [total // 2, total - total // 2]
            if pads[0] == pads[1] == pads[2] == pads[3]:
                return F.conv2d(x, self.weight, None, self.stride, pads[0])
            return F.conv2d(F.pad(x, pads), self.weight, None, self.stride, 0)

    def bn(c):
        # flax momentum 0.9 (weight of the old value) == PyTorch momentum 0.1.
        return nn.BatchNorm2d(c, eps=1e-5, momentum=0.1)

    class MLP(nn.Module):
        def __init__(self, s):
            super().__init__()
            dims = [s["in_dim"]] + [s["width"]] * s["depth"]
            self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
            self.head = nn.Linear(dims[-1], s["num_classes"])

        def forward(self, x):
            x = x.reshape(x.shape[0], -1)
            for layer in self.hidden:
                x = F.relu(layer(x))
            return self.head(x).float()

    class Shortcut(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.project = stride != 1 or cin != cout
            if self.project:
                self.conv = SameConv2d(cin, cout, 1, stride)
                self.bn = bn(cout)

        def forward(self, x):
            return self.bn(self.conv(x)) if self.project else x

    class Block(nn.Module):
        def __init__(self, cin, inner, stride, bottleneck, expansion):
            super().__init__()
            if bottleneck:
                cout = inner * expansion
                specs = [(cin, inner, 1, 1), (inner, inner, 3, stride), (inner, cout, 1, 1)]
            else:
                cout = inner
                specs = [(cin, inner, 3, stride), (inner, inner, 3, 1)]
            self.convs = nn.ModuleList(SameConv2d(a, b, k, st) for a, b, k, st in specs)
            self.bns = nn.ModuleList(bn(b) for _, b, _, _ in specs)
            self.shortcut = Shortcut(cin, cout, stride)

        def forward(self, x):
            y = x
            last = len(self.convs) - 1
            for i, (conv, norm) in enumerate(zip(self.convs, self.bns)):
                y = norm(conv(y))
                if i < last:
                    y = F.relu(y)
            return F.relu(y + self.shortcut(x))

    class ResNet(nn.Module):
        def __init__(self, s):
            super().__init__()
            imagenet = s.get("stem") == "imagenet"  # torchvision's 7x7/2 conv + max-pool
            self.stem = (nn.Conv2d(s["channels"], s["width"], 7, 2, padding=3, bias=False)
                         if imagenet else SameConv2d(s["channels"], s["width"], 3, 1))
            self.pool = nn.MaxPool2d(3, 2, padding=1) if imagenet else nn.Identity()
            self.stem_bn = bn(s["width"])
            self.blocks = nn.ModuleList(
                Block(cin, inner, stride, s["bottleneck"], s["expansion"])
                for cin, inner, stride in s["block_specs"])
            self.head = nn.Linear(s["features"], s["num_classes"])

        def forward(self, x_NCHW):
            x = self.pool(F.relu(self.stem_bn(self.stem(x_NCHW))))
            for block in self.blocks:
                x = block(x)
            return self.head(x.mean(dim=(2, 3))).float()

    class Attention(nn.Module):
        def __init__(self, width, heads):
            super().__init__()
            self.heads = heads
            self.q = nn.Linear(width, width)
            self.k = nn.Linear(width, width)
            self.v = nn.Linear(width, width)
            self.out = nn.Linear(width, width)

        def forward(self, x):
            B, L, D = x.shape
            q, k, v = (proj(x).reshape(B, L, self.heads, D // self.heads).transpose(1, 2)
                       for proj in (self.q, self.k, self.v))  # B N L H
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.out(y.transpose(1, 2).reshape(B, L, D))

    class FeedForward(nn.Module):
        def __init__(self, width, hidden):
            super().__init__()
            self.up = nn.Linear(width, hidden)
            self.down = nn.Linear(hidden, width)

        def forward(self, x):
            return self.down(F.gelu(self.up(x), approximate="tanh"))  # flax's gelu default

    class GPTBlock(nn.Module):
        def __init__(self, width, heads, hidden):
            super().__init__()
            self.ln1 = nn.LayerNorm(width, eps=1e-5)
            self.attn = Attention(width, heads)
            self.ln2 = nn.LayerNorm(width, eps=1e-5)
            self.mlp = FeedForward(width, hidden)

        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self, s):
            super().__init__()
            self.tok = nn.Embedding(s["vocab"], s["width"])
            self.pos = nn.Embedding(s["seq_len"], s["width"])
            self.blocks = nn.ModuleList(
                GPTBlock(s["width"], s["heads"], s["mlp_ratio"] * s["width"])
                for _ in range(s["depth"]))
            self.ln_f = nn.LayerNorm(s["width"], eps=1e-5)
            self.head = nn.Linear(s["width"], s["vocab"])

        def forward(self, tokens):
            L = tokens.shape[1]
            x = self.tok(tokens) + self.pos(torch.arange(L, device=tokens.device))[None]
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_f(x)).float()

    return {"mlp": MLP, "resnet": ResNet, "gpt": GPT}


def build(spec: dict):
    """The PyTorch model for `spec` (from `arch_spec`), PyTorch's default initialisation."""
    return _classes()[spec["family"]](spec)


def shard_units(spec: dict, model) -> list:
    """The submodules FSDP2 wraps one by one (each is all-gathered as a unit), before the
    root: hidden layers of an MLP, residual blocks of a ResNet, transformer blocks of a GPT."""
    if spec["family"] == "mlp":
        return list(model.hidden) + [model.head]
    return list(model.blocks)


def to_torch_batch(spec: dict, batch: dict[str, np.ndarray], device="cpu") -> dict:
    """A numpy batch as the JAX model gets it -> tensors for the PyTorch twin."""
    torch = import_torch()
    if spec["family"] == "gpt":
        tokens = torch.from_numpy(np.ascontiguousarray(batch["tokens"])).long().to(device)
        return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    x = torch.from_numpy(np.ascontiguousarray(batch["x"])).to(device)
    if spec["family"] == "resnet":
        x = x.permute(0, 3, 1, 2)  # NHWC -> NCHW (a channels-last view; no copy)
    return {"inputs": x, "targets": torch.from_numpy(batch["y"]).long().to(device)}


def loss(spec: dict, model, batch: dict):
    """Mean softmax cross-entropy, as every JAX model's `loss`."""
    torch = import_torch()
    logits = model(batch["inputs"]).float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             batch["targets"].reshape(-1))


def param_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


_LEAF_NAMES = {"bias": "bias", "scale": "weight", "embedding": "weight",
               "mean": "running_mean", "var": "running_var"}


def nnx_leaf_to_torch(path: tuple, value: np.ndarray) -> tuple[str, np.ndarray]:
    """One NNX leaf (path, array) -> (PyTorch state-dict key, array in PyTorch's layout)."""
    *module, leaf = (str(p) for p in path)
    if leaf == "kernel":
        name = "weight"
        if value.ndim == 2:      # Linear: (in, out) -> (out, in)
            value = value.T
        elif value.ndim == 4:    # Conv: HWIO -> OIHW
            value = value.transpose(3, 2, 0, 1)
        else:
            raise ValueError(f"unexpected kernel rank {value.ndim} at {path}")
    elif leaf in _LEAF_NAMES:
        name = _LEAF_NAMES[leaf]
    else:
        raise ValueError(f"no PyTorch counterpart for NNX leaf {'/'.join(map(str, path))}")
    return ".".join([*module, name]), np.array(value, dtype=np.float32, order="C")


def state_from_nnx(model_or_state) -> dict[str, np.ndarray]:
    """Every parameter and BatchNorm statistic of an NNX model (or of its `nnx.state`),
    keyed and laid out for `build(spec).load_state_dict`."""
    from flax import nnx

    state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state)
    out = {}
    for path, var in nnx.to_flat_state(state):
        value = var[...] if hasattr(var, "__getitem__") and not isinstance(var, np.ndarray) else var
        key, value = nnx_leaf_to_torch(path, np.asarray(value))
        out[key] = value
    return out


def load_state(model, state: dict[str, np.ndarray]) -> None:
    """Copy `state` into `model`; every parameter and statistic must be covered (only
    BatchNorm's `num_batches_tracked`, which flax has no use for, may be absent)."""
    torch = import_torch()
    tensors = {k: torch.from_numpy(v) for k, v in state.items()}
    result = model.load_state_dict(tensors, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("num_batches_tracked")]
    if missing or result.unexpected_keys:
        raise ValueError(f"state does not fit the model: missing {missing[:5]}, "
                         f"unexpected {result.unexpected_keys[:5]}")

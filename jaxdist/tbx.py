"""tensorboardX, imported without torch.

tensorboardX imports torch at import time when it is installed (to accept torch tensors),
which costs 3-8 s in every process that writes or reads an event file; jaxdist gives it
numbers and numpy arrays only. A process that has already imported torch (the PyTorch
reference) keeps its torch."""

from __future__ import annotations

import importlib
import sys


def tensorboardx():
    """The tensorboardX package, torch left unimported unless this process already has it."""
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        return importlib.import_module("tensorboardX")
    sys.modules["torch"] = None  # `import torch` raises ImportError: tensorboardX's fallback
    try:
        return importlib.import_module("tensorboardX")
    finally:
        del sys.modules["torch"]  # a later `import torch` imports it as usual

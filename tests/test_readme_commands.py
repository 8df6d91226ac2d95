"""The README's commands run as pasted after `make`: every Python command names the venv's
interpreter (a bare `python` is the system's, without jax: ModuleNotFoundError); its
full-size example is the model its name says; and the GPU compiler's size is one figure
wherever it is given."""

import re

from models import get_model
from tests.helpers import ROOT

README = (ROOT / "README.md").read_text()


def commands(markdown: str) -> list[str]:
    """Every command in a code block or a code span."""
    blocks = re.findall(r"```\n(.*?)```", markdown, re.S)
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", markdown, flags=re.S))
    return [line.strip() for b in blocks for line in b.splitlines()] + spans


def test_every_python_command_names_the_venv():
    bare = [c for c in commands(README)
            if re.search(r"(^|[\s:])python3?\s", c) and ".venv/bin/python" not in c]
    assert bare == []


def test_the_plan_example_is_the_model_it_names():
    """§2's example plans llama2-7b at its own shape (no --model-opts reshaping another)."""
    block = README.split("## 2.", 1)[1].split("```", 2)[1]
    assert "--model llama2-7b" in block
    opts = re.search(r"--model-opts (\S+)", block).group(1)
    assert opts == "attention=cudnn"
    cfg = get_model("llama2-7b")
    assert (cfg.vocab, cfg.seq_len, cfg.depth, cfg.width, cfg.heads, cfg.kv_heads,
            cfg.mlp_hidden) == (32000, 4096, 32, 4096, 32, 32, 11008)


def test_one_size_for_the_gpu_compiler():
    texts = {p: (ROOT / p).read_text() for p in ("README.md", "Makefile", "docs/predict.md",
                                                   "docs/benchmarks.md")}
    for path, text in texts.items():
        flat = " ".join(text.split())
        sizes = set(re.findall(r"([\d.]+) GB (?:installed|of (?:CUDA )?wheels)", flat))
        assert sizes == {"4.9"}, (path, sizes)

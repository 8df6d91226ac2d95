"""What importing jaxdist sets for the whole process (jaxdist/__init__.py): the cyclic
garbage collector's youngest threshold raised to 10,000, unless the user raised it further
or disabled the collector."""

import gc
import importlib

import pytest

import jaxdist


@pytest.mark.parametrize("before,after", [
    ((700, 10, 10), (10_000, 10, 10)),      # CPython's default: raised, the others kept
    ((9_999, 3, 4), (10_000, 3, 4)),
    ((50_000, 20, 5), (50_000, 20, 5)),     # a higher one the user set: kept
    ((0, 10, 10), (0, 10, 10)),             # disabled by threshold 0: stays disabled
])
def test_importing_jaxdist_raises_the_collectors_threshold_unless_set(before, after):
    saved = gc.get_threshold()
    try:
        gc.set_threshold(*before)
        importlib.reload(jaxdist)
        assert gc.get_threshold() == after
    finally:
        gc.set_threshold(*saved)


def test_a_venv_without_the_gpu_compiler_runs_on_cpu(monkeypatch, tmp_path, capsys):
    """`make run` installs no jax[cuda12]: without the `jax_plugins` namespace package,
    find_spec of its submodule raises (it imports the parent). The check says "not
    installed" and the README's run goes on, on CPU devices."""
    import importlib.util

    from experiments.run import main
    from experiments.validation import runs_on_cpu
    from jaxdist.config import RunConfig
    from jaxdist.devices import cuda_plugin_installed

    real = importlib.util.find_spec

    def without_plugins(name, *args, **kwargs):
        if name == "jax_plugins":
            return None
        if name.startswith("jax_plugins."):
            raise ModuleNotFoundError("No module named 'jax_plugins'")
        return real(name, *args, **kwargs)
    monkeypatch.setattr(importlib.util, "find_spec", without_plugins)
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    assert not cuda_plugin_installed()
    assert runs_on_cpu(RunConfig())
    assert main(["--layout", "fsdp", "--mesh", "2x4", "--model", "mlp-tiny", "--steps", "1",
                 "--warmup", "0", "--no-progress", "--logdir", str(tmp_path / "r")]) == 0
    assert (tmp_path / "r" / "results.json").exists()

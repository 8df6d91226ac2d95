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

"""jaxdist runtime: config, devices and mesh, train step, loop, metrics, writers."""

from jaxdist.devices import decide_platform as _decide_platform

# Before anything imports jax: on a machine without an NVIDIA driver the GPU plugin (installed
# for its compiler) must not try to start, or every process prints its cuInit traceback.
_decide_platform()

"""jaxdist runtime: config, devices and mesh, train step, loop, metrics, writers."""

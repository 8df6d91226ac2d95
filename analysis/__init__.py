"""Readers of results.json: find runs, compute the published claims' ratios, plot, write the
study report (`analysis.report`) and the cross-framework comparison (`analysis.compare`).
Never imports jax (startup well under a second): runs are read through jaxdist.record."""

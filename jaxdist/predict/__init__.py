"""Predicting a step on real GPUs from the program compiled for the real mesh: by XLA:GPU for
the part's topology without a device where the GPU compiler is installed, else by XLA:CPU on
simulated CPU devices (`jaxdist.program.compiled.for_part`; `--compiler` chooses): `model` (pure
time/memory functions), `program` (compile and read the step), `pipeline` (pipeline
layouts, tick by tick from the schedule table), `plan` (the `--dry-run --hardware` plan),
`inrun` (a real run's prediction beside its measurement)."""

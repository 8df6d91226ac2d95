"""Predicting a step on real GPUs from the program compiled for the real mesh on simulated
CPU devices: `model` (pure time/memory functions), `program` (compile and read the step),
`pipeline` (pipeline layouts, tick by tick from the schedule table), `plan` (the
`--dry-run --hardware` plan), `inrun` (a real run's prediction beside its measurement)."""

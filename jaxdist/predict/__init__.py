"""Predicting a step on real GPUs from the program compiled for the real mesh on simulated
CPU devices: `model` (pure time/memory functions), `program` (compile and read the step)."""

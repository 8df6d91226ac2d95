"""A step's program: where it is compiled for and what it says.

- `compiled`: the compile targets (simulated CPU devices, a run's GPUs, a GPU topology with
  no device) and the step built for one; `gpu_targets`: how a part's XLA:GPU target
  description is written.
- `xla_compile`: the one compile call (runs, plans, PS workers and shards, the PyTorch
  reference's initial weights); nothing outside this package compiles a lowered program.
- `hlo`: the one HLO parse of a program, read by `comm` (collectives), `kernels` (the kernel
  inventory), `liveness` (XLA's buffer live ranges) and `program_reading` (a compiled step's
  figures: memory, collectives, kernels, FLOPs with loop bodies weighed).
- `xla_log`: XLA's warnings, explained.
"""

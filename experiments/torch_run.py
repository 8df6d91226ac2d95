"""Live PyTorch reference: `python -m experiments.torch_run --strategy ddp|fsdp --nproc N`.

The same model (models.torch_ref twins of models/), the same synthetic batches (the JAX model
config's `synthetic_batch` with the same seeds), the same initial weights (by default the
JAX run's, converted), the same optimizer settings, global batch, dtype, warm-up and timed
steps as `python -m experiments.run`, under PyTorch DDP or FSDP2 (`fully_shard`) with N
processes on this host: gloo on CPU, NCCL on GPUs. Writes the same results.json schema
(`framework: "pytorch"`), so `experiments.compare` can line the two up.

This process only launches: it validates, prepares the inputs (the JAX initial weights and
the synthetic batches, in one .npz), starts N ranks (`python -m experiments.torch_worker`,
the rank side), waits, and assembles results.json from what the ranks report.

Fairness rules (docs/compare.md): on CPU every rank gets `--threads` intra-op threads
(default: the cores divided by N); every step starts after a barrier (untimed) and ends
after the step's loss is all-reduced (the JAX step returns the global loss too) and, on
GPU, after torch.cuda.synchronize(); a step's time is the slowest rank's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

from experiments.torch_worker import TORCH_FP32_PRECISION
from jaxdist import procs, record, record_builder
from jaxdist.files import write_json
from jaxdist.errors import OneLineParser, UsageError, path_arg
from jaxdist.host_memory import check_processes

STRATEGIES = {
    "ddp": "DistributedDataParallel: parameters and optimizer state replicated, gradients "
           "all-reduced in buckets during backward",
    "fsdp": "FSDP2 (torch.distributed.fsdp.fully_shard) per block and at the root: "
            "parameters, gradients and optimizer state sharded on dim 0",
}
TORCH_INSTALL = "pip install -e '.[torch]' (CPU build: pip install torch==2.13.0)"


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="python -m experiments.torch_run",
        description="Train the PyTorch twin of a jaxdist model under DDP or FSDP2 with N "
                    "processes on this host, and write results.json in jaxdist's schema.")
    p.add_argument("--strategy", choices=tuple(STRATEGIES), default="ddp",
                   help="; ".join(f"{k}: {v}" for k, v in STRATEGIES.items()))
    p.add_argument("--nproc", type=int, default=2, help="processes (ranks), one device each "
                   "(default: 2)")
    p.add_argument("--model", default="gpt-tiny", help="registered model name, as for "
                   "experiments.run (default: gpt-tiny)")
    p.add_argument("--model-opts", default="", help="model size overrides, e.g. depth=4")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="compute dtype; parameters stay float32 (bfloat16: torch.autocast)")
    p.add_argument("--matmul-precision", choices=tuple(TORCH_FP32_PRECISION),
                   default="default",
                   help="float32 matmul and convolution precision, set as experiments.run's "
                   "flag of that name behaves on GPU: default and high: TF32 (torch "
                   "fp32_precision 'tf32'), highest: float32 ('ieee'). PyTorch's own default "
                   "(float32 matmuls, TF32 convolutions) matches neither (default: default)")
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                   help="adamw (optax defaults: betas 0.9/0.999, eps 1e-8, weight decay "
                   "1e-4) or sgd (momentum 0.9)")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (default: 0.001)")
    p.add_argument("--batch-size", type=int, default=64, help="global batch size, divisible "
                   "by --nproc (default: 64)")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and synthetic data")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps (default: 3)")
    p.add_argument("--steps", type=int, default=20, help="timed steps (default: 20)")
    p.add_argument("--logdir", default="", type=path_arg, help="run directory (default runs/"
                   "<strategy>-torch<N>-<model>-<time>)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: CUDA if it has N GPUs, else CPU (default: auto)")
    p.add_argument("--threads", type=int, default=0, help="CPU intra-op threads per process "
                   "(default 0: the host's cores divided by --nproc, at least 1)")
    p.add_argument("--init", choices=("jax", "torch"), default="jax",
                   help="initial weights: jax (the JAX run's with the same seed, converted; "
                   "losses then match step for step) or torch (PyTorch's own init)")
    p.add_argument("--power-sample-ms", type=int, default=50,
                   help="GPU power sampling period in ms, as experiments.run's (default: 50)")
    p.add_argument("--power-window", choices=("full", "one-step"), default="full",
                   help="energy window, as experiments.run's (default: full: every timed "
                   "step)")
    p.add_argument("--timeout-s", type=float, default=900.0, help="give up (and stop every "
                   "rank) after this long (default: 900)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="print a line now and then from rank 0")
    return p


# ---------------------------------------------------------------------------- launcher

def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_values(args)  # before torch, jax and flax: a wrong number is refused at once
        import torch  # noqa: F401
    except UsageError as e:
        print(f"torch_run: error: {e}", file=sys.stderr)
        return 2
    except ImportError:
        print(f"torch_run: error: PyTorch is not installed; install the extra: "
              f"{TORCH_INSTALL}", file=sys.stderr)
        return 2
    try:
        model_cfg, device = validate(args)
        cfg = run_config(args)
        from experiments.run import make_logdir
        run_dir = make_logdir(cfg, f"torch{args.nproc}")
        logdir = run_dir.path
    except UsageError as e:
        print(f"torch_run: error: {e}", file=sys.stderr)
        return 2
    try:
        results = launch(args, cfg, model_cfg, device, logdir)
    except BaseException as e:
        run_dir.discard()  # only what this run wrote: never a folder the user pointed at
        if isinstance(e, RankFailure):
            print(f"torch_run: error: {e}", file=sys.stderr)
            return 1
        if not isinstance(e, KeyboardInterrupt):
            raise
        print("torch_run: interrupted (SIGINT): the ranks were stopped; the PyTorch reference "
              "writes its record when its ranks finish, so none was written", file=sys.stderr)
        return 130  # launch's `finally` stopped the ranks
    from jaxdist.summary import format_summary

    print()
    print(format_summary(results))
    t = results["torch"]
    print(f"  {'pytorch':<26}  {results['env']['torch_version']}, {t['implementation']}, "
          f"{t['backend']}, {t['threads_per_process']} thread(s) per process")
    from jaxdist.writers import tensorboard_hint
    print(f"\nresults:     {logdir / 'results.json'}")
    print(tensorboard_hint(logdir))
    return 0


def check_values(args) -> None:
    """The flags' values, which need neither torch nor the models."""
    from experiments.validation import check_lr, check_seed

    for name, value in (("--steps", args.steps), ("--batch-size", args.batch_size),
                        ("--nproc", args.nproc)):
        if value < 1:
            raise UsageError(f"{name} must be a positive integer, got {value}")
    if args.warmup < 0:
        raise UsageError(f"--warmup must be 0 or more, got {args.warmup}")
    cpus = os.cpu_count() or 1
    if not 0 <= args.threads <= cpus:  # more only contend (100000 failed creating threads)
        raise UsageError(f"--threads must be 0 (automatic) to this host's {cpus} CPUs, "
                         f"got {args.threads}")
    check_lr(args.lr)
    check_seed(args.seed)
    if not (args.timeout_s > 0 and math.isfinite(args.timeout_s)):
        raise UsageError(f"--timeout-s must be a positive finite number, got {args.timeout_s}")
    power_config(args).validate()
    check_processes(args.nproc, f"--nproc {args.nproc} (a PyTorch rank each)")
    if args.batch_size % args.nproc:
        fit = (args.batch_size // args.nproc + 1) * args.nproc
        raise UsageError(f"global batch {args.batch_size} is not divisible by --nproc "
                         f"{args.nproc}; use a multiple of {args.nproc}, e.g. "
                         f"--batch-size {fit}")


def validate(args) -> tuple:
    """The checks after check_values that need no process: (model config, "cpu"/"cuda")."""
    import torch

    from models import get_model, parse_overrides, torch_ref

    model_cfg = get_model(args.model, parse_overrides(args.model_opts))
    problem = torch_ref.twin_problem(model_cfg)
    if problem:
        raise UsageError(f"model {args.model!r} ({problem}) has no PyTorch twin in "
                         f"models/torch_ref.py; twins: the mlp, resnet and gpt models")
    check_batch_pool(model_cfg, args.batch_size)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.device == "cuda" and gpus < args.nproc:
        raise UsageError(f"--device cuda with --nproc {args.nproc} needs {args.nproc} GPUs; "
                         f"{gpus} are visible")
    device = args.device if args.device != "auto" else ("cuda" if gpus >= args.nproc else "cpu")
    return model_cfg, device


def power_config(args):
    from jaxdist.telemetry import PowerConfig

    return PowerConfig(power_sample_ms=args.power_sample_ms, power_window=args.power_window)


def run_config(args):
    """The jaxdist RunConfig this run corresponds to (what results.json records as
    `config`; `compare` matches on it)."""
    from jaxdist.config import (LoopConfig, MeshConfig, ModelConfig, OutputConfig, RunConfig,
                                TrainConfig)

    return RunConfig(
        mesh=MeshConfig(mesh=str(args.nproc), platform="auto"),
        model=ModelConfig(model=args.model, model_opts=args.model_opts, dtype=args.dtype,
                          matmul_precision=args.matmul_precision),
        train=TrainConfig(layout=args.strategy, optimizer=args.optimizer, lr=args.lr,
                          batch_size=args.batch_size, seed=args.seed),
        loop=LoopConfig(warmup=args.warmup, steps=args.steps), power=power_config(args),
        output=OutputConfig(logdir=args.logdir, progress=args.progress))


class RankFailure(Exception):
    """A rank crashed or the run timed out (not bad input: exit status 1)."""


def threads_per_process(args) -> int:
    return args.threads or max(1, (os.cpu_count() or 1) // args.nproc)


def launch(args, cfg, model_cfg, device: str, logdir: Path) -> dict:
    """Inputs into a work folder, N ranks started and watched, their reports in; then
    results.json and TensorBoard events in `logdir`."""
    work = Path(tempfile.mkdtemp(prefix="torch_run-"))
    try:
        job = write_job(args, model_cfg, device, work, logdir)
        ranks = [procs.start(f"rank {r}", procs.python_argv(
                     "experiments.torch_worker", str(work / "job.json"), str(r)),
                     procs.python_env()) for r in range(args.nproc)]
        try:
            watched = procs.watch(ranks, args.timeout_s + 60)
        finally:
            procs.stop_all(ranks, grace_s=5)  # after a failure or a timeout: the rest
        if watched.failure:
            rank, code = ranks.index(watched.failure[0]), watched.failure[1]
            raise RankFailure(f"rank {rank} exited with status {code} (its traceback, if any, "
                              f"is above); the other ranks were stopped")
        if watched.timed_out:
            raise RankFailure(f"the ranks did not finish within {args.timeout_s + 60:.0f} s "
                              f"(--timeout-s); they were stopped")
        reports = [json.loads((work / f"rank{r}.json").read_text())
                   for r in range(args.nproc)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results = assemble_results(cfg, model_cfg, job, reports)
    write_outputs(cfg, logdir, results)
    return results


def jax_initial_state(model_cfg, seed: int):
    """The initial state (nnx) a JAX run with this seed starts from, built as
    jaxdist.train_step builds it: `model_cfg.build(nnx.Rngs(seed), dtype)` under one jit
    (eagerly, every initializer would compile on its own: seconds); the parameters are
    float32 whatever the compute dtype."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxdist.program.xla_compile import compile_with

    init = jax.jit(lambda: nnx.state(model_cfg.build(nnx.Rngs(seed), jnp.float32)))
    # Optimisation level 0: the init runs once, so compile time is what counts (resnet50:
    # ~10 s instead of ~40 s); the random bits are the same.
    compiled = compile_with(init.lower(), {"xla_backend_optimization_level": 0,
                                           "xla_llvm_disable_expensive_passes": True})
    return compiled()


def check_batch_pool(model_cfg, batch_size: int) -> None:
    """The launcher builds the JAX run's pool of global batches (write_job) before any rank
    starts: beyond the host's memory it is one line (a batch of 10^10 was numpy's
    MemoryError traceback). A floor: the ranks' copies come on top."""
    from jaxdist import host_memory
    from jaxdist.data import NUM_SYNTHETIC_BATCHES
    from jaxdist.program.compiled import batch_bytes

    host_memory.check(NUM_SYNTHETIC_BATCHES * batch_bytes(model_cfg, batch_size),
                      f"pool of {NUM_SYNTHETIC_BATCHES} global batches the ranks train on")


def write_job(args, model_cfg, device: str, work: Path, logdir: Path) -> dict:
    """work/inputs.npz (the very batches the JAX run trains on, and with --init jax its
    initial weights) and work/job.json (what every rank needs); returns the job. Ranks
    write their power CSVs into logdir/rank<r>/power."""
    from jaxdist.data import NUM_SYNTHETIC_BATCHES, TrainStream
    from models import torch_ref

    inputs = {}
    stream = TrainStream(model_cfg, None, args.batch_size, args.seed)
    for i in range(NUM_SYNTHETIC_BATCHES):
        for key, value in stream.batch(i).items():
            inputs[f"batch{i}/{key}"] = value
    if args.init == "jax":
        initial = torch_ref.state_from_nnx(jax_initial_state(model_cfg, args.seed))
        for key, value in initial.items():
            inputs[f"init/{key}"] = value
    np.savez(work / "inputs.npz", **inputs)
    job = {
        "spec": torch_ref.arch_spec(model_cfg), "strategy": args.strategy,
        "world": args.nproc, "device": device,
        "port": procs.free_ports("127.0.0.1", 1)[0], "threads": threads_per_process(args),
        "dtype": args.dtype, "matmul_precision": args.matmul_precision,
        "optimizer": args.optimizer, "lr": args.lr,
        "batch_size": args.batch_size, "seed": args.seed, "warmup": args.warmup,
        "steps": args.steps, "num_batches": NUM_SYNTHETIC_BATCHES, "init": args.init,
        "work": str(work), "timeout_s": args.timeout_s, "progress": args.progress,
        "logdir": str(logdir), "tokens_per_sample": model_cfg.tokens_per_sample,
        "power": dataclasses.asdict(power_config(args)),
    }
    write_json(work / "job.json", job)
    return job


def assemble_results(cfg, model_cfg, job: dict, reports: list[dict]) -> dict:
    from jaxdist import metrics
    from jaxdist.telemetry.combine import combine

    world, warmup = job["world"], job["warmup"]
    # A step takes as long as its slowest rank (every rank started it after a barrier).
    step_s = np.max(np.array([r["step_s"] for r in reports]), axis=0).tolist()
    steps = metrics.step_time_block(step_s[warmup:])
    first = reports[0]
    device_kind = first["device_kind"]
    by_device = [{"device": r["rank"], "process": r["rank"], "bytes": r["state_bytes"]}
                 for r in reports]
    cuda = job["device"] == "cuda"
    threads = sorted({r["threads"] for r in reports})
    mesh = {"data": world, "fsdp": 1} if job["strategy"] == "ddp" else {"data": 1, "fsdp": world}
    return record_builder.build(
        "pytorch", job["strategy"], mesh, cfg.to_dict(), model_cfg, first["params"],
        env={"jax_version": first["torch_version"], "torch_version": first["torch_version"],
             "backend": job["device"], "device_kind": device_kind, "num_devices": world,
             "num_processes": world, "simulated": False,
             "threads_per_process": threads[0] if len(threads) == 1 else threads,
             "host_cpus": os.cpu_count()},
        compile_s=None,  # not measured: there is no compilation step to time
        step_time_s=steps, warmup_step_time_s=step_s[:warmup],
        throughput=record_builder.throughput_block(job["batch_size"], model_cfg.tokens_per_sample,
                                           steps["mean"]),
        mfu=metrics.mfu(device_kind, job["dtype"], world, steps["mean"], None,
                        model_cfg.flops_per_sample() * job["batch_size"],
                        matmul_precision=job["matmul_precision"]),
        memory=dict(
            record_builder.memory_block(
                by_device, None, max(r["peak_bytes"] for r in reports) if cuda else None,
                None if cuda else "torch on CPU has no allocator peak counter (process RSS is "
                "in memory.process_peak_rss_bytes, not comparable to a device peak)"),
            measured_peak_definition="torch.cuda.max_memory_allocated over the whole run, "
                                     "max over ranks" if cuda else None,
            compiled_reason="eager PyTorch: no compiled program, so no compiler bound",
            reserved_peak_bytes=max(r["reserved_bytes"] for r in reports) if cuda else None,
            process_peak_rss_bytes=[r["max_rss_bytes"] for r in reports]),
        sharding=first["sharding"], loss=first["loss"],
        comm=None,  # the summary says why instead of a bare n/a
        # each rank sampled its own GPU (jaxdist.telemetry, as a mesh run): added up
        power=combine({r["rank"]: r["power"] for r in reports}, who="rank"),
        window={"start_unix_s": min(r["window"][0] for r in reports),
                "end_unix_s": max(r["window"][1] for r in reports)},
        compile_note="eager PyTorch: nothing is compiled; one-off costs (lazy optimizer "
                     "state, FSDP lazy init) fall in the warm-up steps",
        step_time_by_rank_s=[r["step_s"][warmup:] for r in reports],
        comm_reason="not read for PyTorch: its collectives (gloo/NCCL, eager) are not "
                    "analysed as a compiled XLA program's are",
        torch={"strategy": job["strategy"], "implementation": first["implementation"],
               "backend": first["backend"], "threads_per_process": job["threads"],
               "init": job["init"], "optimizer_impl": first["optimizer_impl"],
               "fp32_precision": first["fp32_precision"],
               "autocast": job["dtype"] if job["dtype"] != "float32" else None,
               "sync": "barrier before each step (untimed); the step ends after the loss "
                       "all-reduce" + (" and torch.cuda.synchronize()" if cuda else ""),
               "step_time_rule": "max over ranks per step"})


def write_outputs(cfg, logdir: Path, results: dict) -> None:
    from jaxdist.telemetry import outputs
    from jaxdist.writers import RunWriter

    problems = record.check(results)
    if problems:  # a bug here, not bad input
        raise AssertionError(f"results.json does not match the schema: {problems}")
    # every step's time, warm-up included: the slowest rank's
    steps_s = (results["warmup_step_time_s"]
               + np.array(results["step_time_by_rank_s"]).max(axis=0).tolist())
    writer = RunWriter(logdir, cfg.to_dict())
    try:
        warm = len(results["warmup_step_time_s"])
        for i, (loss, step_s) in enumerate(zip(results["loss"], steps_s)):
            writer.step(i, loss, step_s, i >= warm)
        writer.summary(results)  # also writes results.json
        outputs.write_summary(writer.tb, results["power"])  # the ranks' series: rank<r>/
    finally:
        writer.close()


if __name__ == "__main__":
    sys.exit(main())

"""One validation pass over a run's config: every check that needs no device, in one place,
before a run directory, a process or a backend exists. `validate(cfg)` raises the first
problem as a one-line UsageError (later checks read what earlier ones parsed, so there is
one to report) and returns the resolved job (jaxdist/job.py: its kind, the layout's facts,
the model config, the parsed mesh, the part) with the notices (flags that do nothing here,
experiments/notices.py) for the caller to print once it has a place to write.

Cheapest first: the flags' values need nothing but the config, so a bad value is refused
before jax is imported; the layout then needs the layout registry (jax), the model its
config (flax), the parameter server its shard map and a --checkpoint-dir Orbax. The checks that are facts of a domain stay there and are
called from here: a layout's mesh (sharding.check_layout), a pipeline's schedule and depth
(jaxdist.pipeline.checks), a model's own fields (its config's `validate`), a GPU part
(jaxdist.hardware).
"""

from __future__ import annotations

import dataclasses
import math
import os

from jaxdist import job
from jaxdist.config import RunConfig, parse_profile_steps, parse_stage_blocks
from jaxdist.errors import UsageError
from jaxdist.mesh import MeshShape, parse_mesh


def validate(cfg: RunConfig) -> job.Job:
    """Every check of `cfg` for `experiments.run` and `experiments.plan` (a mesh run, a plan
    or the parameter server); the job they resolve (jaxdist.job.resolve: the one model
    build, layout lookup and mesh parse of the run)."""
    check_values(cfg)
    part = None
    if cfg.output.hardware:  # a named part (jaxdist.parts): no jax
        from jaxdist.hardware import get_hardware
        part = get_hardware(cfg.output.hardware, cfg.output.gpus_per_node)
    check_power_settings(cfg, part)  # before jax: a limit or clock the part lacks
    shape = parse_mesh(cfg.mesh.mesh)
    if shape.size is None and cfg.output.dry_run:
        raise UsageError("--dry-run needs an explicit mesh (e.g. --mesh 4x8), not -1")
    kind = job.kind_of(cfg)  # the layout registry (jax): a misspelled --layout stops here
    # a PS run resumes from its shards' snapshots in --logdir (ps.resume)
    if cfg.checkpoint.resume and not cfg.checkpoint.checkpoint_dir and kind != job.PS:
        raise UsageError("--resume and --checkpoint-every need --checkpoint-dir DIR")
    if shape.size is None and kind == job.PS:
        raise UsageError("--layout ps needs an explicit mesh WORKERSxDEVICES (e.g. 4x1)")
    resolved = check_layout_and_model(cfg, kind, shape, part)
    # After the layout: a pipeline layout's decoders evaluate on no dataset (its own error)
    if cfg.data.eval_every and cfg.data.dataset == "synthetic":
        raise UsageError("--eval-every needs a real dataset: add --dataset digits")
    if kind == job.PLAN and part is not None:  # the step is compiled for that cluster
        from jaxdist.hardware import check_nodes
        from jaxdist.program.compiled import check_cpu_limit, xla_options
        check_batch(cfg, shape)
        check_nodes(part, shape.size)
        check_fp8_rate(cfg, part)
        check_cpu_limit(cfg.output.hardware, shape.size, cfg.compiler.compiler)
        xla_options(cfg.compiler.xla_flags)  # --name=value each, before any compile
    elif kind != job.PLAN and shape.size is not None:  # -1: checked once devices are
        check_batch(cfg, shape)
    if kind == job.PS:
        check_ps(resolved)
    elif kind == job.MESH and cfg.compiler.xla_flags.strip():
        from jaxdist.devices import check_xla_flags
        check_xla_flags(cfg.compiler.xla_flags.strip())
    check_checkpoint_dir(cfg, kind)
    from experiments.notices import disk_notices, notices
    return dataclasses.replace(resolved, notices=tuple(notices(cfg) + disk_notices(cfg)))


def check_power_settings(cfg: RunConfig, part) -> None:
    """--power-limit and --sm-clock: a plan on a part with a power record, a limit in the
    part's range and a clock it has (jaxdist.predict.power.check_settings)."""
    out = cfg.output
    if not out.power_limit and not out.sm_clock:
        return
    flag = "--power-limit" if out.power_limit else "--sm-clock"
    if not out.dry_run or part is None:
        raise UsageError(f"{flag} applies to a plan on a part (--dry-run --hardware NAME); a "
                         f"run does not set it")
    from jaxdist.predict.power import check_settings, parse_limits
    limits = parse_limits(out.power_limit) if out.power_limit else [None]
    if out.sm_clock < 0:
        raise UsageError(f"--sm-clock must be a clock in MHz (0: the part's maximum), got "
                         f"{out.sm_clock}")
    for limit in limits:
        check_settings(part.power, part.name, limit, out.sm_clock or None)


def check_fp8_rate(cfg: RunConfig, part) -> None:
    """A --dtype float8 plan times its FP8 GEMMs at the part's FP8 peak: a part with none
    (no FP8 tensor cores, or none tabled in jaxdist.parts) cannot be planned in FP8."""
    from jaxdist.parts import NAMED, PREDICTABLE
    if cfg.model.dtype != "float8":
        return
    if part.fp8_peak_flops() is None:
        fp8 = [n for n in PREDICTABLE if NAMED[n].fp8_peak_flops()]
        raise UsageError(f"--dtype float8: {cfg.output.hardware} has no FP8 rate (no FP8 "
                         f"tensor cores); plan it in --dtype bfloat16, "
                         f"or FP8 on {', '.join(fp8)}")


def check_values(cfg: RunConfig) -> None:
    """What the flags' values alone say (no model, mesh or layout read)."""
    if cfg.data.eval_every < 0:
        raise UsageError(f"--eval-every must be 0 or more, got {cfg.data.eval_every}")
    for name, value in (("--steps", cfg.loop.steps), ("--batch-size", cfg.train.batch_size)):
        if value < 1:
            raise UsageError(f"{name} must be a positive integer, got {value}")
    if cfg.train.microbatches < 1:
        raise UsageError(f"--microbatches must be a positive integer, got "
                         f"{cfg.train.microbatches}")
    if cfg.loop.warmup < 0:
        raise UsageError(f"--warmup must be 0 or more, got {cfg.loop.warmup}")
    ck = cfg.checkpoint
    if ck.checkpoint_every < 0:
        raise UsageError(f"--checkpoint-every must be 0 or more, got {ck.checkpoint_every}")
    if ck.checkpoint_every and not ck.checkpoint_dir:
        raise UsageError("--resume and --checkpoint-every need --checkpoint-dir DIR")
    cfg.power.validate()
    profile = parse_profile_steps(cfg.output.profile_steps)
    if profile and profile[1] >= cfg.loop.warmup + cfg.loop.steps:
        raise UsageError(f"--profile-steps {cfg.output.profile_steps}: the run has steps 0.."
                         f"{cfg.loop.warmup + cfg.loop.steps - 1}")
    check_lr(cfg.train.lr)
    check_seed(cfg.train.seed)
    parse_stage_blocks(cfg.train.pp_stage_blocks)
    if cfg.dist.init_timeout < 1:
        raise UsageError(f"--init-timeout must be 1 or more seconds, got "
                         f"{cfg.dist.init_timeout}")


def check_lr(lr: float) -> None:
    """Also experiments.torch_run's: an infinite rate trains to nan from the first update."""
    if not (lr > 0 and math.isfinite(lr)):
        raise UsageError(f"--lr must be a positive finite number, got {lr}")


SEED_LIMIT = 2 ** 32  # jax.random.key keeps a seed's low 32 bits: 2**32 would be seed 0


def check_seed(seed: int) -> None:
    """Also experiments.torch_run's: numpy refuses negative seeds with a traceback, and JAX
    keeps only 32 bits, so 2**32 and up would silently repeat a smaller seed's run."""
    if not 0 <= seed < SEED_LIMIT:
        raise UsageError(f"--seed must be within 0..{SEED_LIMIT - 1}, got {seed}")


def check_layout_and_model(cfg: RunConfig, kind: str, shape: MeshShape, part) -> job.Job:
    """The layout against the mesh and the model; the job they resolve (its layout rules
    and model config)."""
    from sharding import check_layout
    resolved = job.resolve(cfg, kind, shape, part)
    model_cfg = resolved.model
    if cfg.train.grad_reduce_dtype != "float32" and \
            not resolved.rules.master_weights(cfg.model.dtype):
        raise UsageError(f"--grad-reduce-dtype {cfg.train.grad_reduce_dtype} reduces the "
                         f"gradients of bfloat16 working weights beside a float32 master: it "
                         f"needs --distributed-optimizer and --dtype bfloat16 or float8")
    from jaxdist.pipeline.checks import check_pipeline
    from sharding.pipeline import PIPELINE_LAYOUTS

    pipelined = resolved.layout.pipelined
    if cfg.train.pp_stage_blocks and not pipelined:
        raise UsageError(f"--pp-stage-blocks splits the blocks over pipeline stages; layout "
                         f"{cfg.train.layout!r} has none (use one of "
                         f"{', '.join(PIPELINE_LAYOUTS)})")
    if (pipelined and shape.stage == 1 and shape.size
            and model_cfg.family in ("gpt", "moe")):  # other families: check_layout says so
        raise UsageError(f"layout {cfg.train.layout!r} splits over the stage axis, which "
                         f"this mesh does not have (the short form puts stage fifth: "
                         f"DATAxFSDPxTENSORxEXPERTxSTAGE); e.g. --mesh "
                         f"{stage_example(cfg.train.layout, shape)}")
    check_layout(cfg.train.layout, shape.axis_sizes, model_cfg.family,
                 cfg.train.distributed_optimizer)
    from jaxdist.host_memory import check_model_size
    check_model_size(cfg.model.model, cfg.model.dtype, model_cfg, cfg.output.dry_run,
                     runs_on_cpu(cfg))
    if pipelined:  # depth vs stages x chunks, schedule vs M
        check_pipeline(model_cfg, shape.stage, cfg.train.pp_schedule, cfg.train.microbatches,
                       cfg.train.pp_virtual, cfg.data.eval_every, shape.data,
                       parse_stage_blocks(cfg.train.pp_stage_blocks), shape.context,
                       cfg.train.pp_combined_1f1b)
    return resolved


def runs_on_cpu(cfg: RunConfig) -> bool:
    """A mesh run's devices are this host's CPU (forced, or no GPU plugin installed)."""
    from jaxdist.devices import cuda_plugin_installed

    return cfg.mesh.platform == "cpu" or os.environ.get("JAX_PLATFORMS", "") == "cpu" or \
        not cuda_plugin_installed()


def stage_example(layout: str, shape: MeshShape) -> str:
    """A mesh with a stage axis on the same devices for a pipeline layout: the layout's own
    inner axis (tp_pp: tensor, fsdp_pp: fsdp) kept, 2 stages (or all) from the rest."""
    from sharding.registry import facts
    inner = next((a for a in facts(layout).mesh_axes if a not in ("data", "stage")), None)
    kept = getattr(shape, inner) if inner else 1
    rest = shape.size // kept
    if rest == 1 and kept % 2 == 0:  # every device on the inner axis: give half to stage
        kept, rest = kept // 2, 2
    stages = 2 if rest % 2 == 0 or rest == 1 else rest
    rest = max(rest, stages)
    sizes = {"data": rest // stages, "stage": stages, **({inner: kept} if kept > 1 else {})}
    return ",".join(f"{a}:{n}" for a, n in sizes.items())


def check_batch(cfg: RunConfig, shape: MeshShape) -> None:
    """The batch is split over every device but the tensor, stage and context axes, then
    into micro-batches.
    Also run once devices are known, for a mesh of -1."""
    b, m = cfg.train.batch_size, cfg.train.microbatches
    num_devices = shape.size // shape.tensor // shape.stage // shape.context
    mesh_label = shape.label
    if m < 1:
        raise UsageError(f"--microbatches must be a positive integer, got {m}")
    unit = num_devices * m
    if b % unit:
        below, above = b // unit * unit, (b // unit + 1) * unit
        nearest = f"{below} or {above}" if below else f"{above}"
        what = (f"the {num_devices} batch shards of mesh {mesh_label}" if m == 1 else
                f"{num_devices} batch shards x {m} micro-batches")
        raise UsageError(f"global batch {b} is not divisible by {what}; use a multiple of "
                         f"{unit}, e.g. --batch-size {nearest}")


def check_checkpoint_dir(cfg: RunConfig, kind: str) -> None:
    """--checkpoint-dir: a writable folder, empty unless --resume continues its checkpoints
    (jaxdist/checkpoint.py). Only a mesh run writes any: a plan writes none, and the
    parameter server refuses the flag."""
    if cfg.checkpoint.checkpoint_dir and kind == job.MESH:
        from jaxdist.checkpoint import check_directory, identity
        check_directory(cfg.checkpoint.checkpoint_dir, cfg.checkpoint.resume,
                        identity(cfg.model, cfg.data.dataset, cfg.train.optimizer))


def check_ps(resolved: job.Job) -> None:
    """--layout ps: its options, the flags it does not support, its address and ports and
    its shard map (no process started; ps.server, which forces JAX_PLATFORMS=cpu on import,
    is not imported)."""
    cfg = resolved.cfg
    from jaxdist import procs
    from ps.security import TOKEN_ENV, run_token, security_problems
    from ps.shardmap import shard_map_for

    ps = cfg.ps
    if ps.ps_shards < 1:
        raise UsageError(f"--ps-shards must be 1 or more, got {ps.ps_shards}")
    if ps.staleness < 0:
        raise UsageError(f"--staleness must be 0 or more, got {ps.staleness}")
    if not (ps.ps_timeout_s > 0 and math.isfinite(ps.ps_timeout_s)):
        raise UsageError(f"--ps-timeout-s must be a positive finite number, got "
                         f"{ps.ps_timeout_s}")
    if not (ps.ps_clip_norm >= 0 and math.isfinite(ps.ps_clip_norm)):
        raise UsageError(f"--ps-clip-norm must be 0 (off) or a positive finite norm, got "
                         f"{ps.ps_clip_norm}")
    if ps.ps_checkpoint_every < 0:
        raise UsageError(f"--ps-checkpoint-every must be 0 or more, got "
                         f"{ps.ps_checkpoint_every}")
    if not 1 <= ps.ps_max_message_mb <= 2047:
        raise UsageError(f"--ps-max-message-mb must be within 1..2047 (gRPC's limit is a "
                         f"32-bit size), got {ps.ps_max_message_mb}")
    unsupported = [(cfg.train.microbatches > 1, "--microbatches"),
                   (bool(cfg.checkpoint.checkpoint_dir), "--checkpoint-dir (use "
                                                         "--ps-checkpoint-every)"),
                   (cfg.dist.num_processes > 1, "--num-processes (the launcher starts "
                                                "one process per worker and shard)"),
                   (bool(cfg.output.profile_steps), "--profile-steps")]
    for bad, flag in unsupported:
        if bad:
            raise UsageError(f"--layout ps does not support {flag}")
    if ps.ps_staleness_lr and ps.ps_mode == "sync":
        raise UsageError("--ps-staleness-lr applies to --ps-mode async or ssp; in sync mode "
                         "every update has staleness 0")
    run_token(os.environ, ps.ps_insecure)  # --ps-insecure against a given token
    # beyond this host only with a token the user gives (and gives the other hosts)
    problem = security_problems(ps.ps_bind, os.environ.get(TOKEN_ENV), ps.ps_tls_cert,
                                ps.ps_tls_key)
    if problem:
        raise UsageError(problem)
    if not procs.port_free(ps.ps_bind, 0):
        raise UsageError(f"--ps-bind {ps.ps_bind} is not an address of this host")
    base = getattr(ps, "ps_port", 0)  # optional field: fixed ports base, base+1, ...
    if base and not 1024 <= base <= 65536 - ps.ps_shards:
        raise UsageError(f"--ps-port {base} with {ps.ps_shards} shard(s) needs ports "
                         f"{base}..{base + ps.ps_shards - 1}; give a base within 1024.."
                         f"{65536 - ps.ps_shards} (ports below 1024 need root), or 0 for "
                         f"free ports")
    if base:
        busy = [base + k for k in range(ps.ps_shards) if not procs.port_free(ps.ps_bind,
                                                                              base + k)]
        if busy:
            raise UsageError(f"port(s) {', '.join(map(str, busy))} on {ps.ps_bind} are in "
                             f"use; choose another --ps-port or 0 for free ports")
    shard_map_for(resolved)  # too many shards, non-float32 parameters
    if cfg.checkpoint.resume:  # snapshots of this job to continue from (ps.resume)
        from ps.resume import plan
        plan(resolved)


def check_ps_host(resolved: job.Job) -> None:
    """What this host can hold of a PS job, before its processes start (this host's, so not
    among the run's own checks, which a suite's preflight reads on another host): the
    processes, and their buffers, a floor (the runtimes not counted): each worker builds the
    global batch pool (it slices its own rows from it) and holds the parameters three times
    on the host (the flat vector, two gradient buffers); the shards hold them once more. A
    batch of 10^10 failed in a worker after the job had started."""
    from jaxdist import host_memory
    from jaxdist.data import NUM_SYNTHETIC_BATCHES
    from jaxdist.program.compiled import batch_bytes
    from ps.shardmap import shard_map_for

    ps, workers = resolved.ps, resolved.shape.data
    host_memory.check_processes(workers + ps.ps_shards,
                                f"--layout ps --mesh {resolved.cfg.mesh.mesh} --ps-shards "
                                f"{ps.ps_shards} ({workers} workers and {ps.ps_shards} shard "
                                f"servers on this host)")
    params = shard_map_for(resolved).total * 4
    batch = batch_bytes(resolved.model, resolved.train.batch_size)
    pool = NUM_SYNTHETIC_BATCHES if resolved.dataset is None else 1
    host_memory.check(workers * (pool * batch + 3 * params) + params,
                      f"PS job's buffers ({workers} workers, each with {pool} global "
                      f"batch(es) and 3 copies of the parameters; the shards' copy)")

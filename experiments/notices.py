"""Flags that do nothing for the chosen layout or mode are named, one line each, never
ignored in silence.

The rules are a table: which flags (config field names), and the condition under which they
take effect. A flag counts as given when its value differs from the field's default (the
parser cannot tell `--ps-shards 2` from nothing, and a default changes nothing either way).
A flag is named by the first rule that finds it idle, so `--staleness 4` without `--layout
ps` is "applies only to --layout ps", not also "only to --ps-mode ssp".
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from jaxdist.config import PSConfig, RunConfig
from jaxdist.telemetry import PowerConfig

Predicate = Callable[[RunConfig], bool]


@dataclass(frozen=True)
class Rule:
    fields: tuple[str, ...]   # config field names (`ps_shards` is the flag --ps-shards)
    applies: Predicate         # True: the flags take effect in this configuration
    only: str                  # "applies only to <only>"
    given: Predicate | None = None  # overrides "differs from its default" (see checkpoint)
    text: str = ""             # the whole notice, where "applies only to" does not fit


_PS = tuple(f.name for f in dataclasses.fields(PSConfig))
_POWER = tuple(f.name for f in dataclasses.fields(PowerConfig))
# What --dry-run reads: the model (size, dataset, dtype), the layout, the mesh and the
# optimizer's kind. Values, training, timing, checkpoint, compiler and process flags do
# nothing there (it always runs on the host CPU).
_NOT_IN_DRY_RUN = ("steps", "warmup", "batch_size", "microbatches", "eval_every",
                   "checkpoint_dir", "checkpoint_every", "resume", "profile_steps",
                   "xla_flags", "overlap", "coordinator", "num_processes", "process_id",
                   "init_timeout", "matmul_precision", "seed", "lr", "platform") + _POWER


def _ps(cfg: RunConfig) -> bool:
    """The layout runs out of process (the parameter server): the layout registry's fact."""
    return _facts(cfg).out_of_process


def _pipelined(c: RunConfig) -> bool:
    return _facts(c).pipelined


def _facts(cfg: RunConfig):
    from sharding.registry import facts  # the layout registry's (imports jax)

    return facts(cfg.train.layout)


_DRY_RUN_ONLY = "a training run, not --dry-run (which plans memory from shapes only)"

RULES: tuple[Rule, ...] = (
    # A pipeline layout's plan counts activations per stage, and --hardware compiles the
    # step: the batch and M matter there.
    Rule(_NOT_IN_DRY_RUN, lambda c: not c.output.dry_run or _pipelined(c) or
         bool(c.output.hardware), _DRY_RUN_ONLY),
    Rule(tuple(f for f in _NOT_IN_DRY_RUN if f not in ("batch_size", "microbatches",
                                                       "overlap", "matmul_precision",
                                                       "xla_flags")),
         lambda c: not c.output.dry_run, _DRY_RUN_ONLY),
    # --hardware predicts the GPU step: its overlap policy, matmul precision and XLA flags
    # (handed to each compile of the plan: jaxdist.program.compiled.compile_options) matter.
    Rule(("overlap", "matmul_precision", "xla_flags"),
         lambda c: not c.output.dry_run or bool(c.output.hardware), _DRY_RUN_ONLY),
    Rule(("gpus_per_node",), lambda c: bool(c.output.hardware), "--hardware"),
    Rule(("pp_runtime",), lambda c: bool(c.output.hardware) and _pipelined(c),
         "--hardware on the pipeline layouts (pp, tp_pp, fsdp_pp)"),
    Rule(("pp_schedule", "pp_virtual"), lambda c: _pipelined(c),
         "the pipeline layouts (pp, tp_pp, fsdp_pp)"),
    Rule(("pp_combined_1f1b",), lambda c: _pipelined(c),
         "the pipeline layouts (pp, tp_pp, fsdp_pp)"),
    Rule(("pp_virtual",), lambda c: c.train.pp_schedule == "interleaved",
         "--pp-schedule interleaved"),
    Rule(("tp_comm_chunks", "tp_comm_split"), lambda c: c.train.sequence_parallel, "--sequence-parallel"),
    Rule(_PS, _ps, "--layout ps"),
    Rule(("staleness",), lambda c: c.ps.ps_mode == "ssp", "--ps-mode ssp"),
    Rule(("ps_drop_dead_workers",), lambda c: c.ps.ps_mode == "sync",
         "--ps-mode sync (async and ssp go on without a dead worker anyway)"),
    # The ps launcher starts every server and worker process itself, on the host's XLA_FLAGS.
    Rule(("xla_flags", "overlap", "coordinator", "process_id", "init_timeout"),
         lambda c: not _ps(c), "mesh layouts (--layout ps starts its own processes)"),
    Rule(_POWER, lambda c: not _ps(c), "mesh layouts (--layout ps records no power yet)"),
    Rule(("data_dir",), lambda c: c.data.dataset in ("cifar10", "mnist"),
         "--dataset cifar10 or mnist"),
    Rule(("matmul_precision",), lambda c: c.model.dtype == "float32", "--dtype float32"),
    Rule(("fp8_scaling",), lambda c: c.model.dtype == "float8", "--dtype float8"),
    # --checkpoint-every 0 is also the default, so "given" is the directory without a plan.
    Rule(("checkpoint_every",),
         lambda c: c.checkpoint.checkpoint_every > 0 or c.checkpoint.resume, "",
         given=lambda c: bool(c.checkpoint.checkpoint_dir) and not c.output.dry_run,
         text="--checkpoint-every 0: no checkpoint is saved in --checkpoint-dir unless the "
              "run is interrupted; add --checkpoint-every N to save every N steps"),
)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _differs_from_default(cfg: RunConfig) -> set[str]:
    given = set()
    for section in dataclasses.fields(cfg):
        part = getattr(cfg, section.name)
        given |= {f.name for f in dataclasses.fields(part)
                  if getattr(part, f.name) != f.default}
    return given


def notices(cfg: RunConfig) -> list[str]:
    """One line per rule that finds given flags idle in `cfg`, in table order."""
    given, named, lines = _differs_from_default(cfg), set(), []
    for rule in RULES:
        if rule.given is not None:
            idle = [f for f in rule.fields if f not in named and rule.given(cfg)]
        else:
            idle = [f for f in rule.fields if f in given and f not in named]
        if not idle or rule.applies(cfg):
            continue
        named |= set(idle)
        if rule.text:
            lines.append(f"notice: {rule.text}")
        else:
            verb = "applies" if len(idle) == 1 else "apply"
            lines.append(f"notice: {', '.join(map(_flag, idle))} {verb} only to {rule.only}; "
                         f"ignored")
    return lines


def disk_notices(cfg: RunConfig) -> list[str]:
    """What the folders named on the command line hold, where it changes what the run does
    without a word otherwise: --resume with nothing to resume (an empty --checkpoint-dir:
    the run starts at step 0; one that does not exist is refused by the validation) and a
    --logdir that already holds other
    files (this run writes beside them). Read once the input is known to be valid."""
    lines = []
    ck = cfg.checkpoint
    if ck.resume and ck.checkpoint_dir and not cfg.output.dry_run and not _ps(cfg):
        folder = Path(ck.checkpoint_dir)
        if folder.is_dir() and not _checkpoint_steps(folder):
            what = "holds no checkpoint"
            saves = ("" if ck.checkpoint_every else
                     "; it saves one there only if interrupted (add --checkpoint-every N to "
                     "save every N steps)")
            lines.append(f"notice: --resume: --checkpoint-dir {folder} {what}, so there is "
                         f"nothing to resume: this run starts at step 0{saves}")
    if cfg.output.logdir:
        folder = Path(cfg.output.logdir)
        try:
            entries = sorted(os.listdir(folder)) if folder.is_dir() else []
        except OSError:
            entries = []
        # results.json there: the interrupted run this --resume continues (make_logdir
        # refuses any other).
        if entries and "results.json" not in entries:
            shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
            events = any(e.startswith("events.out.tfevents") for e in entries)
            lines.append(f"notice: --logdir {folder} already holds other files ({shown}); "
                         f"this run writes its own beside them" +
                         ("; TensorBoard will show the event files there as part of this "
                          "run" if events else ""))
    return lines


def _checkpoint_steps(folder: Path) -> list[str]:
    """Orbax's step folders (`12`), complete or not (`12.orbax-checkpoint-tmp-...`)."""
    try:
        return [p for p in os.listdir(folder) if p.split(".")[0].isdigit()]
    except OSError:
        return []

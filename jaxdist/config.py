"""Run configuration: one frozen dataclass per concern; the command line is a view of them.

Each field's metadata carries its help text (and choices where fixed), so `experiments.run`
builds its parser from these classes and `results.json` records `RunConfig.to_dict()`,
which is everything needed to rerun.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from jaxdist.data import DATASETS
from jaxdist.errors import UsageError, path_arg
from jaxdist.parts import PREDICTABLE
from jaxdist.telemetry import PowerConfig


def _opt(default, help, **extra):
    return field(default=default, metadata={"help": help, **extra})


@dataclass(frozen=True)
class MeshConfig:
    mesh: str = _opt("4x8", "device mesh: DATAxFSDP[xTENSOR[xEXPERT[xSTAGE]]] (4x8, 2x2x2), "
                     "axis:size pairs (data:1,fsdp:4,tensor:8; pipelines: data:2,stage:4; "
                     "context parallelism: data:2,context:2), "
                     "N (data N) or -1 (every device on data)")
    platform: str = _opt("auto", "auto: use GPUs if present, else simulate the mesh on host "
                         "CPU devices; cpu: always simulate", choices=("auto", "cpu"))


@dataclass(frozen=True)
class CompilerConfig:
    overlap: bool = _opt(False, "overlap communication with compute on GPU: XLA's latency-"
                         "hiding scheduler and async collectives (no effect on CPU)")
    xla_flags: str = _opt("", "extra XLA flags, appended to XLA_FLAGS before JAX starts")
    compiler: str = _opt("auto", "which XLA compiles a --hardware prediction: gpu (XLA:GPU for "
                         "the part's topology, no GPU needed; `make gpu-compiler`), cpu "
                         "(XLA:CPU on simulated devices), auto (gpu when installed)",
                         choices=("auto", "gpu", "cpu"))


@dataclass(frozen=True)
class DistConfig:
    """Multi-process (multi-host) runs on jax.distributed. Unset: flags, then the
    JAXDIST_COORDINATOR / JAXDIST_NUM_PROCESSES / JAXDIST_PROCESS_ID environment, then
    cluster auto-detection (SLURM, Open MPI, Kubernetes), else one process."""
    coordinator: str = _opt("", "HOST:PORT of process 0 (PORT+1 is used for the join check)")
    num_processes: int = _opt(0, "number of processes (one per host)")
    process_id: int = _opt(-1, "this process's index, 0..N-1")
    init_timeout: int = _opt(60, "seconds to wait for every process to join")


@dataclass(frozen=True)
class ModelConfig:
    model: str = _opt("gpt-tiny", "registered model name")
    model_opts: str = _opt("", "overrides of the model's size, e.g. depth=4,width=128")
    dtype: str = _opt("float32", "compute dtype (parameters stay float32; with "
                      "--distributed-optimizer, bfloat16 working weights beside a sharded "
                      "float32 master copy, as Megatron). float8: the decoders' block "
                      "matmuls in FP8 (e4m3 operands, e5m2 gradients, Transformer Engine's "
                      "hybrid format), bfloat16 elsewhere, the LM head included",
                      choices=("float32", "bfloat16", "float8"))
    fp8_scaling: str = _opt("delayed", "with --dtype float8: how each FP8 tensor's scale is "
                            "chosen. delayed: from the largest amax of its last 1024 steps "
                            "(Transformer Engine's default; the histories are train state); "
                            "current: from its own amax each step (FP8-CS)",
                            choices=("delayed", "current"))
    matmul_precision: str = _opt(
        "default", "precision of float32 matmuls and convolutions (no effect with --dtype "
        "bfloat16). default: each backend's default: TF32 on Ampere and newer GPUs, float32 "
        "on CPU; high: JAX's HIGH, which XLA:GPU also runs as TF32; highest: true float32 "
        "(JAX's HIGHEST). PyTorch's own default is float32 matmuls ('highest') but TF32 "
        "convolutions; experiments.torch_run sets both to match this flag (docs/compare.md)",
        choices=("default", "high", "highest"))


@dataclass(frozen=True)
class TrainConfig:
    layout: str = _opt("fsdp", "how state is laid out over the mesh")
    optimizer: str = _opt("adamw", "optax optimizer", choices=("adamw", "sgd"))
    lr: float = _opt(1e-3, "learning rate")
    batch_size: int = _opt(64, "global batch size, divisible by the number of devices")
    seed: int = _opt(0, "seed for parameters and synthetic data")
    microbatches: int = _opt(1, "gradient accumulation: split each device's batch into N "
                             "micro-batches inside the jitted step (same result as one batch)")
    remat: str = _opt("none", "activation recomputation per block (the decoders: gpt, "
                      "llama and moe models): full keeps block inputs, dots also every "
                      "matmul output, selective_op every other matmul output and the "
                      "attention's (torchtitan's op-level selective AC); MaxText's policies "
                      "by name keep (or, *_offloaded, move to host memory) the block's named "
                      "projections: docs/running.md lists what each keeps",
                      choices=("none", "full", "dots", "selective_op", "minimal",
                               "minimal_flash", "save_dot_with_context_except_mlp",
                               "save_dot_except_mlpwi", "save_dot_except_mlp",
                               "save_qkv_proj", "save_out_proj", "minimal_offloaded",
                               "qkv_proj_offloaded"))
    pp_schedule: str = _opt("1f1b", "pipeline schedule of the pp, tp_pp and fsdp_pp layouts "
                            "over --microbatches: gpipe (all forwards, then all backwards; "
                            "M activations live), 1f1b (one forward, one backward; about S "
                            "live), interleaved (1F1B over --pp-virtual chunks per stage), zb-h1 "
                            "(1F1B with the backward split into input and weight gradients, "
                            "Qi et al. 2023)",
                            choices=("gpipe", "1f1b", "interleaved", "zb-h1"))
    pp_virtual: int = _opt(1, "model chunks per pipeline stage for --pp-schedule interleaved")
    pp_stage_blocks: str = _opt("", "blocks of each pipeline stage, one count per stage "
                                "(NxR: N repeated R times), e.g. 7,8x14,7 for 126 blocks "
                                "over 16 stages; split over a stage's --pp-virtual chunks "
                                "as evenly as possible (default: depth / stages each)")
    pp_combined_1f1b: bool = _opt(False, "run each pipeline tick's forward and backward "
                                  "(of different micro-batches) as one computation, so "
                                  "XLA:GPU overlaps one's tensor-parallel collectives with "
                                  "the other's matmuls (Megatron-Core's combined 1F1B); "
                                  "the last stage's backward then waits a tick for its "
                                  "forward: one more tick and micro-batch stashed; with "
                                  "--pp-schedule 1f1b or interleaved")
    sequence_parallel: bool = _opt(False, "Megatron sequence parallelism (tp, fsdp_tp, tp_pp "
                                   "on gpt and llama models): norms and residual stream "
                                   "split over tensor along the sequence, each block's "
                                   "all-reduces become reduce-scatter + all-gather")
    context_load_balance: bool = _opt(True, "with a context axis (--mesh data:2,context:2): "
                                      "each context shard holds sequence chunks c and "
                                      "2CP-1-c of 2CP (the zig-zag of MaxText and "
                                      "Megatron), so every shard does the same causal "
                                      "attention work; off: CP contiguous parts")
    context_attention: str = _opt("allgather", "with a context axis: how attention reads "
                                  "the other shards' keys and values: allgather (all of "
                                  "them gathered, then one attention) or ring (one block "
                                  "per step passed round the context ring, its exchange "
                                  "beside the previous block's attention; XLA's dot "
                                  "attention, not attention=cudnn)",
                                  choices=("allgather", "ring"))
    tp_comm_chunks: int = _opt(0, "with --sequence-parallel: split the tensor-axis all-"
                               "gathers and reduce-scatters into N pieces, so that one "
                               "piece's collectives overlap another's matmuls (where, "
                               "--tp-comm-split); 0: under tp and fsdp_tp 2 where each "
                               "device's micro-batch is even, else 1; 1: off")
    tp_comm_split: str = _opt("auto", "what --tp-comm-chunks splits: batch (the blocks run "
                              "on N independent slices of each device's micro-batch, "
                              "DeepSpeed Domino's split; tp and fsdp_tp), sequence (each "
                              "sublayer's sequence shard in N pieces, gathered, projected "
                              "and scattered piece by piece, Megatron's pipelined "
                              "--tp-comm-overlap; every layout with --sequence-parallel, "
                              "pipelines included); auto: sequence under the pipeline "
                              "layouts, else batch", choices=("auto", "batch", "sequence"))
    distributed_optimizer: bool = _opt(False, "Megatron's distributed optimizer (ZeRO-1 over "
                                       "the data axes; ddp, tp, ep, pp, tp_pp): optimizer "
                                       "state and float32 master weights sharded over the "
                                       "axes the batch is split on, gradients reduce-"
                                       "scattered, parameters all-gathered after the update "
                                       "(zero1 is ddp with it)")
    grad_reduce_dtype: str = _opt("float32", "with --distributed-optimizer and --dtype "
                                  "bfloat16 or float8: the dtype the gradients are "
                                  "reduce-scattered over the data axes in: float32 (cast "
                                  "up first; Megatron-LM's default under --bf16) or "
                                  "bfloat16 (half the bytes, cast up on the optimizer's "
                                  "shard; Megatron-LM's --grad-reduce-in-bf16, Megatron-"
                                  "Bridge's performance recipes)",
                                  choices=("float32", "bfloat16"))


@dataclass(frozen=True)
class DataConfig:
    dataset: str = _opt("synthetic", "synthetic (random, fixed seed), digits (scikit-learn's "
                        "8x8 handwritten digits, fixed train/test split), cifar10 or mnist "
                        "(read from --data-dir)",
                        choices=DATASETS)
    data_dir: str = _opt("", "directory with the CIFAR-10 python batches or the MNIST IDX files",
                         path=True)
    eval_every: int = _opt(0, "test accuracy every N steps and at the end (0: never; needs a "
                           "real dataset)")


@dataclass(frozen=True)
class PSConfig:
    """Parameter-server options; used only with --layout ps."""
    ps_shards: int = _opt(2, "number of shard server processes")
    ps_mode: str = _opt("sync", "sync (BSP), async (ASP) or ssp (bounded staleness)",
                        choices=("sync", "async", "ssp"))
    staleness: int = _opt(2, "ssp bound: a worker may run this many steps ahead of the slowest")
    ps_staleness_lr: bool = _opt(False, "scale each applied gradient by 1/(1+staleness) "
                                 "(async and ssp)")
    ps_drop_dead_workers: bool = _opt(False, "sync: after --ps-timeout-s continue without a "
                                      "dead worker instead of stopping")
    ps_checkpoint_every: int = _opt(0, "shard snapshot every N applied versions; a dead shard "
                                    "restarts from it (0: off)")
    ps_timeout_s: float = _opt(30.0, "deadline of a PS call and of waiting for a worker")
    ps_port: int = _opt(0, "shard k listens on PS_PORT + k (0: free ports chosen at start)")
    ps_bind: str = _opt("127.0.0.1", "address the shard servers bind; another address needs "
                        "the token in JAXDIST_PS_TOKEN")
    ps_insecure: bool = _opt(False, "run without a token (by default the launcher makes one "
                             "per run unless JAXDIST_PS_TOKEN gives it)")
    ps_tls_cert: str = _opt("", "TLS certificate (PEM) for the shard servers", path=True)
    ps_tls_key: str = _opt("", "TLS private key (PEM) for the shard servers", path=True)
    ps_max_message_mb: int = _opt(64, "message limit, set on both ends; tensors are "
                                  "chunked below it")
    ps_transport: str = _opt("tcp", "tcp: pushes and pulls that fit one message go over a "
                             "plain TCP data port beside gRPC (faster; one more port per "
                             "shard); grpc: everything over gRPC", choices=("tcp", "grpc"))
    ps_clip_norm: float = _opt(0.0, "clip each gradient to this global L2 norm (workers) and "
                               "each shard's applied update to it (servers); 0: off")


@dataclass(frozen=True)
class LoopConfig:
    warmup: int = _opt(3, "untimed steps after compilation (compile time is reported apart)")
    steps: int = _opt(20, "timed steps")


@dataclass(frozen=True)
class CheckpointConfig:
    checkpoint_dir: str = _opt("", "Orbax checkpoint directory (shared by all processes)",
                               path=True)
    checkpoint_every: int = _opt(0, "save the train state every N steps, asynchronously (0: never)")
    resume: bool = _opt(False, "continue from the latest complete checkpoint in "
                        "--checkpoint-dir (any layout or mesh); start afresh if there is none. "
                        "--layout ps: continue the stopped run in --logdir from its shards' "
                        "snapshots")


@dataclass(frozen=True)
class OutputConfig:
    logdir: str = _opt("", "run directory (default runs/<time>-<layout>-<mesh>-<model>)",
                       path=True)
    progress: bool = _opt(True, "show a progress bar")
    dry_run: bool = _opt(False, "only plan: per-device train-state bytes of the layout on the "
                         "mesh, from shapes (no allocation, no devices; any model size)")
    profile_steps: str = _opt("", "capture a jax.profiler trace of steps A:B (inclusive) into "
                              "the run directory, for TensorBoard's profile tab or Perfetto")
    hardware: str = _opt("", f"predict memory and step time on this GPU "
                         f"({', '.join(PREDICTABLE)}) from the step compiled for the mesh: "
                         "with --dry-run printed (and written to plan.json with --logdir); "
                         "on a run, in results.json beside the measured figures")
    gpus_per_node: int = _opt(0, "with --hardware: GPUs per node (0: the part's usual node)")
    pp_runtime: str = _opt("jaxdist", "with --hardware on a pipeline layout: predict the "
                           "schedule as jaxdist's tick loop runs it (jaxdist: lockstep ticks, "
                           "each as long as its slowest stage's op) or as Megatron-LM runs it "
                           "(megatron: each stage starts its next op once its input arrived)",
                           choices=("jaxdist", "megatron"))
    power_limit: str = _opt("", "with --dry-run --hardware: the board power limit in W, as "
                            "nvidia-smi -pl sets it (default: the part's); a comma list "
                            "(700,600,500) plans each and names the least energy per step")
    sm_clock: int = _opt(0, "with --dry-run --hardware: the SM clock in MHz, locked as "
                         "nvidia-smi -lgc locks it (0: the part's maximum)")


@dataclass(frozen=True)
class RunConfig:
    mesh: MeshConfig = field(default_factory=MeshConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    compiler: CompilerConfig = field(default_factory=CompilerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    ps: PSConfig = field(default_factory=PSConfig)
    loop: LoopConfig = field(default_factory=LoopConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    power: PowerConfig = field(default_factory=PowerConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunConfig":
        return cls(**{name: kind(**data.get(name, {})) for name, kind in _SECTIONS.items()})


_SECTIONS = {"mesh": MeshConfig, "dist": DistConfig, "compiler": CompilerConfig, "model": ModelConfig, "train": TrainConfig,
             "data": DataConfig, "ps": PSConfig, "loop": LoopConfig, "checkpoint": CheckpointConfig,
             "power": PowerConfig, "output": OutputConfig}


# Options whose value may begin with "-" (`--xla-flags --xla_foo=1`); see OneLineParser.
_DASH_VALUES = ("xla_flags",)


@dataclass(frozen=True)
class Key:
    """One RunConfig field as a setting: its section, flag, type, choices and default."""
    section: str
    name: str
    kind: str                      # "int", "float", "str" or "bool"
    choices: tuple | None
    default: Any

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def arg(self, value) -> str:
        """One command-line token: `--flag=value` (so a value may begin with "-"), or
        `--flag` / `--no-flag` for a bool."""
        if self.kind == "bool":
            return self.flag if value else "--no-" + self.flag[2:]
        return f"{self.flag}={value}"


def keys() -> dict[str, Key]:
    """Every RunConfig field by name (names are unique across sections), in flag order."""
    out = {}
    for section, kind in _SECTIONS.items():
        for f in dataclasses.fields(kind):
            choices = f.metadata.get("choices")
            out[f.name] = Key(section, f.name, f.type if isinstance(f.type, str) else
                              f.type.__name__, tuple(choices) if choices else None, f.default)
    return out


def to_argv(values: RunConfig | Mapping[str, Any]) -> list[str]:
    """A RunConfig (every field) or {field name: value} (just those) -> the flags that
    reproduce it: from_namespace(parser.parse_args(to_argv(cfg))) == cfg for a parser
    built by add_arguments."""
    if isinstance(values, RunConfig):
        values = {name: getattr(getattr(values, key.section), name)
                  for name, key in keys().items()}
    by_name = keys()
    return [by_name[name].arg(value) for name, value in values.items()]


def registry_help() -> dict[str, str]:
    """What --help appends to --model and --layout: every registered name, read from the
    registries themselves so the help never lags behind them."""
    from models import model_names
    from sharding import describe_layouts

    return {"model": f". Models: {', '.join(model_names())}",
            "layout": f". Layouts: {describe_layouts()}"}


def add_arguments(parser: argparse.ArgumentParser, extra_help: dict[str, str] | None = None):
    """One flag per field (`batch_size` -> `--batch-size`), grouped by section; --model and
    --layout list the registered names (read when the help is printed, where the parser
    can wait: a OneLineParser's late_help)."""
    extra_help = dict(extra_help or {})
    if hasattr(parser, "late_help"):
        parser.late_help.update({k: (lambda k=k: registry_help()[k])
                                 for k in ("model", "layout") if k not in extra_help})
    else:
        extra_help = {**registry_help(), **extra_help}
    for name, kind in _SECTIONS.items():
        group = parser.add_argument_group(name)
        for f in dataclasses.fields(kind):
            flag = "--" + f.name.replace("_", "-")
            help_text = f.metadata["help"] + extra_help.get(f.name, "")
            if f.type == "bool":
                group.add_argument(flag, dest=f.name, default=f.default,
                                   action=argparse.BooleanOptionalAction, help=help_text)
                continue
            parse = path_arg if f.metadata.get("path") else \
                {"int": int, "float": float, "str": str}[f.type]
            if f.name in _DASH_VALUES and hasattr(parser, "dash_values"):
                parser.dash_values.add(flag)
            group.add_argument(flag, dest=f.name, type=parse, default=f.default,
                               choices=f.metadata.get("choices"),
                               help=f"{help_text} (default: {f.default})")


def from_namespace(ns: argparse.Namespace) -> RunConfig:
    return RunConfig(**{
        name: kind(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(kind)})
        for name, kind in _SECTIONS.items()})


def parse_profile_steps(text: str) -> tuple[int, int] | None:
    """`--profile-steps A:B` -> (A, B), inclusive step indices; "" -> None."""
    if not text:
        return None
    a, sep, b = text.partition(":")
    if not sep or not a.strip().isdigit() or not b.strip().isdigit() or int(a) > int(b):
        raise UsageError(f"--profile-steps {text!r} is not A:B with 0 <= A <= B (e.g. 5:7)")
    return int(a), int(b)


def parse_stage_blocks(text: str) -> tuple[int, ...]:
    """`--pp-stage-blocks`: one block count per stage, comma-separated; `NxR` is N repeated
    R times (`7,8x14,7`: 7, fourteen 8s, 7). Empty: even stages."""
    if not text.strip():
        return ()
    counts: list[int] = []
    for item in (i.strip() for i in text.split(",")):
        m = re.fullmatch(r"([0-9]+)(?:x([0-9]+))?", item)
        if not m or int(m.group(1)) == 0 or m.group(2) is not None and int(m.group(2)) == 0:
            raise UsageError(f"--pp-stage-blocks {text!r}: {item!r} is not a positive block "
                             f"count; give one per stage (NxR: N repeated R times), e.g. "
                             f"7,8x14,7")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return tuple(counts)

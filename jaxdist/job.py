"""The resolved job: what a run's config means once it is read, made once and passed whole.

`experiments.validation.validate(cfg)` is the factory: it checks the config and returns the
Job that `resolve` derives from it (the model config and dataset, the layout's facts and
sharding rules, the mesh shape, the part). Everything below `experiments/` takes the job and
reads what it needs from it (torchtitan's ParallelDims, MaxText's pyconfig): `loop.run`,
`run_setup.setup`, `step_program`, `plan`, `predict`, `run_ps`. Derived jobs are made here,
not by hand: `on_part` (a run's own prediction on a GPU part), `with_xla_flags` (a plan
compiled again with other flags), `for_processes` (a parameter-server process, from the
config its launcher passed it, already validated).

Imports nothing heavy at module level: `resolve` imports the layout registry (jax) and the
model registry (flax) when it is called.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxdist.config import RunConfig
    from jaxdist.mesh import MeshShape
    from jaxdist.parts import Part
    from sharding.registry import LayoutFacts

# What the entry point runs for a job: a training run on a device mesh (experiments.run),
# a plan of one (experiments.plan, or experiments.run --dry-run), or the parameter server's
# processes (a layout that runs out of process, ps.driver).
MESH, PLAN, PS = "mesh", "plan", "ps"
KINDS = (MESH, PLAN, PS)


@dataclass(frozen=True)
class Job:
    cfg: RunConfig                # the config as validated (--resume's folder resolved)
    kind: str                     # one of KINDS
    layout: LayoutFacts           # the layout registry's facts (sharding.registry)
    model: Any                    # the model config (jaxdist.run_model.build_model)
    shape: MeshShape              # the parsed --mesh (size None for -1: known with devices)
    optimizer: str                # --optimizer
    part: Part | None             # --hardware's part (jaxdist.parts), None without
    notices: tuple[str, ...]      # "notice: ..." lines, in experiments.notices' order
    dataset: Any = None           # the dataset (jaxdist.data), None for synthetic batches
    rules: Any = None             # the layout's sharding rules (sharding.get_layout)

    # The config's typed sections, read from the job (one frozen dataclass per concern)
    train = property(lambda self: self.cfg.train)
    loop = property(lambda self: self.cfg.loop)
    data = property(lambda self: self.cfg.data)
    compiler = property(lambda self: self.cfg.compiler)
    dist = property(lambda self: self.cfg.dist)
    checkpoint = property(lambda self: self.cfg.checkpoint)
    power = property(lambda self: self.cfg.power)
    output = property(lambda self: self.cfg.output)
    ps = property(lambda self: self.cfg.ps)
    # the ModelConfig section's settings (Job.model is the model's own config)
    settings = property(lambda self: self.cfg.model)  # the whole ModelConfig section
    model_name = property(lambda self: self.settings.model)
    dtype = property(lambda self: self.settings.dtype)
    matmul_precision = property(lambda self: self.settings.matmul_precision)
    fp8_scaling = property(lambda self: self.settings.fp8_scaling)
    mesh_settings = property(lambda self: self.cfg.mesh)  # --mesh as given, --platform
    platform = property(lambda self: self.mesh_settings.platform)

    @property
    def hosts(self) -> int:
        """The hosts the mesh spans: a plan for a part, its nodes (the mesh's devices over
        the part's node size); a mesh run, its processes (--num-processes, 1 without); a
        plan from shapes and the parameter server, this host (the parameter server starts
        its processes here)."""
        if self.kind == PLAN and self.part is not None:
            return math.ceil(self.shape.size / self.part.gpus_per_node)
        if self.kind == MESH:
            return max(self.dist.num_processes, 1)
        return 1

    def to_dict(self) -> dict:
        """The config that made the job (results.json's `config`, a child process's argv)."""
        return self.cfg.to_dict()

    def on_part(self, name: str) -> Job:
        """This job as a plan on the part `name` (jaxdist.parts; its node size the job's
        --gpus-per-node): a run's own prediction, the same step planned. An unknown part is
        a UsageError."""
        from jaxdist.hardware import get_hardware

        part = get_hardware(name, self.output.gpus_per_node)
        output = dataclasses.replace(self.output, dry_run=True, hardware=name)
        return dataclasses.replace(self, cfg=dataclasses.replace(self.cfg, output=output),
                                   kind=PLAN, part=part, notices=())

    def with_xla_flags(self, flags: str) -> Job:
        """This job compiled with `flags` as its --xla-flags (a plan's fallback compile)."""
        compiler = dataclasses.replace(self.compiler, xla_flags=flags)
        return dataclasses.replace(self, cfg=dataclasses.replace(self.cfg, compiler=compiler))

    def with_train(self, **changes) -> Job:
        """This job with other training settings and the same model config (a plan's
        program at another batch size: the attention-score probe)."""
        train = dataclasses.replace(self.train, **changes)
        return dataclasses.replace(self, cfg=dataclasses.replace(self.cfg, train=train))

    def with_shape(self, shape: MeshShape) -> Job:
        """This job on the mesh the devices resolved (a run's --mesh -1)."""
        return dataclasses.replace(self, shape=shape)


def resolve(cfg: RunConfig, kind: str, shape: MeshShape, part: Part | None,
            notices: tuple[str, ...] = ()) -> Job:
    """The job `cfg` describes on the mesh `shape`: the layout's facts and rules (one
    get_layout), the model config and dataset (one build_model). Raises a one-line
    UsageError where the model or layout refuses the config."""
    from jaxdist.run_model import build_model
    from sharding import get_layout
    from sharding.registry import facts

    train = cfg.train
    rules = get_layout(train.layout, train.distributed_optimizer, train.grad_reduce_dtype)
    model_cfg, dataset = build_model(cfg.model, train, cfg.data, shape)
    return Job(cfg, kind, facts(train.layout), model_cfg, shape, train.optimizer, part,
               tuple(notices), dataset, rules)


def for_process(cfg: RunConfig) -> Job:
    """The job of a process a launcher started with an already validated config (a
    parameter-server shard or worker): resolved again here, with no check repeated."""
    from jaxdist.mesh import parse_mesh

    mesh = cfg.mesh
    return resolve(cfg, kind_of(cfg), parse_mesh(mesh.mesh), None)


def kind_of(cfg: RunConfig) -> str:
    """The job's kind from its flags and its layout's facts (imports the layout registry,
    hence jax; an unknown layout is refused here, one line)."""
    output, train = cfg.output, cfg.train
    if output.dry_run:
        return PLAN
    from sharding.registry import facts
    return PS if facts(train.layout).out_of_process else MESH


def out_of_process(layout: str) -> bool:
    """Whether `layout` runs in processes of its own (the parameter server), from the layout
    registry (imports jax; an unknown layout is refused, one line)."""
    from sharding.registry import facts
    return facts(layout).out_of_process

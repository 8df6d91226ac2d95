"""Predicted power and energy of a step, from its predicted timeline and the part's power
record (jaxdist.part_figures.PartPower), under a board power limit and an SM clock, as
`nvidia-smi -pl` and `-lgc` set them.

The timeline (`Timeline`): per pipeline stage (one for a mesh step), the seconds of
compute-bound and of memory-bound kernels at the part's own limit and clock (as the time
model predicts them), and the step's length; the rest of each stage's step is waiting (exposed communication, the pipeline
bubble, launch gaps). `fixed_s` is the part of the step that does not follow the device
time (exposed communication, launches); the rest of the step (the kernels, and the bubble
and the waits for other stages, which are made of other stages' kernels) stretches as the
busiest stage's kernels do.

Each phase draws (jaxdist.hardware.POWER_CONSTANTS, three per GPU generation, fractions of
the die's rated power):
- waiting: P_wait, at any clock;
- a compute-bound or memory-bound kernel: P_wait + (P_phase - P_wait) g(f), P_phase its draw
  at the maximum clock, g the dynamic power's share at SM clock f: (f / f_max)^3 above the
  part's base clock (voltage rising with the clock: P ~ C V^2 f, MODEL_CONSTANTS
  power_cap_clock_exponent), falling in proportion to f below it (the voltage at its floor);
- never above the limit: where a phase would draw more, the GPU lowers its clock until it
  draws the limit (DVFS). A compute-bound kernel's time stretches by f_ref / f (f_ref: its
  clock at the part's own limit); a memory-bound kernel's and a collective's do not (HBM and
  links have their own clocks).

Per GPU: the average over the step (per stage where the stages differ), energy per step
(all GPUs), J/token, tokens/J and Go et al.'s samples/(s*MJ) (throughput over the step's
energy in MJ); per node (jaxdist.parts.NODES), the GPUs plus the rest of the server. Data
and arithmetic only: no jax.
"""

from __future__ import annotations

import dataclasses

from jaxdist.errors import UsageError
from jaxdist.figures import ABSENT, Figures
from jaxdist.hardware import constant, power_constant
from jaxdist.part_figures import NodePower, PartPower

LABEL = "predicted"


@dataclasses.dataclass(frozen=True)
class StageBusy(Figures):
    """One stage's kernels over a step, seconds at the part's own limit and clock."""
    compute_s: float
    memory_s: float


@dataclasses.dataclass(frozen=True)
class Timeline(Figures):
    """What each GPU does over one step at the part's own board limit and clock:
    `stages` (one per pipeline stage; one for a mesh step), the step's length, and the part
    of it that does not stretch with the kernels (`fixed_s`)."""
    step_s: float
    stages: tuple[StageBusy, ...]
    fixed_s: float = 0.0

    @property
    def critical(self) -> int:
        return max(range(len(self.stages)),
                   key=lambda s: self.stages[s].compute_s + self.stages[s].memory_s)


@dataclasses.dataclass(frozen=True)
class PhaseDraw(Figures):
    """One phase under the limit and clock: the SM clock it runs at and what it draws."""
    clock_mhz: float
    watts: float


@dataclasses.dataclass(frozen=True)
class PowerFigures(Figures):
    """plan.json's `power` block: per GPU and per node, predicted."""
    gpu_avg_w: float
    energy_per_step_j: float
    step_s: float
    limit_w: float
    sm_clock_mhz: float
    tokens_per_j: float | None
    j_per_token: float | None
    samples_per_s_per_mj: float | None
    node_avg_w: float | None
    node_energy_per_step_j: float | None
    node: str | None
    terms: dict
    gpu_avg_w_by_stage: list = ABSENT
    label: str = LABEL


def dynamic_share(f: float, rec: PartPower) -> float:
    """The share of a phase's dynamic power (above waiting) it draws at SM clock f."""
    cube = 1 / constant("power_cap_clock_exponent")
    base = rec.base_clock_mhz
    if f >= base:
        return (f / rec.max_clock_mhz) ** cube
    return (base / rec.max_clock_mhz) ** cube * f / base


def clock_for_share(share: float, rec: PartPower) -> float:
    """The SM clock at which a phase draws `share` of its dynamic power (dynamic_share's
    inverse)."""
    cube = 1 / constant("power_cap_clock_exponent")
    at_base = (rec.base_clock_mhz / rec.max_clock_mhz) ** cube
    if share >= at_base:
        return rec.max_clock_mhz * share ** (1 / cube)
    return rec.base_clock_mhz * share / at_base


def draws(rec: PartPower) -> dict[str, float]:
    """Watts of each phase at the maximum SM clock: compute, memory, waiting."""
    return {phase: power_constant(phase, rec.generation) * rec.die_rated_w
            for phase in ("compute", "memory", "waiting")}


def phase(full_w: float, wait_w: float, limit_w: float, clock: float,
          rec: PartPower) -> PhaseDraw:
    """A busy phase drawing `full_w` at the maximum clock, run with its clock locked at
    `clock` (at most) under `limit_w`: the clock it runs at and its draw."""
    watts = wait_w + (full_w - wait_w) * dynamic_share(clock, rec)
    if watts > limit_w:
        clock = clock_for_share((limit_w - wait_w) / (full_w - wait_w), rec)
        watts = limit_w
    return PhaseDraw(clock_mhz=clock, watts=watts)


def check_settings(rec: PartPower | None, part: str, limit_w: float | None,
                   clock_mhz: float | None) -> None:
    """A limit the part accepts and a clock it has; a one-line UsageError otherwise."""
    if rec is None and (limit_w is not None or clock_mhz is not None):
        from jaxdist.parts import NAMED, PREDICTABLE
        have = ", ".join(n for n in PREDICTABLE if NAMED[n].power is not None)
        raise UsageError(f"{part} has no power record in jaxdist.parts; --power-limit and "
                         f"--sm-clock apply to {have}")
    if limit_w is not None and not rec.limit_min_w <= limit_w <= rec.limit_max_w:
        raise UsageError(f"--power-limit {limit_w:g} W is outside {part}'s range "
                         f"{rec.limit_min_w:g}-{rec.limit_max_w:g} W")
    if clock_mhz is not None and int(clock_mhz) not in rec.clocks():
        raise UsageError(f"--sm-clock {clock_mhz:g} MHz is not a clock of {part}: "
                         f"{rec.clock_min_mhz:g}-{rec.max_clock_mhz:g} MHz in steps of "
                         f"{rec.clock_step_mhz:g}")


def parse_limits(text: str) -> list[float]:
    """--power-limit's value: one limit in W or a comma list (a sweep)."""
    try:
        limits = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        limits = []
    if not limits or any(not x > 0 for x in limits):
        raise UsageError(f"--power-limit {text!r}: give watts, one (600) or a comma list for "
                         f"a sweep (700,600,500)")
    return limits


def predict_power(timeline: Timeline, rec: PartPower, gpus: int,
                  tokens_per_step: int | None = None, samples_per_step: int | None = None,
                  limit_w: float | None = None, sm_clock_mhz: float | None = None,
                  node: NodePower | None = None) -> PowerFigures:
    """The step's power and energy on `gpus` GPUs of the part `rec` (split evenly over the
    timeline's stages) under `limit_w` (default: the part's) with the SM clock locked at
    `sm_clock_mhz` (default: its maximum). The timeline is the step at the part's own limit
    and clock (what the time model predicts: its kernel rates were published at the part's
    limit, or carried to it, jaxdist.hardware.clock_factor); compute-bound time stretches by
    the clock there over the clock here."""
    limit = rec.limit_w if limit_w is None else limit_w
    clock = rec.max_clock_mhz if sm_clock_mhz is None else sm_clock_mhz
    w = draws(rec)
    wait_w = min(w["waiting"], limit)
    comp = phase(w["compute"], wait_w, limit, clock, rec)
    mem = phase(w["memory"], wait_w, limit, clock, rec)
    # the timeline is at the part's own limit and clock: compute stretches from there
    ref = phase(w["compute"], min(w["waiting"], rec.limit_w), rec.limit_w, rec.max_clock_mhz,
                rec)
    stretch = ref.clock_mhz / comp.clock_mhz
    busy = [(s.compute_s * stretch, s.memory_s) for s in timeline.stages]
    crit = timeline.stages[timeline.critical]
    was = crit.compute_s + crit.memory_s
    ratio = sum(busy[timeline.critical]) / was if was else 1.0
    step = timeline.fixed_s + (timeline.step_s - timeline.fixed_s) * ratio
    by_stage = []
    for c, m in busy:
        waiting = max(0.0, step - c - m)
        by_stage.append((c * comp.watts + m * mem.watts + waiting * wait_w) / step)
    gpu_avg = sum(by_stage) / len(by_stage)
    energy = gpu_avg * gpus * step
    node_w = node_j = None
    if node is not None:
        node_w = node.gpus * gpu_avg + node.non_gpu_training_w
        node_j = node_w * step * gpus / node.gpus
    return PowerFigures(
        gpu_avg_w=gpu_avg, energy_per_step_j=energy, step_s=step, limit_w=limit,
        sm_clock_mhz=clock,
        tokens_per_j=tokens_per_step / energy if tokens_per_step else None,
        j_per_token=energy / tokens_per_step if tokens_per_step else None,
        samples_per_s_per_mj=(samples_per_step / step / (energy / 1e6)
                              if samples_per_step else None),
        node_avg_w=node_w, node_energy_per_step_j=node_j,
        node=None if node is None else f"{node.name} ({node.gpus} GPUs, {node.metering})",
        terms={"compute_w": comp.watts, "memory_w": mem.watts, "waiting_w": wait_w,
               "compute_clock_mhz": comp.clock_mhz, "memory_clock_mhz": mem.clock_mhz,
               "compute_stretch": stretch,
               "compute_s": sum(c for c, _ in busy) / len(busy),
               "memory_s": sum(m for _, m in busy) / len(busy),
               "fixed_s": timeline.fixed_s, "generation": rec.generation},
        gpu_avg_w_by_stage=by_stage if len(by_stage) > 1 else ABSENT)


def busy_of(compute_s: float, memory_s: float, device_s: float) -> StageBusy:
    """A stage's kernels within its device time: the roofline counts a program's compute and
    HBM time side by side (its device time is the larger), so there they share the device
    time in their proportion; kernel by kernel they are already apart."""
    total = compute_s + memory_s
    scale = device_s / total if total > device_s > 0 else 1.0
    return StageBusy(compute_s=compute_s * scale, memory_s=memory_s * scale)


def timeline_of(step) -> Timeline:
    """The timeline of a predicted step (jaxdist.predict.time_model.StepTime): per stage its
    compute-bound and memory-bound seconds (a pipeline's from its ticks' `stage_busy`); what
    does not follow the kernels is the exposed communication and the launches."""
    pipe = step.pipeline
    busy = pipe.stage_busy if pipe and pipe.has("stage_busy") else [
        {"compute_s": step.compute_s, "hbm_s": step.hbm_s, "device_s": step.device_s}]
    stages = tuple(busy_of(b["compute_s"], b["hbm_s"], b["device_s"]) for b in busy)
    fixed = step.comm_exposed_s + (step.launch_s or 0.0) + \
        (step.exposed_host_transfer_s or 0.0)
    return Timeline(step_s=step.step_s, stages=stages, fixed_s=min(fixed, step.step_s))


def timeline_of_plan(plan: dict) -> Timeline:
    """`timeline_of` read back from a written plan.json (its `time` block, and a pipeline's
    `stage_busy` in its `pipeline` block): a plan planned once is re-powered without a
    compile."""
    from types import SimpleNamespace
    t = plan["time"]
    busy = (plan.get("pipeline") or {}).get("stage_busy")
    step = SimpleNamespace(
        step_s=t["step_s"], compute_s=t["compute_s"], hbm_s=t["hbm_s"],
        device_s=t["device_s"], comm_exposed_s=t["comm_exposed_s"],
        launch_s=t.get("launch_s", 0.0),
        exposed_host_transfer_s=t.get("exposed_host_transfer_s", 0.0),
        pipeline=SimpleNamespace(stage_busy=busy, has=lambda name: True) if busy else None)
    return timeline_of(step)


def plan_power(step, part, gpus: int, tokens_per_step: int | None,
               samples_per_step: int | None, limit_w: float | None = None,
               sm_clock_mhz: float | None = None) -> PowerFigures | None:
    """A plan's power block: its step (StepTime) on `gpus` GPUs of `part` (jaxdist.parts.Part);
    None on a part without a power record (`no_power_reason` says why)."""
    if part.power is None:
        return None
    from jaxdist.parts import NODE_OF_PART, NODES
    node = NODES.get(NODE_OF_PART.get(part.name, ""))
    return predict_power(timeline_of(step), part.power, gpus, tokens_per_step,
                         samples_per_step, limit_w, sm_clock_mhz, node)


def no_power_reason(part) -> str:
    return f"{part.name} has no power record (jaxdist.parts): no power is predicted"


def power_line(p: PowerFigures) -> str:
    """One line: `power: 612 W/GPU (stage 0: 655 W), 7.3 kJ/step, 1.9 tokens/J`."""
    stages = ""
    if p.has("gpu_avg_w_by_stage"):
        top = max(range(len(p.gpu_avg_w_by_stage)), key=p.gpu_avg_w_by_stage.__getitem__)
        stages = f" (stage {top}: {p.gpu_avg_w_by_stage[top]:.0f} W)"
    energy = p.energy_per_step_j
    unit = (f"{energy / 1e6:.2f} MJ" if energy >= 1e6 else f"{energy / 1e3:.1f} kJ"
            if energy >= 1e3 else f"{energy:.3g} J")
    tokens = f", {p.tokens_per_j:.3g} tokens/J" if p.tokens_per_j else ""
    node = f", node {p.node_avg_w / 1e3:.2f} kW" if p.node_avg_w else ""
    return f"power: {p.gpu_avg_w:.0f} W/GPU{stages}, {unit}/step{tokens}{node}"


def sweep(timeline: Timeline, rec: PartPower, gpus: int, limits, **kw) -> list[PowerFigures]:
    """predict_power at each limit in `limits`."""
    return [predict_power(timeline, rec, gpus, limit_w=limit, **kw) for limit in limits]


def sweep_lines(rows: list[PowerFigures]) -> list[str]:
    """A sweep as text: time, power and energy per limit, and the limit of least energy."""
    best = min(rows, key=lambda r: r.energy_per_step_j)
    lines = [f"{'limit W':>8}{'step s':>10}{'W/GPU':>8}{'kJ/step':>12}"]
    lines += [f"{r.limit_w:>8.0f}{r.step_s:>10.4g}{r.gpu_avg_w:>8.0f}"
              f"{r.energy_per_step_j / 1e3:>12.4g}" for r in rows]
    lines.append(f"least energy per step: {best.limit_w:.0f} W "
                 f"({best.energy_per_step_j / 1e3:.4g} kJ, step {best.step_s:.4g} s)")
    return lines


@dataclasses.dataclass(frozen=True)
class PlanPower(Figures):
    """A plan's power: at the limit asked for (or the part's), and the sweep's rows where
    --power-limit listed several (`sweep`, with the limit of least energy per step); or,
    on a part without a power record, the reason there is none."""
    power: PowerFigures | None
    sweep: list = ABSENT
    least_energy_limit_w: float = ABSENT
    reason: str = ABSENT

    def lines(self) -> list[str]:
        if self.power is None:
            return [f"power: none predicted ({self.reason})"]
        out = [power_line(self.power)]
        if self.has("sweep"):
            out += ["power-limit sweep (predicted):", *("  " + ln for ln in
                                                        sweep_lines(self.sweep))]
        return out

    def to_json(self) -> dict:
        """plan.json's `power` block."""
        if self.power is None:
            return {"available": False, "reason": self.reason}
        return {**self.power.to_json(), **({"sweep": [r.to_json() for r in self.sweep],
                                            "least_energy_limit_w": self.least_energy_limit_w}
                                           if self.has("sweep") else {})}


def for_plan(plan, job) -> PlanPower:
    """The power of a predicted plan (jaxdist.plan.predicted.PredictedPlan) of `job`, under
    its --power-limit (one, or a sweep) and --sm-clock."""
    part, out = job.part, job.cfg.output
    if part.power is None:
        return PlanPower(power=None, reason=no_power_reason(part))
    limits = parse_limits(out.power_limit) if out.power_limit else [None]
    tokens = plan.batch_size * plan.seq_len if plan.seq_len else None
    rows = [plan_power(plan.prediction.time, part, job.shape.size, tokens, plan.batch_size,
                       limit, out.sm_clock or None) for limit in limits]
    if len(rows) == 1:
        return PlanPower(power=rows[0])
    best = min(rows, key=lambda r: r.energy_per_step_j)
    return PlanPower(power=rows[0], sweep=rows, least_energy_limit_w=best.limit_w)

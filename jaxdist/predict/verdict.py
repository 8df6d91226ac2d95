"""The memory verdict, in one place: a prediction's bytes per device against the part's HBM
(`jaxdist.parts.Part.hbm_bytes`), and what the verdict makes of the throughput.

- `memory_verdict`: one program compiled by XLA:CPU: jaxdist.predict.memory's hand estimate
  decides; XLA:CPU's temporaries ride along as an upper bound.
- `gpu_memory_verdict`: one program compiled by XLA:GPU: its buffer assignment decides, the
  hand estimate beside it term by term (`MEMORY_BAND`).
- `pipeline_verdict`: a pipeline's worst stage (jaxdist.predict.stage_memory), its working set
  from XLA:GPU's buffer assignment of one chunk's backward where compiled for a GPU.
- `word` and `if_it_fit`: the verdict in one word, and a throughput labelled "if it fit"
  where it does not.
"""

from __future__ import annotations

import dataclasses

from jaxdist.figures import ABSENT, Figures
from jaxdist.parts import Part
from jaxdist.plan_words import MEMORY_BAND, MEMORY_RULE

LABEL = "predicted"

@dataclasses.dataclass(frozen=True)
class MemoryTerm(Figures):
    """One term of the memory per device, XLA:GPU's buffer assignment beside the hand
    estimate, and whether they agree within MEMORY_BAND."""
    term: str
    compiler_bytes: float
    hand_bytes: float
    hand_over_compiler: float | None
    agrees: bool


@dataclasses.dataclass(frozen=True)
class MemoryVerdict(Figures):
    """The memory per device against the part's HBM, plan.json's `memory` block: the
    figure that decides (`total_bytes`) and its terms, the verdict (`fits`: True, False or
    None for unknown) and why. One program adds the hand estimate's terms; compiled by
    XLA:CPU, that compiler's temporaries (an upper bound); by XLA:GPU, its buffer assignment
    term by term (`terms`, `compiler`) and which figure decided (`source`); a pipeline, its
    stages and the worst one's activations."""
    state_bytes: float
    gradient_bytes: float
    temp_bytes: float
    total_bytes: float
    hbm_bytes: float
    fits: bool | None
    fits_reason: str | None
    over_by_bytes: float
    headroom_bytes: float
    label: str = LABEL
    rule: str = MEMORY_RULE
    # the hand estimate's terms (jaxdist.predict.memory.MemoryEstimate), one program
    residual_bytes: float = ABSENT
    transient_bytes: float = ABSENT
    gathered_param_bytes: float = ABSENT
    host_residual_bytes: float = ABSENT
    method: str = ABSENT
    batch_shards: int = ABSENT
    flash_attention: bool = ABSENT
    upper_bound: bool = ABSENT
    upper_bound_why: str | None = ABSENT
    # XLA:CPU's program
    cpu_compiler_temp_bytes: float = ABSENT
    cpu_compiler_note: str = ABSENT
    # XLA:GPU's program
    source: str = ABSENT
    source_note: str = ABSENT
    terms: list[MemoryTerm] = ABSENT
    band: list[float] = ABSENT
    compiler: dict[str, float] = ABSENT
    xla_temp_limit_bytes: float = ABSENT
    hand_estimate_bytes: float = ABSENT
    hand_over_compiler: float | None = ABSENT
    # a pipeline's stages
    fp8_weight_bytes: float = ABSENT
    gradient_cast_bytes: float = ABSENT
    temp_note: str = ABSENT
    stages: list[dict] = ABSENT


def _against_hbm(need: float, hw: Part) -> dict[str, float]:
    return {"total_bytes": need, "hbm_bytes": hw.hbm_bytes,
            "over_by_bytes": max(0, need - hw.hbm_bytes),
            "headroom_bytes": max(0, hw.hbm_bytes - need)}


def _hand(estimate) -> dict[str, float | str | bool | None]:
    """The hand estimate's terms, as MemoryVerdict's fields."""
    return {k: v for k, v in estimate.to_json().items() if k != "label"}


def word(fits: bool | None) -> str:
    """The verdict in one word: fits, OOM or unknown (an estimate that is only an upper
    bound, or two figures that disagree)."""
    return {True: "fits", False: "OOM"}.get(fits, "unknown")


def if_it_fit(throughput, fits: bool | None):
    """A step that does not fit has no throughput to act on: it stays (what the step would
    give on a part with room) but is labelled as such (a time_model.Throughput)."""
    if fits is not False:
        return throughput
    return throughput.replace(if_it_fit=True, label=f"{throughput.label}, if it fit")


def memory_verdict(estimate, cpu_temp_bytes: float, hw: Part) -> MemoryVerdict:
    """Per-device bytes against HBM capacity. `estimate` is jaxdist.predict.memory's peak
    (exact state + gradients + the backward's saved residuals + a transient working set;
    within 5% of torchtitan's published peaks in --validate), and it decides the verdict.
    XLA:CPU's temp bytes ride along labelled as the CPU compiler's upper bound (its buffer
    assignment keeps float32 copies around bf16 dots and the L x L scores: 6-7x over)."""
    need = estimate.total_bytes
    fits = need <= hw.hbm_bytes
    if fits:
        reason = None
    elif estimate.state_bytes > hw.hbm_bytes:
        reason = "the train state alone exceeds HBM (exact)"
    elif estimate.upper_bound:
        fits, reason = None, (f"the state fits; the estimate, an upper bound "
                              f"({estimate.upper_bound_why}), would not")
    else:
        reason = ("state + gradients + saved activations + working set exceed HBM "
                  "(predicted)")
    return MemoryVerdict(
        **{**_hand(estimate), **_against_hbm(need, hw)},
        temp_bytes=need - estimate.state_bytes, cpu_compiler_temp_bytes=cpu_temp_bytes,
        cpu_compiler_note="XLA:CPU's temporaries for this step (L x L attention scores "
                          "removed for flash attention decoders): an upper bound for the "
                          "GPU, not used for the verdict",
        fits=fits, fits_reason=reason)


def memory_terms(estimate, gpu: dict[str, float]) -> list[MemoryTerm]:
    """The compiled buffer assignment and the hand estimate, term by term: the train state
    (XLA: the donated arguments, updated in place; hand: the exact shards) and everything
    else (XLA: temporaries, the batch and outputs not donated; hand: gradients + saved
    activations + the working set)."""
    total = gpu["argument_bytes"] + gpu["output_bytes"] - gpu["alias_bytes"] + \
        gpu["temp_bytes"]
    rows = (("state", gpu["alias_bytes"], estimate.state_bytes),
            ("gradients + saved activations + working set", total - gpu["alias_bytes"],
             estimate.total_bytes - estimate.state_bytes))
    return [MemoryTerm(term=name, compiler_bytes=c, hand_bytes=h,
                       hand_over_compiler=h / c if c > 0 else None,
                       agrees=c > 0 and MEMORY_BAND[0] <= h / c <= MEMORY_BAND[1])
            for name, c, h in rows]


def gpu_memory_verdict(estimate, gpu: dict[str, float], hw: Part) -> MemoryVerdict:
    """Per-device bytes against the part's usable HBM, by MEMORY_RULE. XLA:GPU's buffer
    assignment of the step (argument + output - alias + temp: what the program allocates,
    before the allocator's own pools and library workspaces) is the figure shown and held to
    HBM; jaxdist.predict.memory's hand estimate is set beside it term by term, and where a
    term disagrees beyond MEMORY_BAND the verdict is what both figures say (unknown where
    they differ) and names the term. XLA planned the program (scheduler,
    rematerialization) for the same usable HBM (jaxdist.program.gpu_targets XLA_BASE_FRACTION): its
    limit for temporaries is that less arguments and outputs, times its slop factor."""
    from jaxdist.program.gpu_targets import XLA_SLOP_FACTOR

    compiled = gpu["argument_bytes"] + gpu["output_bytes"] - gpu["alias_bytes"] + \
        gpu["temp_bytes"]
    terms = memory_terms(estimate, gpu)
    disagree = [t for t in terms if not t.agrees]
    hand = estimate.total_bytes
    need, source = compiled, "XLA:GPU buffer assignment"
    if not disagree:
        fits = need <= hw.hbm_bytes
        source_note = (f"XLA:GPU's buffer assignment agrees with the hand estimate term by term "
                       f"within {MEMORY_BAND[0]}-{MEMORY_BAND[1]}")
    else:
        # Two figures that disagree decide only what they both say: fits when both fit, OOM
        # when both do not (or the exact state alone does not), else unknown.
        # A hand estimate that is only an upper bound (no remat, tensor parallelism:
        # memory.py) says nothing when it is over HBM: the compiled figure alone decides.
        silent = bool(estimate.upper_bound) and hand > hw.hbm_bytes
        both = {compiled <= hw.hbm_bytes} | (set() if silent else {hand <= hw.hbm_bytes})
        fits = both.pop() if len(both) == 1 else None
        if estimate.state_bytes > hw.hbm_bytes:
            fits = False
        source_note = (f"XLA:GPU's buffer assignment disagrees with the hand estimate beyond "
                       f"{MEMORY_BAND[0]}-{MEMORY_BAND[1]} on "
                       f"{' and '.join(t.term for t in disagree)}: " +
                       (f"the hand estimate, an upper bound ({estimate.upper_bound_why}),"
                        f" is over HBM and says nothing; XLA's figure decides" if silent else
                        "the verdict is what both say" + ("" if fits is not None else
                                                          " (they do not say the same: "
                                                          "unknown)")))
    if fits:
        reason = None
    elif estimate.state_bytes > hw.hbm_bytes:
        reason = "the train state alone exceeds HBM (exact)"
    elif fits is None:
        over = "XLA:GPU's buffer assignment" if compiled > hw.hbm_bytes else "the hand estimate"
        reason = (f"{over} exceeds HBM and the other does not; they disagree on "
                  f"{' and '.join(t.term for t in disagree)}")
    else:
        reason = (f"the {source} exceeds HBM" if not disagree or silent else
                  "XLA:GPU's buffer assignment and the hand estimate both exceed HBM")
    io = gpu["argument_bytes"] + gpu["output_bytes"] - gpu["alias_bytes"]
    return MemoryVerdict(
        **{**_hand(estimate), **_against_hbm(need, hw)},
        source=source, source_note=source_note, terms=terms, band=list(MEMORY_BAND),
        compiler={k: gpu[k] for k in ("argument_bytes", "output_bytes", "alias_bytes",
                                      "temp_bytes")} | {"peak_bytes": compiled,
                                                        "host_temp_bytes":
                                                        gpu.get("host_temp_bytes", 0)},
        xla_temp_limit_bytes=max(0.0, (hw.hbm_bytes - io) * XLA_SLOP_FACTOR),
        hand_estimate_bytes=hand, hand_over_compiler=hand / compiled if compiled else None,
        temp_bytes=need - estimate.state_bytes, fits=fits, fits_reason=reason)


def pipeline_verdict(stage_memory, hw: Part,
                     compiled_working: float | None = None) -> MemoryVerdict:
    """The memory verdict of a pipeline: the worst stage of `stage_memory`'s stages (exact
    state, activations stashed per the schedule table) against the part's HBM. The working
    set of one chunk's backward: XLA:GPU's temporaries of that op (`compiled_working`,
    extrapolated to the chunk's blocks) where compiled for a GPU, else the hand estimate."""
    from jaxdist.predict.stage_memory import stage_total

    stages = stage_memory.stages
    if compiled_working is not None:
        stages = [{**s, "activation_working_hand": s["activation_working"],
                   "activation_working": int(compiled_working)} for s in stages]
        stages = [{**s, "total": stage_total(s)} for s in stages]
    worst = max(stages, key=lambda s: s["total"])
    # padded slots (--pp-stage-blocks): state and gradients the stage holds
    state_bytes = (worst["params"] + worst["opt"] + worst.get("master", 0) +
                   worst.get("padding_state", 0))
    need = worst["total"]
    fits = need <= hw.hbm_bytes
    working = ("one chunk's backward from XLA:GPU's buffer assignment of that op"
               if compiled_working is not None else
               "one chunk's backward by Korthikanti et al. 2022")
    gradient_bytes = worst["gradients"] + worst.get("padding_gradients", 0)
    temp_bytes = worst["activation_stash"] + worst["activation_working"]
    fp8_bytes = worst.get("fp8_weights", 0)
    return MemoryVerdict(
        state_bytes=state_bytes, gradient_bytes=gradient_bytes, temp_bytes=temp_bytes,
        fp8_weight_bytes=fp8_bytes,
        # a chunk's gradients cast up for their float32 reduction, beyond the activations
        gradient_cast_bytes=need - state_bytes - gradient_bytes - temp_bytes - fp8_bytes,
        temp_note=f"activations per stage: stash counted from the schedule table, working "
                  f"set of {working} (jaxdist.predict.stage_memory)",
        **_against_hbm(need, hw), fits=fits,
        fits_reason=None if fits else "state + gradients + activations of stage "
                                      f"{worst['stage']} exceed HBM",
        stages=stages)

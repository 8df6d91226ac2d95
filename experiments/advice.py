"""What would bring a plan that does not fit under its part's HBM: each lever a user has
(the distributed optimizer, full remat, cuDNN flash attention, more micro-batches,
bfloat16), applied to the plan's config, kept only where the validation accepts the result,
with the memory per device it would reach by the hand estimate (shapes only: nothing is
compiled). Those that fit come first, then by the memory they reach.

`advise(job)` is what `--dry-run --hardware PART` and the suite's `--plan` print under
"to fit"; the plan records them (plan.json `advice`)."""

from __future__ import annotations

import dataclasses

from jaxdist.errors import UsageError


def _train(**changes):
    return lambda cfg: dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **changes))


def _model(**changes):
    return lambda cfg: dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **changes))


def levers(job) -> list[tuple[str, object]]:
    """(the flags, the config they make) of every lever `job` has not pulled yet."""
    cfg, out = job.cfg, []
    if not cfg.train.distributed_optimizer:
        out.append(("--distributed-optimizer", _train(distributed_optimizer=True)))
    if cfg.train.remat != "full" and getattr(job.model, "remat", None) is not None:
        out.append(("--remat full", _train(remat="full")))
    if getattr(job.model, "attention", None) == "default":
        opts = ",".join(o for o in (cfg.model.model_opts, "attention=cudnn") if o)
        out.append((f"--model-opts {opts}", _model(model_opts=opts)))
    for more in (2, 4):
        n = cfg.train.microbatches * more
        out.append((f"--microbatches {n}", _train(microbatches=n)))
    if job.dtype == "float32":
        out.append(("--dtype bfloat16", _model(dtype="bfloat16")))
    return out


def hand_peak(job) -> float:
    """The hand estimate of the peak bytes per device of `job`'s step (the fullest stage's
    for a pipeline): what the plans' memory verdicts check XLA's figure against."""
    if job.layout.pipelined:
        from jaxdist.predict.stage_memory import stage_memory
        return max(s["total"] for s in stage_memory(job).stages)
    from jaxdist.predict.prediction import hand_memory
    from jaxdist.predict.state import state_bytes
    return hand_memory(job, state_bytes(job), dict(job.shape.axis_sizes)).total_bytes


def advise(job, most: int = 4) -> list:
    """The levers that the validation accepts for `job`, each with the memory it would
    reach (jaxdist.plan.predicted.Advice), those that fit first; at most `most`."""
    from experiments.validation import validate
    from jaxdist.plan.predicted import Advice

    hbm, now = job.part.hbm_bytes, hand_peak(job)
    found = []
    for flags, change in levers(job):
        try:
            derived = validate(change(job.cfg))
        except UsageError:  # a lever this job cannot take (e.g. rows not divisible)
            continue
        reach = hand_peak(derived)
        found.append(Advice(flags=flags, memory_bytes=reach, saves_bytes=now - reach,
                            fits=reach <= hbm))
    found = sorted((a for a in found if a.saves_bytes > 0),
                   key=lambda a: (not a.fits, a.memory_bytes))
    if found and not found[0].fits:  # no lever alone: the levers together, best first
        together = combined(job, [a.flags for a in found], hbm, now)
        if together is not None:
            found.insert(0, together)
    return found[:most]


def combined(job, flags_in_order: list[str], hbm: float, now: float):
    """The levers of `flags_in_order` pulled one after another (each kept where the
    validation accepts it with the ones before), until the job fits; None where it never
    does or where one lever alone is all there is."""
    from experiments.validation import validate
    from jaxdist.plan.predicted import Advice

    change = dict(levers(job))
    cfg, pulled, reach = job.cfg, [], now
    for flags in flags_in_order:
        try:
            derived = validate(change[flags](cfg))
        except UsageError:
            continue
        cfg, reach = derived.cfg, hand_peak(derived)
        pulled.append(flags)
        if reach <= hbm:
            break
    if len(pulled) < 2 or reach > hbm:
        return None
    return Advice(flags=" ".join(pulled), memory_bytes=reach, saves_bytes=now - reach,
                  fits=True)


def with_advice(plan, job):
    """`plan` (a predicted plan) with the checked levers of `job` where it does not fit."""
    if getattr(plan, "prediction", None) is None or plan.prediction.fits is True:
        return plan
    return dataclasses.replace(plan, advice=tuple(advise(job)))

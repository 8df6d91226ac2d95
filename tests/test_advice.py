"""Advice a plan gives is checked before it is given: each "to fit" lever is one the
validation accepts for the job, with the memory it would reach (experiments.advice)."""

from __future__ import annotations

import dataclasses

import pytest

from experiments.advice import advise, hand_peak
from experiments.run import build_parser
from experiments.validation import validate
from jaxdist.config import from_namespace
from jaxdist.errors import UsageError

# Llama-3 70B as tp_pp on data:4,stage:2,tensor:8 at batch 64 and 4 micro-batches, scaled
# down: one row per micro-batch and data shard, so more micro-batches are refused
TP_PP = ["--dry-run", "--hardware", "h100-sxm", "--model", "llama-tiny", "--layout", "tp_pp",
         "--mesh", "data:2,stage:2,tensor:2", "--batch-size", "8", "--microbatches", "4",
         "--dtype", "bfloat16"]
# a one-program layout in float32 without remat
FSDP = ["--dry-run", "--hardware", "h100-sxm", "--model", "llama-tiny", "--layout", "fsdp",
        "--mesh", "1x8", "--batch-size", "16", "--dtype", "float32"]


def job_of(argv, hbm_fraction: float):
    """The validated job of `argv` on a part whose HBM is `hbm_fraction` of its peak."""
    job = validate(from_namespace(build_parser().parse_args(argv)))
    part = dataclasses.replace(job.part, hbm_bytes=hand_peak(job) * hbm_fraction)
    return dataclasses.replace(job, part=part)


@pytest.mark.parametrize("argv", [TP_PP, FSDP], ids=["tp_pp", "fsdp"])
def test_every_lever_given_is_accepted_and_reaches_less_memory(argv):
    job = job_of(argv, 0.9)
    advice = advise(job)
    assert advice, "a plan over HBM by 10% has a lever"
    now = hand_peak(job)
    for a in advice:  # each as the user would paste it after the command
        derived = validate(from_namespace(build_parser().parse_args(argv + a.flags.split())))
        assert hand_peak(derived) == a.memory_bytes < now
        assert a.saves_bytes == now - a.memory_bytes
    assert [a.fits for a in advice] == sorted((a.fits for a in advice), reverse=True)


def test_a_lever_the_validation_refuses_is_not_given():
    """8 rows over 2 data shards at 4 micro-batches is one row each: 8 micro-batches are
    refused by the validation, so the advice does not name them; the distributed optimizer,
    what Megatron runs for such a layout, is named with what it reaches."""
    with pytest.raises(UsageError):
        validate(from_namespace(build_parser().parse_args(TP_PP[:-4] + [
            "--microbatches", "8", "--dtype", "bfloat16"])))
    advice = advise(job_of(TP_PP, 0.9))
    assert not [a for a in advice if a.flags.startswith("--microbatches")]
    dist = [a for a in advice if a.flags == "--distributed-optimizer"]
    assert dist and dist[0].saves_bytes > 0


def test_the_plan_text_names_the_checked_levers():
    from jaxdist.plan.predicted import Advice, next_steps
    from jaxdist.predict import verdict

    over = verdict.MemoryVerdict(state_bytes=1, gradient_bytes=1, temp_bytes=1,
                                 total_bytes=3, hbm_bytes=2, fits=False,
                                 fits_reason="activations exceed HBM", over_by_bytes=1,
                                 headroom_bytes=0)
    lever = Advice(flags="--distributed-optimizer", memory_bytes=2 * 2 ** 30,
                   saves_bytes=2 ** 30, fits=True)
    assert next_steps(over, (lever,)) == [
        "--distributed-optimizer (2.00 GiB per device, fits; hand estimate)"]
    assert next_steps(dataclasses.replace(over, fits=True), (lever,)) == []
    alone = dataclasses.replace(over, fits_reason="the train state alone exceeds HBM")
    assert "shards the state further" in next_steps(alone, (lever,))[0]


def test_levers_together_where_none_fits_alone():
    """No lever alone brings the float32 fsdp step under 60% of its peak; pulled one after
    another, best first, they do, and the plan names them together, first."""
    job = job_of(FSDP, 0.6)
    first = advise(job)[0]
    assert first.fits and len(first.flags.split("--")) > 2, first
    derived = validate(from_namespace(build_parser().parse_args(FSDP + first.flags.split())))
    assert hand_peak(derived) == first.memory_bytes <= job.part.hbm_bytes

"""jaxdist.config's flags view: keys() names every field once, and to_argv() is the inverse of
add_arguments + from_namespace, for a whole RunConfig and for a few settings."""

import dataclasses

from jaxdist.config import (CompilerConfig, DataConfig, LoopConfig, MeshConfig, ModelConfig,
                            OutputConfig, PSConfig, RunConfig, TrainConfig, add_arguments,
                            from_namespace, keys, to_argv)
from jaxdist.errors import OneLineParser
from jaxdist.telemetry import PowerConfig


def parse(argv: list[str]) -> RunConfig:
    parser = OneLineParser()
    add_arguments(parser)
    return from_namespace(parser.parse_args(argv))


# Every section off its defaults: bools both ways, a float, a value that begins with "-" and
# one with "=" in it, and an empty string where the default is not.
CFG = RunConfig(
    mesh=MeshConfig(mesh="2x2x2", platform="cpu"),
    compiler=CompilerConfig(overlap=True, xla_flags="--xla_foo=1 --xla_bar=true"),
    model=ModelConfig(model="mlp-tiny", model_opts="depth=3,width=16", dtype="bfloat16",
                      matmul_precision="highest"),
    train=TrainConfig(layout="zero1", optimizer="sgd", lr=0.0123456789, batch_size=48, seed=-3,
                      microbatches=4, remat="dots"),
    data=DataConfig(dataset="digits", eval_every=5),
    ps=PSConfig(ps_mode="ssp", staleness=5, ps_staleness_lr=True, ps_timeout_s=2.5),
    loop=LoopConfig(warmup=0, steps=7),
    power=PowerConfig(power_sample_ms=20, power_window="one-step"),
    output=OutputConfig(logdir="/tmp/x y", progress=False, profile_steps="2:3"),
)


def test_every_section_differs_from_its_default():
    for section in dataclasses.fields(RunConfig):
        if section.name not in ("dist", "checkpoint"):
            assert getattr(CFG, section.name) != section.default_factory(), section.name


def test_round_trip_of_a_whole_config():
    assert parse(to_argv(CFG)) == CFG
    assert parse(to_argv(RunConfig())) == RunConfig()


def test_some_settings_to_flags():
    assert to_argv({"batch_size": 32, "progress": False, "overlap": True,
                    "xla_flags": "--xla_foo=1"}) == [
        "--batch-size=32", "--no-progress", "--overlap", "--xla-flags=--xla_foo=1"]
    cfg = parse(to_argv({"steps": 3, "layout": "ddp"}))
    assert (cfg.loop.steps, cfg.train.layout, cfg.loop.warmup) == (3, "ddp", 3)


def test_keys_name_every_field_with_its_section_type_and_choices():
    k = keys()
    assert len(k) == sum(len(dataclasses.fields(getattr(RunConfig(), s.name)))
                         for s in dataclasses.fields(RunConfig))
    assert (k["batch_size"].section, k["batch_size"].kind, k["batch_size"].default) == \
        ("train", "int", 64)
    assert k["dtype"].choices == ("float32", "bfloat16", "float8")
    assert k["resume"].kind == "bool" and k["resume"].flag == "--resume"
    assert k["power_window"].section == "power" and k["layout"].choices is None

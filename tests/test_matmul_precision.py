"""`--matmul-precision`: the JAX step is traced under it (every float32 dot of the lowered
and compiled step carries the precision; bfloat16 compute is left alone), experiments.run
records it in results.json, and a bad value is a one-line error."""

import re

import jax
import pytest

from jaxdist.data import TrainStream
from jaxdist.mesh import MeshShape, build_mesh
from jaxdist.record import RunRecord
from jaxdist.train_step import build_program, make_optimizer, put_batch
from models import get_model
from sharding import get_layout
from tests.helpers import cli_main, run_cli

DOT = re.compile(r"stablehlo\.dot_general.*")


def lowered_step(precision: str, dtype: str = "float32", layout: str = "fsdp"):
    cfg = get_model("mlp-tiny")
    mesh = build_mesh(MeshShape(1, 2), jax.devices()[:2])
    program = build_program(cfg, dtype, make_optimizer("sgd", 1e-2), get_layout(layout), mesh,
                            seed=0, matmul_precision=precision)
    batch = put_batch(TrainStream(cfg, None, 8, 0).batch(0), program.batch_sharding)
    return program.step.lower(program.init(), batch)


def dot_precisions(lowered) -> list[str]:
    return [re.search(r"precision = \[(\w+), (\w+)\]", line).group(1)
            for line in DOT.findall(lowered.as_text())]


@pytest.mark.parametrize("precision, expected", [("default", "DEFAULT"), ("high", "HIGH"),
                                                 ("highest", "HIGHEST")])
def test_every_float32_dot_takes_the_precision(precision, expected):
    lowered = lowered_step(precision)
    found = dot_precisions(lowered)
    # mlp-tiny: 3 Linear layers -> 3 forward dots, 3 weight gradients, 2 input gradients
    assert found == [expected] * 8
    hlo = lowered.compile().as_text()
    tagged = len(re.findall(r"operand_precision=\{" + precision + "," + precision + r"\}", hlo))
    assert tagged == (0 if precision == "default" else 8)


def test_bfloat16_compute_is_left_at_the_default():
    # On bf16 operands a non-default precision would make XLA:GPU upcast the dot to float32;
    # PyTorch's setting, likewise, governs float32 matmuls only.
    assert dot_precisions(lowered_step("highest", "bfloat16")) == ["DEFAULT"] * 8


def test_ddp_shard_map_step_takes_the_precision_too():
    assert dot_precisions(lowered_step("highest", layout="ddp")) == ["HIGHEST"] * 8


def test_run_records_the_precision(tmp_path):
    logdir = tmp_path / "run"
    proc = run_cli("--layout", "ddp", "--mesh", "2", "--platform", "cpu", "--model", "mlp-tiny",
                   "--batch-size", "8", "--warmup", "0", "--steps", "1",
                   "--matmul-precision", "highest", "--logdir", str(logdir))
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = RunRecord.load(logdir).results
    assert results["config"]["model"]["matmul_precision"] == "highest"


def test_bad_precision_is_a_one_line_error(tmp_path, capsys):
    logdir = tmp_path / "run"
    proc = cli_main(capsys, "--matmul-precision", "fast", "--logdir", str(logdir))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert "--matmul-precision" in lines[0] and "'fast'" in lines[0]
    assert "default" in lines[0] and "highest" in lines[0]
    assert not logdir.exists()

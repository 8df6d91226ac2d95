"""The resolved job the one validation pass returns (jaxdist/job.py): its kind, on which
experiments.run dispatches, and what it resolved, read from the layout registry and the
model registry instead of the flags."""

import pytest

from experiments.run import build_parser
from experiments.validation import validate
from jaxdist import job
from jaxdist.config import from_namespace
from jaxdist.errors import UsageError


def resolved(*argv: str) -> job.Job:
    return validate(from_namespace(build_parser().parse_args([*argv, "--no-progress"])))


def test_a_mesh_run_a_plan_and_the_parameter_server():
    mesh = resolved("--layout", "tp_pp", "--mesh", "stage:2,tensor:2", "--model", "gpt-tiny",
                    "--batch-size", "8", "--microbatches", "2", "--optimizer", "sgd",
                    "--num-processes", "2", "--coordinator", "localhost:1234",
                    "--process-id", "0")
    assert (mesh.kind, mesh.layout.name, mesh.layout.pipelined, mesh.layout.out_of_process) \
        == (job.MESH, "tp_pp", True, False)
    assert (mesh.model.family, mesh.shape.stage, mesh.shape.tensor, mesh.shape.size) == \
        ("gpt", 2, 2, 4)
    assert (mesh.optimizer, mesh.part, mesh.hosts) == ("sgd", None, 2)
    plan = resolved("--dry-run", "--hardware", "h100-sxm", "--gpus-per-node", "4",
                    "--layout", "fsdp", "--mesh", "2x4", "--model", "gpt-tiny",
                    "--batch-size", "8")
    assert (plan.kind, plan.layout.gathers_weights, plan.part.name, plan.part.gpus_per_node,
            plan.hosts) == (job.PLAN, True, "h100-sxm", 4, 2)
    ps = resolved("--layout", "ps", "--mesh", "2x1", "--model", "mlp-tiny",
                  "--batch-size", "8")
    assert (ps.kind, ps.layout.out_of_process, ps.layout.replicated, ps.hosts) == \
        (job.PS, True, True, 1)
    assert ps.cfg.train.layout == "ps" and ps.notices == ()


def test_the_kind_comes_from_the_registry_and_bad_input_stays_one_line():
    with pytest.raises(UsageError, match="unknown layout 'pss'"):
        resolved("--layout", "pss", "--mesh", "2x1")
    with pytest.raises(UsageError, match="--layout ps needs an explicit mesh"):
        resolved("--layout", "ps", "--mesh", "-1")

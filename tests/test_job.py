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


def test_a_predicted_plan_builds_the_model_config_once(tmp_path, capsys, monkeypatch):
    """The job is resolved once and passed whole: one predicted plan (validation, the plan,
    its prediction, the state and the compiled figures) builds the model config once."""
    from experiments import plan
    from jaxdist import run_model

    calls = []
    build = run_model.build_model
    monkeypatch.setattr(run_model, "build_model",
                        lambda *sections: calls.append(sections) or build(*sections))
    assert plan.main(["--layout", "fsdp", "--mesh", "2x2", "--model", "gpt-tiny",
                      "--model-opts", "depth=4", "--batch-size", "8", "--hardware", "h100-sxm",
                      "--compiler", "cpu"] +
                     ["--logdir", str(tmp_path / "plan"), "--no-progress"]) == 0
    assert "PREDICTED" in capsys.readouterr().out
    assert len(calls) == 1


def test_derived_jobs_keep_what_was_resolved():
    """A run's own prediction (`on_part`), a fallback compile (`with_xla_flags`) and another
    batch (`with_train`) are the same job: the model config and the layout's rules are the
    resolved ones, not derived again."""
    mesh = resolved("--layout", "fsdp", "--mesh", "2x2", "--model", "gpt-tiny",
                    "--batch-size", "8", "--gpus-per-node", "4")
    planned = mesh.on_part("h200")
    assert (planned.kind, planned.part.name, planned.part.gpus_per_node) == (job.PLAN, "h200", 4)
    assert (planned.cfg.output.dry_run, planned.cfg.output.hardware) == (True, "h200")
    assert planned.model is mesh.model and planned.rules is mesh.rules
    flagged = planned.with_xla_flags("--xla_gpu_enable_triton_gemm=false")
    assert flagged.compiler.xla_flags == "--xla_gpu_enable_triton_gemm=false"
    assert flagged.model is mesh.model and flagged.part is planned.part
    wide = mesh.with_train(batch_size=16)
    assert (wide.train.batch_size, mesh.train.batch_size) == (16, 8)
    assert wide.model is mesh.model
    with pytest.raises(UsageError, match="unknown --hardware 'h1000'"):
        mesh.on_part("h1000")

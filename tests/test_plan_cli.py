"""Two entry points on one step: `experiments.plan` plans what `experiments.run --dry-run`
plans, through the same parser, validation pass and plan."""

import json

from tests.helpers import cli_main

ARGS = ["--layout", "fsdp", "--mesh", "2x2", "--model", "gpt-tiny", "--batch-size", "8"]


def test_plan_and_run_dry_run_write_the_same_plan(tmp_path, capsys):
    from experiments import plan

    capsys.readouterr()
    assert plan.main([*ARGS, "--logdir", str(tmp_path / "plan"), "--no-progress"]) == 0
    planned = capsys.readouterr()
    ran = cli_main(capsys, *ARGS, "--dry-run", "--logdir", str(tmp_path / "run"))
    assert ran.returncode == 0
    a, b = (json.loads((tmp_path / d / "dry_run.json").read_text()) for d in ("plan", "run"))
    assert a == b and a["layout"] == "fsdp" and a["mesh"] == {"data": 2, "fsdp": 2}
    assert a["state_bytes_per_device"]["params"] * 4 == a["state_bytes_global"]["params"] > 0
    # the same printed plan, but for the file's folder
    assert planned.out.replace(str(tmp_path / "plan"), "") == \
        ran.stdout.replace(str(tmp_path / "run"), "")


def test_plan_refuses_bad_input_in_one_line(capsys):
    from experiments import plan

    capsys.readouterr()
    assert plan.main([*ARGS, "--lr", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["plan: error: --lr must be a positive finite number, got 0.0"]

"""docs/go2025.md's commands work as written: every `experiments.suite` command, run with
--dry-run (in this process: it lists rows, plans nothing), lists rows, and every
`experiments.plan` command is the command of a row the suite lists (the same settings)."""

import shlex

import pytest

from experiments import run as run_mod
from experiments.suite import cli as suite_cli
from jaxdist.config import from_namespace
from tests.helpers import ROOT

DOC = ROOT / "docs" / "go2025.md"


def doc_commands(module: str) -> list[list[str]]:
    prefix = f".venv/bin/python -m {module} "
    return [shlex.split(line)[3:] for line in DOC.read_text().splitlines()
            if line.startswith(prefix)]


def listed(capsys, argv: list[str]) -> dict[str, list[str]]:
    """{row name: its command's arguments} from the suite's --dry-run of `argv`."""
    capsys.readouterr()
    argv = [*argv, "--dry-run"] if "--dry-run" not in argv else argv
    assert suite_cli.main(argv) == 0, capsys.readouterr().err
    lines = capsys.readouterr().out.strip().splitlines()
    assert "(dry run:" in lines[0]
    return {line.split()[0]: shlex.split(line)[1:] for line in lines[1:-1]}


def config(argv: list[str]):
    return from_namespace(run_mod.build_parser().parse_args(argv))


def test_doc_suite_commands_list_rows(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # --out runs/... is listed, never made
    commands = doc_commands("experiments.suite")
    assert len(commands) >= 9
    for argv in commands:
        rows = listed(capsys, argv)
        assert rows, argv
        if "--models" in argv:
            model = argv[argv.index("--models") + 1]
            assert all(name.startswith(model + "-") for name in rows), argv
    assert not (tmp_path / "runs").exists()


def test_doc_plan_commands_are_rows_of_the_suite(capsys):
    plans = doc_commands("experiments.plan")
    assert len(plans) == 4
    for argv in plans:
        hardware = argv[argv.index("--hardware") + 1]
        rows = listed(capsys, ["--preset", "go2025", "--plan", "--hardware", hardware])
        wanted = config(argv)
        assert any(config(cmd[3:]) == wanted for cmd in rows.values()), argv


@pytest.mark.parametrize("table", ["## 32 H200", "### 1F1B against GPipe, 32 H200",
                                   "## 64 H100", "### 1F1B against GPipe, 64 H100"])
def test_every_table_has_its_commands(table):
    """Under each table: one row's experiments.plan command and a suite subset."""
    text = DOC.read_text().split(table, 1)[1].split("\n#", 1)[0]
    assert "-m experiments.plan --hardware" in text
    assert "-m experiments.suite --preset go2025 --plan" in text and "--models" in text

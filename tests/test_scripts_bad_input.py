"""The benchmarks in scripts/ take bad input as every entry point does: one line, exit 2 (a
count of 0 ended in ZeroDivisionError, IndexError or StatisticsError tracebacks).
bench_ps.py's cases are in test_ps_record.py."""

import pytest

from jaxdist.errors import OneLineParser
from tests.helpers import ROOT, run_refusing_script


def test_require_at_least_names_the_option_and_its_minimum(capsys):
    parser = OneLineParser(prog="bench")
    parser.add_argument("--batch-size", type=int, default=1)
    args = parser.parse_args(["--batch-size", "0"])
    parser.require_at_least(args, batch_size=0)  # at the minimum: nothing said
    with pytest.raises(SystemExit) as e:
        parser.require_at_least(args, batch_size=1)
    assert e.value.code == 2
    assert capsys.readouterr().err == (
        "bench: error: --batch-size must be at least 1, got 0 (see --help)\n")


@pytest.mark.parametrize("script, argv, message", [
    ("bench_loop.py", ["--rounds", "0"], "--rounds must be at least 1, got 0"),
    ("bench_telemetry.py", ["--blocks", "0"], "--blocks must be at least 1, got 0"),
    ("bench_vs_torch.py", ["--repeats", "0"], "--repeats must be at least 1, got 0"),
    ("bench_pp.py", ["--ms", "2"], "every --ms at least S=4"),
    ("compare_compilers.py", ["--batch-size", "0"], "--batch-size must be at least 1"),
    ("suite_cpu.py", ["--top", "0", "tests"], "--top must be at least 1, got 0")])
def test_a_benchmark_refuses_a_count_below_its_minimum(script, argv, message):
    """Refused before jax or the models are imported (bench_pp.py took a second to)."""
    proc = run_refusing_script(ROOT / "scripts" / script, argv)
    assert proc.returncode == 2 and proc.stdout == "[]\n"
    assert len(proc.stderr.splitlines()) == 1 and message in proc.stderr, proc.stderr


@pytest.mark.parametrize("script, argv, message", [
    ("bench_dryrun.py", ["--bogus"], "bench_dryrun.py: error: unrecognized arguments: --bogus"),
    ("gpu_table.py", [], "gpu_table.py: error: the following arguments are required: runs"),
    ("suite_cpu.py", ["--bogus"],
     "suite_cpu.py: error: pytest: unrecognized arguments: --bogus")])
def test_an_unknown_argument_is_one_line_and_exit_2(script, argv, message):
    """argparse's usage line and pytest's usage, ini and rootdir lines (with its exit
    status 4) were printed before the error."""
    proc = run_refusing_script(ROOT / "scripts" / script, argv)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [f"{message} (see --help)"], proc.stderr

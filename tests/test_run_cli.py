"""`python -m experiments.run` as a user runs it: end to end on a simulated 4x8 mesh, and
every kind of bad input (exit 2, one line, no traceback, no run directory)."""

import json
import subprocess
import sys

import jax
import pytest

from jaxdist.record import RunRecord, check
from tests.helpers import child_env, cli_main, read_scalars, run_cli


@pytest.fixture(scope="session")
def e2e(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("runs") / "fsdp-4x8"
    proc = run_cli("--layout", "fsdp", "--mesh", "4x8", "--model", "mlp-tiny",
                   "--batch-size", "64", "--warmup", "2", "--steps", "5",
                   "--logdir", str(logdir))
    return proc, logdir


def test_end_to_end_results_json(e2e):
    proc, logdir = e2e
    assert proc.returncode == 0, proc.stderr
    results = RunRecord.load(logdir).results
    assert check(results) == []
    assert results["layout"] == "fsdp"
    assert results["mesh"] == {"data": 4, "fsdp": 8}
    assert results["env"]["simulated"] is True
    assert results["env"]["num_devices"] == 32
    assert len(results["loss"]) == 7          # warm-up steps included
    assert results["step_time_s"]["n"] == 5
    assert len(results["warmup_step_time_s"]) == 2
    assert results["power"]["available"] is False
    assert "NVML" in results["power"]["reason"]  # the exact reason, never zeros
    assert results["memory"]["measured_peak_bytes"] is None
    assert len(results["memory"]["state_bytes_by_device"]) == 32
    assert results["mfu"]["value"] is None and results["mfu"]["reason"]
    assert results["model"]["params"] == 6922
    assert results["config"]["train"]["layout"] == "fsdp"


def test_end_to_end_console(e2e):
    proc, logdir = e2e
    # The same words as the summary's mesh row, with the form --mesh takes back.
    assert "simulating mesh data=4 x fsdp=8 (--mesh 4x8) on 32 host CPU devices" in proc.stdout
    assert "fsdp on data=4 x fsdp=8 (--mesh 4x8)" in proc.stdout
    assert "not performance figures" in proc.stdout
    assert "step time p50 / p90 / p99" in proc.stdout
    assert f"tensorboard --logdir {logdir}" in proc.stdout


def test_end_to_end_tensorboard(e2e):
    _, logdir = e2e
    results = RunRecord.load(logdir).results
    scalars = read_scalars(logdir)
    loss = scalars["train/loss"]
    assert [step for step, _ in loss] == list(range(7))  # one per step
    assert [v for _, v in loss] == pytest.approx(results["loss"], rel=1e-6)
    assert [s for s, _ in scalars["train/step_time_s"]] == list(range(2, 7))
    assert scalars["trial/samples_per_s"][0][1] == pytest.approx(
        results["throughput"]["samples_per_s"], rel=1e-6)
    assert scalars["trial/state_bytes_per_device"][0][1] == pytest.approx(
        results["memory"]["state_bytes_per_device"])


BAD = [
    (["--layout", "zero9"], "unknown layout 'zero9' (did you mean 'zero1'?); choose from ddp, ep, ep_pp, fsdp, fsdp_pp, fsdp_tp, hsdp, pp, ps, tp, tp_pp, zero1"),
    (["--model", "gpt-huge"], "unknown model 'gpt-huge'; choose from"),
    (["--mesh", "4x"], "axis size ''"),
    (["--mesh", "0x8"], "axis size '0'"),
    (["--mesh", "axb"], "axis size 'a'"),
    (["--mesh", "4x8x2x9x9x2"], "has 6 axes"),
    (["--mesh", "3", "--batch-size", "64"], "global batch 64 is not divisible by the 3 batch shards of mesh 3x1; "
                                        "use a multiple of 3, e.g. --batch-size 63 or 66"),
    (["--steps", "0"], "--steps must be a positive integer"),
    (["--batch-size", "-4"], "--batch-size must be a positive integer"),
    (["--optimizer", "lamb"], "invalid choice: 'lamb'"),
    (["--remat", "custom"], "--remat: invalid choice: 'custom' (choose from 'none', 'full', "
                            "'dots', 'selective_op', 'minimal', 'minimal_flash', "
                            "'save_dot_with_context_except_mlp', 'save_dot_except_mlpwi', "
                            "'save_dot_except_mlp', 'save_qkv_proj', 'save_out_proj', "
                            "'minimal_offloaded', 'qkv_proj_offloaded')"),
    (["--steps", "many"], "invalid int value: 'many'"),
    (["--layout", "pp", "--model", "gpt-tiny", "--mesh", "data:4,stage:2", "--model-opts",
      "depth=2", "--microbatches", "2", "--remat", "qkv_proj_offloaded"],
     "--remat qkv_proj_offloaded moves saved values to host memory, which the pipeline "
     "layouts' stash (device buffers between ticks) cannot hold; use --remat save_qkv_proj "
     "(the same values in device memory) or a layout without stages"),
    (["--model-opts", "depth=2,colour=blue"], "has no option 'colour'"),
    (["--layout", "tp", "--mesh", "2x2x2"], "layout 'tp' applies to gpt, moe models, not 'mlp'"),
    (["--layout", "tp", "--model", "gpt-tiny"], "layout 'tp' splits over the tensor axis, which "
                                                "this mesh does not have (tensor=1: it would "
                                                "run as plain replication); add one, e.g. "
                                                "--mesh 2x2x2"),
    (["--layout", "ep", "--model", "moe-tiny"], "layout 'ep' splits over the expert axis, which "
                                                "this mesh does not have (expert=1: it would run "
                                                "as plain replication); add one, e.g. --mesh "
                                                "2x2x1x2"),
    (["--layout", "ep", "--model", "gpt-tiny"], "layout 'ep' applies to moe models, not 'gpt' "
                                                "(layouts for 'gpt' on this mesh: ddp, fsdp, "
                                                "hsdp, ps, zero1)"),
    (["--layout", "fsdp", "--mesh", "2x2x2"], "layout 'fsdp' uses mesh axes data, fsdp, context; the "
                                              "mesh has tensor=2 (layouts for this mesh: "),
    (["--microbatches", "3"], "not divisible by 8 batch shards x 3 micro-batches"),
    # stage is the fifth short position; the error shows a mesh with one, on these devices
    (["--layout", "pp", "--model", "gpt-tiny", "--mesh", "2x4x1"],
     "layout 'pp' splits over the stage axis, which this mesh does not have (the short "
     "form puts stage fifth: DATAxFSDPxTENSORxEXPERTxSTAGE); e.g. --mesh data:4,stage:2"),
    (["--layout", "tp_pp", "--model", "gpt-tiny", "--mesh", "1x1x4"],
     "e.g. --mesh data:1,stage:2,tensor:2"),
    (["--xla-flags=--xla_bogus_flag=1"], "--xla-flags rejected by XLA: --xla_bogus_flag=1"),
    # The value as its own word, as docs/running.md writes it: it reaches XLA (argparse alone
    # reads "--xla..." as a missing value).
    (["--xla-flags", "--xla_bogus_flag=1"], "--xla-flags rejected by XLA: --xla_bogus_flag=1"),
    (["--xla-flags", "--xla_backend_optimization_level=0 --xla_bogus_flag=1"],
     "--xla-flags rejected by XLA: --xla_bogus_flag=1"),
    # A value XLA cannot read (the message was a line of XLA's flag listing), and one it
    # reads and then aborts compiling with (the run died with SIGABRT, its folder left empty)
    (["--xla-flags", "--xla_cpu_use_thunk_runtime=maybe"],
     "--xla-flags rejected by XLA: --xla_cpu_use_thunk_runtime takes bool values, not 'maybe'"),
    (["--xla-flags", "--xla_cpu_parallel_codegen_split_count=-5"],
     "--xla-flags rejected by XLA: XLA aborted compiling a small program with them "
     "(std::length_error: "),
    # XLA's CPU backend failed the first program with a traceback (measured: 2,048 runs)
    (["--mesh", "2049", "--batch-size", "2049"], "mesh 2049x1 puts 2049 devices in one process; "
                                                 "XLA's CPU backend runs at most 2048 there"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--lr", "inf"], "--lr must be a positive finite number, got inf"),
    (["--seed", "-1"], "--seed must be within 0..4294967295, got -1"),  # was numpy's traceback
    (["--seed", "4294967296"], "--seed must be within 0..4294967295"),  # JAX: seed 0's run
    (["--model-opts", "depth=2,depth=3"], "--model-opts gives depth twice (2 and 3)"),
    (["--init-timeout", "0"], "--init-timeout must be 1 or more seconds, got 0"),
    (["--coordinator", "localhost:99999", "--num-processes", "2", "--process-id", "0"],
     "PORT must be within 1..65534"),  # was bind()'s OverflowError traceback
]


@pytest.mark.parametrize("args, message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input(tmp_path, monkeypatch, capsys, args, message):
    argv = ("--model", "mlp-tiny", "--mesh", "2x4", "--batch-size", "16", *args)
    if any(a.startswith("--xla") for a in args):  # XLA reads its flags once per process
        proc = run_cli(*argv, cwd=tmp_path)
    else:  # main(argv) as the binary calls it, in this process (8 simulated devices)
        monkeypatch.chdir(tmp_path)
        proc = cli_main(capsys, *argv)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []  # no runs/ directory, nothing half-written


def test_unwritable_logdir(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.chdir(tmp_path)
    proc = cli_main(capsys, "--model", "mlp-tiny", "--mesh", "2x4", "--batch-size", "8",
                    "--logdir", str(blocker / "run"))
    assert proc.returncode == 2
    assert "cannot write to --logdir" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_logdir_at_a_file_says_a_folder_is_expected(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.chdir(tmp_path)
    proc = cli_main(capsys, "--model", "mlp-tiny", "--mesh", "2x4", "--batch-size", "8",
                    "--logdir", str(blocker))
    assert proc.returncode == 2
    assert f"cannot write to --logdir {blocker}: {blocker} is a file, not a folder " \
           f"(--logdir takes a folder, new or existing)" in proc.stderr
    assert "File exists" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert blocker.read_text() == "not a directory"


def test_mesh_help_names_the_stage_axis():
    from experiments.run import build_parser
    text = " ".join(build_parser().format_help().split())
    assert "DATAxFSDP[xTENSOR[xEXPERT[xSTAGE]]]" in text and "data:2,stage:4" in text


def _run_importtime(cwd, *argv) -> tuple[int, list[str], set[str]]:
    """The real binary under `python -X importtime`: (exit status, its stderr lines that are
    not import timings, the modules it imported)."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "experiments.run", *argv],
                          cwd=cwd, env=child_env(), capture_output=True, text=True, timeout=120)
    lines = proc.stderr.splitlines()
    errors = [ln for ln in lines if not ln.startswith("import time:")]
    imported = {ln.rsplit("|", 1)[1].strip() for ln in lines
                if ln.startswith("import time:") and ln.count("|") == 2}
    return proc.returncode, errors, imported


def test_a_misspelled_layout_is_refused_before_the_models_are_imported(tmp_path):
    """The real binary (what a user waits for): one line naming the valid layouts, exit 2,
    nothing written, and neither flax nor a model module imported on the way (`python -X
    importtime`): the layout is checked first, which is what keeps it near a second."""
    code, errors, imported = _run_importtime(tmp_path, "--layout", "fsdpp", "--mesh", "4x8")
    assert code == 2 and len(errors) == 1
    assert "unknown layout 'fsdpp' (did you mean 'fsdp'" in errors[0] and "zero1" in errors[0]
    assert "sharding.registry" in imported
    assert sorted(m for m in imported if m.split(".")[0] in ("flax", "optax", "models")) == []
    assert list(tmp_path.iterdir()) == []


def test_a_bad_value_is_refused_before_jax_is_imported(tmp_path):
    """The validation pass checks the flags' values first (experiments/validation.py), so
    `--lr 0` is refused by the real binary without importing jax at all."""
    code, errors, imported = _run_importtime(tmp_path, "--layout", "fsdp", "--mesh", "4x8",
                                             "--lr", "0")
    assert code == 2 and errors == ["run: error: --lr must be a positive finite number, got 0.0"]
    assert "experiments.validation" in imported
    assert sorted(m for m in imported if m.split(".")[0] in ("jax", "jaxlib", "flax")) == []
    assert list(tmp_path.iterdir()) == []


def test_mesh_that_does_not_match_the_devices(tmp_path):
    proc = run_cli("--mesh", "4x8", "--model", "mlp-tiny", cwd=tmp_path,
                   xla_flags="--xla_force_host_platform_device_count=8")
    assert proc.returncode == 2
    assert "mesh 4x8 needs 32 devices but 8 simulated CPU devices are present" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def _user_folder(tmp_path):
    folder = tmp_path / "my-experiment"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    return folder


def test_failed_run_keeps_an_existing_logdir_and_its_files(tmp_path):
    """A run that fails once its directory exists (here: --resume from a checkpoint of
    another model) removes what it wrote, never the folder --logdir named nor its files."""
    from jaxdist.checkpoint import Checkpointer
    from jaxdist.mesh import MeshShape
    from tests.helpers import train

    _, state, _ = train("mlp-tiny", "ddp", MeshShape(2), steps=0)
    ck = Checkpointer(str(tmp_path / "ck"), 1, {"model": "mlp-tiny", "model_opts": "",
                                                  "dataset": "synthetic", "optimizer": "sgd",
                                                  "dtype": "float32"})
    ck.maybe_save(1, state, data_position=1)
    ck.finish()
    folder = _user_folder(tmp_path)
    proc = run_cli("--model", "mlp-tiny", "--mesh", "2", "--batch-size", "4", "--steps", "2",
                   "--logdir", str(folder), "--checkpoint-dir", str(tmp_path / "ck"),
                   "--resume", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "is from an incompatible run (optimizer 'sgd' vs 'adamw')" in proc.stderr
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]  # events file removed
    assert (folder / "notes.txt").read_text() == "mine"


def test_discard_removes_only_what_the_run_created(tmp_path):
    from experiments.run import make_logdir
    from jaxdist.config import OutputConfig, RunConfig

    folder = _user_folder(tmp_path)
    run_dir = make_logdir(RunConfig(output=OutputConfig(logdir=str(folder))), "2")
    (folder / "events.out.tfevents.1").write_text("x")
    (folder / "ps").mkdir()
    (folder / "ps" / "worker0.log").write_text("why it failed")
    (folder / "ps" / "shard0.sock").write_text("")
    run_dir.discard(keep=("ps/*.log",))
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) == [
        "notes.txt", "ps", "ps/worker0.log"]

    new = tmp_path / "a" / "b" / "run"
    run_dir = make_logdir(RunConfig(output=OutputConfig(logdir=str(new))), "2")
    assert run_dir.created == (tmp_path / "a").absolute()
    (new / "results.json.tmp").write_text("{")
    run_dir.discard()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my-experiment"]


def test_an_interrupted_logdir_can_be_reused(tmp_path):
    from experiments.run import make_logdir
    from jaxdist.config import CheckpointConfig, OutputConfig, RunConfig
    from jaxdist.errors import UsageError

    # Reused only to resume it: its own settings plus --resume (tests/test_run_dirs_safety.py).
    ck = CheckpointConfig(checkpoint_dir=str(tmp_path / "ck"), resume=True)
    cfg = RunConfig(output=OutputConfig(logdir=str(tmp_path)), checkpoint=ck)
    (tmp_path / "results.json").write_text(json.dumps(
        {"status": "interrupted", "config": {"checkpoint": {"checkpoint_dir": ck.checkpoint_dir}}}))
    assert make_logdir(cfg, "2").path == tmp_path
    (tmp_path / "results.json").write_text('{"status": "complete"}')
    with pytest.raises(UsageError, match="already holds a finished run"):
        make_logdir(cfg, "2")


def test_a_run_larger_than_the_hosts_free_memory_is_refused(tmp_path, monkeypatch, capsys):
    """CPU devices hold their buffers in this host's RAM: a state and batches, or a step,
    beyond what /proc/meminfo says is available is refused in one line (exit 2, nothing
    kept), rather than the kernel's OOM killer SIGKILLing the run or XLA raising
    RESOURCE_EXHAUSTED with a traceback. The state's bytes are its shards' exact bytes."""
    from jaxdist import host_memory
    from jaxdist.data import NUM_SYNTHETIC_BATCHES
    from jaxdist.mesh import parse_mesh
    from jaxdist.metrics import state_bytes_by_device
    from tests.helpers import train

    _, state, program = train("gpt-tiny", "fsdp", parse_mesh("2x4"), steps=0)
    exact = sum(row["bytes"] for row in state_bytes_by_device(state))
    assert host_memory.state_bytes(program.abstract_state, program.state_shardings,
                                   jax.devices()) == exact > 0
    batch = 8 * 33 * 4  # gpt-tiny: 8 sequences of 32 + 1 int32 tokens
    need = exact + NUM_SYNTHETIC_BATCHES * batch * 2  # on the host and on the devices
    monkeypatch.chdir(tmp_path)
    argv = ("--model", "gpt-tiny", "--layout", "fsdp", "--mesh", "2x4", "--batch-size", "8",
            "--steps", "1", "--warmup", "0")
    monkeypatch.setattr(host_memory, "available_bytes", lambda: need - 1)
    proc = cli_main(capsys, *argv)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"run: error: the train state and {NUM_SYNTHETIC_BATCHES} batch(es) needs "
        f"{need / 2**30:.1f} GiB of host memory on the 8 CPU device(s) of this process, and "
        f"{(need - 1) / 2**30:.1f} GiB is available: use a smaller model, batch or mesh "
        f"(--microbatches), or plan it with --dry-run --hardware PART, which allocates "
        f"nothing"]
    calls = iter([need, 0])  # the state fits; the compiled step then does not
    monkeypatch.setattr(host_memory, "available_bytes", lambda: next(calls))
    proc = cli_main(capsys, *argv)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "run: error: the step (outputs and temporaries, the compiler's figure) needs ")
    assert "Traceback" not in proc.stderr and list(tmp_path.iterdir()) == []


def test_launchers_refuse_more_processes_than_the_host_can_hold(tmp_path, monkeypatch, capsys):
    """experiments.launch and a PS run start their processes on this host, each holding at
    least an interpreter with jax (the floor is below what this one holds): a count beyond
    the host's available memory is one line before any starts."""
    from experiments import launch
    from jaxdist import host_memory

    floor = host_memory.PROCESS_FLOOR_BYTES
    assert host_memory.private_bytes() > floor  # this process: jax, and much more
    host_memory.check_processes(10, "x", available=10 * floor)
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 11 * floor)
    monkeypatch.chdir(tmp_path)
    tail = (f"12 processes, each holding at least 60 MiB (Python with jax or torch "
            f"imported), {12 * floor / 2**30:.1f} GiB in all, and this host has "
            f"{11 * floor / 2**30:.1f} GiB available; start fewer")
    assert launch.main(["--processes", "12", "--", "--model", "mlp-tiny", "--mesh", "12x1",
                        "--batch-size", "12"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"launch: error: --processes 12 (experiments.run each): {tail}"]
    proc = cli_main(capsys, "--layout", "ps", "--mesh", "8x1", "--ps-shards", "4",
                    "--model", "mlp-tiny", "--batch-size", "16")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"run: error: --layout ps --mesh 8x1 --ps-shards 4 (8 workers and 4 shard servers on "
        f"this host): {tail}"]
    assert list(tmp_path.iterdir()) == []  # torch_run's --nproc: tests/test_torch_ref.py


def test_a_ps_job_larger_than_the_host_is_refused_before_it_starts(tmp_path, monkeypatch,
                                                                   capsys):
    """Each PS worker builds the global batch pool: a batch of 10^10 (19,670 GiB over two
    workers) failed in a worker with numpy's MemoryError after the job had started."""
    monkeypatch.chdir(tmp_path)
    proc = cli_main(capsys, "--layout", "ps", "--mesh", "2x1", "--model", "mlp-tiny",
                    "--batch-size", str(10 ** 10))
    (line,) = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and line.startswith(
        "run: error: the PS job's buffers (2 workers, each with 8 global batch(es) and 3 "
        "copies of the parameters; the shards' copy) needs 1966")  # 10^10 x 132 B x 8 x 2
    assert line.endswith("GiB is available: use a smaller model or batch, or fewer processes")
    assert list(tmp_path.iterdir()) == []


def test_every_entry_point_refuses_a_path_no_file_can_have(tmp_path, monkeypatch, capsys):
    """A name longer than the file system allows or a symlink loop, in any option that names
    a file or folder (jaxdist.errors.path_arg): one line, exit 2, nothing written; each was
    an OSError traceback from wherever the path was first read."""
    from analysis import compare, go2025, plan_rank, report
    from experiments import predict, run, torch_run
    from experiments.suite import cli as suite

    monkeypatch.chdir(tmp_path)
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    long = "x" * 300
    cases = [(run.main, ["--logdir", long]), (run.main, ["--checkpoint-dir", long]),
             (run.main, ["--data-dir", "loop1"]), (torch_run.main, ["--logdir", long]),
             (suite.main, ["--preset", long]), (suite.main, ["--out", "loop1/x"]),
             (report.main, [long]), (report.main, [".", "--out", long]),
             (compare.main, [long]), (compare.main, [".", "--baselines", "loop1"]),
             (predict.main, ["--validate", "--json", long]), (plan_rank.main, [long]),
             (go2025.main, ["loop1", "."])]
    for main, argv in cases:
        try:
            code = main(argv)
        except SystemExit as e:  # the parsers' one line
            code = e.code
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1, (argv, err)
        assert err[0].endswith(("File name too long", "File name too long (see --help)",
                                "Too many levels of symbolic links",
                                "Too many levels of symbolic links (see --help)")), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loop1", "loop2"]

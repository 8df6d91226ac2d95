"""The PyTorch twins (models/torch_ref.py) and the live reference launcher
(experiments/torch_run.py): equal parameter counts, equal losses from the same weights and
batches, and a 2-process DDP / FSDP2 run on CPU that writes a schema-valid results.json."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdist.record import RunRecord, check
from models import get_model
from tests.helpers import ROOT, child_env, run_refusing_script

torch = pytest.importorskip("torch", reason="PyTorch is not installed: make test installs "
                            "torch==2.13.0 (pip install torch==2.13.0 by hand)")
from models import torch_ref  # noqa: E402

SIZES = ["mlp-tiny", "mlp-10m", "gpt-tiny", "gpt-small", "gpt", "resnet-tiny", "resnet18",
         "resnet50"]


def jax_param_count(cfg) -> int:
    abstract = nnx.eval_shape(lambda: cfg.build(nnx.Rngs(0), jnp.float32))
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


@pytest.mark.parametrize("name", SIZES)
def test_equal_parameter_counts(name):
    cfg = get_model(name)
    with torch.device("meta"):  # shapes only: resnet50 costs nothing to build
        model = torch_ref.build(torch_ref.arch_spec(cfg))
    assert torch_ref.param_count(model) == jax_param_count(cfg)


@pytest.mark.parametrize("name", ["mlp-tiny", "gpt-tiny", "resnet-tiny"])
def test_same_weights_same_loss(name):
    """The JAX initial state loads into the twin (every key, every shape) and both
    frameworks compute the same training-mode loss on the same synthetic batch."""
    cfg = get_model(name)
    spec = torch_ref.arch_spec(cfg)
    jax_model = cfg.build(nnx.Rngs(3), jnp.float32)  # as torch_run.jax_initial_state does
    state = torch_ref.state_from_nnx(jax_model)
    model = torch_ref.build(spec)
    expected = {k for k in model.state_dict() if not k.endswith("num_batches_tracked")}
    assert set(state) == expected
    torch_ref.load_state(model, state)
    model.train()

    jax_model.train()
    batch = cfg.synthetic_batch(np.random.default_rng([0, 0]), 8)
    jax_loss = float(nnx.jit(cfg.loss)(jax_model, {k: jnp.asarray(v) for k, v in batch.items()}))
    with torch.no_grad():
        torch_loss = torch_ref.loss(spec, model, torch_ref.to_torch_batch(spec, batch)).item()
    assert torch_loss == pytest.approx(jax_loss, abs=2e-5)


def test_same_padding_matches_jax_output_shape():
    spec = torch_ref.arch_spec(get_model("resnet-tiny"))
    model = torch_ref.build(spec)
    x = torch.zeros(2, 3, 32, 32)
    assert model(x).shape == (2, 10)


def torch_run(*args, timeout=240, env_extra=None):
    env = child_env()
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "experiments.torch_run", *args,
                           "--no-progress"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("torch")
    out = {}
    # fsdp at --matmul-precision highest: on CPU it changes nothing (it sets cuBLAS and cuDNN
    # modes), so the two runs' losses still agree.
    for strategy, precision in (("ddp", "default"), ("fsdp", "highest")):
        logdir = base / strategy
        proc = torch_run("--strategy", strategy, "--nproc", "2", "--model", "mlp-tiny",
                         "--batch-size", "32", "--warmup", "1", "--steps", "3",
                         "--matmul-precision", precision, "--logdir", str(logdir))
        out[strategy] = (proc, logdir)
    return out


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_torch_run_writes_schema_valid_results(runs, strategy):
    proc, logdir = runs[strategy]
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = RunRecord.load(logdir).results
    assert check(results) == []
    assert results["framework"] == "pytorch"
    assert results["layout"] == strategy
    # built by jaxdist.record_builder.build, as mesh and ps records are (tests/test_record.py)
    from tests.test_record import BUILT
    assert list(results)[:len(BUILT)] == BUILT and "torch" in list(results)[len(BUILT):]
    assert (results["status"], results["steps_done"]) == ("complete", 4)
    assert results["env"]["backend"] == "cpu" and results["env"]["simulated"] is False
    assert results["env"]["torch_version"].startswith("2.")
    assert results["env"]["num_processes"] == 2
    assert results["env"]["threads_per_process"] >= 1
    assert results["torch"]["threads_per_process"] == results["env"]["threads_per_process"]
    assert results["memory"]["compiled"] is None
    assert results["memory"]["measured_peak_bytes"] is None
    assert results["memory"]["measured_peak_reason"]
    assert results["power"]["available"] is False and results["power"]["reason"]
    assert results["model"]["params"] == 6922
    assert results["step_time_s"]["n"] == 3 and len(results["warmup_step_time_s"]) == 1
    assert len(results["loss"]) == 4
    assert results["config"]["train"]["batch_size"] == 32
    # eager PyTorch compiles nothing: no compile time, and a reason instead of 0.0
    assert results["compile_s"] is None and "nothing is compiled" in results["compile_note"]
    assert re.search(r"\n  compile +n/a \(eager PyTorch: nothing is compiled", proc.stdout)
    # the precision as recorded, and torch's settings as read back in the ranks
    precision, setting = {"ddp": ("default", "tf32"), "fsdp": ("highest", "ieee")}[strategy]
    assert results["config"]["model"]["matmul_precision"] == precision
    assert results["torch"]["fp32_precision"] == {"cuda_matmul": setting, "cudnn_conv": setting}
    shard = results["sharding"]
    if strategy == "ddp":
        assert shard["sharded_bytes"] == 0 and shard["replicated_leaves"] > 0
    else:
        assert shard["parts"]["params"]["replicated_bytes"] == 0
        assert shard["sharded_bytes"] > 0
    by_device = results["memory"]["state_bytes_by_device"]
    assert len(by_device) == 2


def test_ddp_and_fsdp_agree_and_fsdp_halves_state(runs):
    ddp = RunRecord.load(runs["ddp"][1]).results
    fsdp = RunRecord.load(runs["fsdp"][1]).results
    assert fsdp["loss"] == pytest.approx(ddp["loss"], rel=1e-5)
    # Same weights, same data: the first loss is the JAX model's (see test_compare too).
    assert fsdp["memory"]["state_bytes_per_device"] < 0.6 * ddp["memory"]["state_bytes_per_device"]


def test_a_rank_measures_power_like_a_mesh_run(tmp_path, monkeypatch):
    """Each rank samples its GPU with jaxdist.telemetry (a scripted fake NVML at 300 W here:
    no GPU on this machine) over the timed steps, as a mesh run does; the launcher adds the
    ranks' blocks up (jaxdist.telemetry.combine) into the record, its summary line and
    TensorBoard. One rank, in this process: gloo with a world of one."""
    from experiments import torch_run, torch_worker
    from jaxdist import telemetry
    from jaxdist.summary import format_summary
    from jaxdist.telemetry import fake
    from tests.helpers import avg_power_tolerance, read_scalars

    real = telemetry.create_monitor

    def with_fake(cfg, backend=None, *, devices=None, **kw):
        return real(cfg, fake.fake_backend([fake.FakeGPU(power_w=300.0)]), devices=None, **kw)
    monkeypatch.setattr(telemetry, "create_monitor", with_fake)
    args = torch_run.build_parser().parse_args(
        ["--nproc", "1", "--model", "mlp-tiny", "--batch-size", "8", "--warmup", "1",
         "--steps", "30", "--power-sample-ms", "5", "--no-progress"])
    model_cfg, device = torch_run.validate(args)
    cfg = torch_run.run_config(args)
    logdir, work = tmp_path / "run", tmp_path / "work"
    work.mkdir()
    job = torch_run.write_job(args, model_cfg, device, work, logdir)
    report = torch_worker.run_rank(0, job)
    mine = report["power"]
    assert mine["available"] is True, mine.get("reason")
    assert mine["window"]["steps"] == 30 and mine["window"]["samples"] == 30 * 8
    assert mine["window"]["window_steps"] == [1, 30]
    assert mine["avg_w"] == pytest.approx(300.0, rel=avg_power_tolerance(mine))
    assert (logdir / "rank0" / "power" / "gpu_power_0.csv").stat().st_size > 0
    results = torch_run.assemble_results(cfg, model_cfg, job, [report])
    torch_run.write_outputs(cfg, logdir, results)
    power = RunRecord.load(logdir).results["power"]
    assert power["available"] and power["energy_j"] == mine["energy_j"]
    assert power["window"]["per_rank"][0]["rank"] == 0 and power["gpus"][0]["rank"] == 0
    assert re.search(r"\n  power / energy +avg \d+ W, [0-9.]+ J/step", format_summary(results))
    assert "power/energy_per_step_j" in read_scalars(logdir)


BAD = [
    (["--batch-size", "33"], "global batch 33 is not divisible by --nproc 2"),
    (["--model", "gpt-huge"], "unknown model 'gpt-huge'"),
    (["--steps", "0"], "--steps must be a positive integer"),
    (["--strategy", "zero9"], "invalid choice: 'zero9'"),
    (["--device", "cuda"], "needs 2 GPUs"),
    (["--matmul-precision", "tf32"], "--matmul-precision: invalid choice: 'tf32'"),
    (["--power-sample-ms", "0"], "--power-sample-ms must be 1..60000, got 0"),
    (["--lr", "inf"], "--lr must be a positive finite number, got inf"),
    (["--seed", "-1"], "--seed must be within 0..4294967295, got -1"),
    (["--timeout-s", "inf"], "--timeout-s must be a positive finite number, got inf"),
    # every rank failed creating its threads (EAGAIN), each with a traceback
    (["--threads", "100000"], "--threads must be 0 (automatic) to this host's "),
    # numpy's MemoryError traceback in the launcher, building the batches
    (["--batch-size", str(10 ** 10)], "the pool of 8 global batches the ranks train on needs "
                                       "9834"),
    # llama is of the gpt family (its layouts, its data) but has its own blocks: the ranks
    # failed loading the weights, each with a traceback
    (["--model", "llama-tiny"], "model 'llama-tiny' (Llama, not GPT's blocks) has no PyTorch "
                                "twin"),
]


def test_more_ranks_than_the_host_can_hold_are_refused(tmp_path, monkeypatch, capsys):
    """Each rank holds at least an interpreter with jax's floor (host_memory): --nproc
    beyond the host's available memory is one line before any rank starts."""
    from experiments.torch_run import main
    from jaxdist import host_memory

    floor = host_memory.PROCESS_FLOOR_BYTES
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 11 * floor)
    logdir = tmp_path / "run"
    assert main(["--nproc", "16", "--model", "mlp-tiny", "--batch-size", "16", "--logdir",
                 str(logdir)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"torch_run: error: --nproc 16 (a PyTorch rank each): 16 processes, each holding at "
        f"least 60 MiB (Python with jax or torch imported), {16 * floor / 2**30:.1f} GiB in "
        f"all, and this host has {11 * floor / 2**30:.1f} GiB available; start fewer"]
    assert not logdir.exists()


@pytest.mark.parametrize("args, message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input(tmp_path, capsys, args, message):
    if "--device" in args and torch.cuda.device_count() >= 2:
        pytest.skip("this host has the GPUs")
    from experiments.torch_run import main

    logdir = tmp_path / "run"
    try:
        code = main(["--model", "mlp-tiny", "--logdir", str(logdir), "--no-progress", *args])
    except SystemExit as e:  # argparse errors
        code = e.code
    assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines
    assert not logdir.exists()


def test_torch_missing_names_the_extra(tmp_path):
    code = ("import sys; sys.modules['torch'] = None; "
            "from experiments.torch_run import main; sys.exit(main(['--model', 'mlp-tiny']))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env=child_env())
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "pip install -e '.[torch]'" in lines[0] and "torch==2.13.0" in lines[0]


@pytest.mark.parametrize("argv, message", [(["--nproc", "0"], "--nproc must be a positive "
                                            "integer, got 0"),
                                           (["--lr", "nan"], "--lr must be a positive finite")])
def test_wrong_numbers_are_refused_before_jax_and_flax(argv, message):
    """The flags' values are checked before torch and the models are imported (it took ~3 s
    of imports to refuse --nproc 0)."""
    proc = run_refusing_script(ROOT / "experiments" / "torch_run.py", argv)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr
    assert proc.stdout == "[]\n"


def test_ctrl_c_stops_the_ranks_in_one_line(tmp_path):
    """Ctrl-C during the ranks' run: exit 130, one line saying no record was written, no
    traceback (a KeyboardInterrupt traceback from procs.watch before), no run folder, and no
    rank left running."""
    import signal

    logdir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "experiments.torch_run", "--model",
                             "mlp-tiny", "--steps", "100000", "--logdir", str(logdir),
                             "--no-progress"], cwd=ROOT, env=child_env(TMPDIR=str(tmp_path)),
                            text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not logdir.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(2)  # the ranks start
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == [
        "torch_run: interrupted (SIGINT): the ranks were stopped; the PyTorch reference "
        "writes its record when its ranks finish, so none was written"], err
    assert not logdir.exists()
    assert [p for p in Path("/proc").glob("[0-9]*/cmdline")  # the ranks' job is under tmp
            if str(tmp_path) in _read(p)] == []


def _read(path: Path) -> str:
    try:
        return path.read_bytes().decode(errors="replace")
    except OSError:  # the process is gone
        return ""

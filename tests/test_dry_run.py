"""--dry-run: per-device state bytes of full-size models from shapes alone."""

import json
import subprocess
import sys

import jax
import pytest

from jaxdist import state_shapes
from jaxdist.plan import shapes as dryrun
from jaxdist.program import compiled
from jaxdist.config import ModelConfig, RunConfig, TrainConfig
from jaxdist.mesh import parse_mesh
from jaxdist.train_step import abstract_train_state, make_optimizer
from tests.helpers import ROOT, child_env, cli_main, job_of, run_cli


def test_llama3_70b_fsdp_on_4x8(tmp_path):
    proc = run_cli("--dry-run", "--model", "llama3-70b", "--layout", "fsdp", "--mesh", "4x8",
                   "--logdir", str(tmp_path / "plan"), timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "nothing allocated" in proc.stdout
    plan = json.loads((tmp_path / "plan" / "dry_run.json").read_text())
    assert plan["model"]["params"] == 70_553_706_496  # Meta's Llama 3 70B: 70.6B
    total = sum(plan["state_bytes_global"].values())
    assert plan["state_bytes_global"]["opt"] == pytest.approx(2 * plan["state_bytes_global"]["params"], rel=1e-6)
    per_device = plan["state_bytes_per_device"]["total"]
    replicated = plan["sharding"]["replicated_bytes"]
    assert per_device <= total / 32 * 1.01 + replicated
    assert per_device >= total / 32


def test_dry_run_needs_an_explicit_mesh(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    proc = cli_main(capsys, "--dry-run", "--model", "gpt-tiny", "--mesh", "-1")
    assert proc.returncode == 2
    assert "--dry-run needs an explicit mesh" in proc.stderr



# Plans are computed from a decoder's depth-1 and depth-2 shapes stacked to full depth
# (jaxdist/plan/shapes.py). These bytes are the ones the whole-model trace gives
# (scripts/bench_dryrun.py --compare-full-trace): 24.64 GiB and 61.28 GiB (docs/running.md).
# gpt3-175b's vocabulary (50257) is split over tensor 8 stored padded to 8 x 6283 rows
# (sharding/padding.py).
PLANS = {
    ("llama3-70b", "fsdp", "4x8"): (70_553_706_496, {
        "params": 8_819_213_312, "model_state": 0, "opt": 17_638_426_628,
        "total": 26_457_639_940}),
    ("gpt3-175b", "fsdp_tp", "1x4x8"): (175_221_867_601, {
        "params": 21_934_105_132, "model_state": 0, "opt": 43_868_210_268,
        "total": 65_802_315_400}),
}


@pytest.mark.parametrize("model,layout,mesh", list(PLANS))
def test_full_size_plans_are_exact(model, layout, mesh):
    cfg = RunConfig(model=ModelConfig(model=model), train=TrainConfig(layout=layout))
    plan = dryrun.plan(job_of(cfg, parse_mesh(mesh))).to_json()
    params, per_device = PLANS[model, layout, mesh]
    assert plan["model"]["params"] == params
    assert plan["state_bytes_per_device"] == per_device


@pytest.mark.parametrize("model,opts", [("gpt-small", ""), ("llama-tiny", "depth=5"),
                                        ("moe-small", ""), ("gpt-tiny", "depth=3")])
def test_stacked_state_is_the_whole_model_trace(model, opts):
    """Same paths, Variable types, shapes and dtypes as tracing the whole constructor, so
    every layout sees the same input."""
    cfg = RunConfig(model=ModelConfig(model=model, model_opts=opts))
    model_cfg = job_of(cfg).model
    tx = make_optimizer("adamw", 1e-3)
    assert state_shapes._stacked_model_state(model_cfg, "float32") is not None  # the fast path
    stacked = state_shapes.planning_state(model_cfg, "float32", tx)
    whole = abstract_train_state(model_cfg, "float32", tx)
    assert jax.tree.structure(stacked) == jax.tree.structure(whole)
    assert [(x.shape, x.dtype) for x in jax.tree.leaves(stacked)] == \
        [(x.shape, x.dtype) for x in jax.tree.leaves(whole)]


def test_models_that_are_not_a_stack_are_traced_whole():
    for model in ("mlp-tiny", "resnet-tiny", "gpt-tiny"):  # gpt-tiny: depth 2, nothing to gain
        model_cfg = job_of(RunConfig(model=ModelConfig(model=model))).model
        assert state_shapes._stacked_model_state(model_cfg, "float32") is None


@pytest.mark.parametrize("compiler", ["auto", "cpu"])
def test_plan_beyond_xla_cpu_says_to_install_the_gpu_compiler(tmp_path, monkeypatch, capsys,
                                                              compiler):
    """A plan for more devices than XLA:CPU compiles for (jaxdist.devices
    CPU_DEVICES_PER_PROCESS), with the GPU compiler absent (simulated, as where `make
    gpu-compiler` was not run) or --compiler cpu: one line that says XLA:GPU is needed and
    how to get it, before anything is compiled; it was XLA's "Multiprocess computations
    aren't implemented on the CPU backend" after the lowering."""
    from jaxdist.devices import CPU_DEVICES_PER_PROCESS
    from jaxdist.program import compiled

    missing = f"the GPU compiler (jax-cuda12 plugin) is not installed; {compiled.INSTALL_HINT}"
    monkeypatch.setattr(compiled, "gpu_compiler_missing", lambda: missing)
    n = 2 * CPU_DEVICES_PER_PROCESS
    proc = cli_main(capsys, "--dry-run", "--hardware", "h100-sxm", "--model", "gpt-tiny",
                    "--layout", "fsdp", "--mesh", str(n), "--batch-size", str(n),
                    "--compiler", compiler, "--logdir", str(tmp_path / "plan"))
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("run: error: ")
    assert f"at most {CPU_DEVICES_PER_PROCESS} devices" in proc.stderr
    assert "`make gpu-compiler`" in proc.stderr and str(n) in proc.stderr
    assert "Multiprocess" not in proc.stderr and not (tmp_path / "plan").exists()


def test_billion_block_model_is_refused_at_once(tmp_path):
    """--model-opts depth=1000000000: a plan and a run on CPU devices each refused in one line
    with the estimate, in under 5 s, nothing written; the plan grew to 24 GB until the OOM
    killer ended it, and the run left an empty folder. In a child (bounded by its timeout:
    the unguarded build would take the host's memory)."""
    code = (
        "import sys, time\nfrom experiments.run import main\n"
        "for extra in (['--dry-run'], ['--platform', 'cpu', '--steps', '1']):\n"
        "    start = time.perf_counter()\n"
        "    code = main(['--model', 'gpt-tiny', '--mesh', '8', '--model-opts',\n"
        "                 'depth=1000000000', '--no-progress', '--logdir', sys.argv[1], *extra])\n"
        "    print(code, round(time.perf_counter() - start, 2))\n")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "out")], cwd=ROOT,
                          env=child_env(), capture_output=True, text=True, timeout=60)
    results = [line.split() for line in proc.stdout.splitlines()]
    assert [r[0] for r in results] == ["2", "2"], proc.stdout + proc.stderr[-2000:]
    assert all(float(seconds) < 5 for _, seconds in results), results
    lines = proc.stderr.splitlines()
    assert len(lines) == 2 and all(
        line.startswith("run: error: --model gpt-tiny at depth 1,000,000,000 needs about ")
        and "GiB is available: give a smaller depth in --model-opts" in line
        for line in lines), proc.stderr
    assert "its plan" in lines[0] and "its build (the parameters" in lines[1]
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(compiled.gpu_compiler_missing() is not None,
                    reason=str(compiled.gpu_compiler_missing()))
def test_a_4096_device_plan_leaves_no_thread_per_device(tmp_path):
    """A --hardware plan compiled by XLA:GPU for 4,096 devices: the process holds a few
    threads once its plan is written, not one per device (XLA's CPU client keeps one per
    simulated device; given the mesh's 16,384, a 16,384-GPU plan wrote its plan and did not
    exit in 20 minutes), and it exits on its own. Counted in a child: the CPU device count
    is the process's own."""
    code = ("import os, sys, threading\nfrom experiments.run import main\n"
            "rc = main(['--dry-run', '--hardware', 'h100-sxm', '--model', 'mlp-tiny',\n"
            "           '--layout', 'ddp', '--mesh', '4096', '--batch-size', '4096',\n"
            "           '--logdir', sys.argv[1]])\n"
            "print(rc, threading.active_count(), len(os.listdir('/proc/self/task')))\n")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "plan")], cwd=ROOT,
                          env=child_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rc, python_threads, tasks = map(int, proc.stdout.splitlines()[-1].split())
    assert rc == 0 and (tmp_path / "plan" / "plan.json").exists()
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert plan["compiled"]["compiler"].startswith("XLA:GPU") and plan["hardware"]["nodes"] == 512
    assert python_threads == 1
    assert tasks < 64, f"{tasks} threads after a 4,096-device plan"

"""The sbatch form of the main job on a real one-node SLURM (scripts/slurm/cpu_1node.sbatch,
2 tasks of 4 simulated CPU devices): submitted with `sbatch --wait`, with an explicit
coordinator and with JAX's SLURM auto-detection, each run's losses equal one process holding
all 8 devices. Skipped, saying why, where no SLURM answers (scripts/slurm/one_node_cluster.sh
starts one; docs/multi-host.md)."""

import shutil
import subprocess

import pytest

from jaxdist.record import RunRecord
from tests.helpers import ROOT, child_env, cli_main


def _slurm_missing() -> str | None:
    if shutil.which("sbatch") is None:
        return "no sbatch here (a one-node SLURM: scripts/slurm/one_node_cluster.sh start)"
    try:
        state = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True,
                               timeout=10).stdout.split()
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"sinfo did not answer ({e})"
    if not {"idle", "mixed"} & set(state):
        return f"no idle SLURM node (sinfo: {state or 'nothing'})"
    return None


pytestmark = pytest.mark.skipif(_slurm_missing() is not None, reason=str(_slurm_missing()))
STEPS = 6


@pytest.mark.parametrize("coord", ["explicit", "auto"])
def test_sbatch_two_tasks_equal_one_process(coord, tmp_path, capsys):
    logdir = tmp_path / "slurm"
    env = child_env(COORD=coord, LOGDIR=str(logdir), STEPS=str(STEPS))
    job = subprocess.run(["sbatch", "--wait", f"--output={tmp_path}/slurm-%j.out",
                          str(ROOT / "scripts/slurm/cpu_1node.sbatch")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = "".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))
    assert job.returncode == 0, job.stderr + out[-3000:]
    r = RunRecord.load(logdir).results
    assert r["status"] == "complete" and r["env"]["num_processes"] == 2
    one = cli_main(capsys, "--layout", "fsdp", "--mesh", "2x4", "--model", "mlp-tiny",
                   "--platform", "cpu", "--batch-size", "16", "--warmup", "1", "--steps",
                   str(STEPS), "--logdir", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr
    alone = RunRecord.load(tmp_path / "one").results
    assert len(r["loss"]) == 1 + STEPS  # the warm-up step, then the timed ones
    assert r["loss"] == pytest.approx(alone["loss"], rel=1e-6)

"""--dry-run: per-device state bytes of full-size models from shapes alone."""

import json

import pytest

from tests.helpers import run_cli


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


def test_dry_run_needs_an_explicit_mesh(tmp_path):
    proc = run_cli("--dry-run", "--model", "gpt-tiny", "--mesh", "-1", cwd=tmp_path)
    assert proc.returncode == 2
    assert "--dry-run needs an explicit mesh" in proc.stderr

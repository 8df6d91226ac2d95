"""The HParams page as a user first sees it, in headless Chromium: ddp, zero1 and fsdp of one
model run into a fresh runs folder with `experiments.run` (its own folder names), TensorBoard
started on it, and the page at 1600 x 900 saved as a PNG. Also prints each run's Trial ID and
the note of identical losses, read back from TensorBoard's HTTP data API.

    .venv/bin/python scripts/tensorboard_shot.py --out docs/img/tensorboard-hparams.png

Needs Chromium (`apt-get install chromium` on Debian); about a minute and a half here.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = ("ddp", "zero1", "fsdp")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(base: str, path: str):
    with urllib.request.urlopen(base + path, timeout=30) as response:
        return json.loads(response.read())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tensorboard_shot", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="tensorboard-hparams.png", help="the PNG to write")
    parser.add_argument("--model", default="gpt-tiny")
    parser.add_argument("--steps", default="20")
    args = parser.parse_args(argv)
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("tensorboard_shot: error: no chromium on PATH (apt-get install chromium)",
              file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="tb-shot-"))
    for layout in LAYOUTS:
        subprocess.run([sys.executable, "-m", "experiments.run", "--layout", layout, "--mesh",
                        "2x4", "--model", args.model, "--steps", args.steps, "--no-progress"],
                       cwd=work, check=True, stdout=subprocess.DEVNULL,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    exe = Path(sys.executable).parent / "tensorboard"
    tb = subprocess.Popen([str(exe), "--logdir", "runs", "--host", "127.0.0.1", "--port",
                           str(port), "--load_fast=false"], cwd=work,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                          start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                runs = get(base, "/data/runs")
                if len(runs) == len(LAYOUTS):
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("tensorboard_shot: TensorBoard did not serve the runs")
            time.sleep(1)
        print("Trial IDs:", ", ".join(sorted(runs)))
        for run in runs:
            tags = get(base, f"/data/plugin/text/tags").get(run, [])
            if "note/text_summary" in tags:
                note = get(base, f"/data/plugin/text/text?run={run}&tag=note/text_summary")
                print(f"note in {run}: {note[0]['text']}")
        out = Path(args.out).absolute()
        subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu",
                        "--hide-scrollbars", "--window-size=1600,900",
                        "--virtual-time-budget=20000", f"--screenshot={out}",
                        f"{base}/#hparams"], check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=180)
        print(f"wrote {out}")
    finally:
        os.killpg(tb.pid, signal.SIGTERM)
        tb.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

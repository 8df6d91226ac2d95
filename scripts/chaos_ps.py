"""Chaos test of the parameter server: real shard servers and workers on 127.0.0.1, real
signals, real malformed bytes. Prints one row per fault or input:

    fault or input | expected | observed | parameters intact | seconds to detect | orphans

and exits 0 only when every row holds.

    python scripts/chaos_ps.py            # every mode x {kill -9, SIGSTOP} x {shard, worker}
    python scripts/chaos_ps.py --quick    # one of each kind of fault (tests: under 60 s)

Server rows start `python -m ps.server` processes and talk to them directly (the malformed
corpus, pushes from the future, overflowing gradients, idle streams, wire edge cases;
scripts/chaos_server_rows.py). Run
rows start `python -m experiments.run --layout ps` (the launcher with its shards and
workers), wait until every worker is training, send the signal to one child, and check how
the launcher ends: the exit status, the line that names the culprit, the seconds from the
signal to the exit, and that no process of the run is left (/proc).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import numpy as np  # noqa: E402

from jaxdist import procs  # noqa: E402
from jaxdist.errors import OneLineParser  # noqa: E402
from jaxdist.record import read_results  # noqa: E402
from ps import wire  # noqa: E402
from ps.security import TOKEN_ENV  # noqa: E402
from ps.shard_client import ShardClient  # noqa: E402
from chaos_server_rows import Row, env, model_flags, server_rows  # noqa: E402

LAUNCHERS: list[subprocess.Popen] = []  # killed (with their groups) however the script ends


def kill_launchers() -> None:
    for proc in LAUNCHERS:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


# -- run rows: the launcher, its children, and a signal -----------------------------------

# A run has a token by default (ps.security): give it one this script knows, to watch it.
RUN_TOKEN = "chaos-run-token-of-32-characters"


def training(psdir: Path, workers: int = 2, min_step: int = 3) -> bool:
    """Every worker has pushed at least `min_step` (asked of shard 0)."""
    ready = psdir / "shard0.ready.json"
    if not ready.exists():
        return False
    try:
        port = json.loads(ready.read_text())["port"]
    except (OSError, ValueError, KeyError):
        return False
    client = ShardClient(0, f"127.0.0.1:{port}", max_message_bytes=1 << 20, timeout_s=1.0,
                         token=RUN_TOKEN)
    try:
        reply = json.loads(client._control(wire.encode({"op": "progress"}), timeout=1.0,
                                           metadata=client.metadata))
        return min(reply["seen_step"][:workers]) >= min_step
    except grpc.RpcError:
        return False
    finally:
        client.close()


def run_row(tmp: Path, mode: str, target: str, sig: signal.Signals) -> Row:
    """Start a run, signal `target` ("worker 1" or "shard 0") once training, watch the end."""
    tolerated = target.startswith("worker") and (
        (sig == signal.SIGKILL and mode != "sync") or mode == "sync+drop")
    name = target.replace(" ", "")
    if target == "launcher":
        expected = "launcher exits, every child stopped"
    elif tolerated:
        expected = "exit 0, worker 1 retired"
    else:
        expected = f"exit 1 naming {target}" + (" (stopped)" if sig == signal.SIGSTOP else "")
    verb = {signal.SIGKILL: "kill -9", signal.SIGSTOP: "SIGSTOP"}.get(sig, sig.name)
    row = Row(f"{verb} {target} ({mode})", expected)
    logdir = tmp / f"{mode}-{name}-{sig.name}"
    steps = "1000" if tolerated else "100000"  # 300 async steps could end before the kill
    argv = [sys.executable, "-m", "experiments.run", "--layout", "ps", *model_flags(mode),
            "--ps-shards", "1", "--steps", steps, "--logdir", str(logdir), "--no-progress"]
    launcher = subprocess.Popen(argv, cwd=ROOT, env={**env(), TOKEN_ENV: RUN_TOKEN},
                                stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    LAUNCHERS.append(launcher)
    pids, victim = [], None
    try:
        deadline = time.monotonic() + 150
        while not training(logdir / "ps"):
            if launcher.poll() is not None or time.monotonic() > deadline:
                out, err = launcher.communicate(timeout=30)
                row.observed = f"run ended before the fault: {err.strip()[-200:]}"
                return row
            time.sleep(0.1)
        pids = json.loads((logdir / "ps" / "pids.json").read_text())
        victim = {"shard 0": pids[0], "worker 1": pids[2],  # pids: shard 0, workers 0, 1
                  "launcher": launcher.pid}[target]
        t0 = time.monotonic()
        try:
            os.kill(victim, sig)
        except ProcessLookupError:
            row.observed = f"{target} had already exited: no fault injected"
            return row
        try:
            out, err = launcher.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            row.observed = "launcher still running 60 s after the fault"
            return row
        row.detect_s = time.monotonic() - t0
        rc = launcher.returncode
        line = (err.strip().splitlines() or [""])[-1]
        if target == "launcher":
            row.observed = f"exit {rc}"
            row.held = rc != 0
        elif tolerated:
            results = logdir / "results.json"
            r = read_results(results) if results.exists() else {}
            dead = [d["worker"] for d in r.get("ps", {}).get("dead_workers", [])]
            finite = bool(r) and all(x is not None and np.isfinite(x) for x in r["loss"])
            row.observed = f"exit {rc}, dead workers {dead}, {len(r.get('loss', []))} losses"
            row.intact = "yes" if finite else "NO"
            row.held = rc == 0 and dead == [1] and finite
        else:
            row.observed = f"exit {rc}: {line[:110]}"
            row.intact = "n/a (run stopped)"
            named = target in line and (sig != signal.SIGSTOP or "stopped" in line)
            row.held = rc == 1 and named and len(err.strip().splitlines()) >= 1
        return row
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(10)
        if victim is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGCONT)
        deadline = time.monotonic() + 5
        while (procs.pids_alive(pids) or procs.pids_mentioning(str(logdir))) and \
                time.monotonic() < deadline:
            time.sleep(0.1)
        left = sorted(set(procs.pids_alive(pids)) | set(procs.pids_mentioning(str(logdir))))
        for pid in left:  # leave nothing behind, but report it
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
        row.orphans = str(len(left))
        row.held = row.held and not left


FULL = [(mode, target, sig) for mode in ("sync", "async", "ssp")
        for target in ("worker 1", "shard 0") for sig in (signal.SIGKILL, signal.SIGSTOP)] + [
    ("sync+drop", "worker 1", signal.SIGSTOP), ("sync", "launcher", signal.SIGTERM),
    ("async", "launcher", signal.SIGINT)]
QUICK = [("ssp", "worker 1", signal.SIGSTOP), ("sync", "worker 1", signal.SIGSTOP),
         ("async", "worker 1", signal.SIGKILL), ("sync", "shard 0", signal.SIGSTOP)]


def print_table(rows: list[Row]) -> None:
    head = ("fault or input", "expected", "observed", "params intact", "detect s", "orphans",
            "held")
    cells = [head] + [(r.what, r.expected, r.observed, r.intact,
                       "-" if r.detect_s is None else f"{r.detect_s:.2f}", r.orphans,
                       "yes" if r.held else "NO") for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    for i, c in enumerate(cells):
        print(" | ".join(x.ljust(w) for x, w in zip(c, widths)).rstrip())
        if i == 0:
            print("-+-".join("-" * w for w in widths))


def main(argv=None) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one fault of each kind")
    parser.add_argument("--only", choices=("servers", "runs"), default=None)
    parser.add_argument("--jobs", type=int, default=0, help="rows run at once (default: 5 "
                        "with --quick, else 2); each row's own timing does not depend on it")
    args = parser.parse_args(argv)
    parser.require_at_least(args, jobs=0)
    from concurrent.futures import ThreadPoolExecutor

    start = time.monotonic()
    jobs = args.jobs or (5 if args.quick else 2)
    with tempfile.TemporaryDirectory(prefix="chaos_ps_") as tmp, procs.TerminationHandlers():
        tasks = []
        if args.only != "runs":
            tasks.append(lambda: server_rows(Path(tmp), args.quick))
        if args.only != "servers":
            for mode, target, sig in (QUICK if args.quick else FULL):
                tasks.append(lambda m=mode, t=target, s=sig: [run_row(Path(tmp), m, t, s)])
        # Faults are waits (deadlines, grace periods), so rows overlap well even on 2 cores.
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            try:
                rows = [row for part in pool.map(lambda task: task(), tasks) for row in part]
            finally:
                kill_launchers()
                procs.stop_all(grace_s=1.0)
    print_table(rows)
    held = sum(r.held for r in rows)
    print(f"\n{held}/{len(rows)} rows held in {time.monotonic() - start:.1f} s")
    return 0 if held == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Process lifecycle: start children in their own process groups, stop every one of them
however the run ends, and make children die when their parent does.

Three layers, because each covers a hole in the others:
- the launcher keeps every child it started and kills its whole process group in `stop_all`
  (called from `finally`, atexit, and SIGTERM/SIGHUP handlers that turn into SystemExit);
- children are session leaders (start_new_session), so a terminal's Ctrl-C reaches only the
  launcher, which then tears down in order instead of leaving a half-dead cluster;
- each child runs a parent-death watchdog: if the launcher is SIGKILLed (no cleanup runs), the
  child notices its parent pid changed and exits, so nothing is orphaned.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

PARENT_ENV = "JAXDIST_PS_PARENT_PID"
_LIVE: list["Child"] = []


@dataclass
class Child:
    name: str
    argv: list
    env: dict
    log_path: Path
    proc: subprocess.Popen | None = None
    started_unix_s: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def log_tail(self, lines: int = 8) -> str:
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])


def start(name: str, argv: list, env: dict, log_path: Path) -> Child:
    """Start `argv` in a new session, output to `log_path`, tagged with our pid for the
    child's watchdog."""
    child = Child(name, list(argv), dict(env, **{PARENT_ENV: str(os.getpid())}), log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        child.proc = subprocess.Popen(child.argv, env=child.env, stdout=log,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True)
    child.started_unix_s = time.time()
    _LIVE.append(child)
    return child


def stop(child: Child, grace_s: float = 3.0) -> None:
    """SIGTERM the child's process group (and SIGCONT, so a stopped process can act on it),
    SIGKILL what is left after `grace_s` (SIGKILL ends stopped processes too), reap."""
    if child.proc is None:
        return
    if child.proc.poll() is None:
        _signal_group(child.proc.pid, signal.SIGTERM)
        _signal_group(child.proc.pid, signal.SIGCONT)
        try:
            child.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    _signal_group(child.proc.pid, signal.SIGKILL)  # also any grandchildren left in the group
    try:
        child.proc.wait(5)
    except subprocess.TimeoutExpired:
        pass
    if child in _LIVE:
        _LIVE.remove(child)


def stop_all(children=None, grace_s: float = 3.0) -> None:
    targets = list(_LIVE if children is None else children)
    for child in targets:  # SIGTERM everyone first, so the grace periods overlap
        if child.proc is not None and child.proc.poll() is None:
            _signal_group(child.proc.pid, signal.SIGTERM)
            _signal_group(child.proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + grace_s
    for child in targets:
        stop(child, max(0.0, deadline - time.monotonic()))


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # start_new_session: the child's pid is its group id
    except (ProcessLookupError, PermissionError):
        pass


atexit.register(stop_all)


class TerminationHandlers:
    """Within the block, SIGTERM and SIGHUP raise SystemExit in the main thread, so `finally`
    clauses (and stop_all) run; previous handlers come back on exit. No-op off the main
    thread, where Python cannot install handlers."""

    SIGNALS = (signal.SIGTERM, signal.SIGHUP)

    def __enter__(self):
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self.previous[sig] = signal.signal(sig, self._raise)
        return self

    @staticmethod
    def _raise(signum, frame):
        raise SystemExit(128 + signum)

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        return False


def parent_watchdog(poll_s: float = 0.5) -> None:
    """In a child: exit as soon as the launcher that started us is gone. A no-op when the
    process was not started by a launcher (a scheduler started it: nothing to follow)."""
    expected = os.environ.get(PARENT_ENV)
    if not expected:
        return
    expected = int(expected)
    try:  # Linux: the kernel signals us when the parent exits (instant, no polling)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != expected:  # the parent died before prctl took effect
        os._exit(70)

    def watch():
        while True:
            if os.getppid() != expected:
                os._exit(70)
            time.sleep(poll_s)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def port_free(host: str, port: int) -> bool:
    """Nothing listens on (or is bound to) host:port. Connections of a killed server left
    in TIME_WAIT do not count: gRPC binds with SO_REUSEADDR, so a restarted shard can take
    its port back, and so does this check."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_ports(host: str, count: int) -> list[int]:
    """`count` distinct ports free right now (held open together so they differ). Another
    process could take one before our server binds it; the server then fails loudly."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    held = []
    try:
        for _ in range(count):
            s = socket.socket(family, socket.SOCK_STREAM)
            held.append(s)
            s.bind((host, 0))
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


def pids_alive(pids) -> list[int]:
    """The pids that still exist and are not zombies."""
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        except PermissionError:
            alive.append(pid)
            continue
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.append(pid)
    return alive


def python_argv(module: str, *args: str) -> list:
    return [sys.executable, "-m", module, *args]

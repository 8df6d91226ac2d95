"""Child processes: start them in process groups of their own, watch them, and stop every one
of them however the parent's run ends; children can die with their parent.

Used by every producer that starts processes: the suite (one experiments.run at a time), the
local launcher (N jax.distributed processes), the PyTorch reference (N ranks) and the
parameter server (shards and workers). Three layers, because each covers a hole in the others:
- the parent keeps every child it started and kills its whole process group in `stop_all`
  (called from `finally`, atexit, and SIGTERM/SIGHUP handlers that turn into SystemExit);
- children are session leaders (start_new_session), so a terminal's Ctrl-C reaches only the
  parent, which then tears down in order instead of leaving half a job running; and
  stopping a child's group also stops whatever the child started;
- a child may run `parent_watchdog`: if the parent is SIGKILLed (no cleanup runs), the child
  notices its parent pid changed and exits, so nothing is orphaned.
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
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent   # holds jaxdist/, models/, experiments/, ...
PARENT_ENV = "JAXDIST_PARENT_PID"
PIPE = subprocess.PIPE
_LIVE: list["Child"] = []


@dataclass
class Child:
    name: str
    argv: list
    env: dict
    log_path: Path | None = None
    proc: subprocess.Popen | None = None
    started_unix_s: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def log_tail(self, lines: int = 8) -> str:
        return log_tail(self.log_path, lines) if self.log_path else ""


def start(name: str, argv: list, env: dict | None = None, log: Path | int | None = None, *,
          err_log: Path | None = None, truncate: bool = False, cwd: Path | None = None) -> Child:
    """Start `argv` as the leader of a new session, tagged with our pid for its
    parent_watchdog. `log`: a path (appended to, or started afresh with `truncate`) takes
    stdout and, unless `err_log` is given, stderr; PIPE: both as text lines on
    child.proc.stdout; None: ours. stdin is never the terminal's."""
    env = dict(os.environ if env is None else env, **{PARENT_ENV: str(os.getpid())})
    child = Child(name, list(argv), env, log if isinstance(log, Path) else err_log)
    opened = {}
    try:
        for path in (log, err_log):
            if isinstance(path, Path):
                path.parent.mkdir(parents=True, exist_ok=True)
                opened[path] = open(path, "wb" if truncate else "ab")
        stdout = opened.get(log, log)                     # a file, PIPE or None
        stderr = (opened[err_log] if err_log is not None else
                  subprocess.STDOUT if log is not None else None)
        child.proc = subprocess.Popen(child.argv, env=env, cwd=cwd, stdout=stdout,
                                      stderr=stderr, stdin=subprocess.DEVNULL,
                                      text=log is PIPE, start_new_session=True)
    finally:
        for f in opened.values():  # the child has its own copies
            f.close()
    child.started_unix_s = time.time()
    _LIVE.append(child)
    return child


@dataclass
class Watched:
    """How `watch` ended: exit statuses in the order seen, the first failure, a timeout."""
    exits: list[tuple[Child, int]]
    failure: tuple[Child, int] | None = None
    timed_out: bool = False


def watch(children: list[Child], timeout_s: float | None = None,
          failed: Callable[[int], bool] = lambda code: code != 0,
          poll_s: float = 0.05) -> Watched:
    """Wait until every child has exited, one exits with a status that `failed` says is a
    failure, or `timeout_s` has passed; stops nothing (the caller decides)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pending, exits = list(children), []
    while pending:
        for child in list(pending):
            code = child.poll()
            if code is None:
                continue
            pending.remove(child)
            exits.append((child, code))
            if failed(code):
                return Watched(exits, failure=(child, code))
        if not pending:
            break
        if deadline is not None and time.monotonic() >= deadline:
            return Watched(exits, timed_out=True)
        time.sleep(poll_s)
    return Watched(exits)


def stop(child: Child, grace_s: float = 3.0) -> None:
    """SIGTERM the child's process group (and SIGCONT, so a stopped process can act on it),
    SIGKILL what is left after `grace_s` (SIGKILL ends stopped processes too), reap."""
    if child.proc is None:
        return
    if child.proc.poll() is None:
        _terminate_group(child.proc.pid)
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
            _terminate_group(child.proc.pid)
    deadline = time.monotonic() + grace_s
    for child in targets:
        stop(child, max(0.0, deadline - time.monotonic()))


def _terminate_group(pid: int) -> None:
    _signal_group(pid, signal.SIGTERM)
    _signal_group(pid, signal.SIGCONT)  # a SIGSTOPped process acts on SIGTERM only when woken


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
    """In a child: exit as soon as the parent that started us is gone. A no-op when the
    process was not started by `start` (a scheduler started it: nothing to follow)."""
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

    def watch_parent():
        while True:
            if os.getppid() != expected:
                os._exit(70)
            time.sleep(poll_s)

    threading.Thread(target=watch_parent, name="parent-watchdog", daemon=True).start()


def log_tail(path: Path, lines: int = 8) -> str:
    """The last `lines` non-blank lines of a log, each as a terminal last showed it (a
    progress bar rewrites its line with \\r) and cut to its last 400 characters."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return ""
    kept = [line.rsplit("\r", 1)[-1] for line in text.splitlines()]
    kept = [line[-400:] for line in kept if line.strip()]
    return "\n".join(kept[-lines:])


def python_argv(module: str, *args: str) -> list:
    return [sys.executable, "-m", module, *args]


def python_env(extra: dict | None = None) -> dict:
    """Our environment for a `python -m` child: this checkout first on PYTHONPATH (wherever
    the child starts), unbuffered output (lines arrive as they are printed), plus `extra`."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra or {})
    return env


def host_port(value: str, flag: str, last: int = 65535, why: str = "") -> tuple[str, int]:
    """`value` as (HOST, PORT within 1..last), or a UsageError naming `flag` (and `why` the
    range): an address is checked when it is given, not found wrong after a timeout."""
    from jaxdist.errors import UsageError

    host, _, port = value.rpartition(":")
    if not host.strip("[]") or not port.isdigit():
        raise UsageError(f"{flag} {value!r} is not HOST:PORT")
    if not 1 <= int(port) <= last:
        raise UsageError(f"{flag} {value!r}: PORT must be within 1..{last}{why}")
    return host, int(port)


def port_free(host: str, port: int) -> bool:
    """Nothing listens on (or is bound to) host:port. Connections of a killed server left
    in TIME_WAIT do not count: gRPC binds with SO_REUSEADDR, so a restarted server can take
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
    process could take one before our child binds it; the child then fails loudly."""
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


def free_port_pair(host: str = "127.0.0.1") -> int:
    """A free port whose neighbour is free too (jax.distributed's coordinator uses PORT and
    PORT+1)."""
    for _ in range(50):
        port = free_ports(host, 1)[0]
        if port_free(host, port + 1):
            return port
    raise RuntimeError("no pair of free ports found")


def pids_mentioning(text: str) -> list[int]:
    """Live pids (other than this one) whose command line contains `text` — e.g. a run's
    logdir, to find children a launcher may have left behind."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:  # gone meanwhile, or not ours to read
                continue
    return pids_alive(found)


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

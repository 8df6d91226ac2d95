"""jaxdist.procs with real child processes: output to a log, exit statuses watched, a stop that
lets a child clean up (also one that was SIGSTOPped), SIGKILL for one that will not, and no
process left behind: not a grandchild in the group, not a child whose parent was SIGKILLed."""

import os
import signal
import subprocess
import sys
import time

from jaxdist import procs


def python(code: str) -> list:
    return [sys.executable, "-c", code]


def wait_gone(pids, within_s: float = 5.0) -> list[int]:
    deadline = time.monotonic() + within_s
    while procs.pids_alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return procs.pids_alive(pids)


# Exits 7 on SIGTERM (a child that cleans up), after saying it is ready.
GRACEFUL = ("import signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))\n"
            "print('ready', flush=True)\n"
            "time.sleep(60)\n")


def start_ready(code: str) -> procs.Child:
    child = procs.start("c", python(code), procs.python_env(), procs.PIPE)
    assert child.proc.stdout.readline().strip() == "ready"
    return child


def test_log_and_exit_status(tmp_path):
    log = tmp_path / "logs" / "c.log"
    log.parent.mkdir()
    log.write_text("earlier attempt\n")
    child = procs.start("c", python("import sys; print('out'); print('err', file=sys.stderr); "
                                    "sys.exit(3)"), procs.python_env(), log)
    watched = procs.watch([child], timeout_s=30)
    assert watched.failure == (child, 3) and watched.exits == [(child, 3)]
    assert not watched.timed_out
    assert log.read_text().splitlines()[0] == "earlier attempt"  # appended to
    assert sorted(child.log_tail(2).splitlines()) == ["err", "out"]

    out, err = tmp_path / "o.txt", tmp_path / "e.txt"
    out.write_text("stale\n")
    again = procs.start("c", python("import sys; print('o'); print('e', file=sys.stderr)"),
                        procs.python_env(), out, err_log=err, truncate=True)
    assert procs.watch([again], timeout_s=30).exits == [(again, 0)]
    assert out.read_text() == "o\n" and err.read_text() == "e\n"  # started afresh


def test_watch_times_out_and_failure_rule(tmp_path):
    sleeper = procs.start("s", ["sleep", "60"])
    quick = procs.start("q", python("import sys; sys.exit(130)"))
    try:
        watched = procs.watch([sleeper, quick], timeout_s=1.0,
                              failed=lambda code: code not in (0, 130))
        assert watched.timed_out and watched.failure is None
        assert watched.exits == [(quick, 130)]
    finally:
        procs.stop(sleeper, grace_s=5)
    assert sleeper.proc.returncode == -signal.SIGTERM
    assert procs.pids_alive([sleeper.pid]) == []


def test_stop_lets_the_child_clean_up(tmp_path):
    child = start_ready(GRACEFUL)
    procs.stop(child, grace_s=10)
    assert child.proc.returncode == 7


def test_a_sigstopped_child_still_gets_to_clean_up(tmp_path):
    """SIGTERM stays pending in a stopped process with a handler; the SIGCONT after it
    lets the handler run (without it, only the SIGKILL after the grace period ends it)."""
    child = start_ready(GRACEFUL)
    os.kill(child.pid, signal.SIGSTOP)
    started = time.monotonic()
    procs.stop(child, grace_s=10)
    assert child.proc.returncode == 7
    assert time.monotonic() - started < 5


def test_a_child_ignoring_sigterm_is_killed(tmp_path):
    child = start_ready("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                        "print('ready', flush=True)\ntime.sleep(60)\n")
    os.kill(child.pid, signal.SIGSTOP)
    procs.stop_all([child], grace_s=0.5)
    assert child.proc.returncode == -signal.SIGKILL
    assert procs.pids_alive([child.pid]) == []


def test_stop_takes_the_grandchildren_in_the_group(tmp_path):
    code = ("import subprocess, time\n"
            "g = subprocess.Popen(['sleep', '60'])\n"
            "print(g.pid, flush=True)\n"
            "time.sleep(60)\n")
    child = procs.start("c", python(code), procs.python_env(), procs.PIPE)
    grandchild = int(child.proc.stdout.readline())
    assert procs.pids_alive([grandchild]) == [grandchild]
    procs.stop(child, grace_s=5)
    assert wait_gone([child.pid, grandchild]) == []


def test_a_child_dies_with_its_sigkilled_parent(tmp_path):
    """The parent gets no chance to clean up; its child (a session of its own, so no
    group signal reaches it) follows by parent_watchdog."""
    code = ("from jaxdist import procs\n"
            "import sys, time\n"
            "c = procs.start('g', [sys.executable, '-c', 'from jaxdist.procs import "
            "parent_watchdog; parent_watchdog(); print(1, flush=True); import time; "
            "time.sleep(60)'], procs.python_env(), procs.PIPE)\n"
            "c.proc.stdout.readline()\n"
            "print(c.pid, flush=True)\n"
            "time.sleep(60)\n")
    parent = procs.start("p", python(code), procs.python_env(), procs.PIPE)
    orphan = int(parent.proc.stdout.readline())
    assert procs.pids_alive([orphan]) == [orphan]
    os.kill(parent.pid, signal.SIGKILL)
    parent.proc.wait(5)
    assert wait_gone([orphan]) == []


def test_python_env_puts_this_checkout_first(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)
    env = procs.python_env({"X": "1"})
    assert env["PYTHONPATH"] == f"{procs.ROOT}{os.pathsep}/elsewhere"
    assert env["PYTHONUNBUFFERED"] == "1" and env["X"] == "1"
    assert (procs.ROOT / "jaxdist" / "procs.py").is_file()


def test_free_port_pair_is_free_with_its_neighbour():
    port = procs.free_port_pair()
    assert procs.port_free("127.0.0.1", port) and procs.port_free("127.0.0.1", port + 1)
    a, b = procs.free_ports("127.0.0.1", 2)
    assert a != b


def test_pids_mentioning_finds_a_child_by_its_command_line(tmp_path):
    marker = str(tmp_path / "marker-arg")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", marker])
    try:
        deadline = time.monotonic() + 10
        while child.pid not in procs.pids_mentioning(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert procs.pids_mentioning(marker) == [child.pid]
    finally:
        child.kill()
        child.wait()
    assert procs.pids_mentioning(marker) == []

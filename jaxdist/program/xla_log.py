"""XLA's own C++ log lines on stderr, where a plan is read: a known warning is replaced by one
line that says what it means, everything else passes through as it comes.

XLA:GPU's rematerialization pass warns `hlo_rematerialization.cc:... Can't reduce memory use
below X by rematerialization; only reduced to Y` when a program needs more than the device
memory it compiles for. A plan that does not fit says so in its own memory line; the C++
line before the plan's output, with its thread id and source file, explained nothing.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from contextlib import contextmanager

REMAT = re.compile(r"hlo_rematerialization\.cc:\d+\] Can't reduce memory use below (\S+) "
                   r".*?only reduced to (\S+)")


def remat_note(limit: str, reached: str) -> str:
    return (f"note: XLA's compiler could not bring a program under the GPU's memory by "
            f"recomputing activations (it reached {reached} of a {limit} limit); its "
            f"warnings are left out, and the memory line of the plan says whether the step "
            f"fits")


@contextmanager
def explained_xla_warnings():
    """For the block, what is written to file descriptor 2 (XLA's C++ log, and Python's
    stderr) goes through a filter thread: the first rematerialization warning becomes
    `remat_note`, later ones are dropped, every other line is written as it comes."""
    sys.stderr.flush()
    saved = os.dup(2)
    read, write = os.pipe()
    os.dup2(write, 2)
    os.close(write)
    said = []

    def pump():
        with os.fdopen(read, "rb") as lines:
            for line in lines:
                m = REMAT.search(line.decode(errors="replace"))
                if m is None:
                    os.write(saved, line)
                elif not said:
                    said.append(True)
                    os.write(saved, (remat_note(*m.groups()) + "\n").encode())

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # the pipe's last writer closed: the thread reads to its end
        thread.join(timeout=10)
        os.close(saved)

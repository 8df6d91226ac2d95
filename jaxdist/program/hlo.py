"""Reading XLA's optimized HLO text: its statements (instructions and computation headers,
wrapped lines joined), and how often each computation runs per step (while-loop trip counts,
async wrappers, conditional branches weighed by the caller or marked upper bounds).
jaxdist.program.comm builds its collective accounting on it.

The text is parsed once (`reading`, kept for the last few programs): a run or a plan asks
of one program its collectives, kernels, sends, schedule and op names, and splitting and
matching every line for each would cost a pipeline test a fifth of its time."""

from __future__ import annotations

import functools
import re
from collections import defaultdict
from typing import NamedTuple

# `%name = <shape> <opcode>(`: the shape may be a (nested) tuple with spaces in it.
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.+?)\s+"
                          r"(?P<op>[a-z][\w\-]*)\((?P<rest>.*)$")


def _statements(hlo_text: str):
    """One HLO instruction or computation header per item. XLA prints one per line; HLO
    written by hand (XLA's own tests) wraps long ones: a line that does not open an
    instruction (`name = `), a computation or its closing brace continues the one before,
    as does every line while a bracket is open (e.g. a multi-line backend_config)."""
    pending: list[str] = []
    depth = 0
    for line in hlo_text.splitlines():
        bare = _QUOTED.sub("", line) if '"' in line else line
        delta = sum(bare.count(c) for c in "([{") - sum(bare.count(c) for c in ")]}")
        opened = header(line)
        opens = opened or _IS_INSTRUCTION.match(line)
        if pending and depth > 0 and not opens:
            pending.append(line.strip())
            depth += delta
            continue
        stands_alone = opened or line.lstrip().startswith("}") or not line.strip()
        if opens or stands_alone or not pending:
            if pending:
                yield " ".join(pending)
            pending, depth = [], 0
            if stands_alone:
                yield line
                continue
        pending.append(line.strip())
        depth += delta
    if pending:
        yield " ".join(pending)


_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')
_COMPUTATION = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\)\s*->.*)?\{\s*$")
_IS_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s+=\s")
_CALLS = re.compile(r"(?:body|to_apply|calls|condition)=%?([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def header(line: str) -> re.Match | None:
    return None if _IS_INSTRUCTION.match(line) else _COMPUTATION.match(line)


_BRANCH_LIST = re.compile(r"branch_computations=\{([^}]*)\}")
_TRUE_FALSE = re.compile(r"(true|false)_computation=%?([\w.\-]+)")


def branches(line: str) -> list[str]:
    """A conditional's branch computations in index order (a predicated one: [false, true],
    index 0 being false as for lax.cond); [] for any other instruction."""
    if "_computation" not in line:  # the cheap test first: reading() asks of every line
        return []
    listed = _BRANCH_LIST.search(line)
    if listed:
        return [b.strip().lstrip("%") for b in listed.group(1).split(",") if b.strip()]
    named = dict(_TRUE_FALSE.findall(line))
    return [named["false"], named["true"]] if len(named) == 2 else []


class Statement(NamedTuple):
    line: str
    computation: str | None    # the computation it is in (its own name for a header)
    instruction: re.Match | None
    name: str | None           # the instruction's name


class Reading(NamedTuple):
    statements: tuple[Statement, ...]
    entry: str | None
    # callee computations of each computation: (callee, trip count, is a conditional branch)
    calls: dict[str, list[tuple[str, int, bool]]]


@functools.lru_cache(maxsize=4)
def reading(hlo_text: str) -> Reading:
    """The one parse of a program's text; callers must not mutate what it returns."""
    out, current, entry = [], None, None
    calls: dict[str, list[tuple[str, int, bool]]] = defaultdict(list)
    for line in _statements(hlo_text):
        opened = header(line)
        if opened:
            current = opened.group(2)
            entry = current if opened.group(1) else entry
            out.append(Statement(line, current, None, None))
            continue
        m = INSTRUCTION.match(line)
        name = line.split("=", 1)[0].replace("ROOT", "").strip().lstrip("%") if m else None
        out.append(Statement(line, current, m, name))
        # The -update and -done halves of an async op name the same computation as its
        # -start; following them too would count the wrapped collective two or three times.
        if current is None or m and m.group("op").endswith(("-done", "-update")):
            continue
        trip = _TRIP.search(line)
        for callee in _CALLS.findall(line):
            body = re.search(rf"body=%?{re.escape(callee)}(?![\w.\-])", line)
            repeat = int(trip.group(1)) if trip and body else 1
            calls[current].append((callee, repeat, False))
        calls[current].extend((branch, 1, True) for branch in branches(line))
    return Reading(tuple(out), entry, dict(calls))


def statements(hlo_text: str):
    """One HLO instruction or computation header per item (see _statements)."""
    return (s.line for s in reading(hlo_text).statements)


def instructions(hlo_text: str):
    """(computation, instruction name, INSTRUCTION match, statement) of every instruction,
    in text order (a scheduled module's order)."""
    return ((s.computation, s.name, s.instruction, s.line)
            for s in reading(hlo_text).statements if s.instruction)


def trip_count(line: str) -> int | None:
    """A while loop's known trip count, which XLA records in the loop's backend_config."""
    m = _TRIP.search(line)
    return int(m.group(1)) if m else None


def while_trip_counts(hlo_text: str) -> dict[str, list[int]]:
    """Known trip counts of the while loops of a program, split into the entry computation's
    own loops ("entry", e.g. [4] for a scan over 4 micro-batches) and loops nested in other
    computations ("nested")."""
    r = reading(hlo_text)
    out: dict[str, list[int]] = {"entry": [], "nested": []}
    for s in r.statements:
        if s.instruction and s.instruction.group("op") == "while":
            n = trip_count(s.line)
            if n is not None:
                out["entry" if s.computation == r.entry else "nested"].append(n)
    return out


def entry_computation(hlo_text: str) -> str | None:
    return reading(hlo_text).entry


def conditionals(hlo_text: str) -> list[tuple[str, list[str]]]:
    """(computation holding it, its branches) of every conditional, in text order."""
    return [(s.computation, branches(s.line)) for s in reading(hlo_text).statements
            if s.instruction and s.instruction.group("op") == "conditional"]


def execution_counts(hlo_text: str, branch_runs: dict[str, float] | None = None
                     ) -> tuple[dict[str, float], set[str]]:
    """How many times each computation runs per step, and which of those counts are upper
    bounds. A while loop's body (e.g. the scan over micro-batches) runs its known trip count
    times, and so do the collectives in it; an async-start's wrapped computation runs once
    per run of the async-start. How often each branch of a conditional runs is data the HLO
    does not hold: `branch_runs` gives it (runs per step, per device on average) by branch
    computation; a branch it does not name is counted as running every time its
    conditional does (an upper bound), and it and what it calls are returned as such."""
    branch_runs = branch_runs or {}
    read = reading(hlo_text)
    entry, calls = read.entry, read.calls
    runs: dict[str, float] = defaultdict(int)
    guessed: set[str] = set()

    def visit(name: str, times: float, bound: bool, depth: int = 0) -> None:
        if depth > 50:  # a malformed or recursive graph: count what we have
            return
        runs[name] += times
        if bound:
            guessed.add(name)
        for callee, repeat, is_branch in calls.get(name, ()):
            if is_branch and callee in branch_runs:
                visit(callee, branch_runs[callee], bound, depth + 1)
            else:
                visit(callee, times * repeat, bound or is_branch, depth + 1)

    if entry is not None:
        visit(entry, 1, False)
    return dict(runs), guessed


def executions(hlo_text: str, branch_runs: dict[str, float] | None = None
               ) -> dict[str, float]:
    """execution_counts' runs per computation."""
    return execution_counts(hlo_text, branch_runs)[0]

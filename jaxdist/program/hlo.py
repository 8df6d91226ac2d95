"""Reading XLA's optimized HLO text, the one place that parses it: its statements
(instructions and computation headers, wrapped lines joined), each instruction as a typed
record (`Instruction`: op, result arrays with dtypes, operands, replica groups, called
computations, op_name, backend_config), and how often each computation runs per step
(while-loop trip counts, async wrappers, conditional branches weighed by the caller or
marked upper bounds). Also the one dtype table (`DTYPE_BITS`), the one list of collective
kinds (`COLLECTIVE_KINDS`) and the one ring rule (`ring_steps`, `ring_factor`).
jaxdist.program.comm, kernels, liveness and jaxdist.pipeline.report read the records.

The text is parsed once (`reading`, kept for the last few programs): a run or a plan asks
of one program its collectives, kernels, sends, schedule and op names, and all of them
share that parse; a record's attributes are parsed on first use and kept on it."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from collections import defaultdict
from typing import NamedTuple

import numpy as np

# `%name = <shape> <opcode>(`: the shape may be a (nested) tuple with spaces in it.
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.+?)\s+"
                          r"(?P<op>[a-z][\w\-]*)\((?P<rest>.*)$")


def _statements(hlo_text: str):
    """(statement, its computation-header match or _UNREAD) per HLO instruction or
    computation header. XLA prints one per line; HLO
    written by hand (XLA's own tests) wraps long ones: a line that does not open an
    instruction (`name = `), a computation or its closing brace continues the one before,
    as does every line while a bracket is open (e.g. a multi-line backend_config)."""
    pending: list[str] = []
    depth = 0
    for line in hlo_text.splitlines():
        bare = _QUOTED.sub("", line) if '"' in line else line
        delta = (bare.count("(") + bare.count("[") + bare.count("{")
                 - bare.count(")") - bare.count("]") - bare.count("}"))
        is_instruction = _IS_INSTRUCTION.match(line)
        opened = None if is_instruction else _COMPUTATION.match(line)
        opens = opened or is_instruction
        if pending and depth > 0 and not opens:
            pending.append(line.strip())
            depth += delta
            continue
        stands_alone = opened or line.lstrip().startswith("}") or not line.strip()
        if opens or stands_alone or not pending:
            if pending:
                yield " ".join(pending), _UNREAD
            pending, depth = [], 0
            if stands_alone:
                yield line, opened
                continue
        pending.append(line.strip())
        depth += delta
    if pending:
        yield " ".join(pending), _UNREAD


_UNREAD = object()  # a joined statement: whether it is a header is read from its whole text


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
    instructions: tuple["Instruction", ...]


@functools.lru_cache(maxsize=4)
def reading(hlo_text: str) -> Reading:
    """The one parse of a program's text; callers must not mutate what it returns."""
    out, typed_out, current, entry = [], [], None, None
    calls: dict[str, list[tuple[str, int, bool]]] = defaultdict(list)
    for line, opened in _statements(hlo_text):
        opened = header(line) if opened is _UNREAD else opened
        if opened:
            current = opened.group(2)
            entry = current if opened.group(1) else entry
            out.append(Statement(line, current, None, None))
            continue
        m = INSTRUCTION.match(line)
        name = line.split("=", 1)[0].replace("ROOT", "").strip().lstrip("%") if m else None
        out.append(Statement(line, current, m, name))
        if m:
            typed_out.append(Instruction.read(current, name, m, line))
        # The -update and -done halves of an async op name the same computation as its
        # -start; following them too would count the wrapped collective two or three times.
        if current is None or m and m.group("op").endswith(("-done", "-update")):
            continue
        callees = _CALLS.findall(line)
        trip = _TRIP.search(line) if callees and "known_trip_count" in line else None
        for callee in callees:
            body = re.search(rf"body=%?{re.escape(callee)}(?![\w.\-])", line)
            repeat = int(trip.group(1)) if trip and body else 1
            calls[current].append((callee, repeat, False))
        calls[current].extend((branch, 1, True) for branch in branches(line))
    return Reading(tuple(out), entry, dict(calls), tuple(typed_out))


def statements(hlo_text: str):
    """One HLO instruction or computation header per item (see _statements)."""
    return (s.line for s in reading(hlo_text).statements)


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


# ---- typed instructions: every attribute a consumer reads, parsed here and nowhere else ----

# Collective instructions (each also printed as an async `-start`/`-done` pair).
COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                    "collective-permute", "collective-broadcast", "ragged-all-to-all")
# Bits per element; a float8/float4 type (f8e4m3fn, f4e2m1fn, ...) has the bits its name says.
DTYPE_BITS = {"pred": 8, "token": 0, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8,
              "s16": 16, "u16": 16, "f16": 16, "bf16": 16, "s32": 32, "u32": 32, "f32": 32,
              "s64": 64, "u64": 64, "f64": 64, "c64": 64, "c128": 128}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9, <=]*)\]")
_SMALL_FLOAT = re.compile(r"f(\d)e\w+")


def dtype_bits(dtype: str) -> int:
    if dtype in DTYPE_BITS:
        return DTYPE_BITS[dtype]
    small_float = _SMALL_FLOAT.fullmatch(dtype)
    if small_float:
        return int(small_float.group(1))
    digits = re.search(r"\d+", dtype)
    return int(digits.group()) if digits else 0


def ring_steps(kind: str, n: int) -> int:
    """Steps of a ring collective over n devices, as NCCL counts them: all-reduce 2(n-1)
    (reduce-scatter then all-gather), a permute 1, the others n-1."""
    if n <= 1:
        return 0
    return {"all-reduce": 2 * (n - 1), "collective-permute": 1}.get(kind, n - 1)


def ring_factor(kind: str, n: int) -> float:
    """The share of a collective's buffer each device sends on a ring of n: a step moves
    1/n of the buffer (all-reduce 2(n-1)/n, all-gather etc. (n-1)/n), a permute's one step
    all of it."""
    steps = ring_steps(kind, n)
    return float(steps) if kind == "collective-permute" else steps / n


class Array(NamedTuple):
    """One array of an HLO shape: its element type (HLO's name, e.g. bf16) and dims. A
    tuple itself: a shape tree tells an array from a tuple shape by isinstance(_, Array)."""
    dtype: str
    dims: tuple[int, ...]

    @property
    def elements(self) -> int:
        return math.prod(self.dims)

    @property
    def bits(self) -> int:
        return self.elements * dtype_bits(self.dtype)

    @property
    def bytes(self) -> int:
        """Whole bytes (sub-byte types packed, rounded up)."""
        return -(-self.elements * dtype_bits(self.dtype) // 8)


_COMMENT = re.compile(r"/\*.*?\*/")
_BRACED = re.compile(r"\{[^{}]*\}")
_TREE_TOKEN = re.compile(r"\(|\)|" + _ARRAY.pattern)


def shape_tree(shape: str):
    """An HLO shape as Arrays: an Array for an array, a plain tuple (of trees) for a tuple
    shape (tell them apart with isinstance(_, Array): an Array is a NamedTuple)."""
    shape = _COMMENT.sub("", shape)  # /*index=5*/ markers in long tuples
    while True:  # layouts, e.g. {1,0:T(8,128)}, hold parentheses of their own
        stripped = _BRACED.sub("", shape)
        if stripped == shape:
            break
        shape = stripped
    stack: list[list] = [[]]
    for token in _TREE_TOKEN.finditer(shape):
        if token.group() == "(":
            stack.append([])
        elif token.group() == ")" and len(stack) > 1:
            done = stack.pop()
            stack[-1].append(tuple(done))
        elif token.group(1):
            dims = tuple(int(d.strip().lstrip("<=")) for d in token.group(2).split(",")
                         if d.strip())
            stack[-1].append(Array(token.group(1), dims))
    top = stack[0]
    return top[0] if len(top) == 1 else tuple(top)


def arrays(shape: str) -> list[Array]:
    """Every array of an HLO shape, in order (a tuple gives several)."""
    return [Array(t, tuple(int(d.strip().lstrip("<=")) for d in dims.split(",") if d.strip()))
            for t, dims in _ARRAY.findall(shape)]


def _iota(spec: str) -> np.ndarray:
    """`[2,4]<=[8]` or `[4,2]<=[2,4]T(1,0)`: the device ids of an iota tile assignment."""
    m = _IOTA.fullmatch(spec.strip())
    shape = [int(x) for x in m.group(1).split(",")]
    dims = [int(x) for x in m.group(2).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(3):
        ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    return ids.reshape(shape)


_IOTA = re.compile(r"\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
_MESH_GROUPS = re.compile(
    r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*\)?)\))?\s*\{([^}]*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=(\[[0-9,]+\]<=\[[0-9,]+\](?:T\([0-9,]+\))?)")
_LIST_GROUPS = re.compile(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}")
_GROUP = re.compile(r"\{([0-9,]*)\}")
_AXIS_SIZE = re.compile(r"'([^']+)'=(\d+)")
_AXIS = re.compile(r"'([^']+)'")
_LEADING_DIMS = re.compile(r"^\[([0-9,]+)\]")


def replica_groups(line: str) -> list[list[int]] | None:
    """The device groups of a collective, in any of XLA's three notations."""
    m = _MESH_GROUPS.search(line)
    if m:
        names = _AXIS_SIZE.findall(m.group(1))
        shape = [int(size) for _, size in names]
        order = [name for name, _ in names]
        if m.group(2):
            spec = m.group(2)
            spec = spec if "<=" in spec else _LEADING_DIMS.sub(lambda g: (
                f"[{math.prod(int(x) for x in g.group(1).split(','))}]<=[{g.group(1)}]"), spec)
            ids = _iota(spec).reshape(shape)
        else:
            ids = np.arange(math.prod(shape)).reshape(shape)
        spanned = [order.index(a) for a in _AXIS.findall(m.group(3))]
        kept = [i for i in range(len(shape)) if i not in spanned]
        grouped = ids.transpose(kept + spanned).reshape(-1, math.prod(shape[i] for i in spanned))
        return grouped.tolist()
    m = _IOTA_GROUPS.search(line)
    if m:
        return _iota(m.group(1)).tolist()
    m = _LIST_GROUPS.search(line)
    if m:
        return [[int(x) for x in g.split(",") if x] for g in _GROUP.findall(m.group(1))]
    return None


_PAIRS = re.compile(r"source_target_pairs=\{((?:\s*\{\s*\d+\s*,\s*\d+\s*\}\s*,?)*)\}")
_PAIR = re.compile(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}")


def permute_pairs(line: str) -> list[tuple[int, int]] | None:
    """A collective-permute's (source, target) device pairs; None where it has none."""
    m = _PAIRS.search(line)
    if not m:
        return None
    return [(int(a), int(b)) for a, b in _PAIR.findall(m.group(1))]


_OPERAND = re.compile(r"%([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLED = re.compile(r"(body|to_apply|calls|condition)=%?([\w.\-]+)")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_FUSION_KIND = re.compile(r'"kind":"(__[\w]+)"')
_CUSTOM_FUSION = re.compile(r'"custom_fusion_config":\{"name":"([\w]+)"')
_DIMS_ATTR = re.compile(r"([a-z_]+_dims)=\{([\d,]*)\}")
_BACKEND = re.compile(r"backend_config=(\{.*\})")


def _operand_text(rest: str) -> str:
    """The text of `op(a, b), attrs` between the parentheses (given the text after `op(`)."""
    depth = 1
    for i, c in enumerate(rest):
        depth += c == "("
        depth -= c == ")"
        if depth == 0:
            return rest[:i]
    return rest


_SET_DICT = object.__setattr__


class _once:
    """A property computed on first use and kept in the instance's __dict__: a lock-free
    functools.cached_property (two threads asking at once both compute the same value)."""

    def __init__(self, compute):
        self.compute, self.name, self.__doc__ = compute, compute.__name__, compute.__doc__

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        value = obj.__dict__[self.name] = self.compute(obj)
        return value


@dataclasses.dataclass(frozen=True, eq=False)
class Instruction:
    """One HLO instruction. The name, op and texts are read when the program is; each
    attribute below is parsed on first use and kept (the record lives in `reading`'s cache,
    so a program's attributes are parsed once whichever consumer asks)."""
    computation: str | None
    name: str
    op: str
    shape: str   # the result shape's text
    rest: str    # the text after `op(`: operands, then attributes
    line: str
    root: bool

    @classmethod
    def read(cls, computation: str | None, name: str, m: re.Match, line: str) -> Instruction:
        """The record of one INSTRUCTION match (built without the frozen __init__'s
        per-field setattr: a large program has tens of thousands)."""
        ins = object.__new__(cls)
        op, shape, rest = m.group("op", "shape", "rest")
        _SET_DICT(ins, "__dict__", {"computation": computation, "name": name, "op": op,
                                    "shape": shape, "rest": rest, "line": line,
                                    "root": line.lstrip().startswith("ROOT")})
        return ins

    @_once
    def result(self):
        """The result as Arrays: an Array, or a tuple (of trees) for a tuple."""
        return shape_tree(self.shape)

    @_once
    def results(self) -> tuple[Array, ...]:
        """Every array of the result, flattened in order."""
        return tuple(arrays(self.shape))

    @_once
    def operand_text(self) -> str:
        return _operand_text(self.rest)

    @_once
    def operands(self) -> tuple[str, ...]:
        """The operands' names."""
        return tuple(_OPERAND.findall(self.operand_text))

    @_once
    def operand_count(self) -> int:
        """Operands between the parentheses, named or not (shapes printed with the operands,
        `f32[2,3]{1,0} %p`, hold commas of their own)."""
        depth, count, seen = 0, 0, False
        for ch in self.operand_text:
            if ch in "([{":
                depth += 1
            elif ch in ")]}":
                depth -= 1
            elif ch == "," and depth == 0:
                count += 1
                continue
            seen = seen or not ch.isspace()
        return count + 1 if seen else 0

    @_once
    def called(self) -> tuple[tuple[str, str], ...]:
        """(attribute, computation) of every computation it names: body, condition,
        to_apply, calls (branches: `branches`)."""
        return tuple(_CALLED.findall(self.line))

    def calls(self, *attributes: str) -> list[str]:
        """The computations it names under the given attributes (all where none given)."""
        return [c for a, c in self.called if not attributes or a in attributes]

    @_once
    def branches(self) -> list[str]:
        return branches(self.line)

    @_once
    def op_name(self) -> str | None:
        """Its metadata's op_name (None where it has none)."""
        found = _OP_NAME.search(self.line)
        return found.group(1) if found else None

    @_once
    def replica_groups(self) -> list[list[int]] | None:
        return replica_groups(self.line)

    @_once
    def permute_pairs(self) -> list[tuple[int, int]] | None:
        return permute_pairs(self.line)

    @_once
    def dims_attributes(self) -> dict[str, tuple[int, ...]]:
        """Its `*_dims={...}` attributes, e.g. lhs_contracting_dims."""
        return {k: tuple(int(d) for d in v.split(",") if d)
                for k, v in _DIMS_ATTR.findall(self.rest)}

    @_once
    def custom_call_target(self) -> str | None:
        found = _TARGET.search(self.line)
        return found.group(1) if found else None

    @_once
    def fusion_kind(self) -> str | None:
        """A fusion's backend kind (e.g. __triton_gemm, __cudnn$fusion), None where unnamed."""
        found = _FUSION_KIND.search(self.line)
        return found.group(1) if found else None

    @_once
    def custom_fusion(self) -> str | None:
        found = _CUSTOM_FUSION.search(self.line)
        return found.group(1) if found else None

    @_once
    def backend_config(self) -> dict[str, object]:
        """Its backend_config JSON object, parsed ({} where absent or unreadable)."""
        m = _BACKEND.search(self.line)
        if not m:
            return {}
        text = m.group(1)
        depth = 0
        for i, c in enumerate(text):  # the JSON object ends where its braces balance
            depth += c == "{"
            depth -= c == "}"
            if depth == 0:
                try:
                    return json.loads(text[:i + 1])
                except ValueError:
                    return {}
        return {}

    @property
    def collective(self) -> str | None:
        """The collective kind it is or starts (sync, or an async `-start`), else None."""
        base = self.op[:-len("-start")] if self.op.endswith("-start") else self.op
        return base if base in COLLECTIVE_KINDS else None


def typed(hlo_text: str) -> tuple[Instruction, ...]:
    """Every instruction of a program, in text order (a scheduled module's order); parsed
    once per program and shared between callers."""
    return reading(hlo_text).instructions

"""What a compiled program keeps live, from XLA's own buffer assignment: which temporary
buffer is live at each step of the schedule, and at each step what one more decoder block
would add (`read_dump`'s profile, `peak_at_depth`).

Why: a decoder's plan compiles the step at depth 1 and 2 and extrapolates to its depth. Its
temporaries are not linear in depth: each block adds what it keeps for its backward (its
input, under full remat), but the working set at the peak is one block's backward and the
logits, which XLA schedules differently in each shallow program. llama3-70b fsdp_tp with
sequence parallelism and full remat, ordered: 25.8, 30.3, 31.0 and 33.0 GiB of temporaries
compiled whole at depth 1, 2, 8 and 16; the line through depth 1 and 2 says 383 GiB at 80, the
depth-2 live ranges 31.8 at 8, 33.8 at 16 and 49 at 80 (the slope from 8 to 16 says 49).

XLA:GPU writes its buffer assignment and live ranges only into a dump folder (no API returns
them), so `jaxdist.program.compiled` compiles device-less XLA:GPU programs with `dump_options` and
reads the folder with `read_dump` before removing it. An op's block is its name scope
(models.layers.BLOCK_SCOPE, in the op's metadata: `jvp(block_0)` forward, `transpose(jvp(
block_0))` backward); the op names are read with jaxdist.program.hlo.
"""

from __future__ import annotations

import dataclasses
import re
import weakref
from pathlib import Path

from jaxdist.figures import Figures
from jaxdist.program import hlo

# models.layers.BLOCK_SCOPE, the i-th block (not imported: it would bring flax into every
# import of jaxdist.program.compiled)
BLOCK = re.compile(r"(?<![\w])block_(\d+)(?![\w])")
_VALUE = re.compile(r"^\s*value: <\d+ (\S+) @\d+> \(size=(\d+),offset=\d+\)")
_RANGE = re.compile(r"^\s*(\S+):(\d+)-(\d+)\s*$")

# compiled program -> its reading (read_dump), kept as long as the program is
_READINGS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@dataclasses.dataclass(frozen=True)
class LiveRanges(Figures):
    """What XLA's live ranges of a program say: the most bytes live at once and at which
    value, and the profile (live bytes, bytes each further block would add) of the steps
    no other step dominates (`peak_at_depth` reads it)."""
    peak_live_bytes: int
    peak_at: str
    profile: list[tuple[int, float]]


def dump_options(folder: str) -> dict[str, str | bool]:
    """Per-compile XLA options that write the buffer assignment and live ranges (text) into
    `folder`, without the LLVM IR."""
    return {"xla_dump_to": folder, "xla_dump_hlo_as_text": True, "xla_gpu_dump_llvmir": False}


def remember(compiled, reading: LiveRanges | None) -> None:
    if reading is not None:
        _READINGS[compiled] = reading


def of(compiled) -> LiveRanges | None:
    """The reading `read_dump` made when `compiled` was compiled (None: not dumped)."""
    try:
        return _READINGS.get(compiled)
    except TypeError:  # not weak-referenceable: never remembered
        return None


def _module_files(folder: Path) -> tuple[Path, Path, Path] | None:
    """The dumped optimized module with the largest text, its buffer assignment and live
    ranges (one compile per folder; a helper module XLA compiled on the way is smaller)."""
    texts = [p for p in folder.glob("*after_optimizations.txt")]
    if not texts:
        return None
    text = max(texts, key=lambda p: p.stat().st_size)
    stem = text.name[:-len(".txt")]
    assignment, ranges = (folder / f"{stem}-buffer-assignment.txt",
                          folder / f"{stem}-live-range.txt")
    return (text, assignment, ranges) if assignment.exists() and ranges.exists() else None


def op_names(hlo_text: str) -> dict[str, str]:
    """Each value's op name (`name` or `name{i}` for a tuple element): its instruction's
    metadata; a fusion without one (XLA drops it on some multi-output fusions) takes its
    fused computation's root's, element i from the root tuple's i-th operand."""
    own, roots, calls = {}, {}, {}
    for ins in hlo.typed(hlo_text):
        if ins.op_name is not None:
            own[ins.name] = ins.op_name
        if ins.op == "fusion":
            called = ins.calls("calls")
            if called:
                calls[ins.name] = called[0]
        if ins.root:
            roots[ins.computation] = (ins.name, ins.op, list(ins.operands))
    names = dict(own)
    for fusion, comp in calls.items():
        if comp not in roots:
            continue
        root, op, operands = roots[comp]
        if op == "tuple":
            for i, operand in enumerate(operands):
                if operand in own:
                    names[f"{fusion}{{{i}}}"] = own[operand]
        if fusion not in own and root in own:
            names[fusion] = own[root]
    return names


def read_dump(folder) -> LiveRanges | None:
    """From a folder `dump_options` filled: peak_live_bytes (the temporaries live at the
    busiest step of the schedule, summed), peak_at (that step's instruction), profile.
    `profile`: (live bytes, held bytes) per step of the schedule, only the steps no other
    step beats on both: held is what each block other than the step's own holds there, per
    block (saved forward values, and backward values that outlive the own block's backward:
    gradients), i.e. what one more block would add at that step (`peak_at_depth`). None
    when the folder has no dump."""
    files = _module_files(Path(folder))
    if files is None:
        return None
    text_path, assignment_path, ranges_path = files
    sizes, in_temp = {}, False
    for line in assignment_path.read_text().splitlines():
        if line.startswith("allocation"):
            in_temp = "preallocated-temp" in line
        elif in_temp:
            m = _VALUE.match(line)
            if m:
                sizes[m.group(1)] = int(m.group(2))
    ranges_text = ranges_path.read_text()
    sequence_text, _, ranges_part = ranges_text.partition("BufferLiveRange")
    sequence = {int(i): name for i, name in re.findall(r"^\s+(\d+):(\S+)\s*$", sequence_text,
                                                       re.M)}
    live = {}
    for line in ranges_part.splitlines():
        m = _RANGE.match(line)
        if m and m.group(1).replace("{}", "") in sizes:
            live[m.group(1).replace("{}", "")] = (int(m.group(2)), int(m.group(3)))
    if not live:
        return None
    names = op_names(text_path.read_text())

    def name_of(value):
        return names.get(value) or names.get(value.split("{")[0], "")

    def block_pass(value) -> tuple[int | None, bool]:
        name = name_of(value)
        found = BLOCK.search(name)
        return (int(found.group(1)) if found else None), "transpose(" in name

    spans: dict = {}  # (block, backward) -> first and last step of its instructions
    for t, inst in sequence.items():
        b, backward = block_pass(inst)
        if b is not None:
            first, last = spans.get((b, backward), (t, t))
            spans[(b, backward)] = (min(first, t), max(last, t))

    def own_block(t) -> tuple[int | None, bool, int]:
        """The block whose backward (else forward) is under way at step t, the most recently
        started where XLA interleaved two (it defers weight gradients, and the head's, into
        the next block's backward), whether that is its backward, and that pass's last step;
        None at the head or the optimizer."""
        for backward in (True, False):
            running = [(first, b, last) for (b, bw), (first, last) in spans.items()
                       if bw == backward and first <= t <= last]
            if running:
                _, b, last = max(running)
                return b, backward, last
        return None, False, 0

    def held_at(own, own_backward, own_end, b, backward, end) -> bool:
        """Whether a value of block b live at a step of `own` is one a further block would
        repeat there: an earlier block's saved forward value (in the forward, one that
        outlives the own block's forward: not the input it consumes); in the backward, also
        a later block's value that outlives the own block's backward (a gradient: not the
        cotangent the own block consumes, nor a later block's weights gathered ahead of
        it); at the head or the optimizer every block's."""
        if b is None or b == own:
            return False
        if own is None:
            return True
        if b < own:
            return not backward and (own_backward or end > own_end)
        return own_backward and end > own_end

    values = [(start, end, sizes[v], *block_pass(v)) for v, (start, end) in live.items()]
    blocks = {b for b, _ in spans}
    steps = max(end for _, end, *_ in values) + 1
    points, peak, peak_at = [], -1, 0
    for t in range(steps):
        own, own_backward, own_end = own_block(t)
        others = blocks - {own}
        total = held = 0
        for start, end, size, b, backward in values:
            if start <= t <= end:
                total += size
                if held_at(own, own_backward, own_end, b, backward, end):
                    held += size
        points.append((total, held / len(others) if others else 0.0))
        if total > peak:
            peak, peak_at = total, t
    profile = [p for p in set(points)
               if not any(q[0] >= p[0] and q[1] >= p[1] and q != p for q in points)]
    return LiveRanges(peak_live_bytes=peak, peak_at=sequence.get(peak_at, ""),
                      profile=sorted(profile))


def peak_at_depth(profile, blocks: int) -> float:
    """The busiest step's live bytes with `blocks` more blocks than the profiled program:
    max over steps of live + blocks x held."""
    return max(live + blocks * held for live, held in profile)

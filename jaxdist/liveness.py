"""What a compiled program keeps live, from XLA's own buffer assignment: which temporary
buffer is live at each step of the schedule, and from that, what one decoder block adds to
the program's peak (`held_per_block`).

Why: a decoder's plan compiles the step at depth 1 and 2 and extrapolates to its depth. The
peak temporaries are not linear in depth: each block adds what it keeps for its backward
(its input, and with `--remat dots` its matmul outputs), but the working set at the peak (a
block's recomputation and backward, the logits) is one block's, and XLA's scheduler arranges
it differently in each program: llama3-70b fsdp_tp with sequence parallel peaks at 25.2 GiB of
temporaries at depth 1 and 29.3 GiB at depth 2, of which one block holds 0.25 GiB; the other
4 GiB is a working set arranged differently, and a linear line multiplies it by the depth.

XLA:GPU writes its buffer assignment and live ranges only into a dump folder (no API returns
them), so `jaxdist.compiled` compiles device-less XLA:GPU programs with `dump_options` and
reads the folder with `read_dump` before removing it. The block of an op is its name scope
(models.layers.BLOCK_SCOPE, in the op's metadata: `jvp(block_0)` forward, `transpose(jvp(
block_0))` backward); the op names are read with jaxdist.hlo.
"""

from __future__ import annotations

import re
import weakref
from pathlib import Path

from jaxdist import hlo

# models.layers.BLOCK_SCOPE, the i-th block (models is not imported here: the package graph
# runs models -> jaxdist.errors only)
BLOCK = re.compile(r"(?<![\w])block_(\d+)(?![\w])")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_VALUE = re.compile(r"^\s*value: <\d+ (\S+) @\d+> \(size=(\d+),offset=\d+\)")
_RANGE = re.compile(r"^\s*(\S+):(\d+)-(\d+)\s*$")
_FUSION_CALL = re.compile(r"calls=%?([\w.\-]+)")

# compiled program -> its reading (read_dump), kept as long as the program is
_READINGS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def dump_options(folder: str) -> dict:
    """Per-compile XLA options that write the buffer assignment and live ranges (text) into
    `folder`, without the LLVM IR."""
    return {"xla_dump_to": folder, "xla_dump_hlo_as_text": True, "xla_gpu_dump_llvmir": False}


def remember(compiled, reading: dict | None) -> None:
    if reading is not None:
        _READINGS[compiled] = reading


def of(compiled) -> dict | None:
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
    for comp, name, m, line in hlo.instructions(hlo_text):
        found = _OP_NAME.search(line)
        if found:
            own[name] = found.group(1)
        if m.group("op") == "fusion":
            called = _FUSION_CALL.search(line)
            if called:
                calls[name] = called.group(1)
        if line.lstrip().startswith("ROOT"):
            operands = re.findall(r"%([\w.\-]+)", m.group("rest").split(")")[0])
            roots[comp] = (name, m.group("op"), operands)
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


def read_dump(folder) -> dict | None:
    """From a folder `dump_options` filled: {peak_live_bytes (the temporaries live at the
    busiest step of the schedule, summed), peak_at (that step's instruction),
    held_per_block_bytes (what each block other than the one at the peak holds there, per
    block: what a further block would add to the peak; None when the program has no block
    scopes or its other blocks hold nothing at the peak, e.g. a peak in the optimizer)}.
    None when the folder has no dump."""
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
    steps = max(end for _, end in live.values()) + 1
    delta = [0] * (steps + 1)
    for name, (start, end) in live.items():
        delta[start] += sizes[name]
        delta[end + 1] -= sizes[name]
    total, peak, peak_at = 0, -1, 0
    for t in range(steps):
        total += delta[t]
        if total > peak:
            peak, peak_at = total, t
    names = op_names(text_path.read_text())

    def name_of(value):
        return names.get(value) or names.get(value.split("{")[0], "")

    def block(value) -> int | None:
        found = BLOCK.search(name_of(value))
        return int(found.group(1)) if found else None

    # The buffers the other blocks of the depth-2 program hold at the peak: what their
    # forward saved (when the peak is in the last block's backward or at the head), and what
    # their backward made that outlives the peak's block (gradients, when the peak is in the
    # first block's backward); not the cotangent a block's backward hands to the next one,
    # which the peak's block consumes: one at a time, whatever the depth.
    own = block(sequence.get(peak_at, ""))
    own_end = max((t for t, inst in sequence.items() if block(inst) == own), default=0)
    others = {block(v) for v in live} - {None, own}

    def holds(value, end) -> bool:
        backward = "transpose(" in name_of(value)
        return block(value) in others and (not backward or own is None or end > own_end)

    held = sum(sizes[v] for v, (start, end) in live.items()
               if start <= peak_at <= end and holds(v, end))
    per_block = held / len(others) if held and others else None
    return {"peak_live_bytes": peak, "peak_at": sequence.get(peak_at, ""),
            "held_per_block_bytes": per_block}

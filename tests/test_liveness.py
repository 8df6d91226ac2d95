"""jaxdist.program.liveness reads XLA's buffer live ranges from a dump: the peak of the temporaries
and what one block holds there. Hand-written dumps in XLA's text formats (the three files XLA:GPU
writes for a module), so each case is exact; the real dumps are read by every XLA:GPU plan
(tests/test_predict.py compares a plan with a whole compile)."""

from jaxdist.program import liveness
from jaxdist.predict import program

FWD, BWD = "jit(step_fn)/jvp({})/dot_general", "jit(step_fn)/transpose(jvp({}))/dot_general"


def write_dump(folder, values):
    """values: (name, op_name, bytes, first step, last step), in schedule order."""
    stem = "module_0001.jit_step_fn.sm_9.0a_gpu_after_optimizations"
    hlo = ["HloModule jit_step_fn, is_scheduled=true", "",
           "ENTRY %main.1 (p.1: f32[4]) -> f32[4] {", "  %p.1 = f32[4]{0} parameter(0)"]
    hlo += [f'  %{n} = f32[4]{{0}} add(%p.1, %p.1), metadata={{op_name="{op}"}}'
            for n, op, *_ in values]
    hlo += [f"  ROOT %out = f32[4]{{0}} copy(%{values[-1][0]})", "}"]
    (folder / f"{stem}.txt").write_text("\n".join(hlo) + "\n")
    total = sum(v[2] for v in values)
    (folder / f"{stem}-buffer-assignment.txt").write_text(
        f"allocation 0: size {total}, preallocated-temp:\n" + "".join(
            f" value: <{i} {n} @0> (size={b},offset=0): f32[4]{{0}}\n"
            for i, (n, _, b, *_) in enumerate(values)))
    (folder / f"{stem}-live-range.txt").write_text(
        "HloLiveRange (max 9):\n  InstructionSequence:\n"
        + "".join(f"    {i}:{n}\n" for i, (n, *_) in enumerate(values))
        + "  BufferLiveRange:\n" + "".join(f"    {n}{{}}:{a}-{z}\n"
                                           for n, _, _, a, z in values))


def test_peak_in_the_last_blocks_backward_counts_what_the_first_block_saved(tmp_path):
    write_dump(tmp_path, [
        ("embed", "jit(step_fn)/jvp()/add", 10, 0, 4),
        ("out0", FWD.format("block_0"), 20, 1, 3),   # block 1's input, saved for its backward
        ("out1", FWD.format("block_1"), 5, 2, 3),
        ("work1", BWD.format("block_1"), 100, 3, 3),  # the peak: 10 + 20 + 5 + 100
        ("work0", BWD.format("block_0"), 50, 4, 4)])
    # at block 1's backward block 0 holds its output (block 1's saved input): 20 per block
    assert liveness.read_dump(tmp_path) == liveness.LiveRanges(
        peak_live_bytes=135, peak_at="work1", profile=[(135, 20)])


def test_peak_in_the_first_blocks_backward_counts_gradients_not_the_cotangent(tmp_path):
    write_dump(tmp_path, [
        ("embed", "jit(step_fn)/jvp()/add", 10, 0, 4),
        ("out0", FWD.format("block_0"), 5, 1, 4),
        ("grad1", BWD.format("block_1"), 30, 2, 5),   # block 1's gradient: to the optimizer
        ("cot1", BWD.format("block_1"), 40, 3, 4),    # block 1's cotangent, block 0 consumes
        ("work0", BWD.format("block_0"), 200, 4, 4),  # the peak: 10 + 5 + 30 + 40 + 200
        ("update", "jit(step_fn)/add", 1, 5, 5)])
    # at block 0's backward block 1 holds its gradient (30), not its cotangent
    assert liveness.read_dump(tmp_path) == liveness.LiveRanges(
        peak_live_bytes=285, peak_at="work0", profile=[(285, 30)])


def test_a_peak_where_no_block_holds_anything_does_not_grow(tmp_path):
    write_dump(tmp_path, [("embed", "jit(step_fn)/jvp()/add", 10, 0, 1),
                          ("out0", FWD.format("block_0"), 5, 1, 1),
                          ("update", "jit(step_fn)/add", 90, 2, 2)])
    profile = liveness.read_dump(tmp_path).profile
    assert profile == [(90, 0.0)] and liveness.peak_at_depth(profile, 100) == 90
    assert liveness.read_dump(tmp_path / "absent") is None


def test_extrapolated_temporaries_grow_at_the_step_where_blocks_hold_most():
    def figs(temp, profile=None):
        return program.StepFigures(
            flops=0.0, bytes_accessed=0.0, comm=[],
            memory={"argument_bytes": 40, "output_bytes": 40, "alias_bytes": 40,
                    "temp_bytes": temp, "peak_bytes": 40 + temp},
            liveness=liveness.LiveRanges(peak_live_bytes=150, peak_at="",
                                         profile=profile) if profile else None)

    # depth 2's peak (150 live, nothing held) is overtaken at depth 10 by a step at 100 live
    # where each block holds 10: 100 + 8 x 10 = 180; the buffer assignment's 10 bytes over
    # the live sum (160 - 150) stay
    at10 = program.extrapolated_memory(figs(100), figs(160, [(100, 10), (150, 0)]), 10,
                                       ordered=True)
    memory, method = at10
    assert memory["temp_bytes"] == 160 + 180 - 150
    assert memory["peak_bytes"] == 40 + 190
    assert method.startswith("temporaries: depth 2's + ")
    for line in (program.extrapolated_memory(figs(100), figs(160), 10, ordered=True),
                 program.extrapolated_memory(figs(100), figs(160, [(150, 5)]), 10)):
        # no reading, or a backward XLA may reorder (no full remat): a line
        memory, method = line
        assert memory["temp_bytes"] == 100 + 9 * 60
        assert method == "linear in depth through depth 1 and 2"

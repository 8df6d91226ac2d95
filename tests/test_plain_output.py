"""What a run and a plan print, in plain words: XLA's C++ rematerialization warning said in
one line, a GPU target built from another part's named as such, a progress bar counting the
steps the summary's n counts, `--mesh 8` shown as typed, and --remat's help and error naming
every model family it applies to."""

from __future__ import annotations

import os

import pytest

from tests.helpers import run_loop
from jaxdist.program import compiled
from jaxdist.config import LoopConfig, MeshConfig, ModelConfig, OutputConfig, RunConfig, TrainConfig
from jaxdist.devices import select_devices
from jaxdist.mesh import MeshShape, parse_mesh
from jaxdist.record import mesh_spec
from jaxdist.summary import mesh_text
from jaxdist.program.xla_log import explained_xla_warnings

# As XLA:GPU logs it compiling llama3-70b under ddp on 4x8 H200 for a plan.
REMAT = ("W1202 08:08:30.797227    9602 hlo_rematerialization.cc:3231] Can't reduce memory use "
         "below 101.93GiB (109447566870 bytes) by rematerialization; only reduced to 132.62GiB "
         "(142405632544 bytes), down from 151.38GiB (162542592576 bytes) originally\n")


def test_xla_rematerialization_warnings_become_one_line_and_the_rest_passes(capfd):
    with explained_xla_warnings():
        os.write(2, REMAT.encode())
        os.write(2, b"E1202 08:08:31.0 1 other.cc:1] something else\n")
        os.write(2, REMAT.replace("132.62", "140.00").encode())
    err = capfd.readouterr().err
    assert err.splitlines() == [
        "note: XLA's compiler could not bring a program under the GPU's memory by "
        "recomputing activations (it reached 132.62GiB of a 101.93GiB limit); its warnings "
        "are left out, and the memory line of the plan says whether the step fits",
        "E1202 08:08:31.0 1 other.cc:1] something else"]
    os.write(2, b"after\n")  # stderr is itself again
    assert capfd.readouterr().err == "after\n"


@pytest.mark.skipif(compiled.gpu_compiler_missing() is not None,
                    reason=str(compiled.gpu_compiler_missing()))
def test_a_derived_gpu_target_says_what_it_was_built_from():
    from jaxdist.hardware import get_hardware

    label = compiled.gpu_topology(get_hardware("h200"), 8).label
    assert "sibling" not in label
    assert label.endswith("(XLA publishes no H200 spec: the H100 SXM one (same GH100 die, "
                          "132 SMs, 50 MB L2, 1.98 GHz boost) with the H200's memory)")


def test_progress_bar_counts_warmup_apart_and_then_the_timed_steps(capsys):
    cfg = RunConfig(mesh=MeshConfig(mesh="8"), model=ModelConfig(model="mlp-tiny"),
                    train=TrainConfig(layout="ddp", batch_size=16),
                    loop=LoopConfig(warmup=2, steps=3), output=OutputConfig(progress=True))
    results = run_loop(cfg, select_devices(MeshShape(8)), None, log=lambda *_: None)
    err = capsys.readouterr().err
    assert results["step_time_s"]["n"] == 3
    assert "ddp 8 warm-up: 100%" in err and "| 2/2 " in err
    assert "ddp 8 timed: 100%" in err and "| 3/3 " in err
    assert "/5 " not in err  # never warm-up and timed steps in one count


def test_a_data_only_mesh_reads_as_typed():
    assert mesh_spec({"data": 8, "fsdp": 1}) == parse_mesh("8").spec == "8"
    assert parse_mesh(parse_mesh("8").spec) == parse_mesh("8")
    assert mesh_text({"data": 8, "fsdp": 1}) == "data=8 x fsdp=1 (--mesh 8)"
    assert mesh_spec({"data": 1, "fsdp": 8}) == "1x8"
    assert mesh_spec({"workers": 2, "devices_per_worker": 1}) == "2x1"  # ps: WORKERSxDEVICES


def test_remat_help_and_error_name_every_decoder_family(capsys):
    from experiments.run import build_parser, main

    help_text = " ".join(build_parser().format_help().split())
    assert "activation recomputation per block (the decoders: gpt, llama and moe models)" \
        in help_text
    assert main(["--remat", "full", "--model", "mlp-tiny", "--mesh", "8"]) == 2
    assert capsys.readouterr().err.strip() == (
        "run: error: --remat applies to the decoders (gpt, llama and moe models), not "
        "'mlp-tiny'")

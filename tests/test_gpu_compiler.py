"""XLA:GPU compiling the project's own step for 4 hosts x 8 H200 with no GPU present
(jaxdist.program.compiled.gpu_topology): for every layout, the program's collectives are async
pairs, their bytes are the analytic volume at the dtype XLA:GPU moves, and the state each device
holds is the exact shard bytes the CPU path plans. Skipped, with the reason, where the GPU
compiler is not installed (`make gpu-compiler`)."""

import dataclasses

import pytest

from jaxdist import metrics
from jaxdist.program import compiled, kernels, program_reading, xla_compile
from jaxdist.config import MeshConfig, ModelConfig, RunConfig, TrainConfig
from jaxdist.errors import UsageError
from jaxdist.hardware import get_hardware
from jaxdist.mesh import parse_mesh
from tests.helpers import job_of

pytestmark = pytest.mark.skipif(compiled.gpu_compiler_missing() is not None,
                                reason=str(compiled.gpu_compiler_missing()))

H200 = get_hardware("h200")
PIPE = "depth=4"
CASES = {  # layout: (model, mesh, model options, micro-batches)
    "ddp": ("gpt-tiny", "4x8", "", 1), "zero1": ("gpt-tiny", "4x8", "", 1),
    "fsdp": ("gpt-tiny", "4x8", "", 1), "hsdp": ("gpt-tiny", "4x8", "", 1),
    "tp": ("gpt-tiny", "data:4,tensor:8", "", 1),
    "fsdp_tp": ("gpt-tiny", "data:4,tensor:8", "", 1),
    "ep": ("moe-tiny", "data:8,expert:4", "", 1),  # its 4 experts over expert
    "pp": ("gpt-tiny", "data:8,stage:4", PIPE, 4),
    "tp_pp": ("gpt-tiny", "data:1,stage:4,tensor:8", PIPE, 4),
    "fsdp_pp": ("gpt-tiny", "fsdp:8,stage:4", PIPE, 4),
}
_compiled: dict = {}
# The tests that read gpu_step's programs run on one xdist worker (`make test` is --dist
# loadgroup), so each layout is compiled once per session, not once per worker that happens
# to run one of its tests (an XLA:GPU compile is ~6 s of CPU: XLA ~4 s, ptxas ~2 s).
SHARES_PROGRAMS = pytest.mark.xdist_group("gpu-compiler-programs")


def config(layout: str, batch: int = 64) -> RunConfig:
    model, mesh, opts, mb = CASES[layout]
    return RunConfig(mesh=MeshConfig(mesh=mesh),
                     model=ModelConfig(model=model, model_opts=opts, dtype="bfloat16"),
                     train=TrainConfig(layout=layout, batch_size=batch, microbatches=mb))


def gpu_step(layout: str):
    """(cfg, program, reading) of the layout's step compiled by XLA:GPU, once per module."""
    if layout not in _compiled:
        cfg = config(layout)
        model_cfg = job_of(cfg).model
        shape = parse_mesh(cfg.mesh.mesh)
        target = compiled.gpu_topology(H200, shape.size)
        runs = None
        program, comp, seconds = compiled.compile_step(job_of(cfg), model_cfg, shape, target)
        if layout.endswith("pp"):
            from jaxdist.pipeline.report import switch_runs
            runs = switch_runs(comp.as_text(), dict(shape.axis_sizes), program.schedule)
        _compiled[layout] = (cfg, program, program_reading.read(comp, target, shape.axis_sizes, runs,
                                                         compile_s=seconds))
    return _compiled[layout]


def by_kind_axes(reading) -> dict:
    out: dict = {}
    for op in reading.collectives:
        row = out.setdefault((op["kind"], "+".join(op["axes"])), {"bytes": 0, "dtypes": set()})
        row["bytes"] += op["bytes"]
        row["dtypes"].update(op["dtypes"])
    return out


def params(program) -> int:
    import jax
    return sum(x.size for x in jax.tree.leaves(program.abstract_state["params"]))


@SHARES_PROGRAMS
@pytest.mark.parametrize("layout", list(CASES))
def test_every_layout_compiles_for_32_h200_with_async_collectives(layout):
    cfg, program, reading = gpu_step(layout)
    assert reading.compiler == "XLA:GPU"
    assert "XLA:GPU sm_90, compiled without a device, 4 host(s) x 8 h200" in reading.label
    assert reading.collectives, "a 32-device step moves data"
    sync = [op for op in reading.collectives if not op["async"]]
    assert not sync, f"sync collectives in XLA:GPU's program: {sync}"
    assert not reading.kernels_upper_bound
    assert any(k.startswith("collective (async)") for k in reading.kernels)
    # The state each device holds (donated, so aliased) is exactly the planned shard bytes,
    # the figure the CPU path and --dry-run give from shapes.
    planned = metrics.planned_bytes_per_device(program.abstract_state, program.state_specs,
                                               dict(parse_mesh(cfg.mesh.mesh).axis_sizes))
    assert reading.memory["alias_bytes"] == planned["total"]


@SHARES_PROGRAMS
@pytest.mark.parametrize("layout", ["ddp", "zero1", "fsdp", "hsdp"])
def test_data_parallel_bytes_are_the_analytic_volume_at_the_dtype_moved(layout):
    _, program, reading = gpu_step(layout)
    p = params(program)
    rows = by_kind_axes(reading)
    scalars = 1024  # the loss and a few f32 scalars ride along (bytes, not a fraction)
    if layout == "ddp":  # float32 gradients all-reduced whole
        ar = rows[("all-reduce", "data+fsdp")]
        assert 0 <= ar["bytes"] - 4 * p <= scalars and ar["dtypes"] == {"f32"}
    if layout == "zero1":  # Megatron's distributed optimizer with bf16 working weights:
        # float32 gradients reduce-scattered to the master's shards, bf16 weights gathered
        rs = rows[("reduce-scatter", "data+fsdp")]
        assert rs["bytes"] == 4 * p and rs["dtypes"] == {"f32"}
        ag = rows[("all-gather", "data+fsdp")]
        assert ag["bytes"] == 2 * p and ag["dtypes"] == {"bf16"}
    if layout in ("fsdp", "hsdp"):
        axis = "data+fsdp" if layout == "fsdp" else "fsdp"
        # bf16 weights gathered for compute, bf16 gradients reduce-scattered: half of f32
        assert rows[("all-gather", axis)]["bytes"] == 2 * p
        assert rows[("all-gather", axis)]["dtypes"] == {"bf16"}
        assert 0 <= rows[("reduce-scatter", axis)]["bytes"] - 2 * p <= scalars
        assert "all-gather" not in {k for k, _ in rows if _ == "data"}
    if layout == "hsdp":  # each fsdp group's gradient shard averaged across groups
        assert 0 <= rows[("all-reduce", "data")]["bytes"] - 2 * p / 8 <= scalars


@pytest.mark.parametrize("sequence_parallel,chunks", [(False, 1), (True, 1), (True, 2)])
def test_fsdp_tp_moves_only_weight_shards_on_the_data_axes(sequence_parallel, chunks):
    """fsdp_tp as torchtitan's FSDP2 x TP (llama-tiny, 4 hosts x 8 H200 as data 4 x fsdp 2 x
    tensor 4): on data and fsdp XLA:GPU's program moves no activation, only the weights'
    tensor shards all-gathered (bf16) and their gradients reduce-scattered, each exactly the
    parameters a tensor device holds, and the loss (one f32). With sequence parallelism the
    weights' gradients are reduce-scattered in bf16 too (its sublayers take their weights in
    the compute dtype: float32 and combined into one reduce-scatter at the end before), and
    the norms' gradients, partial over the sequence shards, all-reduced over data, fsdp and
    tensor (f32: 4 norms of 64). Its weight shards are cast before they are gathered, as
    without it (models/sequence_parallel.sublayer: they were gathered in float32, 98,944
    bytes where 57,984 are bf16). Two tp-comm slices (fsdp_tp's default here) gather and
    reduce the norms' vectors once per slice and move nothing else more."""
    import jax
    from jax.sharding import PartitionSpec as P

    mesh = "data:4,fsdp:2,tensor:4"
    cfg = RunConfig(mesh=MeshConfig(mesh=mesh),
                    model=ModelConfig(model="llama-tiny", dtype="bfloat16",
                                      model_opts="kv_heads=4"),
                    train=TrainConfig(layout="fsdp_tp", batch_size=64,
                                      sequence_parallel=sequence_parallel,
                                      tp_comm_chunks=chunks))
    model_cfg = job_of(cfg).model
    shape = parse_mesh(mesh)
    target = compiled.gpu_topology(H200, shape.size)
    program, comp, _ = compiled.compile_step(job_of(cfg), model_cfg, shape, target)
    reading = program_reading.read(comp, target, shape.axis_sizes)
    tensor = shape.axis_sizes["tensor"]
    specs = jax.tree.leaves(program.state_specs["params"], is_leaf=lambda x: isinstance(x, P))
    leaves = jax.tree.leaves(program.abstract_state["params"])
    shard = sum(x.size // (tensor if "tensor" in spec else 1) for x, spec in zip(leaves, specs))
    on_data = [op for op in reading.collectives if set(op["axes"]) & {"data", "fsdp"}]
    assert {op["kind"] for op in on_data} == {"all-gather", "reduce-scatter", "all-reduce"}
    norms = [op for op in on_data if "tensor" in op["axes"]]
    if sequence_parallel:
        assert [(op["kind"], op["bytes"], op["dtypes"]) for op in norms] == [
            ("all-reduce", 4 * 4 * 64 * chunks, ["f32"])]
    else:
        assert norms == []  # never mixed with tensor
    on_data = [op for op in on_data if op not in norms]
    assert all(op["axes"] == ["data", "fsdp"] for op in on_data)
    size = {"bf16": 2, "f32": 4}
    gathered = [op for op in on_data if op["kind"] == "all-gather"]
    assert sum(op["bytes"] for op in gathered) == 2 * (shard + 4 * 64 * (chunks - 1))
    assert {d for op in gathered for d in op["dtypes"]} == {"bf16"}
    scattered = [op for op in on_data if op["kind"] == "reduce-scatter"]
    assert sum(op["bytes"] // size[op["dtypes"][0]] for op in scattered) == shard - 4 * 64 * (
        sequence_parallel)
    # measured: the blocks' largest; the embedding's and head's 8,192 bytes go on their own
    # since fsdp_tp orders its blocks (XLA combined them into one of 57,344 before)
    assert max(op["bytes"] for op in scattered if op["dtypes"] == ["bf16"]) == 49152
    assert sum(op["bytes"] for op in on_data if op["kind"] == "all-reduce") == 4  # the loss


@pytest.mark.parametrize("reduce_dtype, itemsize, name", [("float32", 4, "f32"),
                                                          ("bfloat16", 2, "bf16")])
def test_distributed_optimizer_moves_gradient_shards_and_bf16_weights_on_data(
        reduce_dtype, itemsize, name):
    """tp on data:4,tensor:8 with --distributed-optimizer and bf16 (Megatron's): on `data`
    one reduce-scatter of the gradients each device's tensor shard has, in float32 or with
    --grad-reduce-dtype bfloat16 in bf16 (XLA:CPU promotes a bf16 reduction to float32, so
    only XLA:GPU's program shows it), and one bf16 all-gather of its working weights,
    nothing else but the loss."""
    cfg = dataclasses.replace(config("tp"), train=TrainConfig(
        layout="tp", batch_size=64, distributed_optimizer=True,
        grad_reduce_dtype=reduce_dtype))
    model_cfg = job_of(cfg).model
    shape = parse_mesh(cfg.mesh.mesh)
    target = compiled.gpu_topology(H200, shape.size)
    program, comp, seconds = compiled.compile_step(job_of(cfg), model_cfg, shape, target)
    reading = program_reading.read(comp, target, shape.axis_sizes, None, compile_s=seconds)
    planned = metrics.planned_bytes_per_device(program.abstract_state, program.state_specs,
                                               dict(shape.axis_sizes))
    p_tp = planned["params"] // 2  # bf16 working weights: elements per device under tp
    rows = {k: v for k, v in by_kind_axes(reading).items() if k[1] == "data"}
    assert rows.pop(("reduce-scatter", "data")) == {"bytes": itemsize * p_tp,
                                                     "dtypes": {name}}
    assert rows.pop(("all-gather", "data")) == {"bytes": 2 * p_tp, "dtypes": {"bf16"}}
    assert rows == {("all-reduce", "data"): {"bytes": 4, "dtypes": {"f32"}}}  # the loss
    assert reading.memory["alias_bytes"] == planned["total"]
    assert planned["master"] == (planned["opt"] - 4) // 2 == 4 * p_tp // 4  # f32 over data 4


@SHARES_PROGRAMS
def test_pipeline_sends_equal_the_analytic_stage_bytes():
    cfg, program, reading = gpu_step("tp_pp")
    model_cfg = job_of(cfg).model
    sends = sum(op["bytes"] for op in reading.collectives
                if op["kind"] == "collective-permute")
    S, M = 4, cfg.train.microbatches
    rows = cfg.train.batch_size // M  # data = 1
    # 2 directions x M micro-batches x (S - 1) boundaries x one bf16 activation, over S stages
    analytic = 2 * M * (S - 1) * rows * model_cfg.seq_len * model_cfg.width * 2 / S
    assert sends == pytest.approx(analytic)


@SHARES_PROGRAMS
def test_tensor_parallel_moves_bf16_activations():
    _, _, reading = gpu_step("tp")
    tensor = by_kind_axes(reading)[("all-reduce", "tensor")]
    assert "bf16" in tensor["dtypes"]


def test_gpu_and_cpu_programs_side_by_side_name_their_differences():
    """fsdp on one host of 8: XLA:GPU moves bf16 and reduce-scatters, XLA:CPU all-reduces
    float32 gradients whole; the differences say so."""
    cfg = dataclasses.replace(config("fsdp"), mesh=MeshConfig(mesh="1x8"))
    model_cfg = job_of(cfg).model
    shape = parse_mesh("1x8")
    readings = {}
    for target in (compiled.gpu_topology(H200, 8), compiled.simulated_cpu(8)):
        _, comp, _ = compiled.compile_step(job_of(cfg), model_cfg, shape, target)
        readings[target.compiler] = program_reading.read(comp, target, shape.axis_sizes)
        # as_text's text, fetched once: XLA:GPU's from the modules the cost analysis read
        assert program_reading.text(comp) == comp.as_text()
        assert program_reading.text(comp) is program_reading.text(comp)
        if target.gpu:
            assert program_reading.modules(comp) is program_reading.modules(comp)
    gpu, cpu = readings["XLA:GPU"], readings["XLA:CPU"]
    assert "1 host(s) x 8 h200" in gpu.label
    total = {k: sum(op["bytes"] for op in r.collectives) for k, r in readings.items()}
    assert total["XLA:GPU"] < 0.6 * total["XLA:CPU"]
    lines = program_reading.differences(gpu, cpu)
    assert any(line.startswith("reduce-scatter: only XLA:GPU emits it") for line in lines)
    assert any("all-gather" in line and "bf16 vs f32" in line for line in lines), lines
    # The same state shards under both compilers.
    assert gpu.memory["alias_bytes"] == cpu.memory["alias_bytes"]


def test_cudnn_attention_is_compiled_as_cudnn_and_counted():
    cfg = RunConfig(mesh=MeshConfig(mesh="1x8"),
                    model=ModelConfig(model="llama-tiny", model_opts="attention=cudnn",
                                      dtype="bfloat16"),
                    train=TrainConfig(layout="fsdp", batch_size=16))
    model_cfg = job_of(cfg).model
    shape = parse_mesh("1x8")
    target = compiled.gpu_topology(H200, 8)
    _, comp, _ = compiled.compile_step(job_of(cfg), model_cfg, shape, target)
    inv = kernels.inventory(comp.as_text())
    fwd = inv.kernels["attention (cuDNN) forward"]
    bwd = inv.kernels["attention (cuDNN) backward"]
    depth = model_cfg.depth
    assert fwd["launches"] == depth and bwd["launches"] == depth
    # causal: half of 2 (fwd) and 5 (bwd) matmuls of 2 B H L L Dh, B = 2 rows per device
    B, H, L = 2, model_cfg.heads, model_cfg.seq_len
    one = 2 * B * H * L * L * (model_cfg.width // H)
    assert fwd["flops"] == pytest.approx(depth * one * 2 * 0.5)
    assert bwd["flops"] == pytest.approx(depth * one * 5 * 0.5)


@pytest.mark.parametrize("layout, mesh, sp, mb", [
    ("fsdp_tp", "data:2,tensor:4", False, 1),  # GQA: 2 kv heads over tensor 4 (repeated)
    ("fsdp_tp", "data:4,tensor:2", False, 1),
    ("tp", "data:4,tensor:2", True, 1),        # sequence parallel
    ("tp_pp", "data:2,stage:2,tensor:2", False, 2),
])
def test_cudnn_attention_compiles_under_the_tensor_layouts(layout, mesh, sp, mb):
    """XLA:GPU's cuDNN partitioning rule takes q, k, v only in one sharding (models/
    attention.py): each tensor layout gets the cuDNN forward and backward, each device on
    its own rows and query heads (the FLOPs of B / data rows and heads / tensor)."""
    cfg = RunConfig(mesh=MeshConfig(mesh=mesh),
                    model=ModelConfig(model="llama-tiny", model_opts="attention=cudnn",
                                      dtype="bfloat16"),
                    train=TrainConfig(layout=layout, batch_size=16, microbatches=mb,
                                      sequence_parallel=sp))
    model_cfg = job_of(cfg).model
    shape = parse_mesh(mesh)
    _, comp, _ = compiled.compile_step(job_of(cfg), model_cfg, shape,
                                       compiled.gpu_topology(H200, shape.size))
    found = kernels.inventory(comp.as_text()).kernels
    fwd, bwd = found["attention (cuDNN) forward"], found["attention (cuDNN) backward"]
    if mb > 1:
        return  # a pipeline's calls sit in its schedule's branches: present is the claim
    depth, sizes = model_cfg.depth, shape.axis_sizes
    # one call per block and slice (sequence parallel under tp: two, --tp-comm-chunks)
    calls = depth * model_cfg.tp_comm_chunks
    assert model_cfg.tp_comm_chunks == (2 if sp else 1)
    assert fwd["launches"] == calls and bwd["launches"] == calls
    B, H, L = 16 // sizes["data"], model_cfg.heads // sizes["tensor"], model_cfg.seq_len
    one = 2 * B * H * L * L * (model_cfg.width // model_cfg.heads)
    assert fwd["flops"] == pytest.approx(depth * one * 2 * 0.5)
    assert bwd["flops"] == pytest.approx(depth * one * 5 * 0.5)


def test_kernel_flops_count_every_loop_iteration():
    """A scan's body counted trip-count times (XLA's cost analysis counts it once)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    target = compiled.gpu_topology(H200, 8)
    mesh = Mesh(list(target.devices), ("d",))

    def f(w, x):
        y, _ = jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=5)
        return y.sum()

    fn = jax.jit(jax.grad(f), in_shardings=(NamedSharding(mesh, P()),
                                            NamedSharding(mesh, P("d"))))
    comp, _ = xla_compile.compile_timed(fn, jax.ShapeDtypeStruct((256, 256), jnp.bfloat16),
                                     jax.ShapeDtypeStruct((64, 256), jnp.bfloat16))
    reading = program_reading.read(comp, target, {"d": 8})
    body = 3 * 2 * 8 * 256 * 256  # forward, input and weight gradients of 8 rows per device
    assert reading.flops == 5 * body
    assert reading.xla_cost["flops"] < 2 * body  # XLA's own count: the body once


def test_in_place_updates_and_slices_move_their_rows_not_the_buffer():
    """A scatter-add and a dynamic-update-slice into a donated buffer run in place, and a
    kernel that reads a dynamic slice of a buffer reads that slice: each kernel's bytes
    are the rows it moves (and its indices), not the 4 MiB buffer."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    target = compiled.gpu_topology(H200, 8)
    one = NamedSharding(Mesh(list(target.devices)[:1], ("d",)), P())
    rows, width, n = 4096, 256, 64

    def scatter(buf, ids, upd):
        return buf.at[ids].add(upd)

    def update(buf, i, row):
        return jax.lax.dynamic_update_slice(buf, row, (i, 0))

    def sliced(buf, i, scale):
        return jax.lax.dynamic_slice(buf, (i, 0), (n, width)) * scale

    buf = jax.ShapeDtypeStruct((rows, width), jnp.float32)
    for fn, args, expected in (
            (scatter, (jax.ShapeDtypeStruct((n,), jnp.int32),
                       jax.ShapeDtypeStruct((n, width), jnp.float32)),
             4 * n + 3 * 4 * n * width),  # indices, updates, the rows read and written
            (update, (jax.ShapeDtypeStruct((), jnp.int32),
                      jax.ShapeDtypeStruct((1, width), jnp.float32)),
             4 + 2 * 4 * width),  # the index, the row read, the row written
            (sliced, (jax.ShapeDtypeStruct((), jnp.int32),
                      jax.ShapeDtypeStruct((), jnp.float32)),
             4 + 4 + 2 * 4 * n * width)):  # index, scale, the slice read and written
        jitted = jax.jit(fn, in_shardings=(one,) * 3,
                         donate_argnums=0 if fn is not sliced else ())
        comp, _ = xla_compile.compile_timed(jitted, buf, *args)
        text = program_reading.text(comp)
        moved = [k["bytes"] for items in kernels.schedule(text).values() for k in items
                 if k["item"] == "kernel"]
        assert sum(moved) == pytest.approx(expected, abs=64), (fn.__name__, moved)


def test_part_without_target_and_unfilled_hosts_are_one_line_errors():
    with pytest.raises(UsageError, match="l4 has no XLA:GPU target description.*--compiler cpu"):
        compiled.gpu_topology(get_hardware("l4"), 8)
    with pytest.raises(UsageError, match="do not fill hosts of 8 GPUs"):
        compiled.gpu_topology(H200, 12)


@SHARES_PROGRAMS
def test_kernel_cache_reuses_cubins_and_changes_no_figure():
    """Device-less compiles share XLA:GPU's kernel cache (compiled.kernel_cache_options):
    the step gpu_step compiled through the cache reads the same memory, collectives and
    kernels as the same step compiled without it, and the cache file holds the compiled
    kernels."""
    import os

    cfg, program, with_cache = gpu_step("fsdp_tp")
    model_cfg = job_of(cfg).model
    shape = parse_mesh(cfg.mesh.mesh)
    target = compiled.gpu_topology(H200, shape.size)
    options = compiled.compile_options(job_of(cfg), target)
    assert options == compiled.kernel_cache_options()
    assert compiled.compile_options(job_of(cfg), compiled.simulated_cpu(8)) is None
    assert os.path.getsize(options["xla_gpu_kernel_cache_file"]) > 0
    lowered = program.step.lower(program.abstract_state,
                                 compiled.abstract_batch(model_cfg, cfg.train.batch_size))
    (without, _), = xla_compile.compile_lowered([lowered], None)
    a, b = with_cache, program_reading.read(without, target, shape.axis_sizes)
    assert a.memory == b.memory
    assert a.collectives == b.collectives
    assert a.kernels == b.kernels


@pytest.mark.parametrize("layout,mesh", [("fsdp_tp", "data:2,tensor:2"),
                                         ("tp_pp", "stage:2,tensor:2")])
def test_overlap_variant_lowers_once_and_predicts_as_alone(layout, mesh):
    """A suite plan's cache (jaxdist.predict.prediction): the --overlap variant of a row reuses the
    base row's lowerings (its flags are compile options only), is compiled again with its
    flags, and predicts exactly what the same settings predict with no cache."""
    from jaxdist.config import CompilerConfig, OutputConfig
    from jaxdist.plan.predicted import predict_plan

    def cfg(overlap):
        return RunConfig(mesh=MeshConfig(mesh=mesh),
                         model=ModelConfig(model="gpt-tiny", model_opts="depth=2",
                                           dtype="bfloat16"),
                         train=TrainConfig(layout=layout, batch_size=8, microbatches=4),
                         compiler=CompilerConfig(overlap=overlap),
                         output=OutputConfig(dry_run=True, hardware="h200", gpus_per_node=2))

    def lowerings(cache):
        return sum(1 for k in cache if str(k[0]).startswith("lowered"))

    shape, cache, before = parse_mesh(mesh), {}, xla_compile.compiles_run()
    predict_plan(job_of(cfg(False), shape), cache=cache)
    lowered, compiles = lowerings(cache), xla_compile.compiles_run() - before
    assert lowered > 0 and compiles > 0
    with_cache = predict_plan(job_of(cfg(True), shape), cache=cache).to_json()
    assert lowerings(cache) == lowered
    assert xla_compile.compiles_run() - before == 2 * compiles
    alone = predict_plan(job_of(cfg(True), shape)).to_json()
    for part in ("time", "memory", "throughput"):
        assert with_cache[part] == alone[part], part
    assert with_cache["compiled"]["flops_per_device"] == alone["compiled"]["flops_per_device"]


_ep_steps: dict = {}


@pytest.mark.xdist_group("gpu-compiler-ep")  # ragged compares with sorted's program
@pytest.mark.parametrize("impl", ["sorted", "ragged"])
def test_ep_x_tp_moves_tokens_only_by_all_to_all_on_expert(impl):
    """ep x tp (moe-tiny, 2 hosts x 8 H200 as data 2 x tensor 2 x expert 4, one expert per
    expert device): tokens go to their experts and back by all-to-all on `expert` only;
    `data` carries only gradient all-reduces (f32, the expert parameters' tensor shard over
    data, the others' over data x expert), never activations. With moe_impl=ragged the expert
    matmuls are ragged_dot kernels (6 a layer: 3 forward, 3 backward input gradients; the
    weight gradients too), each with the FLOPs of its rows: one local expert, so as many as
    the batched GEMMs of moe_impl=sorted."""
    import jax
    from jax.sharding import PartitionSpec as P

    mesh = "data:2,tensor:2,expert:4"
    shape = parse_mesh(mesh)
    target = compiled.gpu_topology(H200, shape.size)

    def step(moe_impl):  # compiled once per process for each moe_impl
        if moe_impl not in _ep_steps:
            cfg = RunConfig(mesh=MeshConfig(mesh=mesh),
                            model=ModelConfig(model="moe-tiny",
                                              model_opts=f"moe_impl={moe_impl}",
                                              dtype="bfloat16"),
                            train=TrainConfig(layout="ep", batch_size=64))
            program, comp, _ = compiled.compile_step(job_of(cfg), job_of(cfg).model, shape, target)
            _ep_steps[moe_impl] = (program, comp,
                                   program_reading.read(comp, target, shape.axis_sizes))
        return _ep_steps[moe_impl]

    program, comp, reading = step(impl)
    ops = reading.collectives
    assert {op["kind"] for op in ops if op["kind"] == "all-to-all"} == {"all-to-all"}
    assert all(op["axes"] == ["expert"] for op in ops if op["kind"] == "all-to-all")
    on_data = [op for op in ops if "data" in op["axes"]]
    assert {op["kind"] for op in on_data} == {"all-reduce"}
    assert {d for op in on_data for d in op["dtypes"]} <= {"f32", "bf16"}
    specs = jax.tree.leaves(program.state_specs["params"], is_leaf=lambda x: isinstance(x, P))
    leaves = jax.tree.leaves(program.abstract_state["params"])
    held = sum(x.size // (2 if "tensor" in spec else 1) // (4 if "expert" in spec else 1)
               for x, spec in zip(leaves, specs))
    # every held gradient reduced once over data (at f32, or bf16 where XLA reduces before
    # the cast to the f32 parameter), and a few scalars besides (loss, balance losses)
    size = {"bf16": 2, "f32": 4}
    reduced = sum(op["bytes"] // size[op["dtypes"][0]] for op in on_data)
    assert 0 <= reduced - held <= 32, (reduced, held)
    kernels_ = [k for items in kernels.schedule(comp.as_text()).values() for k in items
                if k["item"] == "kernel" and k.get("ragged")]
    if impl == "sorted":
        assert not kernels_
        return
    from jaxdist.predict.kernels_time import GEMM_KINDS
    gemms = [k for k in kernels_ if k["kind"] in GEMM_KINDS]
    assert len(gemms) >= 2 * 6 and all(k["flops"] > 0 for k in gemms)  # 2 layers
    gemm = lambda r: sum(row["flops"] for kind, row in r.kernels.items()  # noqa: E731
                         if kind in GEMM_KINDS)
    assert gemm(reading) == pytest.approx(gemm(step("sorted")[2]), rel=0.02)


def test_ragged_dot_flops_are_the_real_rows():
    """A ragged-dot (cuDNN's grouped GEMM keeps it) counts each row against one group's
    matrix: 2 M K N, not 2 G M K N; ragged over the contracted rows (a weight gradient,
    result [G, K, N]), each group its own rows: 2 M K N again."""
    hlo = """HloModule m

ENTRY %main (x: bf16[4096,1024], w: bf16[8,1024,2048], g: s32[8], d: bf16[4096,2048]) -> bf16[4096,2048] {
  %x = bf16[4096,1024]{1,0} parameter(0)
  %w = bf16[8,1024,2048]{2,1,0} parameter(1)
  %g = s32[8]{0} parameter(2)
  %d = bf16[4096,2048]{1,0} parameter(3)
  %fwd = bf16[4096,2048]{1,0} ragged-dot(%x, %w, %g), lhs_contracting_dims={1}, rhs_contracting_dims={1}, lhs_ragged_dims={0}, rhs_group_dims={0}, metadata={op_name="jit(f)/ragged_dot_general"}
  %xt = bf16[1024,4096]{1,0} transpose(%x), dimensions={1,0}
  ROOT %wgrad = bf16[8,1024,2048]{2,1,0} ragged-dot(%xt, %d, %g), lhs_contracting_dims={1}, rhs_contracting_dims={0}, lhs_ragged_dims={1}, metadata={op_name="jit(f)/transpose(ragged_dot_general)"}
}
"""
    items = [k for k in kernels.schedule(hlo)["main"] if k["item"] == "kernel"
             and k["kind"] == "unfused ragged-dot"]
    assert [k["flops"] for k in items] == [2 * 4096 * 1024 * 2048] * 2
    assert all(k["ragged"] for k in items)


@pytest.mark.parametrize("remat", ["full", "selective_op"])
def test_ordered_temporaries_extrapolate_from_the_live_ranges_to_a_whole_compile(remat):
    """Where the blocks run ordered (models.layers.run_blocks: full remat, or a layout that
    gathers each block's weights, fsdp_tp here, under any remat) a deep stack's temporaries
    are depth 2's plus, at the step where it weighs most, what each block holds there
    (jaxdist.program.liveness, XLA's own live ranges): within 5% of the whole program compiled at
    depth 4 (a Llama of width 2048 under fsdp_tp with sequence parallelism: measured 1.002
    under full remat, 0.992 under selective_op; under full remat the line through depth 1
    and 2 was 24% over at depth 6, the live ranges 3.7% under)."""
    from jaxdist.config import CompilerConfig
    from jaxdist.predict import program

    cfg = RunConfig(mesh=MeshConfig(mesh="data:2,tensor:4"),
                    model=ModelConfig(model="llama3-70b", dtype="bfloat16", model_opts=(
                        "vocab=32000,seq_len=4096,width=2048,heads=16,kv_heads=8,"
                        "mlp_hidden=5632,attention=cudnn,depth=4")),
                    train=TrainConfig(layout="fsdp_tp", batch_size=16, remat=remat,
                                      sequence_parallel=True),
                    compiler=CompilerConfig(overlap=True))
    model_cfg = job_of(cfg).model
    shape = parse_mesh(cfg.mesh.mesh)
    target = compiled.gpu_topology(get_hardware("h100-sxm"), shape.size)
    whole = program.step_figures(job_of(cfg), model_cfg, shape, "full", target)
    line = program.step_figures(job_of(cfg), model_cfg, shape, "extrapolate", target)
    assert line.memory_method.startswith("temporaries: depth 2's + ")
    assert line.memory["temp_bytes"] == pytest.approx(whole.memory["temp_bytes"],
                                                         rel=0.05)
    for key in ("argument_bytes", "output_bytes", "alias_bytes"):
        assert line.memory[key] == whole.memory[key]


def test_offloading_remat_holds_host_buffers_and_the_plan_counts_them_apart():
    """minimal_offloaded (models.layers REMAT_NAMES) on XLA:GPU: the program holds host
    buffers (its copies to memory space S(5)), minimal's none; the hand estimate keeps full's
    residuals in device memory and what minimal keeps beyond them in host memory (a depth-1
    llama: the same values, JAX's trace places them), and the copies are timed over PCIe."""
    from jaxdist.config import OutputConfig
    from jaxdist.plan.predicted import predict_plan

    def plan(remat):
        return predict_plan(job_of(RunConfig(
            mesh=MeshConfig(mesh="1x8"),
            model=ModelConfig(model="llama-tiny", model_opts="depth=1", dtype="bfloat16"),
            train=TrainConfig(layout="fsdp", batch_size=8, remat=remat),
            output=OutputConfig(dry_run=True, hardware="h100-sxm")), parse_mesh("1x8"))).to_json()

    kept, moved, full = plan("minimal"), plan("minimal_offloaded"), plan("full")
    assert kept["compiled"]["memory"]["host_temp_bytes"] == 0
    assert moved["compiled"]["memory"]["host_temp_bytes"] > 0
    assert moved["memory"]["residual_bytes"] == full["memory"]["residual_bytes"]
    assert moved["memory"]["host_residual_bytes"] == \
        kept["memory"]["residual_bytes"] - full["memory"]["residual_bytes"] > 0
    assert kept["time"]["host_transfer_s"] == 0 < moved["time"]["host_transfer_s"]


@SHARES_PROGRAMS
def test_uneven_pipeline_step_compiles_and_skips_padded_slots():
    """tp_pp with --pp-stage-blocks 1,1,1,2 (depth 5) for 32 H200s: XLA:GPU compiles the
    step with its padded slots' conds, every collective is weighed by the table (none an
    upper bound), and the dot FLOPs are the even depth-4 step's plus one block's, not the
    padded 8 slots' (measured for depth 7 as 1,2,2,2 against 8 even: 619.7 and 704.6
    MFLOP x S)."""
    from jaxdist.pipeline.report import switch_runs

    cfg = config("tp_pp")
    uneven = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, model_opts="depth=5"),
        train=dataclasses.replace(cfg.train, pp_stage_blocks="1,1,1,2"))
    shape = parse_mesh(cfg.mesh.mesh)
    target = compiled.gpu_topology(H200, shape.size)
    model_cfg = job_of(uneven).model
    program, comp, _ = compiled.compile_step(job_of(uneven), model_cfg, shape, target)
    assert program.schedule.blocks == ((1,), (1,), (1,), (2,))
    runs = switch_runs(comp.as_text(), dict(shape.axis_sizes), program.schedule)
    reading = program_reading.read(comp, target, shape.axis_sizes, runs)
    assert not [o for o in reading.collectives if o.get("upper_bound")]
    even = gpu_step("tp_pp")[2].flops
    # a block is less than a quarter of the even step's dots (4 blocks, head, embeddings)
    assert 0 < reading.flops - even < even / 4


def test_pipeline_sends_and_the_gradient_reduction_overlap_the_ticks():
    """tp_pp interleaved V = 2 (data:2,stage:2,tensor:2), distributed optimizer, compiled
    by XLA:GPU with --overlap.
    Sends: in each tick loop every stage send (a collective-permute on `stage`) is async,
    its start scheduled before the operation switch it rides with (F or BACK, holding
    tensor all-reduces) and its done after it, in the same computation
    (jaxdist/pipeline/step.py OverlappedSends). With XLA's default of one collective in
    flight the scheduler puts the send after the operation instead (measured on this
    compiler); a pipeline's --overlap allows two (PIPELINE_OVERLAP_OPTIONS).
    Gradient reduction: chunk 1's gradients are final 2 ticks before the end
    (Schedule.gradients_final), so the loop is two scans and chunk 1's float32 data-axis
    reduce-scatter starts before the second, which holds the step's final backward, and is
    done after it; chunk 0's and the shared gradients' follow the loop."""
    from jaxdist.config import CompilerConfig
    from jaxdist.pipeline.step import overlapped_sends
    from jaxdist.program import hlo

    cfg = dataclasses.replace(config("tp_pp", batch=8), mesh=MeshConfig(
        mesh="data:2,stage:2,tensor:2"), compiler=CompilerConfig(overlap=True))
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(
        cfg.train, microbatches=2, pp_schedule="interleaved", pp_virtual=2,
        distributed_optimizer=True))
    shape = parse_mesh(cfg.mesh.mesh)
    target = compiled.gpu_topology(H200, shape.size)
    model_cfg = job_of(cfg).model
    program, comp, _ = compiled.compile_step(job_of(cfg), model_cfg, shape, target)
    order: dict = {}
    for ins in hlo.typed(comp.as_text()):
        if ins.op in ("collective-permute-start", "collective-permute-done", "conditional",
                      "while", "reduce-scatter-start", "reduce-scatter-done"):
            order.setdefault(ins.computation, []).append(ins)
    beside = {c: [i.op for i in seq] for c, seq in order.items()
              if any(i.op == "collective-permute-start" for i in seq)}
    entry = next(seq for seq in order.values() if any(i.op == "while" for i in seq))
    loops = [k for k, i in enumerate(entry) if i.op == "while"]
    final = program.schedule.gradients_final()
    assert len(loops) == len({r for r in final if r < program.schedule.ticks}) + 1 == 2
    sets = overlapped_sends(program.schedule).sets  # F's slot (input gradients), BACK's
    assert len(beside) == len(loops) * (len(sets[0]) + len(sets[1]))  # a branch per set
    for seq in beside.values():
        assert seq == ["collective-permute-start", "conditional", "collective-permute-done"]
    starts = [i for seq in order.values() for i in seq if i.op == "collective-permute-start"]
    assert all('"is_sync":false' in i.line for i in starts)
    # a float32 reduce-scatter in flight across the last loop (the final backward)
    early = [k for k, i in enumerate(entry) if i.op == "reduce-scatter-start" and
             k < loops[-1] and "f32[" in i.line]
    assert early
    done = [k for k, i in enumerate(entry) if i.op == "reduce-scatter-done"
            and f"(%{entry[early[0]].name})" in i.line]
    assert done and done[0] > loops[-1]


def test_exposure_before_the_first_matmul_is_the_steps_head():
    """A gather the first matmul waits for is exposed before any matmul runs: the kernel
    model reports it as the step's head (exposed once a step, however deep the model:
    jaxdist.predict.depth.linear_times); the same gather after a matmul is not head."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from jaxdist.predict.kernels_time import step_time
    from jaxdist.program import comm

    target = compiled.gpu_topology(H200, 8)
    mesh = Mesh(list(target.devices), ("d",))
    rows, whole = NamedSharding(mesh, P("d")), NamedSharding(mesh, P())
    x = jax.ShapeDtypeStruct((1024, 4096), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)

    def gathered(w):
        return jax.lax.with_sharding_constraint(w, whole)

    def gather_first(x, w):  # the sharded weight is gathered for the only matmul
        return jnp.tanh(x @ gathered(w))

    def matmul_first(x, v, w):  # a matmul on a replicated weight runs before the gather
        return jnp.tanh(jnp.tanh(x @ v) @ gathered(w))

    heads = {}
    for fn, args, shardings in ((gather_first, (x, w), (whole, rows)),
                                (matmul_first, (x, w, w), (whole, whole, rows))):
        jitted = jax.jit(fn, in_shardings=shardings, out_shardings=whole)
        comp, _ = xla_compile.compile_timed(jitted, *args, options=compiled.OVERLAP_OPTIONS)
        text = program_reading.text(comp)
        ops = comm.collectives(text, {"d": 8})
        assert [op["kind"] for op in ops] == ["all-gather"]
        t = step_time(text, ops, H200, {"d": 8})
        heads[fn.__name__] = (t["head_exposed_intra_node_s"], t["exposed_intra_node_s"])
    head, exposed = heads["gather_first"]
    assert head == exposed > 0
    assert heads["matmul_first"][0] == 0.0 < heads["matmul_first"][1]

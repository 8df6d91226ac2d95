"""A PS worker: `python -m ps.worker --worker w (--servers HOST:PORT,... | --ready-dir DIR)
<run flags>`.

A JAX process that owns its local devices (data-parallel inside: the worker's rows of the
batch are split over them and XLA all-reduces the gradient) and loops: pull parameters from
every shard, compute the gradient of its rows, push it. With --mesh WxD, worker w takes rows
[w*B/W, (w+1)*B/W) of the same global batch `TrainStream(...).batch(t)` that every other
layout trains on, so sync mode is DDP's arithmetic.

On CPU the worker simulates D devices (set before JAX starts). On GPU it takes the GPUs it
can see: launch each worker with its own CUDA_VISIBLE_DEVICES (the launcher does this on
one node; a scheduler does it on a cluster).

The parameters travel as one flat float32 vector (ps.shardmap): pulled into a host buffer,
put on the devices once, unflattened inside the jitted step; the gradient comes back flat.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from jaxdist.files import write_json
from jaxdist.record_builder import memory_block
from ps.series import SeriesWriter

FAULT_ENV = "JAXDIST_PS_FAULT"
WRITE_FAILED = 4  # exit status: the worker could not write its output (ps.launch names it)
# SIGINT from the launcher (its run was interrupted): stop after the current step and
# write what was measured. main() installs the handler; run_worker reads the list.
STOP: list[str] = []
# Shards start at the same time as the workers (or later, under a scheduler): waiting for
# them the first time is allowed longer than one call's --ps-timeout-s.
CONNECT_TIMEOUT_S = 120.0


def build_parser():
    from jaxdist.config import add_arguments
    from jaxdist.errors import OneLineParser

    parser = OneLineParser(prog="python -m ps.worker",
                           description="One parameter-server worker. Give it the same run "
                                       "flags as the shard servers.")
    own = parser.add_argument_group("worker")
    own.add_argument("--worker", type=int, required=True, help="this worker's index, 0..W-1")
    own.add_argument("--servers", default="",
                     help="comma-separated HOST:PORT of shards 0..K-1, in order")
    own.add_argument("--ready-dir", default="",
                     help="where the shards' ready files are (shard<k>.ready.json, written "
                          "by ps.server --ready-file): where each shard listens is read "
                          "there, at the start and after a restart, instead of --servers")
    own.add_argument("--out", default="", help="directory for worker<w>.json (metrics)")
    own.add_argument("--start-step", type=int, default=0, help="the first step to run (a "
                     "resumed run's, from its shards' snapshots: ps.resume); its batches "
                     "are that step's")
    add_arguments(parser)
    return parser


def faults(worker: int) -> dict:
    """JAXDIST_PS_FAULT (tests only): kill-worker:W:STEP (SIGKILL after pushing STEP),
    dup-push:W:STEP (send STEP's gradient twice, as a retry would), slow-worker:W:SECONDS."""
    out = {}
    for spec in filter(None, os.environ.get(FAULT_ENV, "").split(",")):
        kind, who, value = (spec.split(":") + ["", "", ""])[:3]
        if kind in ("kill-worker", "dup-push", "slow-worker") and who == str(worker):
            out[kind] = float(value) if kind == "slow-worker" else int(value)
    return out


class Program:
    """The worker's compiled functions over a flat parameter vector."""

    def __init__(self, job, graphdef, abstract, abstract_state, shard_map, mesh):
        import jax
        import jax.numpy as jnp
        from flax import nnx
        from jax.sharding import NamedSharding, PartitionSpec as P

        from jaxdist.train_step import (DTYPES, MeshJit, jax_matmul_precision, loss_and_grad,
                                        split_model)
        from sharding import batch_spec

        model_cfg = job.model
        dtype = DTYPES[job.dtype]
        seed = job.train.seed
        self.treedef = jax.tree.structure(abstract)
        self.leaves = shard_map.leaves
        self.total = shard_map.total
        self.replicated = NamedSharding(mesh, P())
        self.batch_sharding = NamedSharding(mesh, batch_spec(mesh))

        # Parameters go in and gradients come out as trees: slicing a flat vector inside
        # the step (or concatenating the gradients there) made XLA's CPU backend fuse the
        # slices into the matmuls and run 50-100x slower. Flattening on the host costs one
        # copy of the model per step.
        gradient = loss_and_grad(model_cfg, graphdef)  # the mesh layouts' own

        def grad_fn(params, model_state, batch):
            (loss, new_state), grads = gradient(params, model_state, batch)
            return loss, grads, new_state

        def correct_fn(params, model_state, batch):
            model = nnx.merge(graphdef, params, model_state, copy=True)
            model.eval()
            hit_B = jnp.argmax(model(batch["x"]), axis=-1) == batch["y"]
            return jnp.sum(hit_B * batch["mask"])

        r, b = self.replicated, self.batch_sharding
        precision = jax_matmul_precision(job.dtype, job.matmul_precision)
        self.grad = MeshJit(jax.jit(grad_fn, in_shardings=(r, r, b), out_shardings=(r, r, r)),
                            mesh, precision)
        self.correct = MeshJit(jax.jit(correct_fn, in_shardings=(r, r, b), out_shardings=r),
                               mesh, precision)
        init_state = jax.jit(lambda: split_model(model_cfg, dtype, seed)[2], out_shardings=r)
        # Most models keep no state besides parameters: skip compiling a whole init for it.
        self.init_model_state = (init_state if jax.tree.leaves(abstract_state)
                                 else lambda: abstract_state)
        self.num_devices = mesh.devices.size

    def views(self, flat):
        """The flat host vector as a tree of numpy views of it (no copy). The compiled step
        takes them as they are: it moves host arguments to its input shardings itself, at
        ~0.3 ms a step against ~0.75 ms for device_put of the tree and the batch first
        (mlp, measured here), on the GIL the push's threads need. Same values, same bits."""
        import jax

        views = [flat[l.offset:l.offset + l.size].reshape(l.shape) for l in self.leaves]
        return jax.tree.unflatten(self.treedef, views)

    def params(self, flat):
        """The flat host vector as a parameter tree on the devices (replicated)."""
        import jax

        return jax.device_put(self.views(flat), self.replicated)

    def flatten(self, grads, out=None):
        """A gradient tree back to one flat host vector (waits for the devices), into `out`
        when given (a reused buffer: a fresh one is page-faulted in every step)."""
        import jax
        import numpy as np

        out = np.empty(self.total, np.float32) if out is None else out
        for leaf, g in zip(self.leaves, jax.tree.leaves(grads)):
            out[leaf.offset:leaf.offset + leaf.size] = np.asarray(g).reshape(-1)
        return out

    def put(self, batch_np: dict) -> dict:
        import jax
        return {k: jax.device_put(v, self.batch_sharding) for k, v in batch_np.items()}


def shards_from_ready_files(job, ready_dir: Path, log) -> tuple[list[str], list]:
    """(each shard's address, a locator each) from the shards' ready files in `ready_dir`,
    waiting up to CONNECT_TIMEOUT_S for them to appear (shards start beside the workers)."""
    from ps.security import connect_host, ready_file_locator
    from ps.shard_client import PSError

    host = connect_host(job.ps.ps_bind)
    locators = [ready_file_locator(ready_dir / f"shard{k}.ready.json", host)
                for k in range(job.ps.ps_shards)]
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    found = [None] * len(locators)
    while not all(found):
        found = [f or locate() for f, locate in zip(found, locators)]
        if not all(found):
            if time.monotonic() > deadline:
                missing = [k for k, f in enumerate(found) if not f]
                raise PSError(f"shard(s) {missing} wrote no ready file in {ready_dir} within "
                              f"{CONNECT_TIMEOUT_S:g} s")
            time.sleep(0.05)
    log(f"shards at {', '.join(address for address, _ in found)} (their ready files)")
    return [address for address, _ in found], locators


def run_worker(job, worker: int, servers: list[str], out_dir: Path | None, platform,
               log=print, locators=None, first: int = 0) -> dict:
    """Steps `first`.. of the run (0, or where a resumed run's snapshots are); the window
    and the warm-up count this process's steps."""
    import numpy as np

    from jaxdist import metrics, telemetry
    from jaxdist.data import TrainStream, eval_batches
    from jaxdist.devices import env_info
    from jaxdist.mesh import build_mesh
    from jaxdist.program.xla_compile import compile_timed
    from ps.client import PSClient
    from ps.security import TOKEN_ENV
    from ps.shardmap import abstract_model, build_shard_map, leaves_of

    num_workers, dataset = job.shape.data, job.dataset
    model_cfg, graphdef, abstract, abstract_state = abstract_model(job)
    mesh = build_mesh(platform.shape, platform.devices)
    shard_map = build_shard_map(leaves_of(abstract), len(servers))
    program = Program(job, graphdef, abstract, abstract_state, shard_map, mesh)
    fault = faults(worker)

    client = PSClient(servers, shard_map, worker, job.ps.ps_mode,
                      max_message_bytes=job.ps.ps_max_message_mb << 20,
                      timeout_s=job.ps.ps_timeout_s, token=os.environ.get(TOKEN_ENV, ""),
                      tls_cert=job.ps.ps_tls_cert, transport=job.ps.ps_transport,
                      locators=locators)
    client.connect(max(job.ps.ps_timeout_s, CONNECT_TIMEOUT_S))

    stream = TrainStream(model_cfg, dataset, job.train.batch_size, job.train.seed)
    rows = job.train.batch_size // num_workers
    lo, hi = worker * rows, (worker + 1) * rows

    def local_batch(t):  # host rows: the compiled step puts them on the devices
        return {k: v[lo:hi] for k, v in stream.batch(t).items()}

    flat = np.zeros(shard_map.total, np.float32)
    model_state = program.init_model_state()
    params = program.params(flat)
    compiled, compile_s = compile_timed(program.grad, params, model_state,
                                        program.put(local_batch(0)))
    log(f"compiled the gradient step in {compile_s:.2f} s; {shard_map.describe()}")
    waited = client.start_together(max(job.ps.ps_timeout_s, CONNECT_TIMEOUT_S))
    log(f"all workers ready (waited {waited:.2f} s)")

    def evaluate(dev_params, model_state) -> float:
        hits = 0.0
        for batch in eval_batches(dataset, job.train.batch_size, program.num_devices):
            hits += float(program.correct(dev_params, model_state, program.put(batch)))
        return hits / len(dataset.test_y)

    total = job.loop.warmup + job.loop.steps
    # Power as in mesh runs (jaxdist.telemetry): this worker's GPUs, the same windows;
    # jaxdist.telemetry.combine sums the workers' blocks. The sampler's thread is a daemon:
    # a worker that fails mid-loop does not wait for it.
    window_open, window_close = telemetry.window_steps(job.power.power_window,
                                                       job.loop.warmup, job.loop.steps)
    monitor = telemetry.create_monitor(job.power, devices=platform.devices)
    monitor.start()
    losses, step_s, compute_s, waits, accuracy = [], [], [], [], []
    phases = {"pull_s": [], "push_s": [], "batch_s": []}  # per step, wall time on this worker
    started = time.perf_counter()
    window = [None, None]
    every = job.data.eval_every
    report_every = max(1, total // 10)
    pulled = None      # (waited, seconds) when the parameters for this step are already here
    # Gradients alternate between two buffers: the previous step's stays intact for a
    # re-push after a shard restart (client.last_push) while this one is written.
    grad_buffers = [np.empty(shard_map.total, np.float32) for _ in range(2)]
    batch = local_batch(first)
    # Every step's figures go to disk in chunks as the run goes (ps.series): a stopped
    # worker has one chunk left to write, whatever its step count.
    series = SeriesWriter(out_dir / f"worker{worker}.series" if out_dir is not None else None,
                          {"losses": losses, "step_s": step_s, "compute_s": compute_s,
                           "pull_wait_s": waits, "push_s": client.push_s,
                           "pull_s": client.pull_s,
                           **{f"phases_s.{k}": v for k, v in phases.items()}})
    for i in range(total - first):  # i: this process's steps; t: the run's
        t = first + i
        if STOP:  # between steps: every push this worker sent has been answered
            break
        if i == job.loop.warmup:
            window[0] = time.time()
        if i == window_open:
            monitor.open_window()
        t0 = time.perf_counter()
        if pulled is None:
            waited = client.pull(t, flat)
            phases["pull_s"].append(time.perf_counter() - t0)
        else:
            waited, seconds = pulled
            phases["pull_s"].append(seconds)
        c0 = time.perf_counter()
        loss, grads, model_state = compiled(program.views(flat), model_state, batch)
        grad = program.flatten(grads, grad_buffers[t % 2])
        if job.ps.ps_clip_norm > 0:  # the whole model's gradient is here: a global norm
            norm = float(np.linalg.norm(grad))
            if norm > job.ps.ps_clip_norm:
                grad *= np.float32(job.ps.ps_clip_norm / norm)
        compute_s.append(time.perf_counter() - c0)
        if "slow-worker" in fault:
            time.sleep(fault["slow-worker"])
        evaluate_now = (worker == 0 and dataset is not None and every
                        and ((t + 1) % every == 0 or t + 1 == total))
        p0 = time.perf_counter()
        # The push runs in the background while the next batch is prepared, and the pull
        # of step t+1 goes with it (ps.client.start_push): the shard answers it once the
        # push is applied (sync: once step t's barrier completes), with no round trip in
        # between.
        prefetch = (t + 1, flat) if t + 1 < total or evaluate_now else None
        inflight = client.start_push(t, grad, repeat=2 if fault.get("dup-push") == t else 1,
                                     then_pull=prefetch)
        b0 = time.perf_counter()
        batch = local_batch(t + 1) if t + 1 < total else None
        phases["batch_s"].append(time.perf_counter() - b0)
        next_waited = inflight()
        phases["push_s"].append(time.perf_counter() - p0)
        pulled = (next_waited, 0.0) if next_waited is not None else None  # counted in push_s
        step_s.append(time.perf_counter() - t0)
        if i == window_close:
            monitor.close_window()
        losses.append(float(loss))
        waits.append(waited)
        series.step_done(len(losses))
        if fault.get("kill-worker") == t:
            os.kill(os.getpid(), signal.SIGKILL)
        if worker == 0 and (t + 1) % report_every == 0:
            log(f"step {t + 1}/{total} loss {losses[-1]:.4f} step {step_s[-1] * 1e3:.1f} ms")
        if evaluate_now:  # on the parameters after this step (pulled with the push)
            with monitor.paused(f"evaluation after step {t}", window_open <= i < window_close):
                acc = evaluate(program.params(flat), model_state)
            accuracy.append({"step": t + 1, "wall_s": time.perf_counter() - started,
                             "accuracy": acc})
            log(f"step {t + 1}: test accuracy {acc:.4f}")
    window[1] = time.time()
    if window_open < len(losses) <= window_close:  # stopped inside the window: it ends here
        window_close = len(losses) - 1
        monitor.close_window()
    monitor.stop()
    window_n = max(min(window_close, len(losses) - 1) - window_open + 1, 0)
    samples = window_n * (job.train.batch_size // num_workers)
    tokens = model_cfg.tokens_per_sample
    power = monitor.result(window_n, samples, samples * tokens if tokens else None,
                           first_step=window_open)
    if out_dir is not None:
        monitor.write_outputs(out_dir / f"worker{worker}")  # power/*.csv, window.png

    series.flush()
    state = {"params": params, "model_state": model_state}
    by_device = metrics.state_bytes_by_device(state)
    measured, measured_reason = metrics.measured_peak(platform.devices)
    result = {
        "worker": worker, "pid": os.getpid(), "steps_done": len(losses),
        "interrupted": STOP[0] if STOP else None,
        "push_bytes": client.push_bytes, "pull_bytes": client.pull_bytes,
        "restarts_seen": client.restarts_seen, "compile_s": compile_s,
        "rejected_nonfinite": client.rejected_nonfinite,
        "data_fallbacks": sum(s.fallbacks for s in client.shards),
        "bytes_by_transport": {t: sum(s.bytes_by[t] for s in client.shards)
                               for t in ("tcp", "grpc")},
        "accuracy": accuracy, "env": env_info(platform), "power": power,
        "window": {"start_unix_s": window[0], "end_unix_s": window[1]},
        "memory": memory_block(by_device, metrics.compiled_memory(compiled), measured,
                               measured_reason),
        "compiled_flops": metrics.compiled_flops(compiled),
    }
    result.update(losses=losses, step_s=step_s, compute_s=compute_s, pull_wait_s=waits,
                  push_s=client.push_s, pull_s=client.pull_s, phases_s=phases)
    client.close()
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        series_keys = {name.partition(".")[0] for name in series.lists}
        write_json(out_dir / f"worker{worker}.json",  # the series are in their files
                   {**{k: v for k, v in result.items() if k not in series_keys},
                    "series": series.describe(out_dir)})
    return result


def main(argv=None) -> int:
    from jaxdist.config import from_namespace
    from jaxdist.errors import UsageError, WriteError
    from jaxdist.job import for_process
    from jaxdist.mesh import MeshShape
    from jaxdist import procs
    from ps.shard_client import PSError

    procs.parent_watchdog()
    signal.signal(signal.SIGINT, lambda signum, frame: STOP.append("SIGINT"))
    args = build_parser().parse_args(argv)
    log = lambda msg: print(f"[worker {args.worker}] {msg}", flush=True)  # noqa: E731
    try:
        job = for_process(from_namespace(args))  # validated by the launcher
        shape = job.shape
        if shape.size is None:
            raise UsageError("--layout ps needs an explicit mesh WORKERSxDEVICES (e.g. 4x1)")
        if not 0 <= args.worker < shape.data:
            raise UsageError(f"--worker {args.worker} is outside 0..{shape.data - 1}")
        if not 0 <= args.start_step < job.loop.warmup + job.loop.steps:
            raise UsageError(f"--start-step {args.start_step} is outside the run's steps "
                             f"0..{job.loop.warmup + job.loop.steps - 1}")
        if job.train.batch_size % shape.size:
            raise UsageError(f"global batch {job.train.batch_size} is not divisible by the "
                             f"{shape.size} devices of mesh {shape.label}")
        servers = [s.strip() for s in args.servers.split(",") if s.strip()]
        if args.ready_dir:
            if not Path(args.ready_dir).is_dir():
                raise UsageError(f"--ready-dir {args.ready_dir}: no such folder")
        elif not servers:
            raise UsageError("--servers needs at least one HOST:PORT (or give --ready-dir)")
        for server in servers:
            procs.host_port(server, "--servers")
        from jaxdist.devices import configure_host_devices, select_devices

        local = MeshShape(shape.fsdp, 1)  # this worker's devices, data-parallel
        configure_host_devices(local, job.platform)
        platform = select_devices(local)
    except UsageError as e:
        print(f"ps.worker: error: {e}", file=sys.stderr)
        return 2
    try:
        locators = None
        if args.ready_dir:
            servers, locators = shards_from_ready_files(job, Path(args.ready_dir), log)
        run_worker(job, args.worker, servers, Path(args.out) if args.out else None, platform,
                   log, locators, args.start_step)
    except PSError as e:
        print(f"ps.worker {args.worker}: error: {e}", file=sys.stderr, flush=True)
        return 3
    except WriteError as e:  # its own output (a full disk): the path, not a PS failure
        print(f"ps.worker {args.worker}: error: {e}", file=sys.stderr, flush=True)
        return WRITE_FAILED
    return 0


if __name__ == "__main__":
    code = main()
    if code == 0:
        # Everything is written (worker<w>.json last, its series flushed, the log): skip
        # the interpreter's and JAX's teardown, ~0.8 s on a loaded 2-core machine that an
        # interrupted run's launcher would wait for before it writes the record.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    sys.exit(code)

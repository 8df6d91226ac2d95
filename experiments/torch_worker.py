"""One rank of the PyTorch reference: `python -m experiments.torch_worker JOB RANK`, started by
experiments.torch_run (never by hand). JOB is the launcher's job.json (model spec, strategy,
settings, rendezvous port, and the work folder with inputs.npz: the synthetic batches and the
JAX initial weights). The rank trains, then writes rank<RANK>.json there: its step times,
losses, state bytes and settings as read back from torch. Imports torch, numpy and
models.torch_ref (jax comes in through the models package, unused).

Fairness rules (docs/compare.md): every step starts after a barrier (untimed) and ends after
the step's loss is all-reduced (the JAX step returns the global loss too) and, on GPU, after
torch.cuda.synchronize().
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxdist.procs import parent_watchdog
from jaxdist.files import write_json

# --matmul-precision -> PyTorch's float32 setting for matmuls (cuBLAS) and convolutions
# (cuDNN), through the fp32_precision API of torch >= 2.9: "tf32" is what
# set_float32_matmul_precision("high") and cudnn.allow_tf32 = True select, "ieee" what
# "highest" and allow_tf32 = False select. XLA:GPU runs JAX's DEFAULT and HIGH float32 dots
# and convolutions as TF32 on Ampere and newer, HIGHEST as float32 (docs/compare.md). CPU
# matmuls (oneDNN) are left at float32 on both sides.
TORCH_FP32_PRECISION = {"default": "tf32", "high": "tf32", "highest": "ieee"}


def main(argv=None) -> None:
    """Run one rank. Always ends with os._exit: an FSDP process that returns normally
    sometimes aborts in teardown (shared/notes/jax-on-cpu.md)."""
    job_path, rank = (sys.argv[1:] if argv is None else argv)
    parent_watchdog()  # torch_run gone (SIGKILLed): stop instead of waiting in a collective
    code = 0
    try:
        job = json.loads(Path(job_path).read_text())
        report = run_rank(int(rank), job)
        write_json(Path(job["work"]) / f"rank{rank}.json", report)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_rank(rank: int, job: dict) -> dict:
    import datetime

    import torch
    import torch.distributed as dist

    world, cuda = job["world"], job["device"] == "cuda"
    if not cuda:
        torch.set_num_threads(job["threads"])
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    fp32_precision = set_fp32_precision(job["matmul_precision"])
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{job['port']}",
                            rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=job["timeout_s"]))
    try:
        inputs = np.load(Path(job["work"]) / "inputs.npz")
        model, params, implementation = build_torch_model(job, inputs, device)
        opt = make_optimizer(model, job["optimizer"], job["lr"])
        batches = local_batches(job, inputs, rank, device)
        monitor = power_monitor(job, rank, device)
        step_s, losses, window = train(job, rank, model, opt, batches, device, monitor)
        report = dict(report_settings(job, model, opt, device), rank=rank, step_s=step_s,
                      loss=losses, window=window, fp32_precision=fp32_precision,
                      params=params, implementation=implementation, backend=backend,
                      power=rank_power(job, rank, monitor, len(step_s)))
        dist.barrier()
        return report
    finally:
        dist.destroy_process_group()


def build_torch_model(job: dict, inputs, device):
    """(the model on `device`, wrapped for the strategy; its parameter count; what wraps
    it). Weights: the JAX run's (init/ in inputs.npz) or PyTorch's own, seeded."""
    import torch

    from models import torch_ref

    torch.manual_seed(job["seed"])
    model = torch_ref.build(job["spec"])
    if job["init"] == "jax":
        torch_ref.load_state(model, {k[len("init/"):]: inputs[k] for k in inputs.files
                                     if k.startswith("init/")})
    model.to(device).train()
    params = torch_ref.param_count(model)
    model, implementation = wrap(model, job["spec"], job["strategy"], job["world"], device)
    return model, params, implementation


def local_batches(job: dict, inputs, rank: int, device) -> list:
    """This rank's rows of every synthetic batch, as torch tensors on `device`."""
    from models import torch_ref

    local = job["batch_size"] // job["world"]
    rows = slice(rank * local, (rank + 1) * local)
    batches = []
    for i in range(job["num_batches"]):
        keys = sorted(k for k in inputs.files if k.startswith(f"batch{i}/"))
        batch_np = {k.split("/", 1)[1]: inputs[k][rows] for k in keys}
        batches.append(torch_ref.to_torch_batch(job["spec"], batch_np, device))
    return batches


@dataclass(frozen=True)
class TorchDevice:
    """What jaxdist.telemetry reads of a device, for a torch one: `local_hardware_id` is
    its CUDA ordinal (within CUDA_VISIBLE_DEVICES, as a JAX GPU's is)."""
    id: int
    platform: str
    local_hardware_id: int | None
    process_index: int = 0


def power_monitor(job: dict, rank: int, device):
    """This rank's GPU sampled as a mesh run samples its GPUs (jaxdist.telemetry: the same
    sampler, window and block); the launcher adds the ranks' blocks up. On CPU the block
    says why there is none."""
    from jaxdist import telemetry

    me = TorchDevice(rank, "cuda" if device.type == "cuda" else device.type, device.index)
    return telemetry.create_monitor(telemetry.PowerConfig(**job["power"]), devices=[me],
                                    process_index=0)


def power_edges(job: dict) -> tuple[int, int]:
    """(open before step i, close after step j) of the energy window, as a mesh run's."""
    from jaxdist import telemetry

    return telemetry.window_steps(job["power"]["power_window"], job["warmup"], job["steps"])


def rank_power(job: dict, rank: int, monitor, steps_done: int) -> dict:
    """The rank's power block (its rows of each batch are its samples), and its CSVs and
    plot in <run>/rank<r>/power."""
    window_open, window_close = power_edges(job)
    window_n = max(min(window_close, steps_done - 1) - window_open + 1, 0)
    samples = window_n * (job["batch_size"] // job["world"])
    tokens = job["tokens_per_sample"]
    block = monitor.result(window_n, samples, samples * tokens if tokens else None,
                           first_step=window_open)
    monitor.write_outputs(Path(job["logdir"]) / f"rank{rank}")
    return block


def train(job: dict, rank: int, model, opt, batches: list, device, monitor):
    """Warm-up and timed steps: (every step's seconds, every step's global loss, the
    wall-clock window of the timed steps). The power window opens before its first step
    and closes after its last one's synchronize, as in a mesh run."""
    import torch
    import torch.distributed as dist

    from models import torch_ref

    world, spec, cuda = job["world"], job["spec"], device.type == "cuda"
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16)
                if job["dtype"] == "bfloat16" else None)

    def step(batch):
        opt.zero_grad(set_to_none=True)
        if autocast is not None:
            with autocast:
                loss = torch_ref.loss(spec, model, batch)
        else:
            loss = torch_ref.loss(spec, model, batch)
        loss.backward()
        opt.step()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)  # SUM: gloo has no AVG
        if cuda:
            torch.cuda.synchronize(device)
        return global_loss

    total = job["warmup"] + job["steps"]
    window_open, window_close = power_edges(job)
    step_s, losses = [], []
    window = [None, None]
    every = max(1, total // 5)
    monitor.start()
    for i in range(total):
        dist.barrier()
        if i == job["warmup"]:
            window[0] = time.time()
        if i == window_open:
            monitor.open_window()
        start = time.perf_counter()
        global_loss = step(batches[i % len(batches)])
        step_s.append(time.perf_counter() - start)
        window[1] = time.time()
        if i == window_close:
            monitor.close_window()
        losses.append(global_loss.item() / world)
        if rank == 0 and job["progress"] and ((i + 1) % every == 0 or i + 1 == total):
            print(f"[torch {job['strategy']} x{world}] step {i + 1}/{total} "
                  f"loss {losses[-1]:.4f} {step_s[-1] * 1e3:.1f} ms", file=sys.stderr,
                  flush=True)
    monitor.stop()
    return step_s, losses, window


def report_settings(job: dict, model, opt, device) -> dict:
    """What this rank holds and ran with: state bytes and sharding, threads, versions,
    optimizer implementation, memory peaks."""
    import resource

    import torch

    cuda = device.type == "cuda"
    state_bytes, sharding = state_report(model, opt, job["world"])
    return {
        "state_bytes": state_bytes, "sharding": sharding,
        "threads": torch.get_num_threads(), "torch_version": torch.__version__,
        "device_kind": torch.cuda.get_device_name(device) if cuda else "cpu",
        "optimizer_impl": type(opt).__name__ + (" (foreach)" if opt.defaults.get("foreach")
                                                else " (PyTorch default impl)"),
        "peak_bytes": int(torch.cuda.max_memory_allocated(device)) if cuda else None,
        "reserved_bytes": int(torch.cuda.max_memory_reserved(device)) if cuda else None,
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def set_fp32_precision(name: str) -> dict:
    """Apply --matmul-precision; returns the settings read back from torch."""
    import torch

    value = TORCH_FP32_PRECISION[name]
    torch.backends.cuda.matmul.fp32_precision = value
    torch.backends.cudnn.conv.fp32_precision = value
    return {"cuda_matmul": torch.backends.cuda.matmul.fp32_precision,
            "cudnn_conv": torch.backends.cudnn.conv.fp32_precision}


def wrap(model, spec: dict, strategy: str, world: int, device):
    from models import torch_ref

    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [device.index] if device.type == "cuda" else None
        return DDP(model, device_ids=ids), "DistributedDataParallel"
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))
    units = torch_ref.shard_units(spec, model)
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, f"FSDP2 fully_shard ({len(units)} units + root)"


def make_optimizer(model, name: str, lr: float):
    import torch

    if name == "adamw":  # optax.adamw's defaults (PyTorch's weight decay default is 1e-2)
        return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8,
                                 weight_decay=1e-4)
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)  # optax.sgd(lr, 0.9)


def state_report(model, opt, world: int) -> tuple[int, dict]:
    """(bytes of train state this rank holds, sharding summary in jaxdist's form: global
    bytes of sharded vs replicated leaves per part)."""
    import torch
    from torch.distributed.tensor import DTensor

    def local_and_global(t):
        if isinstance(t, DTensor):
            loc = t.to_local()
            sharded = world > 1 and any(p.is_shard() for p in t.placements)
            return loc.numel() * loc.element_size(), t.numel() * t.element_size(), sharded
        return t.numel() * t.element_size(), t.numel() * t.element_size(), False

    parts = {"params": list(model.parameters()), "model_state": list(model.buffers()),
             "opt": [v for s in opt.state.values() for v in s.values()
                     if isinstance(v, torch.Tensor)]}
    held = 0
    summary = {"sharded_bytes": 0, "replicated_bytes": 0, "replicated_leaves": 0, "parts": {}}
    for part, tensors in parts.items():
        sharded = replicated = 0
        for t in tensors:
            loc, glob, is_sharded = local_and_global(t)
            held += loc
            if is_sharded:
                sharded += glob
            else:
                replicated += glob
                summary["replicated_leaves"] += 1 if t.dim() else 0
        summary["parts"][part] = {"sharded_bytes": sharded, "replicated_bytes": replicated}
        summary["sharded_bytes"] += sharded
        summary["replicated_bytes"] += replicated
    return held, summary



if __name__ == "__main__":
    main()

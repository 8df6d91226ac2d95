"""Results of a PS run: the workers' files and the shards' statistics become results.json
(the common schema plus a `ps` block) and TensorBoard events, through the same RunWriter as
every layout. Used by the launcher (ps.driver.run_ps) and by `--collect-only`."""

from __future__ import annotations

from pathlib import Path

from ps.series import read_worker
from ps.shard_client import PSError


def format_ps(results: dict) -> str:
    """The PS lines printed before the common summary table."""
    ps = results["ps"]

    def ms(block, what):
        if not block:
            return f"n/a (no {what} call was timed)"
        return f"{block['p50'] * 1e3:.2f} / {block['p99'] * 1e3:.2f} ms"

    up = ps["updates"]
    staleness = ps["staleness"]
    tp = results["throughput"]
    rows = [
        ("ps mode", f"{ps['mode']}" + (f" (bound {ps['staleness_bound']})"
                                       if ps["staleness_bound"] is not None else "")
         + f", {ps['workers']} workers x {ps['devices_per_worker']} device(s), "
           f"{ps['shards']} shards"),
        ("job throughput", _throughput_line(tp)),
        ("push / pull p50 / p99", f"{ms(ps['push_latency_s'], 'push')}; "
                                  f"{ms(ps['pull_latency_s'], 'pull')}"),
        ("bytes per step", f"push {ps['bytes_per_step']['push'] / 2**20:.2f} MiB, "
                           f"pull {ps['bytes_per_step']['pull'] / 2**20:.2f} MiB, over "
                           f"{ps.get('carried_by', 'gRPC')}" + (
                               f" ({ps['data_fallbacks']} calls a data port refused went "
                               f"over gRPC)" if ps.get("data_fallbacks") else "")),
        ("waits", f"barrier {ps['wait_s']['barrier']:.2f} s, bound "
                  f"{ps['wait_s']['bound']:.2f} s (all shards)"),
        # No applied gradient, no staleness: "n/a (why)", never a 0 that was not measured.
        ("staleness max / mean", f"{staleness['max']} / {staleness['mean']:.2f} versions"
         if staleness["count"] else "n/a (no gradient was applied on any shard)"),
        ("updates", f"{up['applied']} applied, {up['rejected']} rejected, "
                    f"{up['deduplicated']} deduplicated (over all shards)"),
    ]
    if ps["dead_workers"]:
        rows.append(("dead workers", ", ".join(str(d["worker"]) for d in ps["dead_workers"])))
    if ps["shard_restarts"]:
        rows.append(("shard restarts", ", ".join(str(r["shard"]) for r in ps["shard_restarts"])))
    width = max(len(name) for name, _ in rows)
    return "\n" + "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)


def _throughput_line(tp: dict) -> str:
    """The job's throughput with what it counts (ps.collect.job_throughput)."""
    per_worker = ", ".join(f"w{p['worker']} {p['samples']}" for p in tp["per_worker"])
    if tp["samples_per_s"] is None:
        return f"n/a ({tp['reason']})"
    return (f"{tp['samples_per_s']:.1f} samples/s = {tp['samples']} samples (by worker: "
            f"{per_worker}) / {tp['window_s']:.3f} s shared window (first timed step of any "
            f"worker to last step of any)")


def job_throughput(workers: dict, rows: int, warmup: int,
                   tokens_per_sample: int | None) -> dict:
    """The whole job's throughput: the samples every reporting worker completed in its timed
    steps (its rows of the batch x its steps after warm-up), summed, over the shared wall
    window, from the earliest worker's first timed step to the latest worker's last step.
    Per-worker figures beside it (each over its own window). Worker 0 alone would under- or
    mis-state it: in async/ssp the workers run at their own pace and start their timed steps
    at different times."""
    per_worker = []
    for w, r in sorted(workers.items()):
        timed = max(0, len(r["step_s"]) - warmup)
        start, end = r["window"]["start_unix_s"], r["window"]["end_unix_s"]
        span = end - start if start is not None and end is not None else None
        per_worker.append({"worker": w, "timed_steps": timed, "samples": timed * rows,
                           "window": r["window"], "window_s": span,
                           "samples_per_s": timed * rows / span if timed and span else None,
                           # in the window but in no timed step: worker 0's evaluations
                           # (--eval-every), logging; in sync they hold every worker
                           "outside_steps_s": span - sum(r["step_s"][warmup:])
                           if span is not None else None})
    starts = [p["window"]["start_unix_s"] for p in per_worker
              if p["window"]["start_unix_s"] is not None]
    ends = [p["window"]["end_unix_s"] for p in per_worker
            if p["window"]["end_unix_s"] is not None]
    window = {"start_unix_s": min(starts, default=None), "end_unix_s": max(ends, default=None)}
    samples = sum(p["samples"] for p in per_worker)
    wall = (window["end_unix_s"] - window["start_unix_s"]
            if starts and ends else None)
    rate = samples / wall if samples and wall and wall > 0 else None
    return {
        "samples_per_s": rate,
        "tokens_per_s": rate * tokens_per_sample if rate and tokens_per_sample else None,
        "definition": "samples all reporting workers completed in their timed steps (rows "
                      "per worker x steps after warm-up, summed) / the shared wall window "
                      "(earliest worker's first timed step to latest worker's last step; "
                      "`window`); a worker that died wrote no figures and is not counted; "
                      "time in no timed step (evaluations) is inside the window: "
                      "per_worker.outside_steps_s",
        "samples": samples, "window": window, "window_s": wall,
        "reason": None if rate else ("no timed step on any worker" if not samples
                                     else "no wall window recorded"),
        "per_worker": per_worker,
    }


CURVE_POINTS = 2000


def carried_by(by_transport: dict) -> str:
    """The transport that carried a run's push and pull bytes, for labels: one of them, or
    both with their shares (streams, calls a refused data port sent over gRPC)."""
    tcp, grpc_ = by_transport.get("tcp", 0), by_transport.get("grpc", 0)
    if not tcp:
        return "gRPC"
    if not grpc_:
        return "TCP (the shards' data ports)"
    return (f"TCP (the shards' data ports, {tcp / (tcp + grpc_):.0%} of the bytes) and gRPC "
            f"({grpc_ / (tcp + grpc_):.0%})")


def _brief(values) -> dict | None:
    import numpy as np

    if not len(values):
        return None
    a = np.asarray(values, np.float64)
    return {"n": int(a.size), "mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
            "p99": float(np.percentile(a, 99)), "max": float(a.max())}


def _hist_summary(hist: dict) -> dict:
    total = sum(hist.values())
    return {"histogram": hist, "count": total,
            "max": max((int(k) for k in hist), default=None),
            "mean": (sum(int(k) * v for k, v in hist.items()) / total) if total else None}


def _breakdown(ref: dict, stats: list[dict], warmup: int, steps: int, workers: int) -> dict:
    """Where a step's time goes. `worker`: means over the timed steps of the reference
    worker's phases (pull = until its parameters were in; in sync that pull overlaps the
    previous push, so it is ~0; push = push, plus in sync the next pull, including the
    barrier). `server`: per step, the slowest shard's CPU time decoding pushes, optimizer
    apply, and encoding pulls (all workers), and the mean barrier/bound wait of one pull."""
    import numpy as np

    def mean(values):
        values = values[warmup:]
        return float(np.mean(values)) if len(values) else None

    phases = ref.get("phases_s", {})
    pulls = max(1, steps * workers * len(stats))
    return {
        "worker": {"step": mean(ref["step_s"]), "pull": mean(phases.get("pull_s", [])),
                   "compute": mean(ref["compute_s"]),
                   "push": mean(phases.get("push_s", [])),
                   "batch_overlapped": mean(phases.get("batch_s", []))},
        "server": {"decode": max(s.get("decode_s", 0.0) for s in stats) / max(1, steps),
                   "apply": max(s.get("apply_s", 0.0) for s in stats) / max(1, steps),
                   "encode": max(s.get("encode_s", 0.0) for s in stats) / max(1, steps),
                   "wait_per_pull": sum(s["wait_s"]["barrier"] + s["wait_s"]["bound"]
                                        for s in stats) / pulls},
    }


def collect(job, logdir: Path, stats: list[dict], shard_map, launch=None,
            interrupted: str | None = None) -> dict:
    """Worker files + shard stats -> results.json and TensorBoard events (RunWriter).
    `interrupted`: the signal that stopped the run; the workers wrote what they measured
    up to the step each stopped after, and the record says `interrupted`."""
    from jax.sharding import PartitionSpec as P
    import jax

    from jaxdist import metrics
    from jaxdist import record_builder
    from jaxdist.writers import RunWriter
    from jaxdist.telemetry import outputs
    from jaxdist.telemetry.combine import combine
    from ps.shardmap import abstract_model

    shape = job.shape
    psdir = Path(logdir) / "ps"
    num_workers, devices = shape.data, shape.fsdp
    workers = {}
    for w in range(num_workers):
        path = psdir / f"worker{w}.json"
        if path.exists():
            workers[w] = read_worker(path)
    if not workers:
        raise PSError(f"no worker wrote results into {psdir}")
    dead = list(launch.dead_workers) if launch else [
        {"worker": w, "exit": "unknown", "error": f"no {psdir / f'worker{w}.json'}",
         "at_unix_s": None} for w in range(num_workers) if w not in workers]
    ref_w = min(workers)  # worker 0 unless it died
    ref = workers[ref_w]
    warmup, total = job.loop.warmup, job.loop.warmup + job.loop.steps
    losses = []
    for t in range(total):
        values = [r["losses"][t] for r in workers.values() if len(r["losses"]) > t]
        if not values:  # interrupted: no worker got this far
            break
        losses.append(sum(values) / len(values))
    timed = ref["step_s"][warmup:]
    steps = metrics.step_time_block(timed)
    model_cfg, _, abstract_params, abstract_ms = abstract_model(job)
    batch = job.train.batch_size
    tokens = model_cfg.tokens_per_sample
    throughput = job_throughput(workers, batch // num_workers, warmup, tokens)
    # MFU at the job's rate: the time the whole job took per global batch (in sync ~ a
    # step; in async/ssp the workers' steps overlap), so MFU and throughput agree.
    batch_s = batch / throughput["samples_per_s"] if throughput["samples_per_s"] else None
    env = dict(ref["env"], num_devices=num_workers * devices, num_processes=num_workers)
    abstract = {"params": abstract_params, "model_state": abstract_ms}
    specs = jax.tree.map(lambda _: P(), abstract)
    push_s = [s for r in workers.values() for s in r["push_s"]]
    pull_s = [s for r in workers.values() for s in r["pull_s"]]
    steps_done = max(r["steps_done"] for r in workers.values())
    staleness = {}
    step_staleness = {}
    for s in stats:
        for key, hist in (("staleness_hist", staleness), ("step_staleness_hist",
                                                           step_staleness)):
            for k, v in s[key].items():
                hist[k] = hist.get(k, 0) + v
    order = lambda h: dict(sorted(h.items(), key=lambda kv: int(kv[0])))  # noqa: E731
    per_shard = [{"shard": s["shard"], "applied": s["applied"], "rejected": s["rejected"],
                  "deduplicated": s["deduplicated"], "applies": s["applies"],
                  "rejected_nonfinite": s.get("rejected_nonfinite", 0),
                  "clipped": s.get("clipped", 0),
                  "version": s["version"], "epoch": s["epoch"], "snapshots": s["snapshots"],
                  "retired_workers": s["retired"], "events": s["events"]} for s in stats]
    scales = [s["lr_scale_mean"] for s in stats if s["lr_scale_mean"] is not None]
    by_transport = {t: sum(r.get("bytes_by_transport", {}).get(t, 0) for r in workers.values())
                    for t in ("tcp", "grpc")}
    ps_block = {
        "mode": job.ps.ps_mode, "workers": num_workers, "devices_per_worker": devices,
        "shards": job.ps.ps_shards, "transport": job.ps.ps_transport,
        "bytes_by_transport": by_transport, "carried_by": carried_by(by_transport),
        "data_fallbacks": sum(r.get("data_fallbacks", 0) for r in workers.values()),
        "staleness_bound": job.ps.staleness if job.ps.ps_mode == "ssp" else None,
        "staleness_lr": job.ps.ps_staleness_lr,
        "mfu_time_per_batch_s": batch_s,  # what MFU divides by: global batch / job rate
        "step_time_definition": f"wall time of one loop iteration (pull + gradient + push) "
                                f"of worker {ref_w}; other workers in step_time_s_per_worker",
        "step_time_s_per_worker": [metrics.latency_stats(workers[w]["step_s"][warmup:])
                                   if w in workers and len(workers[w]["step_s"]) > warmup
                                   else None for w in range(num_workers)],
        "steps_done_per_worker": [workers[w]["steps_done"] if w in workers else None
                                  for w in range(num_workers)],
        "compute_s_per_worker": [_brief(workers[w]["compute_s"][warmup:]) if w in workers
                                 else None for w in range(num_workers)],
        "shard_map": {"fingerprint": shard_map.fingerprint, "chunk_elems": shard_map.chunk_elems,
                      "pieces": len(shard_map.pieces),
                      "bytes_per_shard": shard_map.bytes_per_shard,
                      "file": str(psdir / "shard_map.json")},
        "push_latency_s": _brief(push_s),
        "pull_latency_s": _brief(pull_s),
        "bytes_per_step": {
            "push": sum(r["push_bytes"] for r in workers.values()) / max(1, steps_done),
            "pull": sum(r["pull_bytes"] for r in workers.values()) / max(1, steps_done)},
        "wait_s": {"barrier": sum(s["wait_s"]["barrier"] for s in stats),
                   "bound": sum(s["wait_s"]["bound"] for s in stats),
                   "per_worker": [sum(workers[w]["pull_wait_s"]) if w in workers else None
                                  for w in range(num_workers)]},
        "staleness": dict(_hist_summary(order(staleness)),
                          per_shard=[s["staleness_hist"] for s in stats]),
        "step_staleness": _hist_summary(order(step_staleness)),
        "lr_scale": {"mean": sum(scales) / len(scales) if scales else None,
                     "min": min((s["lr_scale_min"] for s in stats), default=None)},
        "updates": {"applied": sum(s["applied"] for s in stats),
                    "rejected": sum(s["rejected"] for s in stats),
                    "deduplicated": sum(s["deduplicated"] for s in stats),
                    "rejected_nonfinite": sum(s.get("rejected_nonfinite", 0) for s in stats),
                    "per_shard": per_shard},
        "server_bytes_per_shard": [{"shard": s["shard"], "params_bytes": s["params_bytes"],
                                    "opt_bytes": s["opt_bytes"],
                                    "total_bytes": s["params_bytes"] + s["opt_bytes"]}
                                   for s in stats],
        "time_breakdown_s": _breakdown(ref, stats, warmup, max(1, steps_done), num_workers),
        "dead_workers": dead,
        "shard_restarts": launch.restarts if launch else [],
        "restarts_seen_by_workers": sum(r["restarts_seen"] for r in workers.values()),
        "pids": launch.all_pids if launch else [],
    }
    memory = dict(ref["memory"])
    if memory.get("compiled") is None:
        memory["compiled_reason"] = ("XLA reported no memory analysis for the worker's "
                                     "gradient step")
    memory["servers_note"] = ("state_bytes_per_device counts a worker's replicated parameters "
                              "(+ model state); parameters and optimizer state live on the "
                              "shard servers: ps.server_bytes_per_shard")
    # A worker writes its file after its last step, or after the step it stopped at when
    # the run was interrupted (ps.launch.stop_workers).
    results = record_builder.build(
        "jax", "ps", {"workers": num_workers, "devices_per_worker": devices}, job.to_dict(),
        model_cfg,
        shard_map.total, env=env, compile_s=ref["compile_s"], step_time_s=steps,
        warmup_step_time_s=ref["step_s"][:warmup], throughput=throughput,
        mfu=metrics.mfu(env["device_kind"], job.dtype, num_workers * devices, batch_s,
                        ref["compiled_flops"], model_cfg.flops_per_sample() * batch,
                        job.matmul_precision),
        memory=memory, sharding=metrics.sharding_summary(abstract, specs), loss=losses,
        comm=None,
        power=combine({w: r.get("power") or {"available": False, "reason": "the worker "
                                             "recorded no power block"}
                       for w, r in workers.items()}),
        window=throughput["window"],
        steps_done=steps_done,  # loop iterations of each reporting worker (warm-up too)
        interrupted={"signal": interrupted, "received_here": True, "steps_planned": total,
                     "timed_steps": len(timed),
                     "steps_done_per_worker": ps_block["steps_done_per_worker"]}
        if interrupted else None,
        comm_reason="not XLA collectives: workers exchange gradients and parameters with the "
                    f"shards over {ps_block['carried_by']} (ps bytes per step)" + (
                        f"; the all-reduce over each worker's {devices} devices is not "
                        f"analysed" if devices > 1 else ""),
        accuracy=ref["accuracy"], ps=ps_block)
    writer = RunWriter(Path(logdir), job.to_dict())
    try:
        writer.summary(results)  # the record first (results.json), then the curves
        for t in curve_steps(len(losses), warmup):
            step_s = ref["step_s"][t] if t < len(ref["step_s"]) else 0.0
            writer.step(t, losses[t], step_s, t >= warmup)
            for w, r in workers.items():  # timed steps only, as train/step_time_s
                if warmup <= t < len(r["step_s"]):
                    writer.scalar(f"train/worker{w}/step_time_s", r["step_s"][t], t)
        for point in ref["accuracy"]:
            writer.scalar("eval/accuracy", point["accuracy"], point["step"])
        # the run's figures; each worker's series are in its folder (ps/worker<w>/power)
        outputs.write_summary(writer.tb, results["power"])
    finally:
        writer.close()
    return results


def curve_steps(n: int, warmup: int) -> list[int]:
    """The steps the TensorBoard curves get: every one up to CURVE_POINTS timed steps, then
    evenly spaced ones (the first timed and the last step kept). A PS run's curves are
    written when it ends, ~0.5 ms a step here: 12,652 steps made a SIGTERM'd run take 11 s
    to exit, 9 of them here. TensorBoard shows 1,000 points a curve by default;
    results.json keeps every step."""
    stride = max(1, -(-(n - warmup) // CURVE_POINTS))
    return [t for t in range(n) if t < warmup or (t - warmup) % stride == 0 or t == n - 1]

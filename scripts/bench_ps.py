"""Parameter-server transport and step-time benchmark.

1. Push + pull throughput of 4, 40 and 400 MB of float32 across 1, 2 and 4 shard processes
   (the real wire: ps.wire frames, ps.client on the worker side, the real servicer on the
   server side with a no-op core, so only transport is timed), beside a raw loopback TCP
   transfer of the same bytes there and back, measured in the same run.
2. ps-sync step time / ddp step time for the same model, workers and global batch, both
   through `python -m experiments.run`; and the ps-sync step against its own floor (P5):
   worker compute + the slowest shard's decode + apply + encode + the step's push and pull
   bytes (all workers) at the raw loopback TCP rate, every term measured in this run (the
   rate by a raw transfer of the same bytes). DDP in one process is not the PS's floor on
   a machine whose cores the workers and shards share.

    python scripts/bench_ps.py                 # everything (400 MB x 4 shards: ~2.5 GB RAM)
    python scripts/bench_ps.py --sizes 4,40 --shards 1,2 --repeats 2 --skip-step
Both transports are measured (--transports tcp,grpc): tcp, the run's default, carries
one-message pushes and pulls on the shard's data port (ps.tcp); grpc is everything over
gRPC, the alternative it replaced. Prints a table, then the ratios last. Targets:
throughput >= 0.5 x raw for >= 40 MB (P4); ps-sync step <= 1.25 x its floor (P5);
ps-sync / ddp step time printed beside it.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # no INFO lines when servers stop
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MB = 1 << 20
CHUNK = 1 << 20


# -- raw TCP baseline: the same bytes to a process and back, 1 MiB sends ------------------

def _raw_server(port_q, nbytes):
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    buf = bytearray(nbytes)
    view = memoryview(buf)
    while True:
        got = 0
        while got < nbytes:
            n = conn.recv_into(view[got:], min(CHUNK, nbytes - got))
            if n == 0:
                return
            got += n
        for start in range(0, nbytes, CHUNK):
            conn.sendall(view[start:start + CHUNK])


def raw_roundtrip(nbytes: int, repeats: int) -> float:
    """Best seconds to send nbytes to another process and receive them back."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_raw_server, args=(q, nbytes), daemon=True)
    proc.start()
    port = q.get(timeout=60)
    sock = socket.create_connection(("127.0.0.1", port))
    data = memoryview(np.ones(nbytes // 4, np.float32)).cast("B")
    back = bytearray(nbytes)
    view = memoryview(back)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        sender = threading.Thread(target=lambda: [sock.sendall(data[s:s + CHUNK])
                                                  for s in range(0, nbytes, CHUNK)])
        sender.start()
        got = 0
        while got < nbytes:
            got += sock.recv_into(view[got:], min(CHUNK, nbytes - got))
        sender.join()
        best = min(best, time.perf_counter() - start)
    sock.close()
    proc.join(5)
    if proc.is_alive():
        proc.terminate()
    return best


# -- PS transport: real servicer and client, a core that stores and serves only ----------

class TransportCore:
    """Duck-types ps.core.ShardCore for the servicer: keeps the last push, serves params."""
    mode, epoch, version = "async", 0, 0

    def __init__(self, size: int):
        self.size, self.num_workers = size, 1
        self.params = np.ones(size, np.float32)

    def push(self, worker, step, version, epoch, grad):
        self.version += 1
        return {"status": "applied", "version": self.version, "epoch": 0, "staleness": 0}

    def pull(self, worker, step, min_version, epoch):
        return self.version, 0, self.params, 0.0, None

    def count_rejected(self):
        pass

    def waiting(self):
        return []

    def take_buffer(self):
        if not hasattr(self, "_buf"):
            self._buf = np.empty(self.size, np.float32)
        return self._buf

    def give_buffer(self, buf):
        pass

    def stats(self):
        return {}


def _ps_server(shard, num_shards, total, ready_q, max_bytes, transport):
    os.environ["JAX_PLATFORMS"] = "cpu"
    from ps.servicer import ShardServicer, start_grpc
    from ps.shardmap import Leaf, build_shard_map
    from ps.tcp import DataServer
    from ps import wire

    smap = build_shard_map([Leaf("w", (total,), "float32", 0, total)], num_shards,
                           chunk_elems=max(1, -(-total // num_shards)))
    core = TransportCore(smap.shard_size(shard))
    servicer = ShardServicer(core, smap, shard, frame_bytes=wire.frame_bytes(max_bytes))
    server, port = start_grpc(servicer, "127.0.0.1", 0, max_bytes, 1)
    if transport == "tcp":
        servicer.data_port = DataServer(servicer, "127.0.0.1", max_bytes, 1).port
    ready_q.put((shard, port))
    servicer.stop_event.wait()
    server.stop(0)


def ps_roundtrip(nbytes: int, num_shards: int, repeats: int,
                 transport: str = "tcp") -> tuple[float, float, float]:
    """Best (push s, pull s, push+pull s) of nbytes over num_shards shard processes, over
    `transport` (--ps-transport)."""
    from ps.client import PSClient
    from ps.shardmap import Leaf, build_shard_map

    total = nbytes // 4
    max_bytes = 64 * MB
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_ps_server, daemon=True,
                         args=(k, num_shards, total, q, max_bytes, transport))
             for k in range(num_shards)]
    for p in procs:
        p.start()
    ports = dict(q.get(timeout=120) for _ in procs)
    smap = build_shard_map([Leaf("w", (total,), "float32", 0, total)], num_shards,
                           chunk_elems=max(1, -(-total // num_shards)))
    client = PSClient([f"127.0.0.1:{ports[k]}" for k in range(num_shards)], smap, 0, "async",
                      max_message_bytes=max_bytes, timeout_s=60, transport=transport)
    client.connect()
    grad = np.ones(total, np.float32)
    dest = np.empty(total, np.float32)
    best = (float("inf"),) * 3
    try:
        for step in range(repeats):
            t0 = time.perf_counter()
            client.push(step, grad)
            t1 = time.perf_counter()
            client.pull(step + 1, dest)
            t2 = time.perf_counter()
            if t2 - t0 < best[2]:
                best = (t1 - t0, t2 - t1, t2 - t0)
        assert np.array_equal(dest, grad)
    finally:
        for k in range(num_shards):
            try:
                client.shards[k].control("shutdown")
            except Exception:
                pass
        client.close()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    return best


# -- step time: ps sync vs ddp through the CLI --------------------------------------------

def cli_run(args: list[str]) -> dict:
    """results.json of one `experiments.run`."""
    from jaxdist.record import RunRecord

    with tempfile.TemporaryDirectory() as tmp:
        logdir = Path(tmp) / "run"
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        proc = subprocess.run([sys.executable, "-m", "experiments.run", *args, "--logdir",
                               str(logdir), "--no-progress"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=900)
        if proc.returncode:
            raise RuntimeError(proc.stderr[-2000:])
        return RunRecord.load(logdir).results


def step_floor(r: dict, repeats: int) -> tuple[float, dict]:
    """P5's floor of a ps-sync step, from the run's own breakdown (means over the timed
    steps) and a raw loopback transfer of the step's bytes measured now."""
    b, moved = r["ps"]["time_breakdown_s"], r["ps"]["bytes_per_step"]
    nbytes = int(moved["push"] + moved["pull"])
    half = max(CHUNK, nbytes // 2 // CHUNK * CHUNK)  # there and back: push out, pull in
    rate = 2 * half / raw_roundtrip(half, repeats)
    terms = {"compute": b["worker"]["compute"], "decode": b["server"]["decode"],
             "apply": b["server"]["apply"], "encode": b["server"]["encode"],
             f"{nbytes / MB:.1f} MB at raw TCP": nbytes / rate}
    return sum(terms.values()), terms


def format_breakdown(b: dict) -> str:
    ms = lambda x: "n/a" if x is None else f"{x * 1e3:.2f}"  # noqa: E731
    w, s = b["worker"], b["server"]
    return (f"    worker: step {ms(w['step'])} = pull {ms(w['pull'])} + compute (grad, "
            f"flatten) {ms(w['compute'])} + push(+next pull, barrier) {ms(w['push'])} ms; "
            f"batch prep {ms(w['batch_overlapped'])} ms overlapped with the push\n"
            f"    server (slowest shard, per step): decode {ms(s['decode'])}, apply "
            f"{ms(s['apply'])}, encode {ms(s['encode'])} ms; wait per pull "
            f"{ms(s['wait_per_pull'])} ms")


def parse_args(argv=None):
    """The flags, checked: a bad value is one line and exit status 2, and before the models
    (flax, jax: a second) are imported unless --model is what is checked."""
    from jaxdist.errors import OneLineParser, unknown

    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4,40,400", help="MB, comma-separated")
    parser.add_argument("--shards", default="1,2,4")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-step", action="store_true", help="skip the step-time part")
    parser.add_argument("--skip-transport", action="store_true",
                        help="skip the throughput part")
    parser.add_argument("--transports", default="tcp,grpc",
                        help="--ps-transport values to measure, comma-separated")
    parser.add_argument("--model", default="mlp-tiny,mlp",
                        help="models of the step-time comparison, comma-separated")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)

    def counts(flag, text):
        try:
            values = [int(v) for v in text.split(",")]
        except ValueError:
            values = []
        if not values or min(values) < 1:
            parser.error(f"{flag} takes positive integers, comma-separated; got {text!r}")
        return values
    args.sizes, args.shards = counts("--sizes", args.sizes), counts("--shards", args.shards)
    parser.require_at_least(args, repeats=1, batch_size=1, workers=1, steps=1)
    if args.batch_size % args.workers:
        parser.error(f"--batch-size {args.batch_size} is not divisible by --workers "
                     f"{args.workers}")
    args.transports = [t.strip() for t in args.transports.split(",")]
    for transport in args.transports:
        if transport not in ("tcp", "grpc"):
            parser.error(unknown("transport", transport, ["tcp", "grpc"]))
    args.model = [m.strip() for m in args.model.split(",")]
    from models import model_names  # the families register their sizes on import
    for model in args.model:
        if model not in model_names():
            parser.error(unknown("model", model, model_names()))
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    sizes, shard_counts, transports = args.sizes, args.shards, args.transports

    ratios = []
    print(f"load average {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} CPUs; "
          f"transports {', '.join(transports)} (the run's default: tcp)", flush=True)
    print(f"{'MB':>6} {'shards':>6} {'transport':>9} {'push s':>8} {'pull s':>8} "
          f"{'ps MB/s':>9} {'raw MB/s':>9} {'ps/raw':>7}", flush=True)
    for size in ([] if args.skip_transport else sizes):
        nbytes = size * MB
        raw = raw_roundtrip(nbytes, args.repeats)
        raw_rate = 2 * size / raw
        for k in shard_counts:
            for transport in transports:
                push, pull, both = ps_roundtrip(nbytes, k, args.repeats, transport)
                rate = 2 * size / both
                print(f"{size:>6} {k:>6} {transport:>9} {push:>8.3f} {pull:>8.3f} {rate:>9.0f} "
                      f"{raw_rate:>9.0f} {rate / raw_rate:>7.2f}", flush=True)
                ratios.append((size, k, transport, rate / raw_rate))

    steps = []  # (model, transport, ps / ddp, ps / floor)
    if not args.skip_step:
        mesh = f"{args.workers}x1"
        print(f"\nstep time p50, {args.workers} workers x 1 device, batch {args.batch_size}, "
              f"adamw ({args.steps} timed steps):")
        for model in args.model:
            common = ["--model", model, "--batch-size", str(args.batch_size), "--warmup", "3",
                      "--steps", str(args.steps), "--optimizer", "adamw"]
            ddp = cli_run(["--layout", "ddp", "--mesh", mesh, *common])["step_time_s"]["p50"]
            print(f"  {model:<10} ddp {ddp * 1e3:8.2f} ms", flush=True)
            for transport in transports:
                r = cli_run(["--layout", "ps", "--mesh", mesh, "--ps-shards", "2",
                             "--ps-mode", "sync", "--ps-transport", transport, *common])
                ps = r["step_time_s"]["p50"]
                print(f"  {model:<10} ps sync (2 shards, {transport}) {ps * 1e3:8.2f} ms",
                      flush=True)
                print(format_breakdown(r["ps"]["time_breakdown_s"]), flush=True)
                floor, terms = step_floor(r, args.repeats)
                print("    floor " + " + ".join(f"{k} {v * 1e3:.2f}" for k, v in terms.items())
                      + f" = {floor * 1e3:.2f} ms", flush=True)
                steps.append((model, transport, ps / ddp, ps / floor))

    print("\nratios (push+pull throughput / raw loopback TCP; target >= 0.5 for >= 40 MB):")
    for size, k, transport, r in ratios:
        flag = "" if size < 40 else ("  ok" if r >= 0.5 else "  below target")
        print(f"  {size:>4} MB x {k} shard(s), {transport}: {r:.2f}{flag}")
    for model, transport, ratio, floor in steps:
        print(f"ps-sync step / its floor ({model}, {transport}): {floor:.2f} (target <= 1.25)"
              f"{'  ok' if floor <= 1.25 else '  above target'}; ps-sync / ddp step time: "
              f"{ratio:.2f}")


if __name__ == "__main__":
    main()

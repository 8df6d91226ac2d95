"""A shard server: `python -m ps.server --shard i --of K --port P <run flags>`.

One process per shard (Python's GIL would serialise shards sharing a process). It owns its
slice of the flat parameter vector and that slice's optimizer state, and applies updates on
the host with the run's optax optimizer. It never takes an accelerator: JAX_PLATFORMS=cpu is
forced before JAX loads. The gRPC handlers are ps.servicer's; here: the address and token
checks, the seeded initial slice, snapshots at start, and the process's life.
"""

from __future__ import annotations

import os

os.environ["JAX_PLATFORMS"] = "cpu"  # before anything imports jax: a shard holds no GPU
# gRPC logs every failed TLS handshake at INFO, with no rate limit: a peer sending garbage
# to a TLS port wrote 8 MB in 10 s. Its errors (a few, rate-limited by gRPC) still show.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import argparse  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from jaxdist.errors import UsageError  # noqa: E402
from ps import snapshot, wire  # noqa: E402
from ps.core import ShardCore  # noqa: E402
from ps.security import TOKEN_ENV, security_problems, write_private_json  # noqa: E402
from ps.servicer import ShardServicer, start_grpc  # noqa: E402
from ps.tcp import DataServer  # noqa: E402

FAULT_ENV = "JAXDIST_PS_FAULT"  # test-only fault injection, see ps/faults in docs/ps.md


def initial_params(job, shard_map, shard: int) -> np.ndarray:
    """This shard's slice of the seeded initial parameters: every server computes the same
    model init from the run's job, so no process has to send the initial weights."""
    import jax

    from jaxdist.train_step import DTYPES, split_model

    params = jax.jit(lambda: split_model(job.model, DTYPES[job.dtype], job.train.seed)[1])()
    flat = np.concatenate([np.asarray(x, np.float32).ravel() for x in jax.tree.leaves(params)])
    return shard_map.gather(flat, shard)


def fault_hook(shard: int, core: ShardCore):
    """JAXDIST_PS_FAULT=kill-shard:K:V: SIGKILL shard K, in its first life, once it reaches
    version V (tests of recovery; a real crash, no cleanup)."""
    for spec in filter(None, os.environ.get(FAULT_ENV, "").split(",")):
        parts = spec.split(":")
        if parts[0] == "kill-shard" and int(parts[1]) == shard:
            at = int(parts[2])

            def hook():
                if core.epoch == 0 and core.version >= at:
                    os.kill(os.getpid(), signal.SIGKILL)
            return hook
    return None


def build_parser() -> argparse.ArgumentParser:
    from jaxdist.config import add_arguments
    from jaxdist.errors import OneLineParser

    parser = OneLineParser(prog="python -m ps.server",
                           description="One parameter-server shard. Give it the same run "
                                       "flags as the workers (model, optimizer, lr, seed, "
                                       "--ps-* options).")
    own = parser.add_argument_group("shard")
    own.add_argument("--shard", type=int, required=True, help="this shard's index, 0..K-1")
    own.add_argument("--of", type=int, required=True, help="number of shards K")
    own.add_argument("--port", type=int, default=0, help="port to listen on (0: any free)")
    own.add_argument("--ready-file", default="", help="write {port, data_port, pid} here once "
                     "serving (mode 0600)")
    own.add_argument("--snapshot-dir", default="", help="where snapshots go "
                     "(--ps-checkpoint-every)")
    own.add_argument("--restore", action="store_true", help="continue from the latest "
                     "snapshot in --snapshot-dir")
    own.add_argument("--restore-version", type=int, default=-1, help="with --restore: the "
                     "snapshot of this version (a resumed run's, ps.resume), not the latest")
    add_arguments(parser)
    return parser


def main(argv=None) -> int:
    from jaxdist.config import from_namespace
    from jaxdist import procs
    from jaxdist.job import for_process
    from ps.shardmap import shard_map_for

    procs.parent_watchdog()
    _raise_fd_limit()
    args = build_parser().parse_args(argv)
    log = lambda msg: print(f"[shard {args.shard}] {msg}", flush=True)  # noqa: E731
    token = os.environ.get(TOKEN_ENV) or ""
    try:
        if args.of < 1:
            raise UsageError(f"--of must be 1 or more (the number of shards), got {args.of}")
        if not 0 <= args.shard < args.of:
            raise UsageError(f"--shard {args.shard} is outside 0..{args.of - 1}")
        if not 0 <= args.port <= 65535:
            raise UsageError(f"--port must be within 0..65535 (0: any free port), got "
                             f"{args.port}")
        job = for_process(from_namespace(args))  # validated by the launcher
        problem = security_problems(job.ps.ps_bind, token, job.ps.ps_tls_cert,
                                    job.ps.ps_tls_key)
        if problem:
            raise UsageError(problem)
        if job.ps.ps_max_message_mb < 1:
            raise UsageError("--ps-max-message-mb must be 1 or more")
        if args.port and not procs.port_free(job.ps.ps_bind, args.port):
            raise UsageError(f"port {args.port} on {job.ps.ps_bind} is in use")
        ready = Path(args.ready_file) if args.ready_file else None
        if ready and (ready.is_dir() or not ready.parent.is_dir()):
            raise UsageError(f"--ready-file {ready}: " + (
                "is a folder, not a file" if ready.is_dir() else
                f"{ready.parent} is not a folder (the file is written once serving)"))
        if (job.ps.ps_checkpoint_every or args.restore) and not args.snapshot_dir:
            raise UsageError("--ps-checkpoint-every and --restore need --snapshot-dir")
        if job.shape.size is None:
            raise UsageError("--layout ps needs an explicit mesh WORKERSxDEVICES (e.g. 4x1)")
        shard_map = shard_map_for(job, args.of)
        workers = job.shape.data
    except UsageError as e:
        print(f"ps.server: error: {e}", file=sys.stderr)
        return 2

    from jaxdist.train_step import make_optimizer

    log(shard_map.describe())
    log(f"shard {args.shard} holds {len(shard_map.shard_pieces(args.shard))} pieces, "
        f"{shard_map.bytes_per_shard[args.shard]:,} bytes of parameters")
    snap_dir = Path(args.snapshot_dir) if args.snapshot_dir else None
    epoch = snapshot.next_epoch(snap_dir) if snap_dir else 0
    core = ShardCore(initial_params(job, shard_map, args.shard),
                     make_optimizer(job.train.optimizer, job.train.lr),
                     mode=job.ps.ps_mode, num_workers=workers, staleness=job.ps.staleness,
                     staleness_lr=job.ps.ps_staleness_lr,
                     drop_dead=job.ps.ps_drop_dead_workers, timeout_s=job.ps.ps_timeout_s,
                     checkpoint_every=job.ps.ps_checkpoint_every, snapshot_dir=snap_dir,
                     epoch=epoch, clip_norm=job.ps.ps_clip_norm, log=log)
    loaded = snapshot.load(snap_dir, args.restore_version if args.restore_version >= 0
                           else None) if (args.restore and snap_dir) else None
    if loaded:
        core.restore(*loaded)
        log(f"restored version {core.version} (epoch {epoch})")
    elif snap_dir and job.ps.ps_checkpoint_every:
        core.snapshot_now()  # version 0: a shard that dies early still has a snapshot
    max_bytes = job.ps.ps_max_message_mb * (1 << 20)
    servicer = ShardServicer(core, shard_map, args.shard, token=token,
                             frame_bytes=wire.frame_bytes(max_bytes),
                             on_push=fault_hook(args.shard, core))
    servicer.log = log
    try:
        server, port = start_grpc(servicer, job.ps.ps_bind, args.port, max_bytes, workers,
                                  job.ps.ps_tls_cert, job.ps.ps_tls_key)
        if job.ps.ps_transport == "tcp":
            data_server = DataServer(servicer, job.ps.ps_bind, max_bytes, workers,
                                     job.ps.ps_tls_cert, job.ps.ps_tls_key, log=log)
            servicer.data_port, servicer.data_slots = data_server.port, data_server.slots
    except UsageError as e:
        print(f"ps.server: error: {e}", file=sys.stderr)
        return 2
    if args.ready_file:  # this user's alone: where the shard listens is for the run only
        write_private_json(Path(args.ready_file), {"port": port, "pid": os.getpid(),
                                                   "epoch": epoch, "shard": args.shard,
                                           "fingerprint": shard_map.fingerprint,
                                           **({"data_port": servicer.data_port}
                                              if servicer.data_port else {})})
    on_data = f", data port {servicer.data_port}" if servicer.data_port else ""
    log(f"serving on {job.ps.ps_bind}:{port}{on_data} (mode {job.ps.ps_mode}, {workers} workers, "
        f"epoch {epoch}, token {'required' if token else 'off'}, "
        f"tls {'on' if job.ps.ps_tls_cert else 'off'})")
    signal.signal(signal.SIGTERM, lambda *_: servicer.stop_event.set())
    while not servicer.stop_event.wait(0.1):
        pass
    server.stop(grace=0.2).wait(1.0)
    slots = servicer.data_slots
    if slots is not None and slots.unlogged():  # the counts since the last (rate-limited) line
        log(f"data port: {slots.summary()}")
    if servicer.refusals_unlogged():
        log(servicer.refusal_summary())
    log("stopped")
    # Exit now: interpreter shutdown would join the gRPC pool's threads, and a pull parked
    # on a barrier holds one for up to --ps-timeout-s (the launcher would SIGKILL us first).
    # Nothing is lost: snapshots are written atomically while serving.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _raise_fd_limit() -> None:
    """The soft file-descriptor limit up to the hard one: the ports' connection caps
    (ps.servicer.connection_cap) are derived from it."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass


if __name__ == "__main__":
    sys.exit(main())

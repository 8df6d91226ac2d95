"""A shard server: `python -m ps.server --shard i --of K --port P <run flags>`.

One process per shard (Python's GIL would serialise shards sharing a process). It owns its
slice of the flat parameter vector and that slice's optimizer state, and applies updates on
the host with the run's optax optimizer. It never takes an accelerator: JAX_PLATFORMS=cpu is
forced before JAX loads.

The gRPC layer is thin: it authenticates (a token from JAXDIST_PS_TOKEN, compared in constant
time on every call), decodes and validates frames (ps.wire) into a scratch buffer, and hands
whole gradients to `ps.core.ShardCore`. Anything malformed gets an error status; the core is
never called with it, so parameters cannot change and the server stays up.

Methods (generic handlers, raw bytes; no protoc):
  Push     client stream of frames (op "push") -> JSON reply {status, version, epoch, ...}
  Pull     one frame (op "pull": worker, step, min_version, epoch) -> stream of "param" frames
  PushOne, PullOne  the same as single messages of several frames (small shards)
  PushPullOne  sync: the push of step t and the parameters of step t+1 in one call
  Control  one frame (op ping | info | hello | stats | retire | shutdown) -> JSON reply
"""

from __future__ import annotations

import os

os.environ["JAX_PLATFORMS"] = "cpu"  # before anything imports jax: a shard holds no GPU

import argparse  # noqa: E402
import hmac  # noqa: E402
import ipaddress  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from pathlib import Path  # noqa: E402

import grpc  # noqa: E402
import numpy as np  # noqa: E402

from jaxdist.errors import UsageError  # noqa: E402
from ps import snapshot, wire  # noqa: E402
from ps.admission import CallGate, Refused, pool_size  # noqa: E402
from ps.client import FAULT_KEY, TOKEN_KEY  # noqa: E402
from ps.core import PSFault, ShardCore  # noqa: E402
from jaxdist.record import write_json

TOKEN_ENV = "JAXDIST_PS_TOKEN"
FAULT_ENV = "JAXDIST_PS_FAULT"  # test-only fault injection, see ps/faults in docs/ps.md
MIN_TOKEN_CHARS = 16
_CODES = {"invalid": grpc.StatusCode.INVALID_ARGUMENT,
          "precondition": grpc.StatusCode.FAILED_PRECONDITION,
          "restarted": grpc.StatusCode.FAILED_PRECONDITION,
          "aborted": grpc.StatusCode.ABORTED,
          "deadline": grpc.StatusCode.DEADLINE_EXCEEDED,
          "exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED}


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def security_problems(bind: str, token: str | None, cert: str, key: str) -> str | None:
    """Why these security options are unusable, or None."""
    if not is_loopback(bind) and not token:
        return (f"--ps-bind {bind} exposes the shard servers beyond this host; set a shared "
                f"token in {TOKEN_ENV} (at least {MIN_TOKEN_CHARS} characters) on every "
                f"server and worker")
    if token is not None and token != "" and len(token.strip()) < MIN_TOKEN_CHARS:
        # whitespace does not count: a token of 16 spaces is as guessable as an empty one
        return (f"{TOKEN_ENV} must be at least {MIN_TOKEN_CHARS} characters, not counting "
                f"whitespace")
    if bool(cert) != bool(key):
        return "--ps-tls-cert and --ps-tls-key go together: give both or neither"
    for flag, path in (("--ps-tls-cert", cert), ("--ps-tls-key", key)):
        if path and not os.path.isfile(path):
            return f"{flag} {path}: no such file"
    return None


def server_options(max_message_bytes: int) -> list:
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            # grpc sets SO_REUSEPORT by default: a second server could then share a busy
            # port silently. A port in use must be an error.
            ("grpc.so_reuseport", 0)]


class ShardServicer:
    def __init__(self, core: ShardCore, shard_map, shard: int, *, token: str = "",
                 frame_bytes: int = wire.DEFAULT_FRAME_BYTES, on_push=None,
                 call_deadline_s: float | None = None):
        self.core, self.map, self.shard = core, shard_map, shard
        # Longer than the core's own waits (timeout + 1 s), so a parked pull ends with the
        # core's message, not a bare cancellation.
        self.gate = CallGate(core.num_workers, call_deadline_s or
                             getattr(core, "timeout_s", 30.0) + 2.0)
        self.token = token.encode() if token else b""
        self.frame_bytes = frame_bytes
        self.pieces = shard_map.shard_pieces(shard)
        self.layout = {p.name: (p.length, p.shard_offset) for p in self.pieces}
        self.stop_event = threading.Event()
        self.on_push = on_push or (lambda: None)
        self.bytes_in = self.bytes_out = 0
        self.decode_s = self.encode_s = 0.0  # CPU time validating/copying frames in, making out

    def handler(self):
        return grpc.method_handlers_generic_handler("jaxdist.ps.Shard", {
            "Push": grpc.stream_unary_rpc_method_handler(self.push),
            "Pull": grpc.unary_stream_rpc_method_handler(self.pull),
            "Control": grpc.unary_unary_rpc_method_handler(self.control),
            # The same, as single messages of several frames: small transfers skip streams.
            "PushOne": grpc.unary_unary_rpc_method_handler(
                lambda request, context: self.push(iter((request,)), context)),
            "PullOne": grpc.unary_unary_rpc_method_handler(self.pull_one),
            "PushPullOne": grpc.unary_unary_rpc_method_handler(self.push_pull_one),
        })

    # Every handler starts here: a missing or wrong token never reaches parsing.
    def _auth(self, context) -> None:
        if not self.token:
            return
        got = b""
        for key, value in context.invocation_metadata() or ():
            if key == TOKEN_KEY:
                got = value.encode() if isinstance(value, str) else bytes(value)
        if not hmac.compare_digest(got, self.token):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token")

    @staticmethod
    def _abort(context, kind: str, message: str):
        context.set_trailing_metadata(((FAULT_KEY, kind),))
        context.abort(_CODES[kind], message)

    def _admit(self, context):
        """(worker named in the metadata, release()) or abort: see ps.admission."""
        try:
            return self.gate.admit(context)
        except Refused as e:
            if e.kind == "invalid":
                self.core.count_rejected()
            self._abort(context, e.kind, str(e))

    def push(self, request_iterator, context):
        return json.dumps(self._push(request_iterator, context)[0]).encode()

    def push_pull_one(self, request, context):
        """Sync: the push of step t and the pull of step t+1 in one call (one message each
        way, no second call to hand the parameters over). Reply: a frame `op=reply` with
        the push's JSON fields, then the parameter frames."""
        if self.core.mode != "sync":
            self._abort(context, "invalid", "PushPullOne is for --ps-mode sync")
        reply, meta = self._push(iter((request,)), context)
        step = meta["step"] + 1
        pull = wire.encode({"op": "pull", "worker": meta["worker"], "step": step,
                            "min_version": step, "epoch": meta["epoch"]})
        return wire.encode({"op": "reply", **reply}) + self.pull_one(pull, context)

    def _push(self, request_iterator, context):
        self._auth(context)
        worker, release = self._admit(context)
        scratch = self.core.take_buffer()
        try:
            asm = wire.Assembler("push", self.layout, scratch,
                                 fixed=("worker", "step", "version", "epoch"))
            try:
                for message in request_iterator:
                    d0 = time.perf_counter()
                    asm.add(message)
                    self.decode_s += time.perf_counter() - d0
                meta = asm.finish()
                if not meta:
                    raise wire.WireError("empty push")
                if meta["worker"] != worker:
                    raise wire.WireError(f"frames of worker {meta['worker']} on a call of "
                                         f"worker {worker}")
            except wire.WireError as e:
                self.core.count_rejected()
                self._abort(context, "invalid", str(e))
            self.bytes_in += asm.bytes
            try:
                reply = self.core.push(meta["worker"], meta["step"], meta["version"],
                                       meta["epoch"], scratch)
            except PSFault as e:
                self._abort(context, e.kind, str(e))
        finally:
            self.core.give_buffer(scratch)  # kept by the core while a sync barrier holds it
            release()
        self.on_push()
        return reply, meta

    def _pull_source(self, request, context, worker: int):
        """Validate a pull, wait as the mode says (core.pull), and return
        `produce(wire.frames or wire.bundle)` over the parameters it got."""
        try:
            header, _ = wire.decode(request)
            if header.get("op") != "pull":
                raise wire.WireError(f"expected op 'pull', got {str(header.get('op'))[:20]!r}")
            fields = {k: wire.get_int(header, k)
                      for k in ("worker", "step", "min_version", "epoch")}
            if fields["worker"] != worker:
                raise wire.WireError(f"pull of worker {fields['worker']} on a call of worker "
                                     f"{worker}")
        except wire.WireError as e:
            self._abort(context, "invalid", str(e))
        try:
            version, epoch, params, waited, _ = self.core.pull(**fields)
        except PSFault as e:
            self._abort(context, e.kind, str(e))
        meta = {"version": version, "epoch": epoch, "waited_us": int(waited * 1e6)}
        return lambda make: make("param", self.pieces, params, self.frame_bytes, meta,
                                 source_offset=lambda p: p.shard_offset)

    def pull(self, request, context):
        self._auth(context)
        worker, release = self._admit(context)
        try:
            frames = self._pull_source(request, context, worker)(wire.frames)
            while True:
                e0 = time.perf_counter()
                frame = next(frames, None)
                self.encode_s += time.perf_counter() - e0
                if frame is None:
                    break
                self.bytes_out += len(frame)
                yield frame
        finally:
            release()

    def pull_one(self, request, context):
        self._auth(context)
        worker, release = self._admit(context)
        try:
            produce = self._pull_source(request, context, worker)
            e0 = time.perf_counter()
            message = produce(wire.bundle)
            self.encode_s += time.perf_counter() - e0
        finally:
            release()
        self.bytes_out += len(message)
        return message

    def control(self, request, context):
        self._auth(context)
        try:
            header, _ = wire.decode(request)
            op = header.get("op")
            if op == "ping":
                return b'{"ok": true}'
            if op == "progress":
                return json.dumps(self.core.progress()).encode()
            if op == "info":
                return json.dumps(self.info()).encode()
            if op == "stats":
                stats = self.core.stats()
                stats.update(self.info(), bytes_in=self.bytes_in, bytes_out=self.bytes_out,
                             decode_s=self.decode_s, encode_s=self.encode_s)
                return json.dumps(stats).encode()
            if op == "hello":
                worker = wire.get_int(header, "worker", 0, self.core.num_workers - 1)
                try:
                    return json.dumps(self.core.hello(worker)).encode()
                except PSFault as e:
                    self._abort(context, e.kind, str(e))
            if op == "retire":
                worker = wire.get_int(header, "worker", 0, self.core.num_workers - 1)
                reason = str(header.get("reason", "retired by the launcher"))[:200]
                self.core.retire(worker, reason)
                return b'{"ok": true}'
            if op == "shutdown":
                self.stop_event.set()
                return b'{"ok": true}'
            raise wire.WireError(f"unknown control op {str(op)[:20]!r}")
        except wire.WireError as e:
            self._abort(context, "invalid", str(e))

    def info(self) -> dict:
        return {"shard": self.shard, "of": self.map.num_shards,
                "fingerprint": self.map.fingerprint, "epoch": self.core.epoch,
                "version": self.core.version, "mode": self.core.mode,
                "workers": self.core.num_workers, "size": self.core.size,
                "pieces": len(self.pieces), "pid": os.getpid(),
                "waiting": self.core.waiting()}


def start_grpc(servicer: ShardServicer, bind: str, port: int, max_message_bytes: int,
               num_workers: int, tls_cert: str = "", tls_key: str = "") -> tuple:
    """(grpc server, bound port). Raises UsageError if the address cannot be bound."""
    # Data calls are capped per worker (ps.admission); the rest of the pool is for control.
    pool = ThreadPoolExecutor(max_workers=pool_size(num_workers),
                              thread_name_prefix="ps-shard")
    server = grpc.server(pool, handlers=[servicer.handler()],
                         options=server_options(max_message_bytes))
    host = f"[{bind}]" if ":" in bind else bind
    try:
        if tls_cert:
            with open(tls_cert, "rb") as c, open(tls_key, "rb") as k:
                creds = grpc.ssl_server_credentials([(k.read(), c.read())])
            bound = server.add_secure_port(f"{host}:{port}", creds)
        else:
            bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:
        bound = 0
    if not bound:
        raise UsageError(f"cannot bind {bind}:{port} (port in use or address not local)")
    server.start()
    return server, bound


def initial_params(cfg, shard_map, shard: int) -> np.ndarray:
    """This shard's slice of the seeded initial parameters: every server computes the same
    model init from the run config, so no process has to send the initial weights."""
    import jax

    from jaxdist.train_step import DTYPES, split_model
    from ps.shardmap import model_config

    model_cfg = model_config(cfg)
    params = jax.jit(lambda: split_model(model_cfg, DTYPES[cfg.model.dtype],
                                          cfg.train.seed)[1])()
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
    own.add_argument("--ready-file", default="", help="write {port, pid} here once serving")
    own.add_argument("--snapshot-dir", default="", help="where snapshots go "
                     "(--ps-checkpoint-every)")
    own.add_argument("--restore", action="store_true", help="continue from the latest "
                     "snapshot in --snapshot-dir")
    add_arguments(parser)
    return parser


def main(argv=None) -> int:
    from jaxdist.config import from_namespace
    from jaxdist import procs
    from ps.shardmap import shard_map_for

    procs.parent_watchdog()
    args = build_parser().parse_args(argv)
    cfg = from_namespace(args)
    log = lambda msg: print(f"[shard {args.shard}] {msg}", flush=True)  # noqa: E731
    token = os.environ.get(TOKEN_ENV) or ""
    try:
        if not 0 <= args.shard < args.of:
            raise UsageError(f"--shard {args.shard} is outside 0..{args.of - 1}")
        problem = security_problems(cfg.ps.ps_bind, token, cfg.ps.ps_tls_cert,
                                    cfg.ps.ps_tls_key)
        if problem:
            raise UsageError(problem)
        if cfg.ps.ps_max_message_mb < 1:
            raise UsageError("--ps-max-message-mb must be 1 or more")
        if args.port and not procs.port_free(cfg.ps.ps_bind, args.port):
            raise UsageError(f"port {args.port} on {cfg.ps.ps_bind} is in use")
        if (cfg.ps.ps_checkpoint_every or args.restore) and not args.snapshot_dir:
            raise UsageError("--ps-checkpoint-every and --restore need --snapshot-dir")
        shard_map = shard_map_for(cfg, args.of)
        workers = _num_workers(cfg)
    except UsageError as e:
        print(f"ps.server: error: {e}", file=sys.stderr)
        return 2

    from jaxdist.train_step import make_optimizer

    log(shard_map.describe())
    log(f"shard {args.shard} holds {len(shard_map.shard_pieces(args.shard))} pieces, "
        f"{shard_map.bytes_per_shard[args.shard]:,} bytes of parameters")
    snap_dir = Path(args.snapshot_dir) if args.snapshot_dir else None
    epoch = snapshot.next_epoch(snap_dir) if snap_dir else 0
    core = ShardCore(initial_params(cfg, shard_map, args.shard),
                     make_optimizer(cfg.train.optimizer, cfg.train.lr),
                     mode=cfg.ps.ps_mode, num_workers=workers, staleness=cfg.ps.staleness,
                     staleness_lr=cfg.ps.ps_staleness_lr,
                     drop_dead=cfg.ps.ps_drop_dead_workers, timeout_s=cfg.ps.ps_timeout_s,
                     checkpoint_every=cfg.ps.ps_checkpoint_every, snapshot_dir=snap_dir,
                     epoch=epoch, clip_norm=cfg.ps.ps_clip_norm, log=log)
    loaded = snapshot.load(snap_dir) if (args.restore and snap_dir) else None
    if loaded:
        core.restore(*loaded)
        log(f"restored version {core.version} (epoch {epoch})")
    elif snap_dir and cfg.ps.ps_checkpoint_every:
        core.save_snapshot()  # version 0: a shard that dies early still has a snapshot
    max_bytes = cfg.ps.ps_max_message_mb * (1 << 20)
    servicer = ShardServicer(core, shard_map, args.shard, token=token,
                             frame_bytes=wire.frame_bytes(max_bytes),
                             on_push=fault_hook(args.shard, core))
    try:
        server, port = start_grpc(servicer, cfg.ps.ps_bind, args.port, max_bytes, workers,
                                  cfg.ps.ps_tls_cert, cfg.ps.ps_tls_key)
    except UsageError as e:
        print(f"ps.server: error: {e}", file=sys.stderr)
        return 2
    if args.ready_file:
        write_json(Path(args.ready_file), {"port": port, "pid": os.getpid(), "epoch": epoch,
                                           "fingerprint": shard_map.fingerprint})
    log(f"serving on {cfg.ps.ps_bind}:{port} (mode {cfg.ps.ps_mode}, {workers} workers, "
        f"epoch {epoch}, token {'required' if token else 'off'}, "
        f"tls {'on' if cfg.ps.ps_tls_cert else 'off'})")
    signal.signal(signal.SIGTERM, lambda *_: servicer.stop_event.set())
    while not servicer.stop_event.wait(0.1):
        pass
    server.stop(grace=0.2).wait(1.0)
    log("stopped")
    # Exit now: interpreter shutdown would join the gRPC pool's threads, and a pull parked
    # on a barrier holds one for up to --ps-timeout-s (the launcher would SIGKILL us first).
    # Nothing is lost: snapshots are written atomically while serving.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _num_workers(cfg) -> int:
    from jaxdist.mesh import parse_mesh

    shape = parse_mesh(cfg.mesh.mesh)
    if shape.size is None:
        raise UsageError("--layout ps needs an explicit mesh WORKERSxDEVICES (e.g. 4x1)")
    return shape.data


if __name__ == "__main__":
    sys.exit(main())

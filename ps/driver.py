"""`--layout ps` in one command: start K shard servers and W workers on 127.0.0.1, watch
them, tear everything down, and write the same results.json and TensorBoard events as the
other layouts, plus a `ps` block.

This process only launches and collects: it never starts a JAX backend (it reads shapes
through eval_shape), so it holds no device. Servers and workers are separate entry points
(`python -m ps.server`, `python -m ps.worker`) so a scheduler can place them instead; then
`python -m ps.driver --collect-only ...` assembles the results (see docs/ps.md).

Failure policy:
- a worker dies: async and ssp go on without it (it is retired on every shard so the ssp
  bound stops waiting for it) and results report it; sync stops with an error naming it,
  unless --ps-drop-dead-workers, where the shards drop it and go on.
- a shard dies: with --ps-checkpoint-every N it is restarted from its last snapshot, on a
  port of the system's choosing published in its ready file, and the workers carry on (their
  calls retry for --ps-timeout-s and read the ready file again); without, the run stops at
  once with an error naming the shard.
- whatever happens, every child process is stopped (jaxdist.procs); ps.launch holds them.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from jaxdist import procs
from jaxdist.errors import UsageError
from ps.collect import collect, format_ps
from ps.launch import Launch, gpu_count
from ps.security import TOKEN_ENV, run_token
from ps.shard_client import ShardClient


def run_ps(job, logdir: Path, log=print) -> dict:
    """A parameter-server run of `job` (jaxdist.job): start its shards and workers, watch
    them, collect their record into `logdir`."""
    from ps.shardmap import shard_map_for

    shape = job.shape
    psdir = Path(logdir) / "ps"
    psdir.mkdir(parents=True, exist_ok=True)
    shard_map = shard_map_for(job)
    if job.checkpoint.resume:  # checked already (validation): what it continues from
        from ps.resume import plan

        resume = plan(job)
    (psdir / "shard_map.json").write_text(json.dumps(shard_map.to_dict(), indent=1))
    # the run's settings, which a --resume of it must repeat (ps.resume)
    (psdir / "config.json").write_text(json.dumps(job.to_dict(), indent=1))
    log(f"ps: {shard_map.describe()}")
    if job.platform == "cpu" or gpu_count() < shape.size:
        log(f"No accelerator in use: each of the {shape.data} workers simulates "
            f"{shape.fsdp} host CPU device(s). Step times are functional, not performance "
            f"figures.")
    token, notice = run_token(os.environ, job.ps.ps_insecure)
    if notice:
        log(notice)
    launch = Launch(job, psdir, log, token)
    if job.checkpoint.resume:
        launch.resume = resume
        log(f"ps: resuming from the shards' snapshots of version(s) "
            f"{sorted(set(launch.resume['versions']))}: worker(s) start at step(s) "
            f"{sorted(set(launch.resume['start']))}")
    interrupted = None
    with procs.TerminationHandlers():
        try:
            launch.start_servers()
            launch.start_workers()
            launch.wait_servers()
            try:
                launch.watch()
            except (KeyboardInterrupt, SystemExit) as e:  # SystemExit: TerminationHandlers
                interrupted = "SIGINT" if isinstance(e, KeyboardInterrupt) else "SIGTERM"
                log(f"ps: interrupted by {interrupted}: each worker stops after its current "
                    f"step and writes what it measured")
                launch.stop_workers()  # a second Ctrl-C here stops at once, without results
            stats = launch.stats()
            for k, shard in enumerate(stats):  # a full disk under a shard: its path, once
                failed = [e for e in shard.get("events", ()) if "snapshot of version" in e]
                if failed:
                    log(f"ps: shard {k} (pid {shard.get('pid')}) could not write a "
                        f"snapshot: {failed[0]}")
        finally:
            procs.stop_all(launch.children)
    results = collect(job, logdir, stats, shard_map, launch, interrupted)
    log(format_ps(results))
    return results


# -- cluster use: collect results after scheduler-launched servers and workers ------------

def main(argv=None) -> int:
    """`python -m ps.driver --collect-only --servers H:P,... --logdir RUN <run flags>`:
    after workers started by a scheduler have written RUN/ps/worker<w>.json, fetch the
    shards' statistics, shut the shards down and write results.json + TensorBoard."""
    from jaxdist.config import add_arguments, from_namespace
    from jaxdist.errors import OneLineParser
    from jaxdist.job import for_process
    from ps.shardmap import shard_map_for

    parser = OneLineParser(prog="python -m ps.driver")
    parser.add_argument("--collect-only", action="store_true", required=True)
    parser.add_argument("--servers", required=True)
    parser.add_argument("--keep-servers", action="store_true",
                        help="do not shut the shard servers down")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        job = for_process(from_namespace(args))
        if not job.output.logdir:
            raise UsageError("--collect-only needs --logdir (where the workers wrote ps/)")
        shard_map = shard_map_for(job)
    except UsageError as e:
        print(f"ps.driver: error: {e}", file=sys.stderr)
        return 2
    stats = []
    for k, address in enumerate(args.servers.split(",")):
        client = ShardClient(k, address.strip(),
                             max_message_bytes=job.ps.ps_max_message_mb << 20,
                             timeout_s=job.ps.ps_timeout_s,
                             token=os.environ.get(TOKEN_ENV, ""),
                             tls_cert=job.ps.ps_tls_cert)
        stats.append(client.control("stats"))
        if not args.keep_servers:
            client.control("shutdown")
        client.close()
    collect(job, Path(job.output.logdir), stats, shard_map)
    print(f"results: {Path(job.output.logdir) / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

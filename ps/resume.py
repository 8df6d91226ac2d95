"""`--resume` of a PS run: continue a stopped run (killed, its launcher gone) in its own
--logdir from its shards' snapshots, as a mesh run continues from its Orbax checkpoints.

Each shard keeps its two newest snapshots (ps.snapshot), so shards killed between their
snapshots of one version still share one. The plan, checked before any process starts:
every shard of the job has a complete snapshot, made by a run of this job (the shard map's
fingerprint, the workers, the mode, each shard's size); sync mode resumes every shard from
the newest version all of them hold (a sync step is one version on every shard), async and
ssp each shard from its newest. Each worker starts at the step after the last one every
shard applied from it; the batches are those of the step (jaxdist.data's stream is by step),
so a sync run resumed has the losses of an unbroken one. Anything else is one line naming
what does not match.
"""

from __future__ import annotations

import json
from pathlib import Path

from jaxdist.errors import UsageError
from ps import snapshot


def plan(job) -> dict:
    """{"versions": the snapshot version each shard restores, "start": the first step of
    each worker, "psdir": the run's ps folder}; UsageError when there is nothing (of this
    job) to resume."""
    from ps.shardmap import shard_map_for

    if not job.output.logdir:
        raise UsageError("--resume of a --layout ps run needs --logdir: the stopped run's "
                         "folder, whose ps/snapshots it continues from")
    logdir = Path(job.output.logdir)
    psdir = logdir / "ps"
    shards, workers, mode = job.ps.ps_shards, job.shape.data, job.ps.ps_mode
    if (logdir / "results.json").exists():
        raise UsageError(f"--resume: --logdir {logdir} holds a run that ended (its "
                         f"results.json); there is nothing to resume")
    shard_map = shard_map_for(job)
    try:
        saved = json.loads((psdir / "shard_map.json").read_text())
    except (OSError, ValueError):
        saved = None
    if not isinstance(saved, dict) or "fingerprint" not in saved:
        raise UsageError(f"--resume: {psdir} holds no parameter-server run (no readable "
                         f"shard_map.json); give --logdir of a stopped --layout ps run")
    if saved["fingerprint"] != shard_map.fingerprint:
        raise UsageError(f"--resume: the snapshots in {psdir} are of another job (shard map "
                         f"{saved['fingerprint']}, this job's {shard_map.fingerprint}: model, "
                         f"--ps-shards or sharding differ); resume with that run's flags")
    there = sorted(p.name for p in (psdir / "snapshots").glob("shard*"))
    want = [f"shard{k}" for k in range(shards)]
    if there != want:
        raise UsageError(f"--resume: {psdir / 'snapshots'} holds {', '.join(there) or 'no '}"
                         f"{' ' if there else ''}snapshot folders, this job has {shards} "
                         f"shard(s); resume with that run's --ps-shards (and "
                         f"--ps-checkpoint-every N, which wrote them)")
    held = []
    for k in range(shards):
        versions = snapshot.versions(psdir / "snapshots" / f"shard{k}")
        if not versions:
            raise UsageError(f"--resume: shard {k} has no complete snapshot in "
                             f"{psdir / 'snapshots' / f'shard{k}'}; nothing to resume")
        held.append(versions)
    if mode == "sync":
        common = set.intersection(*map(set, held))
        if not common:
            raise UsageError(f"--resume: the shards' snapshots share no version "
                             f"({'; '.join(f'shard {k}: {v}' for k, v in enumerate(held))}); "
                             f"a sync run resumes every shard from the same step")
        versions = [max(common)] * shards
    else:
        versions = [v[-1] for v in held]
    last = [[-1] * workers for _ in range(shards)]
    for k, version in enumerate(versions):
        meta = snapshot.meta_of(psdir / "snapshots" / f"shard{k}", version)
        size = shard_map.bytes_per_shard[k] // 4
        differs = [f"{what} {got!r}, this job's {want!r}" for what, got, want in (
            ("mode", meta.get("mode"), mode), ("workers", meta.get("num_workers"), workers),
            ("parameters", meta.get("size"), size)) if got != want]
        if differs:
            raise UsageError(f"--resume: shard {k}'s snapshot of version {version} is of "
                             f"another job ({'; '.join(differs)}); resume with that run's "
                             f"flags")
        last[k] = list(meta["last_step"])
    differs = _settings_changed(psdir / "config.json", job.cfg)
    if differs:
        raise UsageError(f"--resume: {psdir} is a run with other settings "
                         f"({'; '.join(differs)}); resume it with its own flags")
    start = [min(last[k][w] for k in range(shards)) + 1 for w in range(workers)]
    total = job.loop.warmup + job.loop.steps
    if min(start) >= total:
        raise UsageError(f"--resume: the snapshots in {psdir / 'snapshots'} are at step "
                         f"{min(start)} of {total}: nothing is left to run")
    return {"versions": versions, "start": start, "psdir": psdir}


# What a resume may change: how its processes are reached and watched, not what they train.
FREE = {"resume", "progress", "logdir", "ps_timeout_s", "ps_port", "ps_bind", "ps_tls_cert",
        "ps_tls_key", "ps_transport", "ps_insecure", "ps_checkpoint_every",
        "ps_max_message_mb", "ps_drop_dead_workers"}


def _settings_changed(saved_path: Path, cfg) -> list[str]:
    """"--lr was 0.01, now 0.02" for each training setting that differs from the stopped
    run's (its ps/config.json; none to compare if it has none)."""
    try:
        saved = json.loads(saved_path.read_text())
    except (OSError, ValueError):
        return []
    now = json.loads(json.dumps(cfg.to_dict()))
    return [f"--{name.replace('_', '-')} was {saved[section][name]!r}, now {value!r}"
            for section, fields in now.items() if isinstance(saved.get(section), dict)
            for name, value in fields.items()
            if name not in FREE and name in saved[section] and saved[section][name] != value]

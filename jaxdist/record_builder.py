"""The one builder of results.json, used by every producer (jaxdist.run_record for mesh runs,
ps.collect for parameter-server runs, experiments.torch_run for the PyTorch reference): the
schema's blocks (jaxdist.record.SCHEMA, docs/results.md) in one order, then the producer's
own. The schema, the checker and the reader are jaxdist.record."""

from __future__ import annotations

from jaxdist.record import SCHEMA_VERSION


def build(framework: str, layout: str, mesh: dict, config: dict, model_cfg, params: int, *,
          env: dict,
          compile_s: float | None, step_time_s: dict, warmup_step_time_s: list,
          throughput: dict, mfu: dict, memory: dict, sharding: dict, loss: list,
          comm: dict | None, power: dict, window: dict, steps_done: int | None = None,
          interrupted: dict | None = None, **own) -> dict:
    """A results.json record: the schema's blocks (SCHEMA, docs/results.md) in one order,
    then the producer's own (`own`: `comm_reason`, `pipeline`, `program`, `ps`, `torch`,
    ...). `config` is the run's config as recorded (its to_dict). `steps_done`
    defaults to every step's loss; `interrupted` (the signal, the steps planned) makes the
    status `interrupted`."""
    return {
        **header(framework, layout, mesh, config, model_cfg, params),
        "status": "interrupted" if interrupted else "complete",
        "steps_done": len(loss) if steps_done is None else steps_done,
        "interrupted": interrupted,
        "env": env, "compile_s": compile_s, "step_time_s": step_time_s,
        "warmup_step_time_s": warmup_step_time_s, "throughput": throughput, "mfu": mfu,
        "memory": memory, "sharding": sharding, "loss": loss, "comm": comm, "power": power,
        "window": window, **own}


def header(framework: str, layout: str, mesh: dict, config: dict, model_cfg,
           params: int) -> dict:
    """What the run is: schema_version, framework, layout (and its facts), mesh, model,
    config."""
    return {"schema_version": SCHEMA_VERSION, "framework": framework, "layout": layout,
            **facts_of(layout), "mesh": mesh,
            "model": {"name": config["model"]["model"], "params": params,
                      "flops_per_sample": model_cfg.flops_per_sample(),
                      "tokens_per_sample": model_cfg.tokens_per_sample,
                      # image models: their input side in pixels (readers match on it)
                      "image_size": getattr(model_cfg, "image_size", None),
                      # the pieces the sequence-parallel collectives ran in, and of what
                      "tp_comm_chunks": getattr(model_cfg, "tp_comm_chunks", None),
                      "tp_comm_split": getattr(model_cfg, "tp_comm_split", None)},
            "config": config}


def stopped_in_setup(layout: str, mesh: dict, config: dict, signal: str, phase: str,
                     steps_done: int, steps_planned: int) -> dict:
    """The record of a run a signal stopped before its first step (during `phase`: the model
    build, the state's init or restore, tracing the step, XLA's compile): what the run was,
    `"status": "interrupted"`, the phase and the steps done; no figure, since nothing ran
    (record.STOPPED_IN_SETUP is its schema)."""
    return {"schema_version": SCHEMA_VERSION, "framework": "jax", "layout": layout,
            **facts_of(layout), "mesh": mesh, "model": {"name": config["model"]["model"]},
            "config": config,
            "status": "interrupted", "steps_done": steps_done,
            "interrupted": {"signal": signal, "received_here": True, "phase": phase,
                            "steps_planned": steps_planned, "timed_steps": 0},
            "step_time_s": {"n": 0, "reason": f"stopped by {signal} during {phase}, before "
                                              f"step {steps_done + 1}: no step was run"},
            "loss": []}


def facts_of(layout: str) -> dict:
    """`layout_facts`: what the layout registry says of the layout (what runs out of
    process, what is pipelined, ...), so that readers of the record, which import no jax,
    ask the facts and not the name; nothing for a name that is no layout here."""
    from sharding.registry import recorded_facts
    got = recorded_facts(layout)
    return {} if got is None else {"layout_facts": got}


def throughput_block(batch: int, tokens_per_sample: int | None, mean_s: float | None) -> dict:
    """Samples (and tokens) per second at the mean step time; null with no timed step."""
    return {"samples_per_s": batch / mean_s if mean_s else None,
            "tokens_per_s": batch * tokens_per_sample / mean_s
            if mean_s and tokens_per_sample else None}


def memory_block(by_device: list[dict], compiled: dict | None, measured_peak: int | None,
                 measured_peak_reason: str | None, **own) -> dict:
    """State bytes on every device (and on the fullest), XLA's allocation bound, and the
    allocator's peak where the backend has one (else why not); then the producer's own."""
    return {"state_bytes_per_device": max(d["bytes"] for d in by_device),
            "state_bytes_by_device": by_device, "compiled": compiled,
            "measured_peak_bytes": measured_peak, "measured_peak_reason": measured_peak_reason,
            **own}

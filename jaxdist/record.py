"""results.json, a run's record, in one place: its schema (documented in docs/results.md), a
checker, `read_results`, the one parse of the file, and `RunRecord`, the typed read view over
it that every reader uses (the report, compare, the suite, the tests); the one builder every
producer writes with is jaxdist.record_builder. Imports no jax: readers start without it."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

SCHEMA_VERSION = 1

NUM = (int, float)
OPT_NUM = (int, float, type(None))
LOSS = OPT_NUM  # a loss that was not finite is null in results.json (strict JSON)

# key -> expected type, or a nested spec dict. Extra keys are allowed (later issues add
# blocks); missing keys and wrong types are not.
SCHEMA = {
    "schema_version": int,
    "framework": str,
    "layout": str,
    "mesh": dict,
    "model": {"name": str, "params": int, "flops_per_sample": NUM, "tokens_per_sample": int},
    "config": dict,
    "env": {"jax_version": str, "backend": str, "device_kind": str, "num_devices": int,
            "num_processes": int, "simulated": bool},
    "compile_s": OPT_NUM,  # null where nothing is compiled (eager PyTorch): not 0.0
    "step_time_s": {"n": int, "mean": NUM, "std": NUM, "p50": NUM, "p90": NUM, "p99": NUM,
                    "min": NUM, "max": NUM, "ci95": OPT_NUM},
    "warmup_step_time_s": list,
    "throughput": {"samples_per_s": NUM, "tokens_per_s": OPT_NUM},
    "mfu": {"value": OPT_NUM, "hfu": OPT_NUM, "peak_flops_per_device": OPT_NUM,
            "model_flops_per_step": NUM, "compiled_flops_per_step": OPT_NUM,
            "reason": (str, type(None))},
    "memory": {"state_bytes_per_device": int, "state_bytes_by_device": list,
               "compiled": (dict, type(None)), "measured_peak_bytes": OPT_NUM},
    "sharding": {"sharded_bytes": int, "replicated_bytes": int, "replicated_leaves": int,
                 "parts": dict},
    "loss": list,
    "power": {"available": bool},
}

COMPILED = {"argument_bytes": int, "output_bytes": int, "alias_bytes": int,
            "temp_bytes": int, "peak_bytes": int, "peak_bytes_note": str}
PREDICTION = {False: {"label": str, "reason": str}, True: {  # optional: jaxdist.predict.inrun
    "label": str, "hardware": str, "source": str, "compile_s": NUM, "predicted": {"step_s": NUM},
    "measured_over_predicted": {"step_s": OPT_NUM, "memory": OPT_NUM}}}

# A run interrupted before its first timed step has no latency figures: null, with a reason.
INTERRUPTED = dict(SCHEMA,
                   step_time_s={"n": int, "reason": str},
                   throughput={"samples_per_s": OPT_NUM, "tokens_per_s": OPT_NUM})


# A run a signal stopped before its first step (jaxdist.record_builder.stopped_in_setup):
# what it was, the phase and the steps done, nothing measured.
STOPPED_IN_SETUP = {
    "schema_version": int, "framework": str, "layout": str, "mesh": dict,
    "model": {"name": str}, "config": dict, "status": str, "steps_done": int,
    "interrupted": {"signal": str, "phase": str, "steps_planned": int},
    "step_time_s": {"n": int, "reason": str}, "loss": list}


def check(results: dict) -> list[str]:
    """Problems with `results` against the schema; empty when it conforms."""
    timed = _block(results, "step_time_s").get("n")
    stopped = results.get("status") == "interrupted" and not timed
    spec = (STOPPED_IN_SETUP if stopped and "phase" in _block(results, "interrupted")
            else INTERRUPTED if stopped else SCHEMA)
    problems = _check(results, spec, "") + _status_problems(results)
    compiled = _block(results, "memory").get("compiled")
    if isinstance(compiled, dict):
        problems += _check(compiled, COMPILED, "memory.compiled.")
    if isinstance(p := results.get("prediction"), dict):
        problems += _check(p, PREDICTION.get(p.get("available"), {"available": bool}), "prediction.")
    return problems + _loss_problems(results)


def _block(results: dict, key: str) -> dict:
    """results[key] where it is an object, else {} (its wrong type is _check's to report:
    a hand-edited record must get its problems listed, not an AttributeError)."""
    value = results.get(key)
    return value if isinstance(value, dict) else {}


def _status_problems(results: dict) -> list[str]:
    if results.get("status") not in (None, "complete", "interrupted"):
        return [f"status: expected complete or interrupted, got {results['status']!r}"]
    return []


def _loss_problems(results: dict) -> list[str]:
    loss = results.get("loss")
    if isinstance(loss, list) and not all(isinstance(x, LOSS) for x in loss):
        return ["loss: every entry must be a number, or null where it was not finite"]
    return []


def check_types(results: dict) -> list[str]:
    """What a lenient read (a record from before some field existed) still needs: every
    field the schema knows, where present and not null, of the schema's type, so that the
    readers (this module's RunRecord) never meet a number where they read an object."""
    present = _present(results, SCHEMA)
    return (_check(present, _spec_of(present, SCHEMA), "") + _status_problems(results)
            + _loss_problems(results))


def _present(obj: dict, spec: dict) -> dict:
    """`obj` less the fields `spec` names that are missing or null, at every depth."""
    out = {}
    for key, value in obj.items():
        if key in spec and value is None:
            continue
        if isinstance(spec.get(key), dict) and isinstance(value, dict):
            value = _present(value, spec[key])
        out[key] = value
    return out


def _spec_of(obj: dict, spec: dict) -> dict:
    """`spec` restricted to the fields `obj` has."""
    return {k: _spec_of(obj[k], kind) if isinstance(kind, dict) and isinstance(obj[k], dict)
            else kind for k, kind in spec.items() if k in obj}


def _check(obj: dict, spec: dict, prefix: str) -> list[str]:
    problems = []
    for key, kind in spec.items():
        if key not in obj:
            problems.append(f"{prefix}{key}: missing")
        elif isinstance(kind, dict):
            if not isinstance(obj[key], dict):
                problems.append(f"{prefix}{key}: expected an object")
            else:
                problems += _check(obj[key], kind, f"{prefix}{key}.")
        elif isinstance(obj[key], bool) and kind in (int, NUM, OPT_NUM):
            problems.append(f"{prefix}{key}: expected a number, got a boolean")
        elif not isinstance(obj[key], kind):
            names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple)
                                                     else (kind,)))
            problems.append(f"{prefix}{key}: expected {names}, got {type(obj[key]).__name__}")
    return problems


def mesh_spec(mesh: dict) -> str:
    """A recorded mesh as `--mesh` takes it back: `4x8`, `2x2x2`, `8` (data only); with a
    stage axis (it has no short position before the fifth) or a context axis named:
    `data:2,stage:4,tensor:2`
    (data and every axis over 1). ps meshes (workers x devices) as sizes joined."""
    if mesh.get("stage", 1) > 1 or mesh.get("context", 1) > 1:
        return ",".join(f"{a}:{mesh[a]}" for a in ("data", "fsdp", "stage", "context", "tensor",
                                                    "expert")
                        if a in mesh and (mesh[a] > 1 or a == "data"))
    if list(mesh) == ["data", "fsdp"] and mesh["fsdp"] == 1:  # `--mesh 8`, as typed
        return str(mesh["data"])
    return "x".join(str(v) for v in mesh.values())


def pipeline_schedule(pp: dict) -> str:
    """A pipeline block's schedule as runs are named by it: `1f1b`, `interleaved-v2`,
    `1f1b-combined`."""
    v = pp.get("virtual", 1)
    return pp["schedule"] + (f"-v{v}" if v > 1 else "") + \
        ("-combined" if pp.get("combined_f_back") else "")


# ---------------------------------------------------------------------------- reading

# What a PyTorch run made before `config.model.matmul_precision` was recorded ran at.
PYTORCH_UNRECORDED = "not recorded (PyTorch's default: float32 matmuls, TF32 convolutions)"
# GPUs without TF32 tensor cores: float32 stays float32 at every precision.
PRE_AMPERE = ("V100", "T4", "P100", "P40", "K80")
MEASURED, COMPILER_BOUND = "measured", "compiler bound, not measured"


class RecordError(ValueError):
    """A file that is not a run's results.json."""


def layout_facts(results: dict) -> dict:
    """What a run's layout is (`layout_facts`, written from the layout registry by
    jaxdist.record_builder; docs/results.md). A record without the block, read leniently
    from itself: a parameter-server run's mesh counts workers, a pipeline's record has a
    `pipeline` block, a replicated state has no sharded bytes."""
    got = results.get("layout_facts")
    if isinstance(got, dict):
        return {**LAYOUT_FACTS, **got}
    mesh, sharding = results.get("mesh") or {}, results.get("sharding") or {}
    workers = isinstance(mesh, dict) and "workers" in mesh
    return {**LAYOUT_FACTS, "out_of_process": workers,
            "pipelined": isinstance(results.get("pipeline"), dict),
            "replicated": workers or sharding.get("sharded_bytes") == 0}


LAYOUT_FACTS = {"out_of_process": False, "pipelined": False, "replicated": False,
                "distributed_optimizer": False}


def results_file(path) -> Path:
    """`path` itself, or the results.json in it where it is a run directory."""
    path = Path(path)
    return path / "results.json" if path.is_dir() else path


def read_results(path, standard: bool = False) -> dict:
    """The object in a results.json (`path`, or the run directory holding one), unchecked:
    the one parse of a run's record, for readers that take any record as it is (a partial or
    hand-edited one included); RunRecord.load checks it. RecordError when it is not JSON or
    not an object; with `standard`, also where it has a token standard JSON lacks (NaN,
    Infinity), which results.json never holds."""

    def refuse(token):
        raise ValueError(f"{token} is not standard JSON")

    try:
        results = json.loads(results_file(path).read_text(),
                             **({"parse_constant": refuse} if standard else {}))
    except (ValueError, UnicodeDecodeError) as e:
        raise RecordError(f"not JSON ({e})") from None
    if not isinstance(results, dict):
        raise RecordError("not a jaxdist results.json (not an object)")
    return results


@dataclass(frozen=True)
class RunRecord:
    """One run's results.json, read: every figure a reader wants, named once. Properties read
    `results` live (a missing block reads as None, never a KeyError)."""

    path: Path                    # the run directory
    results: dict
    name: str = ""                # how reports name the run (default: the directory name)
    step_times: tuple = ()        # per timed step, seconds (TensorBoard), when read
    step_times_source: str = "none"

    def __post_init__(self):
        if not self.name:
            object.__setattr__(self, "name", Path(self.path).name)

    @classmethod
    def load(cls, path, name: str = "", require_valid: bool = False) -> "RunRecord":
        """Read `path` (a results.json, or the run directory holding one). RecordError when
        it is not JSON or not a run's record (with `require_valid`: any schema problem)."""
        file = results_file(path)
        results = read_results(file)
        problems = check(results) if require_valid else (
            [] if "step_time_s" in results or results.get("status") == "interrupted"
            else ["step_time_s: missing"]) + check_types(results)
        if problems:
            raise RecordError(f"not a jaxdist results.json ({problems[0]})")
        return cls(file.parent, results, name)

    def cfg(self, section: str, key: str, default=None):
        return ((self.results.get("config") or {}).get(section) or {}).get(key, default)

    def _block(self, key: str) -> dict:
        return self.results.get(key) or {}

    def block(self, key: str) -> dict:
        """results.json's block `key` as recorded ({} where the run has none)."""
        return self._block(key)

    # -- what a run is
    @property
    def status(self) -> str:
        """complete or interrupted (a record from before `status` is complete)."""
        return self.results.get("status") or "complete"

    @property
    def framework(self) -> str:
        return "pytorch" if self.results.get("framework") == "pytorch" else "jax"

    @property
    def layout(self) -> str:
        """As recorded: ddp, zero1, fsdp, hsdp, tp, fsdp_tp, ep or ps."""
        return self.results.get("layout", "?")

    @property
    def out_of_process(self) -> bool:
        """The layout ran in processes of its own (the parameter server): `layout_facts`."""
        return layout_facts(self.results)["out_of_process"]

    @property
    def replicated(self) -> bool:
        """Every device (every worker) held the whole train state: `layout_facts`."""
        return layout_facts(self.results)["replicated"]

    @property
    def ps_mode(self) -> str | None:
        if not self.out_of_process:
            return None
        return self._block("ps").get("mode") or self.cfg("ps", "ps_mode", "sync")

    @property
    def layout_mode(self) -> str:
        """The layout, parameter-server runs by mode: ps-sync / ps-async / ps-ssp
        (+slr: staleness-scaled learning rate)."""
        if not self.out_of_process:
            return self.layout
        mode = self.ps_mode
        slr = self._block("ps").get("staleness_lr", self.cfg("ps", "ps_staleness_lr", False))
        return f"ps-{mode}" + ("+slr" if slr and mode != "sync" else "")

    @property
    def variant(self) -> str:
        """Step options that change what a step does: the pipeline schedule (1f1b,
        interleaved-v2), remat-X, mbN, overlap ('' for none)."""
        pp = self._block("pipeline")
        parts = [pipeline_schedule(pp)] if pp.get("schedule") else []
        remat = self.cfg("train", "remat", "none")
        if remat and remat != "none":
            parts.append(f"remat-{remat}")
        mb = self.cfg("train", "microbatches", 1) or 1
        if mb > 1:
            parts.append(f"mb{mb}")
        if self.cfg("compiler", "overlap") or self.cfg("train", "overlap"):  # older records
            parts.append("overlap")
        return "+".join(parts)

    @property
    def group(self) -> str:
        return self.layout_mode + (f" {self.variant}" if self.variant else "")

    @property
    def model_name(self) -> str:
        return self._block("model").get("name", "?")

    @property
    def model(self) -> str:
        """The model with its overrides: `resnet-tiny[width=8]`."""
        opts = self.cfg("model", "model_opts", "")
        return self.model_name + (f"[{opts}]" if opts else "")

    @property
    def mesh(self) -> str:
        """As `--mesh` takes it: `4x8`, `data:2,stage:4` (mesh_spec)."""
        return mesh_spec(self.results.get("mesh") or {}) or "?"

    @property
    def bar(self) -> str:
        """A figure's label for the run: `layout @ mesh` (variant included)."""
        return f"{self.group} @ {self.mesh}"

    @property
    def devices(self) -> int | None:
        n = self._block("env").get("num_devices")
        if n is None and self.results.get("mesh"):
            n = math.prod(self.results["mesh"].values())
        return n

    @property
    def batch(self) -> int | None:
        """The global batch."""
        return self.cfg("train", "batch_size")

    dtype = property(lambda self: self.cfg("model", "dtype", "float32"))
    optimizer = property(lambda self: self.cfg("train", "optimizer"))
    dataset = property(lambda self: self.cfg("data", "dataset"))
    lr = property(lambda self: self.cfg("train", "lr"))
    seed = property(lambda self: self.cfg("train", "seed"))
    microbatches = property(lambda self: self.cfg("train", "microbatches"))
    remat = property(lambda self: self.cfg("train", "remat"))
    overlap = property(lambda self: self.cfg("compiler", "overlap"))
    params = property(lambda self: self._block("model").get("params"))

    @property
    def fp8_scaling(self) -> str | None:
        """FP8's scaling, for an FP8 run only."""
        return self.cfg("model", "fp8_scaling") if self.dtype == "float8" else None

    @property
    def grad_reduce_dtype(self) -> str | None:
        """Where the distributed optimizer reduces bfloat16 working weights' gradients: only
        such a run has one."""
        if self.results.get("distributed_optimizer") and self.dtype != "float32":
            return self.cfg("train", "grad_reduce_dtype", "float32")
        return None

    @property
    def schedule(self) -> str | None:
        """A pipeline's schedule (`1f1b`, `interleaved-v2`), else None."""
        pp = self._block("pipeline")
        return pipeline_schedule(pp) if pp else None

    @property
    def steps(self) -> str | None:
        """The steps run, warm-up included (`23`); an interrupted run's against those
        planned (`18 of 303`), as its one-line message says."""
        done = self.results.get("steps_done")
        if done is None:
            done = len(self.results.get("loss") or []) or None
        if done is None:
            return None
        planned = self._block("interrupted").get("steps_planned")
        return f"{done} of {planned}" if planned else str(done)

    @property
    def matmul_precision(self) -> str:
        """--matmul-precision. Runs made before it was recorded ran at their framework's
        default: XLA's (what "default" selects) for JAX; PyTorch's own (float32 matmuls, TF32
        convolutions), which no value of the flag reproduces, for PyTorch."""
        recorded = self.cfg("model", "matmul_precision")
        if recorded:
            return recorded
        return "default" if self.framework == "jax" else PYTORCH_UNRECORDED

    @property
    def backend(self) -> str | None:
        b = self._block("env").get("backend")
        return "gpu" if b in ("gpu", "cuda") else b

    device_kind = property(lambda self: self._block("env").get("device_kind"))
    simulated = property(lambda self: bool(self._block("env").get("simulated")))

    def precision_class(self) -> str:
        """The arithmetic of float32 matmuls as published records name it: float32 compute at
        default/high precision on an Ampere or newer GPU is TF32."""
        if (self.dtype == "float32" and self.backend == "gpu" and
                self.matmul_precision in ("default", "high") and
                not any(old in (self.device_kind or "").upper() for old in PRE_AMPERE)):
            return "tf32"
        return self.dtype

    # -- what a run measured
    def step_p(self, q: str):
        """A statistic of the timed steps' latency (p50, p99, mean, n, ...), seconds."""
        return self._block("step_time_s").get(q)

    step_p50 = property(lambda self: self.step_p("p50"))
    step_p99 = property(lambda self: self.step_p("p99"))

    samples_per_s = property(lambda self: self._block("throughput").get("samples_per_s"))
    tokens_per_s = property(lambda self: self._block("throughput").get("tokens_per_s"))
    mfu = property(lambda self: self._block("mfu").get("value"))
    hfu = property(lambda self: self._block("mfu").get("hfu"))
    comm_ring_bytes = property(lambda self: self._block("comm").get("total_ring_bytes"))

    @property
    def state_bytes(self):
        """Exact bytes of train-state shards on the fullest device."""
        return self._block("memory").get("state_bytes_per_device")

    @property
    def compiled_bound(self):
        """XLA's allocation bound for the step (argument + output - alias + temp): an upper
        bound, not a measured peak."""
        return (self._block("memory").get("compiled") or {}).get("peak_bytes")

    @property
    def measured_peak(self):
        return self._block("memory").get("measured_peak_bytes")

    @property
    def peak(self):
        """Peak bytes per device: measured where the backend reports it, else the compiler's
        bound (an upper bound; `peak_basis` says "compiler bound, not measured"), else None."""
        return self.measured_peak if self.measured_peak is not None else self.compiled_bound

    @property
    def peak_basis(self) -> str:
        if self.measured_peak is not None:
            return MEASURED
        if self.compiled_bound is not None:
            return COMPILER_BOUND
        return self._block("memory").get("measured_peak_reason") or "not measured"

    @property
    def prediction(self) -> dict | None:  # the time model's, when available (predicted)
        return self._block("prediction") if self._block("prediction").get("available") else None

    @property
    def energy_per_sample(self):
        power = self._block("power")
        return power.get("energy_per_sample_j") if power.get("available") else None

    @property
    def energy_per_step(self):
        power = self._block("power")
        return power.get("energy_per_step_j") if power.get("available") else None

    accuracy = property(lambda self: self.results.get("accuracy") or [])

    @property
    def final_accuracy(self):
        return self.accuracy[-1]["accuracy"] if self.accuracy else None

    @property
    def loss(self) -> list:
        """Per step; a diverged step's null (results.json is strict JSON) read as nan."""
        return [math.nan if x is None else x for x in self.results.get("loss") or []]

    @property
    def train_time(self):
        """Wall time of the timed steps: the window span, else mean x n."""
        w = self._block("window")
        if w.get("start_unix_s") and w.get("end_unix_s"):
            return w["end_unix_s"] - w["start_unix_s"]
        mean, n = self.step_p("mean"), self.step_p("n")
        return mean * n if mean is not None and n else None

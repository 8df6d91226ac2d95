"""The step's time read from the XLA:GPU program kernel by kernel, in schedule order.

Each kernel (jaxdist.program.kernels.schedule) costs max(FLOPs / the achievable rate of its kind and
dtype, bytes / the achievable HBM rate) + one launch: GEMM fusions and cuBLAS calls at the
part's achievable dense matmul rate, cuDNN attention at its forward / backward rate for its
sequence length, everything else at the streaming HBM rate (jaxdist.parts: published
microbenchmarks, each cited), all scaled by the generation's one fitted number, the kernel
efficiency (jaxdist.hardware.MODEL_CONSTANTS, fitted on one named record). Each collective costs what
jaxdist.predict.time_model.collective_time says (NCCL's ring: bandwidth by link, latency per
step), and an async one is hidden only behind the kernels XLA's latency-hiding scheduler
placed between its `-start` and its `-done`; what the kernels there do not cover is exposed.
Loop bodies count their trip count; a conditional's branches count as often as the caller
says they run (`branch_runs`), else every time (flagged).
"""

from __future__ import annotations

import bisect
import dataclasses

from jaxdist.figures import Figures
from jaxdist.program import kernels
from jaxdist.hardware import constant, kernel_efficiency, rates_part
from jaxdist.parts import ANY_DTYPE, Part, attention_curve, rate
from jaxdist.predict.time_model import collective_time

GEMM_KINDS = ("gemm fusion (Triton)", "gemm (cuBLAS)", "unfused dot", "unfused convolution",
              "unfused ragged-dot", "cuDNN fusion")


@dataclasses.dataclass(frozen=True)
class KernelTime(Figures):
    """Seconds per step of an XLA:GPU program per device, kernel by kernel: its kernels'
    compute-bound, memory-bound and launch time (`device_s` their sum, with the host copies
    no kernel hid), each link's collective time and the part of it the schedule leaves
    exposed (`head_*`: of that, before the step's first matmul), host copies (remat
    offload), seconds per kernel kind, and where each rate comes from."""
    device_s: float
    compute_s: float
    hbm_s: float
    launch_s: float
    intra_node_s: float
    inter_node_s: float
    exposed_intra_node_s: float
    exposed_inter_node_s: float
    host_transfer_s: float
    exposed_host_transfer_s: float
    comm_exposed_s: float
    step_s: float
    head_exposed_intra_node_s: float
    head_exposed_inter_node_s: float
    upper_bound: bool
    by_kind: dict[str, float]
    rates: dict[str, str]
    kernel_efficiency: float

    # the terms in seconds: sums over kernels, each a line in depth (jaxdist.predict.depth)
    SECONDS = ("device_s", "compute_s", "hbm_s", "launch_s", "intra_node_s", "inter_node_s",
               "exposed_intra_node_s", "exposed_inter_node_s", "host_transfer_s",
               "exposed_host_transfer_s", "comm_exposed_s", "step_s",
               "head_exposed_intra_node_s", "head_exposed_inter_node_s")


def is_matmul(kernel: dict) -> bool:
    """A GEMM or attention kernel: the work a model's blocks repeat."""
    return kernel["kind"] in GEMM_KINDS or kernel["kind"].startswith("attention")


def has_rates(hw: Part) -> bool:
    """Whether the part has every published rate this model needs; else the roofline model
    (jaxdist.predict.time_model.step_time) times the program."""
    try:
        Rates(hw)
    except KeyError:
        return False
    return True


class Rates:
    """The part's achievable rates, looked up once."""

    def __init__(self, hw: Part):
        self.hw = hw
        # The one fitted number of the generation scales every rate (not the launch cost); a
        # part that carries over a sibling's published rates scales them by its clock under
        # its power cap (compute) and its HBM bandwidth (streaming): jaxdist.hardware.rates_part
        part, clock, hbm = rates_part(hw)
        k = self.efficiency = kernel_efficiency(hw)
        self.clock_factor = clock
        self.gemm_bf16 = k * clock * rate(part, "gemm", "bfloat16").value
        try:  # FP8 GEMMs at their own measured rate where one is published
            fp8 = rate(part, "gemm", "float8")
        except KeyError:
            fp8 = None
        self.gemm_fp8 = k * clock * fp8.value if fp8 else None
        self.hbm = k * hbm * rate(part, "hbm_copy", ANY_DTYPE).value
        self.launch = rate(part, "launch", ANY_DTYPE).value
        # copies between HBM and host memory (an offloading remat policy's) ride PCIe
        self.host = constant(f"host_link_bandwidth_{hw.efficiency}") * \
            constant("link_efficiency")
        self.attention = {kind: k * clock * rate(part, kind, "bfloat16").value
                          for kind in ("attention_fwd", "attention_bwd")}
        self.curve = tuple((n, k * clock * f, k * clock * b) for n, f, b in
                           attention_curve(part, "bfloat16"))
        cap = f" under the {hw.power_cap_w:g} W cap" if hw.power_cap_w else ""
        scaled = "" if part == hw.name else (
            f" ({part}'s rate x {clock:.3f}, its clock{cap}, for compute; x {hbm:.3f}, the "
            f"HBM bandwidth ratio, for streaming)")
        self.sources = {k: rate(part, k, d).source + scaled for k, d in
                        (("gemm", "bfloat16"), ("hbm_copy", ANY_DTYPE),
                         ("launch", ANY_DTYPE), ("attention_fwd", "bfloat16"),
                         ("attention_bwd", "bfloat16"))}
        if fp8:
            self.sources["gemm_float8"] = fp8.source + scaled

    def gemm(self, dtype: str, precision: str) -> float:
        """bf16 (and f16) at the measured rate; FP8 at its own measured rate where one is
        published (FP8 GEMMs reach a smaller fraction of their peak than bf16 ones); float32
        (TF32 or FP32 by --matmul-precision), and FP8 without a measured rate, at bf16's
        fraction of their own peak."""
        if dtype in ("bfloat16", "float16"):
            return self.gemm_bf16
        if dtype == "float8" and self.gemm_fp8:
            return self.gemm_fp8
        peak16 = self.hw.peak_flops("bfloat16")
        if dtype == "float8":  # no FP8 peak: the bf16 rate (plans refuse such a part)
            peak8 = self.hw.fp8_peak_flops()
            return self.gemm_bf16 * peak8 / peak16 if peak8 and peak16 else self.gemm_bf16
        peak32 = self.hw.peak_flops("float32", precision)
        return self.gemm_bf16 * peak32 / peak16 if peak32 and peak16 else self.gemm_bf16

    def attention_rate(self, backward: bool, seq: int | None) -> float:
        kind = "attention_bwd" if backward else "attention_fwd"
        if not self.curve or seq is None:
            return self.attention[kind]
        lengths = [p[0] for p in self.curve]
        i = min(bisect.bisect_left(lengths, seq), len(lengths) - 1)
        return self.curve[i][2 if backward else 1]

    def kernel(self, item: dict, precision: str) -> tuple[float, str]:
        """(seconds, what bounds it: "compute" or "HBM") of one kernel launch."""
        kind = item["kind"]
        memory = item["bytes"] / self.hbm
        if kind in GEMM_KINDS and item["flops"]:
            compute = item["flops"] / self.gemm(item["dtype"], precision)
        elif kind.startswith("attention (cuDNN)"):
            compute = item["flops"] / self.attention_rate(kind.endswith("backward"),
                                                          item["seq"])
        else:
            compute = 0.0
        return max(compute, memory) + self.launch, "compute" if compute > memory else "HBM"


def step_time(hlo_text: str, collectives: list[dict], hw: Part, mesh: dict[str, int],
              precision: str = "default",
              branch_runs: dict[str, float] | None = None) -> KernelTime:
    """Seconds per step of the program, per device, kernel by kernel."""
    program = kernels.schedule(hlo_text)
    r = Rates(hw)
    comm = {}  # instruction name -> (seconds per run, link)
    for op in collectives:
        one = {**op, "count": 1, "ring_bytes": op["ring_bytes"] / max(op["times"], 1e-12)}
        t = collective_time(one, hw, mesh)
        comm[op["name"]] = (t.seconds, t.link)
        comm.setdefault(f"@{op['computation']}", (t.seconds, t.link))
    totals = {"compute_s": 0.0, "hbm_s": 0.0, "launch_s": 0.0, "intra-node": 0.0,
              "inter-node": 0.0, "exposed intra-node": 0.0, "exposed inter-node": 0.0,
              "host": 0.0, "exposed host": 0.0, "head intra-node": 0.0,
              "head inter-node": 0.0, "head host": 0.0}
    by_kind: dict[str, float] = {}
    flags = {"upper_bound": False}
    matmul_work: dict[str, bool] = {}

    def does_matmuls(name: str, depth: int = 0) -> bool:
        """Whether computation `name` runs a GEMM or attention kernel, itself or in a callee."""
        if name not in matmul_work:
            matmul_work[name] = depth <= 50 and any(
                (item["item"] == "kernel" and is_matmul(item))
                or (item["item"] == "call" and does_matmuls(item["callee"], depth + 1))
                for item in program.get(name, ()))
        return matmul_work[name]

    def collective(item) -> tuple[float, str]:
        if "host_bytes" in item:  # a copy between HBM and host memory, over PCIe
            return item["host_bytes"] / r.host, "host"
        if item.get("wraps"):  # an async-start: the collective it wraps
            return comm.get(f"@{item['wraps']}", (0.0, "intra-node"))
        return comm.get(item["name"], (0.0, "intra-node"))

    def walk(name: str, times: float, depth: int = 0) -> float:
        """Adds `times` runs of computation `name` to the totals; returns its device time."""
        if depth > 50:
            return 0.0
        device = 0.0
        open_ops: dict[str, list] = {}  # start name -> [seconds, link, covered]
        items = program.get(name, ())
        # The step's head (the entry computation before its first matmul kernel): the first
        # blocks' gathers exposed there are exposed once a step, however deep the model
        # (jaxdist.predict.depth.linear_times)
        first = next((i for i, item in enumerate(items) if
                      (item["item"] == "kernel" and is_matmul(item)) or
                      (item["item"] == "call" and does_matmuls(item["callee"]))),
                     len(items)) if depth == 0 else len(items)
        for at, item in enumerate(items):
            kind = item["item"]
            if kind == "kernel":
                seconds, bound = r.kernel(item, precision)
                totals["compute_s" if bound == "compute" else "hbm_s"] += \
                    (seconds - r.launch) * times
                totals["launch_s"] += r.launch * times
                by_kind[item["kind"]] = by_kind.get(item["kind"], 0.0) + seconds * times
                spent = seconds
            elif kind == "call":
                if not item["branch"]:
                    callee_times = times * item["repeat"]
                elif branch_runs and item["callee"] in branch_runs:
                    callee_times = branch_runs[item["callee"]]  # runs per step, absolute
                else:  # how often a branch runs is not in the HLO: every time (a bound)
                    flags["upper_bound"] = True
                    callee_times = times
                spent = walk(item["callee"], callee_times, depth + 1) / max(times, 1e-12)
            elif kind == "start":
                seconds, link = collective(item)
                totals[link] += seconds * times
                open_ops[item["name"]] = [seconds, link, 0.0]
                continue
            elif kind == "done":
                op = open_ops.pop(item["name"], None)
                if op is not None:
                    exposed = max(0.0, op[0] - op[2])
                    totals[f"exposed {op[1]}"] += exposed * times
                    if depth == 0 and at < first:
                        totals[f"head {op[1]}"] += exposed * times
                    if op[1] == "host":  # the stream waits for the copy: device time
                        device += exposed
                continue
            else:  # a synchronous collective: nothing hides it
                seconds, link = collective(item)
                totals[link] += seconds * times
                totals[f"exposed {link}"] += seconds * times
                if depth == 0 and at < first:
                    totals[f"head {link}"] += seconds * times
                continue
            device += spent
            for op in open_ops.values():
                op[2] += spent
        for seconds, link, covered in open_ops.values():  # never closed here: exposed
            totals[f"exposed {link}"] += max(0.0, seconds - covered) * times
            if link == "host":
                device += max(0.0, seconds - covered)
        return device * times

    from jaxdist.program.hlo import entry_computation, execution_counts
    entry = entry_computation(hlo_text)
    device = walk(entry, 1.0) if entry else 0.0
    _, guessed = execution_counts(hlo_text, branch_runs)
    exposed = totals["exposed intra-node"] + totals["exposed inter-node"]
    return KernelTime(
        device_s=device, compute_s=totals["compute_s"], hbm_s=totals["hbm_s"],
        launch_s=totals["launch_s"], intra_node_s=totals["intra-node"],
        inter_node_s=totals["inter-node"],
        exposed_intra_node_s=totals["exposed intra-node"],
        exposed_inter_node_s=totals["exposed inter-node"],
        # host copies (remat offload): their time, and the part no kernel hid (in device_s)
        host_transfer_s=totals["host"], exposed_host_transfer_s=totals["exposed host"],
        comm_exposed_s=exposed, step_s=device + exposed,
        # the part of each link's exposure before the step's first matmul
        head_exposed_intra_node_s=totals["head intra-node"],
        head_exposed_inter_node_s=totals["head inter-node"],
        upper_bound=flags["upper_bound"] or bool(guessed),
        by_kind=dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        rates=r.sources, kernel_efficiency=r.efficiency)

"""XLA:GPU compile targets as data: the `GpuTargetConfigProto` of each GPU part, so the real GPU
compiler can compile a step for a cluster that is not here (jaxdist.compiled.gpu_topology).

XLA publishes target descriptions for real parts in `xla/tools/hlo_opt/gpu_specs/*.txtpb`
(read from tensorflow/tensorflow `third_party/xla/xla/tools/hlo_opt/gpu_specs/`, commits
below). Each spec here is one of those, field for field, plus what device-less compilation
needs that the published files lack: `runtime_version` (the CUDA runtime of the installed
jax-cuda12 wheels; openxla/xla#25919) and a cuDNN version recent enough for the cuDNN
flash-attention lowering (the published files say 8.9.x, the plugin ships cuDNN 9). A part
without a published spec (H200, A10G) is derived from its die sibling; every changed field
names its source, and the part's `derived` says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_XLA = "tensorflow/tensorflow third_party/xla/xla/tools/hlo_opt/gpu_specs/{} @{}"
# XLA:GPU's scheduler and rematerialization plan for a memory limit (xla/service/gpu/
# gpu_hlo_schedule.cc, GetSchedulerMemoryLimit): a base of the module config's
# device_memory_size, which a runtime sets from its allocator and a device-less compile leaves
# at 0, else 80% of the target's device_memory_size; less the program's arguments and outputs;
# times xla_gpu_memory_limit_slop_factor (95%). Measured here: an A100 40GB target
# (42,331,013,120 B) logs "exceeds the base limit (33864810496)", 0.8 x its size. A plan's
# target therefore says usable / 0.8, so that XLA plans for the part's usable HBM
# (jaxdist.hardware hbm_bytes, what the verdict holds the program to), not 80% of it.
XLA_BASE_FRACTION = 0.8
XLA_SLOP_FACTOR = 0.95
# What the jax-cuda12 0.10.2 wheels install (nvidia-cuda-runtime-cu12 12.9, cudnn 9): the
# compiler takes the versions it may target from these two fields.
RUNTIME_VERSION = (12, 9, 0)
DNN_VERSION = (9, 8, 0)
_ADDED = (f"runtime_version {'.'.join(map(str, RUNTIME_VERSION))} and dnn_version_info "
          f"{'.'.join(map(str, DNN_VERSION))}: the CUDA runtime and cuDNN the jax-cuda12 0.10.2 "
          f"wheels install (device-less AOT needs runtime_version, openxla/xla#25919)")


@dataclass(frozen=True)
class GpuTarget:
    device_info: dict            # GpuDeviceInfoProto fields
    device_description: str      # what the device reports as device_kind
    sources: tuple[str, ...]
    derived: str | None = None   # why and how this spec differs from a published one
    changed: dict = field(default_factory=dict)  # field -> its source, for derived specs

    @property
    def sm(self) -> str:
        cc = self.device_info["cuda_compute_capability"]
        return f"sm_{cc['major']}{cc.get('minor', 0)}"

    def text(self, usable_bytes: float | None = None) -> str:
        """The GpuTargetConfigProto text that get_topology_desc takes as target_config; with
        `usable_bytes`, device_memory_size is set so that XLA's memory limit is that many
        bytes (usable / XLA_BASE_FRACTION)."""
        info = dict(self.device_info)
        if usable_bytes:
            info["device_memory_size"] = int(round(usable_bytes / XLA_BASE_FRACTION))
        cc = info.pop("cuda_compute_capability")
        lines = ["gpu_device_info {"]
        lines += [f"  {k}: {v}" for k, v in info.items()]
        lines.append(f"  cuda_compute_capability {{ major: {cc['major']} minor: "
                     f"{cc.get('minor', 0)} }}")
        lines.append("}")
        major, minor, patch = RUNTIME_VERSION
        lines.append(f"runtime_version {{ major: {major} minor: {minor} patch: {patch} }}")
        lines.append('platform_name: "CUDA"')
        major, minor, patch = DNN_VERSION
        lines.append(f"dnn_version_info {{ major: {major} minor: {minor} patch: {patch} }}")
        lines.append(f'device_description_str: "{self.device_description}"')
        return "\n".join(lines) + "\n"


def _info(cc: tuple[int, int], cores: int, fpus: int, bandwidth: int, l2: int, clock: float,
          memory: int, smem_core: int, smem_optin: int, threads_core: int = 2048) -> dict:
    return {"threads_per_block_limit": 1024, "threads_per_warp": 32,
            "shared_memory_per_block": 49152, "shared_memory_per_core": smem_core,
            "threads_per_core_limit": threads_core, "core_count": cores,
            "fpus_per_core": fpus, "block_dim_limit_x": 2147483647,
            "block_dim_limit_y": 65535, "block_dim_limit_z": 65535,
            "memory_bandwidth": bandwidth, "l2_cache_size": l2, "clock_rate_ghz": clock,
            "device_memory_size": memory, "shared_memory_per_block_optin": smem_optin,
            "registers_per_core_limit": 65536, "registers_per_block_limit": 65536,
            "cuda_compute_capability": {"major": cc[0], "minor": cc[1]}}


_H100_SXM = _info((9, 0), 132, 128, 3352320000000, 52428800, 1.98, 84978434048, 233472, 232448)
_A100_80 = _info((8, 0), 108, 64, 2039040000000, 41943040, 1.41, 85100068864, 167936, 166912)
_A6000 = _info((8, 6), 84, 128, 768096000000, 6291456, 1.8, 51041271808, 102400, 101376, 1536)

TARGETS: dict[str, GpuTarget] = {
    "h100-sxm": GpuTarget(_H100_SXM, "NVIDIA H100 80GB HBM3", (
        _XLA.format("h100_sxm.txtpb", "3f745823431d34a4978362caf76cda3ef80ea8ff"), _ADDED)),
    "h100-pcie": GpuTarget(
        _info((9, 0), 114, 128, 2039040000000, 52428800, 1.755, 84942979072, 233472, 232448),
        "NVIDIA H100 PCIe",
        (_XLA.format("h100_pcie.txtpb", "e7e3ef56a71e3a169ad74c19f15966491073fc68"), _ADDED)),
    "a100-sxm-80gb": GpuTarget(_A100_80, "NVIDIA A100-SXM4-80GB", (
        _XLA.format("a100_sxm_80.txtpb", "97dfeadf71bd425fa1acbb170126afcb670c33e6"), _ADDED)),
    "a100-sxm-40gb": GpuTarget(
        {**_A100_80, "memory_bandwidth": 1555200000000, "device_memory_size": 42331013120},
        "NVIDIA A100-SXM4-40GB",
        (_XLA.format("a100_sxm_40.txtpb", "b1fb6997953ff50b59faf79af9183f94475cf762"), _ADDED)),
    "h200": GpuTarget(
        {**_H100_SXM, "memory_bandwidth": 4800000000000, "device_memory_size": 141000000000},
        "NVIDIA H200",
        (_XLA.format("h100_sxm.txtpb", "3f745823431d34a4978362caf76cda3ef80ea8ff"), _ADDED),
        derived="XLA publishes no H200 spec: the H100 SXM one (same GH100 die, 132 SMs, "
                "50 MB L2, 1.98 GHz boost) with the H200's memory",
        changed={"memory_bandwidth": "4.8 TB/s HBM3e (NVIDIA H200 datasheet, H200 SXM column)",
                 "device_memory_size": "141 GB (NVIDIA H200 datasheet, H200 SXM column)",
                 "device_description_str": "'NVIDIA H200', the device_kind an H200 reports"}),
    "h100-sxm-96gb-500w": GpuTarget(
        {**_H100_SXM, "memory_bandwidth": 2400000000000, "device_memory_size": 96000000000},
        "NVIDIA H100 96GB HBM2e",
        (_XLA.format("h100_sxm.txtpb", "3f745823431d34a4978362caf76cda3ef80ea8ff"), _ADDED),
        derived="XLA publishes no spec for the 96 GB HBM2e H100 (torchtitan's Grand Teton "
                "part): the H100 SXM one (same GH100 die, 132 SMs, 50 MB L2) with its memory; "
                "its 500 W limit is in jaxdist.hardware, not here",
        changed={"memory_bandwidth": "2.4 TB/s HBM2e (pytorch/torchtitan benchmarks/"
                                     "llama3_h100_202412_torchtitan.md)",
                 "device_memory_size": "96 GB (the same page)",
                 "device_description_str": "'NVIDIA H100 96GB HBM2e', named here (the page "
                                           "does not give the device_kind)"}),
    "a10g": GpuTarget(
        {**_A6000, "core_count": 80, "memory_bandwidth": 600000000000,
         "device_memory_size": 24000000000, "clock_rate_ghz": 1.71},
        "NVIDIA A10G",
        (_XLA.format("a6000.txtpb", "dd0b533d53850a75d1d7270312088f23326e38d5"), _ADDED),
        derived="XLA publishes no A10G spec: the RTX A6000 one (same GA102 die, sm_86, 6 MB L2) "
                "with the A10G's SM count, clock and memory",
        changed={"core_count": "80 SMs (AWS G5 / NVIDIA A10G: 80 RT cores, one per SM)",
                 "clock_rate_ghz": "1.71 GHz boost (NVIDIA A10 datasheet)",
                 "memory_bandwidth": "600 GB/s GDDR6 (NVIDIA A10 datasheet)",
                 "device_memory_size": "24 GB (NVIDIA A10 datasheet)",
                 "device_description_str": "'NVIDIA A10G', the device_kind an A10G reports"}),
}


def target_for(part: str) -> GpuTarget | None:
    return TARGETS.get(part)

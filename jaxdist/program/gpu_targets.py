"""XLA:GPU compile targets: how a GPU part's `GpuTargetConfigProto` is written, so the real GPU
compiler can compile a step for a cluster that is not here (jaxdist.program.compiled.gpu_topology).
The targets themselves are data of their parts (`jaxdist.parts`, each record's `target`).

XLA publishes target descriptions for real parts in `xla/tools/hlo_opt/gpu_specs/*.txtpb`
(read from tensorflow/tensorflow `third_party/xla/xla/tools/hlo_opt/gpu_specs/`, commits
named in each part's sources). Each spec is one of those, field for field, plus what
device-less compilation needs that the published files lack: `runtime_version` (the CUDA
runtime of the installed jax-cuda12 wheels; openxla/xla#25919) and a cuDNN version recent
enough for the cuDNN flash-attention lowering (the published files say 8.9.x, the plugin
ships cuDNN 9). A part without a published spec (H200, A10G) is derived from its die sibling;
every changed field names its source, and the target's `derived` says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

XLA_SPEC = "tensorflow/tensorflow third_party/xla/xla/tools/hlo_opt/gpu_specs/{} @{}"
# XLA:GPU's scheduler and rematerialization plan for a memory limit (xla/service/gpu/
# gpu_hlo_schedule.cc, GetSchedulerMemoryLimit): a base of the module config's
# device_memory_size, which a runtime sets from its allocator and a device-less compile leaves
# at 0, else 80% of the target's device_memory_size; less the program's arguments and outputs;
# times xla_gpu_memory_limit_slop_factor (95%). Measured here: an A100 40GB target
# (42,331,013,120 B) logs "exceeds the base limit (33864810496)", 0.8 x its size. A plan's
# target therefore says usable / 0.8, so that XLA plans for the part's usable HBM
# (jaxdist.parts hbm_bytes, what the verdict holds the program to), not 80% of it.
XLA_BASE_FRACTION = 0.8
XLA_SLOP_FACTOR = 0.95
# What the jax-cuda12 0.10.2 wheels install (nvidia-cuda-runtime-cu12 12.9, cudnn 9): the
# compiler takes the versions it may target from these two fields.
RUNTIME_VERSION = (12, 9, 0)
DNN_VERSION = (9, 8, 0)
ADDED = (f"runtime_version {'.'.join(map(str, RUNTIME_VERSION))} and dnn_version_info "
         f"{'.'.join(map(str, DNN_VERSION))}: the CUDA runtime and cuDNN the jax-cuda12 0.10.2 "
         f"wheels install (device-less AOT needs runtime_version, openxla/xla#25919)")


@dataclass(frozen=True)
class GpuTarget:
    device_info: dict            # GpuDeviceInfoProto fields
    sources: tuple[str, ...]
    derived: str | None = None   # why and how this spec differs from a published one
    changed: dict = field(default_factory=dict)  # field -> its source, for derived specs

    @property
    def sm(self) -> str:
        cc = self.device_info["cuda_compute_capability"]
        return f"sm_{cc['major']}{cc.get('minor', 0)}"

    def text(self, device_kind: str, usable_bytes: float | None = None) -> str:
        """The GpuTargetConfigProto text that get_topology_desc takes as target_config, for a
        device reporting `device_kind`; with `usable_bytes`, device_memory_size is set so that
        XLA's memory limit is that many bytes (usable / XLA_BASE_FRACTION)."""
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
        lines.append(f'device_description_str: "{device_kind}"')
        return "\n".join(lines) + "\n"


def gpu_device_info(cc: tuple[int, int], cores: int, fpus: int, bandwidth: int, l2: int,
                    clock: float, memory: int, smem_core: int, smem_optin: int,
                    threads_core: int = 2048) -> dict[str, int | float | dict[str, int]]:
    """The GpuDeviceInfoProto fields of one spec: the parts' own figures, and the limits every
    CUDA part shares."""
    return {"threads_per_block_limit": 1024, "threads_per_warp": 32,
            "shared_memory_per_block": 49152, "shared_memory_per_core": smem_core,
            "threads_per_core_limit": threads_core, "core_count": cores,
            "fpus_per_core": fpus, "block_dim_limit_x": 2147483647,
            "block_dim_limit_y": 65535, "block_dim_limit_z": 65535,
            "memory_bandwidth": bandwidth, "l2_cache_size": l2, "clock_rate_ghz": clock,
            "device_memory_size": memory, "shared_memory_per_block_optin": smem_optin,
            "registers_per_core_limit": 65536, "registers_per_block_limit": 65536,
            "cuda_compute_capability": {"major": cc[0], "minor": cc[1]}}

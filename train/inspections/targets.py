"""GPUs to compile for without having one: their descriptions and compile-only devices.

JAX's CUDA plugin has a compile-only client: given a description of a GPU (an
XLA ``GpuTargetConfigProto`` in text form), ``jax.experimental.topologies``
makes devices of that GPU that programs can be compiled for, on a machine with
no GPU, with no CUDA driver. The program XLA's GPU compiler produces is the one
the GPU would run, except that no autotuning happens (GEMMs get XLA's default
kernel configurations): it shows kernels, dtypes, collectives and XLA's memory
plan, not time.

Shipped targets: ``h100`` (H100 SXM, 80 GB) and ``h200`` (141 GB). A user's
target is the path of a ``GpuTargetConfigProto`` text file (XLA's
``xla/backends/gpu/target_config/specs/*.txtpb`` are such files; fields this
XLA does not know must be removed).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

import jax

__all__ = ["GpuTarget", "TargetError", "TARGETS", "get_target", "target_devices", "GPU_COMPILE_EXTRA"]

#: What to install for compiling to a GPU (the CUDA plugin matching the installed jax).
GPU_COMPILE_EXTRA = "pip install '.[gpu-compile]' (or pip install \"jax[cuda12]=={version}\")"


class TargetError(ValueError):
    """A target that cannot be compiled for here: unknown, unreadable, or no CUDA plugin."""


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """A GPU to compile for."""

    name: str  # "h100", or the file a user's target came from
    device_kind: str  # "NVIDIA H100 80GB HBM3"
    memory_bytes: int  # device memory XLA may plan for
    config_text: str  # its GpuTargetConfigProto, in text form

    def describe(self) -> str:
        return f"{self.device_kind} ({self.memory_bytes / 2 ** 30:.1f} GiB)"


@dataclasses.dataclass(frozen=True)
class _Spec:
    """The facts of a GPU that XLA's GPU compiler reads."""

    device_kind: str
    sms: int
    memory_bytes: int
    bandwidth: int  # bytes/s
    l2_bytes: int
    clock_ghz: float
    capability: tuple[int, int]
    cudnn: tuple[int, int, int] = (9, 8, 0)

    def config_text(self) -> str:
        major, minor = self.capability
        return "\n".join([
            "gpu_device_info {",
            "  threads_per_block_limit: 1024", "  threads_per_warp: 32", "  shared_memory_per_block: 49152",
            "  shared_memory_per_core: 233472", "  threads_per_core_limit: 2048", f"  core_count: {self.sms}",
            "  fpus_per_core: 128", "  block_dim_limit_x: 2147483647", "  block_dim_limit_y: 65535",
            "  block_dim_limit_z: 65535", f"  memory_bandwidth: {self.bandwidth}", f"  l2_cache_size: {self.l2_bytes}",
            f"  clock_rate_ghz: {self.clock_ghz}", f"  device_memory_size: {self.memory_bytes}",
            "  shared_memory_per_block_optin: 232448",
            f"  cuda_compute_capability {{ major: {major} minor: {minor} }}",
            "  registers_per_core_limit: 65536", "  registers_per_block_limit: 65536",
            "}",
            'platform_name: "CUDA"',
            f"dnn_version_info {{ major: {self.cudnn[0]} minor: {self.cudnn[1]} patch: {self.cudnn[2]} }}",
            "runtime_version { major: 12 minor: 8 patch: 0 }",
            f'device_description_str: "{self.device_kind}"',
        ]) + "\n"


# Public datasheet figures: 132 SMs (SXM), HBM3 3.35 TB/s (H100) and HBM3e 4.8 TB/s (H200),
# 50 MiB L2, 1.98 GHz boost, compute capability 9.0; memory as the devices report it.
_SPECS = {
    "h100": _Spec("NVIDIA H100 80GB HBM3", 132, 84_942_979_072, 3_352_320_000_000, 52_428_800, 1.98, (9, 0)),
    "h200": _Spec("NVIDIA H200 141GB HBM3e", 132, 151_397_597_184, 4_800_000_000_000, 52_428_800, 1.98, (9, 0)),
}
TARGETS = tuple(_SPECS)


def get_target(target: str | GpuTarget) -> GpuTarget:
    """A shipped target by name (``h100``, ``h200``) or a ``GpuTargetConfigProto`` text file."""
    if isinstance(target, GpuTarget):
        return target
    key = str(target).strip().lower()
    if key in _SPECS:
        spec = _SPECS[key]
        return GpuTarget(key, spec.device_kind, spec.memory_bytes, spec.config_text())
    if not os.path.isfile(target):
        raise TargetError(f"unknown compile target {target!r}: give one of {', '.join(TARGETS)}, or the path of a "
                          f"GpuTargetConfigProto text file")
    try:
        with open(target, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise TargetError(f"cannot read the target file {target}: {getattr(e, 'strerror', None) or e}") from None
    memory = re.search(r"device_memory_size:\s*(\d+)", text)
    kind = re.search(r'device_description_str:\s*"([^"]*)"', text) or re.search(r'\bname:\s*"([^"]*)"', text)
    if memory is None:
        raise TargetError(f"the target file {target} has no gpu_device_info.device_memory_size: is it a "
                          f"GpuTargetConfigProto in text form?")
    return GpuTarget(os.path.basename(target), kind.group(1) if kind else os.path.basename(target),
                     int(memory.group(1)), text)


def target_devices(target: GpuTarget, count: int = 1) -> list[Any]:
    """``count`` compile-only devices of ``target`` (one host; nothing runs on them).

    Raises:
      TargetError: JAX's CUDA plugin is not installed, or XLA cannot read the target.
    """
    from jax.experimental import topologies

    if count < 1:
        raise TargetError(f"--devices must be at least 1, got {count}")
    try:
        topology = topologies.get_topology_desc(platform="cuda", target_config=target.config_text,
                                                topology=f"1x1x{count}")
    except NotImplementedError:
        raise TargetError(f"compiling for {target.name} needs JAX's CUDA plugin, which is not installed: "
                          + GPU_COMPILE_EXTRA.format(version=jax.__version__)) from None
    except Exception as e:  # noqa: BLE001 - XLA's parse or topology errors, as one line
        raise TargetError(f"XLA cannot make {count} {target.name} device(s): {str(e).splitlines()[0]}") from None
    return list(topology.devices)

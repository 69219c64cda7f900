"""GPUs and TPUs to compile for without having one: their descriptions and compile-only devices.

JAX's CUDA plugin has a compile-only client: given a description of a GPU (an
XLA ``GpuTargetConfigProto`` in text form), ``jax.experimental.topologies``
makes devices of that GPU that programs can be compiled for, on a machine with
no GPU, with no CUDA driver. The program XLA's GPU compiler produces is the one
the GPU would run, except that no autotuning happens (GEMMs get XLA's default
kernel configurations): it shows kernels, dtypes, collectives and XLA's memory
plan, not time.

Shipped targets: ``h100`` (H100 SXM, 80 GB), ``h200`` (141 GB) and ``a100`` (A100 SXM,
80 GB: no FP8, int8 at twice its bf16 rate). A user's
target is the path of a ``GpuTargetConfigProto`` text file (XLA's
``xla/backends/gpu/target_config/specs/*.txtpb`` are such files; fields this
XLA does not know must be removed).

TPUs the same way through libtpu (``jax[tpu]``, the extra ``tpu-compile``): ``v5e``,
``v5p``, ``v6e``, a slice of N chips chosen from N, or given (``v5p:2x2x2``). libtpu's
compile-only client makes the slice's devices on a machine with no TPU, and XLA's TPU
compiler produces the program the slice would run.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

import jax
import numpy as np

__all__ = ["GpuTarget", "TpuTarget", "Target", "TargetError", "TARGETS", "GPU_TARGETS", "TPU_TARGETS", "get_target",
           "target_devices", "slice_topology", "target_slug", "GPU_COMPILE_EXTRA", "TPU_COMPILE_EXTRA"]

#: What to install for compiling to a GPU (the CUDA plugin matching the installed jax).
GPU_COMPILE_EXTRA = "pip install '.[gpu-compile]' (or pip install \"jax[cuda12]=={version}\")"
#: What to install for compiling to a TPU (libtpu matching the installed jax).
TPU_COMPILE_EXTRA = "pip install '.[tpu-compile]' (or pip install \"jax[tpu]=={version}\")"


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

    @property
    def capability(self) -> tuple[int, int] | None:
        """Its CUDA compute capability, (9, 0) for an H100 (None where its description has none)."""
        m = re.search(r"cuda_compute_capability\s*\{\s*major:\s*(\d+)\s*minor:\s*(\d+)", self.config_text)
        return (int(m.group(1)), int(m.group(2))) if m else None

    @property
    def fp8(self) -> bool:
        """Tensor cores that multiply FP8 (Ada and Hopper on: compute capability 8.9 or later)."""
        return self.capability is None or self.capability >= (8, 9)

    @property
    def int8(self) -> bool:
        """Tensor cores that multiply int8 (Turing on: compute capability 7.5 or later)."""
        return self.capability is None or self.capability >= (7, 5)


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
    shared_memory_per_core: int = 233472  # bytes (Hopper: 228 KiB)
    shared_memory_per_block_optin: int = 232448

    def config_text(self) -> str:
        major, minor = self.capability
        return "\n".join([
            "gpu_device_info {",
            "  threads_per_block_limit: 1024", "  threads_per_warp: 32", "  shared_memory_per_block: 49152",
            f"  shared_memory_per_core: {self.shared_memory_per_core}", "  threads_per_core_limit: 2048",
            f"  core_count: {self.sms}",
            "  fpus_per_core: 128", "  block_dim_limit_x: 2147483647", "  block_dim_limit_y: 65535",
            "  block_dim_limit_z: 65535", f"  memory_bandwidth: {self.bandwidth}", f"  l2_cache_size: {self.l2_bytes}",
            f"  clock_rate_ghz: {self.clock_ghz}", f"  device_memory_size: {self.memory_bytes}",
            f"  shared_memory_per_block_optin: {self.shared_memory_per_block_optin}",
            f"  cuda_compute_capability {{ major: {major} minor: {minor} }}",
            "  registers_per_core_limit: 65536", "  registers_per_block_limit: 65536",
            "}",
            'platform_name: "CUDA"',
            f"dnn_version_info {{ major: {self.cudnn[0]} minor: {self.cudnn[1]} patch: {self.cudnn[2]} }}",
            "runtime_version { major: 12 minor: 8 patch: 0 }",
            f'device_description_str: "{self.device_kind}"',
        ]) + "\n"


# Public datasheet figures: 132 SMs (SXM), HBM3 3.35 TB/s (H100) and HBM3e 4.8 TB/s (H200),
# 50 MiB L2, 1.98 GHz boost, compute capability 9.0; memory as the devices report it. A100 SXM
# 80 GB: 108 SMs, HBM2e 2.0 TB/s, 40 MiB L2, 1.41 GHz boost, compute capability 8.0, 164 KiB of
# shared memory per SM (163 KiB per block); 312 bf16 TFLOP/s, 624 int8 TOPS, no FP8.
_SPECS = {
    "h100": _Spec("NVIDIA H100 80GB HBM3", 132, 84_942_979_072, 3_352_320_000_000, 52_428_800, 1.98, (9, 0)),
    "h200": _Spec("NVIDIA H200 141GB HBM3e", 132, 151_397_597_184, 4_800_000_000_000, 52_428_800, 1.98, (9, 0)),
    "a100": _Spec("NVIDIA A100-SXM4-80GB", 108, 85_899_345_920, 2_039_000_000_000, 41_943_040, 1.41, (8, 0),
                  shared_memory_per_core=167936, shared_memory_per_block_optin=166912),
}
GPU_TARGETS = tuple(_SPECS)


@dataclasses.dataclass(frozen=True)
class TpuTarget:
    """A TPU generation to compile for, on a slice of its chips."""

    name: str  # "v5e", or "v5p:2x2x2" when the slice was given
    device_kind: str  # "TPU v5 lite", as its devices say
    memory_bytes: int  # HBM per chip
    generation: str  # libtpu's name for it in a topology ("v5e")
    host: tuple[int, ...]  # the chips of one host (the smallest slice libtpu makes): 2x2, or 2x2x1 on a 3-D torus
    accelerator: str  # TPU_ACCELERATOR_TYPE of one host, so libtpu does not ask a metadata server
    topology: str = ""  # the slice given with the target ("2x2x2"), else chosen from the device count
    fp8: bool = False  # matrix units that multiply FP8
    int8: bool = True  # matrix units that multiply int8 (v5e, v5p, v6e: at twice their bf16 rate)

    def describe(self) -> str:
        return f"{self.device_kind} ({self.memory_bytes / 2 ** 30:.1f} GiB HBM per chip)"

    @property
    def chips(self) -> int | None:
        """The chips of the given slice; None where the slice is chosen from the device count."""
        return int(np.prod([int(d) for d in self.topology.split("x")])) if self.topology else None


# Public figures (cloud.google.com/tpu/docs): HBM per chip 16 GiB (v5e), 95 GiB (v5p), 32 GiB (v6e);
# four chips per host, a 2-D torus (v5e, v6e) or a 3-D one (v5p); none multiplies FP8 natively.
_TPUS = {
    "v5e": TpuTarget("v5e", "TPU v5 lite", 16 * 2 ** 30, "v5e", (2, 2), "v5litepod-4"),
    "v5p": TpuTarget("v5p", "TPU v5", 95 * 2 ** 30, "v5p", (2, 2, 1), "v5p-8"),
    "v6e": TpuTarget("v6e", "TPU v6 lite", 32 * 2 ** 30, "v6e", (2, 2), "v6e-4"),
}
TPU_TARGETS = tuple(_TPUS)
TARGETS = GPU_TARGETS + TPU_TARGETS
#: A target of either kind.
Target = GpuTarget | TpuTarget
#: libtpu's environment on a machine that is not a TPU host: no metadata server to ask, no logs on the
#: terminal, and no lock on the (absent) chips, so that several processes compile at once.
_LIBTPU_ENV = {"TPU_SKIP_MDS_QUERY": "1", "TPU_WORKER_HOSTNAMES": "localhost", "TPU_STDERR_LOG_LEVEL": "3",
               "TPU_MIN_LOG_LEVEL": "3", "TPU_LOG_DIR": "disabled", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def get_target(target: str | Target) -> Target:
    """A shipped target by name (``h100``, ``h200``, ``v5e``, ``v5p``, ``v6e``), a TPU slice
    (``v5p:2x2x2``) or a ``GpuTargetConfigProto`` text file."""
    if isinstance(target, (GpuTarget, TpuTarget)):
        return target
    key = str(target).strip().lower()
    generation, _, topology = key.partition(":")
    if generation in _TPUS:
        return _tpu_target(_TPUS[generation], topology)
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


def target_devices(target: Target, count: int | None = None) -> list[Any]:
    """``count`` compile-only devices of ``target`` (GPUs: one host; TPUs: the chips of a slice;
    default: 1, or a given slice's chips). Nothing runs on them.

    Raises:
      TargetError: JAX's CUDA plugin (libtpu for a TPU) is not installed, or XLA cannot make the devices.
    """
    from jax.experimental import topologies

    if count is not None and count < 1:
        raise TargetError(f"--devices must be at least 1, got {count}")
    if isinstance(target, TpuTarget):
        return _tpu_devices(target, count)
    count = count or 1
    try:
        topology = topologies.get_topology_desc(platform="cuda", target_config=target.config_text,
                                                topology=f"1x1x{count}")
    except NotImplementedError:
        raise TargetError(f"compiling for {target.name} needs JAX's CUDA plugin, which is not installed: "
                          + GPU_COMPILE_EXTRA.format(version=jax.__version__)) from None
    except Exception as e:  # noqa: BLE001 - XLA's parse or topology errors, as one line
        raise TargetError(f"XLA cannot make {count} {target.name} device(s): {str(e).splitlines()[0]}") from None
    return list(topology.devices)


def target_slug(target: Target) -> str:
    """The target's name in file names: ``h100``, ``v5p-2x2x2``, a target file's name without ``.txtpb``."""
    return target.name.removesuffix(".txtpb").replace(":", "-")


def _tpu_target(base: TpuTarget, topology: str) -> TpuTarget:
    """``base`` on the slice ``topology`` ("2x2x2"; "" to choose it from the device count)."""
    if not topology:
        return base
    dims = topology.split("x")
    if len(dims) != len(base.host) or not all(d.isdigit() and int(d) > 0 for d in dims):
        example = "2x2x2" if len(base.host) == 3 else "2x4"
        raise TargetError(f"unknown {base.name} slice {topology!r}: give {len(base.host)} chip counts, as in "
                          f"{base.name}:{example}, or {base.name} alone (the slice chosen from --devices)")
    return dataclasses.replace(base, name=f"{base.name}:{topology}", topology=topology)


def slice_topology(target: TpuTarget, count: int) -> str:
    """The smallest slice of ``target`` holding ``count`` chips, as libtpu names it ("v5p:2x2x2"):
    the given one, else one host's, its sides doubled from the shortest until it holds them."""
    if target.topology:
        return f"{target.generation}:{target.topology}"
    dims = sorted(target.host)
    while int(np.prod(dims)) < count:
        dims[0] *= 2
        dims.sort()
    shape = dims if len(dims) == 2 else [dims[1], dims[2], dims[0]] if dims[0] == 1 else dims
    return f"{target.generation}:{'x'.join(map(str, shape))}"


def _tpu_devices(target: TpuTarget, count: int | None) -> list[Any]:
    """``count`` chips of the slice of ``target`` that holds them (default: the whole given slice, else one)."""
    from jax.experimental import topologies

    given = target.chips
    count = count or given or 1
    if given is not None and count > given:
        raise TargetError(f"--devices {count} is more than the {given} chips of the slice {target.name}")
    for key, value in {**_LIBTPU_ENV, "TPU_ACCELERATOR_TYPE": target.accelerator}.items():
        os.environ.setdefault(key, value)
    name = slice_topology(target, count)
    try:
        topology = topologies.get_topology_desc(topology_name=name, platform="tpu")
    except (NotImplementedError, ModuleNotFoundError, ImportError):
        raise TargetError(f"compiling for {target.name} needs libtpu, which is not installed: "
                          + TPU_COMPILE_EXTRA.format(version=jax.__version__)) from None
    except Exception as e:  # noqa: BLE001 - libtpu's topology errors, as one line
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "not installed" in message:
            raise TargetError(f"compiling for {target.name} needs libtpu, which is not installed: "
                              + TPU_COMPILE_EXTRA.format(version=jax.__version__)) from None
        raise TargetError(f"libtpu cannot make the slice {name}: {message}") from None
    return list(topology.devices)[:count]

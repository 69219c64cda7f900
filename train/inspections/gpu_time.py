"""A modeled GPU step time, from the program compiled for the GPU: a model, never a measurement.

GPUs are lent to this project rarely; what XLA's GPU compiler makes of a step
is known without one (:mod:`train.inspections.targets`). This module turns that program
into a time: each kernel it launches (:mod:`train.inspections.hlo_kernels`) takes

    launches x (max(t_0 + bytes / (HBM bandwidth x e_bw), FLOPs / (peak x e_kind)) + t_gap)

with the bandwidth and dense peaks from the device's datasheet (the peak for
the operands' dtype: bf16/f16, FP8, int8, TF32 for a float32 GEMM at default
precision, plain float32 at ``highest``), and numbers calibrated on profiles
measured on a GPU (:data:`CALIBRATION`): the share of peak a GEMM and cuDNN's
attention reach; a kernel's latency ``t_0`` (what one moving nothing takes) and the
share of bandwidth its bytes stream at past it, fitted kernel by kernel (a small
kernel reaches a small share of the bandwidth: 2 us of latency is most of a 1 MB
one's time, little of a 100 MB one's; ``benchmarks/results/kernel-bandwidth.md``).
``t_gap``, the idle time between two kernels, is the measured step's wall time
less its busy time, per launch. Collectives take their bytes over NVLink at the
same bandwidth share.

What it is for: comparing two programs for the same GPU (ours against a
hand-written step, a rewrite against the plain program), and knowing where a
step's time goes before renting the GPU. What it is not: a measurement. It
knows no cache, no overlap of kernels, no autotuned GEMM configuration (a
compile-only program has XLA's default Triton GEMMs where a tuned run may pick
cuBLAS); ``benchmarks/results/model-calibration.md`` says how far it is from
each measured kernel kind and step.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any, NamedTuple

from train.inspections.hlo_kernels import KINDS, HloKernel, read_hlo_kernels

__all__ = ["Datasheet", "Calibration", "CALIBRATION", "ModeledKernel", "ModeledStep", "datasheet", "model_step",
           "model_kernels"]

_FP8 = ("f8e4m3fn", "f8e5m2", "f8e4m3", "f8e4m3fnuz", "f8e5m2fnuz", "f8e3m4")


class Datasheet(NamedTuple):
    """What a GPU's datasheet says: HBM bandwidth, dense matrix peaks by math, NVLink."""

    name: str
    bandwidth: float  # bytes/s
    half: float  # dense bf16/f16 tensor-core FLOP/s
    fp8: float  # dense FP8 FLOP/s (0: none)
    tf32: float  # dense TF32 FLOP/s (a float32 GEMM at default precision)
    f32: float  # float32 without tensor cores (precision highest)
    link_bandwidth: float  # NVLink bytes/s per direction
    int8: float = 0.0  # dense int8 OP/s (0: none)

    def peak(self, dtype: str, precision: str = "") -> float:
        """The dense peak a GEMM with ``dtype`` operands runs at."""
        if dtype in ("bf16", "f16"):
            return self.half
        if dtype in _FP8:
            return self.fp8 or self.half
        if dtype == "s8":
            return self.int8 or self.half
        if dtype == "f32":
            return self.f32 if precision == "highest" else self.tf32
        return self.f32


#: Per SM and clock, by compute capability: (half, fp8, tf32, f32, int8) FLOPs. Hopper's datasheet:
#: H100 SXM 989.4 / 1978.9 / 494.7 TFLOP/s dense, 1978.9 int8 TOPS at 132 SMs, 1.83 GHz (tensor),
#: 66.9 at 1.98 GHz; A100 SXM 312 / - / 156 TFLOP/s, 624 int8 TOPS, 19.5 at 108 SMs, 1.41 GHz.
_PER_SM_CLOCK = {(9, 0): (4096.0, 8192.0, 2048.0, 256.0, 8192.0), (8, 0): (2048.0, 0.0, 1024.0, 128.0, 4096.0),
                 (8, 9): (1024.0, 2048.0, 512.0, 256.0, 2048.0), (10, 0): (8192.0, 16384.0, 4096.0, 256.0, 16384.0)}
#: The tensor-core datasheet peaks are at a lower sustained clock than the boost clock (Hopper and
#: later); an A100's are at its boost clock.
_TENSOR_CLOCK_RATIO = {(8, 0): 1.0}
_DEFAULT_TENSOR_CLOCK_RATIO = 1.83 / 1.98


class Calibration(NamedTuple):
    """The model's fitted numbers, and where they came from."""

    gemm_efficiency: float  # share of the dense peak a GEMM reaches
    attention_efficiency: float  # share of the dense peak cuDNN's fused attention reaches (causal: half the FLOPs)
    bandwidth_efficiency: float  # share of HBM bandwidth a kernel's bytes stream at, past its latency
    min_kernel_seconds: float  # a kernel's latency: the shortest kernel, and where every kernel's memory time starts
    gap_seconds: float  # idle time between two kernels (launch, dependencies)
    source: str


#: The GEMM and attention shares and the gap fitted by ``python -m benchmarks.model_calibration`` on the
#: H200 profile of 2026-11-30 (``benchmarks/results/profile-gpt2_small-mixed_bf16-nvidia-h200-2026-11-30.json``:
#: GPT-2 small at its real vocabulary, 16 x 1024 tokens, mixed_bf16, five steps back to back; device busy
#: 31.70 ms, wall 33.47 ms per step) against the very program that lease ran (commit ef960a5); a
#: memory-bound kernel's latency and streaming share fitted kernel by kernel by ``python -m
#: benchmarks.kernel_bandwidth`` on the GPT-2-small hand-written step's profile of 2026-11-28; checked
#: against the other steps measured there (``benchmarks/results/model-calibration-2026-11-30.md``: the
#: hand-written step's GEMMs within 2%, our reductions 30% under, which is most of the model's error on
#: ours against hand-written). The fit of 2026-11-25 (a 65-token vocabulary) was 0.740 / 0.277 / 1.10 us.
CALIBRATION = Calibration(gemm_efficiency=0.805, attention_efficiency=0.251, bandwidth_efficiency=0.763,
                          min_kernel_seconds=1.83e-6, gap_seconds=2.51e-6,
                          source="profile-gpt2_small-mixed_bf16-nvidia-h200 (2026-11-30); kernel-bandwidth (the "
                                 "GPT-2-small profiles of 2026-11-28)")


class ModeledKernel(NamedTuple):
    """A kernel and its modeled time in one step (all its launches)."""

    kernel: HloKernel
    seconds: float
    bound: str  # "memory", "compute" or "launch" (its latency more than its bytes' time)


class ModeledStep(NamedTuple):
    """The modeled time of one step of a compiled program."""

    device: str
    seconds: float
    kernels: tuple[ModeledKernel, ...]
    calibration: Calibration

    @property
    def launches(self) -> int:
        return sum(m.kernel.launches for m in self.kernels)

    @property
    def bytes(self) -> float:
        return sum(m.kernel.bytes * m.kernel.launches for m in self.kernels)

    @property
    def flops(self) -> float:
        return sum(m.kernel.flops * m.kernel.launches for m in self.kernels)

    def by_kind(self) -> dict[str, dict[str, float]]:
        """Per kernel kind: launches, bytes, FLOPs and modeled seconds."""
        out: dict[str, dict[str, float]] = defaultdict(lambda: {"launches": 0, "bytes": 0.0, "flops": 0.0,
                                                                "seconds": 0.0})
        for m in self.kernels:
            row = out[m.kernel.kind]
            row["launches"] += m.kernel.launches
            row["bytes"] += m.kernel.bytes * m.kernel.launches
            row["flops"] += m.kernel.flops * m.kernel.launches
            row["seconds"] += m.seconds
        return {k: dict(out[k]) for k in KINDS if k in out}

    def top(self, n: int = 10) -> list[ModeledKernel]:
        """The ``n`` kernels with the most modeled time."""
        return sorted(self.kernels, key=lambda m: -m.seconds)[:n]

    def to_json(self, top: int = 10) -> dict[str, Any]:
        return {"what": "a model of the step time from the compiled program (datasheet roofline per kernel, "
                        "calibrated on a measured profile), not a measurement",
                "device": self.device, "seconds": self.seconds, "launches": self.launches, "bytes": self.bytes,
                "flops": self.flops, "by_kind": self.by_kind(), "calibration": self.calibration._asdict(),
                "top": [{"kernel": m.kernel.name, "kind": m.kernel.kind, "module": m.kernel.module,
                         "launches": m.kernel.launches, "bytes": m.kernel.bytes, "flops": m.kernel.flops,
                         "dtype": m.kernel.dtype, "bound": m.bound, "seconds": m.seconds} for m in self.top(top)]}

    def lines(self, top: int = 5) -> list[str]:
        """The report's lines (``--compile-for``'s output)."""
        out = [f"Modeled step time on {self.device} (a model from the compiled program, not a measurement): "
               f"{self.seconds * 1e3:.2f} ms; {self.launches} kernel launches, {self.bytes / 1e9:.2f} GB moved, "
               f"{self.flops / 1e12:.2f} TFLOP of matrix math"]
        kinds = self.by_kind()
        out.append("  by kind: " + ", ".join(f"{k} {v['seconds'] * 1e3:.2f} ms ({int(v['launches'])})"
                                             for k, v in kinds.items()))
        for m in self.top(top):
            where = f" in {m.kernel.module}" if m.kernel.module else ""
            out.append(f"  {m.seconds * 1e3:7.3f} ms  {m.kernel.kind:<10}{m.kernel.name}{where} ({m.bound})")
        return out


def datasheet(target: Any) -> Datasheet:
    """The datasheet of a :class:`train.inspections.targets.GpuTarget`, from its target description
    (SM count, clock, bandwidth, compute capability).

    Raises:
      ValueError: a compute capability this model has no peaks for.
    """
    text = target.config_text

    def number(key: str) -> float:
        m = re.search(key + r":\s*([0-9.e+]+)", text)
        if m is None:
            raise ValueError(f"the target {target.name} has no {key}: cannot model its step time")
        return float(m.group(1))

    capability = re.search(r"cuda_compute_capability\s*\{\s*major:\s*(\d+)\s*minor:\s*(\d+)", text)
    key = (int(capability.group(1)), int(capability.group(2))) if capability else None
    if key not in _PER_SM_CLOCK:
        known = ", ".join(f"{a}.{b}" for a, b in _PER_SM_CLOCK)
        raise ValueError(f"no datasheet peaks for compute capability {key} of {target.name} (known: {known})")
    sms, clock = number("core_count"), number("clock_rate_ghz") * 1e9
    half, fp8, tf32, f32, int8 = _PER_SM_CLOCK[key]
    tensor = sms * clock * _TENSOR_CLOCK_RATIO.get(key, _DEFAULT_TENSOR_CLOCK_RATIO)
    link = 300e9 if key == (8, 0) else 450e9  # NVLink 3 (A100) and 4 (Hopper), per direction
    return Datasheet(target.device_kind, number("memory_bandwidth"), half * tensor, fp8 * tensor, tf32 * tensor,
                     f32 * sms * clock, link, int8 * tensor)


def model_kernels(kernels: list[HloKernel], sheet: Datasheet, calibration: Calibration = CALIBRATION
                  ) -> list[ModeledKernel]:
    """Each kernel's modeled time in one step."""
    c = calibration
    out = []
    for k in kernels:
        bandwidth = sheet.link_bandwidth if k.kind == "collective" else sheet.bandwidth
        streaming = k.bytes / (bandwidth * c.bandwidth_efficiency)
        memory = c.min_kernel_seconds + streaming
        compute = 0.0
        if k.flops:
            efficiency = c.attention_efficiency if k.kind == "attention" else c.gemm_efficiency
            flops = k.flops / 2 if k.causal else k.flops
            compute = flops / (sheet.peak(k.dtype, k.precision) * efficiency)
        seconds = max(memory, compute)
        bound = "compute" if compute > memory else ("launch" if c.min_kernel_seconds >= streaming else "memory")
        out.append(ModeledKernel(k, k.launches * (seconds + c.gap_seconds), bound))
    return out


def model_step(hlo_text: str, target: Any, calibration: Calibration = CALIBRATION) -> ModeledStep:
    """The modeled time of one step of the optimized program ``hlo_text`` on ``target``
    (a :class:`train.inspections.targets.GpuTarget`)."""
    sheet = datasheet(target)
    kernels = model_kernels(read_hlo_kernels(hlo_text), sheet, calibration)
    return ModeledStep(sheet.name, sum(m.seconds for m in kernels), tuple(kernels), calibration)

"""A modeled TPU step time, from the program compiled for the TPU: a model, never a measurement.

As :mod:`train.inspections.gpu_time` does for a GPU, every op of the optimized
TPU program that does work (a fusion, a matmul, a copy, a collective; a loop
body's once per iteration: :mod:`train.inspections.hlo_kernels` reads them)
takes the longest of

- its HBM time: the bytes it moves in HBM over ``HBM bandwidth x e_bw``. An
  operand or result the compiler placed in the chip's VMEM (its layout says
  ``S(1)``) moves no HBM bytes; an asynchronous prefetch into VMEM (or an
  eviction from it, ``copy-start``, ``slice-start``) moves its bytes once;
- its matrix time: its FLOPs over ``matrix-unit peak x e_mxu``, with the peak of
  the operands' dtype: int8 at twice bf16's on a v5e or v6e, bf16, and a float32
  matmul at one, three or six bf16 passes (XLA's default, ``high``, ``highest``).
  The Pallas flash attention kernels count their products (two forward; four and
  three in the two backward kernels, with the recomputed scores; half of them
  causal) at the bf16 peak; the int8 matmul kernels
  (:mod:`precision.autocast.scaled.int8_pallas`) the FLOPs and HBM bytes their
  ``cost_estimate`` declares, at the int8 peak (a roofline: XLA writes no estimate
  of a custom call, so the quantization they do in VMEM is not in the model);
- XLA's own estimate of it: the ``estimated_cycles`` the TPU compiler writes on
  each op it made, at the chip's clock. It sees what the two rooflines do not:
  the vector units' elementwise work (an ``exp`` over the logits, a rounding to
  int8, a reduction of values already in VMEM) and transposes.

A TPU runs the whole step as one program: no kernel launches, no gap between ops.

No TPU profile has calibrated it: ``e_mxu`` is the H200 profile's GEMM share
(:data:`train.inspections.gpu_time.CALIBRATION`), the same for both dtypes, and
``e_bw`` the one share of bandwidth the H200 profile's memory-bound kernels reached
together (:data:`BANDWIDTH_EFFICIENCY`: with no launches, no latency per kernel), so
what it says best is how two programs for the same chip compare (``mixed_int8``
against ``mixed_bf16``), not the seconds. :func:`amdahl_bound` gives the best any
program could do against it with its matmuls at twice the rate and nothing else changed.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

from precision.autocast.scaled.int8_pallas import SCOPE as INT8_SCOPE, module_path as int8_module
from precision.autocast.tpu_flash import BACKWARD_SCOPE, FORWARD_SCOPE, module_path as attention_module
from train.inspections.gpu_kernels import attribute, instruction_lines
from train.inspections.gpu_time import CALIBRATION
from train.inspections.hlo_kernels import HloKernel, read_hlo_kernels

__all__ = ["BANDWIDTH_EFFICIENCY", "TpuDatasheet", "TPU_DATASHEETS", "TpuModeledStep", "model_tpu_step",
           "tpu_kernels", "xla_estimated_cycles", "xla_cycles_by_op", "amdahl_bound", "TpuOpTime", "op_times"]


#: The share of HBM bandwidth the H200 profile's memory-bound kernels reached together, small and large
#: (their bytes over their time: ``benchmarks/results/model-calibration.md`` of 2026-11-25). The GPU model
#: now splits it into a latency per kernel and a streaming share; a TPU program has no kernel launches.
BANDWIDTH_EFFICIENCY = 0.589


class TpuDatasheet(NamedTuple):
    """What a TPU chip's datasheet says: HBM bandwidth and the matrix units' dense peaks."""

    name: str
    bandwidth: float  # bytes/s
    bf16: float  # FLOP/s
    int8: float  # OP/s
    clock: float = 0.0  # Hz of its TensorCore (0: unknown), for XLA's estimated cycles

    def peak(self, dtype: str, precision: str = "") -> float:
        """The dense peak of a matmul with ``dtype`` operands (a float32 one: bf16 passes)."""
        if dtype in ("s8", "u8"):
            return self.int8
        if dtype == "f32":
            return self.bf16 / {"highest": 6, "high": 3}.get(precision, 1)
        return self.bf16


#: cloud.google.com/tpu/docs: v5e 197 bf16 TFLOP/s, 394 int8 TOPS, 819 GB/s (four 128 x 128 MXUs: a
#: 1.5 GHz clock); v5p 459 / 918, 2,765 GB/s; v6e 918 / 1,836, 1,640 GB/s.
TPU_DATASHEETS = {"v5e": TpuDatasheet("TPU v5e", 819e9, 197e12, 394e12, 197e12 / (4 * 128 * 128 * 2)),
                  "v5p": TpuDatasheet("TPU v5p", 2765e9, 459e12, 918e12),
                  "v6e": TpuDatasheet("TPU v6e", 1640e9, 918e12, 1836e12)}


class TpuModeledStep(NamedTuple):
    """The modeled time of one step of a TPU program, by what bounds each op."""

    device: str
    seconds: float
    memory_seconds: float  # of ops bound by HBM
    matmul_seconds: dict[str, float]  # of ops bound by the matrix units, per operand dtype
    matmul_flops: dict[str, float]  # per operand dtype (attention: "attention")
    xla_cycles: int = 0  # XLA's own TPU cost model: the estimated cycles of the step's ops
    clock: float = 0.0  # Hz, for xla_cycles
    vector_seconds: float = 0.0  # of ops bound by XLA's estimate (vector units, transposes)
    hbm_bytes: float = 0.0  # moved in HBM in one step

    @property
    def xla_seconds(self) -> float:
        """XLA's estimate of the step in seconds (0 where the chip's clock is not known)."""
        return self.xla_cycles / self.clock if self.clock else 0.0

    def int8_share(self) -> float:
        """The share of matmul FLOPs (attention's included) with int8 operands."""
        total = sum(self.matmul_flops.values())
        return self.matmul_flops.get("s8", 0.0) / total if total else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"what": "a model of the step time from the compiled TPU program (each op: the longest of its HBM "
                        "time, its matrix time and XLA's estimate; efficiencies borrowed from the H200 fit), "
                        "not a measurement",
                "device": self.device, "seconds": self.seconds, "memory_seconds": self.memory_seconds,
                "matmul_seconds": self.matmul_seconds, "vector_seconds": self.vector_seconds,
                "matmul_flops": self.matmul_flops, "hbm_bytes": self.hbm_bytes, "int8_share": self.int8_share(),
                "xla_estimated_cycles": self.xla_cycles, "xla_estimated_seconds": self.xla_seconds}

    def lines(self) -> list[str]:
        """The report's lines (``--compile-for``'s output)."""
        flops = ", ".join(f"{k} {v / 1e12:.2f}" for k, v in sorted(self.matmul_flops.items()))
        bound = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in sorted(self.matmul_seconds.items()))
        return [f"Modeled step time on {self.device} (a model from the compiled program, not a measurement): "
                f"{self.seconds * 1e3:.2f} ms; HBM-bound ops {self.memory_seconds * 1e3:.2f} ms "
                f"({self.hbm_bytes / 1e9:.1f} GB), matrix-bound {bound or 'none'}, vector-bound (XLA's estimate) "
                f"{self.vector_seconds * 1e3:.2f} ms", f"  matmul TFLOP by operand dtype: {flops or 'none'}",
                f"  XLA's own TPU cost model: {self.xla_cycles:,} cycles"
                + (f", {self.xla_seconds * 1e3:.2f} ms at {self.clock / 1e9:.2f} GHz" if self.clock else "")]


def _flash_flops(line: str) -> float:
    """The products of a Pallas flash attention kernel, from its query's (batch, heads, T, D) shape
    (the first rank-4 operand in its line): two forward; three (dq) or four (dk, dv) backward."""
    shape = re.search(r"\w+\[(\d+),(\d+),(\d+),(\d+)\]", line.partition("custom-call(")[0] + line)
    if shape is None:
        return 0.0
    b, h, t, d = (int(x) for x in shape.groups())
    op_name = attribute(line, "op_name")
    products = 2 if f"/{BACKWARD_SCOPE}" not in op_name else 3 if "dq" in op_name else 4
    return 2.0 * products * b * h * t * t * d


def xla_cycles_by_op(text: str) -> dict[str, int]:
    """XLA's own TPU cost model: the ``estimated_cycles`` its compiler writes on each op of the
    optimized program (its fusions, matmuls and copies; a fused computation's ops are its fusion's),
    by the op's name."""
    cycles, fused = {}, False
    for line in instruction_lines(text):
        if line and not line.startswith(" "):
            fused = line.startswith(("%fused", "fused")) or "fused_computation" in line.split("(")[0]
            continue
        m = None if fused else re.search(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*"estimated_cycles":"(\d+)"', line)
        if m:
            cycles[m.group(1)] = int(m.group(2))
    return cycles


def xla_estimated_cycles(text: str) -> int:
    """XLA's estimate of the whole program: the sum of :func:`xla_cycles_by_op`."""
    return sum(xla_cycles_by_op(text).values())


def _cost_estimate(line: str) -> tuple[float, float] | None:
    """(FLOPs, bytes accessed) a Pallas kernel's ``cost_estimate`` declares in its backend config."""
    m = re.search(r'"cost_estimate"\s*:\s*\{([^}]*)\}', line)
    fields = dict(re.findall(r'"(\w+)":"?(\d+)"?', m.group(1))) if m else {}  # any key order, quoted or not
    return (float(fields["flops"]), float(fields["bytes_accessed"])) if {"flops", "bytes_accessed"} <= fields.keys() \
        else None


def tpu_kernels(text: str) -> list[HloKernel]:
    """The ops of an optimized TPU program (:func:`read_hlo_kernels`), the flash attention
    kernels given their FLOPs (kind ``attention``), and the int8 matmul kernels
    (:mod:`precision.autocast.scaled.int8_pallas`) counted as int8 matmuls: their FLOPs and
    HBM bytes as their ``cost_estimate`` declares them (each operand once per block reading it)."""
    kernels = read_hlo_kernels(text)
    if FORWARD_SCOPE not in text and INT8_SCOPE not in text:
        return kernels
    by_name = {m.group(1): m.group(2) for m in re.finditer(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$",
                                                           "\n".join(instruction_lines(text)), re.M)}
    out = []
    for k in kernels:
        line = by_name.get(k.name, "")
        if "custom-call(" in line and FORWARD_SCOPE in line:
            k = k._replace(kind="attention", flops=_flash_flops(line), dtype="bf16", causal=True,
                           module=attention_module(k.module))
        elif "custom-call(" in line and f"/{INT8_SCOPE}/" in line and _cost_estimate(line):
            flops, moved = _cost_estimate(line)
            k = k._replace(kind="gemm", flops=flops, bytes=moved, dtype="s8",
                           module=int8_module(k.module))
        out.append(k)
    return out


class TpuOpTime(NamedTuple):
    """One op of a TPU program and its modeled time in one step (all its launches)."""

    kernel: HloKernel
    seconds: float
    bound: str  # "hbm", "matrix" or "xla" (XLA's estimate: vector units, transposes)


def op_times(hlo_text: str, chip: str, efficiency: float = CALIBRATION.gemm_efficiency,
             bandwidth_efficiency: float = BANDWIDTH_EFFICIENCY, matmul_speedup: float = 1.0,
             xla_estimates: bool = True) -> list[TpuOpTime]:
    """Each op of the optimized TPU program ``hlo_text`` with its modeled time on one chip of generation
    ``chip`` (``"v5e"``, ``"v5p"``, ``"v6e"``): the longest of its HBM, matrix and XLA-estimated times.
    ``matmul_speedup``: every matmul but attention's as if its matrix unit ran that many times faster,
    the rest of its op as it is: its XLA estimate less the time saved on its FLOPs at peak
    (:func:`amdahl_bound`). ``xla_estimates=False``: the two rooflines alone (an op kept in VMEM
    then takes no time)."""
    sheet = TPU_DATASHEETS[chip]
    cycles = xla_cycles_by_op(hlo_text) if sheet.clock and xla_estimates else {}
    out = []
    for k in tpu_kernels(hlo_text):
        memory = k.bytes / (sheet.bandwidth * bandwidth_efficiency)
        flops = k.flops / 2 if k.causal else k.flops
        faster = matmul_speedup if flops and k.kind != "attention" else 1.0
        peak = sheet.peak(k.dtype, k.precision)
        compute = flops / (peak * efficiency * faster) if flops else 0.0
        estimate = cycles.get(k.name, 0) / sheet.clock if sheet.clock else 0.0
        if faster != 1.0:  # the matrix unit's share of XLA's estimate (at peak) faster, the rest (its fused work) not
            estimate = max(estimate - flops / peak * (1.0 - 1.0 / faster), 0.0)
        seconds = max(memory, compute, estimate)
        bound = "matrix" if compute and compute == seconds else "xla" if estimate > memory else "hbm"
        out.append(TpuOpTime(k, seconds * k.launches, bound))
    return out


def model_tpu_step(hlo_text: str, chip: str, efficiency: float = CALIBRATION.gemm_efficiency,
                   bandwidth_efficiency: float = BANDWIDTH_EFFICIENCY,
                   matmul_speedup: float = 1.0, xla_estimates: bool = True) -> TpuModeledStep:
    """The modeled time of one step of the optimized TPU program ``hlo_text`` on one chip of
    generation ``chip``: the sum of its :func:`op_times` (the same arguments)."""
    sheet = TPU_DATASHEETS[chip]
    ops = op_times(hlo_text, chip, efficiency, bandwidth_efficiency, matmul_speedup, xla_estimates)
    memory_seconds, vector_seconds, matmul_seconds, matmul_flops = 0.0, 0.0, {}, {}
    for op in ops:
        k = op.kernel
        dtype = "attention" if k.kind == "attention" else k.dtype
        if k.flops:
            matmul_flops[dtype] = matmul_flops.get(dtype, 0.0) + (k.flops / 2 if k.causal else k.flops) * k.launches
        if op.bound == "matrix":
            matmul_seconds[dtype] = matmul_seconds.get(dtype, 0.0) + op.seconds
        elif op.bound == "xla":
            vector_seconds += op.seconds
        else:
            memory_seconds += op.seconds
    seconds = memory_seconds + vector_seconds + sum(matmul_seconds.values())
    cycles = xla_cycles_by_op(hlo_text) if sheet.clock and xla_estimates else {}
    return TpuModeledStep(sheet.name, seconds, memory_seconds, matmul_seconds, matmul_flops, sum(cycles.values()),
                          sheet.clock, vector_seconds, sum(op.kernel.bytes * op.kernel.launches for op in ops))


def amdahl_bound(hlo_text: str, chip: str, xla_estimates: bool = True) -> float:
    """The best ratio to this program's modeled step any program could reach with its matmuls (attention's
    aside) at twice the rate and everything else unchanged: the bound int8 matmuls face
    (:func:`model_tpu_step` with ``matmul_speedup=2``, over the step as it is)."""
    return (model_tpu_step(hlo_text, chip, matmul_speedup=2.0, xla_estimates=xla_estimates).seconds
            / model_tpu_step(hlo_text, chip, xla_estimates=xla_estimates).seconds)

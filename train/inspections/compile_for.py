"""``python -m train CONFIG --compile-for h100``: the experiment's train step,
compiled for a GPU (or a TPU slice: ``v5e``, ``v5p``, ``v6e``) this machine does not
have, and what that program does.

Before renting GPUs, learn whether a config fits and whether its policy reaches
the kernels it should: the train state is built abstractly (``jax.eval_shape``:
nothing allocated, so a model far larger than this machine can be described),
laid out on N compile-only devices of the target (:mod:`train.inspections.targets`), and one
train step is lowered and compiled by XLA's GPU compiler. The report reads the
compiled program (:mod:`train.inspections.gpu_kernels`, :mod:`train.parallel.communication`):

- memory per device from XLA's plan (arguments, outputs, aliased, temporaries)
  against the device's memory: whether it fits;
- the kernels: cuDNN attention forward and backward, GEMMs by library (cuBLAS,
  cuBLASLt, cuBLASLt FP8, Triton) and operand dtypes, cuDNN convolutions;
- under a half policy, every GEMM with a float32 operand, by module path, and
  which of them a rule asked for;
- the GEMMs with float32 operands by the arithmetic they run: TF32 at XLA's
  default precision, true float32 where a policy asked for it (``matmul=highest``);
- the collectives a step sends on N devices, with dtypes and bytes;
- the time to trace and lower, and to compile;
- a *modeled* step time (:mod:`train.inspections.gpu_time`: every kernel's bytes and FLOPs
  against the device's datasheet, calibrated on a profile measured on a GPU),
  with the kernels that take most of it: a model, never a measurement.

No autotuning runs without a GPU (XLA's default GEMM configurations), so it
proves structure, dtypes and memory, not speed.

For a TPU (libtpu's compile-only client, :mod:`train.inspections.targets`) the report
is the same but for the kernels: a TPU program's are its matrix-unit ops
(:mod:`train.inspections.tpu_kernels`), and its modeled time is a roofline of the
chip's datasheet (:mod:`train.inspections.tpu_time`). A float16 policy is refused
for a TPU (its matrix units multiply bfloat16), and so is FP8 (none of these
generations multiplies it), and FP8 for an A100. Under an int8 policy the report
gives the int8 share of the matmul FLOPs and what stays out
(:mod:`train.inspections.int8_share`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from collections import Counter
from typing import Any

import jax
import numpy as np

from train.parallel.communication import CommunicationReport, compile_partitioned, hlo_collectives, module_paths
from train.config import ConfigError, ExperimentConfig
from train.parallel.distributed import Layout, MeshError
from train.inspections.gpu_kernels import Kernel, read_kernels
from train.inspections.gpu_time import ModeledStep, model_step
from train.inspections.hlo_kernels import read_hlo_kernels
from train.inspections.int8_share import Int8Share, int8_share, matrix_unit_problem
from train.inspections.targets import (GpuTarget, Target, TargetError, TpuTarget, get_target, target_devices,
                                       target_slug)
from train.inspections.tpu_kernels import read_tpu_kernels
from train.inspections.tpu_time import TpuModeledStep, model_tpu_step, tpu_kernels
from train.config.tpu_policy import tpu_config_problem

__all__ = ["CompiledStep", "compile_for", "compile_train_step", "write_report", "TargetError", "DoesNotFitError",
           "check_tpu_policy"]

_KIND_NAMES = {"cudnn_attention": "cuDNN fused attention", "cudnn_attention_backward": "cuDNN fused attention (bwd)",
               "cublas": "cuBLAS GEMM", "cublaslt": "cuBLASLt GEMM", "cublaslt_fp8": "cuBLASLt FP8 GEMM",
               "triton_gemm": "Triton GEMM fusion", "xla_dot": "XLA dot (no GEMM library)",
               "cudnn_conv": "cuDNN convolution", "tpu_matmul": "TPU matmul (MXU)",
               "tpu_flash_attention": "Pallas flash attention", "tpu_flash_attention_backward": "Pallas flash attention (bwd)"}


@dataclasses.dataclass(frozen=True)
class CompiledStep:
    """One train step compiled for a GPU or TPU target, read back."""

    target: Target
    devices: int
    mesh: dict[str, int]
    experiment: str  # what was compiled: model, policy, batch
    policy_half: bool  # the policy computes in half (or fp8): float32 GEMMs are worth naming
    memory: dict[str, int]  # per device: argument, output, alias, temp, peak bytes
    kernels: tuple[Kernel, ...]
    communication: CommunicationReport  # what the target runs: its compiled program (a GPU's), or after partitioning
    seconds: dict[str, float]  # lower, compile
    hlo_text: str = dataclasses.field(default="", repr=False)  # the optimized program (compiled.as_text())
    modeled: ModeledStep | TpuModeledStep | None = dataclasses.field(default=None, repr=False)  # None: no datasheet
    modeled_error: str = ""  # why there is no model
    blockwise: Any = None  # precision.BlockwisePlan: the loss from large logits, a block of rows at a time
    int8: Int8Share | None = None  # under an int8 policy: the int8 share of matmul FLOPs, what stays out
    partitioned: CommunicationReport | None = dataclasses.field(default=None, repr=False)  # right after partitioning
    tensor_plan: Any = dataclasses.field(default=None, repr=False)  # how mesh.tensor splits the params, if it does

    @property
    def fits(self) -> bool:
        return self.memory["peak"] <= self.target.memory_bytes

    def f32_gemms(self, declared: bool = False) -> dict[str, int]:
        """GEMMs with a float32 operand, counted by module path ("" for an op outside any
        module): outside float32 regions (rules, ``precision.compute_in``), or, with
        ``declared``, inside them."""
        return dict(Counter(k.module for k in self.kernels
                            if k.gemm and k.has_f32_operand and (k.region == "float32") == declared))

    def f32_gemm_algorithms(self) -> dict[str, int]:
        """GEMMs with both operands float32, counted by the arithmetic they run on the target
        (:func:`train.inspections.gpu_kernels.f32_algorithm`): ``tf32`` (XLA's default precision on
        a GPU with TF32), ``f32`` (``matmul=highest``...), ``bf16_3x``..."""
        as_read = isinstance(self.target, TpuTarget) or _has_tf32(self.target)  # else TF32 falls back to f32
        return dict(Counter(k.algorithm if as_read or k.algorithm != "tf32" else "f32"
                            for k in self.kernels if k.algorithm))

    def kernel_rows(self) -> list[dict[str, Any]]:
        """One row per (kernel kind, operand dtypes): how many."""
        counts = Counter((k.kind, k.operands) for k in self.kernels)
        order = list(_KIND_NAMES)
        return [{"kind": kind, "operands": list(ops), "count": n} for (kind, ops), n in
                sorted(counts.items(), key=lambda kv: (order.index(kv[0][0]) if kv[0][0] in order else 99, kv[0][1]))]

    def count(self, kind: str | None = None, fp8: bool | None = None) -> int:
        """Kernels of ``kind`` (None: any GEMM); ``fp8``: only (or no) FP8 GEMMs."""
        return sum(1 for k in self.kernels if (k.kind == kind if kind else k.gemm)
                   and (fp8 is None or k.fp8 == fp8))

    def to_json(self) -> dict[str, Any]:
        return {"target": self.target.name, "device_kind": self.target.device_kind,
                "device_memory_bytes": self.target.memory_bytes, "devices": self.devices, "mesh": self.mesh,
                "experiment": self.experiment, "fits": self.fits, "memory": self.memory,
                "kernels": self.kernel_rows(), "gemms": self.count(), "fp8_gemms": self.count(fp8=True),
                "f32_gemms": self.f32_gemms() if self.policy_half else {},
                "f32_gemms_in_float32_regions": self.f32_gemms(declared=True) if self.policy_half else {},
                "f32_gemm_algorithms": self.f32_gemm_algorithms(),
                "collectives": self.communication.rows(), "collectives_stage": self.communication.stage,
                "collectives_partitioned": self.partitioned.rows() if self.partitioned is not None else None,
                "collectives_by_layer": (self.partitioned or self.communication).layers(), "seconds": self.seconds,
                "modeled": self.modeled.to_json() if self.modeled is not None else {"error": self.modeled_error},
                "blockwise_loss": self.blockwise._asdict() if self.blockwise is not None else None,
                "int8": self.int8.to_json() if self.int8 is not None else None,
                "tensor_layout": self.tensor_plan.lines() if self.tensor_plan is not None else None,
                "jax": jax.__version__}

    def __str__(self) -> str:
        m, t = self.memory, self.target
        lines = [f"Compiled for {t.device_kind} ({t.name}; {self.devices} device{'s' * (self.devices > 1)}, mesh "
                 f"{self.mesh}; compile-only: XLA's default kernels, no autotuning) in "
                 f"{self.seconds['compile']:.1f} s, after {self.seconds['lower']:.1f} s to trace and lower",
                 f"  one train step of {self.experiment}",
                 f"Memory per device (XLA's plan): arguments {_size(m['argument'])}, outputs {_size(m['output'])} "
                 f"({_size(m['alias'])} aliased), temporaries {_size(m['temp'])}",
                 f"  peak about {_size(m['peak'])} of {t.memory_bytes / 2 ** 30:.1f} GiB: "
                 + ("fits" if self.fits else "DOES NOT FIT" + blocks_hint(self.blockwise)),
                 "Kernels:", f"  {'kind':<30}{'operands':<24}{'count':>6}"]
        for row in self.kernel_rows():
            lines.append(f"  {_KIND_NAMES.get(row['kind'], row['kind']):<30}{' x '.join(row['operands']):<24}"
                         f"{row['count']:>6}")
        if not self.kernels:
            lines.append("  no GEMM, attention or convolution kernel")
        lines += _algorithm_lines(self.f32_gemm_algorithms())
        fp8 = self.count(fp8=True)
        if fp8 or "f8" in self.experiment:
            lines.append(f"FP8 GEMMs: {fp8} of {self.count()} GEMMs")
        if self.int8 is not None:
            lines += self.int8.lines()
        if self.policy_half:
            lines += self._f32_lines()
        if self.tensor_plan is not None:
            lines.append(self.tensor_plan.lines()[0] + " (--explain lists each param's layout)")
        if self.devices > 1:
            lines.append(str(self.communication))
            lines += (self.partitioned or self.communication).layer_lines(top=12)
        if self.blockwise is not None:
            lines.append(self.blockwise.describe())
        lines += self.modeled.lines() if self.modeled is not None else [f"Modeled step time: none ({self.modeled_error})"]
        return "\n".join(lines)

    def _f32_lines(self) -> list[str]:
        lines = []
        for declared, what in ((False, "GEMMs with a float32 operand"),
                               (True, "GEMMs with a float32 operand in float32 regions (rules)")):
            f32 = self.f32_gemms(declared)
            if not f32:
                lines += [] if declared else [f"{what}: none"]
                continue
            lines.append(f"{what}: {sum(f32.values())}")
            lines += [f"  {module or '(outside any module)'}: {n}"
                      for module, n in sorted(f32.items(), key=lambda kv: (-kv[1], kv[0]))]
        return lines


#: How the report names the arithmetic of a float32 GEMM.
_ALGORITHM_NAMES = {"tf32": "TF32 (XLA's default precision)", "f32": "float32",
                    "bf16": "one bfloat16 pass (XLA's default precision on a TPU)", "bf16_3x": "three bfloat16 passes",
                    "bf16_6x": "six bfloat16 passes (float32 accuracy)"}


def _algorithm_lines(counts: dict[str, int]) -> list[str]:
    """``Float32 GEMMs by arithmetic: 10 TF32 (XLA's default precision), 2 float32`` (none: no line)."""
    if not counts:
        return []
    shown = ", ".join(f"{n} {_ALGORITHM_NAMES.get(name, name)}" for name, n in
                      sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    return [f"Float32 GEMMs by arithmetic: {shown}"]


def _has_tf32(target: GpuTarget) -> bool:
    """Whether the target's tensor cores run TF32 (compute capability 8.0 or later)."""
    m = re.search(r"cuda_compute_capability\s*\{\s*major:\s*(\d+)", target.config_text)
    return m is None or int(m.group(1)) >= 8


def compile_for(config: ExperimentConfig, target: str | Target = "h100", devices: int | None = None
                ) -> CompiledStep:
    """Compiles one train step of ``config`` for ``target`` (``"h100"``, ``"h200"``, a
    ``GpuTargetConfigProto`` text file, ``"v5e"``, ``"v5p"``, ``"v6e"`` or a TPU slice such as
    ``"v5p:2x2x2"``) on ``devices`` of it (default: the config's mesh size, a given slice's
    chips under ``mesh.data=-1``, else 1), without the device, and reads the program back.

    Raises:
      TargetError: no CUDA plugin (libtpu) here, an unknown target, a policy the target cannot
        run (float16 or FP8 on a TPU), or a mesh that does not fit the devices.
      ConfigError, DataError: the config cannot run (as :func:`train.run` would say).
    """
    from train.experiment.builders import build_train_state
    from train.experiment.loop import build_experiment

    gpu = get_target(target)
    if isinstance(gpu, TpuTarget):
        check_tpu_policy(config, gpu)
    problem = matrix_unit_problem(config, gpu)
    if problem:
        raise TargetError(problem)
    layout = _layout(config, target_devices(gpu, devices or _default_devices(config, gpu)))
    data, task, model = build_experiment(config, memory=(0, ""))  # XLA's plan says what fits, below
    start = time.perf_counter()
    # nothing allocated; XLA's plan says what fits, below
    state = jax.eval_shape(lambda: build_train_state(config, model, data, layout, memory=(0, ""))[0])
    size = config.data.batch_size * config.accum_steps
    batch = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype),
                                   data.train_batch(0, size, config.seed))
    return compile_train_step(state, batch, layout, gpu, task=task, accum_steps=config.accum_steps,
                              experiment=_describe(config, state, size), started=start)


def compile_train_step(state: Any, batch: Any, layout: Layout, target: Target, *, task: Any = "classification",
                       accum_steps: int = 1, experiment: str = "", started: float | None = None) -> CompiledStep:
    """Compiles :func:`train.make_train_step`'s step for ``target`` on the
    compile-only devices of ``layout``'s mesh and reads the program back.
    ``state``, ``batch``: abstract (``jax.eval_shape``), placed here by ``layout``."""
    from train.training.forward import blockwise_plan
    from train.training.step import make_train_step, step_layout

    start = time.perf_counter() if started is None else started
    layout = step_layout(layout, state, "compile_train_step")  # with the plan the state was created in, if any
    state = _placed(state, layout.state(state))
    batch = _placed(batch, jax.tree_util.tree_map(lambda _: layout.batch(), batch))
    lowered = make_train_step(accum_steps=accum_steps, layout=layout, task=task).lower(state, batch)
    lowered_at = time.perf_counter()
    try:
        compiled, partitioned = compile_partitioned(lowered)
    except jax.errors.JaxRuntimeError as e:
        raise _refused(e, experiment, layout.mesh.devices.size, target) from None
    done = time.perf_counter()
    text, count = compiled.as_text(), layout.mesh.devices.size
    stage = "partitioned" if partitioned is not None else "compiled"
    modeled, why = _modeled(text, target)
    policy = state.model.policy
    scaled = policy.int8 or any(rule.policy.int8 for rule in getattr(state.model, "rules", ()))
    modules = module_paths(state.params)
    after = CommunicationReport(tuple(hlo_collectives(partitioned or text, count)), stage, target.name, modules)
    # a GPU's compiled program is what it sends (its reduce-scatters made of all-reduces and slices)
    sent = (CommunicationReport(tuple(hlo_collectives(text, count)), "compiled", target.name, modules)
            if isinstance(target, GpuTarget) else after)
    return CompiledStep(
        target=target, devices=count, mesh=dict(layout.mesh.shape), experiment=experiment,
        policy_half=np.dtype(state.model.policy.compute_dtype).itemsize < 4, memory=_memory(compiled),
        kernels=tuple(read_tpu_kernels(text) if isinstance(target, TpuTarget) else read_kernels(text)),
        communication=sent, partitioned=after, tensor_plan=layout.tensor_plan,
        seconds={"lower": round(lowered_at - start, 2), "compile": round(done - lowered_at, 2)}, hlo_text=text,
        modeled=modeled, modeled_error=why,
        blockwise=blockwise_plan(state, batch, task=task, accum_steps=accum_steps, layout=layout),
        int8=int8_share(_hlo_kernels(text, target)) if scaled else None)


class DoesNotFitError(ValueError):
    """The target's compiler refused the step for its memory (XLA:TPU does, where XLA:GPU plans
    past the device and the report says it does not fit): no program to report."""


def _refused(error: Exception, experiment: str, devices: int, target: Target) -> Exception:
    """The compiler's error as :class:`DoesNotFitError` where it ran out of device memory, else as it is."""
    message = str(error)
    if "RESOURCE_EXHAUSTED" not in message:
        return error
    said = message.split("RESOURCE_EXHAUSTED:", 1)[1].strip().splitlines()[0]
    step = f"one train step of {experiment}" if experiment else "the train step"
    return DoesNotFitError(f"{step} does not fit {devices} {target.name} device(s), "
                           f"and XLA's compiler refused to compile it: {said} Less memory: model.remat=full, "
                           f"a smaller data.batch_size, or the step split over more devices (--devices N with "
                           f"mesh.fsdp=N)")


def blocks_hint(plan: Any) -> str:
    """What to try when a step does not fit and its loss from the logits stays whole only
    because ``precision.blockwise_loss: auto`` found them small enough (docs/blockwise-loss.md)."""
    if plan is None or plan.found or "precision.blockwise_loss=true" not in plan.reason:
        return ""
    return " (its loss from the logits in blocks of rows may fit it: precision.blockwise_loss=true)"


def _hlo_kernels(text: str, target: Target) -> list:
    """Every op of the program with its bytes and FLOPs (:mod:`train.inspections.hlo_kernels`)."""
    return tpu_kernels(text) if isinstance(target, TpuTarget) else read_hlo_kernels(text)


def _modeled(text: str, target: Target) -> tuple[ModeledStep | TpuModeledStep | None, str]:
    """The modeled step time of ``text`` on ``target``, or None and why (a target whose
    compute capability has no datasheet peaks here)."""
    if isinstance(target, TpuTarget):
        return model_tpu_step(text, target.generation), ""
    try:
        return model_step(text, target), ""
    except ValueError as e:
        return None, str(e)


def _size(n: float) -> str:
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} bytes"


def check_tpu_policy(config: ExperimentConfig, target: TpuTarget) -> None:
    """Refuses, in one line, a policy (or a rule's) that computes in float16 or FP8 for a TPU target."""
    problem = tpu_config_problem(config, target)
    if problem:
        raise TargetError(problem)


def _default_devices(config: ExperimentConfig, target: Target) -> int | None:
    """Devices to compile on when --devices is not given: all of a given TPU slice's chips under
    ``mesh.data=-1`` (None), else the config's mesh size."""
    if isinstance(target, TpuTarget) and target.topology and config.mesh.data == -1:
        return None
    return _mesh_devices(config)


def _mesh_devices(config: ExperimentConfig) -> int:
    mesh = config.mesh
    return (1 if mesh.data == -1 else mesh.data) * mesh.fsdp * mesh.tensor


def _layout(config: ExperimentConfig, devices: list) -> Layout:
    from train.experiment.loop import mesh_layout

    try:
        layout = mesh_layout(config, devices)
    except MeshError as e:
        raise TargetError(f"{e} (--devices {len(devices)})".replace(
            "; use mesh.data=-1 to take all of them, or set XLA_FLAGS=--xla_force_host_platform_device_count=N for "
            "N CPU devices", "")) from None
    return layout


def _placed(state: Any, shardings: Any) -> Any:
    return jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)


def _memory(compiled: Any) -> dict[str, int]:
    """XLA's memory plan per device; ``peak``: what must be resident at once (live
    arguments, outputs not aliased to them, temporaries)."""
    stats = compiled.memory_analysis()
    m = {"argument": int(stats.argument_size_in_bytes), "output": int(stats.output_size_in_bytes),
         "alias": int(stats.alias_size_in_bytes), "temp": int(stats.temp_size_in_bytes),
         "code": int(getattr(stats, "generated_code_size_in_bytes", 0))}
    m["peak"] = m["argument"] + m["output"] - m["alias"] + m["temp"] + m["code"]
    return m


def _describe(config: ExperimentConfig, state: Any, batch: int) -> str:
    params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(state.params))
    shape = getattr(config.data, "seq_len", None)
    tokens = f" x {shape} tokens" if config.data.name in ("shakespeare", "synthetic_text") and shape else ""
    return (f"{config.model.name} ({params / 1e6:.1f}M params), policy {config.precision.policy}, "
            f"batch {batch}{tokens}")


def write_report(report: CompiledStep, workdir: str) -> str:
    """Writes ``WORKDIR/compiled-<target>.json``; returns its path."""
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, f"compiled-{target_slug(report.target)}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report.to_json(), f, indent=1)
    return path

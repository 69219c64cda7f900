"""The H100 (or TPU) program of every policy on the benchmark models, compiled without the device.

Each model of the suite at its ``gpu`` size (:mod:`benchmarks.workloads`: the
GPT at the GPT-2-small shape, 16 x 1024 tokens; its pinned-dtype twin, every
layer ``dtype=float32``; the ResNet; the MLP) under every policy of the suite
and ``mixed_fp8`` (``min_size`` 0, and the default), its train step compiled
for the target by JAX's compile-only CUDA client (:func:`train.compile_for`'s
machinery) and read back: XLA's memory plan, cuDNN attention calls, GEMMs by
operand dtype (float32, half, FP8), cuDNN convolutions, compile time.

What it proves: the kernels, their operand dtypes and the memory plan XLA's GPU
compiler makes for the target. What it does not: time. No autotuning runs
without a GPU, so GEMMs get XLA's default configurations (Triton fusions where
a tuned run might pick cuBLAS), and nothing is executed.

For a TPU (``--target v5e``, libtpu's compile-only client): the same rows with the
program's matrix-unit ops (matmuls and convolutions) by operand dtype; float16 and
FP8 policies are left out, as ``--compile-for`` refuses them for a TPU.

    python -m benchmarks.compiled [--target h100] [--models gpt,mlp] [--policies fp32,mixed_bf16] [--out DIR]

Needs JAX's CUDA plugin (``pip install '.[gpu-compile]'``), or libtpu for a TPU
(``pip install '.[tpu-compile]'``); run with ``JAX_PLATFORMS=cpu``. Writes
``<target>-compiled.{json,md}`` to ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any

import jax
import jax.numpy as jnp
import optax

import precision
from benchmarks.compile_only import chosen, target_device, target_slug
from benchmarks.report import RESULTS, command, environment
from benchmarks.workloads import POLICIES, policy_case, workload
from train import create_train_state
from train.config.tpu_policy import tpu_policy_problem
from train.inspections.compile_for import compile_train_step
from train.inspections.targets import TpuTarget
from train.parallel.distributed import Layout, make_mesh

MODELS = ("gpt", "gpt_pinned", "resnet", "mlp")
#: name -> (policy preset, loss scale, fp8 min_size or None)
CASES = {**{c.name: (c.policy, c.loss_scale, None) for c in POLICIES},
         "mixed_fp8": ("mixed_fp8", "none", 0), "mixed_fp8_default": ("mixed_fp8", "none", None)}


def measure(model_name: str, case: str, target: Any, device: Any) -> dict[str, Any]:
    """One model under one policy case, compiled for ``target``: its row of the table."""
    w = workload(model_name, "gpu")
    policy, loss_scale, min_size = CASES[case]
    fp8 = precision.fp8_options(min_size=min_size) if min_size is not None else None
    precision_name = policy_case(case).matmul_precision if case in {c.name for c in POLICIES} else None
    task = "language_model" if w.tokens_per_example > 1 else "classification"
    with jax.default_matmul_precision(precision_name or "default"):
        sample = jnp.zeros((1, *w.inputs.shape[1:]), w.inputs.dtype)
        state = jax.eval_shape(lambda: create_train_state(w.model, policy, optax.adamw(1e-3), jax.random.PRNGKey(0),
                                                          sample, loss_scale=loss_scale, fp8=fp8))
        labels = w.inputs.shape if task == "language_model" else w.inputs.shape[:1]
        batch = {"inputs": w.inputs, "labels": jax.ShapeDtypeStruct(labels, "int32")}
        report = compile_train_step(state, batch, Layout(make_mesh(1, 1, [device])), target, task=task,
                                    experiment=f"{model_name} {case}")
    kinds = {k: report.count(k) for k in ("cudnn_attention", "cudnn_attention_backward", "cudnn_conv",
                                          "tpu_flash_attention", "tpu_flash_attention_backward")}
    gemms = [k for k in report.kernels if k.gemm]
    convs = [k for k in report.kernels if k.kind == "cudnn_conv"]
    return {"model": model_name, "policy": case, "memory": report.memory, "fits": report.fits,
            **kinds, "gemms": len(gemms), "f32_gemms": sum(k.has_f32_operand for k in gemms),
            "half_gemms": sum(not k.has_f32_operand and not k.fp8 for k in gemms),
            "fp8_gemms": sum(k.fp8 for k in gemms), "f32_convs": sum(k.has_f32_operand for k in convs),
            "gemm_libraries": sorted({k.kind for k in gemms}), "seconds": report.seconds}


def table(rows: list[dict[str, Any]], tpu: bool = False) -> str:
    """The rows as markdown, temporaries against the same model's fp32 (a TPU's: its matmuls, no cuDNN)."""
    fp32 = {r["model"]: r["memory"]["temp"] for r in rows if r["policy"] == "fp32"}
    head = ("| model | policy | peak GiB | temp GiB | temp / fp32 | flash attn fwd / bwd | matmuls | f32 | half "
            "| compile s |" if tpu else
            "| model | policy | peak GiB | temp GiB | temp / fp32 | cuDNN attn fwd / bwd | GEMMs | f32 | half | fp8 "
            "| convs f32 | compile s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        m = r["memory"]
        ratio = f"{m['temp'] / fp32[r['model']]:.2f}" if fp32.get(r["model"]) else "-"
        kernels = (f"{r.get('tpu_flash_attention', 0)} / {r.get('tpu_flash_attention_backward', 0)} | {r['gemms']} | "
                   f"{r['f32_gemms']} | {r['half_gemms']}" if tpu else
                   f"{r['cudnn_attention']} / {r['cudnn_attention_backward']} | {r['gemms']} | {r['f32_gemms']} | "
                   f"{r['half_gemms']} | {r['fp8_gemms']} | {r['f32_convs']} of {r['cudnn_conv']}")
        lines.append(f"| {r['model']} | {r['policy']} | {m['peak'] / 2 ** 30:.2f} | {m['temp'] / 2 ** 30:.2f} | "
                     f"{ratio} | {kernels} | {r['seconds']['compile']:.1f} |")
    return "\n".join(lines)


def markdown(result: dict[str, Any]) -> str:
    """The table's page: what was compiled, the rows, and what they prove."""
    tpu = result.get("platform") == "tpu"
    client = "libtpu's compile-only client" if tpu else "JAX's compile-only CUDA client"
    return (f"# Train steps compiled for {result['device_kind']} without one\n\n"
            f"`{result['command']}` (jax {result['environment']['jax']}, {client} on "
            f"{result['environment']['device']}, {result['environment']['date']}). One train step per row, "
            f"batch sizes of `benchmarks/workloads.py`'s `gpu` size (GPT: 16 x 1024 tokens). Peak: arguments + "
            f"outputs - aliased + temporaries, per device, from XLA's memory plan; "
            + ("flash attn: the Pallas flash attention kernels (forward; backward, two per layer); matmuls: the "
               "program's other matrix-unit ops (matmuls and convolutions) by operand dtype.\n\n" if tpu else
               "GEMMs by operand dtype; convs: cuDNN convolutions with a float32 operand, of all.\n\n")
            + f"{table(result['rows'], tpu)}\n\n" + (_TPU_NOTE if tpu else _GPU_NOTE))


_GPU_NOTE = ("What it proves: the kernels XLA's GPU compiler chose for an H100, their operand dtypes and the memory "
             "plan: under every half policy the GPT's attention is cuDNN's fused kernel forward and backward in "
             "every layer, every GEMM and convolution reads half (or FP8) operands, pinned `dtype=float32` layers "
             "included, and temporaries fall to a quarter of fp32's for the GPT, half for the ResNet. `mixed_fp8` "
             "at the default `min_size` (1024) makes no FP8 GEMM at the GPT-2-small shape (d_model 768), as "
             "`explain` says. What it does not prove: time. No autotuning runs without a GPU, so GEMMs get XLA's "
             "default Triton configurations (a tuned run may pick cuBLAS), and nothing executes; the allocator's "
             "peak on a device adds the CUDA context and fragmentation to XLA's plan.\n")
_TPU_NOTE = ("What it proves: the program XLA's TPU compiler makes for one chip: under the bfloat16 policies the "
             "GPTs' attention is JAX's Pallas flash attention in every layer (one kernel forward, two backward: "
             "no `[batch, heads, T, T]` scores kept), every "
             "matmul and convolution reads bfloat16 operands, pinned `dtype=float32` layers included, and XLA's "
             "memory plan against the chip's HBM. float16 and FP8 policies are not compiled: a TPU's matrix units "
             "multiply bfloat16 (`--compile-for` refuses them in one line). float32 matmuls at XLA's default "
             "precision run as one bfloat16 pass on a TPU (`fp32` rows), six at `highest`. What it does not prove: "
             "time; nothing executes.\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compiled", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="h100", help="h100, h200, a100, a GpuTargetConfigProto text file, v5e, v5p or v6e")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--policies", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--out", default=str(RESULTS), help="directory for <target>-compiled.{json,md}")
    args = p.parse_args(argv)
    models, cases = chosen(p, models=(args.models, MODELS), policies=(args.policies, CASES))
    found = target_device(args.target)
    if found is None:
        return 2
    target, device = found
    tpu = isinstance(target, TpuTarget)
    if tpu:
        cases = [c for c in cases if not tpu_policy_problem(CASES[c][0], target)]
    rows = []
    for model_name in models:
        for case in (["fp32"] if "fp32" not in cases else []) + cases:
            rows.append(measure(model_name, case, target, device))
            print(f"{model_name:<12}{case:<18}temp {rows[-1]['memory']['temp'] / 2 ** 30:7.2f} GiB  "
                  f"GEMMs {rows[-1]['gemms']} (f32 {rows[-1]['f32_gemms']}, fp8 {rows[-1]['fp8_gemms']})", flush=True)
    text = table(rows, tpu)
    name = target_slug(target)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"target": target.name, "device_kind": target.device_kind, "platform": "tpu" if tpu else "cuda",
              "environment": environment(),
              "command": command("benchmarks.compiled", argv), "rows": rows}
    (out / f"{name}-compiled.json").write_text(json.dumps(result, indent=1))
    (out / f"{name}-compiled.md").write_text(markdown(result))
    print(f"\n{text}\n\nwrote {out / f'{name}-compiled.json'} and {out / f'{name}-compiled.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

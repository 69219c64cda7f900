"""Fine-tuning's cost: full fine-tuning against LoRA on a bf16, int8 or nf4 base.

For a GPT-2-small (163M params, vocabulary 50,304), a Llama-style 1.6B decoder (width 2,048,
16 layers, vocabulary 128,256) and a Llama-style 9.6B one (width 4,096, 32 layers, 32 heads,
the 8B class), each under ``mixed_bf16`` with AdamW:

- **train-state bytes per param**, exact from the state's shapes and dtypes
  (:func:`precision.state_bytes`: params, float32 masters, optimizer state);
- **on the target GPU** (JAX's compile-only CUDA client, no GPU here): XLA's memory plan of
  one train step, its arguments (the state and batch) and its peak, whether it fits the
  device, and the modeled step time (:mod:`train.inspections.gpu_time`, **a model, not a
  measurement**);
- **on this CPU** (``--cpu``): a small GPT's step time, LoRA against full fine-tuning, a ratio
  measured in one run (absolute CPU times say nothing of a GPU's);
- **accuracy** (``--accuracy WORKDIR``): the shipped default experiment fine-tuned in full and
  with LoRA on each base, from the same 300-step run.

LoRA: rank 16 on every Dense / DenseGeneral (``train.FineTune(lora=train.LoRA(16), base=...)``).

    python -m benchmarks.finetune_cost [--target h100] [--models gpt2,llama1b,llama8b] [--cpu]
                                       [--accuracy WORKDIR] [--out DIR]

Needs JAX's CUDA plugin for the GPU columns (``pip install '.[gpu-compile]'``; ``JAX_PLATFORMS=cpu``).
Writes ``finetune-cost-<target>.{json,md}``.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import optax

import precision
import train
from benchmarks.compile_only import chosen, target_device, target_slug
from benchmarks.report import RESULTS, command, environment, write_tables
from benchmarks.step_models import Llama, PinnedGPT
from train.inspections.compile_for import compile_train_step
from train.inspections.gpu_time import model_step
from train.parallel.distributed import Layout, make_mesh

SEQ = 1024
#: name -> (model, rows of 1,024 tokens per step)
MODELS = {"gpt2": (lambda: PinnedGPT(50304, SEQ, 768, 12, 12), 16),
          "llama1b": (lambda: Llama(128256, 2048, 16, 16), 16),
          "llama8b": (lambda: Llama(128256, 4096, 32, 32), 4)}
#: variant -> the fine-tuning (None: full fine-tuning, every param trained)
VARIANTS = {"full": None,
            "lora-bf16": train.FineTune(lora=train.LoRA(16), base="bf16"),
            "lora-int8": train.FineTune(lora=train.LoRA(16), base="int8"),
            "lora-nf4": train.FineTune(lora=train.LoRA(16), base="nf4")}


def abstract_state(model: Any, finetune: Any, sample: Any) -> Any:
    """The train state's shapes and dtypes (nothing allocated)."""
    return jax.eval_shape(lambda: train.create_train_state(model, "mixed_bf16", optax.adamw(1e-4),
                                                           jax.random.key(0), sample, finetune=finetune))


def gpu_row(name: str, variant: str, target: Any, device: Any) -> dict[str, Any]:
    """One model under one fine-tuning: state bytes, XLA's plan for ``target``, the modeled time."""
    make, rows = MODELS[name]
    tokens = jax.ShapeDtypeStruct((rows, SEQ), jnp.int32)
    state = abstract_state(make(), VARIANTS[variant], jnp.zeros((1, SEQ), jnp.int32))
    per_param = precision.state_bytes(state.params, state.opt_state)
    step = compile_train_step(state, {"inputs": tokens, "labels": tokens}, Layout(make_mesh(1, 1, [device])), target,
                              task="language_model")
    modeled = model_step(step.hlo_text, target)
    count = sum(precision.quantized_weights.logical_size(x)
                for x in jax.tree_util.tree_leaves(state.params, is_leaf=precision.quantized_weights.is_quantized))
    trained = sum(x.size for x in jax.tree_util.tree_leaves(state.trained_params))
    return {"model": name, "variant": variant, "rows": rows, "params": count, "trained": trained,
            "bytes_per_param": per_param, "argument": step.memory["argument"], "temp": step.memory["temp"],
            "peak": step.memory["peak"], "fits": step.memory["peak"] <= target.memory_bytes,
            "modeled_seconds": modeled.seconds}


def cpu_ratios(steps: int = 20) -> dict[str, float]:
    """A small GPT's train step time here, each LoRA variant over full fine-tuning (median of ``steps``)."""
    from train.models import GPT

    model = GPT(vocab_size=2048, block_size=128, num_layers=4, num_heads=4, d_model=256)
    batch = {"inputs": jnp.zeros((8, 128), jnp.int32), "labels": jnp.zeros((8, 128), jnp.int32)}
    times = {}
    for variant, finetune in VARIANTS.items():
        state = train.create_train_state(model, "mixed_bf16", optax.adamw(1e-4), jax.random.key(0),
                                         batch["inputs"][:1], finetune=finetune)
        step = train.make_train_step()
        state, _ = step(state, batch)  # compile
        samples = []
        for _ in range(steps):
            start = time.perf_counter()
            state, metrics = step(state, batch)
            jax.block_until_ready(metrics["loss"])
            samples.append(time.perf_counter() - start)
        times[variant] = sorted(samples)[len(samples) // 2]
    return {variant: t / times["full"] for variant, t in times.items()}


def accuracy_rows(workdir: str, steps: int = 300) -> list[dict[str, Any]]:
    """The shipped default experiment (digits, an MLP, mixed_f16) trained ``steps``, then
    fine-tuned ``steps`` more from it: in full, and with LoRA (rank 4) on each base. Test
    accuracy and train-state bytes per param, as the runs print them."""
    import io
    import os

    from train.config import load_config

    common = [f"steps={steps}", "progress=false", "inference_dtypes=[]"]
    base_dir = os.path.join(workdir, "base")
    base = train.run(load_config("configs/default.yaml", [f"workdir={base_dir}", *common]), out=io.StringIO())
    rows = [{"variant": "base (from scratch)", "accuracy": base["eval"]["accuracy"], "bytes_per_param": None}]
    for variant, extra in (("full", []), *((f"lora-{b}", ["finetune.lora.rank=4", f"finetune.base={b}"])
                                           for b in ("bf16", "int8", "nf4"))):
        out = io.StringIO()
        tuned = train.run(load_config("configs/default.yaml", [
            f"workdir={os.path.join(workdir, variant)}", f"model.init_from={base_dir}", *common, *extra]), out=out)
        per_param = float(out.getvalue().split("train state: ")[1].split(" bytes/param")[0])
        rows.append({"variant": variant, "accuracy": tuned["eval"]["accuracy"], "bytes_per_param": per_param})
    return rows


def table(rows: list[dict[str, Any]], memory: int) -> str:
    """The rows as markdown."""
    lines = ["| model (params) | fine-tuning | trained | state bytes/param | state GiB | step peak GiB | "
             f"fits {memory / 2**30:.0f} GiB | modeled ms |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = r["bytes_per_param"]
        lines.append(f"| {r['model']} ({r['params'] / 1e9:.2f}B, {r['rows']} x {SEQ} tokens) | {r['variant']} | "
                     f"{100 * r['trained'] / r['params']:.2g}% | {b['total']:.2f} (params {b['params']:.2f}, masters "
                     f"{b['masters']:.2f}, optimizer {b['optimizer']:.2f}) | {b['total'] * r['params'] / 2**30:.1f} | "
                     f"{r['peak'] / 2**30:.1f} | {'yes' if r['fits'] else 'no'} | {r['modeled_seconds'] * 1e3:.1f} |")
    return "\n".join(lines)


def accuracy_table(rows: list[dict[str, Any]]) -> str:
    """The accuracy rows as markdown."""
    lines = ["| run | test accuracy | train state bytes/param |", "|---|---|---|"]
    for r in rows:
        per_param = "" if r["bytes_per_param"] is None else f"{r['bytes_per_param']:.1f}"
        lines.append(f"| {r['variant']} | {r['accuracy']:.4f} | {per_param} |")
    return "\n".join(lines)


def markdown(result: dict[str, Any]) -> str:
    env = result["environment"]
    cpu = result.get("cpu_ratios")
    accuracy = ("\n\nAccuracy (`--accuracy`): the shipped default experiment (digits, an MLP, mixed_f16) trained 300 "
                "steps, then 300 more from it in full or with LoRA rank 4 on each base (`model.init_from`):\n\n"
                + accuracy_table(result["accuracy"])) if result.get("accuracy") else ""
    ratios = ("\n\nOn this CPU (a GPT of 4 layers, width 256, 8 x 128 tokens; median of 20 steps, one run): step "
              "time over full fine-tuning: " + ", ".join(f"{k} {v:.2f}x" for k, v in cpu.items() if k != "full")
              + ".") if cpu else ""
    return (f"# Fine-tuning's cost: full against LoRA, compiled for {result['device_kind']} without one\n\n"
            f"`{result['command']}` (jax {env['jax']}, JAX's compile-only CUDA client, {env['date']}). mixed_bf16, "
            f"AdamW; LoRA rank 16 on every Dense / DenseGeneral, the rest frozen (no gradient, master or "
            f"optimizer state) and stored as the variant says (int8 / nf4: weight matrices in codes, blocks of 64; "
            f"smaller params in bf16). *State*: exact from shapes and dtypes. *Step peak*: XLA's memory plan "
            f"for the target, per device. *Modeled ms*: `train.inspections.gpu_time`, **not a measurement**."
            f"\n\n{table(result['rows'], result['memory_bytes'])}{ratios}{accuracy}\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.finetune_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="h100")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--cpu", action="store_true", help="also the CPU step-time ratios")
    p.add_argument("--accuracy", metavar="WORKDIR", help="also fine-tune the default experiment in WORKDIR: "
                                                        "accuracy of full fine-tuning and LoRA on each base")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    names, variants = chosen(p, models=(args.models, MODELS), variants=(args.variants, VARIANTS))
    found = target_device(args.target)
    if found is None:
        return 2
    target, device = found
    rows = []
    for name in names:
        for variant in variants:
            rows.append(gpu_row(name, variant, target, device))
            r = rows[-1]
            print(f"{name:<9}{variant:<11}state {r['bytes_per_param']['total']:.2f} B/param, peak "
                  f"{r['peak'] / 2**30:.1f} GiB ({'fits' if r['fits'] else 'does not fit'}), modeled "
                  f"{r['modeled_seconds'] * 1e3:.1f} ms", flush=True)
    result = {"target": target.name, "device_kind": target.device_kind, "memory_bytes": target.memory_bytes,
              "environment": environment(), "rows": rows,
              "command": command("benchmarks.finetune_cost", argv)}
    if args.cpu:
        result["cpu_ratios"] = cpu_ratios()
        print("cpu step time over full fine-tuning:", result["cpu_ratios"], flush=True)
    if args.accuracy:
        result["accuracy"] = accuracy_rows(args.accuracy)
        print(accuracy_table(result["accuracy"]), flush=True)
    write_tables(args.out, f"finetune-cost-{target_slug(target)}", result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

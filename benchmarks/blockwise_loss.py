"""The loss from large logits a block of rows at a time, against the whole logits and a
hand-written step, compiled for a GPU without one.

For a GPT-2-small (vocabulary 50,304) and a Llama-style 1.6B decoder (vocabulary 128,256,
width 2,048, 16 layers, untied head), each under ``mixed_bf16`` at 16 x 1024 tokens:
our step with the loss in blocks (:func:`precision.blockwise_loss`, the default), our step
with the whole logits (``precision.blockwise_loss=false``) and the hand-written bf16 step
of :mod:`benchmarks.step_cost`, each compiled for the target by JAX's compile-only CUDA
client. Read from each program: XLA's temporaries and peak per device, the modeled step
time (:mod:`train.inspections.gpu_time`, **a model, not a measurement**), kernel launches,
whether a whole ``[16, 1024, vocabulary]`` buffer exists, and the largest batch (rows of
1,024 tokens) whose step fits the device's memory.

    python -m benchmarks.blockwise_loss [--target h100] [--models gpt2,llama1b] [--no-fit] [--out DIR]

Needs JAX's CUDA plugin (``pip install '.[gpu-compile]'``; run with ``JAX_PLATFORMS=cpu``).
Writes ``blockwise-loss-<target>.{json,md}``.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

import jax
import jax.numpy as jnp

import precision
from benchmarks import step_cost
from benchmarks.compile_only import chosen, target_device, target_slug
from benchmarks.report import RESULTS, command, environment, write_tables
from benchmarks.step_models import Llama, PinnedGPT, cudnn_attention
from train import create_train_state
from train.inspections.compile_for import compile_train_step
from train.inspections.gpu_time import model_step
from train.parallel.distributed import Layout, make_mesh

SEQ, BATCH = 1024, 16


def models() -> dict[str, tuple[Any, Any, int]]:
    """name -> (the model as a user gives it, its hand-written bf16 twin, vocabulary)."""
    gpt2 = PinnedGPT(50304, SEQ, 768, 12, 12)
    llama = Llama(128256, 2048, 16, 16)
    return {"gpt2": (gpt2, gpt2.clone(dtype=jnp.bfloat16, attention_fn=cudnn_attention), 50304),
            "llama1b": (llama, llama.clone(dtype=jnp.bfloat16, attention_fn=cudnn_attention), 128256)}


def _batch(rows: int) -> dict[str, jax.ShapeDtypeStruct]:
    tokens = jax.ShapeDtypeStruct((rows, SEQ), jnp.int32)
    return {"inputs": tokens, "labels": tokens}


def ours(model: Any, rows: int, blockwise: bool, target: Any, device: Any) -> Any:
    """Our train step of ``model`` at ``rows`` x 1,024 tokens, compiled for ``target``."""
    layout = Layout(make_mesh(1, 1, [device]))
    ops = precision.op_lists(blockwise_loss=blockwise)
    state = jax.eval_shape(lambda: create_train_state(model, "mixed_bf16", step_cost._optimizer(), jax.random.key(0),
                                                      jnp.zeros((1, SEQ), jnp.int32), loss_scale="none", ops=ops))
    return compile_train_step(state, _batch(rows), layout, target, task="language_model")


def hand(half: Any, rows: int, device: Any) -> tuple[str, dict[str, int]]:
    """The hand-written bf16 step's optimized program and XLA's memory plan."""
    m = step_cost.Model("hand", None, None, _batch(rows)["inputs"], _batch(rows)["labels"], "language_model")
    compiled = step_cost.hand_written_compiled(half, m, jnp.bfloat16, False, False, Layout(make_mesh(1, 1, [device])))
    stats = compiled.memory_analysis()
    memory = {"argument": int(stats.argument_size_in_bytes), "output": int(stats.output_size_in_bytes),
              "alias": int(stats.alias_size_in_bytes), "temp": int(stats.temp_size_in_bytes)}
    memory["peak"] = memory["argument"] + memory["output"] - memory["alias"] + memory["temp"]
    return compiled.as_text(), memory


def _whole_logits(text: str, vocab: int) -> list[str]:
    return sorted(set(re.findall(r"(?:f32|bf16|f16)\[%d,%d,%d\]" % (BATCH, SEQ, vocab), text)))


def _row(text: str, memory: dict[str, int], vocab: int, target: Any) -> dict[str, Any]:
    modeled = model_step(text, target)
    return {"temp": memory["temp"], "peak": memory["peak"], "modeled_seconds": modeled.seconds,
            "launches": modeled.launches, "whole_logits": _whole_logits(text, vocab)}


def largest_batch(peak_at: Any, memory: int) -> int:
    """The largest batch (rows of 1,024 tokens) whose step's peak fits ``memory`` without
    XLA rematerializing activations: the peak is a fixed part (params, optimizer state) plus
    a part per row, read from the steps at 16 and 32 rows (both far below the limit, where
    XLA plans no recomputation) and extended linearly."""
    small, large = peak_at(BATCH), peak_at(2 * BATCH)
    per_row = (large - small) / BATCH
    return int((memory - (small - per_row * BATCH)) // per_row)


def measure(name: str, target: Any, device: Any, fit: bool) -> dict[str, Any]:
    model, half, vocab = models()[name]
    row: dict[str, Any] = {"model": name, "vocab": vocab}
    for blockwise in (True, False):
        step = ours(model, BATCH, blockwise, target, device)
        key = "blocks" if blockwise else "whole"
        row[key] = _row(step.hlo_text, step.memory, vocab, target)
        row[key]["plan"] = step.blockwise.describe()
        print(f"{name} ours {key}: temp {step.memory['temp'] / 2**30:.2f} GiB, modeled "
              f"{row[key]['modeled_seconds'] * 1e3:.2f} ms; {row[key]['plan']}", flush=True)
        if fit:
            peaks = {BATCH: step.memory["peak"]}
            row[key]["largest_batch"] = largest_batch(
                lambda rows, b=blockwise: peaks.get(rows) or ours(model, rows, b, target, device).memory["peak"],
                target.memory_bytes)
            print(f"{name} ours {key}: largest batch {row[key]['largest_batch']} x {SEQ}", flush=True)
    text, memory = hand(half, BATCH, device)
    row["hand_written"] = _row(text, memory, vocab, target)
    if fit:
        row["hand_written"]["largest_batch"] = largest_batch(
            lambda rows: memory["peak"] if rows == BATCH else hand(half, rows, device)[1]["peak"], target.memory_bytes)
    print(f"{name} hand-written: temp {memory['temp'] / 2**30:.2f} GiB, modeled "
          f"{row['hand_written']['modeled_seconds'] * 1e3:.2f} ms", flush=True)
    return row


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | step | temporaries GiB | x hand | peak GiB | modeled ms | x hand | whole-logits buffers | "
             "largest batch (x 1,024 tokens) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        h = r["hand_written"]
        for key, label in (("blocks", "ours, loss in blocks"), ("whole", "ours, whole logits"),
                           ("hand_written", "hand-written bf16")):
            s = r[key]
            lines.append(f"| {r['model']} ({r['vocab']:,}) | {label} | {s['temp'] / 2**30:.2f} | "
                         f"{s['temp'] / h['temp']:.3f} | {s['peak'] / 2**30:.2f} | {s['modeled_seconds'] * 1e3:.2f} | "
                         f"{s['modeled_seconds'] / h['modeled_seconds']:.3f} | "
                         f"{', '.join(s['whole_logits']) or 'none'} | {s.get('largest_batch', '')} |")
    return "\n".join(lines)


def markdown(result: dict[str, Any]) -> str:
    env = result["environment"]
    plans = "\n".join(f"- {r['model']}: {r['blocks']['plan']}" for r in result["rows"])
    return (f"# The loss in blocks of rows, compiled for {result['device_kind']} without one\n\n"
            f"`{result['command']}` (jax {env['jax']}, JAX's compile-only CUDA client, {env['date']}). "
            f"`mixed_bf16`, AdamW, {BATCH} x {SEQ} tokens. *Temporaries* and *peak*: XLA's memory plan per device; "
            f"*modeled ms*: `train.inspections.gpu_time`'s model of the step (**not a measurement**); *largest "
            f"batch*: rows of {SEQ} tokens whose step's peak fits the device's "
            f"{result['device_memory_bytes'] / 2**30:.0f} GiB without XLA recomputing activations (the peak at 16 and "
            f"32 rows extended linearly).\n\n{table(result['rows'])}\n\n"
            f"What the blocks were:\n{plans}\n\nHow it works and what it costs: "
            f"[docs/blockwise-loss.md](../../docs/blockwise-loss.md).\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.blockwise_loss", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="h100")
    p.add_argument("--models", default="gpt2,llama1b")
    p.add_argument("--no-fit", action="store_true", help="skip the largest batch (compiles 3 more steps a model)")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    (names,) = chosen(p, models=(args.models, models()))
    found = target_device(args.target)
    if found is None:
        return 2
    target, device = found
    rows = [measure(name, target, device, not args.no_fit) for name in names]
    result = {"target": target.name, "device_kind": target.device_kind, "device_memory_bytes": target.memory_bytes,
              "environment": environment(), "rows": rows,
              "command": command("benchmarks.blockwise_loss", argv)}
    write_tables(args.out, f"blockwise-loss-{target_slug(target)}", result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

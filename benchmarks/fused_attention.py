"""Users' attention at the GPT-2-small shape, compiled for an H100 without one:
written-out softmax attention fused by autocast, against the same program with
fusion off and against fp32.

Each model is a user's, from ``examples/user_models`` (a GPT on Flax's
``nn.SelfAttention``, Hugging Face-style GPT-2 and Llama models, an NNX model
on ``nnx.MultiHeadAttention``), and the project's own GPT for reference, all at
the GPT-2-small shape (12 layers, 768 wide, 12 heads, 16 x 1024 tokens, GPT-2's
50,304-token vocabulary), one train step each compiled through the CLI's
``--compile-for`` machinery: XLA's memory plan and cuDNN fused-attention calls.

    python -m benchmarks.fused_attention [--target h100] [--layers 12] [--models linen_gpt,hf_gpt2] [--out DIR]

Needs JAX's CUDA plugin (``pip install '.[gpu-compile]'``; run with
``JAX_PLATFORMS=cpu``). Writes ``<target>-fused-attention.{json,md}``. Proves
kernels and memory, not time (nothing runs; no autotuning).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any

from benchmarks.compile_only import chosen, target_device, target_slug
from benchmarks.report import RESULTS, command, environment
from train.inspections.compile_for import compile_for
from train.config import load_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
_USER = ("model.width=768", "model.heads=12", "model.max_len=1024")
#: name -> (config, overrides, the layers override's key)
MODELS = {
    "linen_gpt": ("examples/user_models/linen_gpt.yaml", _USER, "model.layers"),
    "hf_gpt2": ("examples/user_models/hf_style.yaml", _USER, "model.layers"),
    "hf_llama": ("examples/user_models/hf_style.yaml", (*_USER, "model.name=hf_style.py:Llama"), "model.layers"),
    "nnx_mha": ("examples/user_models/nnx_lm.yaml", (*_USER, "model.vocab_size=50304"), "model.layers"),
    "our_gpt": ("configs/gpu/gpt2_small_mixed_bf16.yaml", (), "model.num_layers"),
}
SHAPE = ("data.seq_len=1024", "data.batch_size=16", "data.num_classes=50304", "data.num_test=65536")
CASES = {"fp32": ("precision.policy=fp32",),
         "mixed_bf16_unfused": ("precision.policy=mixed_bf16", "precision.fuse_attention=false"),
         "mixed_bf16": ("precision.policy=mixed_bf16",)}


def measure(model: str, case: str, layers: int, target: Any) -> dict[str, Any]:
    """One model under one case, compiled for ``target``: its row."""
    path, overrides, key = MODELS[model]
    config = load_config(ROOT / path, ["workdir=/tmp/unused", *SHAPE, *overrides, f"{key}={layers}", *CASES[case]])
    report = compile_for(config, target, None)
    return {"model": model, "case": case, "memory": report.memory, "fits": report.fits,
            "cudnn_attention": report.count("cudnn_attention"),
            "cudnn_attention_backward": report.count("cudnn_attention_backward"),
            "f32_gemms": sum(k.has_f32_operand for k in report.kernels if k.gemm), "seconds": report.seconds}


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as markdown, temporaries against the same model's fp32."""
    fp32 = {r["model"]: r["memory"]["temp"] for r in rows if r["case"] == "fp32"}
    lines = ["| model | policy | temp GiB | temp / fp32 | peak GiB | cuDNN attn fwd / bwd | f32 GEMMs | compile s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m = r["memory"]
        ratio = f"{m['temp'] / fp32[r['model']]:.2f}" if fp32.get(r["model"]) else "-"
        lines.append(f"| {r['model']} | {r['case']} | {m['temp'] / 2 ** 30:.2f} | {ratio} | {m['peak'] / 2 ** 30:.2f} "
                     f"| {r['cudnn_attention']} / {r['cudnn_attention_backward']} | {r['f32_gemms']} | "
                     f"{r['seconds']['compile']:.1f} |")
    return "\n".join(lines)


def markdown(result: dict[str, Any]) -> str:
    return (f"# Users' attention fused, compiled for {result['device_kind']} without one\n\n"
            f"`{result['command']}` (jax {result['environment']['jax']}, JAX's compile-only CUDA client on "
            f"{result['environment']['device']}, {result['environment']['date']}). One train step per row at the "
            f"GPT-2-small shape ({result['layers']} layers, 768 wide, 12 heads, 16 x 1024 tokens, vocabulary "
            f"50,304); temp and peak per device from XLA's memory plan.\n\n{table(result['rows'])}\n\n"
            "The users' models write their attention out (Flax's `dot_product_attention`, einsum / softmax / "
            "einsum) or, for NNX without dropout, call `jax.nn.dot_product_attention`; under `mixed_bf16` autocast "
            "computes each as cuDNN's fused attention, forward and backward in every layer, and with "
            "`precision.fuse_attention=false` (the `_unfused` rows) XLA materialises the (batch, heads, T, T) logits. "
            "`nnx_mha` (NNX's attention without dropout) and `our_gpt` call `jax.nn.dot_product_attention` "
            "themselves: that call is cuDNN's under a half policy whatever `fuse_attention` says, so their two "
            "rows agree. What it does not prove: time (nothing runs, no autotuning).\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fused_attention", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="h100", help="h100, h200 or a GpuTargetConfigProto text file")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    models, cases = chosen(p, models=(args.models, MODELS), cases=(args.cases, CASES))
    found = target_device(args.target)
    if found is None:
        return 2
    target = found[0]
    rows = []
    for model in models:
        for case in cases:
            rows.append(measure(model, case, args.layers, args.target))
            r = rows[-1]
            print(f"{model:<10}{case:<24}temp {r['memory']['temp'] / 2 ** 30:6.2f} GiB  cuDNN attention "
                  f"{r['cudnn_attention']} / {r['cudnn_attention_backward']}", flush=True)
    result = {"target": target.name, "device_kind": target.device_kind, "environment": environment(),
              "layers": args.layers, "rows": rows,
              "command": command("benchmarks.fused_attention", argv)}
    name = target_slug(target)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}-fused-attention.json").write_text(json.dumps(result, indent=1))
    (out / f"{name}-fused-attention.md").write_text(markdown(result))
    print(f"\n{table(rows)}\n\nwrote {out / f'{name}-fused-attention.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

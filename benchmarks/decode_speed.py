"""Decoding one token at a time on a device, measured: tokens/s, the bandwidth it reaches, and the
modeled time of the very program the device ran beside it (issue 70's bandwidth goal, checked).

For this project's GPT with its KV cache and random weights, per served weights dtype (bf16,
int8), at batch 1: the prompt (``--prompt`` tokens) read in one pass, then ``--tokens`` tokens
decoded back to back through :class:`train.serving.Generator` (the programs ``python -m train
sample`` runs: 16 tokens a dispatch since 2026-11-30, when the H200 showed one dispatch a token
bound by the host's 1.3 ms). Reported: time per token, the bytes a token must read (every weight once, one
row of each table, the cache at its length) and the bandwidth that makes, against the device's
datasheet; :mod:`train.inspections.gpu_time`'s modeled time of the compiled decode step (on an
H100 or H200) and its ratio to the measured one; the kernels of a traced stretch of decoding by
kind (device busy against wall: how much of a token is launches and gaps).

Shapes: ``gpt2_small`` (12 x 768, vocabulary 50,304, 1,024 positions), ``wide_2`` and ``wide_4``
(2 and 4 layers 4,096 wide, MLP 16,384, vocabulary 128,256, 4,096 positions: a 7B model's layers
and head; serving casts weights on the host, too slow for 32 such layers in a short lease);
``llama_2`` and ``llama_4``, a Hugging Face Flax Llama with Llama-3-8B's layers and head (8,192
positions), and ``hf_gpt2_small``, a Hugging Face Flax GPT-2 small, whose rows ``--kernels xla,fused``
gives for the model's own modules and for the fused decode kernels (``--decode-kernels fused``). From the two depths, what one wide layer adds (time
and bytes: the bandwidth its GEMVs reach) and the 32-layer model taken linearly. ``tiny``,
``llama_tiny`` and ``hf_gpt2_tiny`` for a check of this script.

    python -m benchmarks.decode_speed [--shapes gpt2_small,wide_2,wide_4] [--dtypes bf16,int8]
        [--kernels xla,fused] [--prompt 128] [--tokens 128] [--out DIR]

On a CPU it runs (``--shapes tiny``); its times are the CPU's. Writes
``decode-speed-<device>.{json,md}``.
"""

from __future__ import annotations

import argparse
import sys
import types
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.profile_step import traced
from benchmarks.report import RESULTS, device_slug, environment, write_tables
from benchmarks.serving import Ids
from train.inspections.export import export_rules
from train.models import GPT
from train.serving import Generator, Sampling, Source
from train.serving.weights import tree_bytes

#: name -> (layers, heads, width, vocabulary, positions, scanned)
SHAPES = {"tiny": (2, 2, 64, 256, 256, False), "tiny_4": (4, 2, 64, 256, 256, False),
          "gpt2_small": (12, 12, 768, 50304, 1024, False),
          "wide_2": (2, 32, 4096, 128256, 4096, False), "wide_4": (4, 32, 4096, 128256, 4096, False)}
#: Hugging Face Flax Llamas (random weights, :func:`benchmarks.serving.llama_source`): name -> (layers, shape);
#: ``llama_2``/``llama_4``: Llama-3-8B's layers and head (``--kernels xla,fused`` times the fused decode kernels)
LLAMAS = {"llama_2": (2, None), "llama_4": (4, None),
          "llama_tiny": (2, {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
                             "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 512,
                             "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}),
          "llama_tiny_4": (4, "llama_tiny")}
#: Hugging Face Flax GPT-2s (random weights, :func:`benchmarks.serving.gpt2_source`): name -> ``GPT2Config`` fields
#: (``hf_gpt2_small``: GPT-2 small, 50,257 tokens; ``--kernels xla,fused`` times the fused decode kernels)
GPT2S = {"hf_gpt2_small": {}, "hf_gpt2_tiny": {"n_embd": 128, "n_layer": 2, "n_head": 2, "vocab_size": 512,
                                                "n_positions": 512}}
#: (shallow, deep, depth to take them to) for the per-layer figures
DEPTHS = {"wide": ("wide_2", "wide_4", 32), "tiny": ("tiny", "tiny_4", 32), "llama": ("llama_2", "llama_4", 32),
          "llama_tiny": ("llama_tiny", "llama_tiny_4", 32)}


def _layers(name: str) -> int:
    if name in GPT2S:
        return GPT2S[name].get("n_layer", 12)
    return LLAMAS[name][0] if name in LLAMAS else SHAPES[name][0]


def source(name: str) -> Source:
    """The GPT (or Hugging Face Llama or GPT-2) of shape ``name`` with random weights, ready to serve."""
    if name in GPT2S:
        from benchmarks.serving import gpt2_source
        return gpt2_source(GPT2S[name])
    if name in LLAMAS:
        from benchmarks.serving import LLAMA3_8B, llama_source
        layers, shape = LLAMAS[name]
        shape = LLAMAS[shape][1] if isinstance(shape, str) else shape
        return llama_source(layers, (shape or LLAMA3_8B)["vocab_size"], shape)
    layers, heads, width, vocab, positions, scanned = SHAPES[name]
    model = GPT(vocab_size=vocab, block_size=positions, num_layers=layers, num_heads=heads, d_model=width,
                scan_layers=scanned)
    params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    rules = types.SimpleNamespace(policy="mixed_bf16", rules=None)
    return Source(f"random {name}", "export", model, params, {}, lambda dtype: export_rules(rules, dtype), Ids(vocab),
                  positions, "block_size", None, None)


def _device_model() -> Any:
    """The modeled target this device is (an H100 or H200), or None."""
    kind = jax.devices()[0].device_kind.lower()
    name = next((n for n in ("h100", "h200") if n in kind), None)
    if name is None or jax.default_backend() != "gpu":
        return None
    from train.inspections.targets import get_target
    return get_target(name)


def _traced(generator: Generator, step: Any, length: int, start: int, steps: int = 16) -> dict[str, Any]:
    """Device busy time a token by kernel kind over ``steps`` decode steps, and the wall time."""
    cache = generator.decoder.init(1, length)
    token, cache = step(generator.params, cache, jnp.zeros((1, 1), jnp.int32), np.int32(start), np.uint32(0))  # warm
    jax.block_until_ready(token)
    carry = {"token": token, "cache": cache}

    def run():
        for i in range(steps):
            carry["token"], carry["cache"] = step(generator.params, carry["cache"], carry["token"][:, None],
                                                  np.int32(start + 1 + i), np.uint32(0))
        return carry["token"]

    t = traced(run, steps)
    return {"source": t["source"], "wall_seconds": t["wall_seconds"], "busy_seconds": t["busy_seconds"],
            "by_kind": t["by_kind"]}


def measure(name: str, src: Source, dtype: str, prompt: int, tokens: int, kernels: str = "xla") -> dict[str, Any]:
    """One row: ``name``'s model (``src``) served in ``dtype``, each token through ``kernels``
    (``--decode-kernels``), decoded at batch 1."""
    generator = Generator(src, dtype, decode_kernels=kernels)
    ids = np.random.default_rng(0).integers(0, src.tokenizer.size, prompt).astype(np.int32)
    generator.generate(ids, tokens=4, sampling=Sampling(temperature=0))  # compiles both programs
    out = generator.generate(ids, tokens=tokens, sampling=Sampling(temperature=0))
    length = generator.cache_length(prompt, tokens)
    per_token = 1.0 / out.tokens_per_second
    cache_bytes = tree_bytes(jax.eval_shape(lambda: generator.decoder.init(1, length)))
    token_bytes = generator.served.token_bytes + cache_bytes
    row = {"shape": name, "dtype": dtype if kernels == "xla" else f"{dtype} {kernels}", "params": int(sum(x.size for x in jax.tree_util.tree_leaves(src.params))),
           "prompt": prompt, "tokens": tokens, "cache_length": length, "seconds_per_token": per_token,
           "tokens_per_second": out.tokens_per_second, "time_to_first_token": out.first_token_seconds,
           "weight_bytes": generator.served.token_bytes, "cache_bytes": cache_bytes, "token_bytes": token_bytes,
           "bandwidth": token_bytes / per_token}
    target = _device_model()
    step = generator.program("step", 1, length, 1, Sampling(temperature=0))
    if target is not None:
        from train.inspections.gpu_time import datasheet, model_step
        modeled, bandwidth = model_step(step.as_text(), target), datasheet(target).bandwidth
        row.update(datasheet_bandwidth=bandwidth, limit_ratio=per_token * bandwidth / token_bytes,
                   modeled_seconds=modeled.seconds, modeled_launches=modeled.launches,
                   model_vs_measured=modeled.seconds / per_token)
    row["trace"] = _traced(generator, step, length, prompt)
    return row


def per_layer(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each pair of depths measured (:data:`DEPTHS`) and dtype: what one layer adds (seconds,
    bytes, the bandwidth that makes, and the model's seconds) and the deep model taken linearly."""
    by = {(r["shape"], r["dtype"]): r for r in rows}
    out = []
    for family, (shallow, deep, depth) in DEPTHS.items():
        layers = _layers(deep) - _layers(shallow)
        for dtype in sorted({r["dtype"] for r in rows}):
            a, b = by.get((shallow, dtype)), by.get((deep, dtype))
            if a is None or b is None:
                continue
            seconds = (b["seconds_per_token"] - a["seconds_per_token"]) / layers
            nbytes = (b["token_bytes"] - a["token_bytes"]) / layers
            row = {"family": family, "dtype": dtype, "layer_seconds": seconds, "layer_bytes": nbytes,
                   "layer_bandwidth": nbytes / seconds if seconds > 0 else None, "depth": depth,
                   "deep_seconds": a["seconds_per_token"] + (depth - _layers(shallow)) * seconds,
                   "deep_bytes": a["token_bytes"] + (depth - _layers(shallow)) * nbytes}
            if "modeled_seconds" in a and "modeled_seconds" in b:
                row["layer_modeled_seconds"] = (b["modeled_seconds"] - a["modeled_seconds"]) / layers
                row["deep_limit_ratio"] = row["deep_seconds"] * a["datasheet_bandwidth"] / row["deep_bytes"]
            out.append(row)
    return out


def markdown(result: dict[str, Any]) -> str:
    env = result["environment"]
    lines = [f"# Decoding at batch 1 on {result['device']}", "",
             f"`{result['command']}` ({env['date']}, jax {env['jax']}). This project's GPT (or a Hugging Face Llama or GPT-2: `llama_*`, `hf_gpt2_*`) with its KV cache, random "
             "weights, served through `train.serving.Generator` (greedy); the prompt in one pass, then each token "
             "back to back. *Bytes a token*: every weight once (a table's row), the cache at its length. *x limit*: "
             "the time a token over its bytes at the datasheet's bandwidth. *Modeled*: `train.inspections.gpu_time` "
             "on the compiled decode step the device ran. *Busy*: device time a token in a traced stretch.", "",
             "| shape | weights | ms a token | tokens/s | MB a token | GB/s | x limit | modeled ms | model / measured "
             "| busy / wall ms |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        t = r["trace"]
        model = (f"{r['modeled_seconds'] * 1e3:.3f} | {r['model_vs_measured']:.2f}" if "modeled_seconds" in r
                 else "- | -")
        limit = f"{r['limit_ratio']:.2f}x" if "limit_ratio" in r else "-"
        lines.append(f"| {r['shape']} | {r['dtype']} | {r['seconds_per_token'] * 1e3:.3f} | {r['tokens_per_second']:,.0f} "
                     f"| {r['token_bytes'] / 1e6:,.1f} | {r['bandwidth'] / 1e9:,.0f} | {limit} | {model} | "
                     f"{t['busy_seconds'] * 1e3:.3f} / {t['wall_seconds'] * 1e3:.3f} |")
    if result["per_layer"]:
        lines += ["", "What one layer adds (the two depths' difference), and the deep model taken linearly:", "",
                  "| layers | weights | ms a layer | MB a layer | GB/s a layer | modeled ms a layer | depth | ms a token "
                  "there | x limit there |", "|---|---|---|---|---|---|---|---|---|"]
        for r in result["per_layer"]:
            bw = f"{r['layer_bandwidth'] / 1e9:,.0f}" if r["layer_bandwidth"] else "-"
            modeled = f"{r['layer_modeled_seconds'] * 1e3:.4f}" if "layer_modeled_seconds" in r else "-"
            limit = f"{r['deep_limit_ratio']:.2f}x" if "deep_limit_ratio" in r else "-"
            lines.append(f"| {r['family']} | {r['dtype']} | {r['layer_seconds'] * 1e3:.4f} | {r['layer_bytes'] / 1e6:,.1f} "
                         f"| {bw} | {modeled} | {r['depth']} | {r['deep_seconds'] * 1e3:.3f} | {limit} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.decode_speed", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="gpt2_small,wide_2,wide_4")
    p.add_argument("--dtypes", default="bf16,int8")
    p.add_argument("--kernels", default="xla",
                   help="decode kernels, comma-separated: xla, fused (the Hugging Face shapes only)")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    unknown = [s for s in args.shapes.split(",") if s not in {**SHAPES, **LLAMAS, **GPT2S}]
    if unknown:
        p.error(f"unknown shape {', '.join(unknown)}; give some of {', '.join([*SHAPES, *LLAMAS, *GPT2S])}")
    env = environment()
    rows = []
    for name in args.shapes.split(","):
        src = source(name)
        for dtype, kernels in [(d, k) for k in args.kernels.split(",") for d in args.dtypes.split(",")]:
            if kernels != "xla" and name not in LLAMAS and name not in GPT2S:
                continue
            rows.append(measure(name, src, dtype, args.prompt, args.tokens, kernels))
            r = rows[-1]
            print(f"{name} {r['dtype']}: {r['seconds_per_token'] * 1e3:.3f} ms a token, {r['bandwidth'] / 1e9:.0f} GB/s"
                  + (f", modeled {r['modeled_seconds'] * 1e3:.3f} ms ({r['model_vs_measured']:.2f}x)"
                     if "modeled_seconds" in r else ""), flush=True)
    result = {"environment": env, "device": jax.devices()[0].device_kind, "rows": rows, "per_layer": per_layer(rows),
              "command": "python -m benchmarks.decode_speed " + " ".join(sys.argv[1:] if argv is None else argv)}
    write_tables(args.out, f"decode-speed-{device_slug(env)}", result, markdown(result))
    return result


if __name__ == "__main__":
    main()

"""Serving a language model in half precision and int8 (issue 70): per weights/cache dtype,
the perplexity on the eval split, the agreement of greedy tokens with float32, tokens/s on this
CPU, the bytes a token reads, and the decode step compiled for an H100 (compile-only: its
modeled time per token against the bandwidth limit, bytes / 3.35 TB/s).

    python -m benchmarks.serving [--run runs/shakespeare_gpt_mixed_bf16] [--models shakespeare,gpt2_small]

``shakespeare``: the run of the README's command (``configs/shakespeare_gpt_mixed_bf16.yaml``),
its eval split. ``shakespeare_qlora``: a QLoRA fine-tuning of that run (rank 8 on an nf4 base,
200 steps: ``python -m train configs/shakespeare_gpt_mixed_bf16.yaml
workdir=runs/shakespeare_gpt_qlora_nf4 steps=200 eval_every=100 checkpoint_every=100
model.init_from=runs/shakespeare_gpt_mixed_bf16 finetune.lora.rank=8 finetune.base=nf4
optimizer.lr=3e-4 optimizer.warmup_steps=10``), served merged (f32, bf16, int8) and as stored
(``nf4``: the base's codes, the adapters unmerged). ``nf4`` rows of the random models: their
weight matrices stored as a QLoRA run stores its base (:func:`with_nf4_base`). ``gpt2_small``: a Hugging Face Flax GPT-2 at GPT-2 small's shape (12 layers,
768 wide, 50,257 tokens, 1,024 positions) with random weights (none can be downloaded here):
its perplexity means nothing and is not given; the agreement is measured on random tokens.
``llama3_8b``: a Hugging Face Flax Llama at Llama-3-8B's shape (4,096 wide, 14,336 in the MLP,
32 query and 8 key-value heads, 128,256 tokens, 8,192 positions), random weights, its decode
step alone: compiled at (layers, vocabulary) (1, 32,064), (2, 32,064) and (1, 64,128) (its
weights at full size do not fit this machine's memory beside the served copies) and taken to
(32, 128,256) linearly: each layer adds the same kernels and bytes, and the vocabulary the
bytes of the embedding row and the head (the same kernels at both vocabularies: checked, in the
result's ``same_kernels_at_both_vocabularies``).
Greedy agreement is teacher-forced: at each position of the same windows, whether the largest
logit is float32's. Writes ``benchmarks/results/serving.{json,md}`` (``serving-MODEL`` for one model).
"""

from __future__ import annotations

import argparse
import atexit
import re
import shutil
import sys
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.compile_only import chosen
from benchmarks.report import RESULTS, command, environment, write_tables
from train.inspections.gpu_time import CALIBRATION
from train.inspections.targets import TargetError
from train.serving import Generator, Sampling, Source, load_source
from precision.quantized_weights import dequantize_weight, quantizable, quantize_weight
from train.serving.compiled import compile_decode_step

MODELS = ("shakespeare", "shakespeare_qlora", "gpt2_small", "llama3_8b")
#: (weights, cache) rows per model; float32 first (the reference).
ROWS = {"shakespeare": [("f32", "f32"), ("bf16", "bf16"), ("f16", "f16"), ("int8", "bf16"), ("bf16", "int8"),
                        ("bf16", "fp8"), ("int8", "int8")],
        "shakespeare_qlora": [("f32", "f32"), ("bf16", "bf16"), ("int8", "bf16"), ("nf4", "bf16")],
        "gpt2_small": [("f32", "f32"), ("bf16", "bf16"), ("f16", "f16"), ("int8", "bf16"), ("nf4", "bf16")],
        "llama3_8b": [("bf16", "bf16"), ("int8", "bf16"), ("nf4", "bf16")]}
#: The weights each model's decode step is also compiled with the fused kernels in (``--decode-kernels fused``;
#: its other rows: the model's own modules).
FUSED_ROWS = {"gpt2_small": ("bf16", "int8"), "llama3_8b": ("bf16", "int8")}
#: Llama-3-8B's shape (its config.json) and depth (the decode step is compiled smaller: see the docstring).
LLAMA3_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
             "vocab_size": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
             "tie_word_embeddings": False}
LLAMA3_8B_LAYERS = 32
GOALS = {"bf16_changed_greedy_max": 0.01, "int8_perplexity_vs_bf16_max": 0.01, "h100_ratio_max": 1.5}


class Ids:
    """A tokenizer for ids alone (random weights: no tokenizer is needed to time them)."""

    def __init__(self, size: int):
        self.size = size

    def decode(self, ids: Any) -> str:
        return " ".join(str(int(i)) for i in np.ravel(ids))


def _scratch_directory(prefix: str) -> str:
    """A temporary directory for a made-up model's config, removed when the process exits."""
    directory = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, directory, True)
    return directory


def gpt2_source(shape: dict | None = None) -> Source:
    """A Hugging Face Flax GPT-2 of ``shape`` (``GPT2Config`` fields; default GPT-2 small's shape,
    transformers' defaults), random weights (the model's own initialization, seed 0)."""
    import transformers

    from train.inspections.export import export_rules
    from train.weights import huggingface

    directory = _scratch_directory("gpt2-")
    config = transformers.GPT2Config(architectures=["GPT2LMHeadModel"], **(shape or {}))
    config.save_pretrained(directory)
    params = jax.device_get(transformers.FlaxGPT2LMHeadModel(config, seed=0).params)
    rules = type("Section", (), {"policy": "mixed_bf16", "rules": None})
    return Source(directory, "huggingface", huggingface.model(directory), params, {},
                  lambda dtype: export_rules(rules, dtype), Ids(config.vocab_size), config.n_positions,
                  "n_positions", None, None)


def llama_source(layers: int, vocab: int, shape: dict | None = None) -> Source:
    """A Flax Llama of ``shape`` (default Llama-3-8B's: :data:`LLAMA3_8B`) at ``layers`` layers and a
    ``vocab``-token vocabulary, random weights (normal, 0.02; norms 1) made in numpy in bfloat16."""
    import transformers

    from train.inspections.export import export_rules
    from train.weights import huggingface

    directory = _scratch_directory("llama3-8b-")
    config = transformers.LlamaConfig(architectures=["LlamaForCausalLM"], num_hidden_layers=layers,
                                      **((shape or LLAMA3_8B) | {"vocab_size": vocab}))
    config.save_pretrained(directory)
    empty = transformers.FlaxLlamaForCausalLM(config, _do_init=False)
    shapes = jax.eval_shape(lambda key: empty.init_weights(key, (1, 1)), jax.random.key(0))
    rng = np.random.default_rng(0)
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: np.ones(x.shape, np.float32) if "norm" in jax.tree_util.keystr(path)
        else (0.02 * rng.standard_normal(x.shape, np.float32)).astype(jnp.bfloat16), shapes)
    rules = type("Section", (), {"policy": "mixed_bf16", "rules": None})
    return Source(directory, "huggingface", huggingface.model(directory), params, {},
                  lambda dtype: export_rules(rules, dtype), Ids(config.vocab_size), config.max_position_embeddings,
                  "max_position_embeddings", None, None)


def with_nf4_base(source: Source) -> Source:
    """``source`` with its weights also as a QLoRA run stores its frozen base (each weight matrix
    of 4,096 values or more in nf4 codes, :func:`precision.quantized_weights.quantizable`, as
    :func:`train.finetune.frozen.stored_frozen` stores it), no adapters: what ``--dtype nf4``
    serves (its float32 weights: the codes read back; the other dtypes serve the weights as they were)."""
    from flax import traverse_util

    from train.serving.stored_base import StoredBase

    flat = traverse_util.flatten_dict(source.params)
    codes = {p: _quantize_nf4(x) for p, x in flat.items() if quantizable(x)}  # jitted: no [values, 16] array
    params = traverse_util.unflatten_dict(flat | {p: np.asarray(_dequantize(q)) for p, q in codes.items()})
    return source._replace(base=StoredBase(source.model, params, codes, 0))


_quantize_nf4 = jax.jit(lambda x: quantize_weight(x, "nf4"))
_dequantize = jax.jit(dequantize_weight)


def _decode_parts(step: Any) -> dict[str, float]:
    """What the modeled step is made of: its bytes streamed (past each kernel's latency), the
    kernels' latencies and the gaps between them, and compute-bound time beyond their bytes."""
    c = CALIBRATION
    streaming = sum(m.kernel.launches * m.kernel.bytes for m in step.modeled.kernels) / (
        step.bandwidth * c.bandwidth_efficiency)
    launches = step.modeled.launches * (c.min_kernel_seconds + c.gap_seconds)
    return {"streaming_us": 1e6 * streaming, "launch_us": 1e6 * launches,
            "compute_us": 1e6 * max(0.0, step.modeled.seconds - streaming - launches)}


def _decode_row(step: Any) -> dict[str, Any]:
    return {"bytes_per_token": step.bytes, "cache_bytes": step.cache_bytes, "length": step.length,
            "h100_modeled_us": step.modeled.seconds * 1e6, "h100_limit_us": step.limit_seconds * 1e6,
            "h100_ratio": step.ratio, "h100_launches": step.modeled.launches,
            "h100_hlo_bytes": step.modeled.bytes, "gemms": step.gemms, **_decode_parts(step)}


def layer_kernels(step: Any, layer: int = 1) -> list[dict[str, Any]]:
    """The kernels one layer of a compiled decode step launches, in program order: from the first to the
    last kernel whose module path names ``layers/<layer>`` (a GEMM XLA names no module for, between them,
    is the layer's too; ``h/<layer>`` in a GPT-2), each with its kind, module, MB and modeled microseconds."""
    kernels = list(step.modeled.kernels)
    inside = [i for i, m in enumerate(kernels) if re.search(rf"(layers|h)/{layer}(/|$)", m.kernel.module)]
    if not inside:
        return []
    return [{"kind": m.kernel.kind, "name": m.kernel.name,
             "module": (re.sub(rf"^.*(layers|h)/{layer}/?", "", m.kernel.module) or "(the layer)") if m.kernel.module
             else "-",
             "mb": m.kernel.bytes * m.kernel.launches / 1e6, "us": m.seconds * 1e6}
            for m in kernels[inside[0]:inside[-1] + 1]]


def measure_decode_only(target: str) -> list[dict[str, Any]]:
    """The Llama-3-8B-shaped rows: the decode step compiled at (layers, vocabulary) (1, V/4), (2, V/4) and
    (1, V/2), taken to (32, V) linearly (see the module's docstring)."""
    vocab, rows, steps = LLAMA3_8B["vocab_size"], [], {}
    points = {"base": (1, vocab // 4), "deeper": (2, vocab // 4), "wider": (1, vocab // 2)}
    for name, (layers, size) in points.items():
        source = with_nf4_base(llama_source(layers, size))
        for dtype, kv, kernels in _llama_rows():
            step = compile_decode_step(Generator(source, dtype, kv, decode_kernels=kernels), target)
            steps[(dtype, kv, kernels, name)] = _decode_row(step) | {
                "layer_kernels": layer_kernels(step) if layers > 1 else []}
        del source
    linear = ("bytes_per_token", "cache_bytes", "h100_modeled_us", "h100_limit_us", "h100_launches",
              "h100_hlo_bytes", "streaming_us", "launch_us", "compute_us")
    per_layer, per_token = LLAMA3_8B_LAYERS - 1, (vocab - vocab // 4) / (vocab // 2 - vocab // 4)
    for dtype, kv, kernels in _llama_rows():
        base, deeper, wider = (steps[(dtype, kv, kernels, name)] for name in points)
        row = {k: base[k] + per_layer * (deeper[k] - base[k]) + per_token * (wider[k] - base[k]) for k in linear}
        row["h100_ratio"] = row["h100_modeled_us"] / row["h100_limit_us"]
        row |= {"model": "llama3_8b", "weights": dtype, "cache": kv, "kernels": kernels, "perplexity": None,
                "length": base["length"],
                "compiled": {f"{layers} layers, vocabulary {size}": steps[(dtype, kv, kernels, name)]
                             for name, (layers, size) in points.items()},
                "same_kernels_at_both_vocabularies": base["h100_launches"] == wider["h100_launches"],
                "layer_kernels": deeper["layer_kernels"]}
        rows.append(row)
        print(_row_line(row), flush=True)
    return rows


def _llama_rows() -> list[tuple[str, str, str]]:
    """(weights, cache, decode kernels) of the llama3_8b rows."""
    return [(dtype, kv, "xla") for dtype, kv in ROWS["llama3_8b"]] + [
        (dtype, kv, "fused") for dtype, kv in ROWS["llama3_8b"] if dtype in FUSED_ROWS["llama3_8b"]]


def _windows(model: str, source: Source, batches: int) -> list[np.ndarray]:
    """Token windows to score: the eval split (Shakespeare), random tokens (GPT-2's shape)."""
    if source.data is not None:
        return [np.asarray(b["inputs"]) for b in source.data.eval_batches(16, batches)]
    rng = np.random.default_rng(0)
    return [rng.integers(0, source.tokenizer.size, (2, 256)).astype(np.int32) for _ in range(batches)]


def _scores(generator: Generator, windows: list[np.ndarray], source: Source) -> tuple[float | None, np.ndarray]:
    """Perplexity of the windows' next tokens (None without an eval split) and the greedy tokens."""
    nll, count, greedy = 0.0, 0, []
    for tokens in windows:
        logits = generator.logits(tokens)
        greedy.append(logits.argmax(-1))
        if source.data is not None:
            logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
            nll -= float(np.take_along_axis(np.asarray(logp), tokens[:, 1:, None], -1).sum())
            count += tokens[:, 1:].size
    return (float(np.exp(nll / count)) if count else None), np.concatenate([g.ravel() for g in greedy])


def _speed(generator: Generator, prompt: np.ndarray, tokens: int) -> dict[str, float]:
    generator.generate(prompt, tokens, Sampling(temperature=0))  # compiled, warmed
    out = generator.generate(prompt, tokens, Sampling(temperature=0))
    return {"tokens_per_second": out.tokens_per_second, "first_token_ms": 1e3 * out.first_token_seconds,
            "cache_bytes_cpu": out.cache_bytes}


def measure(model: str, source: Source, batches: int, tokens: int, target: str, decode_only: bool = False
            ) -> list[dict[str, Any]]:
    """The model's rows (``decode_only``: the H100 decode step alone, bf16 and int8 weights)."""
    windows = _windows(model, source, batches)
    prompt = windows[0][0, :8]
    rows, reference = [], None
    for dtype, kv in (ROWS["llama3_8b"] if decode_only else ROWS[model]):
        start = time.perf_counter()
        generator = Generator(source, dtype, kv)
        row = {"model": model, "weights": dtype, "cache": kv, "perplexity": None,
               "weight_bytes": generator.served.bytes}
        if not decode_only:
            perplexity, greedy = _scores(generator, windows, source)
            reference = greedy if reference is None else reference
            row |= {"perplexity": perplexity, "greedy_agreement": float(np.mean(greedy == reference)),
                    **_speed(generator, prompt, tokens)}
        try:
            step = compile_decode_step(generator, target)
            row |= _decode_row(step)
            if dtype in FUSED_ROWS.get(model, ()) and kv == "bf16":  # beside the fused kernels' layer
                row["layer_kernels"] = layer_kernels(step)
        except TargetError as e:
            row |= {"h100_error": str(e)}
        row["seconds"] = time.perf_counter() - start
        rows.append(row)
        print(_row_line(row), flush=True)
    return rows + _fused_rows(model, source, target)


def _fused_rows(model: str, source: Source, target: str) -> list[dict[str, Any]]:
    """The decode step compiled with the fused kernels (:data:`FUSED_ROWS`), bf16 cache (they run
    interpreted on a CPU: no speed or scores of theirs here)."""
    fused = []
    for dtype in FUSED_ROWS.get(model, ()):
        start = time.perf_counter()
        generator = Generator(source, dtype, "bf16", decode_kernels="fused")
        step = compile_decode_step(generator, target)
        row = {"model": model, "weights": dtype, "cache": "bf16", "kernels": "fused", "perplexity": None,
               "weight_bytes": generator.served.bytes, **_decode_row(step), "layer_kernels": layer_kernels(step),
               "seconds": time.perf_counter() - start}
        fused.append(row)
        print(_row_line(row), flush=True)
    return fused


def _row_line(r: dict[str, Any]) -> str:
    ppl = f"{r['perplexity']:.4f}" if r["perplexity"] is not None else "-"
    h100 = (f"{r['h100_modeled_us']:.1f} / {r['h100_limit_us']:.1f} us ({r['h100_ratio']:.2f}x) | "
            f"{r['h100_hlo_bytes'] / 1e6:.3f} | {r['h100_launches']}" if "h100_ratio" in r else "- | - | -")
    agree = f"{100 * r['greedy_agreement']:.2f}%" if "greedy_agreement" in r else "-"
    speed = f"{r['tokens_per_second']:.1f}" if "tokens_per_second" in r else "-"
    parts = (f"{r['streaming_us']:.1f} + {r['launch_us']:.1f} + {max(0.0, r['compute_us']):.1f}" if "streaming_us" in r
             else "-")
    return (f"| {r['model']} | {_weights(r)} | {r['cache']} | {ppl} | {agree} | {speed} | "
            f"{r.get('bytes_per_token', 0) / 1e6:.3f} | {h100} | {parts} |")


def _weights(r: dict[str, Any]) -> str:
    return r["weights"] + (" (fused kernels)" if r.get("kernels") == "fused" else "")


def markdown(result: dict[str, Any]) -> str:
    lines = ["# Serving: weights and KV cache dtypes (issue 70)", "", f"Command: `{result['command']}`", "",
             f"Environment: {result['environment']}", "",
             "Perplexity on the eval split (Shakespeare; `-`: random weights), greedy tokens equal to float32's "
             "(teacher-forced, every position of the same windows), tokens/s decoding on this CPU (batch 1, "
             f"{result['tokens']} tokens, shared cores: noisy), bytes a token reads (every weight and the cache at the "
             "model's context), and the decode step compiled for an H100 (compile-only: modeled time per token against "
             "bytes / 3.35 TB/s), and what the model's time is made of (`train.inspections.gpu_time`: the bytes "
             f"streamed at {CALIBRATION.bandwidth_efficiency:.3f} of the bandwidth, each launch's "
             f"{1e6 * CALIBRATION.min_kernel_seconds:.2f} us latency and {1e6 * CALIBRATION.gap_seconds:.2f} us gap, "
             "compute-bound time past them). llama3_8b: random weights, the decode step alone, compiled at 1-2 layers "
             "and a quarter and half of its vocabulary, taken to 32 layers and 128,256 tokens (module docstring); "
             "rows with fused kernels: `--decode-kernels fused` (`train.serving.fused_decode`), the decode step alone.", "",
             "| model | weights | cache | perplexity | greedy = f32 | tokens/s (CPU) | MB per token | H100 modeled / "
             "bandwidth limit | MB the H100 step moves | its kernels | modeled us: streaming + launches + compute |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [_row_line(r) for r in result["rows"]]
    lines += ["", "Goals: " + "; ".join(f"{k} {v}" for k, v in result["goals"].items()), ""]
    lines += [f"- {line}" for line in result["verdicts"]]
    for r in result["rows"]:
        if r.get("layer_kernels"):
            lines += ["", f"The kernels one layer of {r['model']}'s decode step launches, {_weights(r)} weights "
                      f"({len(r['layer_kernels'])}; its second layer, in program order; "
                      "modeled on an H100):", "", "| kind | kernel | module | MB | modeled us |", "|---|---|---|---:|---:|"]
            lines += [f"| {k['kind']} | {k['name']} | {k['module']} | {k['mb']:.3f} | {k['us']:.1f} |"
                      for k in r["layer_kernels"]]
    return "\n".join(lines) + "\n"


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    shake = {(r["weights"], r["cache"]): r for r in rows if r["model"] == "shakespeare"}
    if "greedy_agreement" in shake.get(("bf16", "bf16"), {}):
        changed = 1 - shake[("bf16", "bf16")]["greedy_agreement"]
        out.append(f"bf16 weights change {100 * changed:.2f}% of greedy tokens against float32 on the Shakespeare GPT "
                   f"(goal <= 1%): {'met' if changed <= 0.01 else 'NOT met'}")
    if shake.get(("int8", "bf16"), {}).get("perplexity") and shake.get(("bf16", "bf16"), {}).get("perplexity"):
        rel = shake[("int8", "bf16")]["perplexity"] / shake[("bf16", "bf16")]["perplexity"] - 1
        out.append(f"int8 weights' perplexity is {100 * rel:+.2f}% of bf16's (goal within 1%): "
                   f"{'met' if abs(rel) <= 0.01 else 'NOT met'}")
    qlora = {(r["weights"], r["cache"]): r for r in rows if r["model"] == "shakespeare_qlora"}
    nf4, half = qlora.get(("nf4", "bf16"), {}), qlora.get(("bf16", "bf16"), {})
    if nf4.get("perplexity") and half.get("perplexity"):
        out.append(f"the QLoRA run served as stored (nf4 base, adapters unmerged): perplexity "
                   f"{100 * (nf4['perplexity'] / half['perplexity'] - 1):+.2f}% of its merged bf16 weights', greedy "
                   f"tokens {100 * nf4['greedy_agreement']:.2f}% float32's (bf16: {100 * half['greedy_agreement']:.2f}%), "
                   f"{nf4['weight_bytes'] / half['weight_bytes']:.2f}x the bytes of weights")
    for r in rows:
        if r["cache"] == "bf16" and r["weights"] in ("bf16", "int8", "nf4") and "h100_ratio" in r:
            moved = r["h100_hlo_bytes"] / r["bytes_per_token"]
            out.append(f"{r['model']} {_weights(r)}: the modeled H100 decode step at batch 1 is {r['h100_ratio']:.2f}x "
                       f"its bandwidth limit (goal <= 1.5x): {'met' if r['h100_ratio'] <= 1.5 else 'NOT met'}; it moves "
                       f"{moved:.2f}x the bytes a token needs ({r['streaming_us']:.1f} us streamed at the model's "
                       f"{CALIBRATION.bandwidth_efficiency:.3f} of the bandwidth: {1 / CALIBRATION.bandwidth_efficiency:.2f}x "
                       f"the limit for bytes alone), in {r['h100_launches']:.0f} kernels ({r['launch_us']:.1f} us of "
                       f"latency and gaps: {r['launch_us'] / r['h100_limit_us']:.2f}x the limit)")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving", description=__doc__.split("\n\n")[0])
    p.add_argument("--run", default="runs/shakespeare_gpt_mixed_bf16", help="the Shakespeare run (or an export)")
    p.add_argument("--qlora-run", default="runs/shakespeare_gpt_qlora_nf4",
                   help="a QLoRA fine-tuning of the Shakespeare run on an nf4 base (module docstring)")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--batches", type=int, default=8, help="eval windows scored: batches of 16 (default 8)")
    p.add_argument("--tokens", type=int, default=64, help="tokens timed per generation (default 64)")
    p.add_argument("--target", default="h100")
    p.add_argument("--decode-only", action="store_true", help="the H100 decode step alone (bf16 and int8 weights)")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    (models,) = chosen(p, models=(args.models, MODELS))
    rows = []
    for model in models:
        if model == "llama3_8b":
            rows += measure_decode_only(args.target)
            continue
        source = (load_source(args.run) if model == "shakespeare" else load_source(args.qlora_run)
                  if model == "shakespeare_qlora" else with_nf4_base(gpt2_source()))
        rows += measure(model, source, 2 if model == "gpt2_small" else args.batches, args.tokens, args.target,
                        args.decode_only)
    result = {"command": command("benchmarks.serving", argv), "environment": environment(), "tokens": args.tokens,
              "goals": GOALS, "rows": rows, "verdicts": verdicts(rows)}
    name = "serving" if len(models) == len(MODELS) else f"serving-{'-'.join(models)}"
    write_tables(args.out, name + ("-decode" if args.decode_only else ""), result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

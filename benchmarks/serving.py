"""Serving a language model in half precision and int8 (issue 70): per weights/cache dtype,
the perplexity on the eval split, the agreement of greedy tokens with float32, tokens/s on this
CPU, the bytes a token reads, and the decode step compiled for an H100 (compile-only: its
modeled time per token against the bandwidth limit, bytes / 3.35 TB/s).

    python -m benchmarks.serving [--run runs/shakespeare_gpt_mixed_bf16] [--models shakespeare,gpt2_small]

``shakespeare``: the run of the README's command (``configs/shakespeare_gpt_mixed_bf16.yaml``),
its eval split. ``gpt2_small``: a Hugging Face Flax GPT-2 at GPT-2 small's shape (12 layers,
768 wide, 50,257 tokens, 1,024 positions) with random weights (none can be downloaded here):
its perplexity means nothing and is not given; the agreement is measured on random tokens.
Greedy agreement is teacher-forced: at each position of the same windows, whether the largest
logit is float32's. Writes ``benchmarks/results/serving.{json,md}`` (``serving-MODEL`` for one model).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from typing import Any

import jax
import numpy as np

from benchmarks.compile_only import chosen
from benchmarks.report import RESULTS, command, environment, write_tables
from train.inspections.gpu_time import CALIBRATION
from train.inspections.targets import TargetError
from train.serving import Generator, Sampling, Source, load_source
from train.serving.compiled import compile_decode_step

MODELS = ("shakespeare", "gpt2_small")
#: (weights, cache) rows per model; float32 first (the reference).
ROWS = {"shakespeare": [("f32", "f32"), ("bf16", "bf16"), ("f16", "f16"), ("int8", "bf16"), ("bf16", "int8"),
                        ("bf16", "fp8"), ("int8", "int8")],
        "gpt2_small": [("f32", "f32"), ("bf16", "bf16"), ("f16", "f16"), ("int8", "bf16")]}
GOALS = {"bf16_changed_greedy_max": 0.01, "int8_perplexity_vs_bf16_max": 0.01, "h100_ratio_max": 1.5}


class _Ids:
    """A tokenizer for ids alone (the random GPT-2: no tokenizer is needed to time it)."""

    def __init__(self, size: int):
        self.size = size

    def decode(self, ids: Any) -> str:
        return " ".join(str(int(i)) for i in np.ravel(ids))


def _gpt2_small() -> Source:
    import transformers

    from train.inspections.export import export_rules
    from train.weights import huggingface

    directory = tempfile.mkdtemp(prefix="gpt2-small-")
    config = transformers.GPT2Config(architectures=["GPT2LMHeadModel"])  # GPT-2 small's shape
    config.save_pretrained(directory)
    params = jax.device_get(transformers.FlaxGPT2LMHeadModel(config, seed=0).params)
    rules = type("Section", (), {"policy": "mixed_bf16", "rules": None})
    return Source(directory, "huggingface", huggingface.model(directory), params, {},
                  lambda dtype: export_rules(rules, dtype), _Ids(config.vocab_size), config.n_positions,
                  "n_positions", None, None)


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


def measure(model: str, source: Source, batches: int, tokens: int, target: str) -> list[dict[str, Any]]:
    windows = _windows(model, source, batches)
    prompt = windows[0][0, :8]
    rows, reference = [], None
    for dtype, kv in ROWS[model]:
        start = time.perf_counter()
        generator = Generator(source, dtype, kv)
        perplexity, greedy = _scores(generator, windows, source)
        reference = greedy if reference is None else reference
        row = {"model": model, "weights": dtype, "cache": kv, "perplexity": perplexity,
               "greedy_agreement": float(np.mean(greedy == reference)), "weight_bytes": generator.served.bytes,
               **_speed(generator, prompt, tokens)}
        try:
            step = compile_decode_step(generator, target)
            row |= {"bytes_per_token": step.bytes, "cache_bytes": step.cache_bytes, "length": step.length,
                    "h100_modeled_us": step.modeled.seconds * 1e6, "h100_limit_us": step.limit_seconds * 1e6,
                    "h100_ratio": step.ratio, "h100_launches": step.modeled.launches,
                    "h100_hlo_bytes": step.modeled.bytes, "gemms": step.gemms}
        except TargetError as e:
            row |= {"h100_error": str(e)}
        row["seconds"] = time.perf_counter() - start
        rows.append(row)
        print(_row_line(row), flush=True)
    return rows


def _row_line(r: dict[str, Any]) -> str:
    ppl = f"{r['perplexity']:.4f}" if r["perplexity"] is not None else "-"
    h100 = (f"{r['h100_modeled_us']:.1f} / {r['h100_limit_us']:.1f} us ({r['h100_ratio']:.2f}x) | "
            f"{r['h100_hlo_bytes'] / 1e6:.3f} | {r['h100_launches']}" if "h100_ratio" in r else "- | - | -")
    return (f"| {r['model']} | {r['weights']} | {r['cache']} | {ppl} | {100 * r['greedy_agreement']:.2f}% | "
            f"{r['tokens_per_second']:.1f} | {r.get('bytes_per_token', 0) / 1e6:.3f} | {h100} |")


def markdown(result: dict[str, Any]) -> str:
    lines = ["# Serving: weights and KV cache dtypes (issue 70)", "", f"Command: `{result['command']}`", "",
             f"Environment: {result['environment']}", "",
             "Perplexity on the eval split (Shakespeare; `-`: random weights), greedy tokens equal to float32's "
             "(teacher-forced, every position of the same windows), tokens/s decoding on this CPU (batch 1, "
             f"{result['tokens']} tokens, shared cores: noisy), bytes a token reads (every weight and the cache at the "
             "model's context), and the decode step compiled for an H100 (compile-only: modeled time per token against "
             "bytes / 3.35 TB/s).", "",
             "| model | weights | cache | perplexity | greedy = f32 | tokens/s (CPU) | MB per token | H100 modeled / "
             "bandwidth limit | MB the H100 step moves | its kernels |", "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [_row_line(r) for r in result["rows"]]
    lines += ["", "Goals: " + "; ".join(f"{k} {v}" for k, v in result["goals"].items()), ""]
    lines += [f"- {line}" for line in result["verdicts"]]
    return "\n".join(lines) + "\n"


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    shake = {(r["weights"], r["cache"]): r for r in rows if r["model"] == "shakespeare"}
    if ("bf16", "bf16") in shake:
        changed = 1 - shake[("bf16", "bf16")]["greedy_agreement"]
        out.append(f"bf16 weights change {100 * changed:.2f}% of greedy tokens against float32 on the Shakespeare GPT "
                   f"(goal <= 1%): {'met' if changed <= 0.01 else 'NOT met'}")
    if ("int8", "bf16") in shake and ("bf16", "bf16") in shake:
        rel = shake[("int8", "bf16")]["perplexity"] / shake[("bf16", "bf16")]["perplexity"] - 1
        out.append(f"int8 weights' perplexity is {100 * rel:+.2f}% of bf16's (goal within 1%): "
                   f"{'met' if abs(rel) <= 0.01 else 'NOT met'}")
    for r in rows:
        if r["weights"] == "bf16" and r["cache"] == "bf16" and "h100_ratio" in r:
            moved = r["h100_hlo_bytes"] / r["bytes_per_token"]
            out.append(f"{r['model']}: the modeled H100 decode step at batch 1 is {r['h100_ratio']:.2f}x its bandwidth "
                       f"limit (goal <= 1.5x): {'met' if r['h100_ratio'] <= 1.5 else 'NOT met'}; it moves "
                       f"{moved:.2f}x the bytes a token needs, in {r['h100_launches']} kernels: the model's "
                       f"{1e6 * CALIBRATION.gap_seconds:.1f} us between kernels and {1e6 * CALIBRATION.min_kernel_seconds:.0f} us "
                       f"shortest kernel take the rest (and its bandwidth share, {CALIBRATION.bandwidth_efficiency}, "
                       f"alone puts any step at {1 / CALIBRATION.bandwidth_efficiency:.2f}x or more)")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving", description=__doc__.split("\n\n")[0])
    p.add_argument("--run", default="runs/shakespeare_gpt_mixed_bf16", help="the Shakespeare run (or an export)")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--batches", type=int, default=8, help="eval windows scored: batches of 16 (default 8)")
    p.add_argument("--tokens", type=int, default=64, help="tokens timed per generation (default 64)")
    p.add_argument("--target", default="h100")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    (models,) = chosen(p, models=(args.models, MODELS))
    rows = []
    for model in models:
        source = load_source(args.run) if model == "shakespeare" else _gpt2_small()
        rows += measure(model, source, args.batches if model == "shakespeare" else 2, args.tokens, args.target)
    result = {"command": command("benchmarks.serving", argv), "environment": environment(), "tokens": args.tokens,
              "goals": GOALS, "rows": rows, "verdicts": verdicts(rows)}
    write_tables(args.out, "serving" if len(models) == len(MODELS) else f"serving-{'-'.join(models)}", result,
                 markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

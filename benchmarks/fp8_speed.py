"""FP8 speed on a GPU: ``mixed_fp8`` against ``mixed_bf16``, the same train step.

Two shapes (issue 26): GPT-2-small (12 layers, d_model 768, sequence 1024) and a
~1B Llama-shaped decoder (16 layers, d_model 2048, sequence 2048; the project's
GPT at that shape). For each: the compiled step's FP8 GEMMs (cuBLASLt FP8 calls
or Triton GEMM fusions whose operands are f8 in the optimized HLO, which of the
two ran them, and how they accumulate), the median step time of both
policies timed in turn (ABBA rounds), and the loss after the same steps from
the same init (goal: within 1% of bf16; speed goal on the 1B shape: >= 1.3x).

    python -m benchmarks.fp8_speed [--shapes gpt2_small,llama_1b] [--steps 30] [--min-size 1024]
        [--scaling current|delayed|rowwise] [--attention] [--out DIR]

On a CPU it runs (``--shapes tiny`` for a check) but its times mean nothing:
XLA's CPU backend widens FP8 and bf16 dots to float32. Writes
``benchmarks/results/fp8_speed-<device>.{json,md}``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
from collections import Counter
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import precision
from benchmarks.measure import alternating_ratio
from benchmarks.report import RESULTS, device_slug, environment, write_tables
from train import create_train_state, make_train_step
from train.inspections.gpu_kernels import read_kernels
from train.models import GPT

#: name -> (layers, heads, d_model, sequence, batch, vocabulary)
SHAPES = {
    "tiny": (2, 2, 64, 32, 4, 256),
    "gpt2_small": (12, 12, 768, 1024, 8, 32768),
    "llama_1b": (16, 16, 2048, 2048, 4, 32768),  # 0.94B params
    "gpt_1b3": (24, 16, 2048, 2048, 4, 32768),  # 1.34B params, 8,192 tokens a step
}


def fp8_gemms(compiled_text: str) -> dict[str, Any]:
    """GEMMs of an optimized GPU HLO module (cuBLAS/cuBLASLt calls and Triton GEMM fusions),
    how many take FP8 operands, which kind ran them (cuBLASLt FP8 or Triton FP8 GEMMs) and
    how they accumulate (fast or float32: :func:`train.inspections.gpu_kernels.fp8_accumulation`)."""
    gemms = [k for k in read_kernels(compiled_text) if k.gemm]
    return {"gemms": len(gemms), "fp8_gemms": sum(k.fp8 for k in gemms),
            "fp8_by": dict(Counter(k.kind for k in gemms if k.fp8)),
            "fp8_accumulation": dict(Counter(k.accumulation for k in gemms if k.fp8))}


def _state_and_step(shape: tuple[int, ...], policy: str, fp8: dict[str, Any]):
    layers, heads, d_model, seq, batch, vocab = shape
    model = GPT(vocab_size=vocab, block_size=seq, num_layers=layers, num_heads=heads, d_model=d_model)
    tokens = np.random.default_rng(0).integers(0, vocab, size=(batch, seq + 1))
    data = {"inputs": jnp.asarray(tokens[:, :-1]), "labels": jnp.asarray(tokens[:, 1:])}
    state = create_train_state(model, policy, optax.adamw(3e-4), jax.random.PRNGKey(0), data["inputs"][:1],
                               fp8=fp8)
    step = make_train_step(task="language_model", donate=True)
    return state, step, data


def measure(name: str, steps: int, rounds: int, fp8: dict[str, Any]) -> dict[str, Any]:
    """Both policies on one shape: FP8 GEMMs in the compiled step, step-time ratio, losses
    (``fp8``: the options of :func:`precision.fp8_options`)."""
    shape = SHAPES[name]
    runs = {p: _state_and_step(shape, p, fp8) for p in ("mixed_bf16", "mixed_fp8")}
    # One compilation per policy, both at once (XLA compiles outside the GIL): the
    # compiled step is the one timed and trained with.
    with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:
        futures = {p: pool.submit(lambda r: r[1].lower(r[0], r[2]).compile(), r) for p, r in runs.items()}
        compiled = {p: f.result() for p, f in futures.items()}
    explanation = precision.explain(runs["mixed_fp8"][0].model.module, runs["mixed_fp8"][2]["inputs"][:1],
                                    policy="mixed_fp8", backward=True, fp8=fp8)

    def stepper(policy):
        return lambda carry: compiled[policy](carry[0], runs[policy][2])

    params = sum(x.size for x in jax.tree_util.tree_leaves(runs["mixed_bf16"][0].params))
    losses = {}
    for policy, (state, _, data) in runs.items():  # the same steps from the same init: the loss each reaches
        state = jax.tree_util.tree_map(jnp.copy, state)  # the timing below donates the originals
        for _ in range(steps):
            state, metrics = compiled[policy](state, data)
        losses[policy] = float(metrics["loss"])
    timing = alternating_ratio(stepper("mixed_bf16"), (runs["mixed_bf16"][0], None), stepper("mixed_fp8"),
                               (runs["mixed_fp8"][0], None), rounds=rounds, steps_per_round=steps)
    return {"shape": dict(zip(("layers", "heads", "d_model", "seq", "batch", "vocab"), shape)), "fp8": fp8,
            "params": params, "steps": steps,
            "fp8_share": explanation.fp8_share, "gemms": {p: fp8_gemms(c.as_text()) for p, c in compiled.items()},
            "bf16_seconds": timing["a_seconds"], "fp8_seconds": timing["b_seconds"],
            "speedup": 1.0 / timing["ratio"], "loss": losses,
            "loss_vs_bf16": losses["mixed_fp8"] / losses["mixed_bf16"] - 1}


def markdown(result: dict[str, Any]) -> str:
    lines = ["# FP8 speed: mixed_fp8 vs mixed_bf16", "", f"device: {result['device']}", "",
             "| shape | params | fp8 share of matmul FLOPs | FP8 GEMMs in the step | bf16 step | fp8 step | speedup | "
             "loss vs bf16 |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in result["shapes"].items():
        g = r["gemms"]["mixed_fp8"]
        by = ", ".join([f"{n} {kind}" for kind, n in sorted(g.get("fp8_by", {}).items())]
                       + [f"{n} accumulating {how}" for how, n in sorted(g.get("fp8_accumulation", {}).items())])
        params = f"{r['params'] / 1e9:.2f}B" if "params" in r else "-"
        lines.append(f"| {name} | {params} | {100 * r['fp8_share']:.0f}% | {g['fp8_gemms']} of {g['gemms']}"
                     f"{f' ({by})' if by else ''} | "
                     f"{1e3 * r['bf16_seconds']:.1f} ms | {1e3 * r['fp8_seconds']:.1f} ms | {r['speedup']:.2f}x | "
                     f"{100 * r['loss_vs_bf16']:+.2f}% |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fp8_speed", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="gpt2_small,llama_1b")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--min-size", type=int, default=precision.fp8.DEFAULT_MIN_SIZE)
    p.add_argument("--scaling", default="current", choices=precision.fp8.SCALINGS)
    p.add_argument("--attention", action="store_true", help="attention's batched products in FP8 too")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    env = environment()
    fp8 = {"min_size": args.min_size, "scaling": args.scaling, "attention": args.attention}
    result = {"environment": env, "device": jax.devices()[0].device_kind,
              "shapes": {name: measure(name, args.steps, args.rounds, fp8) for name in args.shapes.split(",")}}
    write_tables(args.out, f"fp8_speed-{device_slug(env)}", result, markdown(result))
    return result


if __name__ == "__main__":
    main()

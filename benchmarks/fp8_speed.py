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
import statistics
import time
from collections import Counter
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import precision
from benchmarks.measure import alternating_ratio, in_tree_of
from benchmarks.profile_step import kind_of, traced
from benchmarks.report import RESULTS, device_slug, environment, write_tables
from benchmarks.step_models import ScannedLlama
from train import create_train_state, make_train_step
from train.inspections.gpu_kernels import read_kernels
from train.models import GPT

#: name -> (layers, heads, d_model, sequence, batch, vocabulary): the project's GPT at that shape
SHAPES = {
    "tiny": (2, 2, 64, 32, 4, 256),
    "gpt2_small": (12, 12, 768, 1024, 8, 32768),
    "llama_1b": (16, 16, 2048, 2048, 4, 32768),  # 0.94B params
    "gpt_1b3": (24, 16, 2048, 2048, 4, 32768),  # 1.34B params, 8,192 tokens a step
}
#: name -> (layers, heads, kv heads, width, MLP width, sequence, batch, vocabulary): a Llama with its
#: layers scanned (benchmarks.step_models.ScannedLlama: one layer to compile), trained with lean state
#: (bf16 params as their own masters, bf16 AdamW moments) so that one chip holds it; timed one
#: policy after the other.
LLAMA_SHAPES = {
    "llama_tiny": (2, 4, 2, 64, 176, 32, 2, 256),
    "llama3_8b": (32, 32, 8, 4096, 14336, 2048, 2, 128256),  # 8.03B params, 4,096 tokens a step
}
#: (bf16 policy, FP8 policy) by the state a shape trains with
POLICIES = {"mixed": ("mixed_bf16", "mixed_fp8"),
            "lean": ("lean_bf16", "params=bf16,compute=f8/bf16,output=f32,master=bf16,state=bf16")}


def fp8_gemms(compiled_text: str) -> dict[str, Any]:
    """GEMMs of an optimized GPU HLO module (cuBLAS/cuBLASLt calls and Triton GEMM fusions),
    how many take FP8 operands, which kind ran them (cuBLASLt FP8 or Triton FP8 GEMMs) and
    how they accumulate (fast or float32: :func:`train.inspections.gpu_kernels.fp8_accumulation`)."""
    gemms = [k for k in read_kernels(compiled_text) if k.gemm]
    return {"gemms": len(gemms), "fp8_gemms": sum(k.fp8 for k in gemms),
            "fp8_by": dict(Counter(k.kind for k in gemms if k.fp8)),
            "fp8_accumulation": dict(Counter(k.accumulation for k in gemms if k.fp8))}


def _model_and_data(name: str) -> tuple[Any, dict[str, jax.Array], str]:
    """The model of shape ``name``, a batch of random tokens, and the state it trains with."""
    if name in LLAMA_SHAPES:
        layers, heads, kv_heads, width, inner, seq, batch, vocab = LLAMA_SHAPES[name]
        model, state = ScannedLlama(vocab, width, heads, kv_heads, layers, inner), "lean"
    else:
        layers, heads, d_model, seq, batch, vocab = SHAPES[name]
        model, state = GPT(vocab_size=vocab, block_size=seq, num_layers=layers, num_heads=heads, d_model=d_model), "mixed"
    tokens = np.random.default_rng(0).integers(0, vocab, size=(batch, seq + 1))
    return model, {"inputs": jnp.asarray(tokens[:, :-1]), "labels": jnp.asarray(tokens[:, 1:])}, state


def _create(model: Any, policy: str, data: dict[str, jax.Array], fp8: dict[str, Any], like: Any = None):
    """The train state under ``policy``; given ``like``, in its tree (:func:`benchmarks.measure.in_tree_of`)."""
    state = create_train_state(model, policy, optax.adamw(3e-4), jax.random.PRNGKey(0), data["inputs"][:1], fp8=fp8)
    return state if like is None else in_tree_of(like, state)


def _one_after_the_other(model: Any, data: dict, abstract: dict, compiled: dict, steps: int, rounds: int,
                         fp8: dict[str, Any], profiles: dict | None = None) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds per step (median of ``rounds`` rounds of ``steps`` back to back) and the loss after
    them, one policy's state on the device at a time (a large model's two states do not fit together);
    with ``profiles`` (a dict), each policy's kernels traced after its timing, into it."""
    seconds, losses = {}, {}
    for policy, like in abstract.items():
        state = _create(model, policy, data, fp8, like)
        state, metrics = compiled[policy](state, data)  # warm-up
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(steps):
                state, metrics = compiled[policy](state, data)
            jax.block_until_ready(state)
            times.append((time.perf_counter() - start) / steps)
        seconds[policy], losses[policy] = statistics.median(times), float(metrics["loss"])
        print(f"  {policy}: {seconds[policy] * 1e3:.1f} ms a step, loss {losses[policy]:.4f} after "
              f"{1 + rounds * steps} steps", flush=True)
        if profiles is not None:
            state, profiles[policy] = _profiled(compiled[policy], state, data)
            print(f"  {policy}: device busy by kind (ms a step) "
                  f"{ {k: round(v * 1e3, 2) for k, v in profiles[policy]['by_kind'].items()} }", flush=True)
        del state, metrics
    return seconds, losses


def _profiled(step: Any, state: Any, data: dict, steps: int = 2) -> tuple[Any, dict[str, Any]]:
    """Traces ``steps`` steps: the device's busy time a step by kernel kind, and the top kernels."""
    carry = {"state": state}

    def run():
        for _ in range(steps):
            carry["state"], _ = step(carry["state"], data)
        return carry["state"]

    t = traced(run, steps)
    top = sorted(t["per_step"].items(), key=lambda item: -item[1])[:12]
    return carry["state"], {"source": t["source"], "busy_seconds": t["busy_seconds"], "by_kind": t["by_kind"],
                            "top": [{"kernel": name[:120], "kind": kind_of(name), "seconds": s} for name, s in top]}


def measure(name: str, steps: int, rounds: int, fp8: dict[str, Any], profile: bool = False) -> dict[str, Any]:
    """Both policies on one shape: FP8 GEMMs in the compiled step, step-time ratio, losses
    (``fp8``: the options of :func:`precision.fp8_options`)."""
    model, data, kind = _model_and_data(name)
    policies = POLICIES[kind]
    step = make_train_step(task="language_model", donate=True)
    abstract = {p: jax.eval_shape(lambda p=p: _create(model, p, data, fp8)) for p in policies}
    # One compilation per policy, both at once (XLA compiles outside the GIL), from the states'
    # shapes alone: the compiled step is the one timed and trained with.
    with concurrent.futures.ThreadPoolExecutor(len(policies)) as pool:
        futures = {p: pool.submit(lambda p: step.lower(abstract[p], data).compile(), p) for p in policies}
        compiled = {p: f.result() for p, f in futures.items()}
    explanation = precision.explain(model, data["inputs"][:1], policy=policies[1], backward=True, fp8=fp8)
    params = sum(x.size for x in jax.tree_util.tree_leaves(abstract[policies[0]].params))
    bf16, fp8_policy = policies
    if kind == "lean":
        profiles = {} if profile else None
        seconds, losses = _one_after_the_other(model, data, abstract, compiled, steps, rounds, fp8, profiles)
        timing = {"a_seconds": seconds[bf16], "b_seconds": seconds[fp8_policy],
                  "ratio": seconds[fp8_policy] / seconds[bf16], "profiles": profiles}
    else:
        runs = {p: _create(model, p, data, fp8, abstract[p]) for p in policies}
        losses = {}
        for policy, state in runs.items():  # the same steps from the same init: the loss each reaches
            state = jax.tree_util.tree_map(jnp.copy, state)  # the timing below donates the originals
            for _ in range(steps):
                state, metrics = compiled[policy](state, data)
            losses[policy] = float(metrics["loss"])
        stepper = lambda policy: (lambda carry: compiled[policy](carry[0], data))
        timing = alternating_ratio(stepper(bf16), (runs[bf16], None), stepper(fp8_policy), (runs[fp8_policy], None),
                                   rounds=rounds, steps_per_round=steps)
    return {"shape": _describe(name), "state": kind, "policies": list(policies), "fp8": fp8,
            "params": params, "steps": steps,
            "fp8_share": explanation.fp8_share, "gemms": {p: fp8_gemms(c.as_text()) for p, c in compiled.items()},
            "bf16_seconds": timing["a_seconds"], "fp8_seconds": timing["b_seconds"],
            "speedup": 1.0 / timing["ratio"], "loss": {"bf16": losses[bf16], "fp8": losses[fp8_policy]},
            "loss_vs_bf16": losses[fp8_policy] / losses[bf16] - 1, "profiles": timing.get("profiles")}


def _describe(name: str) -> dict[str, int]:
    if name in LLAMA_SHAPES:
        return dict(zip(("layers", "heads", "kv_heads", "d_model", "mlp", "seq", "batch", "vocab"), LLAMA_SHAPES[name]))
    return dict(zip(("layers", "heads", "d_model", "seq", "batch", "vocab"), SHAPES[name]))


def markdown(result: dict[str, Any]) -> str:
    lines = ["# FP8 speed: mixed_fp8 vs mixed_bf16", "", f"device: {result['device']}", "",
             "| shape | params | fp8 share of matmul FLOPs | FP8 GEMMs in the step | bf16 step | fp8 step | speedup | "
             "loss vs bf16 |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in result["shapes"].items():
        g = r["gemms"][r.get("policies", ["", "mixed_fp8"])[1]]
        by = ", ".join([f"{n} {kind}" for kind, n in sorted(g.get("fp8_by", {}).items())]
                       + [f"{n} accumulating {how}" for how, n in sorted(g.get("fp8_accumulation", {}).items())])
        params = f"{r['params'] / 1e9:.2f}B" if "params" in r else "-"
        lines.append(f"| {name} ({r.get('state', 'mixed')} state) | {params} | {100 * r['fp8_share']:.0f}% | {g['fp8_gemms']} of {g['gemms']}"
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
    p.add_argument("--profile", action="store_true", help="trace each policy's kernels after timing it (a shape "
                                                           "trained with lean state)")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES and s not in LLAMA_SHAPES]
    if unknown:
        p.error(f"unknown shape {', '.join(unknown)}; give some of {', '.join([*SHAPES, *LLAMA_SHAPES])}")
    env = environment()
    fp8 = {"min_size": args.min_size, "scaling": args.scaling, "attention": args.attention}
    result = {"environment": env, "device": jax.devices()[0].device_kind,
              "shapes": {name: measure(name, args.steps, args.rounds, fp8, args.profile) for name in args.shapes.split(",")}}
    write_tables(args.out, f"fp8_speed-{device_slug(env)}", result, markdown(result))
    return result


if __name__ == "__main__":
    main()

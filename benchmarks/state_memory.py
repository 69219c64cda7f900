"""Bytes per parameter of the train state under each policy, exact from its leaves.

The train state (params, float32 or bfloat16 masters, the optimizer's moments,
the loss scale) is built abstractly with ``jax.eval_shape`` (nothing allocated,
so a 1B model costs seconds) under AdamW, on the GPT-2-small shape and a
~1B Llama-style shape (the Llama of ``examples/user_models/hf_style.py``). Bytes
are split into params, masters, optimizer state and the rest (loss scale,
step, key); activations and gradients are not state and not counted.

    python -m benchmarks.state_memory [--shapes gpt2-small llama-1b] [--policies ...] [--time-steps 20]

It also times the train step of each policy on the Shakespeare GPT's shape
(``--time-shape``), alternating them in rounds: on CPU this is the overhead of
the state handling (casts, rounding, quantization), not a speed-up (half
precision is no faster there).

Prints a table and writes ``benchmarks/results/state_memory.{md,json}``
(``--out DIR`` for elsewhere).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import optax

import precision
import train
from train.models import GPT

RESULTS = pathlib.Path(__file__).parent / "results"
ROOT = pathlib.Path(__file__).resolve().parent.parent
POLICIES = ("fp32", "mixed_bf16", "O2", "lean_bf16", "params=bf16,compute=bf16,output=f32,master=bf16/kahan,opt=bf16",
            "lean_int8")


def _model(shape: str):
    if shape == "gpt2-small":
        return GPT(vocab_size=50257, block_size=1024, num_layers=12, num_heads=12, d_model=768), (1, 1024)
    if shape == "llama-1b":
        sys.path.insert(0, str(ROOT / "examples" / "user_models"))
        import hf_style

        return hf_style.Llama(32000, 2048, width=2048, heads=16, kv_heads=8, layers=18), (1, 2048)
    if shape == "shakespeare-gpt":  # configs/shakespeare_gpt_*.yaml's model and batch
        return GPT(vocab_size=82, block_size=128, num_layers=4, num_heads=4, d_model=128), (32, 128)
    if shape == "tiny":
        return GPT(vocab_size=64, block_size=16, num_layers=1, num_heads=2, d_model=32), (2, 16)
    raise ValueError(f"unknown shape {shape!r}: gpt2-small, llama-1b or tiny")


def measure(shape: str, policy: str) -> dict:
    """The train state's bytes per parameter by part (:func:`precision.state_bytes`), for ``policy`` on ``shape``."""
    model, tokens = _model(shape)
    sample = jnp.zeros(tokens, jnp.int32)
    state = jax.eval_shape(lambda: train.create_train_state(model, policy, optax.adamw(1e-4), jax.random.PRNGKey(0),
                                                            sample))
    n = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
    return {"shape": shape, "policy": policy, "params": n,
            "bytes_per_param": precision.state_bytes(state.params, state.opt_state)}


def step_times(shape: str, policies: list[str], steps: int, rounds: int = 3) -> dict[str, float]:
    """Median seconds per train step (AdamW) of each policy on ``shape``, measured in rounds that
    alternate the policies (so drift on a noisy machine hits all of them alike)."""
    import statistics
    import time

    model, tokens = _model(shape)
    batch = {"inputs": jnp.zeros(tokens, jnp.int32) + 1, "labels": jnp.zeros(tokens, jnp.int32) + 2}
    task = train.get_task("language_model")
    runs = {}
    for policy in policies:
        state = train.create_train_state(model, policy, optax.adamw(1e-4), jax.random.PRNGKey(0), batch["inputs"])
        step = train.make_train_step(task=task, donate=False)
        jax.block_until_ready(step(state, batch))  # compiled
        runs[policy] = (step, state)
    times: dict[str, list[float]] = {p: [] for p in policies}
    for _ in range(rounds):
        for policy, (step, state) in runs.items():
            start = time.perf_counter()
            for _ in range(steps):
                state, _ = step(state, batch)
            jax.block_until_ready(state)
            times[policy].append((time.perf_counter() - start) / steps)
    return {p: statistics.median(t) for p, t in times.items()}


def table(rows: list[dict]) -> str:
    head = ("shape", "params", "policy", "params B", "masters B", "optimizer B", "total B/param")
    lines = [head] + [(r["shape"], f"{r['params'] / 1e6:.0f}M", r["policy"],
                       *(f"{r['bytes_per_param'][k]:.2f}" for k in ("params", "masters", "optimizer", "total")))
                      for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    text = ["| " + " | ".join(c.ljust(w) for c, w in zip(line, widths)) + " |" for line in lines]
    text.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return ("Train state bytes per parameter under AdamW (exact, from jax.eval_shape of "
            "train.create_train_state)\n\n" + "\n".join(text))


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.state_memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["gpt2-small", "llama-1b"])
    p.add_argument("--policies", nargs="+", default=list(POLICIES))
    p.add_argument("--time-shape", default="shakespeare-gpt", help="the shape whose step time is measured")
    p.add_argument("--time-steps", type=int, default=20, help="steps per timed round (0: no timing)")
    p.add_argument("--out", help="results directory (default: benchmarks/results)")
    args = p.parse_args(argv)
    rows = [measure(shape, policy) for shape in args.shapes for policy in args.policies]
    text = table(rows)
    if args.time_steps:
        times = step_times(args.time_shape, args.policies, args.time_steps)
        base = times.get("mixed_bf16", next(iter(times.values())))
        for row in rows:
            row["step_s"] = {args.time_shape: times[row["policy"]]}
        text += (f"\n\nStep time on {args.time_shape} ({jax.devices()[0].device_kind}, median of 3 alternating rounds "
                 f"of {args.time_steps} steps), against mixed_bf16:\n\n| policy | step | ratio |\n|---|---|---|\n")
        text += "\n".join(f"| {p} | {t * 1e3:.1f} ms | {t / base:.2f}x |" for p, t in times.items())
    print(text)
    out = pathlib.Path(args.out) if args.out else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    (out / "state_memory.md").write_text(text + "\n")
    (out / "state_memory.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(f"written to {out / 'state_memory'}.{{md,json}}")
    return rows


if __name__ == "__main__":
    main()

"""Cost of the mixed-precision optax wrapper with dynamic loss scaling.

Times a jitted MLP train step two ways, alternately in one process:
  plain:   grad of the loss, ``optax.adam`` update, apply;
  wrapped: grad of the *scaled* loss, ``precision.mixed_precision(adam,
           DynamicLossScale)`` update (unscale, finiteness check, select,
           loss-scale adjust), apply.
Both run the same model under the same policy and donate their buffers, as a
real train step does, so the ratio is the wrapper's cost alone. Prints a table and writes it to ``benchmarks/results/``.

    python -m benchmarks.wrapper_overhead [--steps 60] [--batch 256] [--width 1024]

``--bytes`` compares instead what XLA's cost model says each compiled step reads
and writes (``compiled.cost_analysis()["bytes accessed"]``: no timing, so no
noise) for the suite's models: ``train.make_train_step`` (mixed_bf16, no loss
scale, AdamW) against the suite's hand-written JAX + optax step of the same
dtypes, for each ``skip_with``:

    python -m benchmarks.wrapper_overhead --bytes [--size quick] [--models mlp resnet gpt]
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import platform
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import precision
import train
from train.experiment import compile_cache

RESULTS = pathlib.Path(__file__).parent / "results"


class MLP(nn.Module):
    width: int
    depth: int = 3

    @nn.compact
    def __call__(self, x):
        for _ in range(self.depth):
            x = nn.relu(nn.Dense(self.width)(x))
        return nn.Dense(10)(x)


def make_steps(policy: str, width: int, batch: int, skip_with: str):
    model = precision.with_policy(MLP(width), policy)
    x = jax.random.normal(jax.random.key(0), (batch, 784))
    y = jax.random.randint(jax.random.key(1), (batch,), 0, 10)
    params = model.init(jax.random.key(2), x)["params"]

    def loss_fn(params):
        logits = model.apply({"params": params}, x).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    plain_tx = optax.adam(1e-3)

    @functools.partial(jax.jit, donate_argnums=(0, 1))  # as a real train step does
    def plain_step(params, opt_state):
        grads = jax.grad(loss_fn)(params)
        updates, opt_state = plain_tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    wrapped_tx = precision.mixed_precision(optax.adam(1e-3), precision.DynamicLossScale(2.0 ** 15),
                                            skip_with=skip_with)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def wrapped_step(params, opt_state):
        scale = precision.current_loss_scale(opt_state)
        grads = jax.grad(lambda p: scale.scale(loss_fn(p)))(params)
        updates, opt_state = wrapped_tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    copy = lambda tree: jax.tree_util.tree_map(jnp.copy, tree)
    return ((plain_step, (copy(params), plain_tx.init(params))),
            (wrapped_step, (copy(params), wrapped_tx.init(params))))


def _time(step, carry):
    start = time.perf_counter()
    carry = step(*carry)
    jax.block_until_ready(carry)
    return time.perf_counter() - start, carry


def measure(policy: str, width: int, batch: int, steps: int, skip_with: str) -> dict:
    (plain, plain_carry), (wrapped, wrapped_carry) = make_steps(policy, width, batch, skip_with)
    for _ in range(3):  # compile and warm up
        _, plain_carry = _time(plain, plain_carry)
        _, wrapped_carry = _time(wrapped, wrapped_carry)
    ratios, plain_times, wrapped_times = [], [], []
    for i in range(steps):  # alternate (and alternate which goes first) so drift hits both alike
        if i % 2:
            t_w, wrapped_carry = _time(wrapped, wrapped_carry)
            t_p, plain_carry = _time(plain, plain_carry)
        else:
            t_p, plain_carry = _time(plain, plain_carry)
            t_w, wrapped_carry = _time(wrapped, wrapped_carry)
        plain_times.append(t_p)
        wrapped_times.append(t_w)
        ratios.append(t_w / t_p)
    return {"policy": policy, "skip_with": skip_with, "width": width, "batch": batch, "steps": steps,
            "plain_ms": 1e3 * statistics.median(plain_times),
            "wrapped_ms": 1e3 * statistics.median(wrapped_times),
            "overhead_ratio": statistics.median(ratios),
            "ratio_of_medians": statistics.median(wrapped_times) / statistics.median(plain_times)}


def bytes_accessed(name: str, size: str = "quick", skip_with: tuple[str, ...] = ("select", "auto")) -> dict:
    """XLA bytes accessed of our train step (per ``skip_with``) and of the hand-written
    step for the benchmark model ``name``, and their ratios. Compiles, runs nothing."""
    from benchmarks import measure, suite
    from benchmarks.workloads import workload

    w = workload(name, size)
    variables, batch = suite.initial_variables(w), w.batch()
    row: dict = {"model": name, "size": size, "backend": jax.default_backend()}
    hand = None
    for skip in skip_with:
        ours = suite._state(w, "mixed_bf16", "none", (), variables, skip)
        if hand is None:
            hand_jit, hand_state = suite._hand_written_step(w, jnp.bfloat16, ours.params, ours.model_state)
            hand = measure.compiled_bytes_accessed(suite._compile(hand_jit, hand_state, batch)[1])
            row["hand_written_bytes"] = hand
        _, step, _ = suite._compile(train.make_train_step(donate=True), ours, batch)
        row[f"{skip}_bytes"] = measure.compiled_bytes_accessed(step)
        row[f"{skip}_ratio"] = row[f"{skip}_bytes"] / hand
    return row


def bytes_main(args) -> list[dict]:
    skips = tuple(args.skip_with.split(","))
    rows = [bytes_accessed(name, args.size, skips) for name in args.models]
    header = "| model | hand-written step (MB) | " + " | ".join(f"skip_with={k}: MB (ratio)" for k in skips) + " |"
    lines = [f"XLA bytes accessed of one train step ({jax.default_backend()}, jax {jax.__version__}, {args.size} "
             f"models, mixed_bf16, AdamW): `train.make_train_step` / the hand-written JAX + optax step. "
             f"`skip_with=auto` is `cond` on CPU, `select` elsewhere. Reproduce: "
             f"`python -m benchmarks.wrapper_overhead --bytes --size {args.size}`.", "",
             header, "|---|---|" + "---|" * len(skips)]
    for r in rows:
        lines.append(f"| {r['model']} | {r['hand_written_bytes'] / 1e6:.2f} | "
                     + " | ".join(f"{r[f'{k}_bytes'] / 1e6:.2f} ({r[f'{k}_ratio']:.4f})" for k in skips) + " |")
    table = "\n".join(lines)
    print(table)
    out = pathlib.Path(args.out or RESULTS / f"wrapper_bytes_{jax.default_backend()}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table + "\n")
    out.with_suffix(".json").write_text(json.dumps(rows, indent=2) + "\n")
    print(json.dumps({f"{r['model']}/{k}": round(r[f"{k}_ratio"], 4) for r in rows for k in skips}))
    return rows


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--policies", default="fp32,mixed_f16")
    parser.add_argument("--skip-with", default=None, help="skip strategies (default auto,select; select,auto "
                                                           "with --bytes)")
    parser.add_argument("--out", default=None, help="markdown file to write (a .json is written beside it)")
    parser.add_argument("--bytes", action="store_true", help="compare XLA bytes accessed of the suite's models instead")
    parser.add_argument("--size", default="quick", help="with --bytes: the suite's model size")
    parser.add_argument("--models", nargs="+", default=["mlp", "resnet", "gpt"], help="with --bytes: suite models")
    parser.add_argument("--cache-dir", help="persistent compilation cache (see train.experiment.compile_cache)")
    parser.add_argument("--no-cache", action="store_true")
    args = parser.parse_args(argv)
    if not args.no_cache:
        compile_cache.enable(args.cache_dir)
    if args.bytes:
        args.skip_with = args.skip_with or "select,auto"
        return bytes_main(args)
    args.skip_with = args.skip_with or "auto,select"
    args.out = args.out or str(RESULTS / f"wrapper_overhead_{jax.default_backend()}.md")
    rows = [measure(p, args.width, args.batch, args.steps, k)
            for p in args.policies.split(",") for k in args.skip_with.split(",")]
    header = ("| policy | skip_with | MLP | batch | plain optax (ms) | wrapper + dynamic scale (ms) | median of ratios "
              "| ratio of medians |")
    lines = [f"Wrapper overhead on {jax.devices()[0].device_kind} ({platform.processor() or platform.machine()}), "
             f"jax {jax.__version__}, {args.steps} alternating steps; 3x{args.width} MLP.", "", header,
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['policy']} | {r['skip_with']} | 784-{r['width']}x3-10 | {r['batch']} | {r['plain_ms']:.2f} | "
                     f"{r['wrapped_ms']:.2f} | {r['overhead_ratio']:.3f} | {r['ratio_of_medians']:.3f} |")
    table = "\n".join(lines)
    print(table)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table + "\n")
    out.with_suffix(".json").write_text(json.dumps(rows, indent=2) + "\n")
    print(json.dumps({f"{r['policy']}/{r['skip_with']}": round(r["overhead_ratio"], 4) for r in rows}))
    return rows


if __name__ == "__main__":
    main()

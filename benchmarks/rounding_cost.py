"""What stochastic rounding's random bits cost in a lean (bfloat16-stored) AdamW update.

On an H200 (2026-11-30) the lean update's fusions, which draw a random 32-bit word for every
param and both moments, took 76 + 14 ms of a 469 ms step at Llama-3-8B's shape: threefry2x32's
integer arithmetic, not the update's bytes (about 25 ms at the H200's bandwidth). This times
the update (``precision.stored_in(optax.adamw)`` with bfloat16 params as their own masters,
``precision.stored.master_updates``) jitted, with the shipped bits
(:func:`precision.rounding_bits.hashed_bits`) and with ``jax.random.bits`` (threefry, what
it drew before), on the device at hand; and the rounding alone. Medians of back-to-back calls.

    python -m benchmarks.rounding_cost [--params 16777216] [--calls 10] [--out DIR]

Writes ``rounding-cost-<device>.{json,md}``. On a CPU the ratio is the integer work's (the
CPU has no spare arithmetic to hide it behind memory either); a GPU's is the one that counts.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from benchmarks.measure import back_to_back_seconds
from benchmarks.report import RESULTS, command, device_slug, environment, write_tables
from precision import stored

GENERATORS = {"hashed (shipped)": stored.hashed_bits,
              "threefry (jax.random.bits)": lambda key, shape: jax.random.bits(key, shape, jnp.uint32)}


def _update(params: dict, grads: dict) -> Callable:
    """One lean AdamW update: bfloat16 moments stored with stochastic rounding, the bfloat16
    params moved to their stochastically rounded sums."""
    opt = stored.stored_in(optax.adamw(1e-4))
    masters = stored.init_masters(params, "stochastic")

    def step(params, opt_state):
        updates, opt_state = opt.update(grads, opt_state, params)
        moves, _ = stored.master_updates(params, updates, masters, "stochastic")
        return optax.apply_updates(params, moves), opt_state

    return jax.jit(step, donate_argnums=(0, 1)), opt.init(params)


def _seconds(fn: Callable, carry: tuple, calls: int) -> float:
    """Seconds per call of ``carry = fn(*carry)`` back to back, after one call to compile."""
    carry = jax.block_until_ready(fn(*carry))
    return back_to_back_seconds(lambda c: fn(*c), carry, calls)[0]


def measure(size: int, calls: int) -> list[dict[str, Any]]:
    """Seconds per lean update and per rounding of one array, by generator."""
    keys = jax.random.split(jax.random.key(0), 3)
    shape = (size // 4096, 4096)
    params = {"w": jax.random.normal(keys[0], shape, jnp.float32).astype(jnp.bfloat16)}
    grads = {"w": 1e-3 * jax.random.normal(keys[1], shape, jnp.float32)}
    x = jax.random.normal(keys[2], shape, jnp.float32)
    rows = []
    for name, bits in GENERATORS.items():
        original = stored.hashed_bits
        stored.hashed_bits = bits  # what stochastic_round draws from, for this row
        try:
            step, opt_state = _update(params, grads)
            update = _seconds(step, (jax.tree_util.tree_map(jnp.copy, params), opt_state), calls)
            # each call's rounded values (read back as float32) are the next call's input
            round_once = jax.jit(lambda x: (stored.stochastic_round(x, stored.step_key(jnp.uint32(1))).astype(x.dtype),))
            rounding = _seconds(round_once, (x,), calls)
        finally:
            stored.hashed_bits = original
        rows.append({"bits": name, "update_seconds": update, "round_seconds": rounding})
        print(f"{name:28s} update {update * 1e3:8.2f} ms, rounding alone {rounding * 1e3:8.2f} ms", flush=True)
    return rows


def markdown(result: dict[str, Any]) -> str:
    base = result["rows"][-1]
    lines = [f"# Stochastic rounding's random bits in a lean AdamW update, on {result['environment']['device']}", "",
             f"`{result['command']}` ({result['environment']['date']}, jax {result['environment']['jax']}). "
             f"{result['params']:,} bfloat16 params ({result['shape'][0]} x {result['shape'][1]}), bfloat16 moments; "
             "medians of back-to-back calls. *Rounding alone*: one float32 array of that shape stored in bfloat16 (and read back as float32, the next call's input).", "",
             "| random bits | lean update ms | vs threefry | rounding alone ms | vs threefry |", "|---|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['bits']} | {r['update_seconds'] * 1e3:.2f} | {r['update_seconds'] / base['update_seconds']:.2f}x"
                     f" | {r['round_seconds'] * 1e3:.2f} | {r['round_seconds'] / base['round_seconds']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.rounding_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=int, default=1 << 24, help="params in the update (a multiple of 4096)")
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    if args.params <= 0 or args.params % 4096:
        p.error(f"--params must be a positive multiple of 4096, got {args.params}")
    result = {"environment": environment(), "command": command("benchmarks.rounding_cost", argv),
              "params": args.params, "shape": [args.params // 4096, 4096], "rows": measure(args.params, args.calls)}
    write_tables(args.out, f"rounding-cost-{device_slug(result['environment'])}", result, markdown(result))
    return result


if __name__ == "__main__":
    main()

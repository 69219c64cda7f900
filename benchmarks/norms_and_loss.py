"""Closed-form norms and the loss in blocks, timed on a device: each switched off in turn.

GPT-2 small at its real vocabulary (50,304; 16 x 1,024 tokens a step) under ``mixed_bf16``:
our train step as it ships (norms' backward in closed form, the loss in blocks of rows from 8 GiB
of float32 logits), with ``precision.fuse_norms`` false (norms differentiated op by op), and with
``precision.blockwise_loss`` true and false (the loss in blocks, or over the whole logits,
whatever their size). For each:

- the time per step run back to back (as training runs them), the variants in turn in
  rounds (the order rotating each round, so drift hits all alike), medians;
- XLA's memory plan of the step (arguments + outputs - donated + temporaries: the peak the
  allocator is asked for) at 16 and 32 rows, and the largest batch whose plan fits the
  device's memory, the plan extended linearly in the rows;
- that largest batch run: compiled, three steps back to back (it fits, or the error says
  what it ran out of), its time per step and tokens per second.

    python -m benchmarks.norms_and_loss [--size gpu|quick] [--model gpt2_small|gpt] [--rounds 8] [--no-largest]
        [--limit-gib G] [--out DIR]

Run with ``XLA_PYTHON_CLIENT_MEM_FRACTION=0.95`` or so on a GPU: the largest batch is
sized to what the allocator may take (``memory_stats()["bytes_limit"]``). On a CPU it
runs (``--size quick``) but its times mean nothing. Writes
``norms-and-loss-<device>.{json,md}``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import optax

import precision
import train
from benchmarks.measure import compiled_memory, in_tree_of
from benchmarks.report import RESULTS, device_slug, environment, write_tables
from benchmarks.workloads import Workload, model_flops_per_step, workload

#: "as shipped" takes the loss in blocks only from 8 GiB of float32 logits ("auto": not at 16 rows of
#: GPT-2 small, yes at its largest batch); "on" and "off" force it either way.
VARIANTS = {"as shipped": {}, "fuse_norms off": {"fuse_norms": False},
            "blockwise_loss on": {"blockwise_loss": True}, "blockwise_loss off": {"blockwise_loss": False}}
HEADROOM = 0.97  # of the allocator's limit: what fragmentation may take


def _at_rows(w: Workload, rows: int) -> Workload:
    return Workload(w.name, w.model, jax.ShapeDtypeStruct((rows,) + w.inputs.shape[1:], w.inputs.dtype),
                    w.num_classes, w.tokens_per_example, w.rules)


def _state(w: Workload, ops: dict[str, Any], like: Any = None) -> Any:
    """The train state of ``w`` under ``ops``; given ``like``, in its tree (:func:`benchmarks.measure.in_tree_of`)."""
    state = train.create_train_state(w.model, "mixed_bf16", optax.adamw(1e-3, weight_decay=1e-4), jax.random.key(0),
                                     jnp.zeros((1,) + w.inputs.shape[1:], w.inputs.dtype), loss_scale="none",
                                     ops=precision.op_lists(**ops))
    return state if like is None else in_tree_of(like, state)


def _compiled(w: Workload, ops: dict[str, Any], rows: int) -> dict[str, Any]:
    """The step of ``w`` at ``rows`` rows under ``ops``, compiled from shapes alone, and its memory plan."""
    w = _at_rows(w, rows)
    like = jax.eval_shape(lambda: _state(w, ops))
    batch = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), w.batch())
    compiled = train.make_train_step(donate=True).lower(like, batch).compile()
    plan = compiled_memory(compiled)
    return {"step": compiled, "like": like, "w": w, "ops": ops, "plan_bytes": int(plan["total"]),
            "temp_bytes": int(plan["temps"]), "rows": rows}


def _ready(p: dict[str, Any]) -> dict[str, Any]:
    """``p`` with a state and batch on the device to run its step on."""
    return {**p, "state": _state(p["w"], p["ops"], p["like"]), "batch": p["w"].batch()}


def _rounds(prepared: dict[str, dict[str, Any]], rounds: int, steps: int) -> dict[str, list[float]]:
    """Seconds per step of each variant, ``steps`` back to back a round, the order rotating."""
    names = list(prepared)
    times: dict[str, list[float]] = {n: [] for n in names}
    for name in names:  # warm up
        p = prepared[name]
        p["state"] = jax.block_until_ready(p["step"](p["state"], p["batch"])[0])
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            p = prepared[name]
            start = time.perf_counter()
            state = p["state"]
            for _ in range(steps):
                state = p["step"](state, p["batch"])[0]
            p["state"] = jax.block_until_ready(state)
            times[name].append((time.perf_counter() - start) / steps)
    return times


def _largest(plan_small: dict, plan_large: dict, limit: int) -> int:
    per_row = (plan_large["plan_bytes"] - plan_small["plan_bytes"]) / (plan_large["rows"] - plan_small["rows"])
    fixed = plan_small["plan_bytes"] - per_row * plan_small["rows"]
    return int((HEADROOM * limit - fixed) // per_row)


def _run_largest(p: dict[str, Any]) -> dict[str, Any]:
    """Runs the compiled step ``p`` three times back to back: its time, or what it ran out of."""
    rows = p["rows"]
    try:
        p = _ready(p)
        state = jax.block_until_ready(p["step"](p["state"], p["batch"])[0])
        start = time.perf_counter()
        for _ in range(3):
            state = p["step"](state, p["batch"])[0]
        jax.block_until_ready(state)
        seconds = (time.perf_counter() - start) / 3
        return {"rows": rows, "ran": True, "plan_bytes": p["plan_bytes"], "step_seconds": seconds,
                "tokens_per_second": rows * p["w"].tokens_per_example / seconds}
    except Exception as err:  # noqa: BLE001 - an out-of-memory is a result here, not a failure
        return {"rows": rows, "ran": False, "plan_bytes": p["plan_bytes"],
                "error": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"}


def measure(size: str, rounds: int, steps: int, largest: bool, limit: int | None = None,
            model: str = "gpt2_small") -> dict[str, Any]:
    """Every variant: time at the workload's batch, memory plans, and the largest batch run."""
    w = workload(model, size)
    rows = w.batch_size
    with concurrent.futures.ThreadPoolExecutor(2 * len(VARIANTS)) as pool:
        timed = {n: pool.submit(_compiled, w, ops, rows) for n, ops in VARIANTS.items()}
        doubled = {n: pool.submit(_compiled, w, ops, 2 * rows) for n, ops in VARIANTS.items()}
        timed = {n: _ready(f.result()) for n, f in timed.items()}
        doubled = {n: f.result() for n, f in doubled.items()}
    times = _rounds(timed, rounds, steps)
    device = jax.devices()[0]
    limit = limit or (device.memory_stats() or {}).get("bytes_limit")
    flops = model_flops_per_step(w)
    out: dict[str, Any] = {}
    for name in VARIANTS:
        seconds = statistics.median(times[name])
        out[name] = {"step_seconds": seconds, "seconds_by_round": times[name],
                     "tokens_per_second": rows * w.tokens_per_example / seconds,
                     "model_tflops_per_second": flops / seconds / 1e12 if flops else None,
                     "plan_bytes": timed[name]["plan_bytes"], "temp_bytes": timed[name]["temp_bytes"],
                     "plan_bytes_double": doubled[name]["plan_bytes"],
                     "largest_rows": _largest(timed[name], doubled[name], limit) if limit else None}
        print(f"{name:20s} {seconds * 1e3:8.2f} ms/step back to back, plan {timed[name]['plan_bytes'] / 2**30:.2f} GiB "
              f"at {rows} rows, largest batch {out[name]['largest_rows']}", flush=True)
    del timed, doubled
    if largest and limit:
        with concurrent.futures.ThreadPoolExecutor(len(VARIANTS)) as pool:
            big = {n: pool.submit(_compiled, w, ops, out[n]["largest_rows"]) for n, ops in VARIANTS.items()}
            big = {n: f.result() for n, f in big.items()}
        for name in VARIANTS:  # run one at a time: each may take the whole device
            out[name]["largest"] = _run_largest(big.pop(name))
            print(f"{name:20s} at {out[name]['largest_rows']} rows: {out[name]['largest']}", flush=True)
    return {"model": w.describe(), "rows": rows, "tokens_per_row": w.tokens_per_example, "rounds": rounds,
            "steps_per_round": steps, "bytes_limit": limit, "variants": out}


def markdown(result: dict[str, Any]) -> str:
    env, v = result["environment"], result["variants"]
    base = v["as shipped"]
    lines = [f"# Closed-form norms and the loss in blocks, each switched off, on {result['device']}", "",
             f"`{result['command']}` ({env['date']}, jax {env['jax']}). {result['model']}, "
             f"`mixed_bf16`, AdamW, {result['rows']} x {result['tokens_per_row']} tokens. *Step*: the median over "
             f"{result['rounds']} rounds of {result['steps_per_round']} steps back to back, the variants in turn. "
             f"*Plan*: XLA's memory plan of the step (arguments + outputs - donated + temporaries). *Largest "
             f"batch*: rows whose plan fits {HEADROOM:.0%} of the allocator's "
             f"{(result['bytes_limit'] or 0) / 2**30:.1f} GiB, the plans at {result['rows']} and "
             f"{2 * result['rows']} rows extended linearly; then compiled and run three steps.", "",
             "| step | ms / step | x as shipped | plan GiB | temporaries GiB | largest batch | ran | ms / step there "
             "| tokens/s there |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in v.items():
        big = r.get("largest", {})
        ran = "yes" if big.get("ran") else (big.get("error", "") or "-")
        there = f"{big['step_seconds'] * 1e3:.1f} | {big['tokens_per_second']:,.0f}" if big.get("ran") else "- | -"
        lines.append(f"| {name} | {r['step_seconds'] * 1e3:.2f} | {r['step_seconds'] / base['step_seconds']:.3f} | "
                     f"{r['plan_bytes'] / 2**30:.2f} | {r['temp_bytes'] / 2**30:.2f} | {r['largest_rows']} | {ran} | "
                     f"{there} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.norms_and_loss", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="gpu", choices=("quick", "gpu"))
    p.add_argument("--model", default="gpt2_small", choices=("gpt2_small", "gpt"),
                   help="gpt: the suite's small GPT (a quick check of this script)")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=5, help="steps back to back a round")
    p.add_argument("--no-largest", action="store_true", help="skip running the largest batch of each")
    p.add_argument("--limit-gib", type=float, help="the memory to fit (default: the allocator's limit)")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    env = environment()
    result = {"environment": env, "device": jax.devices()[0].device_kind,
              "command": "python -m benchmarks.norms_and_loss " + " ".join(sys.argv[1:] if argv is None else argv),
              **measure(args.size, args.rounds, args.steps, not args.no_largest,
                        int(args.limit_gib * 2**30) if args.limit_gib else None, args.model)}
    write_tables(args.out, f"norms-and-loss-{device_slug(env)}", result, markdown(result))
    return result


if __name__ == "__main__":
    main()

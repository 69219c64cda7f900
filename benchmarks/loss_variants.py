"""The loss over a language model's logits, five ways, timed on a device.

On the H200 (2026-11-28) our step's cross-entropy reduction over GPT-2 small's logits (16 x 1024
x 50,304, one pass: maximum, sum of exponentials and first maximum folded together, an online
softmax) took 1.85 ms, where the hand-written step's two plain reductions (maximum, then sum of
exponentials) took 0.50 + 0.69 ms: the fold evaluates two exponentials per logit and a variadic
reduction, and the pass it saves is cheaper than that work. This times the candidates on the
same logits (bf16, read as float32), forward alone and forward with the gradient:

- ``online softmax, two exps``: that one-pass fold (``precision.losses.cross_entropy`` until
  2026-11-30), the sum rescaled by ``exp(peak_a - peak)`` and ``exp(peak_b - peak)``;
- ``online softmax, one exp``: the same fold with the smaller side rescaled by
  ``exp(-|peak_a - peak_b|)``, one exponential a logit (``precision.losses`` on a TPU);
- ``first maximum, then logsumexp`` (``precision.losses.cross_entropy`` as shipped): a
  (maximum, first position) reduction, then the sum of exponentials against that maximum: two
  passes, one exponential a logit;
- ``three plain passes``: maximum, sum of exponentials, first position holding the maximum, each
  a single-output reduction;
- ``loss alone``: ``jax.nn.logsumexp`` and the label's logit, no correctness (what the
  hand-written step computes).

On the H200 (2026-11-30, ``results/loss-variants-nvidia-h200-2026-11-30.md``), forward / with
the gradient: the two-exp fold 1.685 / 2.250 ms, the one-exp fold 1.422 / 2.134, first maximum
then logsumexp 1.223 / 2.017, three plain passes 1.267 / 2.019, the loss alone 1.008 / 3.424
(its gradient through the label's gather). So the library ships first maximum, then logsumexp.

Each gives the same loss (checked against the shipped one) and, but the last, the same
correctness. Back-to-back calls, medians of rounds.

    python -m benchmarks.loss_variants [--shape 16,1024,50304] [--calls 20] [--out DIR]

On a CPU it runs (``--shape 4,64,512``); its times are the CPU's. Writes ``loss-variants-<device>.{json,md}``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.report import RESULTS, device_slug, environment, write_tables
from precision import losses


def _fold_two_exps(a: tuple, b: tuple) -> tuple:
    """The online-softmax fold as shipped until 2026-11-30: each side's sum rescaled to the
    larger maximum, two exponentials; a side that has seen only -inf adds nothing."""
    (peak_a, total_a, first_a), (peak_b, total_b, first_b) = a, b
    peak, first = losses._first_maximum((peak_a, first_a), (peak_b, first_b))
    # exp(-inf - -inf) is nan: a side that has seen nothing (or only -inf) adds nothing
    rescale = lambda p, t: jnp.where(p == -jnp.inf, 0.0, t * jnp.exp(p - peak))  # noqa: E731
    return peak, rescale(peak_a, total_a) + rescale(peak_b, total_b), first


def _online(fold: Callable) -> Callable:
    """Logsumexp and the first maximum in one reduction: each logit folds into a running
    (maximum, sum of ``exp(x - maximum)``, first position of the maximum) by ``fold``."""

    def lse_and_first(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
        positions = losses._positions(logits)
        init = (jnp.asarray(-jnp.inf, logits.dtype), jnp.zeros([], logits.dtype),
                jnp.asarray(logits.shape[-1], jnp.int32))
        peak, total, first = jax.lax.reduce((logits, jnp.ones_like(logits), positions), init, fold,
                                            (logits.ndim - 1,))
        return peak + jnp.log(total), first

    return lse_and_first


def _three_plain_passes(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Maximum, sum of exponentials against it, then the first position holding it: three
    single-output reductions (none variadic)."""
    peak = jnp.max(logits, axis=-1)
    safe = jnp.where(jnp.isfinite(peak), peak, 0.0)
    total = jnp.sum(jnp.exp(logits - safe[..., None]), axis=-1)
    positions = losses._positions(logits)
    holds = (logits == peak[..., None]) | jnp.isnan(peak)[..., None]
    first = jnp.min(jnp.where(holds, positions, logits.shape[-1]), axis=-1)
    return safe + jnp.log(total), first


def _with_lse(lse_and_first: Callable) -> Callable:
    """The shipped custom-VJP cross-entropy with its forward reduction swapped."""

    @jax.custom_vjp
    def ce(logits, labels):
        return fwd(logits, labels)[0]

    def fwd(logits, labels):
        log_total, first = lse_and_first(logits)
        label_logit = jnp.take_along_axis(logits, labels[..., None], -1)[..., 0]
        return (log_total - label_logit, first == labels), (logits, labels, log_total)

    ce.defvjp(fwd, losses._cross_entropy_bwd)
    return lambda logits, labels: ce(logits.astype(jnp.float32), labels)


def _loss_alone(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
    logits = logits.astype(jnp.float32)
    label_logit = jnp.take_along_axis(logits, labels[..., None], -1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - label_logit, jnp.zeros(labels.shape, bool)


VARIANTS = {"online softmax, two exps": _with_lse(_online(_fold_two_exps)),
            "online softmax, one exp": _with_lse(_online(losses._fold_one_exp)),
            "first maximum, then logsumexp (shipped)": losses.cross_entropy,
            "maximum, logsumexp, first position: three plain passes": _with_lse(_three_plain_passes),
            "loss alone (no correctness)": _loss_alone}


def _seconds(fn: Callable, args: tuple, calls: int, rounds: int = 3) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def measure(shape: tuple[int, ...], calls: int) -> list[dict[str, Any]]:
    """Every variant's forward and forward-with-gradient time, and its agreement with the shipped loss."""
    key_logits, key_labels = jax.random.split(jax.random.key(0))
    logits = (3 * jax.random.normal(key_logits, shape, jnp.float32)).astype(jnp.bfloat16)
    labels = jax.random.randint(key_labels, shape[:-1], 0, shape[-1], jnp.int32)
    shipped_loss, shipped_correct = jax.jit(losses.cross_entropy)(logits, labels)
    rows = []
    for name, ce in VARIANTS.items():
        forward = jax.jit(ce)
        grad = jax.jit(jax.value_and_grad(lambda x, y, ce=ce: ce(x, y)[0].mean()))
        loss, correct = forward(logits, labels)
        rows.append({"variant": name, "forward_seconds": _seconds(forward, (logits, labels), calls),
                     "with_gradient_seconds": _seconds(grad, (logits, labels), calls),
                     "loss_error": float(jnp.max(jnp.abs(loss - shipped_loss) / jnp.abs(shipped_loss))),
                     "correct_agrees": bool(jnp.all(correct == shipped_correct)) if "alone" not in name else None,
                     "logits_bytes": int(np.prod(shape)) * 2})
        print(f"{name:36s} forward {rows[-1]['forward_seconds'] * 1e3:8.3f} ms, with gradient "
              f"{rows[-1]['with_gradient_seconds'] * 1e3:8.3f} ms, loss error {rows[-1]['loss_error']:.1e}", flush=True)
    return rows


def markdown(result: dict[str, Any]) -> str:
    env = result["environment"]
    lines = [f"# The loss over a language model's logits, five ways, on {result['device']}", "",
             f"`{result['command']}` ({env['date']}, jax {env['jax']}). Logits bf16 {result['shape']} (read as "
             f"float32), int32 labels; back-to-back calls, medians. *Loss error*: the largest relative difference "
             f"from the shipped loss.", "",
             "| variant | forward ms | with gradient ms | loss error | correctness as shipped |", "|---|---|---|---|---|"]
    for r in result["rows"]:
        agrees = "-" if r["correct_agrees"] is None else ("yes" if r["correct_agrees"] else "NO")
        lines.append(f"| {r['variant']} | {r['forward_seconds'] * 1e3:.3f} | {r['with_gradient_seconds'] * 1e3:.3f} | "
                     f"{r['loss_error']:.1e} | {agrees} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.loss_variants", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="16,1024,50304")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    try:
        shape = tuple(int(d) for d in args.shape.split(","))
    except ValueError:
        shape = ()
    if len(shape) < 2 or min(shape) < 1:
        p.error(f"--shape {args.shape!r}: give positive sizes, the vocabulary last, e.g. 16,1024,50304")
    env = environment()
    result = {"environment": env, "device": jax.devices()[0].device_kind, "shape": list(shape),
              "rows": measure(shape, args.calls),
              "command": "python -m benchmarks.loss_variants " + " ".join(sys.argv[1:] if argv is None else argv)}
    write_tables(args.out, f"loss-variants-{device_slug(env)}", result, markdown(result))
    return result


if __name__ == "__main__":
    main()

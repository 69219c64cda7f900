"""Gradient underflow: pure float16 without loss scaling, and what scaling recovers.

The setting: an MLP autoencoder on Fashion-MNIST images in [0, 1] with a
sigmoid output and the usual per-pixel mean squared error, at a large batch
(16384, as in large-batch training). The mean over batch x 784 pixels makes
every output gradient 2 * error / 12.8e6, and the sigmoid of the (mostly black)
background shrinks it further: below float16's smallest subnormal,
2**-24 ~ 6e-8, so in float16 it is exactly zero, and so is every gradient
computed from it. At batch 512 only ~5% of the gradient values underflow and
AdamW trains through it (measured); at 16384 all of them do.

Three runs, same init and data order, AdamW, float32 master weights in all:
  ``fp32``          the reference;
  ``pure_f16``      params and compute in float16, no loss scaling;
  ``pure_f16_dyn``  the same with dynamic loss scaling.
Reports the fraction of gradient values that underflow (nonzero in float32,
zero in float16), at init and along training, the test reconstruction error, and
plots both (``docs/underflow.png``).

    python -m benchmarks.underflow [--steps 150] [--batch 16384] [--data DIR] [--out DIR] [--docs DIR]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import precision
from benchmarks.report import RESULTS, environment, pyplot
from train.data import load_fashion_mnist

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
F16_TINY = 2.0 ** -24  # smallest positive float16 (subnormal)
CASES = {"fp32": ("fp32", precision.NoOpLossScale()),
         "pure_f16": ("pure_f16", precision.NoOpLossScale()),
         "pure_f16_dyn": ("pure_f16", precision.DynamicLossScale(2.0 ** 15))}


class Autoencoder(nn.Module):
    """784 -> 256 -> 32 -> 256 -> 784, ReLU inside, sigmoid out."""

    widths: tuple[int, ...] = (256, 32, 256)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        shape = x.shape
        h = x.reshape((shape[0], -1))
        for width in self.widths:
            h = nn.relu(nn.Dense(width)(h))
        return nn.sigmoid(nn.Dense(int(np.prod(shape[1:])))(h)).reshape(shape)


def _images(data_dir: str | None) -> tuple[np.ndarray, np.ndarray]:
    data = load_fashion_mnist(data_dir)
    # Undo the loader's standardisation: autoencoders reconstruct pixels in [0, 1].
    lo, hi = data.x_train.min(), data.x_train.max()
    return (data.x_train - lo) / (hi - lo), (data.x_test - lo) / (hi - lo)


def _loss(model: Any, params: Any, x: jax.Array, scale: Any) -> jax.Array:
    recon = model.apply({"params": params}, x).astype(jnp.float32)
    return scale.scale(jnp.mean(jnp.square(recon - x)))


def underflow_fraction(model32: Any, model16: Any, params: Any, x: jax.Array) -> dict[str, float]:
    """Of the gradient values float32 computes as nonzero, the fraction float16 computes as zero
    (unscaled), and the fraction of float32 values below float16's smallest subnormal."""
    g32 = jax.grad(_loss, argnums=1)(model32, params, x, precision.NoOpLossScale())
    g16 = jax.grad(_loss, argnums=1)(model16, jax.tree_util.tree_map(lambda p: p.astype(jnp.float16), params), x,
                                     precision.NoOpLossScale())
    a = np.concatenate([np.ravel(v) for v in jax.tree_util.tree_leaves(g32)])
    b = np.concatenate([np.ravel(np.asarray(v, np.float32)) for v in jax.tree_util.tree_leaves(g16)])
    nonzero = a != 0
    return {"zero_in_f16": float(np.mean(b[nonzero] == 0)),
            "below_f16_min": float(np.mean(np.abs(a[nonzero]) < F16_TINY)),
            "median_abs_grad_f32": float(np.median(np.abs(a[nonzero])))}


def train_case(name: str, x_train: np.ndarray, x_test: np.ndarray, steps: int, batch: int, probe_every: int,
               seed: int = 0) -> dict[str, Any]:
    """Trains one case; returns its loss curve, underflow fractions and test error."""
    policy, scale = CASES[name]
    model = precision.with_policy(Autoencoder(), policy)
    model32 = precision.with_policy(Autoencoder(), "fp32")
    model16 = precision.with_policy(Autoencoder(), "pure_f16")
    sample = jnp.asarray(x_train[:batch])
    params = model.init(jax.random.key(seed), sample)["params"]
    tx = precision.mixed_precision(optax.adamw(1e-3, weight_decay=1e-4), scale)
    opt_state = tx.init(params)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, x):
        s = precision.current_loss_scale(opt_state)
        loss, grads = jax.value_and_grad(lambda p: _loss(model, p, x, s))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, s.unscale(loss)

    test_error = jax.jit(lambda p, x: jnp.mean(jnp.square(model32.apply({"params": p}, x) - x)))
    rng = np.random.default_rng(seed)
    curve, probes, start = [], [], time.perf_counter()
    for i in range(steps + 1):
        if i % probe_every == 0:
            p32 = precision.full_precision_params(params, opt_state)
            probes.append({"step": i, "test_mse": float(test_error(p32, jnp.asarray(x_test[:2000]))),
                           **underflow_fraction(model32, model16, p32, jnp.asarray(x_train[:batch]))})
        if i == steps:
            break
        idx = rng.choice(len(x_train), batch, replace=False)
        params, opt_state, loss = step(params, opt_state, jnp.asarray(x_train[idx]))
        if i % 10 == 0:
            curve.append((i, float(loss), float(precision.current_loss_scale(opt_state).loss_scale)))
    mp = precision.find_mixed_precision_state(opt_state)
    final = precision.full_precision_params(params, opt_state)
    return {"case": name, "policy": policy, "loss_scale": type(scale).__name__, "curve": curve, "probes": probes,
            "final_test_mse": float(test_error(final, jnp.asarray(x_test))),
            "skipped_steps": int(mp.loss_scale.skipped_steps), "seconds": time.perf_counter() - start}


def plot(results: dict[str, Any], path: pathlib.Path) -> pathlib.Path | None:
    """Training loss and loss scale, test error and underflow fraction, per case
    (``None`` without matplotlib)."""
    plt = pyplot()
    if plt is None:
        return None

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    styles = {"fp32": dict(linestyle="--", linewidth=3, alpha=0.6)}
    for name, r in results.items():
        steps, losses, scales = zip(*r["curve"])
        axes[0].plot(steps, losses, label=name, **styles.get(name, {}))
        axes[1].plot([p["step"] for p in r["probes"]], [p["test_mse"] for p in r["probes"]], marker="o", label=name,
                     **styles.get(name, {}))
        if name == "fp32":
            probe_steps = [p["step"] for p in r["probes"]]
            axes[2].plot(probe_steps, [100 * p["zero_in_f16"] for p in r["probes"]], marker="o", color="C3",
                         label="zero when computed in float16")
            axes[2].plot(probe_steps, [100 * p["below_f16_min"] for p in r["probes"]], marker="s", color="C4",
                         label="float32 value below 2**-24")
    axes[0].set(title="train loss (MSE)", xlabel="step", yscale="log")
    axes[1].set(title="test reconstruction MSE", xlabel="step", yscale="log")
    axes[2].set(title="param gradient values lost in float16 (%),\nat the fp32 run's params",
                xlabel="step", ylim=(0, 105))
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Fashion-MNIST autoencoder at batch 16384: pure float16 with and without dynamic loss scaling")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def markdown(summary: dict[str, Any]) -> str:
    """The underflow table: final test error, scale, skipped steps, underflow fractions, budget."""
    env, cases = summary["environment"], summary["cases"]
    init = cases["fp32"]["probes"][0]
    out = [f"# Gradient underflow in float16 ({env['date']}, {env['device']}, jax {env['jax']})", "",
           f"Fashion-MNIST MLP autoencoder (784-256-32-256-784, sigmoid output, per-pixel MSE), batch "
           f"{summary['batch']}, {summary['steps']} AdamW steps (lr 1e-3), same init and data order; float32 "
           f"master weights in every case. Reproduce: `python -m benchmarks.underflow`.", "",
           f"At init, {100 * init['zero_in_f16']:.1f}% of the param gradient values that float32 computes as "
           f"nonzero come out exactly zero when the backward pass runs in float16, although only "
           f"{100 * init['below_f16_min']:.1f}% of them are themselves below float16's smallest subnormal "
           f"(2**-24): the per-pixel output gradients (median param gradient {init['median_abs_grad_f32']:.1e}) "
           "underflow first, and every gradient computed from them is zero.", "",
           "| case | policy | loss scale | final test MSE | vs fp32 | final scale | skipped steps | time |",
           "|---|---|---|---|---|---|---|---|"]
    base = cases["fp32"]["final_test_mse"]
    for name, r in cases.items():
        out.append(f"| {name} | {r['policy']} | {r['loss_scale']} | {r['final_test_mse']:.5f} "
                   f"| {100 * (r['final_test_mse'] / base - 1):+.1f}% | {r['curve'][-1][2]:g} | {r['skipped_steps']} "
                   f"| {r['seconds']:.0f} s |")
    out += ["", f"Test MSE at init: {init['test_mse']:.5f}. ![underflow](../../docs/underflow.png)"]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.underflow", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch", type=int, default=16384)
    p.add_argument("--probe-every", type=int, default=25)
    p.add_argument("--data", default=None, help="directory of the Fashion-MNIST IDX files")
    p.add_argument("--out", default=str(RESULTS), help="where the tables go")
    p.add_argument("--docs", default=str(DOCS), help="where the plot goes")
    args = p.parse_args(argv)
    x_train, x_test = _images(args.data)
    results = {}
    for name in CASES:
        results[name] = train_case(name, x_train, x_test, args.steps, args.batch, args.probe_every)
        r = results[name]
        print(f"{name:13s} test MSE {r['final_test_mse']:.5f}  skipped {r['skipped_steps']}  "
              f"loss scale {r['curve'][-1][2]:g}  underflow at init {100 * r['probes'][0]['zero_in_f16']:.1f}%  "
              f"({r['seconds']:.0f} s)", flush=True)
    out, docs = pathlib.Path(args.out), pathlib.Path(args.docs)
    out.mkdir(parents=True, exist_ok=True)
    docs.mkdir(parents=True, exist_ok=True)
    plot_path = plot(results, docs / "underflow.png")
    summary = {"environment": environment(), "steps": args.steps, "batch": args.batch, "cases": results,
               "plot": os.path.relpath(plot_path, ROOT) if plot_path else None}
    (out / "underflow.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "underflow.md").write_text(markdown(summary))
    final = {name: round(r["final_test_mse"], 5) for name, r in results.items()}
    print(json.dumps({"final_test_mse": final, "underflow_at_init": results["fp32"]["probes"][0]["zero_in_f16"]}))
    return summary


if __name__ == "__main__":
    main()

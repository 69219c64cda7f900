"""Int8 parity: ``mixed_int8`` trained beside ``mixed_bf16`` (and qwix's int8 quantized
training of the same GPT), 600 steps on CPU, and what each program multiplies in int8.

Each run goes through the CLI as a user's would, the shipped config with only the
policy (and the int8 options named) changed, same seed and data order:

- the Shakespeare GPT (``configs/shakespeare_gpt_mixed_bf16.yaml``): ``mixed_int8``
  at its defaults (``python -m train configs/shakespeare_gpt_mixed_bf16.yaml
  precision.policy=mixed_int8``: ``min_size`` 128 takes the projections and the MLP,
  not the 82-way head), and the same GPT under qwix's ``QtProvider`` (int8
  activations, weights and gradients: ``benchmarks/qwix_models.py``);
- the Fashion-MNIST ResNet at ``min_size=0`` (its convolutions have 16-64 channels), and at
  ``min_size=16`` (its first convolution, K = 9, and its 10-way head stay in bf16) with the
  gradient rounded to nearest and stochastically;
- the digits MLP of ``configs/default.yaml`` (its 1,500 steps), default and ``min_size=0``.

The goal (issue 69): final validation loss within 1.5% of ``mixed_bf16``'s, and the digits
accuracy within 0.5 pp. XLA's CPU backend multiplies int8 exactly (s8 x s8 -> s32), so the
numerics are those of a TPU or GPU; the speed is not (``--compile-for v5e`` / ``a100``).
The second table counts, per program, the matmul FLOPs with int8 operands (forward and
backward, from the traced step: :func:`precision.autocast.program.matmul_ops`).

    python -m benchmarks.int8_parity [--runs runs/int8_parity] [--out DIR]

Writes ``benchmarks/results/int8_parity.{json,md}``. A run whose ``summary.json`` already
shows its budget is not repeated.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
from typing import Any

from benchmarks.report import RESULTS, environment, write_tables

ROOT = pathlib.Path(__file__).resolve().parent.parent
RUN = ["steps=600", "log_every=50", "eval_every=300", "checkpoint_every=0"]
QWIX = ["model.name=benchmarks.qwix_models:QwixInt8GPT", "model.vocab_size=82", "model.block_size=128",
        "precision.policy=mixed_bf16"]
EXPERIMENTS = {
    "shakespeare_gpt": ("configs/shakespeare_gpt_mixed_bf16.yaml", RUN, {
        "mixed_bf16": ["precision.policy=mixed_bf16"],
        "mixed_int8": ["precision.policy=mixed_int8"],
        "qwix int8 (QtProvider)": QWIX}),
    "fmnist_resnet": ("configs/fmnist_resnet_mixed_bf16.yaml", RUN, {
        "mixed_bf16": ["precision.policy=mixed_bf16"],
        "mixed_int8 (min_size 0)": ["precision.policy=mixed_int8", "precision.int8.min_size=0"],
        "mixed_int8 (min_size 16)": ["precision.policy=mixed_int8", "precision.int8.min_size=16"],
        "mixed_int8 (min_size 16, stochastic rounding)": ["precision.policy=mixed_int8", "precision.int8.min_size=16",
                                                          "precision.int8.stochastic_rounding=true"]}),
    "digits_mlp": ("configs/default.yaml", [], {
        "mixed_bf16": ["precision.policy=mixed_bf16"],
        "mixed_int8": ["precision.policy=mixed_int8"],
        "mixed_int8 (min_size 0)": ["precision.policy=mixed_int8", "precision.int8.min_size=0"]}),
}
GOAL_LOSS, GOAL_ACCURACY = 0.015, 0.005


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in text).strip("_")


def command(experiment: str, variant: str, workdir: pathlib.Path) -> list[str]:
    """The ``python -m train`` arguments of one run."""
    config, run, variants = EXPERIMENTS[experiment]
    return ["-m", "train", config, *variants[variant], *run, f"workdir={workdir}"]


def train(runs: pathlib.Path) -> None:
    """Every (experiment, variant) run, skipping finished ones."""
    for experiment, (_, _, variants) in EXPERIMENTS.items():
        for variant in variants:
            workdir = runs / experiment / _slug(variant)
            if (workdir / "summary.json").exists():
                continue
            cmd = [sys.executable, *command(experiment, variant, workdir)]
            print(" ".join(cmd[1:]), flush=True)
            subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)


def _shown(path: pathlib.Path) -> pathlib.Path:
    """``path`` relative to the repository where it lies inside it (as a command is typed there)."""
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def collect(runs: pathlib.Path, measure: bool = True) -> dict[str, Any]:
    """Final eval loss and accuracy of every run, and each variant's gap to mixed_bf16; with
    ``measure``, the programs' int8 shares and the recipe's gradient errors too."""
    rows = []
    for experiment, (_, _, variants) in EXPERIMENTS.items():
        found = {v: runs / experiment / _slug(v) / "summary.json" for v in variants}
        summaries = {v: json.loads(p.read_text()) for v, p in found.items() if p.exists()}
        if "mixed_bf16" not in summaries:
            continue
        bf16 = summaries["mixed_bf16"]["eval"]
        for variant, s in summaries.items():
            rows.append({"experiment": experiment, "variant": variant, "steps": s["steps"],
                         "eval_loss": s["eval"]["loss"], "accuracy": s["eval"].get("accuracy"),
                         "vs_bf16": s["eval"]["loss"] / bf16["loss"] - 1,
                         "accuracy_vs_bf16": (s["eval"].get("accuracy") or 0) - (bf16.get("accuracy") or 0),
                         "skipped_steps": s["loss_scale"]["skipped_steps"],
                         "command": "python " + " ".join(command(experiment, variant, _shown(runs / experiment / _slug(variant))))})
    return {"goal_loss_vs_bf16": GOAL_LOSS, "goal_accuracy_pp": GOAL_ACCURACY, "rows": rows,
            "programs": programs() if measure else [], "gradients": gradient_errors() if measure else [],
            "environment": environment()}


#: The recipe's choices whose gradients are compared (int8 options at min_size 0: every matmul but attention's).
CHOICES = {"mixed_bf16": ("mixed_bf16", None),
           "int8, backward int8 (default)": ("mixed_int8", {"min_size": 0}),
           "int8, backward int8, stochastic rounding": ("mixed_int8", {"min_size": 0, "stochastic_rounding": True}),
           "int8, backward bf16": ("mixed_int8", {"min_size": 0, "backward": "bf16"})}


def gradient_errors(batches: int = 4) -> list[dict[str, Any]]:
    """The Shakespeare GPT's gradient under each choice of the recipe against float32's, at its
    initial params on ``batches`` training batches: relative L2 error of the weight gradients
    (all, and the head's) and the cosine of the whole gradient."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import precision
    from train.config import load_config
    from train.experiment.loop import build_experiment

    config = load_config(ROOT / "configs/shakespeare_gpt_mixed_bf16.yaml", ["workdir=/tmp/unused"])
    data, _, model = build_experiment(config)
    batch_list = [data.train_batch(i, config.data.batch_size, config.seed) for i in range(batches)]

    def grads(policy, int8):
        wrapped = precision.with_policy(model, policy, int8=int8)
        params = wrapped.init(jax.random.key(0), batch_list[0]["inputs"][:1])["params"]
        loss = lambda p, b: optax.softmax_cross_entropy_with_integer_labels(  # noqa: E731
            wrapped.apply({"params": p}, b["inputs"]).astype(jnp.float32), b["labels"]).mean()
        step = jax.jit(jax.grad(loss))
        return [jax.tree_util.tree_map(np.asarray, step(params, b)) for b in batch_list]

    def flat(tree, head=False):
        leaves = jax.tree_util.tree_leaves_with_path(tree)
        return np.concatenate([np.ravel(x) for path, x in leaves
                               if ("head" in jax.tree_util.keystr(path)) or not head])

    reference = grads("fp32", None)
    out = []
    for name, (policy, int8) in CHOICES.items():
        got = grads(policy, int8)
        errors = [[np.linalg.norm(flat(g, h) - flat(r, h)) / np.linalg.norm(flat(r, h)) for g, r in zip(got, reference)]
                  for h in (False, True)]
        cosines = [float(flat(g) @ flat(r) / np.linalg.norm(flat(g)) / np.linalg.norm(flat(r)))
                   for g, r in zip(got, reference)]
        out.append({"choice": name, "relative_error": float(np.mean(errors[0])),
                    "head_relative_error": float(np.mean(errors[1])), "cosine": float(np.mean(cosines))})
    return out


def programs() -> list[dict[str, Any]]:
    """The Shakespeare GPT's train step (forward and backward) under each int8 variant: the share of
    its matmul FLOPs with int8 operands, and the int8 products, counted in the traced program."""
    import jax
    import jax.numpy as jnp
    import optax

    import precision
    from benchmarks.qwix_models import QwixInt8GPT
    from precision.autocast.program import matmul_ops
    from train.models import GPT

    tokens = jnp.zeros((32, 128), jnp.int32)
    shape = dict(vocab_size=82, block_size=128, num_layers=4, num_heads=4, d_model=128)
    out = []
    for name, model, policy in (("mixed_int8", GPT(**shape), "mixed_int8"),
                                ("qwix int8 (QtProvider)", QwixInt8GPT(**shape), "mixed_bf16")):
        wrapped = precision.with_policy(model, policy)
        params = jax.eval_shape(lambda: wrapped.init(jax.random.key(0), tokens))["params"]
        step = jax.grad(lambda p: optax.softmax_cross_entropy_with_integer_labels(
            wrapped.apply({"params": p}, tokens).astype(jnp.float32), tokens).mean())
        ops = matmul_ops(jax.make_jaxpr(step)(params))
        total = sum(m.flops for m in ops)
        int8 = [m for m in ops if m.int8]
        out.append({"variant": name, "int8_share": sum(m.flops for m in int8) / total,
                    "int8_products": len(int8), "products": len(ops),
                    "int8_backward": sum(m.backward for m in int8)})
    return out


def markdown(result: dict[str, Any]) -> str:
    lines = ["# Int8 parity (CPU numerics) beside qwix's int8 training", "",
             f"Final validation loss and accuracy after the same steps; the goal: loss within "
             f"{100 * result['goal_loss_vs_bf16']:.1f}% of `mixed_bf16`'s, accuracy within "
             f"{100 * result['goal_accuracy_pp']:.1f} pp.", "",
             "| experiment | policy | steps | eval loss | vs bf16 | accuracy | vs bf16 (pp) | skipped |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["rows"]:
        accuracy = "" if r["accuracy"] is None else f"{100 * r['accuracy']:.2f}%"
        lines.append(f"| {r['experiment']} | {r['variant']} | {r['steps']} | {r['eval_loss']:.4f} | "
                     f"{100 * r['vs_bf16']:+.2f}% | {accuracy} | {100 * r['accuracy_vs_bf16']:+.2f} | "
                     f"{r['skipped_steps']} |")
    lines += ["", "The Shakespeare GPT's train step (batch 32 x 128), matmul FLOPs with int8 operands:", "",
              "| program | int8 share of matmul FLOPs | int8 products (of all) | of them backward |",
              "| --- | ---: | ---: | ---: |"]
    for p in result["programs"]:
        lines.append(f"| {p['variant']} | {100 * p['int8_share']:.1f}% | {p['int8_products']} of {p['products']} | "
                     f"{p['int8_backward']} |")
    lines += ["", "The recipe's choices: the Shakespeare GPT's gradient at its initial params (4 training batches) "
              "against float32's:", "", "| choice | relative L2 error | the head's | cosine |", "| --- | ---: | ---: | ---: |"]
    for g in result["gradients"]:
        lines.append(f"| {g['choice']} | {100 * g['relative_error']:.2f}% | {100 * g['head_relative_error']:.2f}% | "
                     f"{g['cosine']:.5f} |")
    env = result["environment"]
    lines += ["", "Commands: " + "; ".join(f"`{r['command']}`" for r in result["rows"]), "",
              f"jax {env.get('jax')}, {env.get('device')}, {env.get('date')}; reproduce: "
              "`python -m benchmarks.int8_parity`"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.int8_parity", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default="runs/int8_parity")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--collect-only", action="store_true", help="tabulate the runs already made")
    args = p.parse_args(argv)
    runs = pathlib.Path(args.runs).resolve()
    if not args.collect_only:
        train(runs)
    result = collect(runs)
    write_tables(args.out, "int8_parity", result, markdown(result))
    return result


if __name__ == "__main__":
    main()

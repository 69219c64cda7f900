"""Our train step against a hand-written one, compiled for a GPU without one: kernels, bytes, modeled time.

For each model and policy, two programs for the same GPU (JAX's compile-only
CUDA client, as ``--compile-for`` does):

- **ours**: the model as a user gives it (float32 layers, attention written out)
  through ``train.create_train_state`` + ``train.make_train_step`` (AdamW);
- **hand-written**: the step a careful user writes without this library: the
  same model with its layers in the half dtype (``dtype=jnp.bfloat16``), cuDNN
  attention (``jax.nn.dot_product_attention``), the loss in float32, ``jax.grad``
  and optax's AdamW; under float16, jmp's dynamic loss scale (scale, unscale,
  ``all_finite``, ``select_tree``); under O2, float16 params with float32
  masters the update writes back.

Counted from each optimized program (:mod:`train.inspections.hlo_kernels`): kernel launches
per step, bytes read and written, and the modeled step time (:mod:`train.inspections.gpu_time`:
a model calibrated on a profile, **not a measurement**).

    python -m benchmarks.step_cost [--target h100] [--models gpt,gpt_pinned,llama,resnet]
                                   [--policies mixed_bf16,mixed_f16,O2] [--out DIR]

Needs JAX's CUDA plugin (``pip install '.[gpu-compile]'``; run with ``JAX_PLATFORMS=cpu``).
Writes ``step-cost-<target>.{json,md}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any, Callable

import jax
import jax.numpy as jnp
import jmp
import optax

from benchmarks.compile_only import chosen, target_device, target_slug
from benchmarks.report import RESULTS, command, environment, write_tables
from benchmarks.step_models import Llama, PinnedGPT, cudnn_attention
from benchmarks.workloads import workload
from train import create_train_state
from train.training.binding import mode_kwargs
from train.inspections.compile_for import compile_train_step
from train.parallel.distributed import Layout, make_mesh
from train.inspections.gpu_time import model_step
from train.models import GPT

#: policy -> (preset, loss scale, half dtype, O2: half params with float32 masters)
POLICIES = {"mixed_bf16": ("mixed_bf16", "none", jnp.bfloat16, False),
            "mixed_f16": ("mixed_f16", "dynamic", jnp.float16, False),
            "O2": ("O2", "dynamic", jnp.float16, True)}
VOCAB, SEQ, BATCH = 50304, 1024, 16  # GPT-2-small's padded vocabulary, 16 x 1024 tokens


@dataclasses.dataclass(frozen=True)
class Model:
    """A model as a user gives it, its hand-written half twin, and its batch."""

    name: str
    ours: Any
    half: Callable[[Any], Any]  # dtype -> the model written in that dtype with cuDNN attention
    inputs: jax.ShapeDtypeStruct
    labels: jax.ShapeDtypeStruct
    task: str


def models(layers: int = 12) -> dict[str, Model]:
    """The compared models at the GPT-2-small shape (``layers`` deep) and the ResNet's GPU size."""
    tokens = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32)
    gpt = GPT(vocab_size=VOCAB, block_size=SEQ, num_layers=layers, num_heads=12, d_model=768)
    pinned = PinnedGPT(VOCAB, SEQ, 768, 12, layers)
    llama = Llama(VOCAB, 768, 12, layers)
    resnet = workload("resnet", "gpu")
    return {
        "gpt": Model("gpt", gpt, lambda d: gpt.clone(dtype=d, attention_impl="cudnn"), tokens, tokens,
                     "language_model"),
        "gpt_pinned": Model("gpt_pinned", pinned, lambda d: pinned.clone(dtype=d, attention_fn=cudnn_attention),
                            tokens, tokens, "language_model"),
        "llama": Model("llama", llama, lambda d: llama.clone(dtype=d, attention_fn=cudnn_attention), tokens, tokens,
                       "language_model"),
        "resnet": Model("resnet", resnet.model, lambda d: resnet.model.clone(dtype=d), resnet.inputs,
                        jax.ShapeDtypeStruct(resnet.inputs.shape[:1], jnp.int32), "classification"),
    }


def _optimizer() -> optax.GradientTransformation:
    return optax.adamw(1e-3, weight_decay=1e-4)


def hand_written_step(model: Any, half: Any, loss_scaled: bool, o2: bool) -> Callable:
    """The hand-written train step of ``model`` (already written in ``half``):
    ``step((params, opt_state, model_state, (scale, counter)[, half_params]), batch) -> (carry, loss)``,
    the loss scale jmp's dynamic one (its two numbers carried as arrays)."""
    tx = _optimizer()

    def loss_fn(params, model_state, batch, scale):
        out, new_state = model.apply({"params": params, **model_state}, batch["inputs"], mutable=list(model_state),
                                     **mode_kwargs(model, True))
        loss = optax.softmax_cross_entropy_with_integer_labels(out.astype(jnp.float32), batch["labels"]).mean()
        return scale.scale(loss), (loss, new_state)

    def step(carry, batch):
        params, opt_state, model_state, scale_state, *stored = carry
        scale = jmp.DynamicLossScale(*scale_state) if loss_scaled else jmp.NoOpLossScale()
        (_, (loss, new_state)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            stored[0] if o2 else params, model_state, batch, scale)
        grads = scale.unscale(jax.tree_util.tree_map(lambda g: g.astype(jnp.float32), grads))
        updates, new_opt = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        new = (new_params, new_opt, new_state)
        if loss_scaled:
            finite = jmp.all_finite(grads)
            scale = scale.adjust(finite)
            new = jmp.select_tree(finite, new, (params, opt_state, model_state))
        out = (*new, (scale.loss_scale, scale.counter) if loss_scaled else scale_state)
        if o2:
            out += (jax.tree_util.tree_map(lambda p: p.astype(half), new[0]),)
        return out, loss

    return jax.jit(step, donate_argnums=(0,))


def _hand_written_state(model: Any, m: Model, half: Any, loss_scaled: bool, o2: bool) -> Any:
    def init():
        variables = model.init(jax.random.key(0), jnp.zeros((1, *m.inputs.shape[1:]), m.inputs.dtype))
        params = variables.pop("params")
        scale = (jnp.float32(2 ** 15), jnp.int32(0)) if loss_scaled else ()
        carry = (params, _optimizer().init(params), dict(variables), scale)
        return carry + ((jax.tree_util.tree_map(lambda p: p.astype(half), params),) if o2 else ())
    return jax.eval_shape(init)


def hand_written_compiled(model: Any, m: Model, half: Any, loss_scaled: bool, o2: bool, layout: Layout) -> Any:
    """The hand-written step of ``model`` (written in ``half``) on ``m``'s batch, compiled on ``layout``'s device."""
    carry = _hand_written_state(model, m, half, loss_scaled, o2)
    batch = {"inputs": m.inputs, "labels": m.labels}
    placed = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=layout.replicated()),
                                    (carry, batch))
    return hand_written_step(model, half, loss_scaled, o2).lower(*placed).compile()


def compare(m: Model, policy: str, target: Any, device: Any) -> dict[str, Any]:
    """One model under one policy: ours and the hand-written step, compiled for ``target``."""
    preset, loss_scale, half, o2 = POLICIES[policy]
    layout = Layout(make_mesh(1, 1, [device]))
    batch = {"inputs": m.inputs, "labels": m.labels}
    sample = jnp.zeros((1, *m.inputs.shape[1:]), m.inputs.dtype)
    state = jax.eval_shape(lambda: create_train_state(m.ours, preset, _optimizer(), jax.random.key(0), sample,
                                                      loss_scale=loss_scale))
    ours = compile_train_step(state, batch, layout, target, task=m.task, experiment=f"{m.name} {policy}")
    hand_text = hand_written_compiled(m.half(half), m, half, loss_scale != "none", o2, layout).as_text()
    row = {"model": m.name, "policy": policy}
    for who, text in (("ours", ours.hlo_text), ("hand_written", hand_text)):
        modeled = model_step(text, target)
        row[who] = {"kernels": modeled.launches, "bytes": modeled.bytes, "flops": modeled.flops,
                    "modeled_seconds": modeled.seconds, "by_kind": modeled.by_kind(),
                    "top": modeled.to_json(8)["top"]}
    for key in ("kernels", "bytes", "modeled_seconds"):
        row[f"{key}_ratio"] = row["ours"][key] / row["hand_written"][key]
    return row


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as markdown: ours / hand-written per model and policy."""
    lines = ["| model | policy | kernels ours / hand | ratio | GB moved ours / hand | ratio | modeled ms ours / hand "
             "| ratio |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        o, h = r["ours"], r["hand_written"]
        lines.append(f"| {r['model']} | {r['policy']} | {o['kernels']} / {h['kernels']} | {r['kernels_ratio']:.3f} | "
                     f"{o['bytes'] / 1e9:.2f} / {h['bytes'] / 1e9:.2f} | {r['bytes_ratio']:.3f} | "
                     f"{o['modeled_seconds'] * 1e3:.2f} / {h['modeled_seconds'] * 1e3:.2f} | "
                     f"{r['modeled_seconds_ratio']:.3f} |")
    return "\n".join(lines)


def markdown(result: dict[str, Any]) -> str:
    env = result["environment"]
    return (f"# Our train step against a hand-written one, compiled for {result['device_kind']} without one\n\n"
            f"`{result['command']}` (jax {env['jax']}, JAX's compile-only CUDA client, {env['date']}). GPT, "
            f"pinned-dtype GPT on `nn.SelfAttention` and Llama-style decoder at the GPT-2-small shape "
            f"({result['layers']} layers, 768 wide, 12 heads, vocabulary {VOCAB:,}, {BATCH} x {SEQ} tokens); the "
            f"suite's ResNet at its GPU size. AdamW in both steps. *Kernels*: launches per step in the optimized "
            f"program; *GB moved*: their operands and results; *modeled ms*: `train.inspections.gpu_time`'s model of the "
            f"step on the target (a datasheet roofline per kernel calibrated on the H200 profile of 2026-11-25), "
            f"**not a measurement**.\n\n{table(result['rows'])}\n\nWhere the time goes, what was removed and what "
            f"remains: [docs/results.md](../../docs/results.md#our-step-against-a-hand-written-one-compiled-for-an-h100)."
            f"\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.step_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="h100")
    p.add_argument("--models", default="gpt,gpt_pinned,llama,resnet")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    known = models(args.layers)
    names, policies = chosen(p, models=(args.models, known), policies=(args.policies, POLICIES))
    found = target_device(args.target)
    if found is None:
        return 2
    target, device = found
    rows = []
    for name in names:
        for policy in policies:
            rows.append(compare(known[name], policy, target, device))
            r = rows[-1]
            print(f"{name:<12}{policy:<12}kernels {r['ours']['kernels']} / {r['hand_written']['kernels']} "
                  f"({r['kernels_ratio']:.3f}), bytes {r['bytes_ratio']:.3f}, modeled "
                  f"{r['ours']['modeled_seconds'] * 1e3:.2f} / {r['hand_written']['modeled_seconds'] * 1e3:.2f} ms",
                  flush=True)
    result = {"target": target.name, "device_kind": target.device_kind, "layers": args.layers,
              "environment": environment(), "rows": rows,
              "command": command("benchmarks.step_cost", argv)}
    write_tables(args.out, f"step-cost-{target_slug(target)}", result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Run by tests/test_blockwise_loss.py in a process of 2 CPU devices: a language model's
train step with its loss in blocks, the batch split over the devices (data) and the params
too (FSDP, the head's vocabulary dimension split), against the same step on one device.
Prints one JSON line."""

import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import precision
import train
from precision.blockwise import transform
from train.parallel.communication import compile_partitioned

VOCAB, SEQ, ROWS = 512, 8, 8
transform.MIN_LOGITS_BYTES, transform.BLOCK_BYTES = 1, 2 * SEQ * VOCAB * 4  # blocks of 2 rows


def state_and_batch():
    model = train.models.GPT(vocab_size=VOCAB, block_size=SEQ, num_layers=1, num_heads=2, d_model=16)
    tokens = jax.random.randint(jax.random.key(1), (ROWS, SEQ), 0, VOCAB)
    batch = {"inputs": tokens, "labels": jnp.roll(tokens, -1, axis=1)}
    return model, batch


def run(layout, blockwise=True):
    model, batch = state_and_batch()
    state = train.create_train_state(model, "mixed_bf16", optax.sgd(0.1), jax.random.key(0), batch["inputs"][:1],
                                     layout=layout, ops=precision.op_lists(blockwise_loss=blockwise))
    step = train.make_train_step(task="lm", layout=layout, donate=False)
    if layout is not None:
        batch = layout.global_batch(jax.tree_util.tree_map(np.asarray, batch), ROWS)
    plan = train.blockwise_plan(state, batch, task="lm", layout=layout)
    _, text = compile_partitioned(step.lower(state, batch))
    new, metrics = step(state, batch)
    return float(metrics["loss"]), plan, text, new


def largest_gather(text):
    """Elements of the largest all-gather result after SPMD partitioning."""
    sizes = [int(np.prod([int(d) for d in dims.split(",") if d]))
             for dims in re.findall(r"= \w+\[([\d,]*)\][^=]*? all-gather(?:-start)?\(", text or "")]
    return max(sizes, default=0)


one, _, _, one_state = run(None, blockwise=False)  # the whole logits, on one device
out = {"one_device": one}
for data, fsdp in ((2, 1), (1, 2)):
    layout = train.Layout(train.make_mesh(data, fsdp), fsdp_min_size=0)
    loss, plan, text, state = run(layout)
    diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in
               zip(jax.tree_util.tree_leaves(state.params), jax.tree_util.tree_leaves(one_state.params)))
    out[f"data{data}_fsdp{fsdp}"] = {"loss": loss, "found": plan.found, "reason": plan.reason, "block_rows": plan.block_rows,
                                     "largest_gather": largest_gather(text), "params_diff": diff,
                                     "partitioned": text is not None}
out["logits"] = ROWS * SEQ * VOCAB
print(json.dumps(out))
sys.stdout.flush()

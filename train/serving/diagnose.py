"""The doctor on decoding: ``sample --diagnose``.

A model that trained cleanly can still fail where it is served: in float16 a key or value
written to the cache, or an attention logit over a long context, may pass 65504 where the
training's bfloat16 never overflowed. :func:`diagnose_decoding` runs
:func:`precision.diagnose` on the two programs serving runs, in the serving dtypes and with
the cache in its own: the **prefill** (the prompt into an empty cache) and a **decode step**
(the next token against the cache the prompt filled, as the served model filled it). It
names the op and module that overflow there and the rule it verified to fix them, which
``export`` and a run take as ``precision.rules=[...]``.

The params the doctor starts from are the served ones read back in float32 (an int8
weight's dequantized values), cast by the serving policy as serving casts them.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

import precision
from precision.channel_weights import dequantize_channels, is_channel_int8
from train.training.diagnose import summary_line

__all__ = ["diagnose_decoding", "format_diagnosis"]


def diagnose_decoding(generator: Any, prompt: str) -> dict[str, precision.Diagnosis]:
    """``{"prefill": ..., "decode step": ...}``: the doctor's diagnosis of each program
    ``generator`` (a :class:`train.serving.Generator`) serves ``prompt`` with, one row."""
    ids = generator.source.tokenizer.encode(prompt)
    length = generator._length(len(ids), 1, True)
    decoder = generator.decoder
    params = jax.tree_util.tree_map(lambda x: dequantize_channels(x, jnp.float32) if is_channel_int8(x)
                                    else jnp.asarray(x, jnp.float32), generator.params, is_leaf=is_channel_int8)
    tokens = jnp.asarray(ids[None], jnp.int32)
    empty = decoder.init(1, length)
    found = {"prefill": _diagnose(decoder.call(params, empty, tokens, jnp.int32(0)))}
    logits, filled = jax.jit(decoder.forward)(generator.params, decoder.init(1, length), tokens, jnp.int32(0))
    if len(ids) < length:
        after = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None]
        found["decode step"] = _diagnose(decoder.call(params, filled, after, jnp.int32(len(ids))))
    return found


def _diagnose(call: tuple[Any, tuple, dict, dict]) -> precision.Diagnosis:
    model, args, variables, kwargs = call
    return precision.diagnose(model, *args, variables=variables, **kwargs)


def format_diagnosis(found: dict[str, precision.Diagnosis]) -> str:
    """One line per program: what the doctor found, and the rule that fixes it."""
    lines = []
    for program, diagnosis in found.items():
        lines.append(f"doctor, {program}: {summary_line(diagnosis)}")
        fix = next((r for r in diagnosis.recommendations if r.overrides), None)
        if fix is not None:
            lines.append(f"  the rule, for export and training: {fix.command_line}")
    return "\n".join(lines)

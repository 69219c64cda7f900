"""The doctor on decoding: ``sample --diagnose``.

A model that trained cleanly can still fail where it is served: in float16 a key or value
written to the cache, or an attention logit over a long context, may pass 65504 where the
training's bfloat16 never overflowed. :func:`diagnose_decoding` runs
:func:`precision.diagnose` on the two programs serving runs, in the serving dtypes and with
the cache in its own: the **prefill** (the prompt into an empty cache) and a **decode step**
(the next token against the cache the prompt filled, as the served model filled it). It
names the op and module that overflow there and the rule it verified to fix them, which
``export`` and a run take as ``precision.rules=[...]``.

The params the doctor starts from are the float32 ones (an int8 weight's dequantized values),
cast by the serving policy as serving casts them.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

import precision
from train.serving.weights import float32_weights
from train.training.binding import doctor_subject
from train.training.diagnose import summary_line

__all__ = ["diagnose_decoding", "format_diagnosis"]


def diagnose_decoding(generator: Any, prompt: str) -> dict[str, precision.Diagnosis | None]:
    """``{"prefill": ..., "decode step": ...}``: the doctor's diagnosis of each program
    ``generator`` (a :class:`train.serving.Generator`) serves ``prompt`` with, one row; the
    decode step's is None where the served prefill already left non-finite values in the cache."""
    ids = generator.source.tokenizer.encode(prompt)
    length = generator.cache_length(len(ids), 1, True)
    decoder = generator.decoder
    params = float32_weights(generator.params, generator.float_params)
    tokens = jnp.asarray(ids[None], jnp.int32)
    empty = _float32(decoder.init(1, length))
    found = {"prefill": _diagnose(decoder.call(params, empty, tokens, jnp.int32(0)))}
    logits, filled = jax.jit(decoder.forward)(generator.params, decoder.init(1, length), tokens, jnp.int32(0))
    finite = all(bool(jnp.isfinite(x).all()) for x in jax.tree_util.tree_leaves((logits, filled))
                 if jnp.issubdtype(x.dtype, jnp.floating))
    if len(ids) < length and finite:  # else the step would only read what the prefill broke
        after = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None]
        found["decode step"] = _diagnose(decoder.call(params, _float32(filled), after, jnp.int32(len(ids))))
    elif len(ids) < length:
        found["decode step"] = None
    return found


def _float32(cache: Any) -> Any:
    """A half cache's arrays in float32: the doctor computes in the serving dtypes and compares with
    float32, so what the cache holds must not be fixed in half (a key past 65504 overflows already in
    the half matmul that makes it, which the doctor names). Codes (int8, fp8) stay as they are."""
    half = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return jax.tree_util.tree_map(lambda x: x.astype(jnp.float32) if x.dtype in half else x, cache)


def _diagnose(call: tuple[Any, tuple, dict, dict]) -> precision.Diagnosis:
    model, args, variables, kwargs = call
    target, variables, mode = doctor_subject(model, variables, False)
    if target is not model:  # an NNX module merged with its variables: its own call's keywords, not apply's
        kwargs = mode
    return precision.diagnose(target, *args, variables=variables, **kwargs)


def format_diagnosis(found: dict[str, precision.Diagnosis | None]) -> str:
    """One line per program: what the doctor found, and the rule that fixes it."""
    lines = []
    for program, diagnosis in found.items():
        if diagnosis is None:
            lines.append(f"doctor, {program}: not diagnosed: the served prefill left non-finite values in the cache "
                         f"(fix the prefill first)")
            continue
        lines.append(f"doctor, {program}: {summary_line(diagnosis)}")
        fix = next((r for r in diagnosis.recommendations if r.overrides), None)
        if fix is not None:
            lines.append(f"  the rule, for export and training: {fix.command_line}")
    return "\n".join(lines)

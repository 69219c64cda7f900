"""Fused attention for a TPU: JAX's Pallas flash attention, where it is the same computation.

On a TPU, ``jax.nn.dot_product_attention`` has no fused kernel: it expands into
XLA's attention, which writes the ``(batch, heads, T, S)`` logits and
probabilities to HBM (on the GPT-2-small step compiled for a v5e, 12.2 GiB of
temporaries against 7.6 on an H100 with cuDNN's kernel). JAX ships a fused one
for TPUs as a Pallas kernel (``jax.experimental.pallas.ops.tpu.flash_attention``:
blocks of query and key in VMEM, softmax statistics in float32, never the
logits; its splash attention where no bias is added, :mod:`.tpu_splash`).
Autocast puts it in the TPU branch of the attention's
``jax.lax.platform_dependent`` (beside cuDNN's for CUDA), so a program lowered
for a TPU runs it and every other platform keeps what it had.

Only what the kernel computes exactly as ``jax.nn.dot_product_attention`` is
sent to it:

- query, key and value ``(batch, length, heads, head size)`` in one half dtype,
  grouped key/value heads repeated to the query's (as ``jax.nn`` computes them);
- causal masking (the kernel's own, aligned at the first query and key as
  ``is_causal``) or none; an additive bias, given to the kernel as
  ``bias / scale`` because it adds the bias *before* scaling (float32, broadcast
  to every batch and head: the kernel takes it whole);
- no other mask, no sequence lengths, no local window: the kernel's masking is by
  causality or segment ids, and a general mask is neither;
- shapes its blocks divide (lengths multiples of 128, head size up to 128 or a
  multiple of it), checked by building its forward and backward passes
  abstractly, as for cuDNN.

The kernel is described where libtpu is installed (a TPU install has it;
``pip install '.[tpu-compile]'`` compiles for a TPU from a CPU machine):
elsewhere no program is lowered for a TPU, and nothing of it is traced.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from precision.autocast import tpu_flash

__all__ = ["KERNEL", "available", "flash_function"]

#: How ``explain`` names the kernel.
KERNEL = "Pallas flash attention"
_HALF = (np.dtype(np.float16), np.dtype(jnp.bfloat16))
_TAKEN = ("query", "key", "value", "bias")  # the call's arrays the kernel takes


def available() -> bool:
    """Whether the TPU kernel is described here: libtpu is installed (no TPU needed)."""
    return importlib.util.find_spec("libtpu") is not None


def flash_function(names: tuple[str, ...], static: dict, arrays: list,
                   module: tuple[str, ...] = ()) -> tuple[Callable[..., list] | None, str]:
    """``jax.nn.dot_product_attention(**dict(zip(names, arrays)), **static)`` as the TPU's
    Pallas flash attention: ``(function of the arrays returning its outputs as a list, "")``,
    or ``(None, why not)`` where the kernel would not compute the same thing or cannot take it.
    ``module``: the path of the module it is in, which its passes are named in."""
    why = _why_not(names, static, arrays)
    if why:
        return None, why

    def attend(*values):
        given = dict(zip(names, values, strict=True))
        return [_flash(given, static, module=module)]

    try:
        specs = [jax.ShapeDtypeStruct(np.shape(v), v.dtype) for v in arrays]
        jax.eval_shape(lambda *xs: _pull_back(attend, xs), *specs)
        jax.eval_shape(lambda *xs: _flash(dict(zip(names, xs, strict=True)), static, check=True), *specs)
    except (AttributeError, ImportError) as e:  # the kernel's passes are JAX's own functions, private
        return None, f"this JAX's Pallas flash attention is not the one known here ({_first_line(e)})"
    except (NotImplementedError, ValueError, TypeError) as e:
        return None, f"the TPU kernel cannot take its shapes ({_first_line(e)})"
    return attend, ""


def _why_not(names: tuple[str, ...], static: dict, arrays: list) -> str:
    extra = [n for n in names if n not in _TAKEN]
    if "mask" in extra:
        return "its mask is not causal (the TPU kernel masks causally, or takes a bias)"
    if extra:
        return f"{' and '.join(extra)} given (the TPU kernel takes query, key, value and a bias)"
    if static.get("implementation") is not None:
        return f"the model asked for implementation={static['implementation']!r}"
    if static.get("local_window_size") is not None:
        return "a local window (the TPU kernel attends to every earlier key or to all)"
    given = dict(zip(names, arrays, strict=True))
    query, key, value = (given[n] for n in ("query", "key", "value"))
    if any(np.ndim(x) != 4 for x in (query, key, value)):
        return "query, key and value without a batch dimension"
    if len({np.dtype(x.dtype) for x in (query, key, value)}) != 1 or np.dtype(query.dtype) not in _HALF:
        return "query, key and value not in one half dtype"
    if query.shape[2] % key.shape[2] or key.shape[2] != value.shape[2]:
        return "key and value heads that do not divide the query's"
    return ""


def _flash(given: dict, static: dict, check: bool = False, module: tuple[str, ...] = ()) -> jax.Array:
    """The call computed by the Pallas kernel, in ``jax.nn``'s layout and dtype; ``check``:
    builds the kernel's passes for these shapes instead (:func:`tpu_flash.check`)."""
    query, key, value = given["query"], given["key"], given["value"]
    groups = query.shape[2] // key.shape[2]
    if groups > 1:  # grouped heads: each key/value head serves `groups` query heads, as jax.nn computes it
        key, value = jnp.repeat(key, groups, axis=2), jnp.repeat(value, groups, axis=2)
    scale = static.get("scale")
    scale = float(query.shape[-1] ** -0.5 if scale is None else scale)
    bias = given.get("bias")
    if bias is not None:  # the kernel computes (q.k + bias) * scale; jax.nn q.k * scale + bias
        batch, length, heads, _ = query.shape
        big = float(jnp.finfo(jnp.float32).max)  # a saturated mask bias (finfo.min) / scale stays finite
        bias = jnp.clip(bias.astype(jnp.float32) / scale, -big, big)
        bias = jnp.broadcast_to(bias, (batch, heads, length, key.shape[1]))
    causal = bool(static.get("is_causal", False))
    if check:
        heads_first = lambda x: jnp.transpose(x, (0, 2, 1, 3))  # noqa: E731 - (B, T, N, H) -> (B, N, T, H)
        tpu_flash.check(heads_first(query), heads_first(key), heads_first(value), bias, causal=causal, scale=scale)
        return query
    # in jax.nn's layout, so its residuals are the arrays cuDNN's and XLA's attention keep too
    return tpu_flash.flash(query, key, value, bias, causal=causal, scale=scale, heads_second=True,
                           module=module).astype(query.dtype)


def _pull_back(fn: Any, args: tuple) -> Any:
    out, pull = jax.vjp(fn, *args)
    return pull(jax.tree_util.tree_map(jnp.ones_like, out))


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__

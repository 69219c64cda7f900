"""JAX's Pallas splash attention: the TPU kernel of an attention that adds no bias.

:mod:`.tpu_flash` runs JAX's flash attention kernel where a bias is added and this
one, ``jax.experimental.pallas.ops.tpu.splash_attention`` (the kernel MaxText runs
on TPUs), where none is. Both compute the same softmax attention with float32
statistics; they differ in what they write to HBM. The flash kernel keeps its
softmax statistics as ``(batch, heads, T, 128)`` float32 arrays, each value
repeated across 128 lanes, and its backward pass reads three of them (the sum,
the maximum, and ``sum(o * do)``). At GPT-2 small's shape, 16 x 1024 tokens,
that is 100 MB each, in every layer. The splash kernel keeps one logsumexp per
query and reads it 8 rows deep. On the GPT-2-small step compiled for a v5e, the
modeled step went from 254.2 to 215.6 ms (``benchmarks/results/int8-tpu-step.md``).

It takes the same inputs as the flash kernel: ``(batch, heads, length, head
size)`` in one half dtype, causal (aligned at the first query and key) or
unmasked, lengths that its blocks divide (multiples of 128). Its backward pass
is called directly (``_splash_attention_bwd``), so the forward's residuals can
be the other platforms' (:mod:`.tpu_flash` keeps ``l = 1`` and
``m = logsumexp``). That function is private to JAX: where it differs,
:func:`.tpu_flash.check` fails and the attention is left unfused, and
``explain`` says why.

The kernel does not scale the logits: the query is scaled before it, in its
own dtype, as MaxText does. That is exact for a power-of-two scale (``1/8`` for
64-wide heads). Otherwise it adds one rounding of the query.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["forward", "backward", "BLOCK"]

#: The largest block along queries and keys (MaxText's default); smaller where it does not divide a length.
BLOCK = 512


def _block(*lengths: int) -> int:
    block = BLOCK
    while block > 128 and any(n % block for n in lengths):
        block //= 2
    return block


@functools.lru_cache(maxsize=None)
def _kernel(causal: bool, heads: int, t: int, s: int) -> Any:
    """The splash kernel for one example's ``(heads, t, head size)`` queries against ``s`` keys."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    shape = (t, s)
    mask = masks.MultiHeadMask([masks.CausalMask(shape) if causal else masks.FullMask(shape)] * heads)
    b = _block(t, s)
    sizes = splash.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
                              block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)
    with jax.ensure_compile_time_eval():  # its mask's block tables as constants, not values of the trace calling it
        return splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, save_residuals=True)


def _scaled(q: jax.Array, scale: float) -> jax.Array:
    return (q.astype(jnp.float32) * scale).astype(q.dtype)


def forward(causal: bool, scale: float, q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, ...]:
    """The attention over ``(batch, heads, length, head size)`` operands and the residuals the
    backward pass reads, as :mod:`.tpu_flash` keeps them: ``(out, l, m)`` with ``l = 1``,
    ``m`` the logsumexp of each query's scaled logits (float32, ``(batch, heads, T)``)."""
    kernel = _kernel(causal, q.shape[1], q.shape[2], k.shape[2])
    out, (lse,) = jax.vmap(kernel)(_scaled(q, scale), k, v)
    return out, jnp.ones_like(lse), lse


def backward(causal: bool, scale: float, q: jax.Array, k: jax.Array, v: jax.Array, out: jax.Array,
             l: jax.Array, m: jax.Array, do: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(dq, dk, dv)`` of :func:`forward` for the output gradient ``do`` (``l`` and ``m``: softmax
    statistics such that a probability is ``exp(logit - m) / l``, the fallback's or :func:`forward`'s)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash

    kernel = _kernel(causal, q.shape[1], q.shape[2], k.shape[2])
    options = kernel.kwargs

    def one(q, k, v, out, lse, do):  # a static mask's block tables as the kernel holds them
        residuals = (q, k, v, None, None, out, lse, kernel.dq_mask_info, kernel.dkv_mask_info)
        grads = splash._splash_attention_bwd(False, options["mask_value"], options["is_mqa"], options["block_sizes"],
                                             None, options["mask_function"], options["attn_logits_soft_cap"],
                                             options["interpret"], residuals, do)
        return grads[3:6]

    lse = m + jnp.log(l)
    dq, dk, dv = jax.vmap(one)(_scaled(q, scale), k, v, out, lse, do)
    return (dq.astype(jnp.float32) * scale).astype(q.dtype), dk, dv


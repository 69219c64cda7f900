"""The GPT's decode cache, the Flax way: a ``cache`` collection of keys and values.

With ``decode=True`` each attention layer keeps the keys and values of every position it
has seen in the ``cache`` collection (``keys``, ``values``), as Flax's lm1b example does,
and the model one counter of positions (``position``, :func:`cache_position`) that it
hands to every layer (one counter, not one per layer: a decode step at batch 1 is
launch-bound, and each counter is a kernel of its own). ``model.init`` on a batch of the
cache's full length makes the cache (zeros) and runs attention as in training; each later
``apply(..., mutable=["cache"])`` on ``n`` new tokens writes their keys and values at
``position .. position + n`` and attends over the cache, so a prompt goes in one call and
each new token in a call of the same shape.

One new token (a decode step) over a cache of arrays attends by a call of
``jax.nn.dot_product_attention`` over the keys up to its position
(``key_value_seq_lengths``): under a half-precision policy's autocast, cuDNN's fused
attention where the program is lowered for a CUDA GPU (one kernel, where XLA's written-out
attention is six: its logits, their softmax, the product with the values), XLA's elsewhere.
A cache of codes (``train.serving``'s int8 and fp8 stores) is read written out, its codes
dequantized inside the products (a fused kernel would read a dequantized copy).

How keys and values are stored is a :class:`KVStore` the model is given, never a dtype
it picks: :class:`DenseKV` keeps them as computed (or in a dtype the caller names); a
caller may give a store that quantizes them (``train.serving``). The model calls
``init``, ``write`` and ``read`` and knows nothing of what they do.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import flax.linen as nn
import jax
import jax.numpy as jnp

__all__ = ["KVStore", "DenseKV", "cached_attention", "cache_position"]


class KVStore(Protocol):
    """How a decode cache holds keys (or values) of shape ``(batch, length, heads, head_dim)``."""

    def init(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """The empty store for a cache of ``shape`` (a pytree of arrays)."""

    def write(self, stored: Any, new: jax.Array, index: jax.Array) -> Any:
        """``stored`` with ``new`` (``(batch, n, heads, head_dim)``) at positions ``index .. index + n``."""

    def read(self, stored: Any, dtype: Any) -> jax.Array:
        """The whole cache as an array, in ``dtype`` where the store holds codes."""


@dataclasses.dataclass(frozen=True)
class DenseKV:
    """Keys and values stored as arrays: in ``dtype``, or (None) the dtype they are computed in."""

    dtype: Any = None

    def init(self, shape: tuple[int, ...], dtype: Any) -> jax.Array:
        return jnp.zeros(shape, self.dtype or dtype)

    def write(self, stored: jax.Array, new: jax.Array, index: jax.Array) -> jax.Array:
        return jax.lax.dynamic_update_slice_in_dim(stored, new.astype(stored.dtype), index, axis=1)

    def read(self, stored: jax.Array, dtype: Any) -> jax.Array:
        del dtype  # an array already: read as stored
        return stored


def cache_position(module: nn.Module, length: int) -> jax.Array:
    """The positions ``index .. index + length`` of the tokens a decoding model is given, and
    the position counter moved past them (``cache/position``; 0 .. length at init)."""
    initializing = not module.has_variable("cache", "position")
    position = module.variable("cache", "position", lambda: jnp.zeros((), jnp.int32))
    start = jnp.zeros((), jnp.int32) if initializing else position.value
    if not initializing:
        position.value = start + length
    return start + jnp.arange(length)


def cached_attention(module: nn.Module, q: jax.Array, k: jax.Array, v: jax.Array, store: KVStore | None,
                     attend: Any, start: jax.Array | None) -> jax.Array:
    """Causal attention of ``q`` (scaled) over the cache with ``k``, ``v`` written into it.

    At init (no cache yet) the cache is made from ``k`` and ``v``'s shapes (its length is
    theirs) and ``attend(q, k, v)`` runs as in training. Otherwise the new keys and values
    go to ``start ..`` (the model's position counter), and each query at position
    ``start + i`` attends to the cached positions up to its own: the logits and softmax in
    float32, the probabilities back in the values' dtype for the second product.
    """
    store = store or DenseKV()
    initializing = not module.has_variable("cache", "keys")
    keys = module.variable("cache", "keys", store.init, k.shape, k.dtype)
    values = module.variable("cache", "values", store.init, v.shape, v.dtype)
    if initializing:
        return attend(q, k, v)
    keys.value = store.write(keys.value, k, start)
    values.value = store.write(values.value, v, start)
    if q.shape[1] == 1 and isinstance(store, DenseKV):  # a decode step: one call a fused kernel can take
        seen = jnp.full((q.shape[0],), start + 1, jnp.int32)
        return jax.nn.dot_product_attention(q, keys.value.astype(q.dtype), values.value.astype(q.dtype), scale=1.0,
                                            key_value_seq_lengths=seen)
    return _attend_cache(q, store.read(keys.value, q.dtype), store.read(values.value, v.dtype), start)


def _attend_cache(q: jax.Array, keys: jax.Array, values: jax.Array, start: jax.Array) -> jax.Array:
    """Each query at ``start + i`` over the cached positions up to its own, written out (XLA)."""
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, keys, preferred_element_type=jnp.float32)
    seen = jnp.arange(keys.shape[1])[None, :] <= (start + jnp.arange(q.shape[1]))[:, None]
    probs = jax.nn.softmax(jnp.where(seen, logits, jnp.finfo(logits.dtype).min), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs.astype(values.dtype), values)

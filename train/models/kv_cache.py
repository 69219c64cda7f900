"""The GPT's decode cache, the Flax way: a ``cache`` collection of keys and values.

With ``decode=True`` each attention layer keeps the keys and values of every position it
has seen in the ``cache`` collection (``keys``, ``values``, ``index``), as Flax's lm1b
example does: ``model.init`` on a batch of the cache's full length makes the cache (zeros)
and runs attention as in training; each later ``apply(..., mutable=["cache"])`` on ``n``
new tokens writes their keys and values at ``index .. index + n`` and attends over the
cache, so a prompt goes in one call and each new token in a call of the same shape.

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
                     attend: Any) -> jax.Array:
    """Causal attention of ``q`` (scaled) over the cache with ``k``, ``v`` written into it.

    At init (no cache yet) the cache is made from ``k`` and ``v``'s shapes (its length is
    theirs) and ``attend(q, k, v)`` runs as in training. Otherwise the new keys and values
    go to ``index ..``, and each query at position ``index + i`` attends to the cached
    positions up to its own: the logits and softmax in float32, the probabilities back in
    the values' dtype for the second product.
    """
    store = store or DenseKV()
    initializing = not module.has_variable("cache", "keys")
    keys = module.variable("cache", "keys", store.init, k.shape, k.dtype)
    values = module.variable("cache", "values", store.init, v.shape, v.dtype)
    index = module.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
    if initializing:
        return attend(q, k, v)
    start, count = index.value, q.shape[1]
    keys.value = store.write(keys.value, k, start)
    values.value = store.write(values.value, v, start)
    index.value = start + count
    all_keys, all_values = store.read(keys.value, q.dtype), store.read(values.value, v.dtype)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, all_keys, preferred_element_type=jnp.float32)
    seen = jnp.arange(all_keys.shape[1])[None, :] <= (start + jnp.arange(count))[:, None]
    probs = jax.nn.softmax(jnp.where(seen, logits, jnp.finfo(logits.dtype).min), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs.astype(all_values.dtype), all_values)

"""Precision for what training stores: optimizer state and master weights below float32.

Adam keeps 8 bytes of moments per parameter and, for half-stored params, 4 more
of float32 masters: most of a large model's train state. Stored in bfloat16
they take half, but round-to-nearest loses what the seeds of this project
describe: an update smaller than half a unit in the last place of the value it
is added to vanishes, every step, so a bfloat16 weight (8 bits of mantissa)
stops moving under a small learning rate, and a second moment's small
increments round away. The remedies here keep the arithmetic in float32 and
round only the store:

- :func:`stochastic_round`: round up with probability equal to the distance to
  the value below, so the stored value is right on average (an update of a
  tenth of an ulp moves the weight one ulp one time in ten). The random bits are
  a pure function of a key in the train state (:func:`step_key`) and each value's
  index (:func:`precision.rounding_bits.hashed_bits`: a few integer operations a
  value, where threefry's took most of a large model's update): resume is bit-exact,
  and a sharded value gets the same bits on any mesh.
- :func:`kahan_add`: a bfloat16 compensation buffer holds what the rounded sum
  lost and adds it back next step (deterministic, 2 more bytes per param).
- :func:`stored_in`: any optax transformation with its float state stored in
  bfloat16 or 8-bit blocks (upcast, update in float32, store with stochastic rounding).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from precision.quantized import MIN_SIZE, Blockwise, dequantize, quantize
from precision.rounding_bits import hashed_bits

__all__ = ["ROUNDINGS", "StoredState", "StoredMasters", "stochastic_round", "kahan_add", "step_key", "stored_in", "loaded", "round_to",
           "init_masters", "master_updates", "accumulate"]

F32, BF16, INT8 = np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.int8)
#: How a value computed in float32 is stored in bfloat16: ``stochastic`` (unbiased, default),
#: ``kahan`` (a compensation buffer carries the rounding error), ``nearest`` (plain rounding).
ROUNDINGS = ("stochastic", "kahan", "nearest")
_SEED = 0x5EED  # the stochastic rounding's stream: this seed, folded with the step count and the leaf


#: The streams of random bits: the optimizer state's stores, the masters' and the gradient
#: accumulation's (never the same bits).
STATE_STREAM, MASTER_STREAM, ACCUM_STREAM = 0, 1, 2


def step_key(count: jax.Array, leaf: int = 0, stream: int = STATE_STREAM) -> jax.Array:
    """The key of stochastic rounding at step ``count`` for leaf number ``leaf`` of ``stream``."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(jax.random.key(_SEED), stream), count), leaf)


def stochastic_round(x: jax.Array, key: jax.Array, dtype: Any = BF16) -> jax.Array:
    """``x`` (float32) rounded to bfloat16 up or down at random, up with probability
    equal to its distance from the value below (in units of the bfloat16 ulp): unbiased.

    bfloat16 is float32's upper 16 bits: adding 16 random bits below them and truncating
    does exactly that. Non-finite values round to nearest (they stay what they are).
    """
    if np.dtype(dtype) != BF16:
        raise ValueError(f"stochastic rounding stores float32 values as bfloat16, not {np.dtype(dtype)}")
    x = jnp.asarray(x, jnp.float32)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    noise = hashed_bits(key, x.shape) >> 16
    rounded = jax.lax.bitcast_convert_type((bits + noise) & jnp.uint32(0xFFFF0000), jnp.float32)
    return jnp.where(jnp.isfinite(x), rounded, x).astype(BF16)


def accumulate(total: Any, grads: Any, key: jax.Array) -> Any:
    """``total + grads`` leaf by leaf, added in float32 and stored in ``total``'s dtype:
    float32 as it is, bfloat16 with stochastic rounding from ``key`` (folded with the
    leaf's index). Gradient accumulation over micro-batches in a bfloat16 buffer
    (``accum=bf16``) halves its bytes; rounding each partial sum to nearest would drop
    every micro-batch's bits below the running total's ulp, always the same way."""
    leaves, treedef = jax.tree_util.tree_flatten(total)
    added = []
    for i, (t, g) in enumerate(zip(leaves, treedef.flatten_up_to(grads), strict=True)):
        s = t.astype(jnp.float32) + g.astype(jnp.float32)
        added.append(s if t.dtype == F32 else stochastic_round(s, jax.random.fold_in(key, i), t.dtype))
    return treedef.unflatten(added)


def kahan_add(value: jax.Array, update: jax.Array, compensation: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``value + update`` (``value`` and ``compensation`` stored in bfloat16), computed in
    float32 with the rounding error of the last store added back; returns the new value and
    the new compensation (what rounding the sum to bfloat16 lost, itself in bfloat16)."""
    total = value.astype(jnp.float32) + (update.astype(jnp.float32) + compensation.astype(jnp.float32))
    stored = total.astype(value.dtype)
    return stored, (total - stored.astype(jnp.float32)).astype(compensation.dtype)


def round_to(x: jax.Array, dtype: Any, rounding: str, key: jax.Array) -> jax.Array:
    """``x`` stored in ``dtype``: float32 as it is; bfloat16 by ``rounding`` (``stochastic`` or ``nearest``)."""
    dtype = np.dtype(dtype)
    if dtype == F32 or not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    return stochastic_round(x, key, dtype) if rounding == "stochastic" else x.astype(dtype)


class StoredState(NamedTuple):
    """State of :func:`stored_in`: the inner state, its floating arrays in the stored dtype."""

    inner_state: Any
    count: jax.Array  # updates stored so far: the stochastic rounding's stream


def _stored(x: Any) -> bool:
    """Whether a state leaf is narrowed: floating arrays (scalars, such as a schedule's, stay)."""
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) and np.ndim(x) > 0


def _is_blockwise(x: Any) -> bool:
    return isinstance(x, Blockwise)


def _store(x: Any, dtype: np.dtype, key: jax.Array) -> Any:
    """A float32 state array stored in ``dtype``: bfloat16 (stochastic rounding), float32, or
    8-bit blocks (:mod:`precision.quantized`) for an array of at least ``MIN_SIZE`` values."""
    if dtype == INT8:
        return quantize(x, key) if x.size >= MIN_SIZE else round_to(x, BF16, "stochastic", key)
    return round_to(x, dtype, "stochastic", key)


def _load(x: Any) -> Any:
    if _is_blockwise(x):
        return dequantize(x)
    return x.astype(jnp.float32) if _stored(x) else x


def loaded(state: Any) -> Any:
    """A state (or part of one) that :func:`stored_in` stored, read back in float32: what ``inner`` sees."""
    return jax.tree_util.tree_map(_load, state, is_leaf=_is_blockwise)


def stored_in(inner: optax.GradientTransformation, dtype: Any = BF16) -> optax.GradientTransformationExtraArgs:
    """``inner`` with its floating state arrays stored in ``dtype``: bfloat16, float32, or
    ``int8`` (8-bit blocks, :mod:`precision.quantized`; arrays under its ``MIN_SIZE`` in
    bfloat16). Each update reads them in float32, runs ``inner`` in float32, and stores the
    new state with stochastic rounding (plain rounding would drop the second moment's small
    increments). Works for any optax transformation whose state holds float arrays."""
    dtype = np.dtype(dtype)
    if dtype not in (F32, BF16, INT8):
        raise ValueError(f"optimizer state can be stored in float32, bfloat16 or int8 (8-bit blocks), not {dtype} "
                         f"(float16's range loses a second moment's squares of small gradients)")
    inner = optax.with_extra_args_support(inner)

    def store_all(state, count):
        leaves, treedef = jax.tree_util.tree_flatten(state)
        stored = [_store(x, dtype, step_key(count, i)) if _stored(x) else x for i, x in enumerate(leaves)]
        return jax.tree_util.tree_unflatten(treedef, stored)

    def init(params):
        zero = jnp.zeros([], jnp.uint32)
        return StoredState(store_all(inner.init(params), zero), zero)

    def update(updates, state, params=None, **extra_args):
        wide = loaded(state.inner_state)
        updates, new = inner.update(updates, wide, params, **extra_args)
        return updates, StoredState(store_all(new, state.count), state.count + 1)

    return optax.GradientTransformationExtraArgs(init, update)


class StoredMasters(NamedTuple):
    """State of bfloat16 masters (params stored in bfloat16 are their own masters)."""

    count: jax.Array  # updates applied so far: the stochastic rounding's stream
    compensation: Any = None  # kahan: per bfloat16 param, what rounding its last update lost


def init_masters(params: Any, rounding: str) -> StoredMasters:
    """The state of bfloat16 masters of ``params`` under ``rounding`` (see :data:`ROUNDINGS`)."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"master rounding must be one of {', '.join(ROUNDINGS)}, got {rounding!r}")
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        if jnp.issubdtype(x.dtype, jnp.floating) and np.dtype(x.dtype) not in (F32, BF16):
            raise ValueError(f"bfloat16 masters keep bfloat16 (or float32) params, but "
                             f"{jax.tree_util.keystr(path, simple=True, separator='/')} is {np.dtype(x.dtype)}: "
                             f"use params=bf16, or float32 masters (master=f32)")
    compensation = None
    if rounding == "kahan":
        compensation = jax.tree_util.tree_map(lambda x: jnp.zeros_like(x) if np.dtype(x.dtype) == BF16 else None,
                                              params)
    return StoredMasters(jnp.zeros([], jnp.uint32), compensation)


def master_updates(params: Any, updates: Any, state: StoredMasters, rounding: str) -> tuple[Any, StoredMasters]:
    """Float32 ``updates`` to bfloat16 params (their own masters) rounded by ``rounding``:
    the updates returned move each bfloat16 param exactly to its rounded sum (float32
    params take theirs as they are), and the masters' new state."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    moves = treedef.flatten_up_to(updates)
    carried = treedef.flatten_up_to(state.compensation) if state.compensation is not None else [None] * len(leaves)
    out, kept = [], []
    for i, (p, u, c) in enumerate(zip(leaves, moves, carried)):
        if np.dtype(p.dtype) != BF16:
            out.append(u)
            kept.append(c)
            continue
        if rounding == "kahan":
            stored, c = kahan_add(p, u, c)
        else:
            stored = round_to(p.astype(jnp.float32) + u.astype(jnp.float32), BF16, rounding,
                              step_key(state.count, i, MASTER_STREAM))
        out.append(stored.astype(jnp.float32) - p.astype(jnp.float32))  # exact: both are bfloat16 values
        kept.append(c)
    compensation = None if state.compensation is None else jax.tree_util.tree_unflatten(treedef, kept)
    return jax.tree_util.tree_unflatten(treedef, out), StoredMasters(state.count + 1, compensation)


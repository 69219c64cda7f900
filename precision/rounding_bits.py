"""Random bits for stochastic rounding, cheap enough to draw for every parameter every step.

Storing a train state in bfloat16 with stochastic rounding (:mod:`precision.stored`) draws
random bits for every parameter and every optimizer moment, every step: 24 billion a step for an
8B model's params and two Adam moments. ``jax.random.bits`` draws them with threefry2x32,
twenty rounds of 32-bit arithmetic a pair of words, and that arithmetic, not memory, set the
speed of the update: on an H200 (2026-11-30, ``benchmarks/results/fp8_speed-nvidia-h200-2026-11-30.json``)
the lean update's fusions took 76 + 14 ms of a 469 ms step at Llama-3-8B's shape, where its
bytes need about 25 ms.

Rounding needs less than a cryptographic stream: 16 independent, uniform bits a value,
a new draw every step, the same draw on resume and on any mesh. :func:`hashed_bits` hashes
each element's coordinates with a 32-bit integer mixer (``lowbias32``, from Chris Wellons'
hash prospector: two multiplies and three xor-shifts, full avalanche), seeded by two words
drawn from the step's key: one mixing round a dimension and one more, a few integer
operations a value where threefry takes about a hundred. It is a pure function of the key
and the global index, so a sharded array gets the bits of the whole one (the index is
``iota`` over the global shape, which the SPMD partitioner offsets per shard).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

__all__ = ["hashed_bits", "mix32"]

_MULTIPLIERS = (0x21F0AAAD, 0xD35A2D97)


def mix32(x: jax.Array) -> jax.Array:
    """``lowbias32``: a bijection of uint32 whose every output bit depends on every input bit
    (a flipped input bit flips each output bit with probability close to a half)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(_MULTIPLIERS[0])
    x = x ^ (x >> 15)
    x = x * jnp.uint32(_MULTIPLIERS[1])
    return x ^ (x >> 15)


def hashed_bits(key: jax.Array, shape: Sequence[int]) -> jax.Array:
    """uint32 random bits of ``shape`` for stochastic rounding: each element's coordinates
    hashed (:func:`mix32`, one round a dimension) with two seed words drawn from ``key``.
    Deterministic in ``key``; a different key gives unrelated bits."""
    shape = tuple(int(n) for n in shape)
    seed = jax.random.bits(key, (2,), jnp.uint32)
    h = seed[0]
    for axis, n in enumerate(shape):  # each coordinate < 2**32, so any size is covered
        index = jax.lax.broadcasted_iota(jnp.uint32, tuple(n if a == axis else 1 for a in range(len(shape))), axis)
        h = mix32(h + index)
    return mix32(jnp.broadcast_to(h, shape) ^ seed[1])

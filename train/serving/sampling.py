"""The next token from the logits, in float32: greedy, or sampled with a temperature, top-k and top-p.

Whatever the model computes in, its logits come out in float32 and are sampled there: a
temperature divides them, ``top_k`` keeps the k largest, ``top_p`` the fewest largest whose
probabilities add up to at least p (nucleus sampling), the rest get no probability; one
draw per row from the key of that step. Temperature 0 is greedy (the largest logit).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from train.serving.tokenizer import SampleError

__all__ = ["Sampling", "next_tokens"]


class Sampling(NamedTuple):
    """How the next token is chosen (``top_k``/``top_p`` None: not applied); ``seed`` keys the draws."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0

    def checked(self, vocab: int) -> "Sampling":
        """The same, or :class:`SampleError` naming the option out of range."""
        if not self.temperature >= 0:
            raise SampleError(f"--temperature {self.temperature}: give 0 (greedy) or more")
        if self.top_k is not None and not 1 <= self.top_k:
            raise SampleError(f"--top-k {self.top_k}: give at least 1 (the vocabulary has {vocab} tokens)")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise SampleError(f"--top-p {self.top_p}: give a probability in (0, 1]")
        return self._replace(top_k=None if self.top_k is None else min(self.top_k, vocab))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def next_tokens(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """One token per row of ``logits`` ``(batch, vocab)``, chosen as ``sampling`` says (in float32)."""
    logits = logits.astype(jnp.float32)
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / sampling.temperature
    if sampling.top_k is not None:
        kth = jax.lax.top_k(logits, sampling.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sampling.top_p is not None:
        ordered = jnp.sort(logits, axis=-1)[:, ::-1]
        before = jnp.cumsum(jax.nn.softmax(ordered, axis=-1), axis=-1) - jax.nn.softmax(ordered, axis=-1)
        kept = jnp.where(before < sampling.top_p, ordered, jnp.inf)  # the fewest largest reaching p
        logits = jnp.where(logits < jnp.min(kept, axis=-1, keepdims=True), -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)

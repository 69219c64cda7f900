"""A user's GPT on Flax's ``nn.SelfAttention`` (``examples/user_models/linen_gpt.py``) with its head tied
to the token embedding and written as an einsum, ``einsum("btd,vd->btv", x, embedding)``, as Gemma and
MaxText write theirs: the head's matmul contracts the weight's trailing axis (``x . wᵀ``), a form of its
own for the int8 TPU kernels (``benchmarks/int8_tpu_step.py``'s ``flax-attention-einsum-head`` case).
"""

from __future__ import annotations

import sys
from pathlib import Path

import flax.linen as nn
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "user_models"))
import linen_gpt  # noqa: E402

__all__ = ["GPT"]


class GPT(linen_gpt.GPT):
    """``linen_gpt.GPT`` (its fields, its blocks) with the head ``x . embeddingᵀ`` written as an einsum."""

    @nn.compact
    def __call__(self, tokens, deterministic: bool = True):
        embed = nn.Embed(self.vocab_size, self.width, name="embed")
        positions = self.param("positions", nn.initializers.normal(0.02), (self.max_len, self.width))
        x = embed(tokens) + positions[None, :tokens.shape[1]]
        for i in range(self.layers):
            x = linen_gpt.Block(self.width, self.heads, self.dropout, name=f"block_{i}")(x, deterministic)
        return jnp.einsum("btd,vd->btv", nn.LayerNorm(name="ln_f")(x), embed.embedding)

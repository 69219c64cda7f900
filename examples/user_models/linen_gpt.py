"""A user's GPT written with Flax's own attention: ``nn.SelfAttention`` with a
causal mask from ``nn.make_causal_mask``, pre-norm blocks, learned positions,
``deterministic`` on the call. Flax writes this attention out (two einsums
around a softmax); under a half policy autocast computes it as one fused
attention (cuDNN's on a GPU). Nothing here knows about mixed precision.

    python -m train examples/user_models/linen_gpt.yaml
    python -m train examples/user_models/linen_gpt.yaml --explain
"""

import flax.linen as nn
import jax.numpy as jnp


class Block(nn.Module):
    width: int
    heads: int
    dropout: float

    @nn.compact
    def __call__(self, x, deterministic: bool):
        mask = nn.make_causal_mask(x[..., 0])
        y = nn.SelfAttention(self.heads, dropout_rate=self.dropout, deterministic=deterministic,
                             name="attn")(nn.LayerNorm(name="ln1")(x), mask=mask)
        x = x + nn.Dropout(self.dropout)(y, deterministic=deterministic)
        y = nn.Dense(4 * self.width, name="up")(nn.LayerNorm(name="ln2")(x))
        y = nn.Dense(self.width, name="down")(nn.gelu(y))
        return x + nn.Dropout(self.dropout)(y, deterministic=deterministic)


class GPT(nn.Module):
    vocab_size: int
    max_len: int
    width: int = 128
    heads: int = 4
    layers: int = 2
    dropout: float = 0.0

    @nn.compact
    def __call__(self, tokens, deterministic: bool = True):
        x = nn.Embed(self.vocab_size, self.width, name="embed")(tokens)
        positions = self.param("positions", nn.initializers.normal(0.02), (self.max_len, self.width))
        x = x + positions[None, :tokens.shape[1]]
        for i in range(self.layers):
            x = Block(self.width, self.heads, self.dropout, name=f"block_{i}")(x, deterministic)
        return nn.Dense(self.vocab_size, name="head")(nn.LayerNorm(name="ln_f")(x))

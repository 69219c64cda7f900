"""A user's Linen language model in the style of Flax's lm1b/wmt examples: a
config dataclass, ``dtype`` pinned in every layer, and ``deterministic`` (not
``train``) on the call. Nothing here knows about mixed precision.

    python -m train examples/user_models/linen_lm.yaml
"""

import dataclasses

import flax.linen as nn
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class LMConfig:
    vocab_size: int = 64
    max_len: int = 64
    width: int = 64
    heads: int = 4
    layers: int = 2
    dropout: float = 0.1
    dtype: str = "float32"  # what such models pin; the policy overrides it


class Block(nn.Module):
    config: LMConfig

    @nn.compact
    def __call__(self, x, deterministic: bool):
        c = self.config
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        y = nn.LayerNorm(dtype=c.dtype)(x)
        y = nn.MultiHeadDotProductAttention(c.heads, dtype=c.dtype, dropout_rate=c.dropout,
                                            deterministic=deterministic)(y, y, mask=mask)
        x = x + y
        y = nn.Dense(4 * c.width, dtype=c.dtype)(nn.LayerNorm(dtype=c.dtype)(x))
        y = nn.Dense(c.width, dtype=c.dtype)(nn.gelu(y))
        return x + nn.Dropout(c.dropout)(y, deterministic=deterministic)


class LM(nn.Module):
    config: LMConfig

    @nn.compact
    def __call__(self, tokens, deterministic: bool = True):
        c = self.config
        x = nn.Embed(c.vocab_size, c.width, dtype=c.dtype)(tokens)
        x = x + self.param("position", nn.initializers.normal(0.02), (c.max_len, c.width))[:tokens.shape[1]]
        for _ in range(c.layers):
            x = Block(c)(x, deterministic)
        return nn.Dense(c.vocab_size, dtype=c.dtype)(nn.LayerNorm(dtype=c.dtype)(x))

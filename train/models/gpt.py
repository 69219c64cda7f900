"""A decoder-only, GPT-style Transformer for character-level language modelling.

The attention probabilities come from their own :class:`Softmax` module, so a
precision rule (``("Softmax", "f32")``, or preset O1) can keep them in float32
without the model knowing about precision.
"""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp


class Softmax(nn.Module):
    """``jax.nn.softmax`` as a module, so rules can target it."""

    axis: int = -1

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.nn.softmax(x, axis=self.axis)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position sees only earlier ones."""

    num_heads: int
    dropout: float = 0.0
    dtype: Any = None  # every layer's computation dtype, the way Flax examples pass it; None: inputs'/params'

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        batch, length, features = x.shape
        head_dim = features // self.num_heads
        qkv = nn.Dense(3 * features, dtype=self.dtype, name="qkv")(x)
        q, k, v = jnp.split(qkv.reshape(batch, length, 3 * self.num_heads, head_dim), 3, axis=2)
        q = q * (head_dim ** -0.5)  # scale before the product: keeps the logits in range
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        causal = jnp.tril(jnp.ones((length, length), dtype=bool))
        logits = jnp.where(causal, logits, jnp.finfo(logits.dtype).min)
        probs = Softmax(name="softmax")(logits)
        probs = nn.Dropout(self.dropout, deterministic=not train)(probs)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v.dtype), v)
        return nn.Dense(features, dtype=self.dtype, name="proj")(out.reshape(batch, length, features))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    num_heads: int
    mlp_ratio: int = 4
    dropout: float = 0.0
    dtype: Any = None  # every layer's computation dtype, the way Flax examples pass it; None: inputs'/params'

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        features = x.shape[-1]
        x = x + CausalSelfAttention(self.num_heads, self.dropout, self.dtype, name="attn")(
            nn.LayerNorm(dtype=self.dtype)(x), train)
        y = nn.Dense(self.mlp_ratio * features, dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(x))
        y = nn.Dense(features, dtype=self.dtype)(nn.gelu(y))
        return x + nn.Dropout(self.dropout, deterministic=not train)(y)


class GPT(nn.Module):
    """Token and position embeddings, ``num_layers`` Transformer blocks, a final
    LayerNorm and a linear head over the vocabulary."""

    vocab_size: int = 128
    block_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    d_model: int = 128
    mlp_ratio: int = 4
    dropout: float = 0.0
    dtype: Any = None  # every layer's computation dtype, the way Flax examples pass it; None: inputs'/params'

    @nn.compact
    def __call__(self, tokens: jax.Array, train: bool = False) -> jax.Array:
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by num_heads ({self.num_heads})")
        length = tokens.shape[1]
        if length > self.block_size:
            raise ValueError(f"sequence length {length} exceeds block_size {self.block_size}")
        x = nn.Embed(self.vocab_size, self.d_model, dtype=self.dtype, name="tokens")(tokens)
        x = x + nn.Embed(self.block_size, self.d_model, dtype=self.dtype, name="positions")(jnp.arange(length))[None]
        x = nn.Dropout(self.dropout, deterministic=not train)(x)
        for i in range(self.num_layers):
            x = TransformerBlock(self.num_heads, self.mlp_ratio, self.dropout, self.dtype, name=f"block_{i}")(x, train)
        return nn.Dense(self.vocab_size, dtype=self.dtype, name="head")(nn.LayerNorm(dtype=self.dtype, name="ln_f")(x))

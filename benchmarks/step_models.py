"""Models written the way users write them, for comparing our step with a hand-written one.

Each model pins its layers' computation dtype (``dtype=jnp.float32``, as Flax's
examples and most published models do) and takes the attention function its
layers call, so the same model is written twice:

- as a user gives it to this library: float32 layers, attention written out
  (``nn.dot_product_attention``: einsum, softmax, einsum), nothing about
  precision; autocast makes it half and fuses its attention;
- as a careful user writes it by hand for a half-precision step: the same
  layers with ``dtype=jnp.bfloat16`` (or float16) and ``jax.nn.dot_product_attention``
  with cuDNN's fused kernel.

``PinnedGPT`` is a GPT on Flax's ``nn.SelfAttention`` (learned positions,
LayerNorm, GELU MLP); ``Llama`` a Llama-style decoder (RMSNorm, rotary
positions, SwiGLU, no biases) with its attention in ``nn.MultiHeadDotProductAttention``'s
place written by hand.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

__all__ = ["PinnedGPT", "Llama", "cudnn_attention"]


def cudnn_attention(query, key, value, bias=None, mask=None, **_: Any):
    """Causal attention by cuDNN's fused kernel (what a hand-written half step calls), with
    ``nn.dot_product_attention``'s signature: the mask is the causal one, so it is not read."""
    del bias, mask
    return jax.nn.dot_product_attention(query, key, value, is_causal=True, implementation="cudnn")


class _Block(nn.Module):
    width: int
    heads: int
    dtype: Any
    attention_fn: Callable

    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(x[..., 0])
        y = nn.SelfAttention(self.heads, dtype=self.dtype, attention_fn=self.attention_fn, name="attn")(
            nn.LayerNorm(dtype=self.dtype, name="ln1")(x), mask=mask)
        x = x + y
        y = nn.Dense(4 * self.width, dtype=self.dtype, name="up")(nn.LayerNorm(dtype=self.dtype, name="ln2")(x))
        return x + nn.Dense(self.width, dtype=self.dtype, name="down")(nn.gelu(y))


class PinnedGPT(nn.Module):
    """A GPT on ``nn.SelfAttention`` with every layer's ``dtype`` pinned (float32 by default)."""

    vocab_size: int
    max_len: int
    width: int = 128
    heads: int = 4
    layers: int = 2
    dtype: Any = jnp.float32
    attention_fn: Callable = nn.dot_product_attention

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab_size, self.width, dtype=self.dtype, name="embed")(tokens)
        positions = self.param("positions", nn.initializers.normal(0.02), (self.max_len, self.width))
        x = x + positions[None, :tokens.shape[1]].astype(self.dtype)
        for i in range(self.layers):
            x = _Block(self.width, self.heads, self.dtype, self.attention_fn, name=f"block_{i}")(x)
        return nn.Dense(self.vocab_size, dtype=self.dtype, name="head")(nn.LayerNorm(dtype=self.dtype, name="ln_f")(x))


class _RMSNorm(nn.Module):
    dtype: Any

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        variance = jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True)
        return (x * jax.lax.rsqrt(variance + 1e-6)).astype(self.dtype) * scale.astype(self.dtype)


def _rotary(x):
    half = x.shape[-1] // 2
    angles = jnp.arange(x.shape[1])[:, None] / (10000 ** (jnp.arange(half) / half))[None, :]
    cos, sin = jnp.cos(angles)[None, :, None, :].astype(x.dtype), jnp.sin(angles)[None, :, None, :].astype(x.dtype)
    first, second = x[..., :half], x[..., half:]
    return jnp.concatenate([first * cos - second * sin, first * sin + second * cos], axis=-1)


class _LlamaBlock(nn.Module):
    width: int
    heads: int
    dtype: Any
    attention_fn: Callable
    kv_heads: int | None = None  # grouped-query attention (None: as many as ``heads``)
    mlp: int | None = None  # the MLP's width (None: 4 x width)

    @nn.compact
    def __call__(self, x):
        size, kv_heads = self.width // self.heads, self.kv_heads or self.heads
        h = _RMSNorm(self.dtype, name="attn_norm")(x)
        q = nn.DenseGeneral((self.heads, size), use_bias=False, dtype=self.dtype, name="q")(h)
        k, v = (nn.DenseGeneral((kv_heads, size), use_bias=False, dtype=self.dtype, name=n)(h) for n in ("k", "v"))
        k, v = (jnp.repeat(t, self.heads // kv_heads, axis=2) for t in (_rotary(k), v))
        mask = nn.make_causal_mask(x[..., 0])
        out = self.attention_fn(_rotary(q), k, v, mask=mask, dtype=self.dtype)
        x = x + nn.DenseGeneral(self.width, axis=(-2, -1), use_bias=False, dtype=self.dtype, name="o")(out)
        h = _RMSNorm(self.dtype, name="mlp_norm")(x)
        gate = nn.Dense(self.mlp or 4 * self.width, use_bias=False, dtype=self.dtype, name="gate")(h)
        up = nn.Dense(self.mlp or 4 * self.width, use_bias=False, dtype=self.dtype, name="up")(h)
        return x + nn.Dense(self.width, use_bias=False, dtype=self.dtype, name="down")(nn.silu(gate) * up)


class _ScannedLlamaBlock(_LlamaBlock):
    """A block as :func:`flax.linen.scan` calls it: ``(carry, x) -> (carry, y)``."""

    def __call__(self, x, _):  # type: ignore[override]
        return super().__call__(x), None


class ScannedLlama(nn.Module):
    """A Llama-style decoder whose layers are one block scanned ``layers`` times (as MaxText
    writes them): the compiled program holds one layer, so an 8B model compiles as fast as a
    small one. Grouped-query attention and the MLP's width as Llama 3 has them."""

    vocab_size: int
    width: int = 128
    heads: int = 4
    kv_heads: int = 2
    layers: int = 2
    mlp: int = 352
    dtype: Any = jnp.float32
    attention_fn: Callable = nn.dot_product_attention

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab_size, self.width, dtype=self.dtype, name="embed")(tokens)
        stack = nn.scan(_ScannedLlamaBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                        length=self.layers)
        x, _ = stack(self.width, self.heads, self.dtype, self.attention_fn, self.kv_heads, self.mlp, name="layers")(
            x, None)
        return nn.Dense(self.vocab_size, use_bias=False, dtype=self.dtype, name="head")(
            _RMSNorm(self.dtype, name="norm")(x))


class Llama(nn.Module):
    """A Llama-style decoder with every layer's ``dtype`` pinned (float32 by default)."""

    vocab_size: int
    width: int = 128
    heads: int = 4
    layers: int = 2
    dtype: Any = jnp.float32
    attention_fn: Callable = nn.dot_product_attention

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab_size, self.width, dtype=self.dtype, name="embed")(tokens)
        for i in range(self.layers):
            x = _LlamaBlock(self.width, self.heads, self.dtype, self.attention_fn, name=f"layer_{i}")(x)
        return nn.Dense(self.vocab_size, use_bias=False, dtype=self.dtype, name="head")(
            _RMSNorm(self.dtype, name="norm")(x))

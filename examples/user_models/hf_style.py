"""Language models written the way Hugging Face's Flax models are (written here,
not copied): a GPT-2-style model (fused ``c_attn`` projection, heads split by
reshape, causal and padding masks combined into an additive bias with
``lax.select``, ``einsum`` / softmax / ``einsum``) and a Llama-style model
(RMSNorm, rotary positions, grouped key/value heads repeated to the query heads,
a boolean causal mask applied with ``jnp.where``, a SiLU-gated MLP). Both take
an optional ``attention_mask`` (1 = a real token). Nothing here knows about
mixed precision.

    python -m train examples/user_models/hf_style.yaml [model.name=hf_style.py:Llama]
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax


def _attend(query, key, value, bias):
    """Scaled dot-product attention as HF's Flax models write it: (batch, length, heads, size)."""
    query = query / jnp.sqrt(query.shape[-1]).astype(query.dtype)
    weights = jnp.einsum("bqhd,bkhd->bhqk", query, key) + bias
    weights = jax.nn.softmax(weights, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, value)


def _padding_and_causal(tokens, attention_mask):
    length = tokens.shape[1]
    if attention_mask is None:
        attention_mask = jnp.ones_like(tokens)
    causal = jnp.tril(jnp.ones((length, length), bool))[None, None]
    return jnp.logical_and(causal, attention_mask[:, None, None, :].astype(bool))


class GPT2Attention(nn.Module):
    width: int
    heads: int

    @nn.compact
    def __call__(self, x, keep):
        qkv = nn.Dense(3 * self.width, name="c_attn")(x)
        query, key, value = jnp.split(qkv, 3, axis=-1)
        split = lambda t: t.reshape(t.shape[:2] + (self.heads, -1))  # noqa: E731
        bias = lax.select(keep, jnp.full(keep.shape, 0.0, x.dtype), jnp.full(keep.shape, jnp.finfo(x.dtype).min))
        out = _attend(split(query), split(key), split(value), bias)
        return nn.Dense(self.width, name="c_proj")(out.reshape(out.shape[:2] + (self.width,)))


class GPT2(nn.Module):
    vocab_size: int
    max_len: int
    width: int = 128
    heads: int = 4
    layers: int = 2

    @nn.compact
    def __call__(self, tokens, attention_mask=None):
        keep = _padding_and_causal(tokens, attention_mask)
        x = nn.Embed(self.vocab_size, self.width, name="wte")(tokens)
        x = x + nn.Embed(self.max_len, self.width, name="wpe")(jnp.arange(tokens.shape[1])[None])
        for i in range(self.layers):
            x = x + GPT2Attention(self.width, self.heads, name=f"h_{i}_attn")(nn.LayerNorm(name=f"h_{i}_ln_1")(x),
                                                                              keep)
            y = nn.Dense(4 * self.width, name=f"h_{i}_c_fc")(nn.LayerNorm(name=f"h_{i}_ln_2")(x))
            x = x + nn.Dense(self.width, name=f"h_{i}_c_proj")(nn.gelu(y, approximate=True))
        return nn.Dense(self.vocab_size, name="lm_head")(nn.LayerNorm(name="ln_f")(x))


class RMSNorm(nn.Module):
    eps: float = 1e-6

    @nn.compact
    def __call__(self, x):
        scale = self.param("weight", nn.initializers.ones, (x.shape[-1],))
        variance = jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True)
        return (x * lax.rsqrt(variance + self.eps)).astype(x.dtype) * scale


def _rotate(x, positions):
    half = x.shape[-1] // 2
    frequencies = 1.0 / (10000 ** (jnp.arange(half) / half))
    angles = positions[:, None] * frequencies[None, :]  # (length, half)
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    first, second = x[..., :half], x[..., half:]
    return jnp.concatenate([first * cos - second * sin, first * sin + second * cos], axis=-1)


class LlamaAttention(nn.Module):
    width: int
    heads: int
    kv_heads: int

    @nn.compact
    def __call__(self, x, keep):
        size = self.width // self.heads
        query = nn.DenseGeneral((self.heads, size), use_bias=False, name="q_proj")(x)
        key = nn.DenseGeneral((self.kv_heads, size), use_bias=False, name="k_proj")(x)
        value = nn.DenseGeneral((self.kv_heads, size), use_bias=False, name="v_proj")(x)
        positions = jnp.arange(x.shape[1])
        query, key = _rotate(query, positions), _rotate(key, positions)
        key = jnp.repeat(key, self.heads // self.kv_heads, axis=2)
        value = jnp.repeat(value, self.heads // self.kv_heads, axis=2)
        weights = jnp.einsum("bqhd,bkhd->bhqk", query, key) / jnp.sqrt(size).astype(x.dtype)
        weights = jnp.where(keep, weights, jnp.finfo(weights.dtype).min)
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(weights, axis=-1), value)
        return nn.DenseGeneral(self.width, axis=(-2, -1), use_bias=False, name="o_proj")(out)


class Llama(nn.Module):
    vocab_size: int
    max_len: int = 2048  # rotary positions need no table: the longest sequence it is meant for
    width: int = 128
    heads: int = 4
    kv_heads: int = 2
    layers: int = 2

    @nn.compact
    def __call__(self, tokens, attention_mask=None):
        keep = _padding_and_causal(tokens, attention_mask)
        x = nn.Embed(self.vocab_size, self.width, name="embed_tokens")(tokens)
        for i in range(self.layers):
            x = x + LlamaAttention(self.width, self.heads, self.kv_heads, name=f"layers_{i}_self_attn")(
                RMSNorm(name=f"layers_{i}_input_layernorm")(x), keep)
            y = RMSNorm(name=f"layers_{i}_post_attention_layernorm")(x)
            gate = nn.Dense(4 * self.width, use_bias=False, name=f"layers_{i}_gate_proj")(y)
            up = nn.Dense(4 * self.width, use_bias=False, name=f"layers_{i}_up_proj")(y)
            x = x + nn.Dense(self.width, use_bias=False, name=f"layers_{i}_down_proj")(nn.silu(gate) * up)
        return nn.Dense(self.vocab_size, use_bias=False, name="lm_head")(RMSNorm(name="norm")(x))

"""Attention written the ways people write it, for the fused-attention tests
(written here; the Hugging Face-style and Flax-SelfAttention GPTs are in
examples/user_models)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

T, WIDTH, HEADS = 16, 32, 4


class LinenFunctionAttention(nn.Module):
    """``nn.dot_product_attention`` called directly, with a padding mask from lengths."""

    @nn.compact
    def __call__(self, x, lengths):
        q, k, v = (nn.DenseGeneral((HEADS, WIDTH // HEADS), name=n)(x) for n in ("q", "k", "v"))
        keep = jnp.arange(x.shape[1])[None, :] < lengths[:, None]
        out = nn.dot_product_attention(q, k, v, mask=keep[:, None, None, :])
        return nn.DenseGeneral(WIDTH, axis=(-2, -1), name="out")(out)


class SownWeights(nn.Module):
    """Linen's multi-head attention keeping its attention weights (``sow_weights``)."""

    @nn.compact
    def __call__(self, x):
        return nn.MultiHeadDotProductAttention(HEADS)(x, x, mask=nn.make_causal_mask(x[..., 0]), sow_weights=True)


class WrittenOut(nn.Module):
    """Attention written out by hand: the softmax over ``axis``, logits capped by ``cap``."""

    axis: int = -1
    cap: float = 0.0
    returns_probabilities: bool = False

    @nn.compact
    def __call__(self, x):
        q, k, v = (nn.DenseGeneral((HEADS, WIDTH // HEADS), name=n)(x) for n in ("q", "k", "v"))
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1])
        if self.cap:
            logits = self.cap * jnp.tanh(logits / self.cap)
        probabilities = jax.nn.softmax(logits, axis=self.axis)
        out = nn.DenseGeneral(WIDTH, axis=(-2, -1), name="out")(jnp.einsum("bhqk,bkhd->bqhd", probabilities, v))
        return (out, probabilities) if self.returns_probabilities else out


class NNXDropoutAttention(nnx.Module):
    """NNX's multi-head attention with dropout on: NNX writes the attention out."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.attn = nnx.MultiHeadAttention(HEADS, WIDTH, dropout_rate=0.1, decode=False, rngs=rngs)

    def __call__(self, x):
        return self.attn(x, mask=nnx.make_causal_mask(x[..., 0]), deterministic=False)

"""Models written the way their authors' projects write them, for the doctor's
no-false-alarm sweep (written here): a T5-style encoder-decoder and a ViT-style
encoder. (The Llama-style, Flax-SelfAttention GPT and NNX models are the user
models of examples/user_models.)"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

WIDTH, HEADS = 32, 4


class T5LayerNorm(nn.Module):
    """T5's norm: scale only, no mean subtraction, variance in float32."""

    @nn.compact
    def __call__(self, x):
        scale = self.param("weight", nn.initializers.ones, (x.shape[-1],))
        variance = jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True)
        return (x * jax.lax.rsqrt(variance + 1e-6)).astype(x.dtype) * scale


def relative_buckets(query_length, key_length, buckets=8, max_distance=32):
    """T5's relative-position buckets: the log of a distance that is 0 on the diagonal, discarded by where."""
    relative = jnp.arange(key_length)[None, :] - jnp.arange(query_length)[:, None]
    distance = jnp.abs(relative)
    exact = buckets // 2
    large = exact + (jnp.log(distance.astype(jnp.float32) / exact) / np.log(max_distance / exact)
                     * (buckets - exact)).astype(jnp.int32)
    large = jnp.minimum(large, buckets - 1)
    return jnp.where(distance < exact, distance, large)


class T5Attention(nn.Module):
    relative: bool = True

    @nn.compact
    def __call__(self, x, kv, mask=None):
        size = WIDTH // HEADS
        q = nn.DenseGeneral((HEADS, size), use_bias=False, name="q")(x)
        k = nn.DenseGeneral((HEADS, size), use_bias=False, name="k")(kv)
        v = nn.DenseGeneral((HEADS, size), use_bias=False, name="v")(kv)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k)  # T5: no 1/sqrt(d)
        if self.relative:
            table = nn.Embed(8, HEADS, name="relative_attention_bias")
            scores = scores + jnp.transpose(table(relative_buckets(x.shape[1], kv.shape[1])), (2, 0, 1))[None]
        if mask is not None:
            scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        return nn.DenseGeneral(WIDTH, axis=(-2, -1), use_bias=False, name="o")(out)


class T5FeedForward(nn.Module):
    boost: float = 1.0  # > 1: its hidden activations pass float16's range (T5's known float16 overflow), its output not

    @nn.compact
    def __call__(self, x):
        hidden = nn.relu(nn.Dense(4 * WIDTH, use_bias=False, name="wi")(x)) * self.boost
        return nn.Dense(WIDTH, use_bias=False, name="wo")(hidden) / self.boost


class T5Block(nn.Module):
    decoder: bool = False
    boost: float = 1.0

    @nn.compact
    def __call__(self, x, encoded=None):
        mask = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))[None, None] if self.decoder else None
        y = T5LayerNorm(name="ln_0")(x)
        x = x + T5Attention(name="self_attention")(y, y, mask)
        if encoded is not None:
            x = x + T5Attention(relative=False, name="cross_attention")(T5LayerNorm(name="ln_1")(x), encoded)
        return x + T5FeedForward(self.boost, name="ffn")(T5LayerNorm(name="ln_2")(x))


class T5(nn.Module):
    vocab: int = 32
    hot: str = ""  # the block whose feed-forward overflows in float16 (boosted)

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(self.vocab, WIDTH, name="shared")
        encoded = embed(tokens)
        for i in range(2):
            name = f"encoder_{i}"
            encoded = T5Block(boost=1e5 if name == self.hot else 1.0, name=name)(encoded)
        encoded = T5LayerNorm(name="encoder_norm")(encoded)
        decoded = embed(jnp.roll(tokens, 1, axis=1))
        for i in range(2):
            name = f"decoder_{i}"
            decoded = T5Block(decoder=True, boost=1e5 if name == self.hot else 1.0, name=name)(decoded, encoded)
        return embed.attend(T5LayerNorm(name="decoder_norm")(decoded) * WIDTH ** -0.5)


class ViT(nn.Module):
    classes: int = 4

    @nn.compact
    def __call__(self, images):
        x = nn.Conv(WIDTH, (4, 4), strides=(4, 4), name="patch_embedding")(images)
        x = x.reshape(x.shape[0], -1, WIDTH)
        cls = self.param("cls", nn.initializers.zeros, (1, 1, WIDTH))
        x = jnp.concatenate([jnp.broadcast_to(cls, (x.shape[0], 1, WIDTH)), x], axis=1)
        x = x + self.param("position_embedding", nn.initializers.normal(0.02), (1, x.shape[1], WIDTH))
        for i in range(2):
            y = nn.LayerNorm(name=f"block_{i}_ln_0")(x)
            x = x + nn.MultiHeadDotProductAttention(HEADS, name=f"block_{i}_attention")(y, y)
            y = nn.Dense(4 * WIDTH, name=f"block_{i}_mlp_0")(nn.LayerNorm(name=f"block_{i}_ln_1")(x))
            x = x + nn.Dense(WIDTH, name=f"block_{i}_mlp_1")(nn.gelu(y))
        return nn.Dense(self.classes, name="head")(nn.LayerNorm(name="ln")(x)[:, 0])

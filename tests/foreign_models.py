"""Models written the way other projects write them, for the tests of what a
user meets first: Flax NNX's scan-over-layers pattern, tied embeddings called
through a method other than ``__call__``, layers kept in a list, Hugging Face
style nested ``attention/attention/query`` names and encoder/decoder methods,
exact GELU, and outputs that are not an array. No precision code in any."""

from __future__ import annotations

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx


# ----------------------------------------------------------------------------- NNX


class DropoutBlock(nnx.Module):
    def __init__(self, width: int, rngs: nnx.Rngs):
        self.linear = nnx.Linear(width, width, rngs=rngs)
        self.dropout = nnx.Dropout(0.3, rngs=rngs)

    def __call__(self, x):
        return x + self.dropout(nnx.relu(self.linear(x)))


class ScannedNNX(nnx.Module):
    """Stacked blocks built under ``nnx.split_rngs`` + ``nnx.vmap`` (one dropout key per
    layer), run by ``nnx.scan``: Flax's scan-over-layers pattern."""

    def __init__(self, in_features: int, num_classes: int, width: int = 32, depth: int = 5, *, rngs: nnx.Rngs):
        self.embed = nnx.Linear(in_features, width, rngs=rngs)

        @nnx.split_rngs(splits=depth)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def stack(rngs):
            return DropoutBlock(width, rngs)

        self.blocks = stack(rngs)
        self.head = nnx.Linear(width, num_classes, rngs=rngs)

    def __call__(self, x):
        x = self.embed(x.reshape(x.shape[0], -1))

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def through(x, block):
            return block(x)

        return self.head(through(x, self.blocks))


class Embedder(nnx.Module):
    """Token embeddings whose transpose gives the output logits (``attend``), as Gemma's."""

    def __init__(self, vocab: int, width: int, rngs: nnx.Rngs):
        self.table = nnx.Param(jax.random.normal(rngs.params(), (vocab, width)) / width ** 0.5)

    def __call__(self, tokens):
        return jnp.take(self.table[...], tokens, axis=0)

    def attend(self, x):
        return x @ self.table[...].T


class ListLayer(nnx.Module):
    def __init__(self, width: int, rngs: nnx.Rngs):
        self.attn = nnx.Linear(width, width, rngs=rngs)

    def __call__(self, x):
        return x + nnx.relu(self.attn(x))


class TiedNNX(nnx.Module):
    """Layers in a list, tied output logits through ``embedder.attend``."""

    def __init__(self, vocab_size: int = 50, width: int = 16, depth: int = 2, *, rngs: nnx.Rngs):
        self.embedder = Embedder(vocab_size, width, rngs)
        self.layers = nnx.List([ListLayer(width, rngs) for _ in range(depth)])

    def __call__(self, tokens):
        x = self.embedder(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.embedder.attend(x)


# ----------------------------------------------------------------------------- Linen


class SelfAttention(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x):
        q = nn.Dense(self.width, name="query")(x)
        k = nn.Dense(self.width, name="key")(x)
        return jax.nn.softmax(q @ k.swapaxes(-1, -2) / self.width ** 0.5) @ x


class AttentionLayer(nn.Module):
    """Hugging Face's ViT naming: ``attention/attention/query``."""

    width: int

    def setup(self):
        self.attention = SelfAttention(self.width)
        self.output = nn.Dense(self.width)

    def __call__(self, x):
        return self.output(self.attention(x))


class EncoderDecoder(nn.Module):
    """``encode`` / ``decode`` methods called from ``__call__`` (as the WMT example), the
    decoder's logits tied to the embedding through ``nn.Embed.attend``."""

    vocab_size: int = 50
    width: int = 16

    def setup(self):
        self.embed = nn.Embed(self.vocab_size, self.width)
        self.encoder = AttentionLayer(self.width, name="attention")
        self.decoder = nn.Dense(self.width)

    def encode(self, tokens):
        return self.encoder(self.embed(tokens))

    def decode(self, encoded):
        return self.embed.attend(self.decoder(encoded))

    def __call__(self, tokens):
        return self.decode(self.encode(tokens))


class ExactGeluMLP(nn.Module):
    """BERT and ViT's feed-forward: exact (erf) GELU."""

    @nn.compact
    def __call__(self, x):
        x = nn.gelu(nn.Dense(64)(x.reshape(x.shape[0], -1)), approximate=False)
        return nn.Dense(10)(x)


# ----------------------------------------------------------------------------- outputs that are not arrays


@flax.struct.dataclass
class ModelOutput:
    """Hugging Face's Flax outputs: struct dataclasses whose fields are also keys."""

    logits: jax.Array
    hidden_states: jax.Array | None = None

    def __getitem__(self, key):
        return getattr(self, key)


class DictOutputMLP(nn.Module):
    """Returns ``{"logits": ..., "hidden": ...}``, or another container by ``kind``."""

    num_classes: int = 10
    kind: str = "dict"

    @nn.compact
    def __call__(self, x):
        hidden = nn.relu(nn.Dense(32)(x.reshape(x.shape[0], -1)))
        logits = nn.Dense(self.num_classes)(hidden)
        if self.kind == "tuple":
            return logits, hidden
        if self.kind == "model_output":
            return ModelOutput(logits=logits, hidden_states=hidden)
        return {"logits": logits, "hidden": hidden}

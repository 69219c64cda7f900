"""A user's NNX language model written the usual way: every layer pins
``dtype=float32`` and ``param_dtype=float32``, causal attention through
``nnx.MultiHeadAttention``, no precision code and no ``train`` keyword.

    python -m train examples/user_models/nnx_lm.yaml [precision.policy=mixed_fp8]
"""

import jax.numpy as jnp
from flax import nnx

PINNED = {"dtype": jnp.float32, "param_dtype": jnp.float32}


class Block(nnx.Module):
    def __init__(self, width: int, heads: int, *, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(width, rngs=rngs, **PINNED)
        self.attn = nnx.MultiHeadAttention(heads, width, decode=False, rngs=rngs, **PINNED)
        self.ln2 = nnx.LayerNorm(width, rngs=rngs, **PINNED)
        self.up = nnx.Linear(width, 4 * width, rngs=rngs, **PINNED)
        self.down = nnx.Linear(4 * width, width, rngs=rngs, **PINNED)

    def __call__(self, x):
        mask = nnx.make_causal_mask(x[..., 0])
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.down(nnx.gelu(self.up(self.ln2(x))))


class LM(nnx.Module):
    def __init__(self, vocab_size: int, max_len: int, width: int = 128, heads: int = 4, layers: int = 2, *,
                 rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab_size, width, rngs=rngs, **PINNED)
        self.positions = nnx.Param(jnp.zeros((max_len, width), jnp.float32))
        self.blocks = nnx.List([Block(width, heads, rngs=rngs) for _ in range(layers)])
        self.ln_f = nnx.LayerNorm(width, rngs=rngs, **PINNED)
        self.head = nnx.Linear(width, vocab_size, rngs=rngs, **PINNED)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.positions[None, :tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

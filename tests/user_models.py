"""Models written the way people usually write Flax code, not for this project.

Every layer pins ``dtype=`` (and often ``param_dtype=``) to float32, directly
or through a config, as Flax's examples and most published models do. A
policy has to reach their matmuls anyway.
"""

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx


@dataclasses.dataclass(frozen=True)
class LMConfig:
    """A config object that carries the dtype down to every layer."""

    vocab: int = 32
    width: int = 32
    heads: int = 4
    layers: int = 2
    length: int = 8
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32


class DecoderBlock(nn.Module):
    config: LMConfig

    @nn.compact
    def __call__(self, x, deterministic: bool = True):
        c = self.config
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        y = nn.LayerNorm(dtype=c.dtype, param_dtype=c.param_dtype)(x)
        y = nn.MultiHeadDotProductAttention(num_heads=c.heads, dtype=c.dtype, param_dtype=c.param_dtype,
                                            dropout_rate=0.1, deterministic=deterministic)(y, mask=mask)
        x = x + y
        y = nn.LayerNorm(dtype=c.dtype, param_dtype=c.param_dtype)(x)
        y = nn.Dense(4 * c.width, dtype=c.dtype, param_dtype=c.param_dtype)(y)
        y = nn.Dense(c.width, dtype=c.dtype, param_dtype=c.param_dtype)(nn.gelu(y))
        return x + nn.Dropout(0.1, deterministic=deterministic)(y)


class PinnedLM(nn.Module):
    """A GPT-style LM; ``train`` toggles dropout."""

    config: LMConfig = LMConfig()

    @nn.compact
    def __call__(self, tokens, train: bool = False):
        c = self.config
        x = nn.Embed(c.vocab, c.width, dtype=c.dtype, param_dtype=c.param_dtype)(tokens)
        x = x + self.param("positions", nn.initializers.normal(0.02), (c.length, c.width), c.param_dtype)
        for i in range(c.layers):
            x = DecoderBlock(c, name=f"block_{i}")(x, deterministic=not train)
        x = nn.LayerNorm(dtype=c.dtype, name="ln_f")(x)
        return nn.Dense(c.vocab, dtype=c.dtype, name="head")(x)


class ScanBlock(nn.Module):
    width: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, _):
        y = nn.LayerNorm(dtype=self.dtype)(x)
        y = nn.Dense(2 * self.width, dtype=self.dtype)(y)
        y = nn.Dense(self.width, dtype=self.dtype)(jax.nn.silu(y))
        return x + y, None


class ScannedLM(nn.Module):
    """Layers stacked with ``nn.scan`` over ``nn.remat`` blocks; no ``train`` keyword."""

    vocab: int = 32
    width: int = 32
    layers: int = 3
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.width, dtype=self.dtype)(tokens)
        stack = nn.scan(nn.remat(ScanBlock), variable_axes={"params": 0}, split_rngs={"params": True},
                        length=self.layers)
        x, _ = stack(self.width, self.dtype, name="layers")(x, None)
        return nn.Dense(self.vocab, dtype=self.dtype, name="head")(x)


class BasicBlock(nn.Module):
    features: int
    strides: int = 1
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool):
        norm = lambda: nn.BatchNorm(use_running_average=not train, momentum=0.9, dtype=self.dtype)  # noqa: E731
        conv = lambda f, k, s: nn.Conv(f, k, s, use_bias=False, dtype=self.dtype)  # noqa: E731
        y = nn.relu(norm()(conv(self.features, (3, 3), self.strides)(x)))
        y = norm()(conv(self.features, (3, 3), 1)(y))
        if x.shape != y.shape:
            x = norm()(conv(self.features, (1, 1), self.strides)(x))
        return nn.relu(x + y)


class PinnedResNet(nn.Module):
    """A small ResNet with BatchNorm, every layer pinned to float32."""

    width: int = 8
    num_classes: int = 10
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Conv(self.width, (3, 3), use_bias=False, dtype=self.dtype)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9, dtype=self.dtype)(x))
        x = BasicBlock(self.width, dtype=self.dtype)(x, train)
        x = BasicBlock(2 * self.width, strides=2, dtype=self.dtype)(x, train)
        return nn.Dense(self.num_classes, dtype=self.dtype)(jnp.mean(x, axis=(1, 2)))


class PinnedNNXMLP(nnx.Module):
    """An NNX MLP with BatchNorm and Dropout, layers pinned to float32."""

    def __init__(self, din: int, hidden: int, dout: int, *, rngs: nnx.Rngs):
        pinned = dict(dtype=jnp.float32, param_dtype=jnp.float32)
        self.fc1 = nnx.Linear(din, hidden, rngs=rngs, **pinned)
        self.norm = nnx.BatchNorm(hidden, rngs=rngs, **pinned)
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.fc2 = nnx.Linear(hidden, hidden, rngs=rngs, **pinned)
        self.out = nnx.Linear(hidden, dout, rngs=rngs, **pinned)

    def __call__(self, x):
        x = self.drop(nnx.relu(self.norm(self.fc1(x))))
        x = nnx.relu(self.fc2(x))
        return self.out(x)


@jax.custom_vjp
def clipped_matmul(x, w):
    """A matmul whose backward clips the incoming cotangent (a custom_vjp op)."""
    return x @ w


def _clipped_fwd(x, w):
    return x @ w, (x, w)


def _clipped_bwd(res, g):
    x, w = res
    g = jnp.clip(g, -1.0, 1.0)
    return g @ w.T, x.T @ g


clipped_matmul.defvjp(_clipped_fwd, _clipped_bwd)


def plain_mlp(params, x):
    """A plain-JAX function: explicit float32 casts, as careful users write."""
    h = jnp.tanh(clipped_matmul(x.astype(jnp.float32), params["w1"].astype(jnp.float32)) + params["b1"])
    logits = jnp.dot(h, params["w2"], preferred_element_type=jnp.float32)
    return jax.nn.log_softmax(logits)

"""A small ResNet with BatchNorm for small images (digits, Fashion-MNIST)."""

import functools
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp


class ResidualBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and an identity (or 1x1) shortcut."""

    features: int
    strides: int = 1
    dtype: Any = None  # every layer's computation dtype, the way Flax examples pass it; None: inputs'/params'

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9, dtype=self.dtype)
        y = nn.Conv(self.features, (3, 3), self.strides, use_bias=False, dtype=self.dtype)(x)
        y = nn.relu(norm()(y))
        y = nn.Conv(self.features, (3, 3), use_bias=False, dtype=self.dtype)(y)
        y = norm(scale_init=nn.initializers.zeros)(y)  # each block starts as the identity
        if x.shape != y.shape:
            x = norm()(nn.Conv(self.features, (1, 1), self.strides, use_bias=False, dtype=self.dtype)(x))
        return nn.relu(x + y)


class ResNet(nn.Module):
    """Stem convolution, stages of residual blocks (width doubling, stride 2 after
    the first stage), global average pooling, a dense classifier."""

    stage_sizes: Sequence[int] = (1, 1, 1)
    width: int = 16
    num_classes: int = 10
    dtype: Any = None  # every layer's computation dtype, the way Flax examples pass it; None: inputs'/params'

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        if x.ndim == 3:  # (batch, height, width): one channel
            x = x[..., None]
        x = nn.Conv(self.width, (3, 3), use_bias=False, dtype=self.dtype)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9, dtype=self.dtype)(x))
        for stage, blocks in enumerate(self.stage_sizes):
            for block in range(blocks):
                strides = 2 if stage > 0 and block == 0 else 1
                x = ResidualBlock(self.width * 2 ** stage, strides, self.dtype)(x, train)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes, dtype=self.dtype)(x)

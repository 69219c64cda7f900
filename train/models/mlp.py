"""A multilayer perceptron for flat or image inputs."""

from typing import Any, Sequence

import flax.linen as nn
import jax


class MLP(nn.Module):
    """Dense layers with ReLU (and LayerNorm) between them; inputs are flattened."""

    hidden: Sequence[int] = (256, 256)
    num_classes: int = 10
    layer_norm: bool = True
    dropout: float = 0.0
    dtype: Any = None  # every layer's computation dtype, the way Flax examples pass it; None: inputs'/params'

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        x = x.reshape((x.shape[0], -1))
        for width in self.hidden:
            x = nn.Dense(width, dtype=self.dtype)(x)
            if self.layer_norm:
                x = nn.LayerNorm(dtype=self.dtype)(x)
            x = nn.relu(x)
            if self.dropout:
                x = nn.Dropout(self.dropout, deterministic=not train)(x)
        return nn.Dense(self.num_classes, dtype=self.dtype)(x)
